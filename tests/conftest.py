"""Root conftest: the `multidevice` marker and the second pytest run that selects it.

JAX fixes its device count when its backend starts, so tests on a mesh of 8 fake CPU devices
run in their own pytest process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 ... pytest -m multidevice tests`
(README, `.ci/run`). In any run with fewer devices they are skipped, with the reason.
"""

from __future__ import annotations

import jax
import pytest

MULTIDEVICE_COUNT = 8  # devices a `multidevice` test needs


def pytest_collection_modifyitems(config, items):
  """Skips `multidevice` tests when `jax.device_count() < MULTIDEVICE_COUNT`."""
  del config
  marked = [item for item in items if "multidevice" in item.keywords]
  if not marked or jax.device_count() >= MULTIDEVICE_COUNT:  # only then start the backend
    return
  skip = pytest.mark.skip(reason=(
      f"needs {MULTIDEVICE_COUNT} devices, have {jax.device_count()}: run with XLA_FLAGS="
      f"--xla_force_host_platform_device_count={MULTIDEVICE_COUNT} pytest -m multidevice"))
  for item in marked:
    item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
  """`-m multidevice` selecting nothing (exit code 5) is not a failure of the second run."""
  if (exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED
      and session.config.getoption("markexpr") == "multidevice"):
    session.exitstatus = pytest.ExitCode.OK


@pytest.fixture(scope="session")
def fast_compile():
  """XLA:CPU with LLVM -O0 for the session (`jax_disable_most_optimizations`): halves the
  compile time of the multi-device tests. HLO passes, SPMD partitioning included, still run,
  and a mesh run and its one-device reference are compiled alike."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
