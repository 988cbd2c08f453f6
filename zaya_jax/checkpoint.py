"""Orbax checkpoints of a training run, in `workdir/checkpoints/<step>/`.

Each step is an Orbax Composite of five items (DESIGN.md "Checkpoint contents"):
  model       nnx.State of every model variable: parameters and router balancing biases
  opt_state   optax state over the parameters
  train_meta  {"step": int32 [], "rng": uint32 [2]}
  data_iter   the grain iterator's position (one JSON file per process)
  config      the resolved RunConfig as JSON (read back to refuse an incompatible resume)
Restores take abstract targets (`jax.ShapeDtypeStruct` with a sharding), so a checkpoint can
be read back onto another device layout. Orbax deletes checkpoints beyond `max_to_keep`;
nothing here deletes anything else.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from absl import logging

from zaya_jax.config import (COMPUTE_ONLY_MODEL_FIELDS, CheckpointConfig, ConfigError, RunConfig,
                             config_differences)

if TYPE_CHECKING:  # zaya_jax.train imports this module; a runtime import would be circular.
  from zaya_jax.train.state import TrainState

ITEMS = ("model", "opt_state", "train_meta", "data_iter", "config")


def with_sharding(abstract: Any, sharding: jax.sharding.Sharding) -> Any:
  """`abstract` with every `ShapeDtypeStruct` leaf placed on `sharding` (a restore target)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract)


class Checkpointer:
  """Saves and restores TrainState + data iterator + config under one directory."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    """Opens (creating if needed) the checkpoint directory.

    Raises:
      ValueError: if `directory` exists but is not a directory, or holds entries that are
        not Orbax step directories (pass another --workdir).
    """
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
      raise ValueError(f"checkpoint directory {directory} exists and is not a directory; "
                       "pass a different --workdir")
    self.directory = directory
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        ),
    )

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    return self._manager.latest_step()

  def save(self, state: TrainState, data_iter: grain.DatasetIterator, config: RunConfig) -> int:
    """Starts writing `state` (asynchronously if configured) at step `state.step`.

    The iterator's position is taken now, so call this after the step's batch was drawn.
    Returns the step saved.
    """
    step = int(state.step)
    self._manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.merge_state(state.params, state.model_state)),
        opt_state=ocp.args.StandardSave(state.opt_state),
        train_meta=ocp.args.StandardSave({"step": state.step, "rng": state.rng}),
        data_iter=grain.checkpoint.CheckpointSave(data_iter),
        config=ocp.args.JsonSave(config.to_dict()),
    ))
    return step

  def saved_config(self, step: int) -> dict[str, Any]:
    """The RunConfig dict stored with checkpoint `step`."""
    return self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config

  def restore(self, step: int, abstract_state: TrainState, data_iter: grain.DatasetIterator,
              config: RunConfig) -> TrainState:
    """Reads checkpoint `step` into arrays shaped and placed like `abstract_state`.

    Args:
      step: a step from `latest_step()`.
      abstract_state: TrainState of `jax.ShapeDtypeStruct` leaves carrying the target
        sharding (see `with_sharding`).
      data_iter: a fresh iterator of the same data config; its position is restored in place.
      config: the current run's config. Its `model` group must equal the saved one, except
        for compute-only fields (`COMPUTE_ONLY_MODEL_FIELDS`, e.g. dtype, remat).

    Raises:
      ValueError: if the checkpoint was written for a different model config (naming the
        fields), or cannot be read (naming the directory).
    """
    path = os.path.join(self.directory, str(step))
    try:
      saved = self.saved_config(step)
    except Exception as e:  # Orbax raises several types for missing/corrupt items.
      raise ValueError(f"cannot read the config of checkpoint {path}: {e}. Is it a zaya_jax "
                       "checkpoint? Pass a fresh --workdir to start over.") from e
    diffs = config_differences(saved, config, "model", ignore=COMPUTE_ONLY_MODEL_FIELDS)
    if diffs:
      raise ConfigError(f"checkpoint {path} was written for another model: {'; '.join(diffs)}. "
                        "Use the same model config to resume, or a fresh --workdir.")
    data_diffs = config_differences(saved, config, "data")
    if data_diffs:
      logging.warning("resuming %s with a different data config (%s): the saved iterator "
                      "position is applied to the new data", path, "; ".join(data_diffs))
    model_state = nnx.merge_state(abstract_state.params, abstract_state.model_state)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          model=ocp.args.StandardRestore(model_state),
          opt_state=ocp.args.StandardRestore(abstract_state.opt_state),
          train_meta=ocp.args.StandardRestore(
              {"step": abstract_state.step, "rng": abstract_state.rng}),
          data_iter=grain.checkpoint.CheckpointRestore(data_iter),
      ))
    except Exception as e:
      raise ValueError(f"cannot restore checkpoint {path}: {e}") from e
    params, rest = nnx.split_state(out.model, nnx.Param, ...)
    return abstract_state.replace(step=out.train_meta["step"], params=params, model_state=rest,
                                  opt_state=out.opt_state, rng=out.train_meta["rng"])

  def close(self) -> None:
    """Waits for pending asynchronous saves, then releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()


def restore_model_state(directory: str, abstract_model_state: nnx.State,
                        step: int | None = None) -> nnx.State:
  """Only the `model` item (params + balancing biases) of a run's checkpoint, e.g. for eval.

  Args:
    directory: `workdir/checkpoints`.
    abstract_model_state: `nnx.State` of ShapeDtypeStructs (with shardings), as from
      `nnx.state(nnx.eval_shape(...))`.
    step: the step to read; None = the latest.

  Raises:
    ValueError: if the directory holds no checkpoint.
  """
  manager = ocp.CheckpointManager(os.path.abspath(directory),
                                  options=ocp.CheckpointManagerOptions(create=False))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"no checkpoint in {directory}; train first (python -m launch.train ...)")
  out = manager.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(abstract_model_state)))
  manager.close()
  return out.model
