# Shape letters: M rows, K contraction, N output columns, E groups (experts); D F as in zaya_jax.
"""Public grouped matmul ops on the Pallas Triton kernels: `gmm`, `tgmm`, `swiglu_experts_gmm`.

`gmm` is differentiable (`jax.custom_vjp`): `dlhs = gmm(grad, rhs^T per group)` (the same
kernel reading `rhs` transposed, no copy) and `drhs = tgmm(lhs, grad)`; `group_sizes` gets no
gradient. Block sizes and Triton parameters live in `GmmBlockSizes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_interpret
from pallas_kernels.gmm import kernel
from pallas_kernels.gmm.reference import swiglu_grouped


@dataclasses.dataclass(frozen=True)
class GmmBlockSizes:
  """Tile sizes (powers of two, >= 16) and Triton compiler parameters.

  Each block is shrunk to the next power of two >= the matching dimension (min 16), so small
  problems do not pay for a large tile.
  """
  block_m: int = 64
  block_k: int = 64
  block_n: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def validate(self) -> None:
    """Raises ValueError for a block that is not a power of two >= 16, or bad Triton params."""
    for name in ("block_m", "block_k", "block_n"):
      b = getattr(self, name)
      if b < 16 or b & (b - 1):
        raise ValueError(f"GmmBlockSizes.{name}={b}; must be a power of two >= 16")
    if self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"GmmBlockSizes num_warps={self.num_warps}, num_stages={self.num_stages};"
                       " both must be >= 1")

  def fit(self, m: int, k: int, n: int) -> dict:
    """Keyword arguments for `kernel.gmm_call`/`tgmm_call`, blocks shrunk to the problem."""
    shrink = lambda b, d: min(b, max(16, 1 << max(d - 1, 0).bit_length()))
    return dict(block_m=shrink(self.block_m, m), block_k=shrink(self.block_k, k),
                block_n=shrink(self.block_n, n), num_warps=self.num_warps,
                num_stages=self.num_stages)


def _check_group_sizes(group_sizes_E: jax.Array, num_groups: int | None) -> None:
  if group_sizes_E.ndim != 1 or (num_groups is not None and group_sizes_E.shape[0] != num_groups):
    want = "[E]" if num_groups is None else f"[{num_groups}] (rhs.shape[0])"
    raise ValueError(f"group_sizes.shape={group_sizes_E.shape}; must be {want}")
  if group_sizes_E.dtype != jnp.int32:
    raise ValueError(f"group_sizes.dtype={group_sizes_E.dtype}; must be int32")
  if group_sizes_E.shape[0] < 1:
    raise ValueError(f"group_sizes.shape={group_sizes_E.shape}; needs at least one group")


def _check_float(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={x.dtype}; must be a floating dtype")


def _check_gmm_args(lhs_MK, rhs_EKN, group_sizes_E) -> None:
  if lhs_MK.ndim != 2:
    raise ValueError(f"lhs.shape={lhs_MK.shape}; must be [m, k] (rank 2)")
  if rhs_EKN.ndim != 3:
    raise ValueError(f"rhs.shape={rhs_EKN.shape}; must be [E, k, n] (rank 3)")
  if rhs_EKN.shape[1] != lhs_MK.shape[1]:
    raise ValueError(f"rhs.shape={rhs_EKN.shape} and lhs.shape={lhs_MK.shape}: k mismatch "
                     f"(rhs.shape[1] must equal lhs.shape[1])")
  _check_float("lhs", lhs_MK)
  if rhs_EKN.dtype != lhs_MK.dtype:
    raise ValueError(f"rhs.dtype={rhs_EKN.dtype} and lhs.dtype={lhs_MK.dtype}; must be equal")
  _check_group_sizes(group_sizes_E, rhs_EKN.shape[0])


def _check_tgmm_args(lhs_MK, grad_MN, group_sizes_E) -> None:
  if lhs_MK.ndim != 2:
    raise ValueError(f"lhs.shape={lhs_MK.shape}; must be [m, k] (rank 2)")
  if grad_MN.ndim != 2 or grad_MN.shape[0] != lhs_MK.shape[0]:
    raise ValueError(f"grad.shape={grad_MN.shape}; must be [m, n] with m={lhs_MK.shape[0]} "
                     f"(lhs.shape[0])")
  _check_float("lhs", lhs_MK)
  if grad_MN.dtype != lhs_MK.dtype:
    raise ValueError(f"grad.dtype={grad_MN.dtype} and lhs.dtype={lhs_MK.dtype}; must be equal")
  _check_group_sizes(group_sizes_E, None)


def _gmm(lhs_MK, rhs, group_sizes_E, block: GmmBlockSizes, interpret: bool,
         transpose_rhs: bool = False):
  m, k = lhs_MK.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  return kernel.gmm_call(lhs_MK, rhs, group_sizes_E, interpret=interpret,
                         transpose_rhs=transpose_rhs, **block.fit(m, k, n))


def _tgmm(lhs_MK, grad_MN, group_sizes_E, block: GmmBlockSizes, interpret: bool):
  (m, k), n = lhs_MK.shape, grad_MN.shape[1]
  return kernel.tgmm_call(lhs_MK, grad_MN, group_sizes_E, interpret=interpret,
                          **block.fit(m, k, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(lhs_MK, rhs_EKN, group_sizes_E, block, interpret):
  return _gmm(lhs_MK, rhs_EKN, group_sizes_E, block, interpret)


def _gmm_vjp_fwd(lhs_MK, rhs_EKN, group_sizes_E, block, interpret):
  out_MN = _gmm(lhs_MK, rhs_EKN, group_sizes_E, block, interpret)
  return out_MN, (lhs_MK, rhs_EKN, group_sizes_E)


def _gmm_vjp_bwd(block, interpret, residuals, grad_MN):
  lhs_MK, rhs_EKN, group_sizes_E = residuals
  grad_MN = grad_MN.astype(lhs_MK.dtype)
  dlhs_MK = _gmm(grad_MN, rhs_EKN, group_sizes_E, block, interpret, transpose_rhs=True)
  drhs_EKN = _tgmm(lhs_MK, grad_MN, group_sizes_E, block, interpret)
  return dlhs_MK, drhs_EKN, None


_gmm_vjp.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def gmm(lhs_MK: jax.Array, rhs_EKN: jax.Array, group_sizes_E: jax.Array, *,
        block: GmmBlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
  """`out[rows of group e] = lhs[rows of group e] @ rhs[e]`; rows past the last group are 0.

  Differentiable in `lhs` and `rhs` (not `group_sizes`). Same values as
  `jax.lax.ragged_dot(lhs, rhs, group_sizes)`.

  Args:
    lhs_MK: `[m, k]` floating, rows sorted by group.
    rhs_EKN: `[E, k, n]`, same dtype as `lhs`.
    group_sizes_E: int32 `[E]`, rows per group, `sum <= m` (rows past `m` are ignored).
    block: tile sizes and Triton parameters; default `GmmBlockSizes()`.
    interpret: run in the Pallas interpreter; None = exactly when the backend is the CPU.
  Returns:
    `[m, n]` in `lhs.dtype`, accumulated in float32.
  Raises:
    ValueError: wrong ranks, `k` mismatch, group count != `rhs.shape[0]`, `group_sizes` not
      int32, non-floating or mismatched dtypes, or invalid block sizes.
  """
  _check_gmm_args(lhs_MK, rhs_EKN, group_sizes_E)
  block = block or GmmBlockSizes()
  block.validate()
  return _gmm_vjp(lhs_MK, rhs_EKN, group_sizes_E, block, resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def tgmm(lhs_MK: jax.Array, grad_MN: jax.Array, group_sizes_E: jax.Array, *,
         block: GmmBlockSizes | None = None, interpret: bool | None = None) -> jax.Array:
  """`out[e] = lhs[rows of group e]^T @ grad[rows of group e]` (the `rhs` gradient of `gmm`).

  Not differentiable itself. An empty group gives zeros; rows past the last group are ignored.

  Args:
    lhs_MK: `[m, k]` floating, rows sorted by group.
    grad_MN: `[m, n]`, same dtype as `lhs`.
    group_sizes_E: int32 `[E]`, rows per group.
    block: tile sizes and Triton parameters; default `GmmBlockSizes()`.
    interpret: run in the Pallas interpreter; None = exactly when the backend is the CPU.
  Returns:
    `[E, k, n]` in `lhs.dtype`, accumulated in float32.
  Raises:
    ValueError: wrong ranks or row counts, `group_sizes` not int32 `[E]`, non-floating or
      mismatched dtypes, or invalid block sizes.
  """
  _check_tgmm_args(lhs_MK, grad_MN, group_sizes_E)
  block = block or GmmBlockSizes()
  block.validate()
  return _tgmm(lhs_MK, grad_MN, group_sizes_E, block, resolve_interpret(interpret))


def swiglu_experts_gmm(x_MD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                       w_down_EFD: jax.Array, group_sizes_E: jax.Array, *,
                       block: GmmBlockSizes | None = None,
                       interpret: bool | None = None) -> jax.Array:
  """Grouped SwiGLU on sorted rows: `(silu(x Wg[e]) * (x Wu[e])) Wd[e]` per group.

  `reference.swiglu_grouped` with `gmm` as the grouped matmul: `x` is cast to the weights'
  dtype; rows past `sum(group_sizes)` give zeros.

  Args:
    x_MD: `[M, D]` rows sorted by expert.
    w_gate_EDF, w_up_EDF: `[E, D, F]`.
    w_down_EFD: `[E, F, D]`.
    group_sizes_E: int32 `[E]`.
    block, interpret: as in `gmm`.
  Returns:
    `[M, D]` in the weights' dtype.
  Raises:
    ValueError: as `gmm`, for any of the three products.
  """
  mm = functools.partial(gmm, group_sizes_E=group_sizes_E, block=block, interpret=interpret)
  return swiglu_grouped(x_MD, w_gate_EDF, w_up_EDF, w_down_EFD, mm)
