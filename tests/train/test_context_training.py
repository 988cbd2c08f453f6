"""`launch.train` with context parallelism trains like one device, and resumes across context
sizes.

Three CLI runs of the tiny model (T 32, B 8, the raw stdlib corpus, `MULTIPROCESS_OVERRIDES`):
one device for 4 steps (the reference); 8 fake CPU devices with `mesh.context=8` (16 zigzag
chunks of 2 tokens, the CCA halo 2) for 2 steps, then the same workdir resumed on `mesh.data=2,
mesh.context=4` for steps 3-4. Every step's loss equals the reference's (rtol 1e-4: float
summation order over 4 updates) and the routing counts reduce over `context` as over `data`
(the same `expert_load` per step). Slow: three subprocesses, 5m43s on 2 shared cores
(measured: loss rel differences 1.6e-7, 1.7e-7, 0, 0 at steps 1-4; expert loads equal).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import launch_devices, run_records, tail

STEPS = 4


def _run(tmp_path, name, workdir, devices, *extra, cache=None):
  proc = launch_devices(str(workdir), "stdlib", devices, "--config.mesh.expert=1", *extra,
                        log=tmp_path / f"{name}.log", cache_dir=cache)
  assert proc.wait(timeout=400) == 0, tail(tmp_path, f"{name}.log")


@pytest.mark.slow
def test_context_parallel_training_matches_one_device_and_resumes(tmp_path, compile_cache_dir):
  cache = compile_cache_dir  # the session's (tests/conftest.py); single-process runs only
  _run(tmp_path, "ref", tmp_path / "ref", 1, "--config.mesh.data=1",
       f"--config.train.max_steps_per_run={STEPS}", cache=cache)
  _run(tmp_path, "cp8", tmp_path / "cp", 8, "--config.mesh.data=1", "--config.mesh.context=8",
       f"--config.train.max_steps_per_run={STEPS // 2}", cache=cache)
  _run(tmp_path, "cp4", tmp_path / "cp", 8, "--config.mesh.data=2", "--config.mesh.context=4",
       f"--config.train.max_steps_per_run={STEPS // 2}", cache=cache)
  assert "'context': 4" in tail(tmp_path, "cp4.log", 100_000)
  ref, cp = run_records(tmp_path / "ref"), run_records(tmp_path / "cp")
  assert sorted(ref) == sorted(cp) == list(range(1, STEPS + 1)), (sorted(ref), sorted(cp))
  for step in ref:
    np.testing.assert_allclose(cp[step]["loss_last"], ref[step]["loss_last"], rtol=1e-4,
                               err_msg=f"step {step}")
    np.testing.assert_allclose(cp[step]["expert_load"], ref[step]["expert_load"], atol=1e-6,
                               err_msg=f"step {step}")
