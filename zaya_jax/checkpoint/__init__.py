"""Orbax checkpoints of a training run, in `workdir/checkpoints/<step>/`.

Each step is an Orbax Composite of six items (DESIGN.md "Checkpoint contents"):
  model       nnx.State of every model variable: parameters and router balancing biases
  opt_state   optax state over the parameters (absent after `reshape --drop_optimizer`)
  train_meta  {"step", "skipped_steps", "consecutive_skips": int32 [], "rng": uint32 [2],
              "balance": {"integral", "prev_error": float32 [L, X]} (bias controller)}
  data_iter   the grain iterator's position, one JSON file per process
  config      the resolved RunConfig as JSON, plus "runtime": {"process_count",
              "device_count"} of the run that wrote it (and "reshape" after
              launch.reshape_checkpoint)
  integrity   checksums of `model` and `opt_state`: per tensor, and per (layer, expert) for
              expert tensors (zaya_jax/checkpoint/integrity.py); verified on every restore
Restores take abstract targets (`jax.ShapeDtypeStruct` with a sharding), so a checkpoint can
be read back onto another device layout; the checksums do not depend on the layout.

Safety: Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when complete,
so a step directory without that suffix is complete; a process killed mid-save leaves the
tmp directory, which listings ignore and the next Checkpointer removes before its first save.
Orbax deletes checkpoints beyond `max_to_keep` only after the newer one is committed (also
with asynchronous saves). `restore_latest` falls back to older steps when the newest cannot
be read or fails its checksums, and moves the bad ones to `<checkpoints>_corrupt/`; nothing
here deletes a committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils

from zaya_jax.checkpoint import integrity
from zaya_jax.model import ModelConfig
from zaya_jax.config import (COMPUTE_ONLY_MODEL_FIELDS, CheckpointConfig, ConfigError, RunConfig,
                             config_differences)

if TYPE_CHECKING:  # zaya_jax.train imports this module; a runtime import would be circular.
  from zaya_jax.train.state import TrainState

ITEMS = ("model", "opt_state", "train_meta", "data_iter", "config", "integrity")
ARRAY_ITEMS = ("model", "opt_state", "train_meta")
JSON_ITEMS = ("config", "integrity")
CHECKSUMMED_ITEMS = ("model", "opt_state")
# train_meta keys added after the first checkpoints were written: restored as 0 when absent
# (every leaf of a pytree value, e.g. the balancing controller's state, as zeros).
OPTIONAL_TRAIN_META = ("skipped_steps", "consecutive_skips", "balance")
CORRUPT_SUFFIX = "_corrupt"  # bad steps of `<dir>` are moved to `<dir>_corrupt/<step>`
_DATA_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json$")
_MAX_REASON_CHARS = 600
_ORBAX_READ = "_read_array_index_and_device_put"  # Orbax's per-array read coroutine
_ORBAX_READ_ERROR = "Encountered error while reading array index"  # its exception message


class CorruptCheckpointError(ValueError):
  """A checkpoint step cannot be read or fails its integrity checks (names the step)."""


class Restored(NamedTuple):
  """What `Checkpointer.restore_latest` restored."""

  state: TrainState
  step: int
  data_restored: bool  # False: the iterator was not touched (another process count wrote it)


def with_sharding(abstract: Any, sharding: jax.sharding.Sharding) -> Any:
  """`abstract` with every `ShapeDtypeStruct` leaf placed on `sharding` (a restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)


