# Shape letters: M rows, K contraction, N output columns, E groups (experts).
"""Pure-jnp definition of the grouped matmul pair `gmm` / `tgmm` (the spec, in code).

Rows of `lhs` are sorted by group: group `e` owns rows `[start_e, end_e)` with
`end_e = sum(group_sizes[:e+1])`. Rows past `sum(group_sizes)` belong to no group. Both ops
accumulate in float32 and return the dtype of `lhs`. Same values as `jax.lax.ragged_dot`
(the `"ragged_dot"` impl of `zaya_jax.ops.grouped_matmul`); written as a dense one-hot
product, so it is for tests on small shapes only.
"""

from __future__ import annotations

from typing import Callable

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


def swiglu_grouped(x_MD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                   w_down_EFD: jax.Array,
                   matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
  """Grouped SwiGLU on rows sorted by expert: `(silu(x Wg[e]) * (x Wu[e])) Wd[e]` per group.

  The one definition of the experts' SwiGLU: `swiglu_experts_gmm` and the model's experts
  (`zaya_jax.ops.grouped_matmul.swiglu_experts`) call it with their grouped matmul.

  Args:
    x_MD: `[M, D]` rows sorted by expert, cast to the weights' dtype.
    w_gate_EDF, w_up_EDF: `[E, D, F]`; w_down_EFD: `[E, F, D]`.
    matmul: `matmul(a_MK, w_EKN) -> [M, N]`, the grouped matmul over the same group sizes;
      rows past `sum(group_sizes)` must give zeros (they then give zeros here too).
  Returns:
    `[M, D]` in the weights' dtype.
  Matches: HF `ZayaExperts` (`gate_up_proj[e]` = [gate; up] rows, `down_proj[e]`).
  """
  x_MD = x_MD.astype(w_gate_EDF.dtype)
  h_MF = jax.nn.silu(matmul(x_MD, w_gate_EDF)) * matmul(x_MD, w_up_EDF)
  return matmul(h_MF, w_down_EFD)
