# Shape letters: M rows, K contraction, N output columns, E groups (experts), T tiles.
"""Pallas kernels (Triton lowering) for the grouped matmul `gmm` and its transpose `tgmm`.

`gmm`: a grid over (row tiles of a schedule, column tiles). The schedule, built in jnp by
`make_tile_schedule`, splits the `block_m`-aligned row tiles at group boundaries, so each
schedule entry belongs to exactly one group: a tile spanning two groups appears twice, each
entry masking the other group's rows. The rows past `sum(group_sizes)` form one extra
pseudo-group whose entries store zeros without multiplying. At most `ceil(m/bm) + E` entries;
unused ones are empty (mask all false, no k loop).

`tgmm`: a grid over (group, k tiles, n tiles); each program walks its group's rows in
`block_m` blocks (a loop with a data-dependent trip count: 0 for an empty group) and
accumulates `lhs_blk^T @ grad_blk` in float32.

Kernels take whole-array refs and load blocks with `pl.ds` + masks, so `m`, `k`, `n` need not
be multiples of the blocks. Block dims must be powers of two, >= 16 (Triton `dot`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import out_struct


def num_schedule_tiles(m: int, num_groups: int, block_m: int) -> int:
  """Static length of the gmm tile schedule: `ceil(m / block_m) + num_groups`."""
  return pl.cdiv(m, block_m) + num_groups


def group_bounds(group_sizes_E: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """`(starts, ends)`, int32 `[E]` each: row range of each group, clipped to `[0, m]`."""
  ends_E = jnp.minimum(jnp.cumsum(group_sizes_E.astype(jnp.int32)), m)
  starts_E = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_E[:-1]])
  return starts_E, ends_E


def make_tile_schedule(group_sizes_E: jax.Array, m: int, block_m: int) -> tuple[jax.Array, ...]:
  """Row-tile schedule for `gmm`: one entry per (aligned row tile, group) pair that overlaps.

  The rows past `sum(group_sizes)` are pseudo-group `E` (their entries store zeros).

  Args:
    group_sizes_E: int32 `[E]`, rows per group.
    m: number of rows.
    block_m: rows per tile.
  Returns:
    `(group_T, row0_T, lo_T, hi_T)`, int32 `[T]` each with `T = num_schedule_tiles(m, E,
    block_m)`: the entry's group (`E` = no group), first row of its aligned tile, and its row
    range `[lo, hi)` (absolute rows). Unused entries have `group = E`, `lo = hi = 0`.
  """
  num_groups = group_sizes_E.shape[0]
  starts_E, ends_E = group_bounds(group_sizes_E, m)
  # Pseudo-group E: the rows past the last group.
  starts_G = jnp.concatenate([starts_E, ends_E[-1:]])
  ends_G = jnp.concatenate([ends_E, jnp.full((1,), m, jnp.int32)])
  first_G = starts_G // block_m
  tiles_G = jnp.where(ends_G > starts_G, pl.cdiv(ends_G, block_m) - first_G, 0)
  cum_G = jnp.cumsum(tiles_G)
  t = jnp.arange(num_schedule_tiles(m, num_groups, block_m), dtype=jnp.int32)
  g_T = jnp.minimum(jnp.searchsorted(cum_G, t, side="right"), num_groups).astype(jnp.int32)
  used_T = t < cum_G[-1]
  row0_T = (first_G[g_T] + t - (cum_G - tiles_G)[g_T]) * block_m
  lo_T = jnp.maximum(starts_G[g_T], row0_T)
  hi_T = jnp.minimum(ends_G[g_T], row0_T + block_m)
  zero = jnp.zeros_like(t)
  return (jnp.where(used_T, g_T, num_groups), jnp.where(used_T, row0_T, zero),
          jnp.where(used_T, lo_T, zero), jnp.where(used_T, hi_T, zero))


def _dot_precision(dtype) -> jax.lax.Precision | None:
  """Full float32 products for float32 inputs (no TF32); the default for 16-bit inputs."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def gmm_kernel(group_ref, row0_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, *,
               num_groups: int, k: int, n: int, block_m: int, block_k: int, block_n: int,
               transpose_rhs: bool):
  """One (schedule entry, column tile): `out[lo:hi, cols] = lhs[lo:hi] @ rhs[group][:, cols]`.

  Refs: schedule `[T]` int32 x4, `lhs [m, k]`, `rhs [E, k, n]` (`[E, n, k]` when
  `transpose_rhs`), `out [m, n]`.
  """
  tile, col_tile = pl.program_id(0), pl.program_id(1)
  group, row0, lo, hi = group_ref[tile], row0_ref[tile], lo_ref[tile], hi_ref[tile]
  rows = row0 + jnp.arange(block_m)
  row_mask = (rows >= lo) & (rows < hi)
  col0 = col_tile * block_n
  col_mask = col0 + jnp.arange(block_n) < n
  # Pseudo-group `num_groups` (rows past the last group, unused entries): no product, zeros.
  rhs_group = jnp.minimum(group, num_groups - 1)
  num_k = jnp.where(group < num_groups, pl.cdiv(k, block_k), 0)
  precision = _dot_precision(lhs_ref.dtype)

  def body(kb, acc):
    k0 = kb * block_k
    k_mask = k0 + jnp.arange(block_k) < k
    lhs = pltriton.load(lhs_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    if transpose_rhs:
      rhs = pltriton.load(rhs_ref.at[rhs_group, pl.ds(col0, block_n), pl.ds(k0, block_k)],
                          mask=col_mask[:, None] & k_mask[None, :], other=0.0)
      return acc + pltriton.dot(lhs, rhs, trans_b=True, precision=precision)
    rhs = pltriton.load(rhs_ref.at[rhs_group, pl.ds(k0, block_k), pl.ds(col0, block_n)],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
    return acc + pltriton.dot(lhs, rhs, precision=precision)

  acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
  pltriton.store(out_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)],
                 acc.astype(out_ref.dtype), mask=row_mask[:, None] & col_mask[None, :])


