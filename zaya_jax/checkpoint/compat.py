"""Can this run resume from that checkpoint? Checks of a step's saved config and items against
the current RunConfig, before any array is read.

Three outcomes, kept apart on purpose: a user error (another model, no optimizer state) is a
`ConfigError` and moves nothing; a step that lacks an item or record is a
`CorruptCheckpointError` (restore_latest falls back past it); a run-shape change (process
count, `data.num_workers`, `train.seq_len`) only restarts the data order, with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
from absl import logging

from zaya_jax.checkpoint.manager import CorruptCheckpointError
from zaya_jax.config import (COMPUTE_ONLY_MODEL_FIELDS, RESUME_CHANGEABLE_MODEL_FIELDS, ConfigError,
                             RunConfig, config_differences)
from zaya_jax.model import ModelConfig


def check_resumable(path: str, saved: dict[str, Any], config: RunConfig,
                    items: dict[str, Any]) -> None:
  """Refuses a checkpoint this run cannot resume; warns about what it resumes differently.

  Args:
    path: the step directory, for the messages.
    saved: its `config` item (a RunConfig dict plus "runtime", maybe "reshape").
    config: the current run's config. Its `model` group must equal the saved one, except
      for compute-only fields (`COMPUTE_ONLY_MODEL_FIELDS`, e.g. dtype, remat) and the RoPE
      bases (`RESUME_CHANGEABLE_MODEL_FIELDS`: context extension; a change is logged).
    items: `manager.saved_items` of the step.

  Raises:
    ConfigError: if the checkpoint was written for a different model config (naming the
      fields), or holds no optimizer state (`reshape_checkpoint --drop_optimizer`).
  """
  diffs = config_differences(saved, config, "model",
                             ignore=COMPUTE_ONLY_MODEL_FIELDS + RESUME_CHANGEABLE_MODEL_FIELDS)
  if diffs:
    raise ConfigError(f"checkpoint {path} was written for another model: {'; '.join(diffs)}. "
                      "Use the same model config to resume, or a fresh --workdir.")
  rope = [d for d in config_differences(saved, config, "model")
          if d.split(":")[0].split(".")[1] in RESUME_CHANGEABLE_MODEL_FIELDS]
  if rope:
    logging.warning("resuming %s with other RoPE bases (%s): context extension; the "
                    "parameters are kept", path, "; ".join(rope))
  if "opt_state" not in items:
    raise ConfigError(
        f"checkpoint {path} holds no optimizer state (written by launch.reshape_checkpoint "
        "--drop_optimizer, for evaluation or export with launch.convert_to_hf); it cannot "
        "resume training. Resume from the original checkpoint, or use a fresh --workdir.")
  reshape = saved.get("reshape", {})  # present only after launch.reshape_checkpoint
  if reshape.get("param_dtype") not in (None, "float32"):
    logging.warning("checkpoint %s holds parameters cast to %s by launch.reshape_checkpoint: "
                    "training resumes from the rounded values", path, reshape["param_dtype"])
  data_diffs = config_differences(saved, config, "data", ignore=("num_workers",))
  if data_diffs:
    logging.warning("resuming %s with a different data config (%s)", path, "; ".join(data_diffs))


def check_complete(path: str, saved: dict[str, Any], items: dict[str, Any],
                   names: tuple[str, ...]) -> None:
  """Raises CorruptCheckpointError if the step lacks one of the items `names` or its config
  item lacks the writing run's "runtime" record (both always written by `Checkpointer.save`)."""
  missing = [name for name in names if name not in items]
  if missing:
    raise CorruptCheckpointError(f"checkpoint {path} lacks the item(s) {missing}")
  if "process_count" not in saved.get("runtime", {}):
    raise CorruptCheckpointError(f"checkpoint {path}: its config item lacks the runtime record "
                                 "(process_count)")


