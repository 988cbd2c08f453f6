"""Pallas (Triton lowering) kernels of CCA's document-masked GQA flash attention.

Three `pallas_call`s, FlashAttention-2 style, on inputs already padded by `ops.py` (sequence
`Tp` a multiple of every block, head_dim `Hp` a power of 2):

- `attention_forward`: one program per (q block, batch, query head); online softmax over the
  kv blocks the q block can see, float32 accumulators. Returns the output and the natural
  log-sum-exp `lse [B, N, Tp]` of each row's visible logits.
- `attention_backward_dq`: one program per (q block, batch, query head); recomputes the
  probabilities from `lse` and accumulates `dq` over the same kv blocks.
- `attention_backward_dkv`: one program per (kv block, batch, kv head); accumulates `dk`, `dv`
  over the `G = N / K` query heads of its group and the q blocks that can see the kv block.

Masking (the same rule as `reference.visible_mask`): query t sees key s iff
`seg[s] == seg[t]` (0 = padding is compared like any other id), `s <= t`, and, with a window,
`s > t - window`. Kv blocks (q blocks in `dkv`) wholly outside the causal/window band are
skipped by the loop bounds; segments are masked element-wise only. Exponentials are base 2
with `log2(e)` folded into the logit scale.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import out_struct

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: max(masked) - max(masked) = 0


def _visible(q_pos, kv_pos, q_seg, kv_seg, window: int | None) -> jax.Array:
  """bool `[bq, bkv]`: same segment, causal, and inside the window when one is given."""
  mask = (q_seg[:, None] == kv_seg[None, :]) & (kv_pos[None, :] <= q_pos[:, None])
  if window is not None:
    mask &= kv_pos[None, :] > q_pos[:, None] - window
  return mask


def _kv_block_range(q_start, block_q: int, block_kv: int, window: int | None):
  """Kv blocks `[lo, hi)` holding any key that a query in `[q_start, q_start + block_q)` may see."""
  hi = lax.div(q_start + block_q + block_kv - 1, block_kv)
  if window is None:
    return 0, hi
  return lax.div(jnp.maximum(q_start - window + 1, 0), block_kv), hi


def _q_block_range(kv_start, num_q_blocks: int, block_q: int, block_kv: int,
                   window: int | None):
  """Q blocks `[lo, hi)` holding any query that may see a key in `[kv_start, kv_start + bkv)`."""
  lo = lax.div(kv_start, block_q)
  if window is None:
    return lo, num_q_blocks
  last_q = kv_start + block_kv - 1 + window - 1
  return lo, jnp.minimum(lax.div(last_q, block_q) + 1, num_q_blocks)


def _forward_kernel(q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref, *, scale: float,
                    window: int | None, block_q: int, block_kv: int):
  """Refs: q, o `[bq, Hp]`; k, v `[Tp, Hp]` (this head's kv head); seg `[Tp]`; lse `[bq]`."""
  q_start = pl.program_id(0) * block_q
  q_pos = q_start + jnp.arange(block_q)
  q = q_ref[...]
  q_seg = seg_ref[pl.ds(q_start, block_q)]
  hp = q.shape[-1]

  def body(j, carry):
    acc, m_prev, l_prev = carry
    kv_start = j * block_kv
    kv_slice = pl.ds(kv_start, block_kv)
    k = k_ref[kv_slice, :]
    s = pltriton.dot(q, k, trans_b=True) * (scale * LOG2E)  # [bq, bkv] float32, log2 units
    mask = _visible(q_pos, kv_start + jnp.arange(block_kv), q_seg, seg_ref[kv_slice], window)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)
    correction = jnp.exp2(m_prev - m_next)
    v = v_ref[kv_slice, :]
    acc = acc * correction[:, None] + pltriton.dot(p.astype(v.dtype), v)
    return acc, m_next, l_prev * correction + jnp.sum(p, axis=1)

  lo, hi = _kv_block_range(q_start, block_q, block_kv, window)
  init = (jnp.zeros((block_q, hp), jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = lax.fori_loop(lo, hi, body, init)
  seen = l > 0.0  # False only for a row with no visible key (cannot happen: s = t is visible)
  l_safe = jnp.where(seen, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, 0.0)


def _grid_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def attention_forward(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, *, scale: float,
                      window: int | None, block_q: int, block_kv: int, num_warps: int,
                      num_stages: int, interpret: bool):
  """Flash attention forward on padded inputs.

  Args:
    q_BTNH: `[B, Tp, N, Hp]` queries; k_BTKH, v_BTKH: `[B, Tp, K, Hp]`, same dtype.
    segment_ids_BT: int32 `[B, Tp]`.
    scale: logit scale. window: sliding window or None. block_q, block_kv: powers of 2
      dividing Tp. num_warps, num_stages: Triton compiler params. interpret: Pallas interpret.

  Returns:
    (out `[B, Tp, N, Hp]` in q's dtype, lse float32 `[B, N, Tp]`, natural log).
  """
  b, t, n, hp = q_BTNH.shape
  g = n // k_BTKH.shape[2]
  kernel = functools.partial(_forward_kernel, scale=scale, window=window, block_q=block_q,
                             block_kv=block_kv)
  q_spec = pl.BlockSpec((None, block_q, None, hp), lambda i, bi, ni: (bi, i, ni, 0))
  kv_spec = pl.BlockSpec((None, t, None, hp), lambda i, bi, ni: (bi, 0, ni // g, 0))
  return pl.pallas_call(
      kernel,
      grid=(t // block_q, b, n),
      in_specs=[q_spec, kv_spec, kv_spec, pl.BlockSpec((None, t), lambda i, bi, ni: (bi, 0))],
      out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda i, bi, ni: (bi, ni, i))],
      out_shape=[out_struct(q_BTNH.shape, q_BTNH.dtype, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT),
                 out_struct((b, n, t), jnp.float32, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)],
      compiler_params=_grid_params(num_warps, num_stages),
      interpret=interpret,
      name="cca_attention_fwd",
  )(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               scale: float, window: int | None, block_q: int, block_kv: int):
  """Refs: q, do, dq `[bq, Hp]`; k, v `[Tp, Hp]`; seg `[Tp]`; lse, delta `[bq]`."""
  q_start = pl.program_id(0) * block_q
  q_pos = q_start + jnp.arange(block_q)
  q, do = q_ref[...], do_ref[...]
  q_seg = seg_ref[pl.ds(q_start, block_q)]
  lse2 = lse_ref[...] * LOG2E
  delta = delta_ref[...]

  def body(j, dq):
    kv_start = j * block_kv
    kv_slice = pl.ds(kv_start, block_kv)
    k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]
    s = pltriton.dot(q, k, trans_b=True) * (scale * LOG2E)
    mask = _visible(q_pos, kv_start + jnp.arange(block_kv), q_seg, seg_ref[kv_slice], window)
    p = jnp.where(mask, jnp.exp2(s - lse2[:, None]), 0.0)
    dp = pltriton.dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + pltriton.dot(ds.astype(k.dtype), k)

  lo, hi = _kv_block_range(q_start, block_q, block_kv, window)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale: float, window: int | None, block_q: int, block_kv: int):
  """Refs: q, do `[Tp, G, Hp]`; k, v, dk, dv `[bkv, Hp]`; seg `[Tp]`; lse, delta `[G, Tp]`."""
  kv_start = pl.program_id(0) * block_kv
  kv_pos = kv_start + jnp.arange(block_kv)
  k, v = k_ref[...], v_ref[...]
  kv_seg = seg_ref[pl.ds(kv_start, block_kv)]
  t, g, hp = q_ref.shape
  lo, hi = _q_block_range(kv_start, t // block_q, block_q, block_kv, window)

  def head(gi, carry):
    def body(i, carry):
      dk, dv = carry
      q_start = i * block_q
      q_slice = pl.ds(q_start, block_q)
      q, do = q_ref[q_slice, gi, :], do_ref[q_slice, gi, :]
      s = pltriton.dot(q, k, trans_b=True) * (scale * LOG2E)
      mask = _visible(q_start + jnp.arange(block_q), kv_pos, seg_ref[q_slice], kv_seg, window)
      p = jnp.where(mask, jnp.exp2(s - lse_ref[gi, q_slice][:, None] * LOG2E), 0.0)
      dv = dv + pltriton.dot(p.astype(do.dtype), do, trans_a=True)
      dp = pltriton.dot(do, v, trans_b=True)
      ds = p * (dp - delta_ref[gi, q_slice][:, None])
      return dk + pltriton.dot(ds.astype(q.dtype), q, trans_a=True), dv

    return lax.fori_loop(lo, hi, body, carry)

  zeros = jnp.zeros((block_kv, hp), jnp.float32)
  dk, dv = lax.fori_loop(0, g, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def attention_backward(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, out_BTNH, lse_BNT, dout_BTNH, *,
                       scale: float, window: int | None, block_q: int, block_kv: int,
                       num_warps: int, num_stages: int, interpret: bool):
  """Flash attention backward on padded inputs (shapes as in `attention_forward`).

  `delta = rowsum(dout * out)` (float32 `[B, N, Tp]`) is computed here with XLA, then the dq
  and dk/dv kernels run. Returns `(dq [B, Tp, N, Hp], dk, dv [B, Tp, K, Hp])` in the input dtypes.
  """
  b, t, n, hp = q_BTNH.shape
  kh = k_BTKH.shape[2]
  g = n // kh
  delta_BNT = jnp.einsum("BTNH,BTNH->BNT", dout_BTNH.astype(jnp.float32),
                         out_BTNH.astype(jnp.float32))
  params = dict(scale=scale, window=window, block_q=block_q, block_kv=block_kv)
  seg_spec = pl.BlockSpec((None, t), lambda i, bi, hi: (bi, 0))

  q_spec = pl.BlockSpec((None, block_q, None, hp), lambda i, bi, ni: (bi, i, ni, 0))
  kv_spec = pl.BlockSpec((None, t, None, hp), lambda i, bi, ni: (bi, 0, ni // g, 0))
  row_spec = pl.BlockSpec((None, None, block_q), lambda i, bi, ni: (bi, ni, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **params),
      grid=(t // block_q, b, n),
      in_specs=[q_spec, kv_spec, kv_spec, seg_spec, q_spec, row_spec, row_spec],
      out_specs=q_spec,
      out_shape=out_struct(q_BTNH.shape, q_BTNH.dtype, q_BTNH, k_BTKH, v_BTKH, dout_BTNH),
      compiler_params=_grid_params(num_warps, num_stages),
      interpret=interpret,
      name="cca_attention_bwd_dq",
  )(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, dout_BTNH, lse_BNT, delta_BNT)

  group_spec = pl.BlockSpec((None, t, g, hp), lambda j, bi, ki: (bi, 0, ki, 0))
  kv_block_spec = pl.BlockSpec((None, block_kv, None, hp), lambda j, bi, ki: (bi, j, ki, 0))
  group_row_spec = pl.BlockSpec((None, g, t), lambda j, bi, ki: (bi, ki, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, **params),
      grid=(t // block_kv, b, kh),
      in_specs=[group_spec, kv_block_spec, kv_block_spec, seg_spec, group_spec, group_row_spec,
                group_row_spec],
      out_specs=[kv_block_spec, kv_block_spec],
      out_shape=[out_struct(k_BTKH.shape, k_BTKH.dtype, q_BTNH, k_BTKH, v_BTKH, dout_BTNH),
                 out_struct(v_BTKH.shape, v_BTKH.dtype, q_BTNH, k_BTKH, v_BTKH, dout_BTNH)],
      compiler_params=_grid_params(num_warps, num_stages),
      interpret=interpret,
      name="cca_attention_bwd_dkv",
  )(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, dout_BTNH, lse_BNT, delta_BNT)
  return dq, dk, dv
