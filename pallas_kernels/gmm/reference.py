# Shape letters: M rows, K contraction, N output columns, E groups (experts).
"""Pure-jnp definition of the grouped matmul pair `gmm` / `tgmm` (the spec, in code).

Rows of `lhs` are sorted by group: group `e` owns rows `[start_e, end_e)` with
`end_e = sum(group_sizes[:e+1])`. Rows past `sum(group_sizes)` belong to no group. Both ops
accumulate in float32 and return the dtype of `lhs`. Same values as `jax.lax.ragged_dot`
(the `"ragged_dot"` impl of `zaya_jax.ops.grouped_matmul`); written as a dense one-hot
product, so it is for tests on small shapes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes_E: jax.Array, m: int) -> jax.Array:
  """Group id of each of `m` rows: int32 `[m]`, `E` for rows past `sum(group_sizes)`."""
  ends_E = jnp.cumsum(group_sizes_E.astype(jnp.int32))
  return jnp.searchsorted(ends_E, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def gmm_reference(lhs_MK: jax.Array, rhs_EKN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """`out[rows of group e] = lhs[rows of group e] @ rhs[e]`; rows past the last group are 0.

  Args:
    lhs_MK: `[m, k]` rows sorted by group.
    rhs_EKN: `[E, k, n]` one matrix per group.
    group_sizes_E: int32 `[E]`, rows per group, `sum <= m`.
  Returns:
    `[m, n]` in `lhs_MK.dtype` (accumulated in float32).
  """
  m, num_groups = lhs_MK.shape[0], rhs_EKN.shape[0]
  onehot_ME = jax.nn.one_hot(row_groups(group_sizes_E, m), num_groups, dtype=jnp.float32)
  out_MEN = jnp.einsum("mk,ekn->men", lhs_MK, rhs_EKN, preferred_element_type=jnp.float32,
                       precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum("men,me->mn", out_MEN, onehot_ME,
                    precision=jax.lax.Precision.HIGHEST).astype(lhs_MK.dtype)


def tgmm_reference(lhs_MK: jax.Array, grad_MN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """`out[e] = lhs[rows of group e]^T @ grad[rows of group e]`; an empty group gives zeros.

  The gradient of `gmm` with respect to `rhs`. Rows past the last group do not contribute.

  Args:
    lhs_MK: `[m, k]` rows sorted by group.
    grad_MN: `[m, n]` same rows.
    group_sizes_E: int32 `[E]`, rows per group, `sum <= m`.
  Returns:
    `[E, k, n]` in `lhs_MK.dtype` (accumulated in float32).
  """
  m, num_groups = lhs_MK.shape[0], group_sizes_E.shape[0]
  onehot_ME = jax.nn.one_hot(row_groups(group_sizes_E, m), num_groups, dtype=jnp.float32)
  out_EKN = jnp.einsum("mk,me,mn->ekn", lhs_MK.astype(jnp.float32), onehot_ME,
                       grad_MN.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return out_EKN.astype(lhs_MK.dtype)
