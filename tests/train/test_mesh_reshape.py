"""Mesh reshape: a checkpoint saved on one mesh resumes on another and trains on identically.

Runs the real CLI (`python -m launch.train`) in subprocesses on a very small config (float32,
CPU, fake devices via XLA_FLAGS=--xla_force_host_platform_device_count=8):

1. N steps on mesh (data, fsdp, expert) = (2, 1, 4), 8 devices; checkpoint N is written.
2. In this process (1 CPU device), checkpoint N is restored and written again with router
   balancing biases set to `BIASES`. The balancing controller moves the biases only by
   ~1e-2 in N steps, so with the initial biases a restore that dropped them and re-created
   them from init could go unnoticed; `BIASES` send the tokens to other experts than the
   initial ones do, so routing, loss and gradients after the resume depend on them.
3. Four copies of that run resume to step 2N: on (2, 1, 4) again, the reference ("as if it
   had not moved"; tests/train/test_resume.py pins a same-mesh resume to an uninterrupted
   run bit for bit), and on (1, 2, 4) (FSDP now shards the hidden dim), (8, 1, 1) (no expert
   parallelism: every device holds all experts) and one device (a process without fake
   devices).

What the comparison of steps N+1..2N with the reference shows (the effects of a wrong
restore were measured by resuming deliberately broken copies of checkpoint N on one device):
- the `lr` of every step equal: the step counter was restored (the schedule reads it);
- the expert load of every step equal, with no tokens on the classes `BIASES` rule out: the
  balancing biases were restored (the initial biases give another expert load from step N+1
  on, and change the loss of step N+1 by 3e-5 relative);
- the loss and gradient norm of step N+1 equal within `RTOL`: they depend on the parameters,
  the biases and the batch only, so the parameters were restored and the data iterator
  stands at batch N+1 (one batch further: loss off by 4e-4, gradient norm by 6e-2 relative);
- the loss and gradient norm of steps N+2..2N equal within `RTOL`: each depends on the
  update before it, i.e. on the AdamW moments and count restored with the optimizer state
  (zeroed moments: loss of step N+2 off by 3e-3 relative; moments and count zeroed: 1e-2).
The final checkpoints (step 2N, written on each target mesh) are then read back here on one
device: the biases (moved from `BIASES` by the balancing controller) and the
controller state equal the reference's, the RNG key and the next batch equal the
reference's, and parameters and optimizer state agree with it to float32 rounding.

Float32 on CPU, but the meshes reduce in different orders (the loss and gradient sums over
batch shards, FSDP's all-gathered matmuls), so the runs need not agree bit for bit. Observed:
loss and gradient norm identical on (1, 2, 4) and (8, 1, 1), off by <= 1.8e-7 relative on one
device; parameters and moments at 2N within 1.7e-6 of each leaf's largest value.

Every subprocess compiles its mesh's train step (the reference reads the first run's from a
shared persistent compilation cache); they run with XLA's LLVM optimisations off
(JAX_DISABLE_MOST_OPTIMIZATIONS, as the whole suite: tests/conftest.py), which
halves compile time, and the four resumes run in parallel.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from tests.helpers import MODEL_OVERRIDES, cache_env, subprocess_xla_flags
from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import GROUPS, CheckpointConfig, resolve
from zaya_jax.data import make_train_iterator
from zaya_jax.parallel.mesh import MeshConfig, abstract_with_shardings, make_mesh, use_mesh
from zaya_jax.train import abstract_train_state, make_optimizer
from zaya_jax.train.state import abstract_model, train_state_shardings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 3  # steps before the interruption; the resumes train N more
SAVE_MESH = (2, 1, 4)  # (data, fsdp, expert)
TARGETS = {"1x2x4": (8, (1, 2, 4)), "8x1x1": (8, (8, 1, 1)), "1dev": (1, (1, 1, 1))}  # name: (devices, mesh)
RTOL = 1e-6  # relative, loss and grad_norm: ~8 float32 ulps; observed <= 2e-7
STATE_RTOL = 1e-5  # per leaf, of its largest |value|: parameters and AdamW moments at 2N;
# observed <= 1.7e-6; N steps move every parameter leaf by >= 1.7e-4 of its largest |value|
TIMEOUT_S = 600  # per subprocess; the four resumes share 2 cores

# Router balancing biases [L, X] (X = 4 experts + skip) written into checkpoint N. The initial
# ones (0, skip -1) route layer 0 to experts 1 and 3, layer 1 to expert 2; these rule out
# (-0.5) experts 1, 3 and the skip class in layer 0, expert 2 and the skip class in layer 1,
# leaving the choice among the others to the router probabilities (which differ by ~1e-4
# here, so a larger bias decides and a zero one lets the router decide).
BIASES = np.array([[0.0, -0.5, 0.0, -0.5, -0.5],
                   [0.0, 0.0, -0.5, 0.0, -0.5]], np.float32)

OVERRIDES = [
    *MODEL_OVERRIDES,
    # The PID controller moves the biases by ~1e-2 in N steps (module docstring), so the
    # restored `BIASES` still decide the routing after the resume.
    "--config.balance.mode=pid",
    "--config.train.seq_len=32",
    "--config.train.batch_size=8",  # divisible by data * fsdp * expert = 8
    f"--config.train.num_steps={2 * N}",  # the LR schedule spans 2N in every run
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.eval_batches=0",  # no eval step: one compile per process
    f"--config.checkpoint.every_steps={N}",
]


def mesh_flags(mesh):
  data, fsdp, expert = mesh
  return [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
          f"--config.mesh.expert={expert}"]


def launch(workdir, cache_dir, devices, mesh, *extra):
  """Starts `python -m launch.train` with `devices` CPU devices; output goes to workdir.log."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env.update({"JAX_PLATFORMS": "cpu", **cache_env(cache_dir), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
  env["XLA_FLAGS"] = subprocess_xla_flags(devices)
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
         f"--workdir={workdir}", *OVERRIDES, *mesh_flags(mesh), *extra]
  log = open(f"{workdir}.log", "w")  # a file: a full pipe would stall a process we don't read yet
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
  log.close()
  return proc


