"""Optimizers (AdamW, or Muon + AdamW), learning-rate schedules and a per-parameter summary.

`train.optimizer="adamw"`: every parameter gets AdamW (decoupled weight decay on matrices
only, see `decay_mask`) after global-norm clipping.

`train.optimizer="muon"`: the hidden weight matrices get Muon (`optax.contrib.scale_by_muon`:
Nesterov momentum, then Newton-Schulz orthogonalisation of each matrix, then optax's
shape scaling, decoupled weight decay and the Muon learning rate); everything else keeps
AdamW as above. Muon parameters (`MUON_NAMES`, by the last part of their path):

  attention  q_proj, k_proj, v_proj_current, v_proj_delayed  [L, D, N, H]: matrix D x (N*H)
             o_proj                                           [L, N, H, D]: matrix (N*H) x D
  experts    w_gate, w_up [L, E, D, F], w_down [L, E, F, D]: one matrix per layer and expert
  router     down_proj [L, D, R], fc1/fc2 [L, R, R], out_proj [L, R, X]: only with
             `train.muon_router=True`

Embeddings (the tied LM head), norms, biases, scales, CCA's conv filters and `temp` stay on
AdamW. The matrix of each Muon parameter is read from its logical axis names (the
`out_sharding` metadata): `layers` and `experts` are batch axes (each layer's/expert's matrix
is orthogonalised on its own), the remaining axes form the reduction (input) group and the
output group in storage order, where adjacent head axes (`q_heads`/`kv_heads` and `head_dim`)
fuse into one matrix dimension.

`train.router_lr_scale` multiplies the updates of every router parameter
(`layers/mlp/router/*`: the MLP's matrices, biases, norm and EDA scale; in whichever group
they are) after the optimizer, i.e. the router trains at its group's lr x the scale; the
optimizer state does not change with it. The default 0.1 keeps the router slow enough for the
lag-one balancing to follow it (README "Load balancing"); 1.0 is ZAYA1's plain recipe.
`train.expert_lr_scale` does the same for the routed experts' weights
(`layers/mlp/experts/{w_gate,w_up,w_down}`); the default 1.0 leaves them at their group's rate.

Schedules (`train.schedule`), both with a linear warm-up from 0 over `train.warmup_steps`,
over the horizon `schedule_horizon(train)` (`train.schedule_steps`, 0 = `num_steps`):
  "cosine"  cosine decay to `peak * min_lr_ratio` at the horizon;
  "wsd"     warm-up, stable at peak, then decay over the last `decay_fraction * horizon`
            steps to `peak * min_lr_ratio`, linear or `1 - sqrt` (`train.decay_shape`).
The Muon group uses the same shape scaled to `train.muon_lr`. Update k (1-based) uses the
shape's value at k: the first update a warm-up fraction 1/warmup_steps of the peak (never 0),
update `warmup_steps` the peak, the first decay update an already decayed rate and the last
update (`num_steps`) the final rate `peak * min_lr_ratio`.

Skipped updates (non-finite loss or gradient, `zaya_jax.train.step`): the schedule follows
the step, not the applied updates. `update_or_skip` keeps parameters and moments on a skip but
sets every optax `count` to the TrainState's step, so the rate of update k is the schedule's
value at k whatever was skipped before it (and after a rollback or a resume), Adam's and
Muon's bias corrections count the same steps, and the logged `lr` is the applied one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers
# `scale_by_shape` is the shape scaling step of `optax.contrib.muon`'s Muon branch; optax
# exports it only from the module (optax is pinned in requirements.txt).
from optax.contrib._muon import scale_by_shape

from zaya_jax.config import TrainConfig

STACKED_AXIS = "layers"  # logical name of the layer axis added by the scan over layers
NO_DECAY_WORDS = ("norm", "scale", "bias", "temp")  # path parts containing these: no decay

# Muon parameters, by the last part of their path.
MUON_ATTENTION = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "o_proj")
MUON_EXPERTS = ("w_gate", "w_up", "w_down")
MUON_ROUTER = ("down_proj", "fc1", "fc2", "out_proj")
# Logical axes that index independent matrices (Muon orthogonalises each one separately).
MUON_BATCH_AXES = (STACKED_AXIS, "experts")
# Logical axes that fuse with an adjacent one of the set into one matrix dimension.
MUON_FUSED_AXES = ("q_heads", "kv_heads", "head_dim")

MUON, ADAMW = "muon", "adamw"  # group labels
ROUTER_MODULE = "router"  # path part of every router parameter (layers/mlp/router/...)
EXPERTS_MODULE = "experts"  # path part of the routed experts' weights (layers/mlp/experts/...)


# --- schedules -------------------------------------------------------------------------------

def make_schedule(train: TrainConfig, peak: float | None = None) -> optax.Schedule:
  """Learning rate per update for one parameter group (`train.schedule`).

  Args:
    train: the training config (schedule, warmup_steps, num_steps, min_lr_ratio,
      decay_fraction, decay_shape).
    peak: the group's peak learning rate; default `train.lr` (the AdamW group).

  Returns:
    A schedule: steps done before an update (int, the TrainState's `step`, which optax's
    `count` equals, see `update_or_skip`) -> that update's learning rate (float32 []). The
    shape f(k) of update k = step + 1: 0 -> `peak` linearly over `warmup_steps` (f(k) =
    peak * k / warmup_steps), then "cosine" to `peak * min_lr_ratio` at k = `num_steps`, or
    "wsd" constant until the last `wsd_decay_steps(train)` updates, which fall linearly (or
    as 1 - sqrt) to `peak * min_lr_ratio` at k = `num_steps`; constant after `num_steps`.
    `num_steps` here is the horizon `schedule_horizon(train)` (`train.schedule_steps`, or
    `train.num_steps` when that is 0).
  """
  shape = _schedule_shape(train, peak)
  return lambda step: shape(step + 1)


def balance_rate_schedule(train: TrainConfig, power: float) -> optax.Schedule:
  """The factor on each balancing-bias update with `balance.rate_lr_power` = `power`.

  Returns:
    steps done before an update (int, the TrainState's `step`) -> float32 []: 1 for the
    `warmup_steps` updates of the warm-up (the router moves fastest there and the balancing
    must keep up at full speed), then `(make_schedule(train)(step) / train.lr) ** power`,
    the AdamW group's rate over its peak: 1 at the peak, `min_lr_ratio ** power` at the
    horizon.
  """
  lr = make_schedule(train)
  return lambda step: jnp.where(step < train.warmup_steps, 1.0,
                                (lr(step) / train.lr) ** power).astype(jnp.float32)


def _schedule_shape(train: TrainConfig, peak: float | None) -> optax.Schedule:
  """f(k) of `make_schedule`, in optax's convention: f(0) = 0, f(horizon) = the end."""
  peak = train.lr if peak is None else peak
  horizon = schedule_horizon(train)
  end = peak * train.min_lr_ratio
  if train.schedule == "cosine" and not train.warmup_steps:
    # optax's warm-up piece of 0 steps logs "A polynomial schedule was set with a non-positive
    # `transition_steps` value" at INFO (every benchmark run); this is the same schedule.
    return optax.cosine_decay_schedule(init_value=peak, decay_steps=horizon, alpha=end / peak)
  if train.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=train.warmup_steps,
        decay_steps=horizon,  # total length, warmup included (optax convention)
        end_value=end,
    )
  if train.schedule != "wsd":
    raise ValueError(f"train.schedule={train.schedule!r} must be 'cosine' or 'wsd'")
  decay_steps = wsd_decay_steps(train)
  stable_steps = horizon - train.warmup_steps - decay_steps
  pieces, lengths = [], []
  if train.warmup_steps:
    pieces.append(optax.linear_schedule(0.0, peak, train.warmup_steps))
    lengths.append(train.warmup_steps)
  if stable_steps or not decay_steps:
    pieces.append(optax.constant_schedule(peak))
    lengths.append(stable_steps)
  if decay_steps:
    if train.decay_shape == "linear":
      pieces.append(optax.linear_schedule(peak, end, decay_steps))
    else:  # "1-sqrt": peak -> end as 1 - sqrt(fraction of the decay done)
      def one_minus_sqrt(count):
        done = jnp.clip(jnp.asarray(count, jnp.float32) / decay_steps, 0.0, 1.0)
        return end + (peak - end) * (1.0 - jnp.sqrt(done))
      pieces.append(one_minus_sqrt)
    lengths.append(decay_steps)
  if len(pieces) == 1:
    return pieces[0]
  return optax.join_schedules(pieces, boundaries=list(np.cumsum(lengths[:-1])))


