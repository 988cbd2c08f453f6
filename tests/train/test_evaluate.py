"""Evaluation only (zaya_jax/train/evaluate.py, launch.evaluate): the loss of the training
loop's final eval record, also from a --drop_optimizer copy and an HF export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import REPO, run_records
from tests.train.inproc import STEPS, tiny_run_config
from zaya_jax.checkpoint import find_run_checkpoint
from zaya_jax.checkpoint.reshape import reshape
from zaya_jax.config import ConfigError, resolve
from zaya_jax.hf import save_pretrained
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.train import run
from zaya_jax.train.evaluate import evaluate_saved, load_summary, run_config_of


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A finished 6-step run (its metrics hold the final eval) and its final state."""
  workdir = tmp_path_factory.mktemp("run")
  state = run(tiny_run_config(), str(workdir))
  return workdir, jax.device_get(state)


@pytest.mark.slow
def test_checkpoint_drop_optimizer_and_hf_equal_the_loop(trained, tmp_path):
  workdir, final = trained
  want = run_records(workdir, "eval")[STEPS]
  ckpt_dir, step, saved = find_run_checkpoint(str(workdir), None)
  cfg = run_config_of(saved)
  got = evaluate_saved(cfg, ckpt_dir=ckpt_dir, step=step)
  assert got["step"] == STEPS and got["tokens"] == want["tokens"] > 0
  assert abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"], (got["loss"], want["loss"])
  np.testing.assert_allclose(got["expert_load"], want["expert_load"], atol=1e-7)
  assert len(got["max_over_mean"]) == 2 and all(r >= 1.0 for r in got["max_over_mean"])

  reshape(str(workdir), str(tmp_path / "slim"), drop_optimizer=True)
  slim = evaluate_saved(cfg, ckpt_dir=str(tmp_path / "slim" / "checkpoints"), step=STEPS)
  assert slim["loss"] == got["loss"]

  graphdef, _ = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg.model, rngs=nnx.Rngs(0))))
  save_pretrained(nnx.merge(graphdef, nnx.merge_state(final.params, final.model_state)),
                  str(tmp_path / "hf"))
  hf = evaluate_saved(cfg, hf_dir=str(tmp_path / "hf"))
  assert hf["step"] is None
  assert abs(hf["loss"] - want["loss"]) <= 1e-5 * want["loss"], (hf["loss"], want["loss"])

  with pytest.raises(ConfigError, match="train.eval_batches=0"):
    evaluate_saved(resolve(tiny_run_config(eval_batches=0)), ckpt_dir=ckpt_dir, step=step)


def test_load_summary():
  s = load_summary([[0.5, 0.25, 0.25, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
  assert s["max_over_mean"] == pytest.approx([2.0, 1.0])
  assert s["skip_fraction"] == pytest.approx([0.0, 0.2])


@pytest.mark.slow
def test_cli(trained, tmp_path):
  workdir, _ = trained
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "launch.evaluate", f"--workdir={workdir}", "--step=3"]
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  record = json.loads(proc.stdout.strip().splitlines()[-1])
  assert record["kind"] == "eval" and record["step"] == 3 and record["tokens"] > 0
  assert "loss" in proc.stderr and "layer 1: max/mean expert load" in proc.stderr
  assert not any(r.get("step") == 3 and r["kind"] == "eval" for r in
                 map(json.loads, open(workdir / "metrics.jsonl")))
  proc = subprocess.run([*cmd[:4], "--step=99"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("launch.evaluate: --step=99: no such "
                                                        "checkpoint"), proc.stderr[-2000:]