def tgmm_kernel(starts_ref, ends_ref, lhs_ref, grad_ref, out_ref, *, k: int, n: int,
                block_m: int, block_k: int, block_n: int):
  """One (group, k tile, n tile): `out[g][ks, ns] = sum over the group's rows of lhs^T grad`.

  Refs: `starts [E]`, `ends [E]` int32, `lhs [m, k]`, `grad [m, n]`, `out [E, k, n]`.
  """
  group, k_tile, n_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[group], ends_ref[group]
  k0, n0 = k_tile * block_k, n_tile * block_n
  k_mask = k0 + jnp.arange(block_k) < k
  n_mask = n0 + jnp.arange(block_n) < n
  precision = _dot_precision(lhs_ref.dtype)

  def body(i, acc):
    r0 = start + i * block_m
    row_mask = r0 + jnp.arange(block_m) < end
    lhs = pltriton.load(lhs_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    grad = pltriton.load(grad_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)],
                         mask=row_mask[:, None] & n_mask[None, :], other=0.0)
    return acc + pltriton.dot(lhs, grad, trans_a=True, precision=precision)

  num_blocks = pl.cdiv(jnp.maximum(end - start, 0), block_m)
  acc = jax.lax.fori_loop(0, num_blocks, body, jnp.zeros((block_k, block_n), jnp.float32))
  pltriton.store(out_ref.at[group, pl.ds(k0, block_k), pl.ds(n0, block_n)],
                 acc.astype(out_ref.dtype), mask=k_mask[:, None] & n_mask[None, :])


def gmm_call(lhs_MK: jax.Array, rhs: jax.Array, group_sizes_E: jax.Array, *, block_m: int,
             block_k: int, block_n: int, num_warps: int, num_stages: int, interpret: bool,
             transpose_rhs: bool = False) -> jax.Array:
  """`pallas_call` of `gmm_kernel`; no argument checks (see `ops.gmm`).

  Args:
    lhs_MK: `[m, k]`.
    rhs: `[E, k, n]`, or `[E, n, k]` with `transpose_rhs` (then `rhs[e]^T` is used).
    group_sizes_E: int32 `[E]`.
    block_m, block_k, block_n: tile sizes (powers of two, >= 16).
    num_warps, num_stages: Triton compiler parameters.
    interpret: run the kernel body in the Pallas interpreter (CPU).
    transpose_rhs: see `rhs`.
  Returns:
    `[m, n]` in `lhs_MK.dtype`.
  """
  m, k = lhs_MK.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  schedule = make_tile_schedule(group_sizes_E, m, block_m)
  kernel = functools.partial(gmm_kernel, num_groups=num_groups, k=k, n=n, block_m=block_m,
                             block_k=block_k, block_n=block_n, transpose_rhs=transpose_rhs)
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((m, n), lhs_MK.dtype, lhs_MK, rhs, group_sizes_E),
      grid=(schedule[0].shape[0], pl.cdiv(n, block_n)),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="gmm",
  )(*schedule, lhs_MK, rhs)


def tgmm_call(lhs_MK: jax.Array, grad_MN: jax.Array, group_sizes_E: jax.Array, *, block_m: int,
              block_k: int, block_n: int, num_warps: int, num_stages: int,
              interpret: bool) -> jax.Array:
  """`pallas_call` of `tgmm_kernel`; no argument checks (see `ops.tgmm`).

  Args:
    lhs_MK: `[m, k]`.
    grad_MN: `[m, n]`.
    group_sizes_E: int32 `[E]`.
    block_m, block_k, block_n: tile sizes (powers of two, >= 16).
    num_warps, num_stages: Triton compiler parameters.
    interpret: run the kernel body in the Pallas interpreter (CPU).
  Returns:
    `[E, k, n]` in `lhs_MK.dtype`.
  """
  m, k = lhs_MK.shape
  n = grad_MN.shape[1]
  num_groups = group_sizes_E.shape[0]
  starts_E, ends_E = group_bounds(group_sizes_E, m)
  kernel = functools.partial(tgmm_kernel, k=k, n=n, block_m=block_m, block_k=block_k,
                             block_n=block_n)
  return pl.pallas_call(
      kernel,
      out_shape=out_struct((num_groups, k, n), lhs_MK.dtype, lhs_MK, grad_MN, group_sizes_E),
      grid=(num_groups, pl.cdiv(k, block_k), pl.cdiv(n, block_n)),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="tgmm",
  )(starts_E, ends_E, lhs_MK, grad_MN)
