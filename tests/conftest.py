"""Root conftest: the `multidevice` marker and the second pytest run that selects it.

JAX fixes its device count when its backend starts, so tests on a mesh of 8 fake CPU devices
run in their own pytest process started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8 ... pytest -m multidevice tests`
(README, `.ci/run`). In any run with fewer devices they are skipped, with the reason.

JAX's persistent compilation cache is on for the whole session and its subprocesses
(`pytest_configure`); `compile_cache_dir` names its directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from tests.helpers import with_suite_xla_flags

MULTIDEVICE_COUNT = 8  # devices a `multidevice` test needs


def pytest_collection_modifyitems(config, items):
  """Skips `multidevice` tests when `jax.device_count() < MULTIDEVICE_COUNT`, then orders the
  test files heaviest first (`_heaviest_files_first`)."""
  del config
  marked = [item for item in items if "multidevice" in item.keywords]
  skipped = set()
  if marked and jax.device_count() < MULTIDEVICE_COUNT:  # only then start the backend
    skip = pytest.mark.skip(reason=(
        f"needs {MULTIDEVICE_COUNT} devices, have {jax.device_count()}: run with XLA_FLAGS="
        f"--xla_force_host_platform_device_count={MULTIDEVICE_COUNT} pytest -m multidevice"))
    for item in marked:
      item.add_marker(skip)
    skipped = {id(item) for item in marked}
  _heaviest_files_first(items, skipped)


def _heaviest_files_first(items, skipped: set[int]) -> None:
  """Sorts `items` in place by file: files with more `slow` tests that will run first, the
  order inside a file and among equal files kept. With `-n 2 --dist loadfile` a file is one
  unit of work and workers take the next unit as they free up, so the long files start
  first and the many short ones fill in at the end; xdist's own order (most tests first,
  `--loadscope-reorder`, turned off in `pytest_configure`) put the longest files, which hold
  one or two tests, last, and one worker ran them alone for the last minutes of the run."""
  file_of = lambda item: item.nodeid.split("::", 1)[0]
  slow, first = {}, {}
  for i, item in enumerate(items):
    f = file_of(item)
    first.setdefault(f, i)
    if "slow" in item.keywords and id(item) not in skipped:
      slow[f] = slow.get(f, 0) + 1
  items.sort(key=lambda item: (-slow.get(file_of(item), 0), first[file_of(item)]))


def pytest_sessionfinish(session, exitstatus):
  """`-m multidevice` selecting nothing (exit code 5) is not a failure of the second run."""
  if (exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED
      and session.config.getoption("markexpr") == "multidevice"):
    session.exitstatus = pytest.ExitCode.OK


@pytest.fixture
def default_xla_optimizations():
  """XLA's default (LLVM -O2) compile for one test, in a suite that compiles at -O0
  (`pytest_configure`). For tests whose tolerance was set at -O2 (test_step's
  grad-accumulation parity at rtol 1e-5: at -O0 one of 8,192 [4-pid] values lands just
  outside it, float summation order) and for tests that run hundreds of steps, where -O0's
  slower step (0.70 s against 0.32 s for zaya1_tiny's 2,048-token step) outweighs its
  cheaper compile (about 20 against 40 CPU-seconds)."""
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations",
                    os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "1")


@pytest.fixture(scope="session")
def compile_cache_dir():
  """This process's job-local directory of JAX's persistent compilation cache
  (`pytest_configure`): pass it to subprocesses that set their cache explicitly."""
  return pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


# --- Compile report (issue 24, item 1): set ZAYA_COMPILE_REPORT=DIR to write, for each test,
# the seconds this process spent tracing, lowering and compiling with XLA, and the names of the
# programs compiled, as DIR/compile_<worker>.json. Compiles in subprocesses are not seen here.

_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "backend_s",
}
_compile_now: dict | None = None
_compile_report: dict = {}


def _on_compile_event(event, duration, **kwargs):
  key = _COMPILE_EVENTS.get(event)
  if key is None or _compile_now is None:
    return
  _compile_now[key] = _compile_now.get(key, 0.0) + duration
  if key == "backend_s":
    _compile_now.setdefault("programs", []).append(
        [str(kwargs.get("fun_name", "?")), round(duration, 3)])


_CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
_session_cache: str | None = None


def pytest_configure(config):
  """(See `_configure_compilation`; and xdist's reordering of files by test count is turned
  off, so that `pytest_collection_modifyitems`'s heaviest-first order holds.)"""
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False
  _configure_compilation(config)


def _configure_compilation(config):
  """JAX's persistent compilation cache for the whole session: one fresh directory per
  process (each xdist worker has its own, so no two writers share it; removed at the end;
  never shared between machines or jobs), every program written (no minimum compile time or
  size). Set in `os.environ` as well as in this process's jax config, so every subprocess a
  test starts (the CLI runs) reads and writes the same cache: the suite compiles each
  distinct program about once. A test that needs a cold compile, or a multi-process run
  (tests/helpers.py `launch_devices`), sets or removes `JAX_COMPILATION_CACHE_DIR` in its
  child's environment. `ZAYA_TEST_NO_COMPILE_CACHE=1` turns it off (to check that no test
  depends on it). The cache hits on CPU with jax 0.10.2 (jax#38445 reports CPU entries
  rejected on reload in 0.9.1-0.10.1; a hit is checked in tests/tools/test_small_fixes.py).

  XLA:CPU with LLVM -O0 (`jax_disable_most_optimizations`, here and in subprocesses): it
  halves the backend compile time (the tiny test train step: 40.9 -> 20.6 CPU-seconds) and
  on the suite's small shapes a step runs as fast (0.024 -> 0.020 s), but zaya1_tiny's full
  8 x 256 step runs 0.70 s against 0.32 s at -O2, so tests of hundreds of steps take the
  `default_xla_optimizations` fixture. HLO passes, SPMD partitioning included, still run,
  and every run of a comparison is compiled alike.
  XLA:CPU's older loop emitters (`tests/helpers.py` `SUITE_XLA_FLAGS`, added to XLA_FLAGS here
  and so for every subprocess): a tiny CLI run's train step compiles in 3.6 s instead of
  about 6 s; the whole first run took 721 s against 924 s on one idle machine (2026-12-05).
  `ZAYA_TEST_FULL_OPT=1` runs the suite with XLA's default optimisations and emitters.

  `ZAYA_COMPILE_REPORT=DIR`: the compile report below."""
  del config
  global _session_cache
  if os.environ.get("ZAYA_TEST_FULL_OPT") != "1":
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["XLA_FLAGS"] = with_suite_xla_flags(os.environ.get("XLA_FLAGS", ""))
  if os.environ.get("ZAYA_TEST_NO_COMPILE_CACHE") == "1":
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
  else:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _session_cache = tempfile.mkdtemp(prefix=f"zaya_jax_compile_cache_{worker}_")
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": _session_cache, **_CACHE_ENV})
    jax.config.update("jax_compilation_cache_dir", _session_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()
  if os.environ.get("ZAYA_COMPILE_REPORT"):
    jax.monitoring.register_event_duration_secs_listener(_on_compile_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Attributes compile time to the test (setup, call and teardown, fixtures included)."""
  del nextitem
  global _compile_now
  if not os.environ.get("ZAYA_COMPILE_REPORT"):
    yield
    return
  _compile_now = {}
  yield
  _compile_report[item.nodeid] = _compile_now
  _compile_now = None


def pytest_unconfigure(config):
  del config
  if _session_cache is not None:
    shutil.rmtree(_session_cache, ignore_errors=True)
  out = os.environ.get("ZAYA_COMPILE_REPORT")
  if not out or not _compile_report:
    return
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"compile_{worker}_{os.getpid()}.json"), "w") as f:
    json.dump(_compile_report, f)
