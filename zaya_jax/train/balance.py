# Shape letters: L X E (see zaya_jax/__init__.py).
"""Aux-loss-free load balancing: the router's balancing biases, moved outside the gradient.

The router picks `argmax(softmax(logits) + b)` per token (zaya_jax/model/router.py); the
biases `b` [L, X] (`BalancingBias`, in `TrainState.model_state`) never see a gradient. After
each train step's forward, `update_model_state` moves them from that step's routing over the
whole global batch, for the next step (paper §2; DeepSeek-V3's "auxiliary-loss-free"
balancing; ZAYA1-8B report §II-A.2). Four rules (`balance.mode`):

  "quantile"  (default, `quantile_apply="next"`, `quantile_reroute`) every class's bias
              moves by minus the quantile of its tokens' score gaps that would have given it
              its share of this step's batch, read from one all-reduced histogram
              [L, X, 162] (`zaya_jax.model.quantile.histogram_biases`; `quantile_iters` such
              steps, each `quantile_step` of the way), mixed by the EMA
              `b <- ema * b + (1 - ema) * solved`. With `quantile_reroute` (default) the
              histogram is read from this batch's router inputs re-scored by the router
              *after* the optimizer update (`zaya_jax.train.step.rerouted_probs`), i.e. as
              the next step's router will score tokens: the biases then do not trail the
              router's own step. Without it, the scores are the forward pass's (the router
              before the update), and `quantile_integral` ki (0.15 was the tuned value
              then; default 0) adds ki times the running sum I of the solved shifts
              d = solved - b (I <- I + d, in the controller state's `integral`):
              b <- b + (1 - ema) d + ki I, a type-2 loop against the constant lag of the
              EMA step behind a drifting router. The next steps are routed with the
              result, so the rule is causal.
              With `quantile_apply="current"` (opt-in, not causal) each layer solves exact
              biases from the batch it routes and routes that batch with them (even to a
              token every step, ~35 sequential all-reduces per class and sweep); the stored
              biases (for evaluation and export) are the last solve's.
  "adamw"     ZAYA1's rule: an AdamW of its own (`balance.adamw_*`) on the biases, with the
              "gradient" g[l, x] = share[l, x] - 1/E = -e[l, x] (error below).
  "pid"       delta = kp * e + ki * integral + kd * (e - e_prev),
              integral <- clip(integral + e, -integral_clamp, integral_clamp) (anti-windup).
  "sign"      delta = rate * sign(e)   (DeepSeek-V3; integral stays 0).

Error (a fraction of tokens, in [-1, 1]), per layer l, from `counts[l, x]` (non-padding tokens
routed to class x this step, summed over the whole global batch):
  experts x < E:  e[l, x] = 1/E - counts[l, x] / sum_{y<E} counts[l, y]
    the target is uniform over the tokens that went to *an expert*, so the expert controller
    is independent of how many tokens skip; the E errors sum to 0 in every layer;
  skip x = E:     e[l, E] = skip_target - counts[l, E] / sum_{y<=E} counts[l, y]
    only with `balance.skip_target` >= 0; otherwise 0 and the skip bias keeps its value.
  A layer with no (expert-routed) tokens this step has error 0.

For "adamw", "pid" and "sign" the bias moves by the increment `delta` (velocity form):
  experts: delta[l, :E] -= mean_x delta[l, :E]  (centred: the expert updates never shift the
           experts' mean bias against the skip bias, so they do not move tokens to or from the
           skip class; the skip controller alone does that)
  b <- b + delta, then clip to [-bias_clamp, bias_clamp] if bias_clamp > 0; e_prev <- e.
For "pid", because the bias accumulates the increments, `kp` acts as the integral gain of a
classic PID on the bias, `kd` as its proportional gain and `ki` as a second integrator. The
skip class, in every mode: its bias stays at its initial value (-1: the skip class then
practically never wins) unless `skip_target` is set, in which case the same rule drives the
skip share to that target. With `balance.rate_lr_power` p > 0 every rule's update is scaled
after the warm-up, b <- b + (lr(step) / train.lr)^p (b_new - b) (`update_model_state`'s
`rate`, from `zaya_jax.train.optim.balance_rate_schedule`). The layers named in
`balance.exclude_layers` keep their biases whatever the rule computes (a diagnostic). A skipped (non-finite) step, or
`balance.enabled=False`, changes neither biases nor controller state. Bias units are probability units (added to softmax
probabilities), so exports keep HF's `argmax(p + b)` layout.

The controller state (`init_balance_state`) has the same leaves in every mode (the PID's
integral and last error, the AdamW moments and count), so a run may change `balance.mode` on
resume; it is checkpointed with the step (`train_meta`).

Optional auxiliary losses, for comparison (coefficients default 0, i.e. off):
  router z-loss   mean over layers of mean over tokens of logsumexp(logits)^2;
  switch balance  mean over layers of E * sum_{x<E} f[l, x] * P[l, x], f the fraction of
                  tokens routed to expert x (no gradient), P the mean router probability of x.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.config import BalanceConfig
from zaya_jax.model.router import BalancingBias
from zaya_jax.model.quantile import histogram_biases

# {"integral", "prev_error": float32 [L, X], "adamw": the optax AdamW state over [L, X] biases}
BalanceState = dict[str, Any]


def bias_optimizer(cfg: BalanceConfig) -> optax.GradientTransformation:
  """The biases' own AdamW ("adamw" mode): `balance.adamw_lr`, betas, eps, weight decay."""
  return optax.adamw(cfg.adamw_lr, b1=cfg.adamw_b1, b2=cfg.adamw_b2, eps=cfg.adamw_eps,
                     weight_decay=cfg.adamw_weight_decay)


