"""Fault tolerance of `python -m launch.train`, by killing and breaking real training processes.

Every run below uses the same tiny config and seeds as one uninterrupted reference run, so on
CPU each per-step loss of a run that was killed, preempted or pointed at a corrupt checkpoint
must equal the reference bit for bit:
  - `kill -9` at a random step, rerun: resumes from the last complete checkpoint;
  - SIGTERM: checkpoint at the current step, exit 0, rerun resumes there;
  - the newest checkpoint corrupted on disk: reported, moved aside, the previous one used;
  - NaN loss/gradients injected (`train.inject_nan_at_steps`): the update is skipped and
    counted; `max_consecutive_skips` in a row restore the last checkpoint and move past the
    offending batches.
Then (issue 14) Ctrl-C during the first compile, a bad record mid-run and a missing backend.
"""

import glob
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, finish_run, launch_train, run_records

NUM_STEPS = 16
EVERY = 4  # checkpoint interval
CONFIG = [  # steps of 0.1-0.4 s, so that a signal lands mid-run (issue 24: batch 8 -> 4)
    "--config.train.seq_len=256",
    "--config.train.batch_size=4",
    "--config.train.eval_batches=0",
    f"--config.train.num_steps={NUM_STEPS}",
    f"--config.checkpoint.every_steps={EVERY}",
    "--config.checkpoint.max_to_keep=2",
]


def train(workdir, cache, *extra):
  """Starts the tiny training run (the resume test's overrides + CONFIG + `extra`)."""
  return launch_train(workdir, cache, *CONFIG, *extra)


def wait_for_step(proc, workdir, step, timeout=240):
  """Polls metrics.jsonl until it holds a train record of `step` or later; returns the newest."""
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, "the run ended before the fault could be injected: " + proc.stdout.read()[-3000:]
    if os.path.exists(path):
      with open(path) as f:
        steps = [json.loads(l)["step"] for l in f if l.endswith("\n") and '"train"' in l]
      if steps and max(steps) >= step:
        return max(steps)
    time.sleep(0.005)
  raise TimeoutError(f"no step {step} within {timeout} s")


def assert_same_losses(workdir, reference, steps):
  got = run_records(workdir)
  for s in steps:
    assert got[s]["loss"] == reference[s]["loss"], (s, got[s]["loss"], reference[s]["loss"])


@pytest.fixture(scope="module")
def cache(compile_cache_dir):
  """The session's compilation cache (tests/conftest.py): the runs share their programs."""
  return compile_cache_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
  """(workdir, per-step train records) of the uninterrupted run."""
  workdir = tmp_path_factory.mktemp("reference")
  finish_run(train(workdir, cache))
  rows = run_records(workdir)
  assert sorted(rows) == list(range(1, NUM_STEPS + 1))
  return workdir, rows


