# Shape letters: M X D (see zaya_jax/__init__.py); P = M rows in sorted (grouped) order.
"""Public routing op: argument checks, block sizes, and the custom VJP around the kernels.

`route(logits_MX, balancing_biases_X)` returns the same `Routing` as
`reference.route_reference`; the gradient reaches `logits_MX` through `gate_M` only:
d gate_m / d logits_m = p_c * (onehot_c - p), the softmax Jacobian row of the chosen class c.
Integer outputs and the biases get no gradient (the reference detaches the probabilities
before the biases and argmax is flat). The backward is plain jnp (one softmax recompute and
an elementwise product: memory-bound and fused by XLA), not a Pallas kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import resolve_interpret
from pallas_kernels.routing import kernel
from pallas_kernels.routing.reference import Routing


@dataclasses.dataclass(frozen=True)
class RoutingBlockSizes:
  """Launch shape of both routing kernels.

  Attributes:
    block_m: tokens per program, a power of two >= 16 (capped at M rounded up to a power of
      two, so tiny inputs launch one small program).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages (no loop to pipeline here: 1).
  """

  block_m: int = 128
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if self.block_m < 16 or self.block_m & (self.block_m - 1):
      raise ValueError(f"block_m={self.block_m}; must be a power of two >= 16 (Triton tiles)")
    if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
      raise ValueError(f"num_warps={self.num_warps}; must be a power of two >= 1")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages}; must be >= 1")


def _check(logits_MX: jax.Array, balancing_biases_X: jax.Array) -> None:
  if logits_MX.ndim != 2:
    raise ValueError(f"logits must have rank 2 [M, X], got shape {logits_MX.shape}")
  m, x = logits_MX.shape
  if m < 1:
    raise ValueError(f"logits has M={m} tokens; needs at least 1")
  if x < 2:
    raise ValueError(f"logits has X={x} classes; needs at least 2 (experts + skip)")
  if balancing_biases_X.shape != (x,):
    raise ValueError(f"balancing_biases must have shape [X]=({x},) to match logits "
                     f"{logits_MX.shape}, got {balancing_biases_X.shape}")
  for name, a in (("logits", logits_MX), ("balancing_biases", balancing_biases_X)):
    if not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating dtype, got {a.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _route(logits_MX, balancing_biases_X, block: RoutingBlockSizes, interpret: bool) -> Routing:
  m = logits_MX.shape[0]
  block_m = min(block.block_m, max(16, pl.next_power_of_2(m)))
  return Routing(*kernel.route_forward(
      logits_MX, balancing_biases_X.astype(jnp.float32), block_m=block_m,
      num_warps=block.num_warps, num_stages=block.num_stages, interpret=interpret))


def _route_fwd(logits_MX, balancing_biases_X, block, interpret):
  out = _route(logits_MX, balancing_biases_X, block, interpret)
  # logits_MX is the op's input (alive anyway); the probabilities are recomputed in bwd
  # rather than kept as an [M, X] residual.
  return out, (logits_MX, balancing_biases_X, out.class_M, out.gate_M)


def _route_bwd(block, interpret, res, g: Routing):
  del block, interpret
  logits_MX, balancing_biases_X, class_M, gate_M = res
  probs_MX = jax.nn.softmax(logits_MX.astype(jnp.float32), axis=-1)
  onehot_MX = jax.nn.one_hot(class_M, logits_MX.shape[-1], dtype=jnp.float32)
  d_logits_MX = (g.gate_M * gate_M)[:, None] * (onehot_MX - probs_MX)
  return d_logits_MX.astype(logits_MX.dtype), jnp.zeros_like(balancing_biases_X)


_route.defvjp(_route_fwd, _route_bwd)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def route(logits_MX: jax.Array, balancing_biases_X: jax.Array, *,
          block: RoutingBlockSizes | None = None, interpret: bool | None = None) -> Routing:
  """Top-1 routing with stable grouping by class, as two Pallas (Triton) kernels.

  class = argmax(softmax(logits) + biases) (first index on ties), gate = softmax(logits)[class],
  then a stable counting sort of the tokens by class (skip class X - 1 last).

  Args:
    logits_MX: [M, X] router logits, floating (computed in float32 inside), X = E + 1.
    balancing_biases_X: [X] balancing biases, floating (cast to float32); no gradient.
    block: launch shape; None = `RoutingBlockSizes()`.
    interpret: run the kernels in Pallas interpret mode; None = only on a CPU backend.

  Returns:
    `Routing` (see `reference.Routing`): class_M, order_M, inverse_M int32 [M];
    gate_M float32 [M] (differentiable w.r.t. logits); group_sizes_X, group_offsets_X int32.

  Raises:
    ValueError: logits not rank 2, M < 1, X < 2, balancing_biases not of shape [X], a
      non-floating dtype, or invalid `block` sizes.

  Matches: `reference.route_reference`; `zaya_jax.model.router.Router.__call__` after
  `out_proj` plus `zaya_jax.parallel.dispatch.sort_by_key(class_M, X)`.
  """
  _check(logits_MX, balancing_biases_X)
  return _route(logits_MX, balancing_biases_X, block or RoutingBlockSizes(),
                resolve_interpret(interpret))


def permute(x_MD: jax.Array, routing: Routing) -> jax.Array:
  """Rows grouped by class, [P = M, D]: sorted row i is token `routing.order_M[i]`.

  Expert e's rows are [group_offsets_X[e], group_offsets_X[e] + group_sizes_X[e]); skip rows
  come last. Feed `group_sizes_X[:E]` to the grouped matmul.
  """
  return jnp.take(x_MD, routing.order_M, axis=0)


def unpermute(y_PD: jax.Array, routing: Routing) -> jax.Array:
  """Back to token order, [M, D]: token m's row is sorted row `routing.inverse_M[m]`.

  A gather (its transpose, a scatter-add, is the backward); equals
  `zaya_jax.parallel.dispatch.unsort(y_PD, order_M)`.
  """
  return jnp.take(y_PD, routing.inverse_M, axis=0)