def init_balance_state(num_layers: int, num_classes: int) -> BalanceState:
  """Zero controller state, the same leaves for every mode: `integral`, `prev_error` float32
  [L, X] (X = E + 1), and `adamw`, the AdamW state (count int32 [], moments float32 [L, X])."""
  zeros = lambda: jnp.zeros((num_layers, num_classes), jnp.float32)
  return {"integral": zeros(), "prev_error": zeros(),
          "adamw": bias_optimizer(BalanceConfig(mode="adamw")).init(zeros())}


def _is_bias(x: Any) -> bool:
  return isinstance(x, BalancingBias)


def get_biases(model_state: nnx.State) -> jax.Array:
  """The balancing biases float32 [L, X] held in `model_state`.

  Raises:
    ValueError: if `model_state` does not hold exactly one `BalancingBias` variable.
  """
  found = [v for v in jax.tree.leaves(model_state, is_leaf=_is_bias) if _is_bias(v)]
  if len(found) != 1:
    raise ValueError(f"expected one BalancingBias [L, X] in the model state, found {len(found)}")
  return found[0][...]


def set_biases(model_state: nnx.State, biases_LX: jax.Array) -> nnx.State:
  """A copy of `model_state` whose `BalancingBias` holds `biases_LX` (other leaves shared)."""
  return jax.tree.map(lambda v: v.replace(biases_LX) if _is_bias(v) else v, model_state,
                      is_leaf=_is_bias)


def balance_error(counts_LX: jax.Array, skip_target: float | None) -> jax.Array:
  """float32 [L, X]: target share minus observed share (module docstring), skip class last.

  Args:
    counts_LX: float32 non-padding tokens routed to each class this step.
    skip_target: target fraction of all tokens for the skip class; None or < 0 = off (0 error).
  """
  counts_LX = counts_LX.astype(jnp.float32)
  e = counts_LX.shape[-1] - 1
  expert_LE = counts_LX[:, :e]
  expert_total_L1 = jnp.sum(expert_LE, axis=-1, keepdims=True)
  err_LE = 1.0 / e - expert_LE / jnp.maximum(expert_total_L1, 1.0)
  err_LE = jnp.where(expert_total_L1 > 0, err_LE, 0.0)
  if skip_target is None or skip_target < 0:
    err_L1 = jnp.zeros_like(expert_total_L1)
  else:
    total_L1 = jnp.sum(counts_LX, axis=-1, keepdims=True)
    err_L1 = skip_target - counts_LX[:, e:] / jnp.maximum(total_L1, 1.0)
    err_L1 = jnp.where(total_L1 > 0, err_L1, 0.0)
  return jnp.concatenate([err_LE, err_L1], axis=-1)


def clamp_controlled(cfg: BalanceConfig, biases_LX: jax.Array) -> jax.Array:
  """`biases_LX` [L, X] with the controlled classes (the experts, and the skip class when
  `skip_target` is set) clipped to [-bias_clamp, bias_clamp]; unchanged if bias_clamp is 0."""
  if cfg.bias_clamp <= 0:
    return biases_LX
  e = biases_LX.shape[-1] - 1
  controlled_X = jnp.arange(e + 1) < (e + 1 if cfg.skip_controlled else e)
  return jnp.where(controlled_X, jnp.clip(biases_LX, -cfg.bias_clamp, cfg.bias_clamp), biases_LX)


