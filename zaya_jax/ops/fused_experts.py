# Shape letters: M D F E (see zaya_jax/__init__.py); t = rows of one tile.
"""The experts' SwiGLU in one pass over row tiles: the `"fused"` impl of
`zaya_jax.ops.grouped_matmul.swiglu_experts`.

Per tile of one expert's rows (`zaya_jax.ops.row_tiles`), forward:
  a = x Wg[e],  b = x Wu[e],  h = silu(a) * b,  y = h Wd[e]
and a, b are written out for the backward pass (`custom_vjp`), which walks the same tiles once,
recomputes h (elementwise) and forms
  dh = dy Wd[e]^T,  da = dh * b * silu'(a),  db = dh * silu(a),
  dx = da Wg[e]^T + db Wu[e]^T,
  dWg[e] += x^T da,  dWu[e] += x^T db,  dWd[e] += h^T dy     (float32 sums)
The unfused path (three `"looped"` grouped matmuls) walks the tiles six times and saves
a, b and h. Recomputing a and b in the backward instead of saving them (no `[M, F]` residual)
was measured and not kept: configs/bench_cpu.py's step 1.06x slower at 64-row tiles on 2 CPU
cores (2026-12-04), two more expert matmuls per tile.

Same values as `pallas_kernels.gmm.reference.swiglu_grouped` over any grouped matmul, in the
same dtypes: each product returns the inputs' dtype (float32 accumulation for the weight
gradients), so in float32 it equals the `"looped"` path up to summation order.
Inside the expert-parallel `shard_map` the loop carries are marked varying like the
`"looped"` grouped matmul's (`zaya_jax.ops.sharding.varying_like`), and a cotangent of an
input that entered unvarying is summed over the axes the loop made it vary over
(`summed_like`), as autodiff does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zaya_jax.ops.row_tiles import tile_plan, tile_rows, write_rows
from zaya_jax.ops.sharding import summed_like, varying_like


TILE = 64  # rows per tile: configs/bench_cpu.py's step 0.96x at 64 against 128 (2026-12-04, README)


def fused_swiglu_experts(x_MD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                         w_down_EFD: jax.Array, group_sizes_E: jax.Array,
                         tile: int | None = None) -> jax.Array:
  """`(silu(x Wg[e]) * (x Wu[e])) Wd[e]` for the rows of each group `e`, fused per row tile.

  Args:
    x_MD: `[M, D]` rows sorted by expert, cast to the weights' dtype.
    w_gate_EDF, w_up_EDF: `[E, D, F]`; w_down_EFD: `[E, F, D]` (compute dtype).
    group_sizes_E: int32 `[E]`, rows per expert, `sum <= M`; rows past the sum (skipped
      tokens sorted last) give zeros and get zero gradient.
    tile: rows per tile (static, default `TILE`), clipped to `[1, M]`.
  Returns:
    `[M, D]` in the weights' dtype.
  Matches: `pallas_kernels.gmm.reference.swiglu_grouped` (HF `ZayaExperts`).
  """
  x_MD = x_MD.astype(w_gate_EDF.dtype)
  tile = TILE if tile is None else tile
  return _fused(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E,
                max(1, min(tile, x_MD.shape[0])))


def _tile_forward(x_tD, wg_DF, wu_DF, wd_FD):
  """`(a, b, h, y)` of one tile, each product in the inputs' dtype."""
  a_tF, b_tF = x_tD @ wg_DF, x_tD @ wu_DF
  h_tF = jax.nn.silu(a_tF) * b_tF
  return a_tF, b_tF, h_tF, h_tF @ wd_FD