def handler_registry(data_iter_save: tuple[type, Any] | None = None
                     ) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Which Orbax handler saves and restores each item (so `item_metadata` describes them).

  Args:
    data_iter_save: optional `(args type, handler)` that saves `data_iter` instead of grain's
      (the reshape tool copies the saved files rather than saving a live iterator).
  """
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for name in ARRAY_ITEMS:
    registry.add(name, ocp.args.StandardSave)
    registry.add(name, ocp.args.StandardRestore)
  for name in JSON_ITEMS:
    registry.add(name, ocp.args.JsonSave)
    registry.add(name, ocp.args.JsonRestore)
  if data_iter_save is None:
    registry.add("data_iter", grain.checkpoint.CheckpointSave)
  else:
    registry.add("data_iter", *data_iter_save)
  registry.add("data_iter", grain.checkpoint.CheckpointRestore)
  return registry


def open_manager(directory: str, *, read_only: bool, max_to_keep: int | None = None,
                 async_save: bool = False,
                 data_iter_save: tuple[type, Any] | None = None) -> ocp.CheckpointManager:
  """An Orbax CheckpointManager over `directory` with this module's items.

  Args:
    directory: the directory holding the step directories.
    read_only: open an existing directory for reading only (never creates, saves or deletes).
    max_to_keep: most recent steps kept (writable managers); None = all.
    async_save: write in a background thread.
    data_iter_save: see `handler_registry`.
  """
  if read_only:
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  else:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True)  # unfinished saves of a killed process
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               handler_registry=handler_registry(data_iter_save))


def saved_items(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """`{item name: Orbax metadata (None for JSON / iterator items)}` of the items in `step`."""
  metadata = manager.item_metadata(step)
  return {name: metadata[name] for name in metadata.keys()}


def failure_reason(e: BaseException) -> str:
  """One line on why a read failed: the innermost cause (TensorStore names the tensor and the
  file there; Orbax's wrapper dumps the whole TensorStore spec), cut to a readable length."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e).split("See full TensorStore details")[0].strip()
  text = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
  return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + " ..."


def _silence_abandoned_reads() -> None:
  """Stops the late tracebacks of a failed Orbax restore's other reads from flooding stderr.

  When one array fails to read, Orbax raises at once and leaves the other reads in flight;
  as TensorStore finishes them, each calls back into Orbax's closed event loop and its
  coroutine is freed later with an "Exception ignored in <coroutine
  _read_array_index_and_device_put>" traceback holding a whole TensorStore spec (dozens per
  item, seconds later, in the middle of training), and asyncio logs their gathered futures'
  "exception was never retrieved". The failure itself is reported once, by the caller.
  Installs (once per process) an unraisable-exception hook that drops only those kinds and
  passes every other one on, a filter on the `asyncio` logger for those records, and ignores
  their "never awaited" warnings.
  """
  previous = sys.unraisablehook
  if getattr(previous, "_zaya_abandoned_reads", False):
    return
  std_logging.getLogger("asyncio").addFilter(
      lambda record: not (_ORBAX_READ_ERROR in record.getMessage()
                          and "exception was never retrieved" in record.getMessage()))

  def hook(unraisable):
    exc = unraisable.exc_value
    if _ORBAX_READ in repr(unraisable.object) or (
        isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
      return
    previous(unraisable)

  hook._zaya_abandoned_reads = True
  sys.unraisablehook = hook
  warnings.filterwarnings("ignore", f"coroutine '{_ORBAX_READ}' was never awaited")


def _all_processes_ok(ok: bool) -> bool:
  """True if `ok` holds on every process (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return ok
  flags = multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))
  return bool(np.all(flags))


def train_meta_of(state: TrainState) -> dict[str, Any]:
  """The `train_meta` item of `state`: step, RNG, skip counters and the balancing
  controller's state (left out when `state.balance` is None; restored as zeros then)."""
  meta = {"step": state.step, "rng": state.rng, "skipped_steps": state.skipped_steps,
          "consecutive_skips": state.consecutive_skips}
  if state.balance is not None:
    meta["balance"] = state.balance
  return meta


def _zeros_like(abstract: jax.ShapeDtypeStruct) -> jax.Array:
  sharding = getattr(abstract, "sharding", None)
  value = np.zeros(abstract.shape, abstract.dtype)
  return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


def _saved_process_count(saved_config: dict[str, Any], data_dir: str) -> int | None:
  """Processes of the run that wrote a checkpoint: from its config record, else from the
  names of its iterator files (`process_<i>-of-<n>.json`, checkpoints written before the
  record existed); None if neither says."""
  count = saved_config.get("runtime", {}).get("process_count")
  if count is not None:
    return int(count)
  if os.path.isdir(data_dir):
    for name in os.listdir(data_dir):
      m = _DATA_FILE.match(name)
      if m:
        return int(m.group(2))
  return None


def _data_restart_reason(saved: dict[str, Any], config: RunConfig, data_dir: str,
                         data_iter: Any) -> str | None:
  """Why a checkpoint's data position cannot be applied to `data_iter`, or None if it can.

  Positions are per process (`[process_index::process_count]` documents) and per grain
  pipeline: worker processes (`data.num_workers`) pack in another order, and a workers'
  position is not converted to another `train.seq_len` (the in-process one is, see
  `zaya_jax.data.pipeline.PackedIterator`).
  """
  saved_count = _saved_process_count(saved, data_dir)
  if saved_count is not None and saved_count != jax.process_count():
    return (f"it was written by {saved_count} process(es) and this run has "
            f"{jax.process_count()}: each saved position covers other documents")
  saved_workers = saved.get("data", {}).get("num_workers", 0)
  if saved_workers != config.data.num_workers:
    return (f"data.num_workers changed {saved_workers} -> {config.data.num_workers} (each "
            "worker count reads the documents in its own order)")
  saved_len = saved.get("train", {}).get("seq_len", config.train.seq_len)
  if saved_len != config.train.seq_len and (
      config.data.num_workers or not hasattr(data_iter, "saved_seq_len")):
    return (f"train.seq_len changed {saved_len} -> {config.train.seq_len} and the position of "
            f"a pipeline with data.num_workers={config.data.num_workers} cannot be converted")
  return None


def saved_model_config(saved: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a saved RunConfig dict (fields unknown to this code are dropped)."""
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in saved["model"].items() if k in names})


def config_record(config: RunConfig) -> dict[str, Any]:
  """The `config` item: `config.to_dict()` plus the writing run's process and device count."""
  return {**config.to_dict(),
          "runtime": {"process_count": jax.process_count(), "device_count": jax.device_count()}}


class Checkpointer:
  """Saves and restores TrainState + data iterator + config under one directory."""

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

  def save(self, state: TrainState, data_iter: grain.DatasetIterator, config: RunConfig) -> int:
    """Starts writing `state` (asynchronously if configured) at step `state.step`.

    The checksums of the model and optimizer state are computed first, on device, and the
    iterator's position is taken now, so call this after the step's batch was drawn. Every
    process must call it. Returns the step saved.

    Raises:
      ValueError: if the directory already holds a checkpoint at `state.step` or later
        (Orbax would skip the save).
    """
    step = int(state.step)
    model = nnx.merge_state(state.params, state.model_state)
    record = integrity.make_record({"model": model, "opt_state": state.opt_state})
    saved = self._manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(model),
        opt_state=ocp.args.StandardSave(state.opt_state),
        train_meta=ocp.args.StandardSave(train_meta_of(state)),
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
    return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

  def restore(self, step: int, abstract_state: TrainState,
              data_iter: grain.DatasetIterator | None, config: RunConfig) -> TrainState:
    """Reads checkpoint `step` into arrays shaped and placed like `abstract_state`.

    Every array is checked against the checksums saved with it (a checkpoint written before
    checksums existed is restored unverified, with a warning).

    Args:
      step: a step from `all_steps()`.
      abstract_state: TrainState of `jax.ShapeDtypeStruct` leaves carrying the target
        sharding (see `with_sharding`).
      data_iter: a fresh iterator of the same data config, whose position is restored in
        place (converted to the same token if `train.seq_len` changed); None restores
        everything but the data position (a rollback that keeps reading forward). A
        checkpoint written by another process count or `data.num_workers` leaves it
        untouched (warned; `restore_latest` reports it): a run-shape change, never
        reported as corruption.
      config: the current run's config. Its `model` group must equal the saved one, except
        for compute-only fields (`COMPUTE_ONLY_MODEL_FIELDS`, e.g. dtype, remat).

    Raises:
      ConfigError: if the checkpoint was written for a different model config (naming the
        fields), or holds no optimizer state (`reshape_checkpoint --drop_optimizer`).
      CorruptCheckpointError: (a ValueError) if it cannot be read, lacks a tensor or an
        expert, or its arrays differ from their checksums (naming tensors, layers, experts).
    """
    return self._restore(step, abstract_state, data_iter, config)[0]

  def restore_latest(self, abstract_state: TrainState, data_iter: grain.DatasetIterator | None,
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
      another process count (each process's position covers other documents then): the
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
    except Exception as e:  # Orbax and TensorStore raise many types for bad files.
      error = e
      _silence_abandoned_reads()
    if not _all_processes_ok(error is None):
      reason = failure_reason(error) if error is not None else "it failed on another process"
      raise CorruptCheckpointError(f"{what}: {reason}") from error
    return result

  def _check_resumable(self, path: str, saved: dict[str, Any], config: RunConfig,
                       items: dict[str, Any]) -> None:
    diffs = config_differences(saved, config, "model", ignore=COMPUTE_ONLY_MODEL_FIELDS)
    if diffs:
      raise ConfigError(f"checkpoint {path} was written for another model: {'; '.join(diffs)}. "
                        "Use the same model config to resume, or a fresh --workdir.")
    if "opt_state" not in items:
      raise ConfigError(
          f"checkpoint {path} holds no optimizer state (written by launch.reshape_checkpoint "
          "--drop_optimizer, for evaluation or export with launch.convert_to_hf); it cannot "
          "resume training. Resume from the original checkpoint, or use a fresh --workdir.")
    reshape = saved.get("reshape", {})
    if reshape.get("param_dtype") not in (None, "float32"):
      logging.warning("checkpoint %s holds parameters cast to %s by launch.reshape_checkpoint: "
                      "training resumes from the rounded values", path, reshape["param_dtype"])
    data_diffs = config_differences(saved, config, "data", ignore=("num_workers",))
    if data_diffs:
      logging.warning("resuming %s with a different data config (%s): the saved iterator "
                      "position is applied to the new data", path, "; ".join(data_diffs))

  def _restore(self, step: int, abstract_state: TrainState,
               data_iter: grain.DatasetIterator | None,
               config: RunConfig) -> tuple[TrainState, bool]:
    """`restore`, also returning whether the data position was restored."""
    self._manager.wait_until_finished()  # a pending save of this step would be half-written
    path = self.step_path(step)

    def read_metadata():
      return saved_items(self._manager, step), self.saved_config(step)

    items, saved = self._phase(read_metadata, f"cannot read the metadata or config of "
                                              f"checkpoint {path}")
    self._check_resumable(path, saved, config, items)
    missing = [name for name in ("model", "train_meta") if name not in items]
    if missing:
      raise CorruptCheckpointError(f"checkpoint {path} lacks the item(s) {missing}")

    def read_arrays():
      train_meta = {"step": abstract_state.step, "rng": abstract_state.rng}
      for key in OPTIONAL_TRAIN_META:
        if key in items["train_meta"].tree and getattr(abstract_state, key) is not None:
          train_meta[key] = getattr(abstract_state, key)
      args = {
          "model": ocp.args.StandardRestore(
              nnx.merge_state(abstract_state.params, abstract_state.model_state)),
          "opt_state": ocp.args.StandardRestore(abstract_state.opt_state),
          "train_meta": ocp.args.StandardRestore(train_meta),
      }
      if "integrity" in items:
        args["integrity"] = ocp.args.JsonRestore()
      return self._manager.restore(step, args=ocp.args.Composite(**args))

    out = self._phase(read_arrays, f"cannot read the arrays of checkpoint {path}")

    if "integrity" in items:
      try:
        experts = 0
        for item in CHECKSUMMED_ITEMS:
          checksums = integrity.item_record(out.integrity, item, path)
          if checksums is None:
            raise integrity.ChecksumMismatchError(f"checkpoint {path}: the integrity record has "
                                                  f"no checksums for the {item} item")
          experts += integrity.verify_tree(item, out[item], checksums, path)
      except integrity.ChecksumMismatchError as e:
        raise CorruptCheckpointError(str(e)) from e
      logging.info("checkpoint %s: checksums verified (%d expert slices)", path, experts)
    else:
      logging.warning("checkpoint %s has no integrity checksums (written before they existed): "
                      "restoring it unverified", path)

    data_restored = False
    if data_iter is not None:
      if "data_iter" not in items:
        raise CorruptCheckpointError(f"checkpoint {path} lacks its data_iter item")
      restart = _data_restart_reason(saved, config, os.path.join(path, "data_iter"), data_iter)
      if restart:  # a run-shape change, not corruption: everything else resumes
        logging.warning("checkpoint %s: %s, so the saved data position is not applied: the "
                        "model, optimizer and step resume, and the data order restarts (a new "
                        "shuffle)", path, restart)
      else:
        saved_len = saved.get("train", {}).get("seq_len", config.train.seq_len)
        if saved_len != config.train.seq_len:
          logging.warning("checkpoint %s: train.seq_len %d -> %d; the data position is carried "
                          "over to the same token (rows are cut at the new length from there)",
                          path, saved_len, config.train.seq_len)
        convertible = hasattr(data_iter, "saved_seq_len")  # zaya_jax.data's PackedIterator
        if convertible:
          data_iter.saved_seq_len = saved_len
        try:
          self._phase(lambda: self._manager.restore(step, args=ocp.args.Composite(
              data_iter=grain.checkpoint.CheckpointRestore(data_iter))),
                      f"cannot read the data iterator position of checkpoint {path}")
        finally:
          if convertible:
            data_iter.saved_seq_len = None
        data_restored = True

    tm = out.train_meta
    extra = {key: tm[key] if key in tm else jax.tree.map(_zeros_like, getattr(abstract_state, key))
             for key in OPTIONAL_TRAIN_META}
    params, rest = nnx.split_state(out.model, nnx.Param, ...)
    state = abstract_state.replace(step=tm["step"], params=params, model_state=rest,
                                   opt_state=out.opt_state, rng=tm["rng"], **extra)
    return state, data_restored


def find_run_checkpoint(workdir: str, step: int | None) -> tuple[str, int, dict[str, Any]]:
  """`(checkpoints directory, step, saved RunConfig dict)` of a training run's checkpoint.

  For the offline tools (`launch.convert_to_hf`, `launch.generate`).

  Args:
    workdir: the training run directory (holding `checkpoints/`).
    step: the requested step, or None for the latest.

  Raises:
    ValueError: no such directory, no checkpoint, no such step (listing the steps held), or
      an unreadable config; one line naming the path and the fix.
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir}: no such directory")
  ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f"no checkpoint in {workdir}: {ckpt_dir} does not exist (is it a training "
                     "run's --workdir?)")
  manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=False))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise ValueError(f"no checkpoint in {ckpt_dir}; train first (python -m launch.train ...)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"--step={step}: no such checkpoint in {ckpt_dir}; it holds steps {steps}")
    try:
      saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    except Exception as e:  # Orbax raises several types for missing/corrupt items
      raise ValueError(f"cannot read the config of checkpoint {ckpt_dir}/{step}: {e}") from e
  finally:
    manager.close()
  return ckpt_dir, step, saved


def restore_model_state(directory: str, abstract_model_state: nnx.State,
                        step: int | None = None) -> nnx.State:
  """Only the `model` item (params + balancing biases) of a run's checkpoint, e.g. for eval.

  Verified against the checkpoint's checksums when it has them. Works on checkpoints whose
  parameters `launch.reshape_checkpoint --dtype=bfloat16` cast: Orbax casts each array to the
  target's dtype (bfloat16 -> float32 is exact), and the checksums are compared after casting
  back to the saved dtype.

  Args:
    directory: `workdir/checkpoints`.
    abstract_model_state: `nnx.State` of ShapeDtypeStructs (with shardings), as from
      `nnx.state(nnx.eval_shape(...))`.
    step: the step to read; None = the latest.

  Raises:
    ValueError: if the directory holds no checkpoint, or the model item fails its checksums
      (naming the tensors and experts).
  """
  manager = open_manager(directory, read_only=True)
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"no checkpoint in {directory}; train first (python -m launch.train ...)")
    items = saved_items(manager, step)
    args = {"model": ocp.args.StandardRestore(abstract_model_state)}
    if "integrity" in items:
      args["integrity"] = ocp.args.JsonRestore()
    out = manager.restore(step, args=ocp.args.Composite(**args))
    where = os.path.join(os.path.abspath(directory), str(step))
    if "integrity" in items:
      checksums = integrity.item_record(out.integrity, "model", where)
      if checksums is not None:
        integrity.verify_tree("model", out.model, checksums, where)
    else:
      logging.warning("checkpoint %s has no integrity checksums: not verified", where)
    return out.model
  finally:
    manager.close()
