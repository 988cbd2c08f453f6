# Shape letters: B T S N K G H (see zaya_jax/__init__.py).
"""CCA's softmax attention: impl "xla" (jnp, the causal block triangle) | "pallas" (flash kernel).

Packed rows carry `segment_ids [B, T]`: 1, 2, ... per document, 0 for padding. A query sees a
key only inside its own document, causally, and (on `hybrid_sliding` layers) within the last
`window` tokens, itself included (HF `sliding_window_overlay`: `kv > q - window`).

- "xla": `causal_block_attention`, queries in blocks, each against only the keys up to its own
  last position (the causal block triangle), about half the FLOPs and memory of
  `dot_product_attention` over the full `[T, S]` square, with a bool `[B, T, S]` mask
  (`attention_mask`). `dot_product_attention` also serves decoding, where queries continue a
  cache.
- "pallas": `pallas_kernels.cca_attention.cca_flash_attention`, masking from the segment ids
  (no `[B, T, S]` mask is built), run per batch shard under a mesh.

Under context parallelism (zaya_jax/parallel/context.py) CCA calls
`zaya_jax.ops.zigzag_attention.zigzag_block_attention` instead: one shard's two query chunks
against the gathered keys, flash-style on the causal block triangle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cca_attention import cca_flash_attention
from zaya_jax.ops.sharding import per_batch_shard

IMPLS = ("xla", "pallas")


def attention_mask(segment_ids_BT: jax.Array, window: int | None = None) -> jax.Array:
  """bool `[B, T, S]` (S = T): causal, same document, and `q - kv < window` when a window is given."""
  q = jnp.arange(segment_ids_BT.shape[1])[:, None]
  kv = jnp.arange(segment_ids_BT.shape[1])[None, :]
  allowed = kv <= q
  if window is not None:
    allowed &= kv > q - window
  same_doc = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return allowed[None] & same_doc


def dot_product_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                          mask_BTS: jax.Array, scale: float) -> jax.Array:
  """Softmax attention with grouped kv heads: query head n reads kv head n // G.

  Logits and softmax in float32 (masked entries get the float32 minimum, so a fully masked
  padding query yields finite garbage, never NaN). Returns `[B, T, N, H]` in q's dtype.
  Matches: HF `eager_attention_forward` with `repeat_kv`.
  """
  b, t, n, h = q_BTNH.shape
  k = k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, k, n // k, h)
  logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                            preferred_element_type=jnp.float32) * scale
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h)


def causal_block_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                           mask_BTS: jax.Array, scale: float, blocks: int = 8) -> jax.Array:
  """`dot_product_attention` for a causal `mask_BTS` (S = T, no key after its query allowed),
  computed on the block triangle only: the queries in `blocks` blocks of `ceil(T / blocks)`
  positions, query block `[i, i + block)` reading keys `[0, i + block)`.

  Keys a block skips are masked for all its queries, and every query sees at least itself
  (both XLA masks allow `kv == q`), so the softmax over the kept keys equals the one over all:
  the same values up to float summation order, with `(blocks + 1) / (2 blocks)` of the FLOPs
  and saved probabilities of the full square (8 blocks: 56%). The blocks are unrolled, so
  their number, not T, sets the program size.

  Args:
    q_BTNH, k_BTKH, v_BTKH: queries, keys, values (GQA: N % K == 0), same T.
    mask_BTS: bool, causal (`attention_mask`, with or without a window).
    scale: logit scale.
    blocks: query blocks (static; at most T).
  Returns:
    `[B, T, N, H]` in q's dtype.
  """
  t = q_BTNH.shape[1]
  block = -(-t // max(1, min(blocks, t)))
  outs = []
  for start in range(0, t, block):
    end = min(start + block, t)
    outs.append(dot_product_attention(q_BTNH[:, start:end], k_BTKH[:, :end], v_BTKH[:, :end],
                                      mask_BTS[:, start:end, :end], scale))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
              mask_BTS: jax.Array | None, *, scale: float, window: int | None,
              sliding: jax.Array | bool, impl: str = "xla") -> jax.Array:
  """CCA's softmax attention, `[B, T, N, H]` in q's dtype.

  Args:
    q_BTNH, k_BTKH, v_BTKH: queries (after QK-norm and RoPE), keys, values (GQA: N % K == 0).
    segment_ids_BT: int32 document ids, 0 = padding.
    mask_BTS: "xla": the bool causal mask of this layer (`attention_mask`, with the window on
      sliding layers); "pallas": unused (None: the kernel masks from the segment ids).
    scale: logit scale (head_dim ** -0.5).
    window: tokens a sliding layer's query sees, or None when the model has no sliding layers.
    sliding: bool [] (may be traced, e.g. a per-layer flag inside `nnx.scan`): this layer
      attends within `window` tokens.
    impl: one of IMPLS.
  Raises:
    ValueError: unknown `impl` (names the allowed values).

  Padding query rows (segment id 0) attend to the padding keys before them in both impls
  (finite values, equal in both); they are masked out of every loss.
  """
  if impl == "xla":
    return causal_block_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale=scale)
  if impl != "pallas":
    raise ValueError(f"attention impl={impl!r}; must be one of {IMPLS}")

  def run(win, q, k, v, seg):
    return per_batch_shard(lambda *a: cca_flash_attention(*a, scale=scale, window=win), q, k, v, seg)

  args = (q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
  if window is None:
    return run(None, *args)
  if isinstance(sliding, bool):
    return run(window if sliding else None, *args)
  # A per-layer flag traced inside nnx.scan: both kernels are compiled, one runs.
  return jax.lax.cond(sliding, lambda: run(window, *args), lambda: run(None, *args))
