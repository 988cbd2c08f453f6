"""The training console (zaya_jax/train/console.py) and one tiny `launch.train` run."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

from tests.helpers import finish_run, launch_train, run_records
from zaya_jax.train import console


class FakeClock:
  """A clock that moves only when told to."""

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_window_mean_loss_and_time_exclude_eval_and_save():
  clock = FakeClock()
  window = console.LogWindow(clock)
  losses = [4.0, 3.5, float("nan"), 3.0]  # a skipped update's loss is NaN: left out
  for i, loss in enumerate(losses):
    window.add(np.float32(loss))
    clock.now += 0.25  # each step 0.25 s
    if i == 1:
      with window.excluded():  # an evaluation of 3 s
        clock.now += 3.0
    if i == 2:
      with window.excluded():  # a checkpoint save of 1.5 s
        clock.now += 1.5
  assert window.steps == 4
  assert window.mean_loss() == pytest.approx((4.0 + 3.5 + 3.0) / 3)
  assert window.elapsed() == pytest.approx(1.0)
  window.reset()
  assert window.steps == 0 and window.elapsed() == 0.0 and math.isnan(window.mean_loss())


def test_throughput_arithmetic():
  # 4 steps in 2 s of 2048 tokens on 2 devices, 1e6 FLOPs/token against 1e10 FLOP/s peak.
  r = console.throughput(4, 2.0, 2048, 2, 1e6, 1e10, remaining_steps=10)
  assert r["step_time_s"] == pytest.approx(0.5)
  assert r["tokens_per_s"] == pytest.approx(4096.0)
  assert r["tokens_per_s_per_device"] == pytest.approx(2048.0)
  assert r["mfu"] == pytest.approx(1e6 * 4096 / 1e10)
  assert r["eta_s"] == pytest.approx(5.0)
  assert console.throughput(4, 2.0, 2048, 2, 1e6, None, 10)["mfu"] is None
  assert set(console.throughput(0, 0.0, 2048, 2, 1e6, 1e10, 10).values()) == {None}


def test_formatting():
  assert console.duration(3.21) == "3.2s"
  assert console.duration(75) == "1m15s"
  assert console.duration(4321) == "1h12m"
  assert console.si(1234567) == "1.23M"
  assert console.gib(3 * 2**29) == "1.50 GiB"
  assert console.gib(5 * 2**20) == "5 MiB" and console.gib(3072) == "3 KiB"


def _record(**extra):
  return {"loss": 3.25, "lr": 3e-4, "grad_norm": 0.5, "step_time_s": 0.125,
          "tokens_per_s": 16384.0, "tokens_per_s_per_device": 8192.0, "mfu": 0.0123,
          "eta_s": 90.0, "peak_memory_bytes": 3 * 2**29, "balance/max_over_mean_max": 1.5,
          "balance/load_entropy_min": 0.9, "balance/skip_rate_mean": 0.1,
          "router/entropy_mean": 1.2, "skipped_steps": 0, **extra}


def test_step_line():
  line = console.step_line(10, 300, _record())
  longest = console.step_line(100, 300, _record(step_time_s=1.2345, eta_s=4321.0, skipped_steps=12))
  assert len(longest) <= 180, (len(longest), longest)  # several devices, skipped updates
  one_device = console.step_line(10, 300, _record(tokens_per_s_per_device=16384.0))
  assert "16.4k tok/s MFU" in one_device, one_device
  assert line == ("step 10/300 | loss 3.2500 lr 3.00e-04 gnorm 0.500 | 125 ms 16.4k tok/s "
                  "(8.19k/dev) MFU 1.2% ETA 1m30s | mem 1.50GiB | load max/mean 1.50 H 0.90 "
                  "skip 0.10 router 1.20"), line
  assert len(line) < 170, len(line)
  first = console.step_line(1, 300, _record(step_time_s=None, skipped_steps=2))
  assert "first step (compile)" in first and "tok/s" not in first and first.endswith("2 skipped")


def test_header_and_data_summary(tmp_path):
  from zaya_jax.data import DataConfig  # pylint: disable=import-outside-toplevel

  docs = tmp_path / "docs.jsonl"
  docs.write_text("".join(json.dumps({"text": "x" * 10}) + "\n" for _ in range(40)))
  line_bytes = len(json.dumps({"text": "x" * 10}) + "\n")
  data = console.data_summary(DataConfig(source=str(docs), eval_fraction=0.25), 1000)
  m = re.fullmatch(r".*: (\d+) train documents \(~(\d+) tokens, ([\d.]+) epochs this run\), "
                   r"(\d+) eval documents", data)
  assert m, data
  train, tokens, epochs, held_out = int(m[1]), int(m[2]), float(m[3]), int(m[4])
  assert train + held_out == 40 and held_out > 0
  assert tokens == train * (line_bytes + 2)  # bytes of each line + BOS + EOS
  assert epochs == pytest.approx(1000 / tokens, abs=0.005)

  lines = console.header_lines(
      resuming=False, step=0, num_steps=300, params_total=3_540_000, params_active=1_210_000,
      layers=4, experts=8, devices=1, processes=1, mesh_shape={"data": 1}, workdir="/w",
      accelerator="cpu", peak_flops=4.5e10, peak_measured=True, batch_size=8, seq_len=256,
      data=data)
  text = "\n".join(lines)
  assert lines[0].startswith("Starting at step 0/300: 3.54M parameters (1.21M active), "
                             "4 layers x 8 experts, 1 devices (1 processes)")
  assert "(cpu: measured matmul peak)" in text and "45GFLOP/s" in text
  assert "8 sequences x 256 tokens = 2,048 tokens per step; 300 steps = 614k tokens" in text
  assert "/w/config.json" in text and "/w/optimizer.txt" in text
  assert len(lines) <= 6
  assert "context parallelism" not in text
  cp = console.header_lines(
      resuming=False, step=0, num_steps=300, params_total=3_540_000, params_active=1_210_000,
      layers=4, experts=8, devices=8, processes=1, mesh_shape={"data": 1, "fsdp": 2, "context": 4},
      workdir="/w", accelerator="cpu", peak_flops=4.5e10, peak_measured=True, batch_size=8,
      seq_len=256, data=data)
  assert ("300 steps = 614k tokens; context parallelism: each sequence in 8 zigzag chunks of 32 "
          "tokens over 4 devices") in "\n".join(cp)


def test_eval_save_end_and_stop_lines():
  record = {"loss": 3.14159, "tokens": 8192.0,
            "sources": {"wiki": {"loss": 3.0}, "code": {"loss": 2.5}}}
  assert console.eval_line(100, record, 23.1407, 1.26) == (
      "eval step 100 | loss 3.1416 | ppl 23.14 | 8192 tokens | 1.3 s | wiki 3.0000 | code 2.5000")
  assert console.eval_line(3, {"loss": 4.5, "tokens": 64.0}, float("nan"), 0.04) == (
      "eval step 3 | loss 4.5000 | ppl nan | 64 tokens | 0.0 s")
  assert console.saved_line(4, 1.234, False) == "saved checkpoint 4 in 1.23 s"
  assert console.saved_line(4, 1.234, True) == (
      "saved checkpoint 4 in 1.23 s (async: the call; writing goes on in the background)")

  ended = lambda **kw: console.run_ended(**{"stop_reason": None, "step": 6, "num_steps": 6,
                                             "steps_this_run": 6, "max_steps_per_run": 0, **kw})
  assert ended() == "finished"
  assert ended(stop_reason="SIGTERM", step=3) == "stopped by SIGTERM"
  assert ended(steps_this_run=0) == "nothing to train (num_steps reached)"
  assert ended(step=4, max_steps_per_run=4) == "train.max_steps_per_run=4 reached"

  summary = lambda **kw: console.summary_lines(**{
      "ended": "stopped by SIGTERM", "steps_this_run": 1, "times": {
          "total": 9.0, "compile": 5.0, "train": 2.0, "eval": 0.0, "checkpoint": 0.0,
          "train_tokens": 0}, "tokens_this_run": 1024, "train_loss": 3.4,
      "eval_record": None, "checkpoint_step": None, "checkpoint_dir": "/w/checkpoints",
      "metrics_path": "/w/metrics.jsonl", "tensorboard_dir": None, **kw})
  # stopped in the first step: no step timed ("-", was "0 tok/s") and no checkpoint (was
  # "checkpoint None")
  lines = summary()
  assert lines[1].startswith("  1.02k tokens this run, - tok/s mean;"), lines
  assert lines[2] == "  no checkpoint in /w/checkpoints", lines
  lines = summary(checkpoint_step=30, times={"total": 9.0, "compile": 5.0, "train": 2.0,
                                             "eval": 0.0, "checkpoint": 0.0, "train_tokens": 4096})
  assert lines[1].startswith("  1.02k tokens this run, 2.05k tok/s mean;"), lines
  assert lines[2] == "  checkpoint 30 in /w/checkpoints", lines

  stop = lambda **kw: console.stop_warning(**{
      "stop_reason": "SIGTERM", "first_step_stop": False, "step": 3, "num_steps": 6,
      "checkpoint_step": 3, "checkpoint_dir": "/w/checkpoints", "workdir": "/w", **kw})
  assert stop(stop_reason=None) is None
  assert stop() == ("Stopped by SIGTERM at step 3/6; checkpoint 3 is in /w/checkpoints. Rerun "
                    "the same command to resume.")
  assert stop(first_step_stop=True, checkpoint_step=2) == (
      "Stopped by SIGTERM during the first step of this run: nothing was saved; checkpoint 2 in "
      "/w/checkpoints is unchanged. Rerun the same command to resume.")
  assert stop(first_step_stop=True, checkpoint_step=None) == (
      "Stopped by SIGTERM during the first step of this run: nothing was saved; /w holds no "
      "checkpoint, so the next run starts over (with any config).")


def test_write_json_atomic(tmp_path):
  path = str(tmp_path / "config.json")
  console.write_json_atomic(path, {"a": [1, 2]})
  console.write_json_atomic(path, {"b": 3})  # a resume rewrites it
  assert json.loads(open(path).read()) == {"b": 3}
  assert os.listdir(tmp_path) == ["config.json"]  # no temporary left behind


# --- one tiny launch.train run ---

STEPS = 6


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, compile_cache_dir):
  workdir = tmp_path_factory.mktemp("console_run")
  out = finish_run(launch_train(
      workdir, compile_cache_dir, f"--config.train.num_steps={STEPS}",
      "--config.train.log_every=2", "--config.train.eval_every=4",
      "--config.checkpoint.every_steps=4", "--config.train.eval_batches=1"))
  return workdir, out


@pytest.mark.slow
def test_console_of_a_tiny_run(tiny_run):
  workdir, out = tiny_run
  assert "!!python" not in out and "config:\n" not in out  # no YAML dump
  assert "parameter groups:\n" not in out  # the table is in optimizer.txt
  assert re.search(r"Starting at step 0/6: [\d.]+M parameters \([\d.]+M active\), 2 layers x "
                   r"4 experts, 1 devices \(1 processes\)", out), out[-3000:]
  assert "(cpu: measured matmul peak)" in out
  assert out.index("compiling the train step ...") < out.index("step 2/6 |")
  assert re.search(r"train step compiled in \d+\.\d s", out), out[-3000:]
  assert re.search(r"eval step compiled in \d+\.\d s", out), out[-3000:]
  assert re.search(r"eval step 4 \| loss [\d.]+ \| ppl [\d.]+ \| \d+ tokens \| [\d.]+ s", out)
  assert re.search(r"saved checkpoint 4 in [\d.]+ s", out), out[-3000:]
  assert re.search(r"saved checkpoint 6 in [\d.]+ s", out), out[-3000:]
  for step in (2, 4, 6):
    line = re.search(rf"step {step}/6 \|.*", out)[0]
    assert re.search(r"\d+ ms [\d.]+k? tok/s MFU [\d.]+% ETA", line), line  # 1 device
    assert len(line) < 160, line
  assert re.search(r"run ended: finished; 6 steps this run in .*\(compile .*, train .*, eval .*, "
                   r"checkpoint .*\)", out), out[-3000:]
  assert re.search(r"final train loss [\d.]+ \(log-window mean\); eval loss [\d.]+, ppl [\d.]+ "
                   r"at step 6", out), out[-3000:]
  assert f"checkpoint 6 in {workdir}" in out and f"metrics {workdir}/metrics.jsonl" in out


@pytest.mark.slow
def test_records_of_a_tiny_run(tiny_run):
  from zaya_jax.checkpoint import open_manager, saved_config  # pylint: disable=import-outside-toplevel

  workdir, _ = tiny_run
  train = run_records(workdir)
  assert sorted(train) == [2, 4, 6]
  for step, r in train.items():
    assert r["step_time_s"] > 0 and r["peak_memory_bytes"] > 0 and 0 < r["mfu"] < 1
    assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_time_s"])
    assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"])
    assert r["eta_s"] == pytest.approx((STEPS - step) * r["step_time_s"])
    assert math.isfinite(r["loss"]) and math.isfinite(r["loss_last"])
  # The window mean differs from the log step's own loss (two different batches).
  assert any(r["loss"] != r["loss_last"] for r in train.values())
  summary = run_records(workdir, "summary")[STEPS]
  assert summary["ended"] == "finished" and summary["steps_this_run"] == STEPS
  assert summary["train_loss"] == train[STEPS]["loss"]
  assert summary["eval_loss"] == run_records(workdir, "eval")[STEPS]["loss"]
  # The loop timed steps 2..6 for the watchdog (on by default; the bound follows the median).
  assert 0 < summary["step_time_median_s"] < 60
  with open(os.path.join(workdir, "config.json")) as f:
    written = json.load(f)
  manager = open_manager(os.path.join(workdir, "checkpoints"), read_only=True)
  assert written == saved_config(manager, STEPS)
  assert written["train"]["num_steps"] == STEPS and written["train"]["log_every"] == 2
  assert "muon" in open(os.path.join(workdir, "optimizer.txt")).read().lower() or os.path.getsize(
      os.path.join(workdir, "optimizer.txt")) > 100
