# Shape letters: B T V (see zaya_jax/__init__.py); P = prompt length, N = new tokens.
"""Reference greedy decoding with our model, by full recomputation (no KV cache).

`greedy_generate_recompute` is the slow, obviously-correct baseline that a cached generator
must reproduce and that `transformers` `generate(do_sample=False)` is checked against
(tests/convert/test_generate.py). Every step runs the whole model on a fixed `[B, P + N]`
buffer whose not-yet-generated positions hold `pad_token_id`, and reads the logits at the
last filled position: one compilation for all steps, and correct because the model is causal
(position t sees only tokens <= t). A capacity-limited MoE dispatch (`moe_dispatch=
"all_to_all"` on an expert mesh) breaks causality by dropping tokens over capacity; run this
without a mesh (the default local dispatch drops nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.model import ZayaForCausalLM


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
