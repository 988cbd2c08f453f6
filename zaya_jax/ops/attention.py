# Shape letters: B T S N K G H (see zaya_jax/__init__.py).
"""CCA's softmax attention: impl "xla" (jnp, the causal block triangle) | "pallas" (flash kernel).

Packed rows carry `segment_ids [B, T]`: 1, 2, ... per document, 0 for padding. A query sees a
key only inside its own document, causally, and (on `hybrid_sliding` layers) within the last
`window` tokens, itself included (HF `sliding_window_overlay`: `kv > q - window`).

- "xla": `causal_block_attention`, queries in blocks, each against only the keys up to its own
  last position (the causal block triangle), about half the FLOPs and memory of
  `dot_product_attention` over the full `[T, S]` square, with a bool `[B, T, S]` mask
  (`attention_mask`). `dot_product_attention` also serves decoding, where queries continue a
  cache. `attention(backward="recompute")` takes `causal_block_attention_recompute` instead:
  the same forward pass with its own backward pass, which saves the output and a float32
  log-sum-exp per query rather than every block's probabilities (FlashAttention-2's backward).
- "pallas": `pallas_kernels.cca_attention.cca_flash_attention`, masking from the segment ids
  (no `[B, T, S]` mask is built), run per batch shard under a mesh.

Under context parallelism (zaya_jax/parallel/context.py) CCA calls
`zaya_jax.ops.zigzag_attention.zigzag_block_attention` instead: one shard's two query chunks
against the gathered keys, flash-style on the causal block triangle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cca_attention import cca_flash_attention
from zaya_jax.ops.sharding import per_batch_shard

IMPLS = ("xla", "pallas")
BACKWARDS = ("autodiff", "recompute")  # of the "xla" impl
_F32_MIN = float(jnp.finfo(jnp.float32).min)


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
  logits_BKGTS = _masked_logits(q_BTKGH, k_BSKH, mask_BTS, scale)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKH.dtype)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BSKH)
  return out_BTKGH.reshape(b, t, n, h)


def _query_blocks(t: int, blocks: int) -> list[tuple[int, int]]:
  """The `(start, end)` query ranges of the block triangle: `ceil(T / blocks)` positions each
  (the last may be shorter), `blocks` clipped to [1, T]; block `[start, end)` reads keys
  `[0, end)`."""
  block = -(-t // max(1, min(blocks, t)))
  return [(start, min(start + block, t)) for start in range(0, t, block)]


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
  outs = [dot_product_attention(q_BTNH[:, start:end], k_BTKH[:, :end], v_BTKH[:, :end],
                                mask_BTS[:, start:end, :end], scale)
          for start, end in _query_blocks(q_BTNH.shape[1], blocks)]
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _masked_logits(q_BTKGH: jax.Array, k_BSKH: jax.Array, mask_BTS: jax.Array,
                   scale: float) -> jax.Array:
  """float32 `[B, K, G, T, S]` logits of queries `[B, T, K, G, H]` against keys `[B, S, K, H]`,
  masked entries (`mask_BTS` false) at the float32 minimum: `dot_product_attention`'s and each
  query block's of `causal_block_attention_recompute`."""
  logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                            preferred_element_type=jnp.float32) * scale
  return jnp.where(mask_BTS[:, None, None], logits_BKGTS, _F32_MIN)


