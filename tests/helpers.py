"""Shared test infrastructure: tiny configs, random models and batches, one closeness check.

Every test module imports from here, never from another test module.
- `assert_close`: one tolerance table by dtype (`TOLERANCES`); a test may pass a tighter or
  an explicitly justified atol/rtol.
- `tiny_model_config`, `MODEL_OVERRIDES`: the 2-layer, 4-expert model of the unit tests and
  the same sizes as `launch.train` flags for the CLI tests.
- `random_model`, `random_batch`: every parameter randomised at realistic scales; a packed
  batch with two documents in one row and padding in the other.
- `launch_train` / `finish_run` / `run_records`: the training CLI in a subprocess;
  `launch_devices` / `launch_pair` / `wait_all`: the multi-controller runs (fake CPU devices,
  two processes on a local coordinator) of test_multiprocess.py and test_global_batches.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# (atol, rtol) by the dtype of the values compared: float32 math against a float64 or
# float32 reference, and bfloat16 (8 mantissa bits: 2**-8 relative rounding per operand).
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)}


def assert_close(name: str, got, want, atol: float | None = None, rtol: float | None = None,
                 dtype: str | None = None) -> None:
  """`|got - want| <= atol + rtol * |want|` elementwise; the message prints the error size.

  Args:
    name: what is compared, for the failure message.
    got: our array (any array-like).
    want: the reference array, same shape.
    atol, rtol: absolute / relative tolerance; default `TOLERANCES[dtype]`.
    dtype: "float32" | "bfloat16"; default the dtype of `got` if it is bfloat16, else float32.
  Raises:
    AssertionError: shapes differ or any element is off (count, max and mean |diff|).
  """
  if dtype is None:
    dtype = "bfloat16" if getattr(got, "dtype", None) == jnp.bfloat16 else "float32"
  d_atol, d_rtol = TOLERANCES[dtype]
  atol = d_atol if atol is None else atol
  rtol = d_rtol if rtol is None else rtol
  got = np.asarray(got, dtype=np.float64)
  want = np.asarray(want, dtype=np.float64)
  assert got.shape == want.shape, f"{name}: shape {got.shape} != reference shape {want.shape}"
  diff = np.abs(got - want)
  bad = diff > atol + rtol * np.abs(want)
  assert not bad.any(), (
      f"{name}: {int(bad.sum())}/{bad.size} elements off; max|diff|={diff.max():.3g} "
      f"mean|diff|={diff.mean():.3g} max|want|={np.abs(want).max():.3g} (atol {atol}, rtol {rtol})")


def tiny_model_config():
  """2 layers (one sliding, window 4), D=32, 4 heads / 2 kv heads, 4 experts: `ModelConfig`."""
  from configs import zaya1_tiny  # pylint: disable=import-outside-toplevel
  from zaya_jax.config import resolve  # pylint: disable=import-outside-toplevel

  return dataclasses.replace(
      resolve(zaya1_tiny.get_config()).model, hidden_size=32, num_layers=2,
      layer_types=("hybrid", "hybrid_sliding"), sliding_window=4, head_dim=16, num_heads=4,
      num_kv_heads=2, num_experts=4, moe_intermediate_size=32, router_hidden_size=16)


def random_batch(rng, b=2, t=12, vocab=320):
  """A `[b, t]` int32 batch dict (inputs, targets, segment_ids, positions, loss_mask): row 0
  holds two documents (8 + rest tokens), row 1 ends in padding from position 10."""
  inputs = rng.integers(3, 259, (b, t)).astype(np.int32)
  targets = np.roll(inputs, -1, axis=1)
  segment_ids = np.ones((b, t), np.int32)
  segment_ids[0, 8:] = 2  # a second document in row 0
  segment_ids[1, 10:] = 0  # padding at the end of row 1
  positions = np.concatenate([np.arange(8), np.arange(t - 8)])[None].repeat(b, 0).astype(np.int32)
  positions[1] = np.arange(t)
  loss_mask = (segment_ids > 0).astype(np.float32)
  loss_mask[0, 7] = 0.0  # the last token of a document predicts nothing
  return dict(inputs=inputs, targets=targets, segment_ids=segment_ids, positions=positions,
              loss_mask=loss_mask)


def layer_slice(stacked_module: nnx.Module, i: int) -> dict:
  """Pure dict (numpy leaves) of layer `i` of a module whose leaves carry a leading layer axis."""
  pure = nnx.to_pure_dict(nnx.state(stacked_module))

  def take(tree):
    return {k: take(v) if isinstance(v, dict) else np.asarray(v)[i] for k, v in tree.items()}

  return take(pure)


def module_with(make, pure: dict) -> nnx.Module:
  """Builds `make()` abstractly (no random init) and fills every variable from `pure`."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)


