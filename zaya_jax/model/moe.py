# Shape letters: B T D M R X E (see zaya_jax/__init__.py).
"""The MoE block: router -> dispatch (sort by expert, EP exchange) -> experts -> combine -> gate.

Skip class (index E) semantics are a config value (`ModelConfig.skip_mode`):
- `"zero"`: a skipped token's MoE output is 0 (HF `ZayaSparseMoeBlock`);
- `"scaled_identity"`: it is `gate * x`, x the MoE input (Zyphra's original trainer).
Both agree while the skip class cannot win (released checkpoints: skip bias -1). A token
dropped by a capacity-limited dispatch is treated exactly like a skipped one.

Under a device mesh (`jax.set_mesh`) with more than one device, dispatch, the experts and
combine run per shard inside one `jax.shard_map`: tokens stay sharded over every batch axis
and `context` (a sequence shard dispatches only its own tokens), experts are split over `expert`, and the strategy is `ModelConfig.moe_dispatch`
(zaya_jax/parallel/dispatch.py). Without a mesh the same code runs with `LocalDispatch`.
Matches: HF `ZayaSparseMoeBlock.forward`; spec §2 "Experts".
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallas_kernels.routing import gate_of
from zaya_jax.config.mesh import EXPERT, TOKEN_AXES
from zaya_jax.config.model import ModelConfig
from zaya_jax.model.experts import Experts
from zaya_jax.model.router import Router
from zaya_jax.ops.grouped_matmul import swiglu_experts
from zaya_jax.ops.route import RouteResult
from zaya_jax.ops.sharding import single_device
from zaya_jax.parallel.context import token_order
from zaya_jax.parallel.dispatch import LocalDispatch, make_dispatcher, resolve_dispatch


class MoEOutput(NamedTuple):
  """What `MoE.__call__` returns.

  y_BTD: the gated MoE output (compute dtype); r_BTR: float32 router state after EDA, for the
  next layer; counts_X: float32 non-padding tokens routed to each class; dropped: float32 []
  non-padding tokens dropped by a capacity-limited dispatch; stats: with `router_stats`, a
  dict of float32 means over non-padding tokens, `entropy` [] (-sum_x p log p, nats),
  `mean_probs` [X] (softmax) and `z2` [] (logsumexp(logits)^2), for metrics and the auxiliary
  losses (differentiable), `probs` [M, X], every token's softmax without gradient (quantile
  balancing), and `biases` [X], the balancing biases the tokens were routed with; else None.
  """

  y_BTD: jax.Array
  r_BTR: jax.Array
  counts_X: jax.Array
  dropped: jax.Array
  stats: dict[str, jax.Array] | None = None


def _experts_on_shard(dispatcher, gmm_impl, x_MD, class_M, w_gate, w_up, w_down, vary_axes=()):
  """dispatch -> local grouped SwiGLU -> combine, on one shard's tokens.

  `vary_axes`: mesh axes over which the expert weights enter replicated (data, fsdp). Marking
  them varying here makes their gradient a per-shard `[e, D, F]` sum that shard_map's
  boundary psums once, instead of psumming every intermediate (e.g. per-tile weight copies).
  """
  if vary_axes:
    w_gate, w_up, w_down = (jax.lax.pcast(w, vary_axes, to="varying") for w in (w_gate, w_up, w_down))
  rows_PD, group_sizes, meta = dispatcher.dispatch(x_MD, class_M)
  y_PD = swiglu_experts(rows_PD, w_gate, w_up, w_down, group_sizes, gmm_impl)
  return dispatcher.combine(y_PD, meta)


class MoE(nnx.Module):
  """ZAYA1 MoE block (router + E SwiGLU experts + skip class), top-1, dropless by default."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    self.num_experts = cfg.num_experts
    self.skip_mode = cfg.skip_mode
    self.moe_dispatch = cfg.moe_dispatch
    self.capacity_factor = cfg.capacity_factor
    self.force_balanced_routing = cfg.force_balanced_routing
    self.gmm_impl = cfg.gmm_impl
    self.router = Router(cfg, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)

  def expert_outputs(self, x_MD: jax.Array, class_M: jax.Array, route: RouteResult | None = None):
    """Ungated expert output `[M, D]` (0 for skipped/dropped tokens) and the dropped mask `[M]`.

    `route`: with `routing_impl="pallas"` it carries the permutation grouping tokens by class,
    which the single-shard dispatch then uses instead of sorting.
    """
    weights = self.experts.weights()
    if single_device():
      sorted_by = None
      if route is not None and route.order_M is not None:
        sorted_by = (route.order_M, route.group_sizes_X)
      return _experts_on_shard(LocalDispatch(self.num_experts, sorted_by), self.gmm_impl, x_MD,
                               class_M, *weights)
    mesh = jax.sharding.get_abstract_mesh()
    name = resolve_dispatch(self.moe_dispatch, mesh.shape[EXPERT])
    dispatcher = make_dispatcher(name, self.num_experts, self.capacity_factor)
    # The Pallas gmm in interpret mode trips shard_map's varying-axes checker (see
    # zaya_jax.ops.sharding); without the checker, shard_map's transpose still sums the
    # replicated weights' gradients over the batch axes.
    kernel_gmm = self.gmm_impl == "pallas"
    vary_axes = () if kernel_gmm else tuple(a for a in TOKEN_AXES if a != EXPERT)
    body = functools.partial(_experts_on_shard, dispatcher, self.gmm_impl, vary_axes=vary_axes)
    tokens, experts = P(TOKEN_AXES), P(EXPERT)  # context shards hold their own tokens
    return jax.shard_map(body, in_specs=(tokens, tokens, experts, experts, experts),
                         out_specs=(tokens, tokens), check_vma=not kernel_gmm)(x_MD, class_M, *weights)

  def __call__(self, b_BTD: jax.Array, r_prev_BTR: jax.Array, segment_ids_BT: jax.Array,
               router_stats: bool = False, batch_balance=None) -> MoEOutput:
    """Args: `b_BTD` the post-attention-normed input; `r_prev_BTR` float32 router state of the
    previous layer (zeros for layer 0); `segment_ids_BT` (0 = pad, only for the statistics);
    `router_stats`: also compute `MoEOutput.stats`; `batch_balance` (a
    `zaya_jax.model.quantile.BatchBalance`, training only): route with biases solved from
    this batch's probabilities instead of the stored ones.

    Returns a `MoEOutput`.
    """
    bsz, t, d = b_BTD.shape
    e = self.num_experts
    # Tokens M in the order that keeps each device's tokens (its batch rows and, under
    # context parallelism, its sequence shard) one block of M: the plain reshape without CP.
    to_tokens, from_tokens = token_order(bsz, t)
    x_MD = to_tokens(b_BTD)
    real_M = to_tokens(segment_ids_BT != 0).astype(jnp.float32)
    route, r_MR, probs_MX, logits_MX, biases_X = self.router.route(
        x_MD, to_tokens(r_prev_BTR), with_logits=True, batch_balance=batch_balance,
        valid_M=real_M > 0)
    class_M, gate_M = route.class_M, route.gate_M
    if self.force_balanced_routing:  # debug: round-robin over experts, for throughput runs
      class_M = to_tokens(jnp.arange(bsz * t, dtype=jnp.int32).reshape(bsz, t)) % e
      gate_M = gate_of(probs_MX, class_M)
      route = None
    y_MD, dropped_M = self.expert_outputs(x_MD, class_M, route)
    bypass_M1 = ((class_M == e) | dropped_M)[:, None]
    if self.skip_mode == "scaled_identity":
      y_MD = jnp.where(bypass_M1, x_MD.astype(y_MD.dtype), y_MD)
    else:
      y_MD = jnp.where(bypass_M1, 0, y_MD)
    y_MD = y_MD * gate_M[:, None].astype(y_MD.dtype)
    counts_X = jnp.zeros((e + 1,), jnp.float32).at[class_M].add(real_M)
    dropped = jnp.sum(dropped_M * real_M)
    out = MoEOutput(from_tokens(y_MD), from_tokens(r_MR), counts_X, dropped)
    if not router_stats:
      return out
    n_real = jnp.maximum(jnp.sum(real_M), 1.0)
    mean = lambda v_M: jnp.sum(v_M * real_M) / n_real
    entropy_M = -jnp.sum(probs_MX * jax.nn.log_softmax(logits_MX, axis=-1), axis=-1)
    stats = {"entropy": mean(entropy_M),
             "mean_probs": jnp.sum(probs_MX * real_M[:, None], axis=0) / n_real,
             "z2": mean(jnp.square(jax.nn.logsumexp(logits_MX, axis=-1))),
             # every token's probabilities in [B, T] order (matching the batch's flattened masks)
             "probs": jax.lax.stop_gradient(from_tokens(probs_MX).reshape(bsz * t, -1)),
             "biases": biases_X,
             "inputs": jax.lax.stop_gradient(b_BTD.reshape(bsz * t, d))}
    return out._replace(stats=stats)
