"""Bad input to the entry points is one line, through the CLI (issue 23): a missing --config
file, a read-only --workdir, a run shorter than its warm-up. Every run here fails (or warns)
before a train step is compiled, so each takes the seconds of importing JAX."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from zaya_jax.config.config_file import config_file_problem

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env or ENV,
                        capture_output=True, text=True, timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  return lines[0]


# --- item 1: a missing --config file ---------------------------------------------------------

def test_config_file_problem_reads_every_flag_form(tmp_path):
  good = os.path.join(REPO, "configs", "zaya1_tiny.py")
  assert config_file_problem(["prog", f"--config={good}"]) is None
  assert config_file_problem(["prog", f"--config={good}:arg"]) is None  # get_config's argument
  assert config_file_problem(["prog", "--workdir=x"]) is None  # absent: absl's business
  missing = str(tmp_path / "nope.py")
  for argv in (["prog", f"--config={missing}"], ["prog", "--config", missing],
               ["prog", f"-config={missing}"], ["prog", f"--config={good}", f"--config={missing}"]):
    problem = config_file_problem(argv)
    assert problem is not None and problem.startswith("--config=") and "no such file" in problem, argv
  assert "is a directory" in config_file_problem(["prog", f"--config={tmp_path}"])
  assert config_file_problem(["prog", "--config="]).startswith("--config= is empty")


def test_missing_config_file_is_one_line():
  want = ("invalid flags: --config=configs/nope.py: no such file (relative paths start at the "
          f"current directory, {REPO}); give an existing config file, e.g. "
          "--config=configs/zaya1_tiny.py")
  assert _one_line(_run("launch.train", "--config=configs/nope.py", "--workdir=/tmp/x")) == want
  # An override used to fail inside the flag parser, with another traceback.
  assert _one_line(_run("launch.train", "--config=configs/nope.py", "--workdir=/tmp/x",
                        "--config.train.lr=1e-3")) == want
  assert _one_line(_run("launch.sizing", "--config=configs/nope.py", "--num_devices=1")) == want
