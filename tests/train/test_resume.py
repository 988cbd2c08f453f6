"""Resume: N steps, exit, rerun to 2N gives the same per-step losses as 2N steps straight.

Runs the real CLI (`python -m launch.train`) in subprocesses on a very small config. CPU,
fixed seeds: the losses must be bit-identical. The subprocesses share a persistent JAX
compilation cache so the later ones skip most compilation.
"""

import os

import pytest

from tests.helpers import CLI_EVERY, finish_run, launch_train, run_records

N = CLI_EVERY  # steps before the interruption


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """One JAX compilation cache for every subprocess of this module."""
  return tmp_path_factory.mktemp("jax_cache")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["quantile", "adamw"])
def test_resume_matches_straight_run(tmp_path, cache, mode):
  """Per-step losses, expert loads and balancing biases (after each update) equal an
  uninterrupted run's: for "adamw" the biases after step N+1 depend on the bias optimizer's
  restored moments and count; for "quantile" on the restored biases (the solve's warm start)."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  mode_flag = f"--config.balance.mode={mode}"
  finish_run(launch_train(straight, cache, mode_flag))  # compiles; the later runs read the cache
  finish_run(launch_train(resumed, cache, mode_flag, f"--config.train.max_steps_per_run={N}"))
  assert sorted(run_records(resumed)) == list(range(1, N + 1))
  assert sorted(os.listdir(resumed / "checkpoints")) == [str(N)]

  out = finish_run(launch_train(resumed, cache, mode_flag))
  assert f"Resuming at step {N}/{2 * N}" in out, out[-4000:]

  a, b = run_records(straight), run_records(resumed)
  assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
  assert a[N + 1]["balance/biases"] != a[N]["balance/biases"]  # the biases move every step
  for step in a:
    for key in ("loss", "grad_norm", "lr", "expert_load", "balance/biases"):
      assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
  assert run_records(straight, "eval")[2 * N]["loss"] == run_records(resumed, "eval")[2 * N]["loss"]

  # Rerunning a finished run trains nothing more and keeps the checkpoints.
  out = finish_run(launch_train(resumed, cache, mode_flag))
  assert f"Resuming at step {2 * N}/{2 * N}" in out
  assert len(run_records(resumed)) == 2 * N


@pytest.mark.slow
def test_resume_refuses_another_model_and_follows_run_shape_changes(tmp_path, cache):
  """Another model is refused. A new train.seq_len or data.num_workers resumes (issue 14:
  the first silently skipped or repeated tokens, the second made every checkpoint look
  corrupt): the position is carried to the same token across the row length (tested exactly
  in tests/data), and a worker-count change restarts the data order, with a warning."""
  workdir = tmp_path / "run"
  once = ["--config.train.max_steps_per_run=1", "--config.checkpoint.every_steps=1"]
  finish_run(launch_train(workdir, cache, *once))
  proc = launch_train(workdir, cache, "--config.model.hidden_size=64")
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode != 0
  assert "model.hidden_size: 32 -> 64" in out, out[-4000:]

  out = finish_run(launch_train(workdir, cache, *once, "--config.train.seq_len=64"))
  assert "Resuming at step 1/" in out, out[-4000:]
  assert "train.seq_len 32 -> 64; the data position is carried over to the same token" in out
  out = finish_run(launch_train(workdir, cache, *once, "--config.train.seq_len=64",
                      "--config.data.num_workers=2"))
  assert "Resuming at step 2/" in out, out[-4000:]
  assert ("data.num_workers changed 0 -> 2 (each worker count reads the documents in its own "
          "order), so the saved data position is not applied: the model, optimizer and step "
          "resume, and the data order restarts") in out, out[-4000:]
  assert "leaked shared_memory" not in out, out[-4000:]  # issue 23: the workers' last batch
  assert "cannot be restored" not in out and not (workdir / "checkpoints_corrupt").exists()
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]  # max_to_keep=2
