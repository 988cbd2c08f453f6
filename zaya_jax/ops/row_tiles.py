# Shape letters: M E (see zaya_jax/__init__.py); X = any trailing width, n = tiles, t = rows of one tile.
"""Row tiles of a grouped op on rows sorted by group: the loop plan shared by the `"looped"`
grouped matmul (`zaya_jax.ops.grouped_matmul`) and the fused SwiGLU experts
(`zaya_jax.ops.fused_experts`).

Group `e` owns rows `[start_e, end_e)`; it is covered by `ceil(size_e / tile)` tiles of at most
`tile` rows, each tile one group's. A tile reads the `tile` rows from a start clipped to fit in
`M` and masks those outside its `[lo, hi)`, so every slice has a static size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_plan(group_sizes_E: jax.Array, m: int, tile: int):
  """The tiles of `m` rows grouped by `group_sizes_E`, in row order.

  Args:
    group_sizes_E: int32 `[E]`, rows per group, `sum <= m`.
    m: rows (static).
    tile: rows per tile (static, `1 <= tile <= m`).
  Returns:
    `(group_n, lo_n, hi_n, num)`: tile `i` covers rows `[lo_n[i], hi_n[i])` (at most `tile`,
    all of group `group_n[i]`); only the first `num` (int32 [], dynamic) of the static bound
    `n = m // tile + E` entries are tiles.
  """
  e = group_sizes_E.shape[0]
  n = m // tile + e  # sum ceil(size / tile) <= (M + E (tile - 1)) / tile
  ends_E = jnp.cumsum(group_sizes_E)
  tiles_E = (group_sizes_E + tile - 1) // tile
  tile_ends_E = jnp.cumsum(tiles_E)
  i_n = jnp.arange(n, dtype=jnp.int32)
  group_n = jnp.minimum(jnp.searchsorted(tile_ends_E, i_n, side="right"), e - 1)
  lo_n = ends_E[group_n] - group_sizes_E[group_n] + (i_n - (tile_ends_E - tiles_E)[group_n]) * tile
  hi_n = jnp.minimum(lo_n + tile, ends_E[group_n])
  return group_n, lo_n, hi_n, tile_ends_E[-1]


def tile_rows(a_MX: jax.Array, lo: jax.Array, hi: jax.Array, tile: int):
  """`(a_tX, valid_t, start)`: the `tile` rows of `a_MX` from `start` (`lo`, moved back to fit
  in M) and a bool `[tile]` of which of them lie in `[lo, hi)`."""
  start = jnp.clip(lo, 0, a_MX.shape[0] - tile)
  rows_t = start + jnp.arange(tile, dtype=lo.dtype)
  return jax.lax.dynamic_slice_in_dim(a_MX, start, tile), (rows_t >= lo) & (rows_t < hi), start


def write_rows(out_MX: jax.Array, new_tX: jax.Array, valid_t: jax.Array, start: jax.Array):
  """`out_MX` with its rows `start + t` replaced by `new_tX` (cast to its dtype) where
  `valid_t`; the other rows keep their values."""
  old_tX = jax.lax.dynamic_slice_in_dim(out_MX, start, new_tX.shape[0])
  new_tX = jnp.where(valid_t[:, None], new_tX.astype(out_MX.dtype), old_tX)
  return jax.lax.dynamic_update_slice_in_dim(out_MX, new_tX, start, 0)
