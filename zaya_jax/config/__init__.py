"""Validates the ml_collections config once and builds frozen dataclasses from it.

`resolve(config)` is the only place that reads the whole ConfigDict. It returns a `RunConfig`
of small frozen dataclasses (`ModelConfig`, `DataConfig`, `TrainConfig`, `CheckpointConfig`);
every other module takes those. Every error names the offending field and the fix, e.g.

  train.warmup_steps=500 must be < train.num_steps=300; lower the warmup or train longer
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections
from absl import logging

from zaya_jax.data import DataConfig
from zaya_jax.data.tokenizer import SPECIAL_IDS, tokenizer_mismatch
from zaya_jax.config.model import ModelConfig
from zaya_jax.config.mesh import MeshConfig, check_context

GROUPS = ("model", "data", "train", "checkpoint", "mesh", "balance")
# Model fields that change how the model computes, not its parameters: they may differ
# between a checkpoint and the run that resumes from it (tagged in ModelConfig's dataclass).
COMPUTE_ONLY_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                                  if f.metadata.get("compute_only"))
# Model fields a resumed run (or `train.init_from` a checkpoint) may change although they are
# architecture (HF config.json) fields: the RoPE bases, which no parameter depends on. Context
# extension resumes a 4K run at 32K with a larger base (configs/zaya1_base_32k.py).
RESUME_CHANGEABLE_MODEL_FIELDS = ("rope_theta", "rope_theta_sliding")
# Fields that were replaced: `group.field` -> what to set instead (the error names it).
RENAMED_FIELDS = {
    "model.kernels": "model.attention_impl / model.routing_impl / model.gmm_impl='pallas'",
}


# `train.schedule_extend`: what a resume with another `train.num_steps` does to the lr schedule
# (zaya_jax/train/optim.py `extend_schedule`).
SCHEDULE_EXTEND_CHOICES = ("refuse", "constant", "stretch")


class ConfigError(ValueError):
  """An invalid config value; the message names the field (`group.field`) and the fix."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, schedule, logging and evaluation settings (see configs/base.py)."""

  seed: int = 0  # parameter init, training RNG key and data order
  num_steps: int = 100_000  # optimizer steps in the whole run (schedule length)
  max_steps_per_run: int = 0  # leave after this many steps in one process; 0 = no limit
  batch_size: int = 256  # sequences per step, global
  grad_accum_steps: int = 1  # micro-batches per step (gradients summed); batch_size must divide
  seq_len: int = 4096  # tokens per sequence
  lr: float = 3e-4  # peak learning rate
  warmup_steps: int = 2_000  # linear warmup steps
  min_lr_ratio: float = 0.1  # final lr / peak lr
  weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices
  b1: float = 0.9  # AdamW beta1
  b2: float = 0.95  # AdamW beta2
  eps: float = 1e-8  # AdamW epsilon
  grad_clip_norm: float = 1.0  # global-norm clip; 0 = off
  optimizer: str = "adamw"  # "adamw" (all params) | "muon" (hidden matrices Muon, rest AdamW)
  schedule: str = "cosine"  # "cosine" | "wsd" (warmup-stable-decay); both groups, own peak lr
  decay_fraction: float = 0.2  # "wsd": fraction of num_steps (at the end) spent decaying
  decay_shape: str = "linear"  # "wsd": decay to lr*min_lr_ratio "linear" | "1-sqrt"
  muon_lr: float = 0.02  # Muon group's peak learning rate
  muon_weight_decay: float = 0.0  # Muon group's decoupled weight decay (multiplied by the lr)
  muon_momentum: float = 0.95  # Muon's (Nesterov) momentum decay
  muon_ns_steps: int = 5  # Newton-Schulz iterations per Muon update
  muon_router: bool = False  # router matrices (down_proj, fc1, fc2, out_proj) on Muon, not AdamW
  muon_consistent_rms: float = 0.0  # Muon update RMS target (e.g. 0.2 ~ AdamW); 0 = width scaling
  router_lr_scale: float = 0.1  # the router's parameters (layers/mlp/router/*) train at lr x this (0.1: the balancing keeps up; README "Load balancing")
  expert_lr_scale: float = 1.0  # the routed experts' weights (layers/mlp/experts/w_*) train at lr x this
  log_every: int = 50  # steps between log lines
  eval_every: int = 1_000  # steps between evaluations; 0 = only at the end
  eval_batches: int = 16  # batches per evaluation; 0 = no evaluation
  max_consecutive_skips: int = 10  # non-finite updates in a row before rolling back; 0 = never
  skip_data_on_rollback: bool = True  # after a rollback, keep reading after the offending batches
  step_timeout_s: float = 600.0  # watchdog floor (s): a step slower than max(this, factor x median) exits 3; 0 = off
  step_timeout_factor: float = 20.0  # watchdog: multiple of the median step time; 0 = fixed step_timeout_s
  inject_nan_at_steps: tuple[int, ...] = ()  # TEST ONLY: make these updates' loss and grads NaN
  init_from: str = ""  # fresh runs start from these weights: run workdir | checkpoint step dir | HF dir
  schedule_steps: int = 0  # lr schedule horizon in steps; 0 = num_steps (set by schedule_extend)
  schedule_extend: str = "refuse"  # resume with another num_steps: "refuse" | "constant" | "stretch"

  def __post_init__(self):
    for f in ("num_steps", "batch_size", "grad_accum_steps", "seq_len", "log_every"):
      _positive_int(self, "train", f)
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(f"train.batch_size={self.batch_size} is not divisible by "
                        f"train.grad_accum_steps={self.grad_accum_steps}; each micro-batch holds "
                        "batch_size / grad_accum_steps sequences")
    for f in ("seed", "max_steps_per_run", "warmup_steps", "eval_every", "eval_batches",
              "max_consecutive_skips", "schedule_steps"):
      _nonnegative_int(self, "train", f)
    if not isinstance(self.skip_data_on_rollback, bool):
      raise ConfigError(f"train.skip_data_on_rollback={self.skip_data_on_rollback!r} must be "
                        "True or False")
    if not (_is_number(self.step_timeout_s) and self.step_timeout_s >= 0):
      raise ConfigError(f"train.step_timeout_s={self.step_timeout_s!r} must be >= 0 seconds "
                        "(0 = no watchdog)")
    if not (_is_number(self.step_timeout_factor) and self.step_timeout_factor >= 0):
      raise ConfigError(f"train.step_timeout_factor={self.step_timeout_factor!r} must be >= 0 "
                        "(a multiple of the median step time; 0 = train.step_timeout_s alone)")
    if not all(isinstance(s, int) and s >= 1 for s in self.inject_nan_at_steps):
      raise ConfigError(f"train.inject_nan_at_steps={self.inject_nan_at_steps!r} must be a tuple "
                        "of steps >= 1 (a test-only fault injection; leave it empty)")
    if self.warmup_steps >= self.num_steps:
      raise ConfigError(
          f"train.warmup_steps={self.warmup_steps} must be < train.num_steps={self.num_steps}; "
          "lower the warmup or train longer")
    if self.schedule_steps and self.warmup_steps >= self.schedule_steps:
      raise ConfigError(
          f"train.warmup_steps={self.warmup_steps} must be < train.schedule_steps="
          f"{self.schedule_steps} (the schedule's horizon); lower the warmup or set "
          "train.schedule_steps=0 (= train.num_steps)")
    if self.schedule_extend not in SCHEDULE_EXTEND_CHOICES:
      raise ConfigError(f"train.schedule_extend={self.schedule_extend!r} must be one of "
                        f"{SCHEDULE_EXTEND_CHOICES}")
    if not isinstance(self.init_from, str):
      raise ConfigError(f"train.init_from={self.init_from!r} must be a path string "
                        "(\"\" = start from a random initialisation)")
    if not self.lr > 0:
      raise ConfigError(f"train.lr={self.lr} must be > 0 (peak learning rate, e.g. 3e-4)")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1] "
                        "(final lr = lr * min_lr_ratio)")
    if self.weight_decay < 0:
      raise ConfigError(f"train.weight_decay={self.weight_decay} must be >= 0")
    for f in ("b1", "b2"):
      if not 0 <= getattr(self, f) < 1:
        raise ConfigError(f"train.{f}={getattr(self, f)} must be in [0, 1) (AdamW moment decay)")
    if not self.eps > 0:
      raise ConfigError(f"train.eps={self.eps} must be > 0 (AdamW epsilon, e.g. 1e-8)")
    if self.grad_clip_norm < 0:
      raise ConfigError(f"train.grad_clip_norm={self.grad_clip_norm} must be >= 0 (0 = no clipping)")
    self._check_optimizer_and_schedule()

  def _check_optimizer_and_schedule(self):
    choices = {"optimizer": ("adamw", "muon"), "schedule": ("cosine", "wsd"),
               "decay_shape": ("linear", "1-sqrt")}
    for f, allowed in choices.items():
      if getattr(self, f) not in allowed:
        raise ConfigError(f"train.{f}={getattr(self, f)!r} must be one of {allowed}")
    if not (_is_number(self.decay_fraction) and 0 <= self.decay_fraction <= 1):
      raise ConfigError(f"train.decay_fraction={self.decay_fraction!r} must be in [0, 1] (the "
                        "share of train.num_steps at the end that the \"wsd\" schedule decays)")
    horizon = self.schedule_steps or self.num_steps
    horizon_name = "train.schedule_steps" if self.schedule_steps else "train.num_steps"
    decay_steps = int(round(self.decay_fraction * horizon))
    if self.schedule == "wsd" and self.warmup_steps + decay_steps > horizon:
      raise ConfigError(
          f"train.warmup_steps={self.warmup_steps} + decay steps {decay_steps} "
          f"(train.decay_fraction={self.decay_fraction} of {horizon_name}={horizon}) "
          f"exceed {horizon_name}; lower the warmup or train.decay_fraction")
    if not (_is_number(self.muon_lr) and self.muon_lr > 0):
      raise ConfigError(f"train.muon_lr={self.muon_lr!r} must be > 0 (Muon's peak learning "
                        "rate, e.g. 0.02)")
    for f in ("muon_weight_decay", "muon_consistent_rms"):
      if not (_is_number(getattr(self, f)) and getattr(self, f) >= 0):
        raise ConfigError(f"train.{f}={getattr(self, f)!r} must be >= 0")
    if not (_is_number(self.muon_momentum) and 0 <= self.muon_momentum < 1):
      raise ConfigError(f"train.muon_momentum={self.muon_momentum!r} must be in [0, 1) "
                        "(e.g. 0.95)")
    _positive_int(self, "train", "muon_ns_steps")
    if not isinstance(self.muon_router, bool):
      raise ConfigError(f"train.muon_router={self.muon_router!r} must be True or False")
    for f, what in (("router_lr_scale", "the router's"), ("expert_lr_scale", "the experts'")):
      if not (_is_number(getattr(self, f)) and getattr(self, f) > 0):
        raise ConfigError(f"train.{f}={getattr(self, f)!r} must be > 0 (a multiple of {what} "
                          "group learning rate; 1 = the same rate)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Orbax checkpointing settings (see configs/base.py)."""

  every_steps: int = 1_000  # steps between checkpoints; 0 = only at the end
  max_to_keep: int = 3  # most recent checkpoints kept
  async_save: bool = True  # write in a background thread

  def __post_init__(self):
    _nonnegative_int(self, "checkpoint", "every_steps")
    _positive_int(self, "checkpoint", "max_to_keep")
    if not isinstance(self.async_save, bool):
      raise ConfigError(f"checkpoint.async_save={self.async_save!r} must be True or False")


BALANCE_MODES = ("pid", "sign", "adamw", "quantile")


@dataclasses.dataclass(frozen=True)
class BalanceConfig:
  """Router balancing biases and auxiliary router losses (zaya_jax/train/balance.py)."""

  enabled: bool = True  # update the router balancing biases every step from the routing counts
  mode: str = "quantile"  # one of BALANCE_MODES (see configs/base.py)
  kp: float = 0.02  # "pid": bias per unit error per step (error = target - observed share of tokens)
  ki: float = 0.0  # "pid": bias per unit accumulated error per step
  kd: float = 0.0  # "pid": bias per unit change of the error since the last step
  integral_clamp: float = 1.0  # "pid" anti-windup: |accumulated error| <= this (error-steps)
  rate: float = 1e-3  # "sign" mode: bias change per step
  adamw_lr: float = 1e-2  # "adamw": AdamW learning rate on the biases (probability units per step)
  adamw_b1: float = 0.9  # "adamw": first-moment decay
  adamw_b2: float = 0.99  # "adamw": second-moment decay
  adamw_eps: float = 1e-8  # "adamw": denominator epsilon (units of the error, a token share)
  adamw_weight_decay: float = 0.0  # "adamw": decoupled weight decay on the controlled biases
  quantile_apply: str = "next"  # "quantile": "next" = route the next steps (causal) | "current" = this batch (not causal)
  quantile_ema: float = 0.5  # "quantile": b <- ema * b + (1 - ema) * solved; 0 = use the solved biases
  quantile_sweeps: int = 64  # "quantile": most coordinate sweeps over the classes per solve
  quantile_iters: int = 1  # "quantile" "next": histogram steps per train step (one all-reduce each)
  quantile_step: float = 1.0  # "quantile" "next": fraction of each histogram step taken
  quantile_integral: float = 0.0  # "quantile" "next": gain on the running sum of the solved shifts (removes the lag behind a drifting router; without quantile_reroute 0.15 is the tuned value); 0 = the EMA step alone
  quantile_reroute: bool = True  # "quantile" "next" ("current" ignores it): take the histogram step on this batch re-scored by the router after the optimizer update (no lag behind the router's own step)
  rate_lr_power: float = 0.0  # after warm-up, scale every bias update by (lr(step) / train.lr) ** this: 0 = the whole update every step, 1 = in step with the lr (the balancing slows as the lr decays; DeepSeek-V3 stops its bias updates for its last 500B tokens)
  exclude_layers: tuple[int, ...] = ()  # layer indices whose biases no rule moves: their routing is free, as with balancing off (a diagnostic: README "Load balancing")
  bias_clamp: float = 0.0  # |controlled bias| <= this after each update; 0 = no clamp
  skip_target: float | None = None  # target fraction of tokens skipping the experts; None/<0 = off
  router_z_loss: float = 0.0  # coefficient of the router z-loss added to the training loss
  load_balance_loss: float = 0.0  # coefficient of the switch-style balance loss added to the loss

  def __post_init__(self):
    if isinstance(self.exclude_layers, (list, tuple)):  # ConfigDict/JSON may hand back a list
      object.__setattr__(self, "exclude_layers", tuple(self.exclude_layers))
    if (not isinstance(self.exclude_layers, tuple)
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.exclude_layers)
        or len(set(self.exclude_layers)) != len(self.exclude_layers)):
      raise ConfigError(f"balance.exclude_layers={self.exclude_layers!r} must be a tuple of "
                        "distinct layer indices >= 0, e.g. (0,); () = every layer balanced")
    if not isinstance(self.enabled, bool):
      raise ConfigError(f"balance.enabled={self.enabled!r} must be True or False")
    if self.mode not in BALANCE_MODES:
      raise ConfigError(f"balance.mode={self.mode!r} must be one of "
                        + ", ".join(f'"{m}"' for m in BALANCE_MODES))
    for f in ("kp", "ki", "kd", "rate", "bias_clamp", "quantile_integral", "router_z_loss",
              "load_balance_loss", "adamw_lr", "adamw_weight_decay"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ConfigError(f"balance.{f}={v!r} must be a number >= 0")
    for f in ("adamw_b1", "adamw_b2", "quantile_ema"):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
        raise ConfigError(f"balance.{f}={v!r} must be a number in [0, 1)")
    if isinstance(self.adamw_eps, bool) or not isinstance(
        self.adamw_eps, (int, float)) or not self.adamw_eps > 0:
      raise ConfigError(f"balance.adamw_eps={self.adamw_eps!r} must be > 0 (e.g. 1e-8)")
    if isinstance(self.rate_lr_power, bool) or not isinstance(
        self.rate_lr_power, (int, float)) or not 0 <= self.rate_lr_power <= 1:
      raise ConfigError(f"balance.rate_lr_power={self.rate_lr_power!r} must be a number in "
                        "[0, 1] (0 = the whole bias update every step, 1 = scaled by lr / peak lr)")
    if not isinstance(self.quantile_reroute, bool):
      raise ConfigError(f"balance.quantile_reroute={self.quantile_reroute!r} must be True or False")
    if self.quantile_apply not in ("next", "current"):
      raise ConfigError(f"balance.quantile_apply={self.quantile_apply!r} must be \"next\" (solve "
                        "from this batch, route the next) or \"current\" (route this batch too)")
    if isinstance(self.quantile_sweeps, bool) or not isinstance(
        self.quantile_sweeps, int) or self.quantile_sweeps < 1:
      raise ConfigError(f"balance.quantile_sweeps={self.quantile_sweeps!r} must be an integer "
                        ">= 1 (e.g. 16)")
    if isinstance(self.quantile_iters, bool) or not isinstance(
        self.quantile_iters, int) or self.quantile_iters < 1:
      raise ConfigError(f"balance.quantile_iters={self.quantile_iters!r} must be an integer "
                        ">= 1 (histogram steps per train step, e.g. 1)")
    if isinstance(self.quantile_step, bool) or not isinstance(
        self.quantile_step, (int, float)) or not 0 < self.quantile_step <= 1:
      raise ConfigError(f"balance.quantile_step={self.quantile_step!r} must be a number in "
                        "(0, 1] (the fraction of each histogram step taken, e.g. 1.0)")
    if isinstance(self.integral_clamp, bool) or not isinstance(
        self.integral_clamp, (int, float)) or not self.integral_clamp > 0:
      raise ConfigError(f"balance.integral_clamp={self.integral_clamp!r} must be > 0 "
                        "(error-steps; e.g. 1.0)")
    if self.skip_target is not None and (isinstance(self.skip_target, bool) or not isinstance(
        self.skip_target, (int, float)) or self.skip_target >= 1):
      raise ConfigError(f"balance.skip_target={self.skip_target!r} must be a fraction < 1 of "
                        "the tokens, or None / a negative number to leave the skip bias alone")

  @property
  def skip_controlled(self) -> bool:
    """True when `skip_target` sets a target skip rate (else the skip bias keeps its value)."""
    return self.skip_target is not None and self.skip_target >= 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything one training run needs, validated."""

  model: ModelConfig
  data: DataConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  mesh: MeshConfig = MeshConfig()
  balance: BalanceConfig = BalanceConfig()

  def to_dict(self) -> dict[str, dict[str, Any]]:
    """JSON-ready dict (tuples become lists), as saved in every checkpoint."""
    return json.loads(json.dumps(dataclasses.asdict(self)))


def resolve(config: ml_collections.ConfigDict, *, process_count: int = 1) -> RunConfig:
  """Validates `config` and builds the frozen dataclasses of one run.

  Args:
    config: a ConfigDict from `configs/*.py` (after command-line overrides).
    process_count: JAX processes of the run; train.batch_size must divide evenly over them.

  Returns:
    The validated RunConfig.

  Raises:
    ConfigError: naming the field and the fix, e.g. an unknown group or field, a value out
      of range, `model.vocab_size` smaller than the tokenizer's vocabulary, or special token
      ids that differ from the tokenizer's.
  """
  unknown = sorted(set(config.keys()) - set(GROUPS))
  if unknown:
    raise ConfigError(f"unknown config group(s) {unknown}; known groups are {list(GROUPS)}")
  model, train, mesh, balance = synthetic_configs(config)
  data = build_group(DataConfig, config, "data")
  checkpoint = build_group(CheckpointConfig, config, "checkpoint")
  if data.mixture.strip() and data.source != DataConfig.source:
    logging.warning("data.mixture is set, so data.source=%r is not read (the mixture replaces "
                    "it); drop one of them to silence this", data.source)

  if train.batch_size % process_count:
    raise ConfigError(f"train.batch_size={train.batch_size} is not divisible by the "
                      f"{process_count} processes; use a multiple of {process_count}")
  if train.eval_batches and data.eval_fraction == 0:
    raise ConfigError(f"train.eval_batches={train.eval_batches} but data.eval_fraction=0 holds "
                      "out no documents; set train.eval_batches=0 or data.eval_fraction > 0")
  try:
    check_context(mesh.context, train.seq_len, max(model.context_halo), model.attention_impl)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if any(i >= model.num_layers for i in balance.exclude_layers):
    raise ConfigError(f"balance.exclude_layers={balance.exclude_layers} names a layer the model "
                      f"lacks; model.num_layers={model.num_layers}, so use indices "
                      f"0..{model.num_layers - 1}")
  _check_tokenizer(model, data)
  return RunConfig(model=model, data=data, train=train, checkpoint=checkpoint, mesh=mesh,
                   balance=balance)


def config_differences(saved: dict[str, Any], current: RunConfig, group: str,
                       ignore: tuple[str, ...] = ()) -> list[str]:
  """`group.field: saved -> current` for each field of `group` that differs (JSON values).

  Fields absent from `saved` (added to the code after it was written) and fields in `ignore`
  are not compared.
  """
  now = current.to_dict()[group]
  before = saved.get(group, {})
  return [f"{group}.{k}: {before[k]!r} -> {now[k]!r}" for k in now
          if k in before and k not in ignore and before[k] != now[k]]


def clamp_warmup(train: dict[str, Any]) -> str | None:
  """Shortens `train["warmup_steps"]` (in place) to the longest warm-up the run's schedule
  allows, when it is longer: < the horizon (train.schedule_steps, else num_steps), and for
  "wsd" at most the horizon minus its decay steps. As torchtitan and MaxText accept a short
  run of a config made for a long one (e.g. zaya1_tiny's 30 warm-up steps with num_steps=20).

  Returns:
    The one-line warning saying what was clamped, or None when nothing was (also when the
    fields are not valid numbers: TrainConfig's validation names them).
  """
  try:
    warmup, steps = train.get("warmup_steps", 0), train.get("num_steps", 1)
    horizon = train.get("schedule_steps", 0) or steps
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (warmup, horizon)):
      return None
    limit = horizon - 1
    if train.get("schedule") == "wsd":
      limit = min(limit, horizon - int(round(float(train.get("decay_fraction", 0.2)) * horizon)))
  except (TypeError, ValueError):
    return None
  if horizon < 1 or warmup <= limit or limit < 0:
    return None
  train["warmup_steps"] = limit
  over = (f"train.schedule_steps={horizon}" if train.get("schedule_steps") else
          f"train.num_steps={steps}")
  decay = " minus the wsd decay" if limit < horizon - 1 else ""
  return (f"train.warmup_steps={warmup} does not fit {over}: warming up over {limit} steps "
          f"(the warm-up is clamped to the run{decay}); set train.warmup_steps to choose")


def build_group(cls, config: ml_collections.ConfigDict, group: str):
  """`cls(**config[group])`, with unknown fields and constructor errors named `group.field`.
  The train group's warm-up is first clamped to the run (`clamp_warmup`, logged)."""
  if group not in config:
    raise ConfigError(f"config has no {group!r} group; start from configs/base.py")
  values = dict(config[group])
  if group == "train":
    clamped = clamp_warmup(values)
    if clamped:
      logging.warning("%s", clamped)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - names)
  for f in unknown:
    if f"{group}.{f}" in RENAMED_FIELDS:
      raise ConfigError(f"{group}.{f} was replaced by {RENAMED_FIELDS[f'{group}.{f}']}")
  if unknown:
    raise ConfigError(f"{group}.{unknown[0]} is not a field of {cls.__name__}; "
                      f"known fields: {sorted(names)}")
  if "layer_types" in values:  # ConfigDict/JSON may hand back a list
    values["layer_types"] = tuple(values["layer_types"])
  try:
    return cls(**values)
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    msg = str(e)
    raise ConfigError(msg if msg.startswith(f"{group}.") else f"{group}: {msg}") from e


def synthetic_configs(config: ml_collections.ConfigDict
                      ) -> tuple[ModelConfig, TrainConfig, MeshConfig, BalanceConfig]:
  """The `model`, `train`, `mesh` and `balance` groups of `config`, validated as `resolve`
  does, for tools that feed synthetic tokens (launch.mesh_sweep, launch.sizing,
  launch.benchmark): the `data` group and the tokenizer check are not consulted, so a config
  whose tokenizer is not on this machine (configs/zaya1_base.py) still works.

  Raises:
    ConfigError: naming the field, for an invalid or unknown value.
  """
  balance = build_group(BalanceConfig, config, "balance") if "balance" in config else BalanceConfig()
  return (build_group(ModelConfig, config, "model"), build_group(TrainConfig, config, "train"),
          build_group(MeshConfig, config, "mesh"), balance)


def _check_tokenizer(model: ModelConfig, data: DataConfig) -> None:
  """The model's vocabulary and special ids must agree with the tokenizer's (for prepared
  corpora: the tokenizer recorded in their manifests): `data.tokenizer.tokenizer_mismatch`.

  Raises:
    ConfigError: its one-line message (the model field and the fix), or the tokenizer or a
      manifest cannot be read.
  """
  try:
    problem = tokenizer_mismatch(data, model.vocab_size,
                                 {f: getattr(model, f) for f, _ in SPECIAL_IDS})
  except ValueError as e:
    raise ConfigError(str(e)) from e
  if problem:
    raise ConfigError(problem)


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive_int(obj, group: str, field: str) -> None:
  v = getattr(obj, field)
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ConfigError(f"{group}.{field}={v!r} must be a positive integer")


def _nonnegative_int(obj, group: str, field: str) -> None:
  v = getattr(obj, field)
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise ConfigError(f"{group}.{field}={v!r} must be an integer >= 0")
