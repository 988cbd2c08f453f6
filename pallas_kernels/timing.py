"""Wall-clock timing of jitted JAX calls and a description of the host the figures describe."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax


def median_seconds(fn: Callable[..., Any], args: Sequence[Any], repeats: int,
                   warmup: int = 2) -> float:
  """Median wall time in seconds of `fn(*args)` over `repeats` calls, after `warmup` calls
  (the first compiles). Each call is waited for with `jax.block_until_ready`.

  Raises:
    ValueError: if `repeats` < 1.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def host_description() -> str:
  """One line naming what measured figures characterise: the JAX backend, device kind and
  count, and for a CPU backend the host's processor and the cores this process may use."""
  devices = jax.devices()
  kind = devices[0].device_kind
  line = f"{jax.default_backend()} backend, {len(devices)} x {kind}"
  if jax.default_backend() == "cpu":
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line += (f" (host {platform.processor() or platform.machine()}, {cores} usable cores; "
             "fake CPU devices share them: figures describe this host, not an accelerator)")
  return line