def controller_step(cfg: BalanceConfig, biases_LX: jax.Array, state: BalanceState,
                    counts_LX: jax.Array,
                    apply: jax.Array | bool = True) -> tuple[jax.Array, BalanceState]:
  """One "pid", "sign" or "adamw" update: `(new biases [L, X], new state)` from this step's
  counts (module docstring).

  Args:
    cfg: the `balance` config group.
    biases_LX: float32 current balancing biases (skip class last).
    state: controller state from `init_balance_state` (or the previous step).
    counts_LX: float32 non-padding tokens routed to each class this step (global batch).
    apply: bool []; where false (a skipped, non-finite step) biases and state are returned
      unchanged.

  Returns:
    Biases and state for the next step; unchanged when `cfg.enabled` is False.
  """
  if not cfg.enabled:
    return biases_LX, state
  if cfg.mode == "quantile":
    raise ValueError("controller_step takes the 'pid', 'sign' and 'adamw' modes; "
                     "'quantile' needs the router probabilities (quantile_step)")
  e = biases_LX.shape[-1] - 1
  err_LX = balance_error(counts_LX, cfg.skip_target)
  integral_LX, adamw_state = state["integral"], state["adamw"]
  if cfg.mode == "sign":
    delta_LX = cfg.rate * jnp.sign(err_LX)
  elif cfg.mode == "adamw":  # the gradient of the ZAYA1 rule: share - target = -error
    delta_LX, adamw_state = bias_optimizer(cfg).update(-err_LX, adamw_state, biases_LX)
  else:
    integral_LX = jnp.clip(integral_LX + err_LX, -cfg.integral_clamp, cfg.integral_clamp)
    delta_LX = cfg.kp * err_LX + cfg.ki * integral_LX + cfg.kd * (err_LX - state["prev_error"])
  expert_LE = delta_LX[:, :e] - jnp.mean(delta_LX[:, :e], axis=-1, keepdims=True)
  skip_on = cfg.skip_controlled
  skip_L1 = delta_LX[:, e:] if skip_on else jnp.zeros_like(delta_LX[:, e:])
  new_LX = biases_LX + jnp.concatenate([expert_LE, skip_L1], axis=-1)
  new_LX = clamp_controlled(cfg, new_LX)
  new_state = {"integral": integral_LX, "prev_error": err_LX, "adamw": adamw_state}
  keep = lambda new, old: jnp.where(apply, new, old)
  return keep(new_LX, biases_LX), jax.tree.map(keep, new_state, state)


def quantile_step(cfg: BalanceConfig, biases_LX: jax.Array, state: BalanceState,
                  probs_LMX: jax.Array, valid_M: jax.Array, apply: jax.Array | bool = True,
                  solved_LX: jax.Array | None = None) -> tuple[jax.Array, BalanceState]:
  """One "quantile" update: `(biases for the next step [L, X], state)`.

  With `quantile_apply="current"` the model already solved the biases while routing this
  batch (`solved_LX`, `zaya_jax.model.quantile.BatchBalance`); they are stored (with the EMA)
  for evaluation, export and the next step's warm start.

  Args:
    cfg: the `balance` config group (`quantile_ema`, `quantile_integral`, `quantile_iters`,
      `quantile_step`, `skip_target`, `bias_clamp`).
    biases_LX: float32 current balancing biases (skip class last): the solve's warm start.
    state: controller state; with `quantile_apply="next"` and `quantile_integral` > 0 its
      `integral` [L, X] accumulates the solved shifts (probability units), else passed through.
    probs_LMX: float32 router softmax of every token of this step's global batch, per layer.
    valid_M: bool, True for non-padding tokens.
    apply: bool []; where false (a skipped, non-finite step) the biases stay as they are.
    solved_LX: the biases the batch was routed with ("current"); None: solve them here.
  """
  if not cfg.enabled:
    return biases_LX, state
  integrate = solved_LX is None and cfg.quantile_integral > 0
  if solved_LX is None:
    solved_LX = histogram_biases(jax.lax.stop_gradient(probs_LMX), valid_M, biases_LX,
                                 cfg.skip_target, cfg.quantile_iters, cfg.quantile_step)
  new_LX = cfg.quantile_ema * biases_LX + (1.0 - cfg.quantile_ema) * solved_LX
  if not integrate:
    return jnp.where(apply, clamp_controlled(cfg, new_LX), biases_LX), state
  # Type-2 loop: the running sum of the solved shifts tracks a drifting router.
  integral_LX = state["integral"] + (solved_LX - biases_LX)
  new_LX = new_LX + cfg.quantile_integral * integral_LX
  new_state = dict(state, integral=jnp.where(apply, integral_LX, state["integral"]))
  return jnp.where(apply, clamp_controlled(cfg, new_LX), biases_LX), new_state


