# Shape letters: B T D V L X (see zaya_jax/__init__.py).
"""Jitted train and eval steps: next-token cross-entropy over the loss mask.

The loss runs the tied LM head and the cross-entropy fused
(`zaya_jax.ops.cross_entropy.linear_cross_entropy`): the `[B, T, V]` logits and their gradient
are never stored whole.

The batch is a dict of `[B, T]` arrays from `zaya_jax.data`: `inputs`, `targets` (int32),
`segment_ids` (int32, 0 = padding), `positions` (int32), `loss_mask` (float32).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.config import BalanceConfig
from zaya_jax.model.quantile import BatchBalance
from zaya_jax.ops.cross_entropy import linear_cross_entropy
from zaya_jax.ops.sharding import single_device
from zaya_jax.parallel.context import in_context_order
from zaya_jax.train import balance as balance_lib
from zaya_jax.train.optim import update_or_skip
from zaya_jax.train.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
# Balancing / router metrics of `train_step` that the loop writes to the "train" records.
BALANCE_SCALARS = ("balance/max_over_mean_max", "balance/load_entropy_min",
                   "balance/skip_rate_mean", "router/entropy_mean", "router/z_loss",
                   "router/load_balance_loss")  # float32 []
BALANCE_PER_LAYER = ("balance/max_over_mean", "balance/load_entropy", "balance/skip_rate",
                     "router/entropy", "balance/biases")  # [L] ([L, X] for the biases)


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array,
                  loss_mask_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(sum of -log p(target) over masked tokens, number of masked tokens)`, both float32 [].

  Args:
    logits_BTV: float32 logits.
    targets_BT: int32 next-token ids in [0, V).
    loss_mask_BT: float32 weights, 1 for tokens that count, 0 for padding.
  """
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  mask_BT = loss_mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


def batch_balance_of(cfg: BalanceConfig | None) -> BatchBalance | None:
  """The in-step bias solve of `balance.mode="quantile"` with `quantile_apply="current"`,
  else None (the model routes with its stored biases)."""
  if cfg is None or not cfg.enabled or cfg.mode != "quantile" or cfg.quantile_apply != "current":
    return None
  return BatchBalance(cfg.skip_target, cfg.quantile_sweeps)


def reroutes(cfg: BalanceConfig | None) -> bool:
  """True when the step re-scores its batch with the updated router (`balance.quantile_reroute`
  with "quantile" and `quantile_apply="next"`; "current" ignores the setting)."""
  return (cfg is not None and cfg.enabled and cfg.mode == "quantile"
          and cfg.quantile_apply == "next" and cfg.quantile_reroute)


def _forward(graphdef: nnx.GraphDef, params: nnx.State, model_state: nnx.State, batch: Batch,
             batch_balance: BatchBalance | None = None):
  """`(loss_sum, tokens, aux)` of the model on one batch (aux: expert_counts [L, X],
  dropped_tokens [L], router_entropy [L], router_mean_probs [L, X], router_z2 [L],
  router_probs [L, M, X], routing_biases [L, X]); `batch_balance`: see `ZayaForCausalLM
  .backbone`."""
  # copy=True: fresh Variables at the current trace level. The balancing biases come from the
  # jit trace while `params` come from the grad trace; nnx.scan inside the model refuses
  # Variables created at another trace level.
  model = nnx.merge(graphdef, params, model_state, copy=True)
  x_BTD, aux = model.backbone(batch["inputs"], batch["segment_ids"], batch["positions"],
                              batch_balance)
  # Under context parallelism x_BTD is in the model's zigzag order: targets follow it.
  loss_sum, tokens = linear_cross_entropy(*model.head_inputs(x_BTD),
                                          in_context_order(batch["targets"]),
                                          in_context_order(batch["loss_mask"]))
  return loss_sum, tokens, aux


def expert_load(counts_LX: jax.Array) -> jax.Array:
  """float32 [L, X]: fraction of each layer's non-padding tokens sent to each class (skip last)."""
  return counts_LX / jnp.maximum(jnp.sum(counts_LX, axis=-1, keepdims=True), 1.0)


def _objective(graphdef, params, model_state, batch: Batch, cfg: BalanceConfig | None,
               total_tokens: jax.Array, weight: jax.Array | float):
  """One micro-batch's share of the objective, and its parts.

  objective = loss_sum / total_tokens + weight * (z_loss coef * z + balance coef * lb), with
  `weight` the micro-batch's share of the batch's non-padding tokens (over which the router
  losses are means), so the shares of all micro-batches sum to the whole batch's objective:
  the mean next-token loss over its masked tokens plus its router losses (exactly for the
  z-loss; the switch balance loss, a product of two means, is taken per micro-batch, as
  Megatron-LM does). Returns `(objective, (loss_sum, aux, router))`.
  """
  loss_sum, _, aux = _forward(graphdef, params, model_state, batch, batch_balance_of(cfg))
  router = balance_lib.aux_losses(aux, aux["expert_counts"].shape[-1] - 1)
  objective = loss_sum / total_tokens
  if cfg is not None and cfg.router_z_loss:
    objective = objective + weight * cfg.router_z_loss * router["z_loss"]
  if cfg is not None and cfg.load_balance_loss:
    objective = objective + weight * cfg.load_balance_loss * router["load_balance"]
  return objective, (loss_sum, aux, router)


