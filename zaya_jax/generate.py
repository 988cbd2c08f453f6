# Shape letters: B T V (see zaya_jax/__init__.py); P = prompt length, N = new tokens.
"""Generation with our model: cached incremental decoding (`generate`) and its reference.

`generate` runs one compiled prefill over the prompts, then one compiled decode step per new
token, reusing a functional cache (`zaya_jax.model.transformer.init_cache`: keys/values, the
CCA convolution inputs of the last W0+W1-2 tokens, the previous token's delayed value
projection; the router state passes across layers, not time, and needs no cache). Both
programs are compiled once per (batch, prompt length, max length) and reused across calls.
Supported: a batch of equal-length prompts, one document per row, no padding or attention
mask, no device mesh (the MoE's local dispatch; attention on the XLA path). Sampling is
greedy (temperature 0: argmax, first index on ties) or temperature + top-p (nucleus) from a
seed.

`greedy_generate_recompute` is the slow, obviously-correct baseline that the cached generator
must reproduce and that `transformers` `generate(do_sample=False)` is checked against
(tests/convert/test_generate.py). Every step runs the whole model on a fixed `[B, P + N]`
buffer whose not-yet-generated positions hold `pad_token_id`, and reads the logits at the
last filled position: one compilation for all steps, and correct because the model is causal
(position t sees only tokens <= t). A capacity-limited MoE dispatch (`moe_dispatch=
"all_to_all"` on an expert mesh) breaks causality by dropping tokens over capacity; run this
without a mesh (the default local dispatch drops nothing).
"""

from __future__ import annotations

import functools
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.model import ModelConfig, ZayaForCausalLM
from zaya_jax.model.transformer import init_cache


@nnx.jit
def _next_token(model: ZayaForCausalLM, buf_BT: jax.Array, last: jax.Array) -> jax.Array:
  """int32 `[B]`: argmax of the logits at position `last` (int32 scalar) of `buf_BT`."""
  logits_BTV = model(buf_BT)
  logits_BV = jax.lax.dynamic_index_in_dim(logits_BTV, last, axis=1, keepdims=False)
  return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def greedy_generate_recompute(model: ZayaForCausalLM, input_ids_BP, max_new_tokens: int,
                              eos_token_id: int | None = None,
                              pad_token_id: int | None = None) -> np.ndarray:
  """Greedy continuation of equal-length prompts, recomputing the full sequence each step.

  Same rule as `transformers` `generate(do_sample=False)`: the next token is the argmax of
  the float32 logits (first index on ties); once a row emits `eos_token_id` its later tokens
  are `pad_token_id`, and decoding stops early when every row has finished.

  Args:
    model: our model (`model.cfg.skip_mode="zero"` to match transformers).
    input_ids_BP: int `[B, P]` prompts, all of length P >= 1 (no padding, no attention mask).
    max_new_tokens: N >= 0, tokens to add per row.
    eos_token_id: stop token, or None to always generate N tokens.
    pad_token_id: filler after a row's eos; default `model.cfg.pad_token_id`.
  Returns:
    int64 numpy `[B, P + n]`, the prompts followed by n <= N generated tokens (n < N only
    when every row reached `eos_token_id`).
  Raises:
    ValueError: if `input_ids_BP` is not 2-D with P >= 1, or `max_new_tokens` < 0.
  """
  prompt_BP = np.asarray(input_ids_BP, np.int64)
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"input_ids must be int [B, P] with P >= 1, got shape {prompt_BP.shape}")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
  pad = model.cfg.pad_token_id if pad_token_id is None else pad_token_id
  b, p = prompt_BP.shape
  buf_BT = np.full((b, p + max_new_tokens), pad, np.int32)
  buf_BT[:, :p] = prompt_BP
  done_B = np.zeros(b, bool)
  n = 0
  while n < max_new_tokens and not done_B.all():
    tok_B = np.asarray(_next_token(model, jnp.asarray(buf_BT), jnp.int32(p + n - 1)))
    tok_B = np.where(done_B, pad, tok_B)
    buf_BT[:, p + n] = tok_B
    if eos_token_id is not None:
      done_B |= tok_B == eos_token_id
    n += 1
  return buf_BT[:, :p + n].astype(np.int64)


# --- Cached generation -------------------------------------------------------------------------


