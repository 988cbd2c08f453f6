# Shape letters: M D R X E (see zaya_jax/__init__.py).
"""The ZAYA1 router, spec §2 "ZAYA1 router" (paper §2; HF `ZayaRouter`, `ZayaRouterMLP`).

- Down-projection `D -> R`, then exponential depth averaging (EDA): `r += r_prev * scale`
  with `r_prev` the previous layer's `r` (after its own EDA). Layer 0 receives `r_prev = 0`,
  so its `router_states_scale` has no effect; it exists only to keep the layer stack uniform
  and is dropped at Hugging Face export.
- Router MLP over `r`: RMSNorm -> fc1 -> GELU -> fc2 -> GELU -> out_proj, X = E + 1 classes;
  the last class is the skip class (the token bypasses the experts).
- Top-1 choice by `softmax(logits) + balancing_biases`; the gate is the *unbiased*
  probability of the chosen class, the only path by which the router learns.
- The router always computes in float32: it is tiny and a routing decision must not flip
  with the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.config.model import ModelConfig
from zaya_jax.model.layers import RMSNorm, normal, ones, param, zeros
from zaya_jax.model.quantile import BatchBalance
from zaya_jax.ops.route import RouteResult, route


class BalancingBias(nnx.Variable):
  """Router balancing biases `[X]`, float32: model state set by a load-balancing controller,
  never by gradients (excluded from `nnx.Param` filters), saved in checkpoints and exported
  to HF as `mlp.gate.balancing_biases`. Init 0 for experts and -1 for the skip class."""


class Router(nnx.Module):
  """ZAYA1 router for one layer.

  `__call__(h_MD, r_prev_MR)` returns:
    class_M  int32 in [0, E] (E = skip),
    gate_M   float32 = softmax(logits)[class] (differentiable, not renormalised),
    r_MR     float32 router state after EDA, handed to the next layer,
    probs_MX float32 router probabilities (for metrics and auxiliary losses).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    d, r, x = cfg.hidden_size, cfg.router_hidden_size, cfg.num_router_classes
    init = normal(cfg.initializer_range)
    # The router MLP's own init (ModelConfig.router_init): "fan_in" keeps each layer's output
    # variance, so fresh logits differ between tokens and the balancing biases can split them.
    mlp_init = normal(r ** -0.5) if cfg.router_init == "fan_in" else init
    self.routing_impl = cfg.routing_impl
    self.down_proj = param(rngs, init, (d, r), ("embed", "router"))  # MD,DR->MR
    self.down_bias = param(rngs, zeros, (r,), ("router",))
    self.router_states_scale = param(rngs, ones, (r,), ("router",))  # EDA scale (unused on layer 0)
    self.norm = RMSNorm(r, cfg.rms_norm_eps, name="router", rngs=rngs)
    self.fc1 = param(rngs, mlp_init, (r, r), ("router", None))
    self.fc1_bias = param(rngs, zeros, (r,), (None,))
    self.fc2 = param(rngs, mlp_init, (r, r), ("router", None))
    self.fc2_bias = param(rngs, zeros, (r,), (None,))
    self.out_proj = param(rngs, mlp_init, (r, x), ("router", "classes"))  # MR,RX->MX
    self.balancing_biases = BalancingBias(
        jnp.zeros((x,), jnp.float32).at[-1].set(-1.0), out_sharding=("classes",), eager_sharding=False)

  def __call__(self, h_MD: jax.Array, r_prev_MR: jax.Array):
    result, r_MR, probs_MX = self.route(h_MD, r_prev_MR)
    return result.class_M, result.gate_M, r_MR, probs_MX

  def probabilities(self, h_MD: jax.Array, r_prev_MR: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router MLP without the choice: `(r_MR, logits_MX, probs_MX)`, all float32.

    Args:
      h_MD: the tokens' router inputs [M, D], any float dtype (cast to float32).
      r_prev_MR: float32 router state of the previous layer [M, R] (zeros for layer 0).

    Returns:
      The router state after EDA [M, R], the logits [M, X] and their softmax [M, X]
      (HF `ZayaRouter.forward` up to the biased argmax).
    """
    h = h_MD.astype(jnp.float32)
    r_MR = h @ self.down_proj[...] + self.down_bias[...]
    r_MR = r_MR + r_prev_MR * self.router_states_scale[...]
    z = self.norm(r_MR)
    z = jax.nn.gelu(z @ self.fc1[...] + self.fc1_bias[...], approximate=False)
    z = jax.nn.gelu(z @ self.fc2[...] + self.fc2_bias[...], approximate=False)
    logits_MX = z @ self.out_proj[...]
    return r_MR, logits_MX, jax.nn.softmax(logits_MX, axis=-1)

  def route(self, h_MD: jax.Array, r_prev_MR: jax.Array, with_logits: bool = False,
            batch_balance: BatchBalance | None = None, valid_M: jax.Array | None = None):
    """`(RouteResult, r_MR, probs_MX)`: as `__call__`, plus (with `routing_impl="pallas"`) the
    permutation grouping tokens by class, for the MoE's local dispatch. With
    `with_logits`, two more elements: the float32 router logits `[M, X]` (for the z-loss)
    and the biases `[X]` the tokens were routed with: the stored `balancing_biases`, or,
    with `batch_balance`, those it solves from these tokens' probabilities (`valid_M`: bool
    [M], the tokens that count)."""
    r_MR, logits_MX, probs_MX = self.probabilities(h_MD, r_prev_MR)
    biases_X = self.balancing_biases[...]
    if batch_balance is not None:
      biases_X = batch_balance.solve(jax.lax.stop_gradient(probs_MX), valid_M, biases_X)
    result: RouteResult = route(logits_MX, probs_MX, biases_X, impl=self.routing_impl)
    if with_logits:
      return result, r_MR, probs_MX, logits_MX, biases_X
    return result, r_MR, probs_MX