def rerouted_probs(graphdef: nnx.GraphDef, params: nnx.State, model_state: nnx.State,
                   inputs_LMD: jax.Array) -> jax.Array:
  """float32 [L, M, X], no gradient: the router softmax of this step's router inputs
  `inputs_LMD` [L, M, D] (the forward's aux "router_inputs") under `params`, the parameters
  after the optimizer update (`balance.quantile_reroute`).

  The histogram step then moves the biases to balance this batch as the *updated* router
  scores it, which is how the next batch will be scored: the biases no longer trail the
  router's own step by one update (README "Load balancing"). Only the router MLPs run (EDA
  chained over the layers), on inputs from the pre-update backbone, sharded like the batch.
  Under a mesh the routers' stacked `[L, ...]` parameters are replicated once before the
  layer loop: one all-gather per FSDP-sharded router leaf, not one per layer inside it
  (ZAYA1-base on fsdp 8: 40 otherwise; `launch.balance_cost`).
  """
  params = jax.lax.stop_gradient(params)
  if not single_device():
    replicated = jax.sharding.PartitionSpec()
    params = nnx.map_state(
        lambda path, x: jax.lax.with_sharding_constraint(x, replicated)
        if "router" in path else x, params)
  model = nnx.merge(graphdef, params, model_state, copy=True)
  return model.router_probs(jax.lax.stop_gradient(inputs_LMD))