def sample_tokens(key: jax.Array, logits_BV: jax.Array, temperature: jax.Array,
                  top_p: jax.Array) -> jax.Array:
  """Next tokens int32 `[B]` from float32 logits `[B, V]`.

  temperature == 0: argmax (first index on ties). Otherwise softmax(logits / temperature)
  restricted to the smallest set of most probable tokens whose probability reaches `top_p`
  (a token is kept when the probability of the tokens ranked above it is < top_p; the most
  probable token is always kept), sampled with `key`, independently per row.

  Args:
    key: a PRNG key.
    logits_BV: float32 `[B, V]`.
    temperature: float [] >= 0 (traced: no recompilation per value).
    top_p: float [] in (0, 1].
  """
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  t = jnp.where(temperature > 0, temperature, 1.0)
  scaled_BV = logits_BV.astype(jnp.float32) / t
  order_BV = jnp.argsort(-scaled_BV, axis=-1, stable=True)  # descending, lower id first on ties
  sorted_BV = jnp.take_along_axis(scaled_BV, order_BV, axis=-1)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = (above_BV < top_p) | (top_p >= 1.0)
  keep_BV = keep_BV.at[:, 0].set(True)
  pick_B = jax.random.categorical(key, jnp.where(keep_BV, sorted_BV, -jnp.inf), axis=-1)
  sampled_B = jnp.take_along_axis(order_BV, pick_B[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature > 0, sampled_B, greedy_B)


def _choose(logits_BV, key, step, temperature, top_p, done_B, eos, pad):
  """Samples the next tokens; rows already done get `pad`; returns (tok_B, done_B)."""
  tok_B = sample_tokens(jax.random.fold_in(key, step), logits_BV, temperature, top_p)
  tok_B = jnp.where(done_B, pad, tok_B)
  return tok_B, done_B | (tok_B == eos)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, prompt_BP, cache, key, temperature, top_p, eos, pad):
  model = nnx.merge(graphdef, state)
  logits_BV, cache = model.prefill(prompt_BP, cache)
  done_B = jnp.zeros(prompt_BP.shape[0], bool)
  tok_B, done_B = _choose(logits_BV, key, 0, temperature, top_p, done_B, eos, pad)
  return tok_B, done_B, cache, logits_BV


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _decode(graphdef, state, tok_B, cache, key, step, temperature, top_p, done_B, eos, pad):
  model = nnx.merge(graphdef, state)
  logits_BV, cache = model.decode_step(tok_B, cache)
  tok_B, done_B = _choose(logits_BV, key, step, temperature, top_p, done_B, eos, pad)
  return tok_B, done_B, cache, logits_BV


class Generation(NamedTuple):
  """What `generate` returns.

  tokens: int64 numpy `[B, P + n]`, prompts then n <= N new tokens (n < N only when every
    row reached eos; after its eos a row holds pad).
  logits: float32 numpy `[B, n, V]`, the logits each new token was chosen from (None unless
    `return_logits`).
  prefill_s: seconds of the prefill and the first new token (compilation included on a
    first call with these shapes).
  first_step_s: seconds of the first decode step (the second new token; compiles on a first
    call), 0 if n < 2.
  decode_s: seconds of the `steady_steps` = max(n - 2, 0) later decode steps.
  """

  tokens: np.ndarray
  logits: np.ndarray | None
  prefill_s: float
  first_step_s: float
  decode_s: float
  steady_steps: int


