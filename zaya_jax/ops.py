# Shape letters: M D F E (see zaya_jax/__init__.py); P = padded rows, n = row tiles.
"""The one place that picks an implementation per hot op (no global switches).

`grouped_matmul` (the experts' GEMM on rows sorted by expert):
- `"ragged_dot"`: `jax.lax.ragged_dot`, the XLA grouped GEMM (GPU production path);
- `"tiled"`: rows of each group are padded to a multiple of `tile` rows and multiplied tile by
  tile with that tile's expert weight (one batched matmul). Same values; on XLA:CPU about 4x
  faster than `ragged_dot`, whose CPU lowering costs as much as a dense all-experts product;
- `"auto"`: `"tiled"` on CPU, `"ragged_dot"` elsewhere.
The Pallas kernels of a later issue plug in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GMM_IMPLS = ("auto", "ragged_dot", "tiled")


def grouped_matmul(x_MD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, impl: str = "auto",
                   tile: int = 128) -> jax.Array:
  """`y[rows of group e] = x[rows of group e] @ w[e]`; rows past `sum(group_sizes)` give 0.

  Args:
    x_MD: `[M, D]` rows sorted by group.
    w_EDF: `[E, D, F]` one matrix per group.
    group_sizes_E: int32 `[E]`, rows per group, `sum <= M`.
    impl: one of GMM_IMPLS, or "pallas" (pallas_kernels.gmm; picked by zaya_jax.kernels).
    tile: rows per tile of the `"tiled"` implementation.
  Returns:
    `[M, F]` in the dtype of the inputs.
  Raises:
    ValueError: unknown `impl` (names the allowed values).
  """
  if impl == "auto":
    impl = "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
  if impl == "ragged_dot":
    return jax.lax.ragged_dot(x_MD, w_EDF, group_sizes_E)
  if impl == "tiled":
    return _tiled_grouped_matmul(x_MD, w_EDF, group_sizes_E, tile)
  if impl == "pallas":  # chosen by zaya_jax.kernels (ModelConfig.kernels), not by gmm_impl
    from pallas_kernels.gmm import gmm  # pylint: disable=import-outside-toplevel
    return gmm(x_MD, w_EDF, group_sizes_E.astype(jnp.int32))
  raise ValueError(f"grouped_matmul impl={impl!r}; must be one of {GMM_IMPLS} or 'pallas'")


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