def random_model(cfg, seed: int = 0):
  """`ZayaForCausalLM(cfg)` with numpy-random parameters at realistic scales.

  Built with `nnx.eval_shape` and filled from numpy, because `nnx.Rngs` initialisation
  compiles one threefry program per parameter shape (tens of seconds on a small CPU).
  Residual/norm scales ~1, biases ~0.1, `temp` ~2, router `out_proj` ~1.5 (token-dependent
  routing), other matrices ~0.2, balancing biases 0 (skip class -1, as initialised).
  """
  from zaya_jax.model import ZayaForCausalLM  # local: conftest is imported by every test module

  g = np.random.default_rng(seed)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))

  def fill(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    name, shape = keys[-1], leaf.shape
    normal = lambda mean, std: (mean + std * g.standard_normal(shape)).astype(np.float32)
    if name == "balancing_biases":
      return np.zeros(shape, np.float32) + np.where(np.arange(shape[-1]) == shape[-1] - 1, -1.0, 0.0).astype(np.float32)
    if name == "temp":
      return normal(2.0, 0.5)
    if name in ("weight", "router_states_scale") or name.endswith("_scale"):
      return normal(1.0, 0.1)
    if "bias" in name:
      return normal(0.0, 0.1)
    if name == "out_proj" and "router" in keys:
      return normal(0.0, 1.5)
    if name == "embed_tokens":
      return normal(0.0, 1.0)
    return normal(0.0, 0.2)

  pure = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)


# `launch.train` flags for the same small model as `tiny_model_config` (window 8, 2 heads):
# each CLI subprocess compiles and trains in seconds.
MODEL_OVERRIDES = [
    "--config.model.hidden_size=32",
    "--config.model.num_layers=2",
    "--config.model.layer_types=('hybrid','hybrid_sliding')",
    "--config.model.sliding_window=8",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=16",
    "--config.model.num_experts=4",
    "--config.model.moe_intermediate_size=32",
    "--config.model.router_hidden_size=16",
]


# --- the training CLI in a subprocess (tests/train/test_resume.py, test_fault_tolerance.py) ---
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_EVERY = 3  # checkpoint interval of `CLI_TRAIN_OVERRIDES`, which runs 2 * CLI_EVERY steps
CLI_TRAIN_OVERRIDES = [
    *MODEL_OVERRIDES,
    "--config.train.seq_len=32",
    "--config.train.batch_size=2",
    f"--config.train.num_steps={2 * CLI_EVERY}",
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.eval_batches=1",
    f"--config.checkpoint.every_steps={CLI_EVERY}",
]


