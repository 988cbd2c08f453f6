"""`Checkpointer`: a training run's checkpoints, saved and restored as item dicts.

The state saved is anything that converts itself to and from the array items (`Checkpointable`,
e.g. zaya_jax/train/state.py `TrainState`); this module knows only items: it adds the data
iterator, the config record and the checksums, verifies them on restore, and falls back past
(and moves aside) steps that do not read back intact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple, Protocol

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from zaya_jax.checkpoint import compat, integrity
from zaya_jax.checkpoint.manager import (CHECKSUMMED_ITEMS, CorruptCheckpointError,
                                         all_processes_ok, config_record, failure_reason,
                                         open_manager, saved_config, saved_items,
                                         silence_abandoned_reads, verify_items)
from zaya_jax.config import CheckpointConfig, ConfigError, RunConfig, config_differences
from zaya_jax.data import global_iterator

CORRUPT_SUFFIX = "_corrupt"  # bad steps of `<dir>` are moved to `<dir>_corrupt/<step>`


class Checkpointable(Protocol):
  """A state that converts itself to the array items and back (see `TrainState.to_items`)."""

  def to_items(self) -> dict[str, Any]:
    """`{"model": ..., "opt_state": ..., "train_meta": ...}`: pytrees of arrays, or of
    `jax.ShapeDtypeStruct`s with shardings for a restore target."""

  @classmethod
  def from_items(cls, items: dict[str, Any]) -> Checkpointable:
    """The state holding the restored `items` (the same keys as `to_items`)."""


class Restored(NamedTuple):
  """What `Checkpointer.restore_latest` restored."""

  state: Any  # `type(abstract_state).from_items(...)`, e.g. a TrainState
  step: int
  data_restored: bool  # False: the iterator was not touched (another process count wrote it)


class Checkpointer:
  """Saves and restores a state's items + data iterator + config under one directory."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    """Opens (creating if needed) the checkpoint directory.

    Raises:
      ValueError: if `directory` exists but is not a directory.
    """
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"checkpoint directory {directory} exists and is not a directory; "
                       "pass a different --workdir")
    self.directory = directory
    self.corrupt_directory = directory.rstrip(os.sep) + CORRUPT_SUFFIX
    self._manager = open_manager(directory, read_only=False, max_to_keep=cfg.max_to_keep,
                                 async_save=cfg.async_save)

  def step_path(self, step: int) -> str:
    """The directory of checkpoint `step`."""
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, state: Checkpointable, data_iter: grain.DatasetIterator,
           config: RunConfig) -> int:
    """Starts writing `state.to_items()` (asynchronously if configured) at its train_meta step.

    The checksums of the model and optimizer state are computed first, on device, and the
    iterator's position is taken now, so call this after the step's batch was drawn. Every
    process must call it. Returns the step saved.

    Raises:
      ValueError: if the directory already holds a checkpoint at that step or later (Orbax
        would skip the save).
    """
    items = state.to_items()
    step = int(items["train_meta"]["step"])
    record = integrity.make_record({name: items[name] for name in CHECKSUMMED_ITEMS})
    saved = self._manager.save(step, args=ocp.args.Composite(
        **{name: ocp.args.StandardSave(tree) for name, tree in items.items()},
        data_iter=grain.checkpoint.CheckpointSave(data_iter),
        config=ocp.args.JsonSave(config_record(config)),
        integrity=ocp.args.JsonSave(record),
    ))
    if not saved:  # Orbax skips steps <= its latest one
      raise ValueError(f"checkpoint step {step} was not saved: {self.directory} already holds "
                       f"step {self.latest_step()}; a run only saves steps after its newest "
                       "checkpoint (restore that one, or use a fresh --workdir)")
    return step

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are committed."""
    self._manager.wait_until_finished()

  def saved_config(self, step: int) -> dict[str, Any]:
    """The RunConfig dict stored with checkpoint `step` (plus "runtime", maybe "reshape")."""
    return saved_config(self._manager, step)

  def restore(self, step: int, abstract_state: Checkpointable,
              data_iter: grain.DatasetIterator | None, config: RunConfig) -> Any:
    """Reads checkpoint `step` into arrays shaped and placed like `abstract_state`.

    Every array is checked against the checksums saved with it.

    Args:
      step: a step from `all_steps()`.
      abstract_state: e.g. a TrainState of `jax.ShapeDtypeStruct` leaves carrying the target
        sharding (see `zaya_jax.parallel.mesh.abstract_with_shardings`): the restore onto
        another mesh.
      data_iter: a fresh iterator of the same data config, whose position is restored in
        place (converted to the same token if `train.seq_len` changed); None restores
        everything but the data position (a rollback that keeps reading forward). A
        checkpoint written by another process count or `data.num_workers` leaves it
        untouched (warned; `restore_latest` reports it): a run-shape change, never
        reported as corruption. A `process_independent` iterator (prepared corpora) is
        restored from any process or worker count (process 0's saved state); only a
        `train.seq_len` change leaves it untouched.
      config: the current run's config. Its `model` group must equal the saved one, except
        for compute-only fields (`COMPUTE_ONLY_MODEL_FIELDS`, e.g. dtype, remat).

    Returns:
      `type(abstract_state).from_items(restored items)`.

    Raises:
      ConfigError: if the checkpoint was written for a different model config (naming the
        fields), or holds no optimizer state (`reshape_checkpoint --drop_optimizer`).
      CorruptCheckpointError: (a ValueError) if it cannot be read, lacks an item, a tensor
        or an expert, or its arrays differ from their checksums (naming tensors, layers,
        experts).
    """
    return self._restore(step, abstract_state, data_iter, config)[0]

  def restore_latest(self, abstract_state: Checkpointable,
                     data_iter: grain.DatasetIterator | None,
                     config: RunConfig) -> Restored | None:
    """Restores the newest checkpoint that reads back intact, falling back to older ones.

    A step that cannot be read (missing or truncated files, unreadable metadata, checksum
    mismatch) is logged as an error naming the step and the reason, and the next older one
    is tried. Once one restores, the newer failed steps are moved to
    `<checkpoints>_corrupt/<step>` (not deleted), so Orbax no longer lists them and the run
    can save those step numbers again. If every step fails, nothing is moved.

    Args: as `restore`.

    Returns:
      `Restored(state, step, data_restored)`, or None if the directory holds no checkpoint.
      `data_restored` is False when `data_iter` is None or the checkpoint was written by
      another process count (each process's position covers other documents then; not for a
      `process_independent` iterator, see `restore`): the
      caller must start a new data order.

    Raises:
      ConfigError: as `restore` (a user error: nothing is moved).
      CorruptCheckpointError: (a ValueError) if every checkpoint fails, listing each step
        and its reason.
    """
    self._manager.wait_until_finished()
    self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    failures: list[tuple[int, str]] = []
    for step in steps:
      try:
        state, data_restored = self._restore(step, abstract_state, data_iter, config)
      except CorruptCheckpointError as e:
        logging.error("checkpoint step %d (%s) cannot be restored: %s", step,
                      self.step_path(step), e)
        failures.append((step, str(e)))
        if step != steps[-1]:
          logging.error("trying the previous checkpoint")
        continue
      for bad, _ in failures:
        self._move_aside(bad)
      if failures:
        self._manager.reload()
        logging.warning("resumed from checkpoint %d; the newer checkpoint(s) %s failed and were "
                        "moved to %s", step, [s for s, _ in failures], self.corrupt_directory)
      return Restored(state, step, data_restored)
    listing = "\n".join(f"  step {s}: {reason}" for s, reason in failures)
    raise CorruptCheckpointError(
        f"no checkpoint in {self.directory} can be restored; nothing was moved or deleted:\n"
        f"{listing}\nRepair or replace the files, restore them from a backup, or move "
        f"{self.directory} away to train from scratch.")

  def close(self) -> None:
    """Waits for pending asynchronous saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  # --- internals -----------------------------------------------------------------------------

  def _move_aside(self, step: int) -> None:
    """Renames step `step` to `<dir>_corrupt/<step>` (`<step>.<n>` if that exists)."""
    src = self.step_path(step)
    if jax.process_index() == 0 and os.path.isdir(src):
      os.makedirs(self.corrupt_directory, exist_ok=True)
      dst, n = os.path.join(self.corrupt_directory, str(step)), 0
      while os.path.exists(dst):
        n += 1
        dst = os.path.join(self.corrupt_directory, f"{step}.{n}")
      os.rename(src, dst)
      logging.error("moved the failed checkpoint %s to %s", src, dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"zaya_checkpoint_move_aside_{step}")

  def _phase(self, fn: Callable[[], Any], what: str) -> Any:
    """Runs `fn`; if it raised on any process, raises CorruptCheckpointError on all of them."""
    error = None
    result = None
    try:
      result = fn()
    except ConfigError:
      raise
    except global_iterator.DataStateError as e:  # a refused data position: a user error
      raise ConfigError(str(e)) from e
    except Exception as e:  # Orbax and TensorStore raise many types for bad files.
      error = e
      silence_abandoned_reads()
    if not all_processes_ok(error is None):
      reason = failure_reason(error) if error is not None else "it failed on another process"
      raise CorruptCheckpointError(f"{what}: {reason}") from error
    return result

  def _restore(self, step: int, abstract_state: Checkpointable,
               data_iter: grain.DatasetIterator | None,
               config: RunConfig) -> tuple[Any, bool]:
    """`restore`, also returning whether the data position was restored."""
    self._manager.wait_until_finished()  # a pending save of this step would be half-written
    path = self.step_path(step)
    targets = abstract_state.to_items()

    def read_metadata():
      return saved_items(self._manager, step), self.saved_config(step)

    items, saved = self._phase(read_metadata, f"cannot read the metadata or config of "
                                              f"checkpoint {path}")
    compat.check_resumable(path, saved, config, items)
    compat.check_complete(path, saved, items, (*targets, "integrity"))

    def read_arrays():
      return self._manager.restore(step, args=ocp.args.Composite(
          **{name: ocp.args.StandardRestore(target) for name, target in targets.items()},
          integrity=ocp.args.JsonRestore()))

    out = self._phase(read_arrays, f"cannot read the arrays of checkpoint {path}")
    try:
      experts = verify_items(out, out.integrity, CHECKSUMMED_ITEMS, path)
    except integrity.ChecksumMismatchError as e:
      raise CorruptCheckpointError(str(e)) from e
    logging.info("checkpoint %s: checksums verified (%d expert slices)", path, experts)

    data_restored = False
    if data_iter is not None:
      if "data_iter" not in items:
        raise CorruptCheckpointError(f"checkpoint {path} lacks its data_iter item")
      restart = compat.data_restart_reason(saved, config, data_iter,
                                           compat.saved_data_state_is_global(path, saved))
      if restart:  # a run-shape change, not corruption: everything else resumes
        logging.warning("checkpoint %s: %s, so the saved data position is not applied: the "
                        "model, optimizer and step resume, and the data order restarts (a new "
                        "shuffle)", path, restart)
      else:
        if config_differences(saved, config, "data", ignore=("num_workers",)):
          logging.warning("checkpoint %s: the saved data position is applied to the new data "
                          "config", path)
        saved_len = saved["train"]["seq_len"]
        if saved_len != config.train.seq_len:
          logging.warning("checkpoint %s: train.seq_len %d -> %d; the data position is carried "
                          "over to the same token (rows are cut at the new length from there)",
                          path, saved_len, config.train.seq_len)
        convertible = hasattr(data_iter, "saved_seq_len")  # zaya_jax.data's PackedIterator
        if convertible:
          data_iter.saved_seq_len = saved_len
        saved_count = int(saved["runtime"]["process_count"])
        try:
          if saved_count != jax.process_count():  # a process-independent iterator (compat)
            self._phase(lambda: _restore_process_independent(path, saved_count, data_iter),
                        f"cannot read the data iterator position of checkpoint {path}")
          else:
            self._phase(lambda: self._manager.restore(step, args=ocp.args.Composite(
                data_iter=grain.checkpoint.CheckpointRestore(data_iter))),
                        f"cannot read the data iterator position of checkpoint {path}")
        finally:
          if convertible:
            data_iter.saved_seq_len = None
        data_restored = True

    restored = {name: out[name] for name in targets}
    changed = compat.changed_balancing_settings(saved, config)
    if changed:
      logging.warning("checkpoint %s: resuming with changed router/balancing settings: %s (the "
                      "run continues with the new values; set them back to keep the old ones)",
                      path, ", ".join(changed))
    reset = compat.balance_state_reset_reason(saved, config)
    if reset and "balance" in restored.get("train_meta", {}):
      logging.warning("checkpoint %s: %s", path, reset)
      restored["train_meta"] = dict(restored["train_meta"], balance=jax.tree.map(
          lambda x: jnp.zeros_like(x, device=x.sharding), restored["train_meta"]["balance"]))
    state = type(abstract_state).from_items(restored)
    return state, data_restored


def _restore_process_independent(path: str, saved_count: int, data_iter: Any) -> None:
  """Applies process 0's saved state of a `process_independent` iterator (the same on every
  process) written by `saved_count` processes: grain's CheckpointRestore would look for this
  run's `process_<i>-of-<n>.json` only."""
  filename = compat.process0_data_state_file(path, saved_count)
  with open(filename, encoding="utf-8") as f:
    state = json.load(f)
  data_iter.set_state(state)
