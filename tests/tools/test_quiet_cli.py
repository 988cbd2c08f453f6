"""The entry points' stderr on a tiny run: no TPU probe, no Orbax INFO, no read-only warning
(zaya_jax.logs), plus launch.train's --print_config, --help and the override-typo line."""

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, finish_run, launch_train

pytestmark = pytest.mark.slow
ENV = {**os.environ, "JAX_PLATFORMS": ""}  # let JAX probe its platforms (the TPU message)


def _run(*args, timeout=240) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=ENV, capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, compile_cache_dir):
  w = tmp_path_factory.mktemp("quiet") / "run"
  finish_run(launch_train(w, compile_cache_dir))
  return w


def _assert_quiet(proc: subprocess.CompletedProcess, max_lines: int) -> None:
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stderr.splitlines()
  low = proc.stderr.lower()
  assert "tpu" not in low and "orbax" not in low and "read only" not in low, proc.stderr[-3000:]
  assert len(lines) <= max_lines, proc.stderr[-3000:]


def test_generate_reshape_sizing_are_quiet(workdir):
  gen = _run("launch.generate", f"--workdir={workdir}", "--prompt=ab", "--max_new_tokens=2")
  _assert_quiet(gen, 0)
  assert "decode" in gen.stdout
  summary = _run("launch.reshape_checkpoint", f"--src={workdir}", "--summary")
  _assert_quiet(summary, 0)
  assert "NamedShardingMetadata" not in summary.stdout
  assert "sharding=mesh {data:1,fsdp:1,expert:1,context:1} P(None,'fsdp')" in summary.stdout
  shardings = [l.split("sharding=")[1].split("  bytes=")[0] for l in summary.stdout.splitlines()
               if "sharding=" in l]
  # One short line per tensor: the mesh (41 characters with the four axes) and a
  # PartitionSpec of at most four entries; orbax's own metadata repr runs to hundreds.
  assert shardings and max(map(len, shardings)) < 75, max(shardings, key=len)
  sizing = _run("launch.sizing", "--config=configs/zaya1_tiny.py", "--num_devices=1")
  _assert_quiet(sizing, 0)
  # A real error still shows, as one line.
  missing = _run("launch.reshape_checkpoint", f"--src={workdir}/nothing", "--summary")
  assert missing.returncode != 0 and "reshape_checkpoint:" in missing.stderr
  assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr


def test_print_config_help_and_override_typo():
  listing = _run("launch.train", "--config=configs/zaya1_tiny.py", "--print_config",
                 "--config.model.num_experts=4")
  assert listing.returncode == 0, listing.stderr[-2000:]
  lines = listing.stdout.splitlines()
  assert "  train.lr = 0.003  # peak learning rate, reached at the end of warmup" in lines
  assert ("  model.num_experts = 4  (overridden)  # E, routed experts; the router has E+1 "
          "classes (last = skip)") in lines
  assert not listing.stderr.strip(), listing.stderr
  helped = _run("launch.train", "--help")
  assert helped.returncode == 0, helped.stderr[-2000:]  # absl's help flag alone exits 1
  assert "--print_config" in helped.stdout and "--config.<group>.<field>=VALUE" in helped.stdout
  typo = _run("launch.train", "--config=configs/zaya1_tiny.py", "--workdir=/nonexistent/x",
              "--config.train.lrr=1")
  assert typo.returncode != 0
  assert typo.stderr.strip() == ("invalid config override --config.train.lrr: no field 'lrr' "
                                 "in train; did you mean 'lr'?")
  no_workdir = _run("launch.train", "--config=configs/zaya1_tiny.py")
  assert no_workdir.returncode != 0 and "--workdir=DIR is required" in no_workdir.stderr
  assert len(no_workdir.stderr.strip().splitlines()) == 1, no_workdir.stderr
  # A value of the wrong type names the flag and the type, on one line (absl's raw text was
  # "('Non-boolean argument to boolean flag', 'maybe')" and a second "See --help." line).
  key = "--config.balance.quantile_reroute"
  mistyped = _run("launch.train", "--config=configs/zaya1_tiny.py", "--workdir=/nonexistent/x",
                  f"{key}=maybe")
  assert mistyped.returncode != 0
  assert mistyped.stderr.strip() == (f"invalid flags: {key}=maybe: the value must be True or "
                                     f"False, e.g. {key}=True")
  steps = _run("launch.train", "--config=configs/zaya1_tiny.py", "--workdir=/nonexistent/x",
               "--config.train.num_steps=abc")
  assert steps.stderr.strip() == ("invalid flags: --config.train.num_steps=abc: the value must "
                                  "be an integer, e.g. --config.train.num_steps=300")
