"""Runs a `launch.*` entry point once per set of flags, all processes started together."""

import os
import pathlib
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_concurrently(module: str, runs: dict[str, list[str]], root: pathlib.Path,
                     timeout: float = 300) -> dict[str, tuple[int, str, pathlib.Path]]:
  """`python -m module *flags --out=root/name` for every `name: flags` of `runs`, started
  together (each spends most of its time importing JAX): name -> (return code, stdout and
  stderr, OUT folder)."""
  procs = {name: subprocess.Popen(
      [sys.executable, "-m", module, *args, f"--out={root / name}"], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name, args in runs.items()}
  runs_out = {}
  for name, p in procs.items():
    output = p.communicate(timeout=timeout)[0]
    runs_out[name] = (p.returncode, output, root / name)
  return runs_out