def finish(proc, workdir, deadline):
  """Waits for `proc` (until the monotonic `deadline`); returns its output."""
  try:
    proc.wait(timeout=max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  with open(f"{workdir}.log") as f:
    out = f.read()
  assert proc.returncode == 0, f"{workdir}: exit {proc.returncode}\n{out[-6000:]}"
  return out


def records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if r["kind"] == "train"}


def restore_on_one_device(workdir, step):
  """`(cfg, state, data_iter)` of checkpoint `step`, restored as the training loop restores
  (abstract target with the mesh's shardings, fresh iterator), on a 1-device mesh."""
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), CheckpointConfig())
  saved = ckpt.saved_config(step)  # may hold more than the config groups (e.g. "runtime")
  cfg = resolve(ml_collections.ConfigDict({g: saved[g] for g in GROUPS}))
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=1), jax.devices()[:1])
  with use_mesh(mesh):
    _, params_shape, _ = abstract_model(cfg.model, cfg.train.seed)
    tx = make_optimizer(cfg.train, params_shape)
    abstract = abstract_train_state(cfg.model, tx, cfg.train.seed)
    target = abstract_with_shardings(abstract, train_state_shardings(abstract, mesh))
    data_iter = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                                    batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    state = ckpt.restore(step, target, data_iter, cfg)
  ckpt.close()
  return cfg, state, data_iter


def write_with_biases(src, dst, biases):
  """Run `dst` = run `src` at checkpoint N with the balancing biases replaced by `biases`."""
  cfg, state, data_iter = restore_on_one_device(src, N)
  (old,) = jax.tree.leaves(state.model_state)  # the model's only non-Param variable
  assert old.shape == biases.shape, (old.shape, biases.shape)
  np.testing.assert_array_equal(np.asarray(old)[:, -1], -1.0)  # still the initial biases
  model_state = jax.tree.map(lambda b: jax.device_put(biases, b.sharding), state.model_state)
  os.makedirs(dst)
  ckpt = Checkpointer(os.path.join(dst, "checkpoints"), cfg.checkpoint)
  ckpt.save(state.replace(model_state=model_state), data_iter, cfg)
  ckpt.close()
  shutil.copy(os.path.join(src, "metrics.jsonl"), dst)


def worst_leaf_diff(got, want):
  """`(max |got - want| / max |want|, path)` of the worst leaf of two equal-structure pytrees."""
  diffs = []
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                          strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    diffs.append((float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)),
                  jax.tree_util.keystr(path)))
  return max(diffs)