@pytest.mark.slow
def test_kill9_at_random_step_then_resume(tmp_path, cache, reference):
  # After the second checkpoint interval, so that at least one (asynchronous) save is surely
  # committed by then; a kill at any step is equally valid, but then this tests nothing more.
  kill_at = random.Random().randint(2 * EVERY + 1, NUM_STEPS - 2)
  proc = train(tmp_path, cache)
  seen = wait_for_step(proc, tmp_path, kill_at)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  out = finish_run(train(tmp_path, cache))
  resumed = re.search(r"(Resuming|Starting) at step (\d+)/", out)
  assert resumed and resumed[1] == "Resuming", out[-3000:]
  resumed = int(resumed[2])
  assert resumed % EVERY == 0 and 0 < resumed <= seen, (kill_at, seen, resumed)
  assert_same_losses(tmp_path, reference[1], range(1, NUM_STEPS + 1))


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_zero(tmp_path, cache, reference):
  proc = train(tmp_path, cache)
  wait_for_step(proc, tmp_path, EVERY + 1)
  proc.send_signal(signal.SIGTERM)
  out = finish_run(proc)  # exit status 0
  stopped = int(out.split("Stopped by SIGTERM at step ")[1].split("/")[0])
  assert stopped < NUM_STEPS
  assert os.path.isdir(os.path.join(tmp_path, "checkpoints", str(stopped)))
  out = finish_run(train(tmp_path, cache))
  assert f"Resuming at step {stopped}/" in out
  assert_same_losses(tmp_path, reference[1], range(1, NUM_STEPS + 1))


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, cache, reference):
  workdir = tmp_path / "run"
  shutil.copytree(reference[0], workdir)
  latest = os.path.join(workdir, "checkpoints", str(NUM_STEPS))
  data_files = [f for f in glob.glob(os.path.join(latest, "model", "**", "*"), recursive=True)
                if os.path.isfile(f) and os.path.getsize(f) > 64]
  biggest = max(data_files, key=os.path.getsize)
  with open(biggest, "r+b") as f:  # a write cut short: the file loses its second half
    f.truncate(os.path.getsize(biggest) // 2)
  out = finish_run(train(workdir, cache))
  previous = NUM_STEPS - EVERY
  assert f"Resuming at step {previous}/" in out, out[-3000:]
  assert str(NUM_STEPS) in out and "corrupt" in out.lower()
  assert not os.path.exists(os.path.join(biggest))  # moved aside (with its directory) ...
  assert glob.glob(os.path.join(tmp_path, "**", os.path.basename(biggest)), recursive=True)  # ... not deleted
  assert_same_losses(workdir, reference[1], range(1, NUM_STEPS + 1))
  assert os.path.isdir(latest)  # step NUM_STEPS written again


@pytest.mark.slow
def test_nan_steps_are_skipped_then_rolled_back(tmp_path, cache, reference):
  # Step 3 alone is skipped; steps 9 and 10 in a row reach max_consecutive_skips=2, so the run
  # restores checkpoint 8 and trains steps 9.. again on the batches after the bad ones.
  out = finish_run(train(tmp_path, cache, "--config.train.inject_nan_at_steps=(3,9,10)",
                     "--config.train.max_consecutive_skips=2"))
  assert "restoring checkpoint 8" in out, out[-3000:]
  rows = run_records(tmp_path)
  assert sorted(rows) == list(range(1, NUM_STEPS + 1))
  assert math.isnan(rows[3]["loss"]) and rows[3]["skipped_steps"] == 1
  assert_same_losses(tmp_path, reference[1], [1, 2])
  assert rows[4]["loss"] != reference[1][4]["loss"]  # update 3 did not happen
  for s in range(4, NUM_STEPS + 1):
    assert math.isfinite(rows[s]["loss"]), s
  # After the rollback steps 9.. see other batches than the reference's steps 9..
  assert rows[9]["loss"] != reference[1][9]["loss"]
  assert rows[NUM_STEPS]["skipped_steps"] == 3


# --- issue 14: first-step interrupts, bad data mid-run, a missing backend -------------------
# These use test_resume's smaller run (T=32, B=2: seconds per run once compiled).


def read_until(proc, marker, timeout=240):
  """Reads `proc`'s output up to a line containing `marker`; returns what it read."""
  seen, deadline = [], time.monotonic() + timeout
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    assert line, "the run ended before " + repr(marker) + ": " + "".join(seen)[-3000:]
    seen.append(line)
    if marker in line:
      return "".join(seen)
  raise TimeoutError(marker)


def step_dirs(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(os.listdir(path)) if os.path.isdir(path) else []


@pytest.mark.slow
def test_ctrl_c_during_the_first_compile(tmp_path):
  """One Ctrl-C during the first compile: the run stops after its first step and leaves no
  checkpoint (which would pin the workdir's model config), exit 0. Two: the process dies at
  once, without a checkpoint or a crash (issue 14: 46 s, then a segfault). Fresh compilation
  caches, so that the signals land in the compilation; both runs at once."""
  once, twice = tmp_path / "once", tmp_path / "twice"
  procs = [launch_train(once, tmp_path / "cache_once"), launch_train(twice, tmp_path / "cache_twice")]
  try:
    heads = [read_until(p, "Starting at step 0/") for p in procs]
    procs[0].send_signal(signal.SIGINT)
    procs[1].send_signal(signal.SIGINT)
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGINT)
    start = time.monotonic()
    out_twice = heads[1] + procs[1].communicate(timeout=60)[0]
    aborted_after = time.monotonic() - start
    out_once = heads[0] + finish_run(procs[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert procs[1].returncode == -signal.SIGINT, out_twice[-3000:]
  assert aborted_after < 5, aborted_after
  assert "Segmentation fault" not in out_twice and "Traceback" not in out_twice, out_twice[-3000:]
  assert step_dirs(twice) == []
  assert "during the first step of this run: nothing was saved" in out_once, out_once[-3000:]
  assert "holds no checkpoint, so the next run starts over" in out_once
  assert step_dirs(once) == []
  # the summary said `checkpoint None in ...` and the signal's line promised a checkpoint
  assert "checkpoint None" not in out_once and f"no checkpoint in {once}/checkpoints" in out_once
  assert "writing a checkpoint (none if it is this run's first step)" in out_once
  with open(once / "metrics.jsonl") as f:
    summary = [r for r in map(json.loads, f) if r["kind"] == "summary"]
  assert len(summary) == 1 and summary[0]["tokens_per_s"] is None, summary  # no step timed


@pytest.mark.slow
def test_bad_record_mid_run_checkpoints_the_last_step(tmp_path, cache):
  """The corpus file is cut to nothing while the run reads it (a record that passed the
  listing's check fails later): the run exits non-zero with one line naming file:line, after
  a checkpoint of its last completed step, from which the same command resumes."""
  corpus = tmp_path / "corpus.jsonl"
  text = "".join(json.dumps({"text": f"document {i}: " + "abc " * (i % 9)}) + "\n"
                 for i in range(400))
  corpus.write_text(text)
  # A row-shuffle window of 8 rows: the pipeline reads the corpus as it trains (the default
  # 10,000-row window would have read this run's every row before its first step).
  args = [f"--config.data.source={corpus}", "--config.train.eval_batches=0",
          "--config.train.num_steps=300", "--config.checkpoint.every_steps=1000",
          "--config.data.shuffle_window=8"]
  proc = launch_train(tmp_path / "run", cache, *args)
  wait_for_step(proc, tmp_path / "run", 2)
  corpus.write_text("")
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 1, out[-3000:]
  m = re.search(r"training stopped: step (\d+): reading the next batch failed: data\.source: "
                + re.escape(str(corpus)) + r":\d+ is not valid JSON .*; checkpoint (\d+) "
                r"\(the last completed step\) is in .*Fix the data and rerun", out)
  assert m, out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  last = int(m[2])
  assert int(m[1]) == last + 1 and last >= 2
  assert step_dirs(tmp_path / "run") == [str(last)]
  assert max(run_records(tmp_path / "run")) == last
  corpus.write_text(text)
  out = finish_run(launch_train(tmp_path / "run", cache, *args, "--config.train.max_steps_per_run=1"))
  assert f"Resuming at step {last}/300" in out, out[-3000:]


@pytest.mark.slow
def test_missing_backend_is_one_line(tmp_path):
  """JAX_PLATFORMS=rocm with the CPU-only jaxlib: one line naming the backend and the
  requirements file (issue 14: JAX's 35-line traceback)."""
  env = {**os.environ, "JAX_PLATFORMS": "rocm"}
  proc = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
                         f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=env, text=True,
                        capture_output=True, timeout=120)
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith(("I", "W"))]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "JAX cannot start its 'rocm' backend" in lines[0]
  assert "pip install -r launch/slurm/requirements-rocm.txt" in lines[0]
  assert not (tmp_path / "run").exists()
