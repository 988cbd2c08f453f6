"""Resume: N steps, exit, rerun to 2N gives the same per-step losses as 2N steps straight.

Calls the loop in-process (`zaya_jax.train.run`, what `launch.train` calls after parsing) on
a very small config, with the session's persistent compilation cache (tests/conftest.py):
each run after the first of its shapes reads the compiled steps back. One run goes through the CLI (`python -m launch.train`), for what only a process exit shows.
CPU, fixed seeds: the losses must be bit-identical. The console lines (`Resuming at step
...`, the checkpoint warnings) are absl records, read with `caplog`.
"""

import logging
import os

import pytest

from tests.helpers import finish_run, launch_train, run_records
from tests.train.inproc import STEPS, tiny_run_config
from zaya_jax.train import run

N = STEPS // 2  # steps before the interruption; a checkpoint every N steps


def _config(mode: str | None = None, **train):
  config = tiny_run_config(**train)
  if mode is not None:
    config.balance.mode = mode
  return config


def _run(config, workdir, caplog) -> str:
  """`run(config, workdir)`; returns the text of the INFO and higher records it logged."""
  caplog.clear()
  with caplog.at_level(logging.INFO):
    run(config, str(workdir))
  return caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quantile", "adamw"])
def test_resume_matches_straight_run(tmp_path, mode, caplog):
  """Per-step losses, expert loads and balancing biases (after each update) equal an
  uninterrupted run's: for "adamw" the biases after step N+1 depend on the bias optimizer's
  restored moments and count; for "quantile" on the restored biases (the solve's warm start)."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  _run(_config(mode), straight, caplog)  # compiles; the later runs read the cache
  _run(_config(mode, max_steps_per_run=N), resumed, caplog)
  assert sorted(run_records(resumed)) == list(range(1, N + 1))
  assert sorted(os.listdir(resumed / "checkpoints")) == [str(N)]

  out = _run(_config(mode), resumed, caplog)
  assert f"Resuming at step {N}/{2 * N}" in out, out[-4000:]

  a, b = run_records(straight), run_records(resumed)
  assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
  assert a[N + 1]["balance/biases"] != a[N]["balance/biases"]  # the biases move every step
  for step in a:
    for key in ("loss", "grad_norm", "lr", "expert_load", "balance/biases"):
      assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
  assert run_records(straight, "eval")[2 * N]["loss"] == run_records(resumed, "eval")[2 * N]["loss"]

  # Rerunning a finished run trains nothing more and keeps the checkpoints.
  out = _run(_config(mode), resumed, caplog)
  assert f"Resuming at step {2 * N}/{2 * N}" in out
  assert len(run_records(resumed)) == 2 * N


@pytest.mark.slow
def test_resume_refuses_another_model_and_follows_run_shape_changes(tmp_path, caplog,
                                                                    compile_cache_dir):
  """Another model is refused. A new train.seq_len or data.num_workers resumes (issue 14:
  the first silently skipped or repeated tokens, the second made every checkpoint look
  corrupt): the position is carried to the same token across the row length (tested exactly
  in tests/data), and a worker-count change restarts the data order, with a warning.

  The worker-count resume runs through the CLI, whose exit is where the resource tracker
  reports leaked shared memory (issue 23); it reads its compiled steps from the cache that
  the in-process seq_len=64 run wrote."""
  workdir = tmp_path / "run"

  def config(hidden=32, **train):
    c = _config(**train)
    c.checkpoint.every_steps = 1
    c.model.hidden_size = hidden
    return c

  _run(config(max_steps_per_run=1), workdir, caplog)
  with pytest.raises(ValueError, match="model.hidden_size: 32 -> 64"):
    _run(config(hidden=64), workdir, caplog)

  out = _run(config(max_steps_per_run=1, seq_len=64), workdir, caplog)
  assert "Resuming at step 1/" in out, out[-4000:]
  assert "train.seq_len 32 -> 64; the data position is carried over to the same token" in out
  out = finish_run(launch_train(workdir, compile_cache_dir, "--config.train.max_steps_per_run=1",
                                "--config.checkpoint.every_steps=1", "--config.train.seq_len=64",
                                "--config.data.num_workers=2"))
  assert "Resuming at step 2/" in out, out[-4000:]
  assert ("data.num_workers changed 0 -> 2 (each worker count reads the documents in its own "
          "order), so the saved data position is not applied: the model, optimizer and step "
          "resume, and the data order restarts") in out, out[-4000:]
  assert "leaked shared_memory" not in out, out[-4000:]  # issue 23: the workers' last batch
  assert "cannot be restored" not in out and not (workdir / "checkpoints_corrupt").exists()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]  # max_to_keep=2
