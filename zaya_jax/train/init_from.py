"""`train.init_from`: a new run's first TrainState from another run's weights or an HF export.

The source is one of
  a training run's workdir      its newest complete checkpoint (`WORKDIR/checkpoints/<latest>`)
  a checkpoint step directory   `WORKDIR/checkpoints/<step>` (e.g. a `launch.reshape_checkpoint
                                --drop_optimizer` copy: only its `model` item is read)
  a Hugging Face directory      config.json + *.safetensors (`launch.convert_to_hf` output),
                                read with `zaya_jax.hf.load_pretrained`
and gives the parameters and the router balancing biases; the optimizer moments, the step
(0), the RNG key, the bias controller's state and the data iterator are fresh. The loop uses
it only when its workdir holds no checkpoint (a restarted fine-tune resumes itself), the
convention of torchtitan's `initial_load_path` and MaxText's `load_parameters_path`.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zaya_jax.checkpoint import restore_model_state, saved_config
from zaya_jax.checkpoint.manager import open_manager
from zaya_jax.checkpoint.reshape import resolve_source
from zaya_jax.config import (COMPUTE_ONLY_MODEL_FIELDS, RESUME_CHANGEABLE_MODEL_FIELDS, ConfigError,
                             RunConfig, config_differences)
from zaya_jax.hf import load_pretrained
from zaya_jax.hf.hf_config import ConvertError, architecture_differences, read_hf_config
from zaya_jax.parallel.mesh import abstract_with_shardings
from zaya_jax.train.balance import init_balance_state
from zaya_jax.train.state import TrainState

EXPECTED = ("a training run's --workdir (holding checkpoints/), one checkpoint step directory "
            "(WORKDIR/checkpoints/<step>) or a Hugging Face directory (config.json + "
            "*.safetensors, as written by launch.convert_to_hf)")


class Source(NamedTuple):
  """Where `train.init_from` points: `kind` "checkpoint" (then `directory` = the checkpoints
  directory and `step`) or "hf" (then `directory` = the HF directory, `step` None)."""

  kind: str
  directory: str
  step: int | None


def is_hf_dir(path: str) -> bool:
  """Whether `path` is a directory holding config.json and at least one *.safetensors."""
  return (os.path.isfile(os.path.join(path, "config.json"))
          and any(n.endswith(".safetensors") for n in os.listdir(path)))


def find_source(path: str) -> Source:
  """Classifies `train.init_from=path`.

  Raises:
    ConfigError: `path` is none of the three kinds, or holds no checkpoint (one line naming
      train.init_from and what was expected).
  """
  where = f"train.init_from={path}"
  if not os.path.isdir(path):
    raise ConfigError(f"{where}: no such directory; expected {EXPECTED}")
  if is_hf_dir(path):
    return Source("hf", os.path.abspath(path), None)
  base = os.path.basename(os.path.abspath(path))
  if not (os.path.isdir(os.path.join(path, "checkpoints")) or base.isdigit()):
    raise ConfigError(f"{where}: not a run, a checkpoint step or an HF directory; expected "
                      f"{EXPECTED}")
  try:
    directory, step = resolve_source(path, None)
  except ValueError as e:
    raise ConfigError(f"{where}: {str(e).replace('--src=' + os.path.abspath(path), 'it')}; "
                      f"expected {EXPECTED}") from e
  return Source("checkpoint", directory, step)


def initial_state(path: str, cfg: RunConfig, tx: optax.GradientTransformation,
                  abstract_state: TrainState, state_sharding: TrainState) -> tuple[TrainState, str]:
  """The step-0 TrainState of a run started from `train.init_from=path`, and what it loaded.

  Args:
    path: the source (see the module docstring).
    cfg: this run's config; its `model` group must equal the source's (compute-only fields,
      `COMPUTE_ONLY_MODEL_FIELDS`, and for a checkpoint the RoPE bases,
      `RESUME_CHANGEABLE_MODEL_FIELDS`, aside; for an HF directory, every config.json field).
    tx: this run's optimizer (its state is initialised over the loaded parameters).
    abstract_state: this run's TrainState of ShapeDtypeStructs; state_sharding: its
      NamedShardings (every array is read or created directly in its sharding).

  Returns:
    `(state, description)`: float32 parameters and balancing biases from the source, zero
    optimizer moments, step 0, the RNG key of `train.seed`; description, e.g.
    "checkpoint step 200 of /runs/a/checkpoints" or "HF directory /exports/a".

  Raises:
    ConfigError: a bad path, a source written for another model (naming the fields), or a
      source that cannot be read (one line naming train.init_from).
  """
  source = find_source(path)
  where = f"train.init_from={path}"
  model_target = abstract_with_shardings(abstract_state, state_sharding).to_items()["model"]
  if source.kind == "checkpoint":
    model, what = _from_checkpoint(source, cfg, model_target, where)
  else:
    model = hf_model_state(source.directory, cfg, model_target, where)
    what = f"HF directory {source.directory}"
  params, model_state = nnx.split_state(model, nnx.Param, ...)
  opt_state = jax.jit(tx.init, out_shardings=state_sharding.opt_state)(params)
  balance = init_balance_state(cfg.model.num_layers, cfg.model.num_router_classes)
  put = lambda x, s: jax.device_put(x, s)
  state = TrainState(
      step=put(jnp.zeros((), jnp.int32), state_sharding.step), params=params,
      model_state=model_state, opt_state=opt_state,
      rng=put(jax.random.key_data(jax.random.key(cfg.train.seed)), state_sharding.rng),
      skipped_steps=put(jnp.zeros((), jnp.int32), state_sharding.skipped_steps),
      consecutive_skips=put(jnp.zeros((), jnp.int32), state_sharding.consecutive_skips),
      balance=jax.tree.map(put, balance, state_sharding.balance))
  return state, what


def _from_checkpoint(source: Source, cfg: RunConfig, target: nnx.State,
                     where: str) -> tuple[nnx.State, str]:
  """The `model` item of a checkpoint step, after checking its saved model config."""
  step_dir = os.path.join(source.directory, str(source.step))
  manager = open_manager(source.directory, read_only=True)
  try:
    saved: dict[str, Any] = saved_config(manager, source.step)
  except Exception as e:  # Orbax raises several types for a missing or corrupt item
    raise ConfigError(f"{where}: cannot read the config of checkpoint {step_dir}: {e}") from e
  finally:
    manager.close()
  diffs = config_differences(saved, cfg, "model",
                             ignore=COMPUTE_ONLY_MODEL_FIELDS + RESUME_CHANGEABLE_MODEL_FIELDS)
  if diffs:
    raise ConfigError(f"{where}: checkpoint {step_dir} was written for another model: "
                      f"{'; '.join(diffs)}. Use the source's model config.")
  try:
    model = restore_model_state(source.directory, target, source.step)
  except Exception as e:  # corrupt arrays or checksums; the message names the tensor
    raise ConfigError(f"{where}: cannot restore the model of checkpoint {step_dir}: "
                      f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
  return model, f"checkpoint step {source.step} of {source.directory}"


def hf_model_state(hf_dir: str, cfg: RunConfig, target: nnx.State, where: str) -> nnx.State:
  """An HF directory's weights and `balancing_biases` buffers as `target`'s nnx.State.

  Args:
    hf_dir: config.json + *.safetensors (`zaya_jax.hf.save_pretrained` output).
    cfg: the run config; every config.json field of `cfg.model` must match hf_dir's.
    target: the model state of ShapeDtypeStructs with shardings (float32); each array is
      placed in its sharding.
    where: the flag named in errors, e.g. "train.init_from=DIR".

  Raises:
    ConfigError: no config.json, another model (naming the fields), missing or damaged
      tensors (one line).
  """
  try:
    hf_model_cfg = read_hf_config(hf_dir)
  except ConvertError as e:
    raise ConfigError(f"{where}: {e}") from e
  diffs = architecture_differences(cfg.model, hf_model_cfg, hf_dir)
  if diffs:
    raise ConfigError(f"{where}: the HF directory holds another model: {'; '.join(diffs)}. "
                      "Use the source's model config (its config.json fields).")
  try:
    model = load_pretrained(hf_dir)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{where}: {e}") from e
  loaded = nnx.to_pure_dict(nnx.state(model))
  pure = nnx.to_pure_dict(target)
  flat_target = dict(jax.tree_util.tree_leaves_with_path(pure))
  flat_loaded = dict(jax.tree_util.tree_leaves_with_path(loaded))
  if set(flat_target) != set(flat_loaded):
    missing = sorted(map(jax.tree_util.keystr, set(flat_target) - set(flat_loaded)))
    raise ConfigError(f"{where}: the HF weights lack {missing[:5]} of this model config")
  values = jax.tree_util.tree_map_with_path(
      lambda p, t: jax.device_put(np.asarray(flat_loaded[p], t.dtype), t.sharding), pure)
  state = jax.tree.map(lambda t: t, target)  # a copy of the structure, filled below
  nnx.replace_by_pure_dict(state, values)
  return state