def schedule_horizon(train: TrainConfig) -> int:
  """Updates over which the schedule runs (steps): `train.schedule_steps`, 0 = `num_steps`.
  After it the learning rate stays at `peak * min_lr_ratio`."""
  return train.schedule_steps or train.num_steps


def wsd_decay_steps(train: TrainConfig) -> int:
  """Steps of the "wsd" decay phase: `round(decay_fraction * schedule_horizon(train))`."""
  return int(round(train.decay_fraction * schedule_horizon(train)))


def update_or_skip(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                   step: jax.Array, finite: jax.Array) -> tuple[Any, Any]:
  """One optimizer update, or a skipped one, with optax's step counters tied to `step`.

  Every `count` field of the optax state (Adam's and Muon's bias-correction counters, the
  learning-rate schedules' counters) is set to `step` before the update, so the update uses
  `schedule(step)` and bias corrections for `step + 1` updates, and leaves them at `step + 1`
  also when the update is skipped: moments and parameters then keep their old values (the
  non-finite gradient never reaches them), the counters still advance with the step. A
  state whose counters lag its step (skips in a checkpoint written before this rule) is
  realigned by its first update.

  Args:
    tx: the optimizer (`make_optimizer`).
    grads, params: gradient and parameter trees (float32, same structure).
    opt_state: `tx`'s state over `params`.
    step: int32 [], updates done before this one (the TrainState's `step`).
    finite: bool [], False to skip the update.

  Returns:
    `(params, opt_state)` after the update, or the inputs (counters advanced) if skipped.
  """
  def set_counts(state, value):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(value, x.dtype) if _is_count(path) else x, state)

  opt_state = set_counts(opt_state, step)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  return (keep_if_bad(new_params, params),
          set_counts(keep_if_bad(new_opt_state, opt_state), step + 1))