def update_model_state(cfg: BalanceConfig, model_state: nnx.State, state: BalanceState,
                       counts_LX: jax.Array, apply: jax.Array | bool = True,
                       probs_LMX: jax.Array | None = None, valid_M: jax.Array | None = None,
                       routing_biases_LX: jax.Array | None = None,
                       rate: jax.Array | None = None) -> tuple[nnx.State, BalanceState]:
  """The `balance.mode` update of the biases inside `model_state`: `(new model_state, state)`.

  Args:
    counts_LX: float32 non-padding tokens routed to each class this step (global batch).
    apply: bool []; false for a skipped (non-finite) step: nothing changes.
    probs_LMX, valid_M: the router probabilities of every token and the non-padding mask
      (`quantile_step`); needed by "quantile" only.
    routing_biases_LX: the biases the batch was routed with (the model's aux); used by
      "quantile" with `quantile_apply="current"`, where the model solved them.
    rate: float32 [] or None; the update is scaled by it, b <- b + rate * (b_new - b)
      (`balance.rate_lr_power`); the controller state moves as computed. None = 1.
      The layers of `balance.exclude_layers` keep their biases (their state moves as
      computed and is never applied).

  Raises:
    ValueError: "quantile" mode without `probs_LMX` / `valid_M` (or, with "current",
      `routing_biases_LX`).
  """
  biases_LX = get_biases(model_state)
  if cfg.mode == "quantile":
    solved = routing_biases_LX if cfg.quantile_apply == "current" else None
    if solved is None and (probs_LMX is None or valid_M is None):
      raise ValueError("balance.mode='quantile' needs the router probabilities of the batch")
    new_LX, new_state = quantile_step(cfg, biases_LX, state, probs_LMX, valid_M, apply, solved)
  else:
    new_LX, new_state = controller_step(cfg, biases_LX, state, counts_LX, apply)
  if rate is not None:
    new_LX = biases_LX + rate * (new_LX - biases_LX)
  if cfg.exclude_layers:
    kept_L = jnp.isin(jnp.arange(biases_LX.shape[0]), jnp.asarray(cfg.exclude_layers))
    new_LX = jnp.where(kept_L[:, None], biases_LX, new_LX)
  return set_biases(model_state, new_LX), new_state


def load_stats(counts_LX: jax.Array) -> dict[str, jax.Array]:
  """Per-layer load statistics of one step's routing counts (float32 [L, X]).

  Returns:
    `max_over_mean` [L]: max over experts of the expert load / mean expert load (1 = perfect
    balance, E = all expert-routed tokens on one expert; 1 for a layer with no expert tokens),
    `load_entropy` [L]: normalised router-load entropy H(q) / ln E of the expert shares q of
    the expert-routed tokens (ZAYA1-8B report, Fig. 4: 1 = uniform, 0 = one expert; 1 for a
    layer with no expert tokens, and for E = 1, where ln E = 0),
    `skip_rate` [L]: fraction of non-padding tokens routed to the skip class.
  """
  counts_LX = counts_LX.astype(jnp.float32)
  e = counts_LX.shape[-1] - 1
  expert_LE = counts_LX[:, :e]
  mean_L = jnp.mean(expert_LE, axis=-1)
  max_over_mean = jnp.where(mean_L > 0, jnp.max(expert_LE, axis=-1) / jnp.maximum(mean_L, 1e-30), 1.0)
  q_LE = expert_LE / jnp.maximum(jnp.sum(expert_LE, axis=-1, keepdims=True), 1e-30)
  entropy_L = -jnp.sum(jnp.where(q_LE > 0, q_LE * jnp.log(jnp.where(q_LE > 0, q_LE, 1.0)), 0.0), -1)
  if e == 1:  # one expert (a dense model): its load is even by definition; ln 1 = 0
    load_entropy = jnp.ones_like(mean_L)
  else:
    load_entropy = jnp.where(mean_L > 0, jnp.clip(entropy_L / jnp.log(float(e)), 0.0, 1.0), 1.0)
  skip_rate = counts_LX[:, e] / jnp.maximum(jnp.sum(counts_LX, axis=-1), 1.0)
  return {"max_over_mean": max_over_mean, "load_entropy": load_entropy, "skip_rate": skip_rate}


def aux_losses(aux: dict[str, jax.Array], num_experts: int) -> dict[str, jax.Array]:
  """Auxiliary router losses (float32 [], means over layers) from the model's aux dict.

  Args:
    aux: `model(..., return_aux=True)[1]`: `expert_counts` [L, X], `router_mean_probs`
      [L, X] (mean softmax over non-padding tokens), `router_z2` [L] (mean logsumexp^2).
    num_experts: E.

  Returns:
    `z_loss` (router z-loss) and `load_balance` (switch-style, = 1 under uniform routing to
    the experts with no skips).
  """
  counts_LX = jax.lax.stop_gradient(aux["expert_counts"])
  f_LE = counts_LX[:, :num_experts] / jnp.maximum(jnp.sum(counts_LX, -1, keepdims=True), 1.0)
  p_LE = aux["router_mean_probs"][:, :num_experts]
  balance = num_experts * jnp.sum(f_LE * p_LE, axis=-1)
  return {"z_loss": jnp.mean(aux["router_z2"]), "load_balance": jnp.mean(balance)}