def micro_batches(batch: Batch, num_micro: int) -> Batch:
  """`[B, ...]` leaves -> `[num_micro, B / num_micro, ...]`; micro-batch j holds rows
  j, j + num_micro, j + 2 num_micro, ... so that, with the batch sharded over devices in
  contiguous blocks of rows, every micro-batch is spread evenly over the same devices.

  Raises:
    ValueError: if B is not divisible by `num_micro`.
  """
  def split(x):
    if x.shape[0] % num_micro:
      raise ValueError(f"batch of {x.shape[0]} sequences is not divisible by "
                       f"train.grad_accum_steps={num_micro}")
    return jnp.swapaxes(x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _loss_and_grads(graphdef, params, model_state, batch: Batch, cfg: BalanceConfig | None,
                    num_micro: int, batch_sharding):
  """Objective, mean loss, masked tokens, aux and router losses of the whole batch, and the
  objective's gradient w.r.t. `params`, accumulated over `num_micro` micro-batches (a
  `lax.scan`; 1 = the whole batch in one pass).

  Aux of several micro-batches: `expert_counts` and `dropped_tokens` summed (so the
  balancing controller sees the whole batch's counts); `router_entropy` and the router
  losses, means over non-padding tokens, averaged with each micro-batch's share of them.
  With "quantile" balancing, aux also holds every token's `router_probs` [L, M, X] (all
  micro-batches') and `valid` bool [M] (non-padding), in the same token order, and
  `routing_biases` [L, X] (with `quantile_apply="current"` the mean over micro-batches of
  the biases each solved for itself), and with `quantile_reroute` every token's
  `router_inputs` [L, M, D] in the same order.
  """
  tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
  total = jnp.maximum(tokens, 1.0)
  grad_fn = jax.value_and_grad(_objective, argnums=1, has_aux=True)
  need_probs = cfg is not None and cfg.enabled and cfg.mode == "quantile" and (
      cfg.quantile_apply == "next")
  need_inputs = reroutes(cfg)
  if num_micro == 1:
    (objective, (loss_sum, aux, router)), grads = grad_fn(
        graphdef, params, model_state, batch, cfg, total, 1.0)
    if need_probs:
      aux = {**aux, "valid": in_context_order(batch["segment_ids"]).reshape(-1) > 0}
    return (objective, loss_sum / total, tokens, aux, router), grads

  non_padding = jnp.maximum(jnp.sum(batch["segment_ids"] > 0), 1).astype(jnp.float32)

  def micro_parts(micro):
    if batch_sharding is not None:
      micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
    weight = jnp.sum(micro["segment_ids"] > 0).astype(jnp.float32) / non_padding
    (objective, (loss_sum, aux, router)), grads = grad_fn(
        graphdef, params, model_state, micro, cfg, total, weight)
    parts = {"objective": objective, "loss_sum": loss_sum,
             "expert_counts": aux["expert_counts"], "dropped_tokens": aux["dropped_tokens"],
             "router_entropy": aux["router_entropy"] * weight,
             "routing_biases": aux["routing_biases"] / num_micro,
             **{k: v * weight for k, v in router.items()}}
    per_token = {k: aux[k] for k in ("router_probs",) * need_probs
                 + ("router_inputs",) * need_inputs}
    return (parts, grads), per_token

  def body(carry, micro):
    summed, per_token = micro_parts(micro)
    return jax.tree.map(jnp.add, carry, summed), per_token

  micros = micro_batches(batch, num_micro)
  shapes = jax.eval_shape(micro_parts, jax.tree.map(lambda x: x[0], micros))[0]
  init = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
  (parts, grads), per_token_n = jax.lax.scan(body, init, micros)
  router = {k: parts[k] for k in ("z_loss", "load_balance")}
  aux = {k: parts[k] for k in ("expert_counts", "dropped_tokens", "router_entropy",
                               "routing_biases")}
  # Tokens in micro-batch order, matching the flattened micro-batch masks: [n, L, m, ...]
  # -> [L, n * m, ...].
  for k, v_nLM_ in per_token_n.items():
    n, l, m = v_nLM_.shape[:3]
    aux[k] = jnp.moveaxis(v_nLM_, 0, 1).reshape(l, n * m, *v_nLM_.shape[3:])
  if need_probs:
    aux["valid"] = in_context_order(micros["segment_ids"], axis=2).reshape(-1) > 0
  return (parts["objective"], parts["loss_sum"] / total, tokens, aux, router), grads


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
               schedule: optax.Schedule, state: TrainState, batch: Batch,
               poison: jax.Array | None = None,
               balance: BalanceConfig | None = None, grad_accum_steps: int = 1,
               batch_sharding=None, balance_rate: optax.Schedule | None = None
               ) -> tuple[TrainState, Metrics]:
  """One optimizer update on the mean next-token loss; gradients w.r.t. `state.params` only.

  An update whose loss or gradient norm is not finite is skipped: parameters, optimizer
  moments, balancing biases and controller state stay as they were, `step` and optax's
  counters still advance (the batch is consumed; the schedule follows the step),
  `skipped_steps` and `consecutive_skips` count it (the loop rolls back after too many in a
  row).

  Args:
    poison: test-only fault injection: a bool [] that, when true, makes this update's loss
      and gradients NaN (see `train.inject_nan_at_steps`); None compiles no injection.
    balance: the `balance` config group. The controller (zaya_jax/train/balance.py) moves
      the router balancing biases in `model_state` from this step's routing counts, for the
      next step; its coefficients add the router z-loss / balance loss to the objective.
      None (the default, for callers that predate it) = controller off, no auxiliary losses:
      `model_state` stays untouched.
    grad_accum_steps: micro-batches the batch is split into (`micro_batches`); their
      gradients are summed before the one update, so the update equals the whole batch's up
      to float summation order, with activation memory for one micro-batch. The controller
      sees the summed routing counts of all micro-batches.
    batch_sharding: the batch's sharding, applied to each micro-batch (None = unconstrained).
    balance_rate: `balance.rate_lr_power`'s factor per step
      (`zaya_jax.train.optim.balance_rate_schedule`): each bias update is scaled by it,
      b <- b + rate(step) * (b_new - b); None = 1 (the update as the controller computed it).

  Returns:
    The new state (step + 1) and metrics: float32 [] `loss` (mean next-token cross-entropy
    over masked tokens; the objective adds the auxiliary losses, if any, to it), `grad_norm`
    (global L2 norm before clipping), `lr` (the rate this update used), `tokens` (masked
    tokens in the batch), `skipped` (1.0 if this update was skipped), int32 `skipped_steps` /
    `consecutive_skips` (after this update), `expert_load` [L, X], `moe/dropped_fraction`,
    `router/z_loss`, `router/load_balance_loss` (unweighted), and per layer
    `balance/max_over_mean` [L] (max / mean expert load, skip excluded),
    `balance/load_entropy` [L] (normalised load entropy H / ln E of the expert shares),
    `balance/skip_rate` [L], `router/entropy` [L] (nats), `balance/biases` [L, X] (after
    this update), with summaries `balance/max_over_mean_max`, `balance/skip_rate_mean`,
    `router/entropy_mean` (float32 []).
  """
  cfg = balance
  (objective, loss, tokens, aux, router), grads = _loss_and_grads(
      graphdef, state.params, state.model_state, batch, cfg, grad_accum_steps, batch_sharding)
  if poison is not None:
    loss = jnp.where(poison, jnp.nan, loss)
    objective = jnp.where(poison, jnp.nan, objective)
    grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(objective) & jnp.isfinite(grad_norm)
  counts_LX = aux["expert_counts"]
  # Skipped: params and moments kept, optax's counters advance with the step (optim.py).
  params, opt_state = update_or_skip(tx, grads, state.opt_state, state.params, state.step, finite)
  model_state, balance_state = state.model_state, state.balance
  if cfg is not None and cfg.enabled:
    if balance_state is None:
      balance_state = balance_lib.init_balance_state(*counts_LX.shape)
    probs_LMX = aux.get("router_probs")
    if reroutes(cfg):
      probs_LMX = rerouted_probs(graphdef, params, state.model_state, aux["router_inputs"])
    model_state, balance_state = balance_lib.update_model_state(
        cfg, state.model_state, balance_state, jax.lax.stop_gradient(counts_LX), finite,
        probs_LMX, aux.get("valid"), aux.get("routing_biases"),
        None if balance_rate is None else balance_rate(state.step))
  skipped = (~finite).astype(jnp.int32)
  new_state = state.replace(
      step=state.step + 1,
      params=params,
      opt_state=opt_state,
      skipped_steps=state.skipped_steps + skipped,
      consecutive_skips=(state.consecutive_skips + 1) * skipped,
      model_state=model_state,
      balance=balance_state,
  )
  stats = balance_lib.load_stats(counts_LX)
  entropy_L = aux["router_entropy"]
  metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": jnp.asarray(schedule(state.step), jnp.float32),
      "tokens": tokens,
      "skipped": skipped.astype(jnp.float32),
      "skipped_steps": new_state.skipped_steps,
      "consecutive_skips": new_state.consecutive_skips,
      "expert_load": expert_load(counts_LX),
      "moe/dropped_fraction": jnp.sum(aux["dropped_tokens"]) / jnp.maximum(jnp.sum(counts_LX), 1.0),
      "router/z_loss": router["z_loss"],
      "router/load_balance_loss": router["load_balance"],
      "balance/max_over_mean": stats["max_over_mean"],
      "balance/max_over_mean_max": jnp.max(stats["max_over_mean"]),
      "balance/load_entropy": stats["load_entropy"],
      "balance/load_entropy_min": jnp.min(stats["load_entropy"]),
      "balance/skip_rate": stats["skip_rate"],
      "balance/skip_rate_mean": jnp.mean(stats["skip_rate"]),
      "router/entropy": entropy_L,
      "router/entropy_mean": jnp.mean(entropy_L),
      "balance/biases": balance_lib.get_biases(model_state),
  }
  return new_state, metrics


