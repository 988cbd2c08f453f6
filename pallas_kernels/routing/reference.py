# Shape letters: M X (see zaya_jax/__init__.py).
"""Top-1 routing and token permutation in plain jnp: the definition of the routing op.

This is the work between the router MLP and the grouped matmul (spec §2 "ZAYA1 router"; HF
`ZayaRouter.forward`): softmax over the X = E + 1 classes, the balancing biases added to the
detached probabilities, a first-index argmax, the unbiased gate, and the stable grouping of
tokens by class that `zaya_jax.parallel.dispatch.sort_by_key` performs (skip class last).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
  """Top-1 routing of M tokens over X classes (the last class is skip).

  Attributes:
    class_M: int32 [M] in [0, X): argmax of softmax(logits) + biases, first index on ties.
    gate_M: float32 [M], softmax(logits)[class], unbiased and not renormalised; the only
      differentiable output.
    order_M: int32 [M], stable permutation grouping tokens by class: sorted position i holds
      token order_M[i]; skip tokens (class X - 1) sort last.
    inverse_M: int32 [M], the sorted position of token m: inverse_M[order_M[i]] = i.
    group_sizes_X: int32 [X], tokens per class (the skip class included).
    group_offsets_X: int32 [X], exclusive cumulative sum of `group_sizes_X`: where each
      class's rows start in the sorted order.
  """

  class_M: jax.Array
  gate_M: jax.Array
  order_M: jax.Array
  inverse_M: jax.Array
  group_sizes_X: jax.Array
  group_offsets_X: jax.Array


def gate_of(probs_MX: jax.Array, class_M: jax.Array) -> jax.Array:
  """float32 [M]: `probs_MX[m, class_M[m]]`, the unbiased gate of each token's class."""
  return jnp.take_along_axis(probs_MX, class_M[:, None], axis=-1)[:, 0]


def top1(probs_MX: jax.Array, balancing_biases_X: jax.Array) -> tuple[jax.Array, jax.Array]:
  """ZAYA1's top-1 rule: `(class_M, gate_M)`, the int32 first-index argmax of
  `stop_gradient(probs) + biases` and `gate_of(probs, class)` (differentiable in `probs`).

  Args:
    probs_MX: float32 [M, X] router softmax.
    balancing_biases_X: [X] biases, steering the choice only (no gradient reaches them).
  Matches: HF `ZayaRouter.forward` (spec §2 "ZAYA1 router").
  """
  biased_MX = jax.lax.stop_gradient(probs_MX) + balancing_biases_X.astype(jnp.float32)
  class_M = jnp.argmax(biased_MX, axis=-1).astype(jnp.int32)
  return class_M, gate_of(probs_MX, class_M)


def route_reference(logits_MX: jax.Array, balancing_biases_X: jax.Array) -> Routing:
  """`Routing` of `logits_MX` [M, X] float32 with `balancing_biases_X` [X] float32.

  `top1` of the softmax followed by the stable sort of tokens by class that the MoE's
  dispatch performs (`zaya_jax.parallel.dispatch.sort_by_key(class_M, X)`).
  """
  m, x = logits_MX.shape
  probs_MX = jax.nn.softmax(logits_MX.astype(jnp.float32), axis=-1)
  class_M, gate_M = top1(probs_MX, balancing_biases_X)
  order_M = jnp.argsort(class_M, stable=True).astype(jnp.int32)
  inverse_M = jnp.zeros((m,), jnp.int32).at[order_M].set(jnp.arange(m, dtype=jnp.int32))
  group_sizes_X = jnp.bincount(class_M, length=x).astype(jnp.int32)
  group_offsets_X = jnp.cumsum(group_sizes_X) - group_sizes_X
  # Integer outputs carry no gradient (as `stop_gradient` would give them none either).
  return Routing(class_M, gate_M, order_M, inverse_M, group_sizes_X,
                 group_offsets_X.astype(jnp.int32))
