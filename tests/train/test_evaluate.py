"""Evaluation only (zaya_jax/train/evaluate.py, launch.evaluate): the loss of the training
loop's final eval record, also from a --drop_optimizer copy and an HF export; the load floors
of a frozen checkpoint (zaya_jax/perf/balance_floor.py, launch.balance_floor) on the same run."""

from __future__ import annotations

import dataclasses
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
from zaya_jax.perf.balance_floor import balance_floor, fixed_bias_floor, routing_margins
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


@pytest.mark.slow
def test_fixed_bias_floor_equals_evaluate_and_solves_its_fit_set(trained):
  workdir, _ = trained
  ckpt_dir, step, saved = find_run_checkpoint(str(workdir), None)
  cfg = run_config_of(saved)
  # Batches of 8 x 32 tokens (the model is the run's): loads fine enough to tell batches apart.
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=8))
  got = fixed_bias_floor(cfg, ckpt_dir, step, fit_batches=3, test_batches=1, eval_batches=1,
                         skip_batches=STEPS)
  # The stored biases on the held-out batches are launch.evaluate's per-layer figure.
  want = evaluate_saved(cfg, ckpt_dir=ckpt_dir, step=step)["max_over_mean"]
  np.testing.assert_allclose(got["stored"]["eval"], want, rtol=1e-6)
  # Solved exactly on fit (3 x 8 x 32 tokens, 4 experts: 192 each), fit is even to a token.
  assert all(1.0 <= x <= 193 / 192 + 1e-6 for x in got["solved_on_fit"]["fit"]), got
  assert max(got["stored"]["fit"]) > 1.05, got  # ... which the stored biases are not
  # The per-step floor from batch STEPS + 2 on (the first batch routed gives no figure) has
  # "stored" figures for batches STEPS + 3 and + 4: the worst layers of fixed_bias_floor's "test"
  # batch and of a one-batch fit set after it.
  per_step = balance_floor(cfg, ckpt_dir, step, num_batches=3, start_batch=STEPS + 2, window=1)
  after = fixed_bias_floor(cfg, ckpt_dir, step, fit_batches=1, test_batches=1, eval_batches=1,
                           skip_batches=STEPS + 4)
  assert per_step["stored"] == [pytest.approx(max(got["stored"]["test"]), rel=1e-6),
                                pytest.approx(max(after["stored"]["fit"]), rel=1e-6)], (
      per_step, got, after)
  assert per_step["oracle"][0] >= 1.0 and 0.0 <= per_step["churn"][0] <= 1.0
  # Blocks of one step: the windowed figures (numpy, balance_report.windowed) are the medians
  # of the per-step ones (jnp, load_stats).
  for name in ("oracle", "histogram", "stored"):
    assert per_step[f"window_{name}"] == pytest.approx(per_step[f"median_{name}"], rel=1e-6)
    assert 0.0 < per_step[f"window_entropy_{name}"] <= 1.0
  assert len(per_step["bias_step"]) == len(got["margins"]["gap_median"]) > 0
  assert all(x > 0 for x in per_step["bias_step"]), per_step["bias_step"]  # the rule moved them
  with pytest.raises(ValueError, match="fit_batches=0"):
    fixed_bias_floor(cfg, ckpt_dir, step, fit_batches=0, test_batches=1, eval_batches=1)
  # With balance.rate_lr_power=1 the rule's updates are scaled as the training step's at the
  # checkpoint's step (the end of the schedule: min_lr_ratio 0.1).
  slow = dataclasses.replace(cfg, balance=dataclasses.replace(cfg.balance, rate_lr_power=1.0))
  scaled = balance_floor(slow, ckpt_dir, step, num_batches=3, start_batch=STEPS + 2, window=1)
  assert per_step["rate"] == 1.0 and scaled["rate"] == pytest.approx(cfg.train.min_lr_ratio)
  assert scaled["oracle"] == per_step["oracle"] and scaled["stored"] == per_step["stored"]
  assert all(s < 0.5 * f for s, f in zip(scaled["bias_step"], per_step["bias_step"])), (
      scaled["bias_step"], per_step["bias_step"])


def test_routing_margins_by_hand():
  """Two layers, 3 tokens (the last one padding), 2 experts + skip: the gaps of p + b."""
  probs = np.array([[[0.5, 0.3, 0.2], [0.4, 0.45, 0.15], [0.9, 0.05, 0.05]],
                    [[0.2, 0.7, 0.1], [0.34, 0.33, 0.33], [0.1, 0.1, 0.8]]], np.float32)
  biases = np.array([[0.0, 0.1, -1.0], [0.05, -0.05, -1.0]], np.float32)
  got = routing_margins(probs, np.array([True, True, False]), biases, [0.05, 0.2])
  # layer 0: scores (0.5, 0.4) -> gap 0.1, (0.4, 0.55) -> 0.15; layer 1: (0.25, 0.65) -> 0.4,
  # (0.39, 0.28) -> 0.11. Medians of two values are their means.
  np.testing.assert_allclose(got["gap_median"], [0.125, 0.255], atol=1e-6)
  np.testing.assert_allclose(got["top_prob_median"], [0.475, 0.52], atol=1e-6)
  np.testing.assert_allclose(got["bias_spread"], [0.05, 0.05], atol=1e-6)
  assert got["below_step_share"] == [0.0, 0.5]  # layer 1: 0.11 < 0.2, 0.4 is not
  assert "below_step_share" not in routing_margins(probs, np.ones(3, bool), biases)


@pytest.mark.slow
def test_balance_floor_cli(trained):
  workdir, _ = trained
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "launch.balance_floor", f"--workdir={workdir}",
                         "--batches=2", "--fit_batches=2", "--test_batches=1", "--eval_batches=1",
                         "--window=1"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "oracle (exact solve of the previous batch)" in proc.stdout, proc.stdout
  assert "loads summed over 1 blocks of 1 steps, median worst-layer max/mean: oracle" in \
      proc.stdout, proc.stdout
  # The exact solve routes its own fit set evenly up to +-1 token per expert where margins
  # tie or the sweeps run out (`quantile_biases`): 33 / 32 = 1.03 at the 128 fit tokens over
  # 4 experts; the stored biases on the same tokens are no better.
  per_layer = lambda name: [float(x) for x in
                            proc.stdout.split(name + " on fit :")[1].split("\n")[0].split()]
  solved, stored = per_layer("solved exactly on fit "), per_layer("stored biases         ")
  assert len(solved) == 2 and all(1.0 <= r <= 33 / 32 + 0.005 for r in solved), proc.stdout
  assert max(solved) <= max(stored), proc.stdout
  assert "tokens whose gap is below that change" in proc.stdout, proc.stdout
  proc = subprocess.run([sys.executable, "-m", "launch.balance_floor", f"--workdir={workdir}",
                         "--step=99"], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1].startswith("launch.balance_floor: --step=99"), \
      proc.stderr[-2000:]


def test_find_run_checkpoint_names_a_file_given_as_workdir(tmp_path):
  """--workdir=FILE said "no such directory" (found by a new-user trial, 2026-12-07)."""
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(ValueError) as e:
    find_run_checkpoint(str(a_file), None)
  assert str(e.value) == (f"--workdir={a_file}: a file, not a directory; pass a training run's "
                          "--workdir")
  with pytest.raises(ValueError, match="no such directory$"):
    find_run_checkpoint(str(tmp_path / "nope"), None)