def _is_count(path) -> bool:
  """True for an optax state's step counter (the `count` field of its NamedTuples)."""
  return bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "count"


# --- parameter groups ------------------------------------------------------------------------

def per_layer_ndim(variable: nnx.Variable) -> int:
  """Rank of one layer's slice of `variable`: its ndim minus a leading stacked `layers` axis."""
  names = variable.get_metadata().get("out_sharding")
  ndim = len(variable.shape)
  if names and names[0] == STACKED_AXIS:
    ndim -= 1
  return ndim


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _path_parts(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def path_name(path) -> str:
  """`layers/self_attn/q_proj` for a key path of an nnx.State."""
  return "/".join(_path_parts(path))


def decay_mask(params: nnx.State) -> nnx.State:
  """Same tree as `params` (a prefix of it, for optax): True where AdamW weight decay applies.

  Args:
    params: the `nnx.Param` state of the model (concrete or abstract).

  Returns:
    A tree of bools: True for matrices per layer (rank >= 2) not named like a norm, scale,
    bias or temperature.
  """
  def decays(path, v: nnx.Variable) -> bool:
    parts = [p.lower() for p in _path_parts(path)]
    named = any(w in p for p in parts for w in NO_DECAY_WORDS)
    return per_layer_ndim(v) >= 2 and not named

  return jax.tree_util.tree_map_with_path(decays, params, is_leaf=_is_var)


def muon_names(train: TrainConfig) -> tuple[str, ...]:
  """Last path parts of the parameters that Muon trains under `train` (router if asked)."""
  return MUON_ATTENTION + MUON_EXPERTS + (MUON_ROUTER if train.muon_router else ())


def muon_dimension_numbers(name: str, variable: nnx.Variable) -> MuonDimensionNumbers:
  """Muon's reshape of one parameter, from its logical axis names.

  `layers` and `experts` are batch axes; the other axes, in storage order, form exactly two
  groups, the reduction (input) axes then the output axes, where adjacent axes among
  `q_heads`/`kv_heads`/`head_dim` form one group. E.g. q_proj `(layers, embed, q_heads,
  head_dim)` -> reduction (1,), output (2, 3); w_down `(layers, experts, expert_mlp, embed)`
  -> reduction (2,), output (3,).

  Args:
    name: the parameter's path (for errors).
    variable: the parameter, with `out_sharding` metadata (one logical name per axis).

  Raises:
    ValueError: the variable has no logical axis names, or its non-batch axes do not form
      exactly two groups (it is not a stack of matrices).
  """
  names = variable.get_metadata().get("out_sharding")
  if not names or len(names) != len(variable.shape):
    raise ValueError(f"Muon parameter {name} {tuple(variable.shape)} has no logical axis names "
                     f"(out_sharding={names!r}); give it one name per axis")
  groups: list[list[int]] = []
  for i, n in enumerate(names):
    if n in MUON_BATCH_AXES:
      continue
    fuses = (groups and n in MUON_FUSED_AXES and groups[-1][-1] == i - 1
             and names[i - 1] in MUON_FUSED_AXES)
    if fuses:
      groups[-1].append(i)
    else:
      groups.append([i])
  if len(groups) != 2:
    raise ValueError(f"Muon parameter {name} with axes {tuple(names)} is not a stack of "
                     f"matrices: its non-batch axes form {len(groups)} groups, not 2 "
                     f"(batch axes: {MUON_BATCH_AXES})")
  return MuonDimensionNumbers(reduction_axis=tuple(groups[0]), output_axis=tuple(groups[1]))


def param_groups(train: TrainConfig, params: nnx.State) -> dict[str, MuonDimensionNumbers | None]:
  """`{path: dimension numbers}` for Muon parameters, `{path: None}` for AdamW ones.

  Every parameter is AdamW under `train.optimizer="adamw"`.

  Raises:
    ValueError: a Muon parameter whose axes do not describe a stack of matrices.
  """
  chosen = muon_names(train) if train.optimizer == MUON else ()
  groups = {}
  for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var):
    name = path_name(path)
    groups[name] = (muon_dimension_numbers(name, v) if _path_parts(path)[-1] in chosen
                    else None)
  return groups


