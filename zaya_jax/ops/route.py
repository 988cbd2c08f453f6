# Shape letters: M X (see zaya_jax/__init__.py); X = E + 1 router classes, the last = skip.
"""ZAYA1's top-1 routing: `class = argmax(stop_grad(probs) + biases)`, gate = probs[class].

impl "xla": `pallas_kernels.routing.top1` in jnp (the definition of the rule, beside the
kernel's reference); the dispatcher then sorts tokens by class. impl "pallas": the
`pallas_kernels.routing` kernels, which also return the permutation grouping tokens by class
(used by the single-shard dispatch instead of sorting). Matches HF `ZayaRouter`: the biases
steer the choice only (no gradient), the gate is the unbiased probability of the chosen
class, not renormalised.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.routing import route as route_kernel
from pallas_kernels.routing import top1
from zaya_jax.ops.sharding import per_batch_shard, single_device

IMPLS = ("xla", "pallas")


class RouteResult(NamedTuple):
  """Top-1 routing of M tokens over X = E + 1 classes (last = skip).

  class_M: int32 chosen class; gate_M: float32 softmax probability of it (differentiable);
  order_M / group_sizes_X: the stable permutation grouping tokens by class and the int32
  tokens per class, or None when the dispatcher sorts (impl "xla", or "pallas" under a mesh).
  """

  class_M: jax.Array
  gate_M: jax.Array
  order_M: jax.Array | None = None
  group_sizes_X: jax.Array | None = None


def route(logits_MX: jax.Array, probs_MX: jax.Array, balancing_biases_X: jax.Array, *,
          impl: str = "xla") -> RouteResult:
  """Top-1 choice and gate of M tokens.

  Args:
    logits_MX: float32 router logits (the "pallas" impl's input).
    probs_MX: float32 `softmax(logits_MX)` (the "xla" impl's input).
    balancing_biases_X: float32 biases added to the detached probabilities for the choice.
    impl: one of IMPLS.
  Returns:
    `RouteResult`; under a multi-device mesh the "pallas" impl runs per token shard and
    leaves the permutation to the dispatcher (a shard-local one would be wrong for EP).
  Raises:
    ValueError: unknown `impl` (names the allowed values).
  """
  if impl == "xla":
    return RouteResult(*top1(probs_MX, balancing_biases_X))
  if impl != "pallas":
    raise ValueError(f"route impl={impl!r}; must be one of {IMPLS}")
  logits_MX, biases_X = logits_MX.astype(jnp.float32), balancing_biases_X.astype(jnp.float32)
  if single_device():
    r = route_kernel(logits_MX, biases_X)
    return RouteResult(r.class_M, r.gate_M, r.order_M, r.group_sizes_X)
  class_M, gate_M = per_batch_shard(lambda l, b: tuple(route_kernel(l, b)[:2]), logits_MX,
                                    shared=(biases_X,))
  return RouteResult(class_M, gate_M)