def cache_env(cache_dir) -> dict[str, str]:
  """The environment of a subprocess that reads and writes JAX's persistent compilation
  cache in `cache_dir` (a job-local directory, never shared between machines)."""
  return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def launch_train(workdir, cache_dir, *extra) -> subprocess.Popen:
  """Starts `python -m launch.train` on the tiny config with `CLI_TRAIN_OVERRIDES` and then
  `extra` flags (later flags win), stdout and stderr together in one text pipe; the JAX
  compilation cache in `cache_dir` (shared by a module's runs, so later ones skip compiles).

  The cache hits on CPU with jax 0.10.2 (jax#38445 reports CPU entries rejected on reload
  in 0.9.1-0.10.1): a second run of these flags reads all 27 programs from it, 17.7 s of
  backend compile down to 0.7 s. Size -1: every entry is written, with no override."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **cache_env(cache_dir)}
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
         f"--workdir={workdir}", *CLI_TRAIN_OVERRIDES, *extra]
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def finish_run(proc: subprocess.Popen, timeout: float = 240) -> str:
  """Waits for a `launch_train` process; returns its output.

  Raises:
    AssertionError: it exited non-zero (with the output's tail).
    subprocess.TimeoutExpired: it ran over `timeout` seconds.
  """
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-4000:]
  return out


def run_records(workdir, kind: str = "train") -> dict[int, dict]:
  """`{step: record}` of `workdir/metrics.jsonl` records of `kind` (a rerun step's last wins)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if r["kind"] == kind}


# --- multi-controller runs in subprocesses (tests/train/test_multiprocess.py,
# tests/data/test_global_batches.py): tiny model, T=32, B=8, mesh data=2 x expert=4 ---
MULTIPROCESS_T, MULTIPROCESS_B = 32, 8  # tokens per row, rows per global batch
MULTIPROCESS_TIMEOUT_S = 240  # per run, all processes together

MULTIPROCESS_OVERRIDES = [
    *MODEL_OVERRIDES,
    f"--config.train.seq_len={MULTIPROCESS_T}",
    f"--config.train.batch_size={MULTIPROCESS_B}",
    "--config.train.num_steps=1000",  # the equality test stops after max_steps_per_run
    "--config.train.warmup_steps=1",
    "--config.train.log_every=1",
    "--config.train.eval_batches=0",
    "--config.data.eval_fraction=0",
    # A batch must stay one epoch of the documents (test_multiprocess.py's docstring): raw
    # text's row shuffle permutes rows across the epochs inside a window, differently for 1
    # and 2 processes.
    "--config.data.shuffle_rows=False",
    "--config.checkpoint.every_steps=0",  # one checkpoint, at the end
    "--config.mesh.data=2",
    "--config.mesh.fsdp=1",
    "--config.mesh.expert=4",
]


# XLA:CPU's older loop emitters instead of its fusion emitters, for the whole suite and its
# subprocesses (tests/conftest.py, not with ZAYA_TEST_FULL_OPT=1): they halve the backend
# compile of the tiny train step at LLVM -O0 (5.7 -> 2.4 s), most of the suite's time.
SUITE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)


def with_suite_xla_flags(xla_flags: str) -> str:
  """`xla_flags` (an XLA_FLAGS value) with `SUITE_XLA_FLAGS` added where not already there,
  unless ZAYA_TEST_FULL_OPT=1 (XLA's defaults)."""
  if os.environ.get("ZAYA_TEST_FULL_OPT") == "1":
    return xla_flags
  flags = xla_flags.split()
  names = {f.split("=", 1)[0] for f in flags}
  return " ".join(flags + [f for f in SUITE_XLA_FLAGS if f.split("=", 1)[0] not in names])


def subprocess_xla_flags(devices: int = 1) -> str:
  """The XLA_FLAGS of a test's subprocess: `devices` fake CPU devices (no flag for 1) and
  `SUITE_XLA_FLAGS` (`with_suite_xla_flags`)."""
  return with_suite_xla_flags(
      f"--xla_force_host_platform_device_count={devices}" if devices > 1 else "")


def launch_devices(workdir, corpus_path, devices, *extra, log=None, cache_dir=None):
  """Starts `python -m launch.train` on `corpus_path` with `MULTIPROCESS_OVERRIDES`, then
  `extra`, and `devices` fake CPU devices; output goes to `log`.

  XLA's LLVM optimisations are off (JAX_DISABLE_MOST_OPTIMIZATIONS, as in the whole suite:
  tests/conftest.py): it halves the compile time, and every run of these tests, one process
  or two, is compiled alike.

  `cache_dir`: JAX's persistent compilation cache, for a single-process run only. Never for
  the processes of a multi-process run: in jax 0.10.2 the cache key differs per process and
  only process 0 writes entries, so process 0 would load its step from the cache while
  process 1 compiles, and gloo gives up on the first collective after 30 s.
  """
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.update({"JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
              "XLA_FLAGS": subprocess_xla_flags(devices)})
  if cache_dir is not None:
    assert not any(a.startswith("--num_processes") for a in extra), "one process only"
    env.update(cache_env(cache_dir))
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
         f"--workdir={workdir}", f"--config.data.source={corpus_path}", *MULTIPROCESS_OVERRIDES,
         *extra]
  out = open(log, "w") if log else subprocess.DEVNULL  # a file: a full pipe would stall a peer
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def free_port():
  """A TCP port that was free a moment ago (bound to port 0, then released)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_pair(workdir, corpus_path, tmp_path, *extra):
  """Two processes x 4 devices on a fresh local coordinator port."""
  address = f"127.0.0.1:{free_port()}"
  return [launch_devices(workdir, corpus_path, 4, f"--coordinator_address={address}",
                         "--num_processes=2", f"--process_id={i}", *extra,
                         log=tmp_path / f"proc{i}.log")
          for i in range(2)]


def wait_all(procs, timeout):
  """Waits for every process until a shared deadline; kills them all if it passes."""
  deadline = time.monotonic() + timeout
  try:
    return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
      p.wait()
    raise


def tail(tmp_path, name, n=4000):
  """The last `n` characters of the log file `tmp_path/name`."""
  return (tmp_path / name).read_text()[-n:]


def losses(workdir):
  """`{step: loss}` of the train records of `workdir/metrics.jsonl`."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
