"""The learning-rate schedule of a resumed run whose `train.num_steps` differs from its
checkpoint's (`train.schedule_extend`).

The schedule's horizon (`optim.schedule_horizon`: `train.schedule_steps`, 0 = `num_steps`) is
saved with every checkpoint's config. On resume, `extend_schedule` compares the next update's
learning rate under the saved horizon and under the new one:
  "constant" (asked for): the saved horizon is kept (`schedule_steps` set to it, so it
    survives later resumes), whatever the rates: the old schedule continues, with its saved
    warm-up, at its final rate after its end;
  otherwise, equal (relative 1e-6; e.g. "wsd" in its stable phase, whose decay moves to the
    new end): the new horizon is taken, logged as one info line;
  different, `schedule_extend="refuse"` (default): ConfigError naming both rates and the fixes;
  "stretch": the schedule is recomputed over the new horizon, the jump is logged as a warning.
A resume with the same `num_steps` and `schedule_steps=0` keeps the saved `schedule_steps`.

The saved schedule is rebuilt with the warm-up clamped to its horizon as `clamp_warmup` clamps
a short run's: a 20-step run of a config with 30 warm-up steps warmed up over 19, and resuming
it with num_steps=30 (whose own warm-up is clamped to 29) compares against that schedule and,
with "constant", continues it (warm-up 19, horizon 20).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging

from zaya_jax.config import ConfigError, TrainConfig, clamp_warmup
from zaya_jax.train.optim import make_schedule, schedule_horizon

RTOL = 1e-6  # relative difference of the two rates below which the resume is continuous


def _on_horizon(train: TrainConfig, horizon: int) -> TrainConfig:
  """`train` with `schedule_steps=horizon` and its warm-up clamped to fit that horizon (the
  rule of `clamp_warmup`, so a run that was clamped gets back the warm-up it trained with)."""
  fields = {**dataclasses.asdict(train), "schedule_steps": horizon}
  clamp_warmup(fields)
  return dataclasses.replace(train, schedule_steps=horizon, warmup_steps=fields["warmup_steps"])


def extend_schedule(saved_train: dict[str, Any], train: TrainConfig, step: int) -> TrainConfig:
  """The TrainConfig a run resumed at `step` trains with: `train` with the horizon decided.

  Args:
    saved_train: the checkpoint's saved `train` config group (JSON dict; `schedule_steps`
      absent in checkpoints written before it existed = 0).
    train: the current run's training config.
    step: the checkpoint's step (updates done); the next update's rate is compared.

  Returns:
    `train`, with `schedule_steps` set to the saved horizon (and the warm-up clamped to it)
    when the old schedule is kept (same num_steps, or "constant"); `train` itself when
    nothing changes.

  Raises:
    ConfigError: `schedule_extend="refuse"` and the next learning rate would change; names
      train.num_steps, both rates and both fixes.
  """
  saved_num = int(saved_train["num_steps"])
  saved_steps = int(saved_train.get("schedule_steps", 0) or 0)
  old_horizon = saved_steps or saved_num
  if step >= train.num_steps:  # nothing to train: the loop warns
    return train
  if train.num_steps == saved_num and not train.schedule_steps:
    return _on_horizon(train, saved_steps) if saved_steps else train  # the horizon survives
  new_horizon = schedule_horizon(train)
  if new_horizon == old_horizon:
    return train
  old_train = _on_horizon(train, old_horizon)
  old_lr = float(make_schedule(old_train)(step))
  new_lr = float(make_schedule(dataclasses.replace(train, schedule_steps=new_horizon))(step))
  change = f"train.num_steps {saved_num} -> {train.num_steps}"
  if train.schedule_extend == "constant":  # the user's choice, even where the next lr agrees
    warmup = (f"; its warm-up is the saved {old_train.warmup_steps} steps, not "
              f"{train.warmup_steps}" if old_train.warmup_steps != train.warmup_steps else "")
    (logging.warning if warmup else logging.info)(
        "%s at step %d: train.schedule_extend=constant keeps the %d-step %s schedule (next lr "
        "%.3e; constant at its final value after step %d)%s", change, step, old_horizon,
        train.schedule, old_lr, old_horizon, warmup)
    return old_train
  if abs(new_lr - old_lr) <= RTOL * max(abs(old_lr), abs(new_lr)):
    logging.info("%s at step %d: the %s schedule now runs over %d steps; the next lr is "
                 "unchanged (%.3e)", change, step, train.schedule, new_horizon, new_lr)
    return train
  if train.schedule_extend == "stretch":
    logging.warning("%s at step %d: train.schedule_extend=stretch recomputes the %s schedule "
                    "over %d steps; the lr jumps %.3e -> %.3e", change, step, train.schedule,
                    new_horizon, old_lr, new_lr)
    return train
  raise ConfigError(
      f"{change} at step {step} would change the next learning rate {old_lr:.3e} -> "
      f"{new_lr:.3e} (the {train.schedule} schedule's horizon {old_horizon} -> {new_horizon}); "
      "pass --config.train.schedule_extend=constant to keep the old schedule and continue at "
      "its final lr, or --config.train.schedule_extend=stretch to recompute the schedule over "
      "the new num_steps (accepting the jump)")