@pytest.fixture(scope="module")
def cache(compile_cache_dir):
  """The session's JAX compilation cache (tests/conftest.py), for every subprocess."""
  return compile_cache_dir


@pytest.mark.slow
def test_resume_on_another_mesh_matches(tmp_path, cache):
  first, seed = str(tmp_path / "first"), str(tmp_path / "seed")
  deadline = time.monotonic() + TIMEOUT_S
  finish(launch(first, cache, 8, SAVE_MESH, f"--config.train.max_steps_per_run={N}"), first,
         deadline)
  assert sorted(records(first)) == list(range(1, N + 1))
  write_with_biases(first, seed, BIASES)

  runs = {"ref": (8, SAVE_MESH), **TARGETS}
  procs = {}
  try:
    for name, (devices, mesh) in runs.items():
      shutil.copytree(seed, tmp_path / name)
      procs[name] = launch(str(tmp_path / name), cache, devices, mesh)
    deadline = time.monotonic() + TIMEOUT_S
    outs = {name: finish(p, str(tmp_path / name), deadline) for name, p in procs.items()}
  finally:  # a failed run fails the test; don't leave the others running
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()

  for name, (devices, mesh) in runs.items():
    mesh_str = f"mesh {{'data': {mesh[0]}, 'fsdp': {mesh[1]}, 'expert': {mesh[2]}, 'context': 1}}"
    assert re.search(rf"Resuming at step {N}/{2 * N}: .* {devices} devices \(1 processes\), "
                     rf"{re.escape(mesh_str)}", outs[name]), outs[name][-4000:]
  ref = records(tmp_path / "ref")
  assert sorted(ref) == list(range(1, 2 * N + 1))
  # The biases are in force: no tokens on the classes they rule out (the initial biases send
  # every token of layer 0 to experts 1 and 3).
  for step in range(N + 1, 2 * N + 1):
    load = np.asarray(ref[step]["expert_load"])
    np.testing.assert_array_equal(load[BIASES < 0], 0.0, err_msg=f"step {step}: {load}")

  report = {}
  for name in TARGETS:
    got = records(tmp_path / name)
    assert sorted(got) == list(range(1, 2 * N + 1)), (name, sorted(got))
    for step in range(1, N + 1):  # the first run's records, kept by the resume
      assert got[step] == ref[step], (name, step)
    for step in range(N + 1, 2 * N + 1):
      a, b = ref[step], got[step]
      assert b["lr"] == a["lr"], (name, step, a["lr"], b["lr"])
      assert b["expert_load"] == a["expert_load"], (name, step, a["expert_load"], b["expert_load"])
      for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=RTOL, err_msg=f"{name} step {step} {key}")
        report[name, key] = max(report.get((name, key), 0.0), abs(b[key] - a[key]) / abs(a[key]))
  print("max relative difference to the reference, steps N+1..2N:", report)

  # The state each target saved at 2N, read back here on one device.
  _, ref_state, ref_iter = restore_on_one_device(tmp_path / "ref", 2 * N)
  ref_batch = next(ref_iter)
  for name in TARGETS:
    _, state, data_iter = restore_on_one_device(tmp_path / name, 2 * N)
    assert int(state.step) == 2 * N, name
    # The balancing-bias controller moved the biases from BIASES, identically on every mesh
    # (it sees the same global expert counts), and its state was carried along.
    np.testing.assert_array_equal(jax.tree.leaves(state.model_state)[0],
                                  jax.tree.leaves(ref_state.model_state)[0], err_msg=name)
    assert np.abs(jax.tree.leaves(ref_state.model_state)[0] - BIASES).max() > 0  # it did move
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7, err_msg=name),
                 state.balance, ref_state.balance)
    np.testing.assert_array_equal(state.rng, ref_state.rng, err_msg=name)
    batch = next(data_iter)
    for k in ref_batch:
      np.testing.assert_array_equal(batch[k], ref_batch[k], err_msg=f"{name}: next batch {k}")
    for part in ("params", "opt_state"):
      diff, path = worst_leaf_diff(getattr(state, part), getattr(ref_state, part))
      print(f"{name}: {part} max relative diff {diff:.3g} at {path}")
      assert diff <= STATE_RTOL, (name, part, path, diff)
