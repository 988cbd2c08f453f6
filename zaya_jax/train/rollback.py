"""Non-finite updates in the training loop: the skip flags, read one step late, and rollback.

A step whose loss or gradient is not finite skips its update (zaya_jax/train/step.py) and
counts it in the state (`skipped_steps`, `consecutive_skips`). The loop reads an update's
flags only after it has dispatched the next step (`Rollback.check`), so the host never waits
for the step it just dispatched. After `train.max_consecutive_skips` skips in a row it
restores the newest intact checkpoint (`Rollback.restore`); the data iterator keeps its
position (past the offending batches) unless `train.skip_data_on_rollback=False`. A run that
goes non-finite again after `MAX_ROLLBACKS_PER_CHECKPOINT` rollbacks to one checkpoint stops.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import logging

from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import RunConfig
from zaya_jax.train.state import TrainState

MAX_ROLLBACKS_PER_CHECKPOINT = 3


class Rollback:
  """The skip flags of each update and the rollbacks of one run.

  Args:
    cfg: the run's config (train.max_consecutive_skips, train.skip_data_on_rollback; saved
      with a checkpoint it restores).
    ckpt: the run's Checkpointer.
    target: the abstract TrainState with its shardings (what a restore reads into).
    state_sharding: the TrainState's shardings (for the restored skip counters).
    is_main: process 0 (it logs).
  """

  def __init__(self, cfg: RunConfig, ckpt: Checkpointer, target: TrainState, state_sharding,
               is_main: bool):
    self.cfg, self.ckpt, self.target = cfg, ckpt, target
    self.state_sharding, self.is_main = state_sharding, is_main
    self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it

  def check(self, prev: dict[str, Any] | None) -> bool:
    """Reads the flags of the previous update (done by now) into `prev` (its metrics and
    "step"), logging a skipped update; True if it is time to roll back."""
    if prev is None:
      return False
    flags = jax.device_get({k: prev[k] for k in ("skipped", "skipped_steps", "consecutive_skips")})
    if flags["skipped"] and self.is_main:
      logging.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in "
                      "this run so far)", prev["step"], flags["consecutive_skips"],
                      flags["skipped_steps"])
    prev.update(flags)
    train = self.cfg.train
    return bool(train.max_consecutive_skips and
                flags["consecutive_skips"] >= train.max_consecutive_skips)

  def restore(self, bad: dict[str, Any], saved_step: int | None, data_iter) -> tuple[TrainState, int]:
    """Restores the last checkpoint after `max_consecutive_skips` non-finite updates.

    Args:
      bad: the flags of the update that made the count (`check`'s `prev`).
      saved_step: the run's newest checkpoint step, or None.
      data_iter: the training iterator (restored too with train.skip_data_on_rollback=False).

    Returns:
      (the restored state, its skip counters carried over, the step it was restored from).

    Raises:
      FloatingPointError: no checkpoint to roll back to, or rolled back to this one
        MAX_ROLLBACKS_PER_CHECKPOINT times already (naming the fixes).
    """
    train = self.cfg.train
    if saved_step is None:
      raise FloatingPointError(
          f"{int(bad['consecutive_skips'])} consecutive updates up to step {bad['step']} had a "
          "non-finite loss or gradient and there is no checkpoint to roll back to. Lower "
          "train.lr, raise train.warmup_steps, or check the data.")
    self.rollbacks[saved_step] = self.rollbacks.get(saved_step, 0) + 1
    if self.rollbacks[saved_step] > MAX_ROLLBACKS_PER_CHECKPOINT:
      raise FloatingPointError(
          f"rolled back to checkpoint {saved_step} {MAX_ROLLBACKS_PER_CHECKPOINT} times and the "
          "loss still goes non-finite: the model diverges whatever the data. Lower train.lr "
          "or resume from an earlier checkpoint.")
    if self.is_main:
      logging.warning(
          "%d consecutive non-finite updates (steps %d-%d): restoring checkpoint %d%s",
          int(bad["consecutive_skips"]), bad["step"] - int(bad["consecutive_skips"]) + 1,
          bad["step"], saved_step, "; the data iterator keeps its position, so the batches "
          "since that checkpoint are skipped" if train.skip_data_on_rollback else
          "; the data iterator goes back too (train.skip_data_on_rollback=False)")
    # The newest intact checkpoint: `saved_step`, unless it fails to read back (then older).
    restored = self.ckpt.restore_latest(
        self.target, None if train.skip_data_on_rollback else data_iter, self.cfg)
    skipped = jax.device_put(np.int32(bad["skipped_steps"]), self.state_sharding.skipped_steps)
    zero = jax.device_put(np.int32(0), self.state_sharding.consecutive_skips)
    return restored.state.replace(skipped_steps=skipped, consecutive_skips=zero), restored.step