def memory_limit_bytes() -> int:
  """Bytes the decoding cache may take: the first device's `bytes_limit` where the backend
  reports one (GPU), else the host's physical memory (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_fits(cfg: ModelConfig, batch: int, prompt_len: int, max_new_tokens: int) -> None:
  """Raises ValueError naming max_new_tokens when the cache `[L, B, P + N, K, H]` (shapes from
  `jax.eval_shape`, nothing allocated) and the int64 token buffer `[B, P + N]` exceed
  `memory_limit_bytes()`."""
  if max_new_tokens == 0:
    return
  cache = jax.eval_shape(functools.partial(init_cache, cfg, batch, prompt_len + max_new_tokens))
  need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  need += batch * (prompt_len + max_new_tokens) * 8
  limit = memory_limit_bytes()
  if need > limit:
    per_token = need / (prompt_len + max_new_tokens)
    raise ValueError(
        f"max_new_tokens={max_new_tokens} needs {need / 2**30:,.1f} GiB of decoding cache for "
        f"{batch} row(s) (prompt {prompt_len} tokens) but {jax.devices()[0].platform} has "
        f"{limit / 2**30:,.1f} GiB: at most ~{max(int(limit / per_token) - prompt_len, 0):,} "
        "new tokens fit; lower max_new_tokens or the number of rows")


def generate(model: ZayaForCausalLM, input_ids_BP, max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_token_id: int | None = None, pad_token_id: int | None = None,
             return_logits: bool = False) -> Generation:
  """Continues equal-length prompts with a KV/conv cache: one compiled prefill, then one
  compiled decode step per token.

  Greedy (temperature 0) follows the rule of `greedy_generate_recompute` and `transformers`
  `generate(do_sample=False)`; once a row emits `eos_token_id` its later tokens are
  `pad_token_id`, and decoding stops when every row has finished.

  Args:
    model: our model (no device mesh; `cfg.skip_mode="zero"` to match transformers).
    input_ids_BP: int `[B, P]` prompts, all of length P >= 1 (no padding).
    max_new_tokens: N >= 0.
    temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
    top_p: nucleus mass in (0, 1]; 1 keeps every token.
    seed: sampling seed (the same seed gives the same tokens).
    eos_token_id: stop token, or None to always generate N tokens.
    pad_token_id: filler after a row's eos; default `model.cfg.pad_token_id`.
    return_logits: also return the logits of every step.
  Returns:
    A `Generation`.
  Raises:
    ValueError: naming the argument, for a bad shape, max_new_tokens < 0 or too many to fit
      the decoding cache in memory (`memory_limit_bytes`), temperature < 0 or top_p outside
      (0, 1].
  """
  prompt_BP = np.asarray(input_ids_BP, np.int64)
  if prompt_BP.ndim != 2 or prompt_BP.shape[1] < 1:
    raise ValueError(f"input_ids must be int [B, P] with P >= 1 (equal-length prompts), got "
                     f"shape {prompt_BP.shape}")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
  if not temperature >= 0:
    raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
  if not 0 < top_p <= 1:
    raise ValueError(f"top_p={top_p} must be in (0, 1] (1 = no nucleus filtering)")
  pad = model.cfg.pad_token_id if pad_token_id is None else pad_token_id
  b, p = prompt_BP.shape
  _check_fits(model.cfg, b, p, max_new_tokens)
  out_BT = np.full((b, p + max_new_tokens), pad, np.int64)
  out_BT[:, :p] = prompt_BP
  if max_new_tokens == 0:
    no_logits = np.zeros((b, 0, model.cfg.vocab_size), np.float32) if return_logits else None
    return Generation(out_BT, no_logits, 0.0, 0.0, 0.0, 0)
  graphdef, state = nnx.split(model)
  temp, tp = jnp.float32(temperature), jnp.float32(top_p)
  eos, pad_a = jnp.int32(-1 if eos_token_id is None else eos_token_id), jnp.int32(pad)
  key = jax.random.key(seed)
  cache = init_cache(model.cfg, b, p + max_new_tokens)
  logits = []
  t0 = time.perf_counter()
  tok_B, done_B, cache, logits_BV = _prefill(graphdef, state, jnp.asarray(prompt_BP, jnp.int32), cache,
                                             key, temp, tp, eos, pad_a)
  out_BT[:, p] = np.asarray(tok_B)
  t1 = time.perf_counter()
  if return_logits:
    logits.append(np.asarray(logits_BV))
  n = 1
  t_first = t1
  while n < max_new_tokens and not (eos_token_id is not None and bool(np.asarray(done_B).all())):
    tok_B, done_B, cache, logits_BV = _decode(graphdef, state, tok_B, cache, key, jnp.int32(n), temp,
                                              tp, done_B, eos, pad_a)
    out_BT[:, p + n] = np.asarray(tok_B)
    if return_logits:
      logits.append(np.asarray(logits_BV))
    n += 1
    if n == 2:
      t_first = time.perf_counter()
  t2 = time.perf_counter()
  return Generation(out_BT[:, :p + n], np.stack(logits, axis=1) if return_logits else None,
                    prefill_s=t1 - t0, first_step_s=t_first - t1, decode_s=t2 - t_first,
                    steady_steps=max(n - 2, 0))
