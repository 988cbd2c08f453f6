"""Orbax checkpoints of a training run, in `workdir/checkpoints/<step>/`.

Each step is an Orbax Composite of six items (DESIGN.md "Checkpoint contents"):
  model       nnx.State of every model variable: parameters and router balancing biases
  opt_state   optax state over the parameters (absent after `reshape --drop_optimizer`)
  train_meta  {"step", "skipped_steps", "consecutive_skips": int32 [], "rng": uint32 [2],
              "balance": the bias controller's state, e.g. {"integral", "prev_error":
              float32 [L, X]}}
  data_iter   the grain iterator's position, one JSON file per process
  config      the resolved RunConfig as JSON, plus "runtime": {"process_count",
              "device_count"} of the run that wrote it (and "reshape" after
              launch.reshape_checkpoint)
  integrity   checksums of `model` and `opt_state`: per tensor, and per (layer, expert) for
              expert tensors (zaya_jax/checkpoint/integrity.py); verified on every restore
A step that lacks one of these (`opt_state` aside) is corrupt. The training state converts
itself to and from the three array items (zaya_jax/train/state.py `TrainState.to_items` /
`from_items`); this package knows only items.
Restores take abstract targets (`jax.ShapeDtypeStruct` with a sharding, from
`zaya_jax.parallel.mesh.abstract_with_shardings`), so a checkpoint can be read back onto
another device layout; the checksums do not depend on the layout.

Safety: Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it when complete,
so a step directory without that suffix is complete; a process killed mid-save leaves the
tmp directory, which listings ignore and the next Checkpointer removes before its first save.
Orbax deletes checkpoints beyond `max_to_keep` only after the newer one is committed (also
with asynchronous saves). `restore_latest` falls back to older steps when the newest cannot
be read or fails its checksums, and moves the bad ones to `<checkpoints>_corrupt/`; nothing
here deletes a committed checkpoint.

Modules: manager.py (Orbax manager, item handlers, the model item, checksum verification),
checkpointer.py (`Checkpointer`: save / restore / fall back / move aside), compat.py (can this
run resume that step), steps.py (offline step resolution), integrity.py (checksums),
reshape.py (inspect and shrink a checkpoint).
"""

from zaya_jax.checkpoint.checkpointer import CORRUPT_SUFFIX, Checkpointable, Checkpointer, Restored
from zaya_jax.checkpoint.compat import saved_model_config
from zaya_jax.checkpoint.manager import (ARRAY_ITEMS, CHECKSUMMED_ITEMS, ITEMS, JSON_ITEMS,
                                         CorruptCheckpointError, config_record, failure_reason,
                                         open_manager, restore_model_state,
                                         saved_config, saved_items)
from zaya_jax.checkpoint.steps import find_run_checkpoint, select_step

__all__ = [
    "ARRAY_ITEMS",
    "CHECKSUMMED_ITEMS",
    "CORRUPT_SUFFIX",
    "Checkpointable",
    "Checkpointer",
    "CorruptCheckpointError",
    "ITEMS",
    "JSON_ITEMS",
    "Restored",
    "config_record",
    "failure_reason",
    "find_run_checkpoint",
    "open_manager",
    "restore_model_state",
    "saved_config",
    "saved_items",
    "saved_model_config",
    "select_step",
]