def eval_step(graphdef: nnx.GraphDef, state: TrainState, batch: Batch) -> Metrics:
  """Sums for one eval batch: `loss_sum`, `tokens` (float32 []), `expert_counts` [L, X]."""
  loss_sum, tokens, aux = _forward(graphdef, state.params, state.model_state, batch)
  return {"loss_sum": loss_sum, "tokens": tokens, "expert_counts": aux["expert_counts"]}


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, state_shardings=None, batch_sharding=None,
                    fault_injection: bool = False,
                    balance: BalanceConfig | None = None,
                    grad_accum_steps: int = 1,
                    balance_rate: optax.Schedule | None = None
                    ) -> Callable[..., tuple[TrainState, Metrics]]:
  """`train_step` with the static parts bound, jitted; the input state's buffers are donated.

  With `fault_injection` the step takes a third argument, `poison` (bool []; see
  `train_step`), for the loop's test-only `train.inject_nan_at_steps`. `balance`: the
  balancing-bias controller config (see `train_step`; None = off). `grad_accum_steps`:
  micro-batches per update, `balance_rate`: the factor on each bias update (see `train_step`).

  With `state_shardings` (a TrainState of NamedShardings) and `batch_sharding`, the step keeps
  the state in its sharding and metrics replicated; call it inside `jax.set_mesh(mesh)`.
  """
  kw = {}
  if state_shardings is not None:
    kw = dict(in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None))
  if fault_injection:
    if kw:
      kw["in_shardings"] = (*kw["in_shardings"], None)
    return jax.jit(lambda state, batch, poison: train_step(
        graphdef, tx, schedule, state, batch, poison, balance, grad_accum_steps, batch_sharding,
        balance_rate),
                   donate_argnums=0, **kw)
  return jax.jit(lambda state, batch: train_step(
      graphdef, tx, schedule, state, batch, None, balance, grad_accum_steps, batch_sharding,
      balance_rate),
                 donate_argnums=0, **kw)


def make_eval_step(graphdef: nnx.GraphDef, state_shardings=None,
                   batch_sharding=None) -> Callable[[TrainState, Batch], Metrics]:
  """`eval_step` with the graph bound, jitted (shardings as in `make_train_step`)."""
  kw = {} if state_shardings is None else dict(in_shardings=(state_shardings, batch_sharding))
  return jax.jit(lambda state, batch: eval_step(graphdef, state, batch), **kw)