def _recompute_forward(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale, blocks):
  """`(out [B, T, N, H] in q's dtype, log_sum_BKGT float32)`: per query block, the softmax of
  `dot_product_attention`, and per query `log(sum_s exp(logit_s - max_s logit_s))` over the
  block's keys (the log-sum-exp less the row maximum, which the backward pass recomputes)."""
  b, t, n, h = q_BTNH.shape
  kh = k_BTKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, kh, n // kh, h)
  outs, log_sums = [], []
  for start, end in _query_blocks(t, blocks):
    logits_BKGTS = _masked_logits(q_BTKGH[:, start:end], k_BTKH[:, :end],
                                  mask_BTS[:, start:end, :end], scale)
    # A fully masked row has max = MIN and exp(0) = 1 for every key: the uniform softmax of
    # `dot_product_attention` over this block's keys, log_sum = log(end), finite.
    max_BKGT = jnp.max(logits_BKGTS, axis=-1)
    exp_BKGTS = jnp.exp(logits_BKGTS - max_BKGT[..., None])
    sum_BKGT = jnp.sum(exp_BKGTS, axis=-1)
    probs_BKGTS = (exp_BKGTS / sum_BKGT[..., None]).astype(v_BTKH.dtype)
    outs.append(jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v_BTKH[:, :end]))
    log_sums.append(jnp.log(sum_BKGT))
  out_BTKGH = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
  log_sum_BKGT = log_sums[0] if len(log_sums) == 1 else jnp.concatenate(log_sums, axis=-1)
  return out_BTKGH.reshape(b, t, n, h).astype(q_BTNH.dtype), log_sum_BKGT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _recompute_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale, blocks):
  return _recompute_forward(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale, blocks)[0]


def _recompute_attention_fwd(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale, blocks):
  out_BTNH, log_sum_BKGT = _recompute_forward(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale, blocks)
  return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, mask_BTS, out_BTNH, log_sum_BKGT)


def _recompute_attention_bwd(scale, blocks, res, d_out_BTNH):
  """FlashAttention-2 (Dao 2023) Algorithm 2, one query block at a time against all its keys:
  P recomputed from the logits and the saved log-sum, D = rowsum(dO * O), dP = dO V^T,
  dS = P * (dP - D), dQ = dS K scale, dK = dS^T Q scale, dV = P^T dO, dK and dV summed over
  the G query heads of each kv head. Matmul operands in the inputs' dtypes, float32
  accumulation (bfloat16: as FlashAttention-2's P and dS)."""
  q_BTNH, k_BTKH, v_BTKH, mask_BTS, out_BTNH, log_sum_BKGT = res
  b, t, n, h = q_BTNH.shape
  kh = k_BTKH.shape[2]
  q_BTKGH = q_BTNH.reshape(b, t, kh, n // kh, h)
  d_out_BTKGH = d_out_BTNH.reshape(q_BTKGH.shape)
  # D = rowsum(dO * O) = sum_s P dP per query: the softmax's backward term.
  delta_BKGT = jnp.einsum("BTKGH,BTKGH->BKGT", d_out_BTKGH.astype(jnp.float32),
                          out_BTNH.reshape(q_BTKGH.shape).astype(jnp.float32))
  d_qs = []
  d_k_BTKH = jnp.zeros(k_BTKH.shape, jnp.float32)
  d_v_BTKH = jnp.zeros(v_BTKH.shape, jnp.float32)
  for start, end in _query_blocks(t, blocks):
    q_b, k_s, v_s, d_out_b = (q_BTKGH[:, start:end], k_BTKH[:, :end], v_BTKH[:, :end],
                              d_out_BTKGH[:, start:end])
    mask_b = mask_BTS[:, start:end, :end]
    logits_BKGTS = _masked_logits(q_b, k_s, mask_b, scale)
    # The row maximum of the forward pass, recomputed exactly (max is order-free). Subtracted
    # before the log-sum: in a fully masked row, MIN + log S would round to MIN.
    max_BKGT = jnp.max(logits_BKGTS, axis=-1)
    probs_BKGTS = jnp.exp((logits_BKGTS - max_BKGT[..., None])
                          - log_sum_BKGT[..., start:end, None])
    d_v_BTKH = d_v_BTKH.at[:, :end].add(
        jnp.einsum("BKGTS,BTKGH->BSKH", probs_BKGTS.astype(v_BTKH.dtype), d_out_b,
                   preferred_element_type=jnp.float32))
    d_probs_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", d_out_b, v_s,
                               preferred_element_type=jnp.float32)
    d_logits_BKGTS = probs_BKGTS * (d_probs_BKGTS - delta_BKGT[..., start:end, None])
    # Masked logits are constants: no gradient, also in a fully masked row (where P = 1/S).
    d_logits_BKGTS = jnp.where(mask_b[:, None, None], d_logits_BKGTS, 0.0) * scale
    d_qs.append(jnp.einsum("BKGTS,BSKH->BTKGH", d_logits_BKGTS.astype(k_BTKH.dtype), k_s,
                           preferred_element_type=jnp.float32))
    d_k_BTKH = d_k_BTKH.at[:, :end].add(
        jnp.einsum("BKGTS,BTKGH->BSKH", d_logits_BKGTS.astype(q_BTNH.dtype), q_b,
                   preferred_element_type=jnp.float32))
  d_q_BTKGH = d_qs[0] if len(d_qs) == 1 else jnp.concatenate(d_qs, axis=1)
  return (d_q_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype), d_k_BTKH.astype(k_BTKH.dtype),
          d_v_BTKH.astype(v_BTKH.dtype), None)


