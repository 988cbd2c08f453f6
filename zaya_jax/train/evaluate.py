# Shape letters: L X (see zaya_jax/__init__.py).
"""Evaluation: the loop's `evaluate` over eval batches, and evaluation-only runs of a saved
model (`launch.evaluate`): a run's checkpoint (only its `model` item, so `reshape_checkpoint
--drop_optimizer` copies work) or a Hugging Face directory, on the eval split of `data`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from zaya_jax.checkpoint import restore_model_state
from zaya_jax.config import GROUPS, ConfigError, RunConfig, resolve
from zaya_jax.data import make_eval_batches
from zaya_jax.parallel.mesh import abstract_with_shardings, make_mesh, use_mesh
from zaya_jax.train.init_from import hf_model_state
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import TrainState
from zaya_jax.train.step import expert_load, make_eval_step


def evaluate(eval_step, state: TrainState, batches: list[dict[str, jax.Array]]) -> dict[str, Any]:
  """Mean next-token loss over all masked tokens of `batches`, and expert load [L, X].

  Args:
    eval_step: `make_eval_step(...)` (or its compiled form): (state, batch) -> sums.
    state: a TrainState; only `params` and `model_state` are read.
    batches: `[B, T]` batch dicts on the devices.

  Returns:
    {"loss": float (nats per token), "tokens": float (masked tokens counted),
     "expert_load": [L][X] lists (fraction of each layer's tokens per class, skip last)}.
  """
  loss_sum, tokens, counts_LX = 0.0, 0.0, 0.0
  for batch in batches:
    out = jax.device_get(eval_step(state, batch))
    loss_sum += float(out["loss_sum"])
    tokens += float(out["tokens"])
    counts_LX = counts_LX + np.asarray(out["expert_counts"], np.float64)
  return {"loss": loss_sum / max(tokens, 1.0), "tokens": tokens,
          "expert_load": np.asarray(expert_load(np.asarray(counts_LX))).tolist()}


def evaluate_sets(eval_step, state: TrainState,
                  sets: dict[str, list[dict[str, jax.Array]]]) -> dict[str, Any]:
  """`evaluate` over every batch of `sets` (each batch run once), plus, with more than one
  set (a data.mixture's sources, `zaya_jax.data.make_eval_sets`), `"sources": {name: {"loss",
  "tokens", "perplexity"}}` per set (losses in nats per token).

  Raises:
    ValueError: if `sets` holds no batch.
  """
  if not any(sets.values()):
    raise ValueError("no eval batches")
  per_set = {name: evaluate(eval_step, state, batches) for name, batches in sets.items()}
  if len(per_set) == 1:
    return next(iter(per_set.values()))
  tokens = sum(r["tokens"] for r in per_set.values())
  counts = sum(np.asarray(r["expert_load"], np.float64) * r["tokens"] for r in per_set.values())
  return {  # token-weighted: the same sums as `evaluate` over all batches at once
      "loss": sum(r["loss"] * r["tokens"] for r in per_set.values()) / max(tokens, 1.0),
      "tokens": tokens, "expert_load": (counts / max(tokens, 1.0)).tolist(),
      "sources": {name: {"loss": r["loss"], "tokens": r["tokens"],
                         "perplexity": math.exp(min(r["loss"], 700.0))}
                  for name, r in per_set.items()}}


def load_summary(expert_load_LX) -> dict[str, list[float]]:
  """Per layer: `max_over_mean` (the largest expert's load / the experts' mean load, 1.0 =
  even; the skip class, last column, left out) and `skip_fraction` (share of tokens skipped).

  Args:
    expert_load_LX: [L, X] fractions, X = experts + 1 (skip last), as `evaluate` returns.
  """
  load = np.asarray(expert_load_LX, np.float64)
  experts = load[:, :-1]
  mean = np.maximum(experts.mean(axis=1), 1e-12)
  return {"max_over_mean": (experts.max(axis=1) / mean).tolist(),
          "skip_fraction": load[:, -1].tolist()}


def run_config_of(saved: dict[str, Any]) -> RunConfig:
  """The RunConfig of a checkpoint's saved config dict (extra records such as "runtime" and
  "reshape" ignored; fields unknown to this code are an error from `resolve`).

  Raises:
    ConfigError: the saved config does not validate under this code.
  """
  groups = {g: saved[g] for g in GROUPS if g in saved}
  groups["model"] = {k: tuple(v) if isinstance(v, list) else v for k, v in groups["model"].items()}
  return resolve(ml_collections.ConfigDict(groups))


def with_eval_data(cfg: RunConfig, *, eval_batches: int | None = None,
                   data_source: str | None = None) -> RunConfig:
  """`cfg` with `train.eval_batches` and/or `data.source` replaced (None keeps them)."""
  if data_source is not None:
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=data_source))
  if eval_batches is not None:
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=eval_batches))
  return cfg


def evaluate_saved(cfg: RunConfig, *, ckpt_dir: str | None = None, step: int | None = None,
                   hf_dir: str | None = None) -> dict[str, Any]:
  """Evaluates a saved model on the first `cfg.train.eval_batches` batches of the eval split
  of `cfg.data`, as the training loop does (same batches, same jitted eval step, same mesh).

  Args:
    cfg: the run config; `model` must be the saved model's.
    ckpt_dir, step: a run's `checkpoints/` directory and the step to read (only its `model`
      item); or hf_dir: a Hugging Face directory (config.json + *.safetensors).

  Returns:
    {"kind": "eval", "step": the checkpoint step (None for hf_dir), "loss": nats per token,
     "perplexity": exp(loss), "tokens": tokens counted, "batches": batches evaluated,
     "expert_load": [L][X], "max_over_mean": [L], "skip_fraction": [L]}.

  Raises:
    ConfigError: an empty eval split, train.eval_batches=0, or a model that does not match.
    ValueError: the checkpoint cannot be read (names the item or tensor).
  """
  if not cfg.train.eval_batches:
    raise ConfigError("train.eval_batches=0: nothing to evaluate; pass --eval_batches=N")
  mesh = make_mesh(cfg.mesh)
  with use_mesh(mesh):
    built = setup_training(cfg.model, cfg.train, mesh, None)
    target = abstract_with_shardings(built.abstract_state, built.state_sharding).to_items()["model"]
    if hf_dir is not None:
      model = hf_model_state(hf_dir, cfg, target, f"--hf_dir={hf_dir}")
    else:
      model = restore_model_state(ckpt_dir, target, step)
    params, model_state = nnx.split_state(model, nnx.Param, ...)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                       opt_state=None, rng=jnp.zeros((2,), jnp.uint32))
    try:
      host_batches = make_eval_batches(cfg.data, seq_len=cfg.train.seq_len,
                                       batch_size=cfg.train.batch_size,
                                       max_batches=cfg.train.eval_batches)
    except ValueError as e:
      raise ConfigError(str(e)) from e
    batches = [{k: jax.device_put(v, built.data_sharding) for k, v in b.items()}
               for b in host_batches]
    out = evaluate(make_eval_step(built.graphdef), state, batches)
  return {"kind": "eval", "step": step if hf_dir is None else None, "loss": out["loss"],
          "perplexity": math.exp(min(out["loss"], 700.0)), "tokens": out["tokens"],
          "batches": len(batches), "expert_load": out["expert_load"],
          **load_summary(out["expert_load"])}
