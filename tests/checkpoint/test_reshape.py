"""zaya_jax.checkpoint.reshape / launch.reshape_checkpoint: summary, optimizer drop, dtype cast, refusals.

- --drop_optimizer --dtype=bfloat16 writes only the step, its parameters in bfloat16 (the
  balancing biases stay float32), no optimizer state, the source's data position files and
  config plus a "reshape" record; restoring it into the float32 model gives exactly the
  bfloat16-rounded source (what launch.convert_to_hf reads); training refuses to resume it;
  the source's files are unchanged;
- a plain copy (step 2, nothing dropped) resumes training exactly, data position included;
- the summary lists each tensor's shape, dtype, sharding and bytes and verifies the checksums;
- an existing --dst, --dst equal to the source, or a missing --step are refused; the CLI prints
  the summary and then refuses an existing --dst with a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.checkpoint.conftest import IGNORE_ABANDONED_READS
from zaya_jax.checkpoint import reshape
from zaya_jax.checkpoint import open_manager, restore_model_state, saved_items
from zaya_jax.config import ConfigError
from zaya_jax.model import BalancingBias
from zaya_jax.parallel.mesh import abstract_with_shardings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = IGNORE_ABANDONED_READS


def tree_digest(directory: str) -> dict[str, str]:
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.mark.slow
def test_drop_optimizer_and_cast_to_bfloat16(tiny, saved, tmp_path):
  workdir = os.path.dirname(saved.directory)
  before = tree_digest(workdir)
  dst = tmp_path / "eval"
  report = reshape.reshape(workdir, str(dst), drop_optimizer=True, dtype="bfloat16")
  out = os.path.join(dst, "checkpoints", "3")
  assert report[-1] == (f"verified {out} model: 37 tensors equal the cast source, including "
                        "every expert (24 (layer, expert) slices of 3 expert tensors)")
  assert tree_digest(workdir) == before  # the source is never modified
  assert os.listdir(dst / "checkpoints") == ["3"]

  manager = open_manager(str(dst / "checkpoints"), read_only=True)
  items = saved_items(manager, 3)
  manager.close()
  assert "opt_state" not in items and {"model", "train_meta", "data_iter"} <= set(items)
  dtypes = {jax.tree_util.keystr(p): m.dtype for p, m in
            jax.tree_util.tree_leaves_with_path(items["model"].tree)}
  assert dtypes["['layers']['mlp']['experts']['w_gate']['value']"] == jnp.bfloat16
  assert dtypes["['layers']['mlp']['router']['balancing_biases']['value']"] == jnp.float32
  with open(os.path.join(out, "config", "metadata")) as f:
    config = json.load(f)
  assert config["reshape"] == {"source": os.path.join(saved.directory, "3"),
                               "param_dtype": "bfloat16", "optimizer_dropped": True}
  assert config["model"] == tiny.cfg.to_dict()["model"]
  src_iter = os.path.join(saved.directory, "3", "data_iter", "process_0-of-1.json")
  with open(src_iter) as a, open(os.path.join(out, "data_iter", "process_0-of-1.json")) as b:
    assert a.read() == b.read()

  # Read back as launch.convert_to_hf does: into the float32 model, verified on the way.
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = abstract_with_shardings(
      nnx.merge_state(tiny.target.params, tiny.target.model_state), cpu)
  got = restore_model_state(str(dst / "checkpoints"), target)
  want = nnx.merge_state(tiny.state.params, tiny.state.model_state)

  def expected(v):
    x = np.asarray(v[...])
    return x if isinstance(v, BalancingBias) else x.astype(jnp.bfloat16).astype(np.float32)

  is_var = lambda v: isinstance(v, nnx.Variable)
  want_leaves = jax.tree_util.tree_leaves_with_path(want, is_leaf=is_var)
  got_leaves = jax.tree.leaves(got, is_leaf=is_var)
  assert len(got_leaves) == len(want_leaves) == 37
  rounded = set()
  for g, (path, w) in zip(got_leaves, want_leaves):
    assert g[...].dtype == np.float32
    assert np.array_equal(np.asarray(g[...]), expected(w))
    if not np.array_equal(np.asarray(g[...]), np.asarray(w[...])):
      rounded.add(jax.tree_util.keystr(path))
  assert {f"['layers']['mlp']['experts']['{w}']" for w in ("w_gate", "w_up", "w_down")} <= rounded
  assert len(rounded) >= 10  # every random matrix; norms and scales (ones, zeros) stay exact

  ckpt = tiny.checkpointer(dst / "checkpoints")
  with pytest.raises(ConfigError, match="holds no optimizer state"):
    ckpt.restore_latest(tiny.target, tiny.iterator(), tiny.cfg)
  ckpt.close()


@pytest.mark.slow
def test_plain_copy_resumes_training_exactly(tiny, saved, tmp_path):
  report = reshape.reshape(saved.directory, str(tmp_path / "copy"), step=2)
  assert report[-1].endswith("(48 (layer, expert) slices of 6 expert tensors)")  # mu, nu
  ckpt = tiny.checkpointer(tmp_path / "copy" / "checkpoints")
  it = tiny.iterator()
  restored = ckpt.restore_latest(tiny.target, it, tiny.cfg)
  assert (restored.step, restored.data_restored) == (2, True)
  for a, b in zip(jax.tree.leaves((restored.state.params, restored.state.opt_state)),
                  jax.tree.leaves((tiny.state.params, tiny.state.opt_state))):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert int(restored.state.skipped_steps) == 1
  assert np.array_equal(next(it)["inputs"], saved.batch_after[2])
  ckpt.close()


def test_summary_lists_tensors_and_verifies(saved):
  text = reshape.summarize(os.path.join(saved.directory, "2"))  # a step directory
  lines = text.splitlines()
  assert lines[0] == f"checkpoint {os.path.join(saved.directory, '2')} (step 2)"
  assert "items: model, opt_state, train_meta, data_iter, config, integrity" in lines
  assert "train_meta: consecutive_skips=1, rng=[7, 11], skipped_steps=1, step=2" in lines
  assert ("  layers.mlp.experts.w_gate.value  shape=(2, 4, 32, 32)  dtype=float32  "
          "sharding=device cpu:0  bytes=32768") in lines
  assert any(l.startswith("  1.0.mu.layers.mlp.experts.w_down.value  shape=(2, 4, 32, 32)")
             for l in lines)
  assert any(l.startswith("  total model: 37 tensors, ") for l in lines)
  assert any(l.startswith("  total opt_state: 74 tensors, ") for l in lines)
  assert "checksums model: verified (37 tensors, 24 (layer, expert) slices)" in lines
  assert "checksums opt_state: verified (74 tensors, 48 (layer, expert) slices)" in lines


def test_refusals(saved, tmp_path):
  dst = tmp_path / "taken"
  shutil.copytree(saved.directory, dst / "checkpoints")
  with pytest.raises(ValueError, match="already holds .* refusing to overwrite"):
    reshape.reshape(saved.directory, str(dst), drop_optimizer=True)
  with pytest.raises(ValueError, match="is the source"):
    reshape.reshape(saved.directory, os.path.dirname(saved.directory))
  # --dst=RUN/checkpoints wrote RUN/checkpoints/checkpoints/<step> into the source
  with pytest.raises(ValueError, match="is inside the source's checkpoint directory"):
    reshape.reshape(saved.directory, saved.directory)
  assert "checkpoints" not in os.listdir(saved.directory)
  with pytest.raises(ValueError, match=r"--step=7 is not in .* it holds steps \[1, 2, 3\]"):
    reshape.summarize(saved.directory, step=7)


@pytest.mark.slow
def test_cli_prints_summary_then_refuses_existing_dst(saved, tmp_path):
  dst = tmp_path / "taken"
  shutil.copytree(saved.directory, dst / "checkpoints")
  proc = subprocess.run(
      [sys.executable, "-m", "launch.reshape_checkpoint", f"--src={saved.directory}",
       "--step=1", "--summary", f"--dst={dst}", "--drop_optimizer"],
      cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 1, proc.stderr[-4000:]
  assert ("  layers.mlp.experts.w_up.value  shape=(2, 4, 32, 32)  dtype=float32  "
          "sharding=device cpu:0  bytes=32768") in proc.stdout
  assert "checksums model: verified (37 tensors, 24 (layer, expert) slices)" in proc.stdout
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"reshape_checkpoint: --dst={dst}: {dst}/checkpoints already holds ['1', '2', '3']; "
      "refusing to overwrite")