# --- optimizer -------------------------------------------------------------------------------

def _adamw(train: TrainConfig, params: nnx.State) -> optax.GradientTransformation:
  return optax.adamw(
      learning_rate=make_schedule(train),
      b1=train.b1,
      b2=train.b2,
      eps=train.eps,
      weight_decay=train.weight_decay,
      mask=decay_mask(params),
  )


def _muon(train: TrainConfig, groups: dict[str, MuonDimensionNumbers | None]
          ) -> optax.GradientTransformation:
  """The Muon branch of `optax.contrib.muon`, on the Muon-labelled part of the tree."""

  def dim_nums(updates):
    # Inside optax.partition the AdamW parameters are MaskedNodes; mapping over each subtree
    # keeps those (they have no leaves) and puts the dimension numbers inside each Variable,
    # so the result has exactly the tree structure of `updates`.
    return jax.tree_util.tree_map_with_path(
        lambda path, sub: jax.tree.map(lambda _: groups[path_name(path)], sub), updates,
        is_leaf=lambda x: _is_var(x) or isinstance(x, optax.MaskedNode))

  return optax.chain(
      optax.contrib.scale_by_muon(
          ns_steps=train.muon_ns_steps,
          beta=train.muon_momentum,
          nesterov=True,
          weight_dimension_numbers=dim_nums,
      ),
      scale_by_shape(weight_dimension_numbers=dim_nums,
                     consistent_rms=train.muon_consistent_rms or None),
      optax.add_decayed_weights(train.muon_weight_decay),
      optax.scale_by_learning_rate(make_schedule(train, train.muon_lr)),
  )


