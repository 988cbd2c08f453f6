"""Balancing on meshes: `python -m tests.train.balance_mesh_check MODE...` (8 fake CPU devices).

MODE is a `balance.mode`, or "quantile_current" (quantile with `quantile_apply="current"`).
For each MODE, trains a tiny model for `STEPS` steps on one device, on meshes
(data, fsdp, expert) = (1, 1, 8) and (2, 1, 4), and on one device with
`train.grad_accum_steps=2`, the same batches each time, with the step that training
compiles (`zaya_jax.train.setup.setup_training`). Prints one JSON object: for each layout the
per-step routing counts [steps, L, X] (non-padding tokens per class) and biases after each
update [steps, L, X], keyed by mode then layout. tests/train/test_balance_modes.py compares
them with the one-device run's.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from zaya_jax.config import BalanceConfig, TrainConfig  # noqa: E402
from zaya_jax.parallel.mesh import MeshConfig, make_mesh, use_mesh  # noqa: E402
from zaya_jax.train.balance import get_biases  # noqa: E402
from zaya_jax.train.loop import global_batch  # noqa: E402
from zaya_jax.train.setup import setup_training  # noqa: E402
from zaya_jax.train.state import init_train_state  # noqa: E402
from tests.helpers import random_batch, tiny_model_config  # noqa: E402

STEPS = 3
LAYOUTS = {"1 device": (MeshConfig(1, 1, 1), 1, 1), "(1,1,8)": (MeshConfig(1, 1, 8), 8, 1),
           "(2,1,4)": (MeshConfig(2, 1, 4), 8, 1), "1 device, accum 2": (MeshConfig(1, 1, 1), 1, 2)}


def batches():
  """`STEPS` batches of 8 x 16 tokens with documents and padding (numpy)."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    parts = [random_batch(rng, b=2, t=16) for _ in range(4)]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
  return out


def run(mode: str, mesh_cfg: MeshConfig, devices: int, accum: int) -> dict:
  model_cfg = dataclasses.replace(tiny_model_config(), num_experts=8)
  train_cfg = TrainConfig(num_steps=10, warmup_steps=1, lr=3e-2, batch_size=8, seq_len=16,
                          grad_accum_steps=accum)
  apply = "current" if mode == "quantile_current" else "next"
  balance = BalanceConfig(mode=mode.removesuffix("_current"), adamw_lr=3e-2, quantile_apply=apply)
  mesh = make_mesh(mesh_cfg, jax.devices()[:devices])
  with use_mesh(mesh):
    built = setup_training(model_cfg, train_cfg, mesh, balance)
    state = init_train_state(model_cfg, built.tx, train_cfg.seed, mesh)
    counts, biases = [], []
    for batch in batches():
      tokens = float((batch["segment_ids"] > 0).sum())
      state, m = built.step(state, global_batch(batch, built.data_sharding))
      counts.append(np.rint(np.asarray(m["expert_load"]) * tokens).tolist())
      biases.append(np.asarray(get_biases(state.model_state)).tolist())
  return {"counts": counts, "biases": biases}


def main():
  print(json.dumps({mode: {name: run(mode, *layout) for name, layout in LAYOUTS.items()}
                    for mode in sys.argv[1:]}))


if __name__ == "__main__":
  main()
