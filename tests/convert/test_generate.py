"""Greedy decoding with our model equals `transformers` `generate(do_sample=False)`.

Same weights on both sides: a random `transformers.ZayaForCausalLM` (every tensor randomised,
balancing biases set so that experts and the skip class all win some tokens), saved and
loaded with `zaya_jax.hf.load_pretrained` (skip_mode "zero", as transformers). The input
embedding scale is shrunk so the continuation is driven by the layers: with the randomised
scale ~1 the tied head mostly predicts the current token again and every row degenerates
into one repeated token, which would let a broken decoder pass. transformers' cached
`generate` (its Zaya cache with CCA conv states) and its `use_cache=False` path are both
compared.
"""

import jax
import numpy as np
import pytest
import torch
from transformers import ZayaForCausalLM

from tests.model import hf_reference
from zaya_jax import generate as generation
from zaya_jax.generate import generate, greedy_generate_recompute
from zaya_jax.hf import load_pretrained
from zaya_jax.model.transformer import init_cache

PROMPT = 8  # tokens
NEW = 12  # tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """(hf_model, our model, prompt_BP torch.long) on the same random weights."""
  cfg = hf_reference.hf_config(attention_bias=True, lm_head_bias=True, sliding_window=6,
                               layer_types=["hybrid", "hybrid_sliding", "hybrid"])
  cfg._attn_implementation = "eager"
  torch.manual_seed(5)
  hf = ZayaForCausalLM(cfg).eval()
  hf_reference.randomise(hf, seed=5)
  with torch.no_grad():
    hf.model.input_hidden_states_scale.mul_(0.03)
  ids = torch.randint(3, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(6))
  hf_reference.balance_biases(hf, ids, seed=5)
  path = tmp_path_factory.mktemp("hf_gen")
  hf.save_pretrained(path)  # in-memory hf keeps its biases (only from_pretrained resets them)
  return hf, load_pretrained(str(path)), ids[:, :PROMPT]


def hf_generate(hf, prompt, use_cache, **kw):
  with torch.no_grad():
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=NEW, use_cache=use_cache, **kw).numpy()


@pytest.mark.slow
def test_greedy_matches_transformers_generate(models):
  hf, ours, prompt = models
  got = greedy_generate_recompute(ours, prompt.numpy(), NEW, eos_token_id=None)
  assert got.shape == (2, PROMPT + NEW)
  np.testing.assert_array_equal(got[:, :PROMPT], prompt.numpy())
  for row in got[:, PROMPT:]:  # not degenerate: a wrong decoder could not match by luck
    assert len(set(row.tolist())) >= NEW // 2, got
  # The generated sequences exercise every router class (skip included) in every layer.
  picks_LM = hf_reference.chosen_classes(hf, torch.from_numpy(got))
  for li, p in enumerate(picks_LM):
    assert (np.bincount(p, minlength=hf.config.num_experts + 1) > 0).all(), (li, p)
  cached = hf_generate(hf, prompt, use_cache=True, eos_token_id=None)
  recomputed = hf_generate(hf, prompt, use_cache=False, eos_token_id=None)
  np.testing.assert_array_equal(recomputed, cached)
  np.testing.assert_array_equal(got, cached)


def test_greedy_stops_at_eos_like_transformers(models):
  """A row that emits eos is padded afterwards; decoding stops once all rows finished."""
  hf, ours, prompt = models
  free = greedy_generate_recompute(ours, prompt.numpy(), NEW)[:, PROMPT:]
  # eos := row 0's 4th new token (first seen there), so row 0 finishes early; row 1 may too.
  eos = int(free[0, 3])
  assert eos not in free[0, :3]
  got = greedy_generate_recompute(ours, prompt.numpy(), NEW, eos_token_id=eos, pad_token_id=0)
  want = hf_generate(hf, prompt, use_cache=True, eos_token_id=eos, pad_token_id=0)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[0, PROMPT:PROMPT + 4], free[0, :4])
  assert (got[0, PROMPT + 4:] == 0).all()
  if eos in free[1]:  # both finished: generation stops at the later eos
    assert got.shape[1] == PROMPT + 1 + max(3, int(np.argmax(free[1] == eos)))
  else:
    assert got.shape[1] == PROMPT + NEW
    np.testing.assert_array_equal(got[1, PROMPT:], free[1])


def test_greedy_rejects_bad_input(models):
  _, ours, prompt = models
  with pytest.raises(ValueError, match="input_ids must be int"):
    greedy_generate_recompute(ours, prompt.numpy()[0], 2)
  with pytest.raises(ValueError, match="max_new_tokens"):
    greedy_generate_recompute(ours, prompt.numpy(), -1)


def test_generate_refuses_a_cache_over_memory(models, monkeypatch):
  """A max_new_tokens whose cache cannot fit is one ValueError before anything is allocated
  (it was a 7 TiB allocation traceback), and the bound is the cache's real size."""
  _, ours, prompt = models
  prompt_BP = prompt.numpy()
  with pytest.raises(ValueError, match=r"max_new_tokens=1000000000000 needs [\d,.]+ GiB .* "
                     r"lower max_new_tokens or the number of rows"):
    generate(ours, prompt_BP, 10**12)
  b, p = prompt_BP.shape
  cache = init_cache(ours.cfg, b, p + NEW)  # what generate(..., NEW) allocates
  need = sum(x.nbytes for x in jax.tree.leaves(cache)) + b * (p + NEW) * 8
  monkeypatch.setattr(generation, "memory_limit_bytes", lambda: need)
  generation._check_fits(ours.cfg, b, p, NEW)  # exactly fits
  with pytest.raises(ValueError, match=f"max_new_tokens={NEW + 1} needs"):
    generation._check_fits(ours.cfg, b, p, NEW + 1)


@pytest.mark.slow
def test_cached_generate_matches_transformers_generate(models):
  """`zaya_jax.generate.generate` (KV/conv/delayed-value cache) = transformers' cached generate."""
  hf, ours, prompt = models
  got = generate(ours, prompt.numpy(), NEW).tokens
  np.testing.assert_array_equal(got, hf_generate(hf, prompt, use_cache=True, eos_token_id=None))
  free = got[:, PROMPT:]
  eos = int(free[0, 3])
  if eos not in free[0, :3]:
    got = generate(ours, prompt.numpy(), NEW, eos_token_id=eos, pad_token_id=0).tokens
    np.testing.assert_array_equal(got, hf_generate(hf, prompt, use_cache=True, eos_token_id=eos,
                                                   pad_token_id=0))
