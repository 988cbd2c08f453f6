# Shape letters: B T S N K G H (see zaya_jax/__init__.py).
"""Pure-jnp definition of CCA's attention: dense, with a materialised `[B, T, S]` mask.

The same rule as the kernel: query t sees key s iff `s <= t`, both in the same segment, and
(with a window) `s > t - window`. `zaya_jax.ops.attention`'s "xla" impl computes the same
values on the causal block triangle only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_mask(segment_ids_BT: jax.Array, window: int | None = None) -> jax.Array:
  """bool `[B, T, S]` (S = T): causal, same segment, and `t - s < window` when a window is given."""
  t = segment_ids_BT.shape[1]
  q_T1, kv_1S = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  allowed_TS = kv_1S <= q_T1
  if window is not None:
    allowed_TS &= kv_1S > q_T1 - window
  return allowed_TS[None] & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])


def attention_reference(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                        segment_ids_BT: jax.Array, *, scale: float,
                        window: int | None = None) -> jax.Array:
  """Document-masked causal GQA softmax attention with a materialised `[B, T, T]` mask.

  Args:
    q_BTNH: `[B, T, N, H]` queries. k_BTKH, v_BTKH: `[B, T, K, H]`, N a multiple of K; query
      head n reads kv head `n // (N / K)`.
    segment_ids_BT: int32 `[B, T]`, 1, 2, ... per document, 0 = padding (padding tokens see
      the earlier padding tokens of their row, like any other segment).
    scale: logit scale (CCA: `head_dim ** -0.5`).
    window: keys with `kv > q - window` only (sliding layers), or None.

  Returns:
    `[B, T, N, H]` in q's dtype; logits and softmax in float32 (masked logits get the float32
    minimum, so a fully masked row gives finite values, never NaN).
  """
  b, t, n, h = q_BTNH.shape
  k = k_BTKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BTKH,
                            preferred_element_type=jnp.float32) * scale
  mask_BTS = visible_mask(segment_ids_BT, window)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BTKH.dtype)
  return jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BTKH).reshape(b, t, n, h)
