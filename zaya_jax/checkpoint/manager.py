"""The Orbax side of a checkpoint directory: item names and handlers, opening a manager,
reading item metadata, the saved config and the model item, verifying items against their
checksums, and turning Orbax / TensorStore failures into one readable line.

Everything here works on item dicts `{item name: pytree}`; what the items mean for training
is the caller's (zaya_jax/train/state.py `TrainState.to_items`).
"""

from __future__ import annotations

import logging as std_logging
import os
import sys
import warnings
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from zaya_jax.checkpoint import integrity
from zaya_jax.config import RunConfig

ITEMS = ("model", "opt_state", "train_meta", "data_iter", "config", "integrity")
ARRAY_ITEMS = ("model", "opt_state", "train_meta")
JSON_ITEMS = ("config", "integrity")
CHECKSUMMED_ITEMS = ("model", "opt_state")
_MAX_REASON_CHARS = 600
_ORBAX_READ = "_read_array_index_and_device_put"  # Orbax's per-array read coroutine
_ORBAX_READ_ERROR = "Encountered error while reading array index"  # its exception message


class CorruptCheckpointError(ValueError):
  """A checkpoint step cannot be read or fails its integrity checks (names the step)."""


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
  """An Orbax CheckpointManager over `directory` with this package's items.

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


def saved_config(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """The RunConfig dict stored with checkpoint `step` (plus "runtime", maybe "reshape")."""
  return manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config


def config_record(config: RunConfig) -> dict[str, Any]:
  """The `config` item: `config.to_dict()` plus the writing run's process and device count."""
  return {**config.to_dict(),
          "runtime": {"process_count": jax.process_count(), "device_count": jax.device_count()}}


def verify_items(trees: Any, record: dict[str, Any], names: tuple[str, ...], where: str) -> int:
  """Checks each item `trees[name]` of `names` against the `integrity` record of its checkpoint.

  Args:
    trees: the restored items, indexable by name (a dict or Orbax's Composite result).
    record: the checkpoint's `integrity` item.
    names: the items to check, e.g. `CHECKSUMMED_ITEMS`.
    where: the step directory, for the messages.

  Returns:
    The number of (layer, expert) slices verified.

  Raises:
    integrity.ChecksumMismatchError: (a ValueError) if the record is of another version, has
      no checksums for an item, or an array differs (naming tensors, layers and experts).
  """
  experts = 0
  for item in names:
    checksums = integrity.item_record(record, item, where)
    if checksums is None:
      raise integrity.ChecksumMismatchError(f"checkpoint {where}: the integrity record has "
                                            f"no checksums for the {item} item")
    experts += integrity.verify_tree(item, trees[item], checksums, where)
  return experts


def restore_model_state(directory: str, abstract_model_state: nnx.State,
                        step: int | None = None) -> nnx.State:
  """Only the `model` item (params + balancing biases) of a run's checkpoint, e.g. for eval.

  Verified against the checkpoint's checksums. Works on checkpoints whose parameters
  `launch.reshape_checkpoint --dtype=bfloat16` cast: Orbax casts each array to the target's
  dtype (bfloat16 -> float32 is exact), and the checksums are compared after casting back to
  the saved dtype.

  Args:
    directory: `workdir/checkpoints`.
    abstract_model_state: `nnx.State` of ShapeDtypeStructs (with shardings), as from
      `nnx.state(nnx.eval_shape(...))` and `zaya_jax.parallel.mesh.abstract_with_shardings`.
    step: the step to read; None = the latest.

  Raises:
    ValueError: if the directory holds no checkpoint, the step lacks its model or integrity
      item, or the model item fails its checksums (naming the tensors and experts).
  """
  manager = open_manager(directory, read_only=True)
  try:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"no checkpoint in {directory}; train first (python -m launch.train ...)")
    where = os.path.join(os.path.abspath(directory), str(step))
    items = saved_items(manager, step)
    missing = [name for name in ("model", "integrity") if name not in items]
    if missing:
      raise CorruptCheckpointError(f"checkpoint {where} lacks the item(s) {missing}")
    out = manager.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(abstract_model_state), integrity=ocp.args.JsonRestore()))
    verify_items(out, out.integrity, ("model",), where)
    return out.model
  finally:
    manager.close()


def failure_reason(e: BaseException) -> str:
  """One line on why a read failed: the innermost cause (TensorStore names the tensor and the
  file there; Orbax's wrapper dumps the whole TensorStore spec), cut to a readable length."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = str(e).split("See full TensorStore details")[0].strip()
  text = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
  return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + " ..."


def silence_abandoned_reads() -> None:
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


def all_processes_ok(ok: bool) -> bool:
  """True if `ok` holds on every process (a collective: every process must call it)."""
  if jax.process_count() == 1:
    return ok
  flags = multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))
  return bool(np.all(flags))
