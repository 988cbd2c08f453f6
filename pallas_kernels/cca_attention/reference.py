"""Pure-jnp definition of CCA's attention: the XLA path of `zaya_jax.model.attention`."""

from __future__ import annotations

import jax

from zaya_jax.model.attention import attention_mask, dot_product_attention


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
    `[B, T, N, H]` in q's dtype; logits and softmax in float32.
  """
  return dot_product_attention(q_BTNH, k_BTKH, v_BTKH, attention_mask(segment_ids_BT, window),
                               scale)