def data_restart_reason(saved: dict[str, Any], config: RunConfig, data_iter: Any,
                        saved_global: bool | None = None) -> str | None:
  """Why a checkpoint's data position cannot be applied to `data_iter`, or None if it can.

  `saved_global`: whether the saved position is a prepared corpus's global one (a
  `zaya-global-*` state, `saved_data_state_is_global`), None if unknown. A position of the
  other kind of pipeline than `data_iter`'s (prepared data or a mixture <-> raw text, e.g.
  data.source changed from a prepared directory to "stdlib") cannot be applied.

  Positions are per process (`[process_index::process_count]` documents) and per grain
  pipeline: worker processes (`data.num_workers`) pack in another order, and a workers'
  position is not converted to another `train.seq_len` (the in-process one is, see
  `zaya_jax.data.pipeline.PackedIterator`).

  An iterator with `process_independent = True` (prepared corpora,
  `zaya_jax.data.global_iterator.GlobalBatchIterator`) holds the same global position on every
  process, whatever the process or worker count: only a `train.seq_len` change restarts it
  (its rows are cut at another length, so the saved row number means other tokens).
  """
  saved_len = saved["train"]["seq_len"]
  now_global = bool(getattr(data_iter, "process_independent", False))
  if saved_global is not None and saved_global != now_global:
    kinds = ("a prepared corpus's global batch position", "a raw-text pipeline's position")
    return (f"it holds {kinds[0] if saved_global else kinds[1]} and this run reads "
            f"{'prepared data' if now_global else 'raw text'} (data.source="
            f"{config.data.source!r}{', data.mixture' if config.data.mixture else ''}), whose "
            "iterator cannot take it")
  if now_global:
    if saved_len != config.train.seq_len:
      return (f"train.seq_len changed {saved_len} -> {config.train.seq_len}: the saved global "
              "row counts rows of the old length")
    return None
  saved_count = int(saved["runtime"]["process_count"])
  if saved_count != jax.process_count():
    return (f"it was written by {saved_count} process(es) and this run has "
            f"{jax.process_count()}: each saved position covers other documents")
  saved_workers = saved["data"]["num_workers"]
  if saved_workers != config.data.num_workers:
    return (f"data.num_workers changed {saved_workers} -> {config.data.num_workers} (each "
            "worker count reads the documents in its own order)")
  # Rows per raw-text shuffle window, None with data.shuffle_rows off.
  saved_window = saved["data"].get("shuffle_window") if saved["data"].get("shuffle_rows") else None
  window = config.data.shuffle_window if config.data.shuffle_rows else None
  if saved_window != window and (config.data.num_workers or None not in (saved_window, window)):
    return (f"the row shuffle window changed {saved_window} -> {window} rows (None: "
            "data.shuffle_rows off): a position inside a shuffle window "
            + ("of worker processes cannot be converted" if config.data.num_workers
               else "of another size cannot be converted"))
  if saved_len != config.train.seq_len and (
      config.data.num_workers or not hasattr(data_iter, "saved_seq_len")):
    return (f"train.seq_len changed {saved_len} -> {config.train.seq_len} and the position of "
            f"a pipeline with data.num_workers={config.data.num_workers} cannot be converted")
  return None


def process0_data_state_file(step_path: str, process_count: int) -> str:
  """The JSON file of process 0's data position in checkpoint `step_path`, written by
  `process_count` processes (grain's `process_<i>-of-<n>.json` in the `data_iter` item)."""
  return os.path.join(step_path, "data_iter", f"process_0-of-{process_count}.json")


def saved_data_state_is_global(step_path: str, saved: dict[str, Any]) -> bool | None:
  """Whether the `data_iter` item of checkpoint `step_path` (written by
  `saved["runtime"]["process_count"]` processes) is a prepared corpus's global position (a
  `zaya-global-*` state, `zaya_jax.data.global_iterator`) rather than a raw-text pipeline's
  grain state; None if process 0's file cannot be read (the restore names that)."""
  count = int(saved.get("runtime", {}).get("process_count", 1))
  filename = process0_data_state_file(step_path, count)
  try:
    with open(filename, encoding="utf-8") as f:
      state = json.load(f)
  except (OSError, ValueError):
    return None
  return isinstance(state, dict) and str(state.get("format", "")).startswith("zaya-global-")


def balance_state_reset_reason(saved: dict[str, Any], config: RunConfig) -> str | None:
  """Why the saved balancing controller state must restart from zero, or None to keep it.

  The state's leaves are the same in every `balance.mode` (zaya_jax/train/balance.py), but
  not their meaning: "pid" integrates the load error (token shares), "quantile" with
  `quantile_integral` the bias shifts (probability units). A mode change on resume therefore
  restarts the controller state; the biases themselves (model state) are kept.
  """
  saved_mode = saved.get("balance", {}).get("mode")
  if saved_mode is not None and saved_mode != config.balance.mode:
    return (f"balance.mode changed {saved_mode!r} -> {config.balance.mode!r}: the balancing "
            "controller's state (integral, last error, AdamW moments) restarts from zero; the "
            "balancing biases are kept")
  return None


# Settings whose defaults changed on 2026-12-03, 2026-12-06 and 2026-12-07 (the tiny config's
# experts at half the lr; README "Load balancing") and which a resume may change (they are not
# in the checkpointed state's shapes), with the value a run saved before the field existed had:
# the default then (no router or expert scaling, no integral, no reroute).
_BALANCING_SETTINGS = (("train", "router_lr_scale", 1.0), ("train", "expert_lr_scale", 1.0),
                       ("balance", "quantile_integral", 0.0),
                       ("balance", "quantile_reroute", False),
                       ("balance", "rate_lr_power", 0.0),
                       ("balance", "exclude_layers", ()))


def changed_balancing_settings(saved: dict[str, Any], config: RunConfig) -> list[str]:
  """`"group.field old -> new"` for each of `_BALANCING_SETTINGS` whose value in the saved run
  config `saved` (a field the saved run lacks: its value before the field existed) differs
  from `config`'s. Not an error: the run continues with the new values (the checkpointer
  warns once, so that a run resumed under new defaults does not change silently)."""
  out = []
  for group, field, before in _BALANCING_SETTINGS:
    old = saved.get(group, {}).get(field, before)
    old = tuple(old) if isinstance(old, list) else old  # JSON keeps tuples as lists
    new = getattr(getattr(config, group), field)
    if old != new:
      out.append(f"{group}.{field} {old!r} -> {new!r}")
  return out


def saved_model_config(saved: dict[str, Any]) -> ModelConfig:
  """The ModelConfig of a saved RunConfig dict (fields unknown to this code are dropped)."""
  names = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in saved["model"].items() if k in names})