_recompute_attention.defvjp(_recompute_attention_fwd, _recompute_attention_bwd)


def causal_block_attention_recompute(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                                     mask_BTS: jax.Array, scale: float,
                                     blocks: int = 8) -> jax.Array:
  """`causal_block_attention` with its own backward pass: flash-style over the causal block
  triangle, no saved probabilities.

  The forward pass is `causal_block_attention`'s (the same query blocks, each against keys
  `[0, end)`, float32 logits and softmax); besides its inputs it saves only the output and,
  per query, the float32 log-sum-exp of its block's logits less their row maximum
  (`log_sum_BKGT`, `[B, K, G, T]`). The
  backward pass recomputes each block's logits, their row maximum and so the probabilities,
  and forms dQ, dK, dV as in FlashAttention-2 (Dao 2023), Algorithm 2 (D = rowsum(dO * O),
  dS = P * (dP - D)), one query block at a time; GQA: dK, dV summed over the G query heads of
  each kv head. Autodiff of `causal_block_attention` instead keeps every block's
  `[B, K, G, Tq, S]` float32 probabilities (and their v-dtype copy in bfloat16) for the
  backward pass; here the largest saved tensor is the output, `[B, T, N, H]`.

  The log-sum-exp is kept relative to the row maximum because a fully masked query row
  (every logit at the float32 minimum) has a true log-sum-exp of `MIN + log S`, which rounds
  to MIN; this way such a row gets `dot_product_attention`'s uniform softmax over its block's
  keys (finite, never NaN) in both passes, and no gradient into q or k.

  Values and gradients equal `causal_block_attention`'s up to float summation order
  (tests/model/test_attention_backward.py); in bfloat16 also up to where the roundings fall
  (here D uses the rounded output, P and dS are rounded as matmul operands).

  Args:
    q_BTNH: queries `[B, T, N, H]` (GQA: N % K == 0), float32 or bfloat16.
    k_BTKH, v_BTKH: keys and values `[B, T, K, H]`, same T.
    mask_BTS: bool `[B, T, T]`, causal (`attention_mask`, with or without a window); no
      gradient.
    scale: logit scale (a Python number: static).
    blocks: query blocks (static; clipped to [1, T]).
  Returns:
    `[B, T, N, H]` in q's dtype. Gradients: q, k, v in their dtypes (float32 accumulation).
  """
  return _recompute_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, float(scale), int(blocks))


def attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
              mask_BTS: jax.Array | None, *, scale: float, window: int | None,
              sliding: jax.Array | bool, impl: str = "xla",
              backward: str = "autodiff") -> jax.Array:
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
    backward: one of BACKWARDS, for impl "xla": "autodiff" (`causal_block_attention`, the
      backward pass keeps every block's probabilities) or "recompute"
      (`causal_block_attention_recompute`: saves the output and a float32 log-sum-exp per
      query, recomputes the probabilities). "pallas" has its own backward pass and ignores it.
  Raises:
    ValueError: unknown `impl` or `backward` (names the allowed values).

  Padding query rows (segment id 0) attend to the padding keys before them in both impls
  (finite values, equal in both); they are masked out of every loss.
  """
  if backward not in BACKWARDS:
    raise ValueError(f"attention backward={backward!r}; must be one of {BACKWARDS}")
  if impl == "xla":
    block_attention = (causal_block_attention_recompute if backward == "recompute"
                       else causal_block_attention)
    return block_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale=scale)
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
