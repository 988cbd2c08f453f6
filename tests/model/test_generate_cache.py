"""Cached incremental decoding (`zaya_jax.generate.generate`) equals full recomputation.

A random tiny model that exercises every piece of per-layer decoding state: CCA convolutions
of widths 3 and 3 (a 4-token conv cache), the delayed values, GQA (4 query / 2 kv heads), a
sliding-window layer whose window (5) is shorter than prompt + continuation (7 + 12), and
attention / LM-head biases; both skip modes (skip-class bias 0, so it wins some tokens). The input embedding scale is shrunk so the
continuation is driven by the layers (otherwise the tied head repeats the current token and
a broken decoder could pass). Checked: the cached greedy tokens equal
`greedy_generate_recompute`'s, the logits of every decode step equal the full forward's at
that position (<= 1e-4, float32), eos handling, and seeded sampling. Parity with
`transformers` generate: tests/convert/test_generate.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import assert_close, random_model
from zaya_jax.generate import generate, greedy_generate_recompute, sample_tokens
from zaya_jax.model import ModelConfig
from zaya_jax.model.transformer import init_cache

PROMPT, NEW = 7, 12
CFG = ModelConfig(vocab_size=101, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=4, moe_intermediate_size=32, router_hidden_size=16,
                  cca_time0=3, cca_time1=3, layer_types=("hybrid", "hybrid_sliding", "hybrid"),
                  sliding_window=5, attention_bias=True, lm_head_bias=True, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)


full_forward = nnx.jit(lambda m, ids: m(ids))
forward_with_cache = nnx.jit(lambda m, ids, cache: m.forward_with_cache(ids, cache))


@pytest.fixture(scope="module", params=["zero", "scaled_identity"])
def model(request):
  m = random_model(CFG.replace(skip_mode=request.param), seed=3)
  m.input_hidden_states_scale[...] = m.input_hidden_states_scale[...] * 0.05
  bias = m.layers.mlp.router.balancing_biases
  bias[...] = jnp.zeros_like(bias[...])  # the skip class wins some tokens: skip modes differ
  return m


@pytest.fixture(scope="module")
def prompt():
  return np.random.default_rng(4).integers(3, CFG.vocab_size, (2, PROMPT))


@pytest.mark.slow
def test_cached_greedy_equals_recompute_and_full_forward(model, prompt):
  got = generate(model, prompt, NEW, return_logits=True)
  assert got.tokens.shape == (2, PROMPT + NEW) and got.logits.shape == (2, NEW, CFG.vocab_size)
  for row in got.tokens[:, PROMPT:]:  # not degenerate
    assert len(set(row.tolist())) >= NEW // 3, got.tokens
  # Step i's logits (the prefill's for i = 0) = the full forward's at position P - 1 + i.
  full_BTV = np.asarray(full_forward(model, jnp.asarray(got.tokens[:, :-1], jnp.int32)))
  assert_close("cached vs full-forward logits", got.logits, full_BTV[:, PROMPT - 1:], atol=1e-4, rtol=0)
  np.testing.assert_array_equal(got.tokens[:, PROMPT:], np.argmax(full_BTV[:, PROMPT - 1:], -1))
  if model.cfg.skip_mode == "zero":  # the recompute reference (one more compile: one mode)
    np.testing.assert_array_equal(got.tokens, greedy_generate_recompute(model, prompt, NEW))


@pytest.mark.slow
def test_prefill_logits_and_decode_from_mid_sequence(model, prompt):
  """`forward_with_cache` on all prompt positions, then a 3-token chunk after the cache."""
  if model.cfg.skip_mode != "zero":
    pytest.skip("one skip mode suffices")
  ids = jnp.asarray(np.concatenate([prompt, prompt[:, :3]], axis=1), jnp.int32)
  full_BTV = np.asarray(full_forward(model, ids))
  logits_BPV, cache = forward_with_cache(model, ids[:, :PROMPT], init_cache(model.cfg, 2, 16))
  assert int(cache["length"]) == PROMPT
  logits_B3V, cache = forward_with_cache(model, ids[:, PROMPT:], cache)
  assert_close("prefill logits", logits_BPV, full_BTV[:, :PROMPT], atol=1e-4, rtol=0)
  assert_close("chunk logits", logits_B3V, full_BTV[:, PROMPT:], atol=1e-4, rtol=0)
  over, _ = forward_with_cache(model, ids[:, :7], cache)  # 10 + 7 > 16 cached positions
  assert np.isnan(np.asarray(over)).all()


def test_eos_stops_rows_like_recompute(model, prompt):
  if model.cfg.skip_mode != "zero":
    pytest.skip("one skip mode suffices")
  free = generate(model, prompt, NEW).tokens[:, PROMPT:]
  eos = int(free[0, 3])
  assert eos not in free[0, :3]
  got = generate(model, prompt, NEW, eos_token_id=eos, pad_token_id=0).tokens
  want = greedy_generate_recompute(model, prompt, NEW, eos_token_id=eos, pad_token_id=0)
  np.testing.assert_array_equal(got, want)
  assert (got[0, PROMPT + 4:] == 0).all()


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(model, prompt):
  if model.cfg.skip_mode != "zero":
    pytest.skip("one skip mode suffices")
  a = generate(model, prompt, NEW, temperature=1.0, seed=3).tokens
  b = generate(model, prompt, NEW, temperature=1.0, seed=3).tokens
  c = generate(model, prompt, NEW, temperature=1.0, seed=4).tokens
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  greedy = generate(model, prompt, NEW).tokens
  assert (a != greedy).any()
  np.testing.assert_array_equal(generate(model, prompt, NEW, temperature=1.0, top_p=1e-6, seed=3).tokens,
                                greedy)


def test_sample_tokens_nucleus():
  """probs (0.5, 0.3, 0.2): top_p=0.6 keeps ids 0 and 1 (0.5 < 0.6 before id 1), never id 2."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
  toks = np.asarray(jax.jit(sample_tokens)(jax.random.key(0), jnp.tile(logits, (400, 1)),
                                            jnp.float32(1.0), jnp.float32(0.6)))
  assert set(toks.tolist()) == {0, 1}
  assert abs((toks == 0).mean() - 0.625) < 0.08  # renormalised 0.5 / 0.8
  greedy = jax.jit(sample_tokens)(jax.random.key(0), jnp.asarray([[1.0, 3.0, 3.0]]), jnp.float32(0),
                                  jnp.float32(1))
  assert int(greedy[0]) == 1  # first index on ties


def test_generate_rejects_bad_arguments(model, prompt):
  if model.cfg.skip_mode != "zero":
    pytest.skip("one skip mode suffices")
  with pytest.raises(ValueError, match="input_ids must be int"):
    generate(model, prompt[0], 2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, prompt, -1)
  with pytest.raises(ValueError, match="temperature"):
    generate(model, prompt, 2, temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    generate(model, prompt, 2, temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="max_len"):
    init_cache(model.cfg, 2, 0)
  assert generate(model, prompt, 0).tokens.shape == (2, PROMPT)
