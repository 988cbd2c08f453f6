"""Root conftest: the `multidevice` marker and the second pytest run that selects it.

JAX fixes its device count when its backend starts, so tests on a mesh of 8 fake CPU devices
run in their own pytest process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 ... pytest -m multidevice tests`
(README, `.ci/run`). In any run with fewer devices they are skipped, with the reason.

`persistent_compile_cache`: JAX's persistent compilation cache in this process, for a module
whose tests call the training loop in-process several times.
"""

from __future__ import annotations

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

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


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
  """One job-local directory for JAX's persistent compilation cache, for the whole session
  (each xdist worker has its own); never shared between machines."""
  return tmp_path_factory.mktemp("jax_cache")


_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="module")
def persistent_compile_cache(compile_cache_dir):
  """JAX's persistent compilation cache in `compile_cache_dir` for one module's tests, every
  program written (no minimum compile time or size); the previous settings afterwards.

  Each `zaya_jax.train.run` builds and jits its train and eval steps anew, so JAX's in-memory
  caches do not carry a compiled step from one run to the next: on the tiny config a second
  run in the same process spent 21.5 s in the backend compiler without this cache, 0.8 s
  with it (3 of 3 programs read back; jax 0.10.2, CPU). `reset_cache` is needed because JAX
  decides once per process whether the cache is used, at the first compile.
  """
  before = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  compilation_cache.reset_cache()
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