def _forward_loop(x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, tile, save):
  """y `[M, D]`, and with `save` also a = x Wg and b = x Wu `[M, F]` (the backward's residuals)."""
  group_n, lo_n, hi_n, num = tile_plan(group_sizes_E, x_MD.shape[0], tile)
  m, f = x_MD.shape[0], wg_EDF.shape[2]

  def body(i, carry):
    g = group_n[i]
    x_tD, valid_t, start = tile_rows(x_MD, lo_n[i], hi_n[i], tile)
    a_tF, b_tF, _, y_tD = _tile_forward(x_tD, wg_EDF[g], wu_EDF[g], wd_EFD[g])
    if not save:
      return write_rows(carry, y_tD, valid_t, start)
    y_MD, a_MF, b_MF = carry
    return (write_rows(y_MD, y_tD, valid_t, start), write_rows(a_MF, a_tF, valid_t, start),
            write_rows(b_MF, b_tF, valid_t, start))

  init = jnp.zeros(x_MD.shape, wd_EFD.dtype)
  if save:
    init = (init, jnp.zeros((m, f), wg_EDF.dtype), jnp.zeros((m, f), wg_EDF.dtype))
  init = varying_like(init, x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E)
  return jax.lax.fori_loop(0, num, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, tile):
  return _forward_loop(x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, tile, False)


def _fused_fwd(x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, tile):
  y_MD, a_MF, b_MF = _forward_loop(x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, tile, True)
  return y_MD, (x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, a_MF, b_MF)


def _fused_bwd(tile, residuals, dy_MD):
  """dx and the three float32 weight-gradient sums in one loop over the forward's tiles,
  reading the saved a and b (h is recomputed: one elementwise pass)."""
  x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, a_MF, b_MF = residuals
  group_n, lo_n, hi_n, num = tile_plan(group_sizes_E, x_MD.shape[0], tile)
  f32 = jnp.float32

  def body(i, carry):
    dx_MD, dwg_EDF, dwu_EDF, dwd_EFD = carry
    g = group_n[i]
    wg_DF, wu_DF, wd_FD = wg_EDF[g], wu_EDF[g], wd_EFD[g]
    x_tD, valid_t, start = tile_rows(x_MD, lo_n[i], hi_n[i], tile)
    # rows of other groups in the tile get zero cotangent, so they add nothing to dW
    dy_tD = jnp.where(valid_t[:, None], jax.lax.dynamic_slice_in_dim(dy_MD, start, tile), 0)
    dy_tD = dy_tD.astype(wd_FD.dtype)
    a_tF = jax.lax.dynamic_slice_in_dim(a_MF, start, tile)  # rows of other groups: dy is 0
    b_tF = jax.lax.dynamic_slice_in_dim(b_MF, start, tile)
    sig_tF = jax.nn.sigmoid(a_tF)
    silu_tF = a_tF * sig_tF  # jax.nn.silu(a)
    h_tF = silu_tF * b_tF
    dh_tF = jnp.einsum("tD,FD->tF", dy_tD, wd_FD)
    db_tF = dh_tF * silu_tF
    da_tF = dh_tF * b_tF * (sig_tF * (1 + a_tF * (1 - sig_tF)))  # silu'(a)
    dx_tD = jnp.einsum("tF,DF->tD", da_tF, wg_DF) + jnp.einsum("tF,DF->tD", db_tF, wu_DF)
    dx_MD = write_rows(dx_MD, dx_tD, valid_t, start)
    dwg_EDF = dwg_EDF.at[g].add(jnp.einsum("tD,tF->DF", x_tD, da_tF, preferred_element_type=f32))
    dwu_EDF = dwu_EDF.at[g].add(jnp.einsum("tD,tF->DF", x_tD, db_tF, preferred_element_type=f32))
    dwd_EFD = dwd_EFD.at[g].add(jnp.einsum("tF,tD->FD", h_tF, dy_tD, preferred_element_type=f32))
    return dx_MD, dwg_EDF, dwu_EDF, dwd_EFD

  init = (jnp.zeros_like(x_MD), jnp.zeros(wg_EDF.shape, f32), jnp.zeros(wu_EDF.shape, f32),
          jnp.zeros(wd_EFD.shape, f32))
  init = varying_like(init, x_MD, wg_EDF, wu_EDF, wd_EFD, group_sizes_E, dy_MD)
  dx_MD, dwg_EDF, dwu_EDF, dwd_EFD = jax.lax.fori_loop(0, num, body, init)
  grads = [summed_like(dx_MD, x_MD)]
  grads += [summed_like(dw, w).astype(w.dtype)
            for dw, w in ((dwg_EDF, wg_EDF), (dwu_EDF, wu_EDF), (dwd_EFD, wd_EFD))]
  return (*grads, None)


_fused.defvjp(_fused_fwd, _fused_bwd)
