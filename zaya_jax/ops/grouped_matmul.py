# Shape letters: M D F E (see zaya_jax/__init__.py); P = padded rows, n = row tiles, t = rows of one tile.
"""The experts' grouped matmul on rows sorted by expert, one impl string per call.

- `"ragged_dot"`: `jax.lax.ragged_dot`, the XLA grouped GEMM (GPU production path);
- `"tiled"`: rows of each group are padded to a multiple of `tile` rows and multiplied tile by
  tile with that tile's expert weight (one batched matmul). Same values; on XLA:CPU faster
  than `ragged_dot`, whose CPU lowering costs as much as a dense all-experts product, but the
  static tile count `M / tile + E` computes about twice the needed rows, and the gathered
  per-tile weights `[n, D, F]` are saved for the backward pass;
- `"looped"`: a loop over only the tiles the group sizes need (each group's rows in blocks of
  `tile`, read and written in place, the expert's weight sliced, nothing gathered), with a
  `custom_vjp` whose backward pass forms dx and dw in one loop of the same tiles. Same values.
  Inside the expert-parallel `shard_map` the loops' initial carries are marked varying over
  the axes their inputs vary over (`zaya_jax.ops.sharding.varying_like`), as the varying-axes
  check requires;
- `"fused"`: for the experts' SwiGLU (`swiglu_experts`), gate/up, SwiGLU and down in one
  pass over the `"looped"` tiles with one `custom_vjp` (`zaya_jax.ops.fused_experts`: saves
  the gate and up products, not h); a single grouped matmul with this impl is the `"looped"` one;
- `"pallas"`: `pallas_kernels.gmm.gmm` (Triton lowering; interpret mode on CPU);
- `"auto"`: on CPU `"fused"` for the experts' SwiGLU (configs/bench_cpu.py, 2026-12-04, best
  of 2 in one process: 0.95-0.98x the step time of `"looped"`) and `"looped"` for a single
  grouped matmul (0.92x `"tiled"` on bench_cpu, 0.65x on zaya1_tiny with expert parallelism
  (2,1,4) on 8 fake devices); `"ragged_dot"` elsewhere.
Measured speed ratios between the impls are in README's "Pallas kernels and ops" section.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gmm import gmm
from pallas_kernels.gmm.reference import swiglu_grouped
from zaya_jax.ops.fused_experts import fused_swiglu_experts
from zaya_jax.ops.row_tiles import tile_plan, tile_rows, write_rows
from zaya_jax.ops.sharding import summed_like, varying_like

IMPLS = ("auto", "ragged_dot", "tiled", "looped", "fused", "pallas")


def grouped_matmul(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, impl: str = "auto",
                   tile: int = 128) -> jax.Array:
  """`y[rows of group e] = x[rows of group e] @ w[e]`; rows past `sum(group_sizes)` give 0.

  Args:
    x_MD: `[M, D]` rows sorted by group.
    w_EDF: `[E, D, F]` one matrix per group.
    group_sizes_E: int32 `[E]`, rows per group, `sum <= M`.
    impl: one of IMPLS.
    tile: rows per tile of the `"tiled"` and `"looped"` implementations.
  Returns:
    `[M, F]` in the dtype of the inputs.
  Raises:
    ValueError: unknown `impl` (names the allowed values).
  """
  if impl == "auto":
    impl = "looped" if jax.default_backend() == "cpu" else "ragged_dot"
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)
  if impl == "tiled":
    return _tiled_grouped_matmul(x_MD, w_EDF, group_sizes_E, tile)
  if impl in ("looped", "fused"):
    return _looped_grouped_matmul(x_MD, w_EDF, group_sizes_E, max(1, min(tile, x_MD.shape[0])))
  if impl == "pallas":
    return gmm(x_MD, w_EDF, group_sizes_E.astype(jnp.int32))
  raise ValueError(f"grouped_matmul impl={impl!r}; must be one of {IMPLS}")


def swiglu_experts(x_MD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                   w_down_EFD: jax.Array, group_sizes_E: jax.Array, impl: str = "auto") -> jax.Array:
  """Grouped SwiGLU on rows sorted by expert: `(silu(x Wg[e]) * (x Wu[e])) Wd[e]` per group
  (`pallas_kernels.gmm.reference.swiglu_grouped` with `grouped_matmul(impl)`).

  Args:
    x_MD: `[M, D]` rows sorted by expert, cast to the weights' dtype.
    w_gate_EDF, w_up_EDF: `[E, D, F]`; w_down_EFD: `[E, F, D]` (compute dtype).
    group_sizes_E: int32 `[E]`; rows past `sum(group_sizes)` (e.g. skipped tokens sorted
      last) give zeros.
    impl: one of IMPLS: `"fused"` (and `"auto"` on CPU) is `fused_swiglu_experts` (one loop,
      one custom VJP), any other the `grouped_matmul` impl of the three products.
  Returns:
    `[M, D]` in the weights' dtype.
  Raises:
    ValueError: unknown `impl`.
  Matches: HF `ZayaExperts` (`gate_up_proj[e]` = [gate; up] rows, `down_proj[e]`).
  """
  if impl == "auto" and jax.default_backend() == "cpu":
    impl = "fused"
  if impl == "fused":
    return fused_swiglu_experts(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, group_sizes_E)
  return swiglu_grouped(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD,
                        lambda a_MK, w_EKN: grouped_matmul(a_MK, w_EKN, group_sizes_E, impl))


def _tiled_grouped_matmul(x_MD, w_EDF, group_sizes_E, tile):
  m, e = x_MD.shape[0], w_EDF.shape[0]
  tile = max(1, min(tile, m))
  n = (m + e * (tile - 1)) // tile + 1  # static bound on tiles after per-group padding
  ends_E = jnp.cumsum(group_sizes_E)
  starts_E = ends_E - group_sizes_E
  padded_E = (group_sizes_E + tile - 1) // tile * tile
  padded_ends_E = jnp.cumsum(padded_E)
  padded_starts_E = padded_ends_E - padded_E
  rows = jnp.arange(m)
  group_M = jnp.searchsorted(ends_E, rows, side="right")
  valid_M = group_M < e
  g = jnp.minimum(group_M, e - 1)
  dest_M = jnp.where(valid_M, padded_starts_E[g] + rows - starts_E[g], n * tile)  # n*tile = dropped
  x_PD = jnp.zeros((n * tile, x_MD.shape[1]), x_MD.dtype).at[dest_M].set(x_MD, mode="drop")
  tile_group_n = jnp.minimum(jnp.searchsorted(padded_ends_E, jnp.arange(n) * tile, side="right"), e - 1)
  y_PF = jnp.einsum("nmD,nDF->nmF", x_PD.reshape(n, tile, -1), w_EDF[tile_group_n]).reshape(n * tile, -1)
  y_MF = y_PF.at[dest_M].get(mode="fill", fill_value=0)
  return jnp.where(valid_M[:, None], y_MF, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _looped_grouped_matmul(x_MD, w_EDF, group_sizes_E, tile):
  group_n, lo_n, hi_n, num = tile_plan(group_sizes_E, x_MD.shape[0], tile)

  def body(i, y_MF):
    x_tD, valid_t, start = tile_rows(x_MD, lo_n[i], hi_n[i], tile)
    return write_rows(y_MF, x_tD @ w_EDF[group_n[i]], valid_t, start)

  init = varying_like(jnp.zeros((x_MD.shape[0], w_EDF.shape[2]), x_MD.dtype), x_MD, w_EDF,
                      group_sizes_E)
  return jax.lax.fori_loop(0, num, body, init)


def _looped_fwd(x_MD, w_EDF, group_sizes_E, tile):
  return _looped_grouped_matmul(x_MD, w_EDF, group_sizes_E, tile), (x_MD, w_EDF, group_sizes_E)


def _looped_bwd(tile, residuals, dy_MF):
  """dx = dy w[group]^T per tile, dw[group] += x^T dy per tile (float32 sums), one loop."""
  x_MD, w_EDF, group_sizes_E = residuals
  group_n, lo_n, hi_n, num = tile_plan(group_sizes_E, x_MD.shape[0], tile)

  def body(i, carry):
    dx_MD, dw_EDF = carry
    x_tD, valid_t, start = tile_rows(x_MD, lo_n[i], hi_n[i], tile)
    dy_tF = jnp.where(valid_t[:, None], jax.lax.dynamic_slice_in_dim(dy_MF, start, tile), 0)
    g = group_n[i]
    dx_MD = write_rows(dx_MD, jnp.einsum("tF,DF->tD", dy_tF, w_EDF[g]), valid_t, start)
    dw_DF = jnp.einsum("tD,tF->DF", x_tD, dy_tF, preferred_element_type=jnp.float32)
    return dx_MD, dw_EDF.at[g].add(dw_DF)

  init = varying_like((jnp.zeros_like(x_MD), jnp.zeros(w_EDF.shape, jnp.float32)), x_MD, w_EDF,
                      group_sizes_E, dy_MF)
  dx_MD, dw_EDF = jax.lax.fori_loop(0, num, body, init)
  # Inside shard_map an input that enters unvarying gets its cotangent summed over the axes
  # the loop made it vary over, as autodiff would (e.g. rows of a ragged_all_to_all).
  return summed_like(dx_MD, x_MD), summed_like(dw_EDF, w_EDF).astype(w_EDF.dtype), None


_looped_grouped_matmul.defvjp(_looped_fwd, _looped_bwd)