def make_optimizer(train: TrainConfig, params: nnx.State) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip_norm)` then AdamW, or Muon + AdamW (`train.optimizer`).

  Args:
    train: the training config (optimizer, schedule, lrs, betas, eps, weight decays, clip norm,
      Muon settings).
    params: the trainable state (concrete or abstract); its paths, shapes and logical axis
      names choose each parameter's group and Muon's matrix axes.

  Returns:
    The optax transformation over `params`. With `optimizer="muon"` it is an
    `optax.multi_transform` with groups "muon" and "adamw" (see the module docstring).

  Raises:
    ValueError: a Muon parameter whose axes do not describe a stack of matrices.
  """
  if train.optimizer == ADAMW:
    tx = _adamw(train, params)
  else:
    groups = param_groups(train, params)
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: ADAMW if groups[path_name(path)] is None else MUON, params,
        is_leaf=_is_var)
    tx = optax.multi_transform({MUON: _muon(train, groups), ADAMW: _adamw(train, params)},
                               labels)
  if train.router_lr_scale != 1.0 or train.expert_lr_scale != 1.0:
    tx = _scale_updates(tx, lambda path: lr_scale(train, path))
  if train.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(train.grad_clip_norm), tx)
  return tx


def is_router_path(path) -> bool:
  """True for a parameter of the router MLP (a key path with a `router` part)."""
  return ROUTER_MODULE in _path_parts(path)


def is_expert_path(path) -> bool:
  """True for a routed expert's weight (`.../experts/w_gate|w_up|w_down`, with or without the
  Variable's trailing `value` key)."""
  parts = _path_parts(path)
  return any(a == EXPERTS_MODULE and b in MUON_EXPERTS for a, b in zip(parts, parts[1:]))


def lr_scale(train: TrainConfig, path) -> float:
  """The multiple of its group's learning rate a parameter trains at: `train.router_lr_scale`
  for the router, `train.expert_lr_scale` for the routed experts' weights, else 1."""
  if is_router_path(path):
    return train.router_lr_scale
  if is_expert_path(path):
    return train.expert_lr_scale
  return 1.0


def _scale_updates(tx: optax.GradientTransformation, scale_of_path
                   ) -> optax.GradientTransformation:
  """`tx` with each parameter's update multiplied by `scale_of_path(path)` (`lr_scale`).

  The updates are scaled after `tx` has applied its learning rate and decoupled weight decay,
  so a parameter trains exactly as with its group's peak lr x its scale (the decay term scales
  with the lr as in optax). The state is `tx`'s own (no extra leaves), so checkpoints restore
  whatever the scales.
  """
  def update(updates, state, params=None):
    updates, state = tx.update(updates, state, params)
    updates = jax.tree_util.tree_map_with_path(
        lambda path, u: u if (k := scale_of_path(path)) == 1.0 else u * k, updates)
    return updates, state

  return optax.GradientTransformation(tx.init, update)


# --- summary ---------------------------------------------------------------------------------

def describe_optimizer(train: TrainConfig, params: nnx.State) -> str:
  """A table of every parameter once: group, peak lr, weight decay, shape, Muon's axes.

  Args:
    train: the training config.
    params: the trainable state (concrete or abstract).

  Returns:
    Multi-line text: a header (optimizer, schedule, clipping) and one row per parameter
    path with its group ("muon" or "adamw"), peak learning rate, weight decay (0 where the
    decay mask excludes it), shape and, for Muon, the batch / reduction / output axes as
    logical names (`layers,experts / embed / expert_mlp`), then the parameter count per group.
  """
  groups = param_groups(train, params)
  mask = {path_name(p): bool(m) for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(params))}
  sched = f"{train.schedule} (warmup {train.warmup_steps}, {schedule_horizon(train)} steps"
  if train.schedule == "wsd":
    sched += f", {train.decay_shape} decay over the last {wsd_decay_steps(train)}"
  sched += f", final lr = peak * {train.min_lr_ratio:g})"
  lines = [f"optimizer: {train.optimizer}; schedule: {sched}; clip global norm: "
           f"{train.grad_clip_norm:g}" + ("" if train.grad_clip_norm > 0 else " (off)")]
  if train.optimizer == MUON:
    lines.append(f"muon: momentum {train.muon_momentum:g} (Nesterov), {train.muon_ns_steps} "
                 "Newton-Schulz steps, scaling " + (
                     f"consistent RMS {train.muon_consistent_rms:g}" if train.muon_consistent_rms
                     else "sqrt(max(1, fan_out/fan_in))")
                 + f", router {'on' if train.muon_router else 'off'}")
  rows = []
  counts = {MUON: 0, ADAMW: 0}
  for path, v in jax.tree_util.tree_leaves_with_path(params, is_leaf=_is_var):
    name = path_name(path)
    dn = groups[name]
    counts[ADAMW if dn is None else MUON] += int(np.prod(v.shape))
    scale = lr_scale(train, path)
    if dn is None:
      row = [name, ADAMW, f"{train.lr * scale:g}", f"{train.weight_decay if mask[name] else 0.0:g}",
             str(tuple(v.shape)), ""]
    else:
      axes = v.get_metadata()["out_sharding"]
      red, out = tuple(dn.reduction_axis), tuple(dn.output_axis)
      batch = [a for a in range(len(axes)) if a not in red + out]
      fmt = lambda ix: ",".join(axes[i] or f"#{i}" for i in ix) or "-"  # #i: unnamed axis i
      row = [name, MUON, f"{train.muon_lr * scale:g}", f"{train.muon_weight_decay:g}",
             str(tuple(v.shape)), f"{fmt(batch)} / {fmt(red)} / {fmt(out)}"]
    rows.append(row)
  header = ["parameter", "group", "peak lr", "wd", "shape", "muon batch / reduction / output"]
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt_row = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  lines += [fmt_row(header), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]
  lines.append(f"parameters: muon {counts[MUON]:,}, adamw {counts[ADAMW]:,}")
  return "\n".join(lines)

