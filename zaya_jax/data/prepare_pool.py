"""The worker processes and progress bar of `zaya_jax.data.prepare`.

`run_pool` runs one function over many tasks on spawned processes (`spawn`: no state
inherited from a parent that may hold threads), with per-worker progress sent through a
queue to a `Bar` (tqdm on stderr: documents/s as its rate, tokens/s in the postfix) and a
shared stop event so one failing task stops the others.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import queue as queue_lib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import tqdm

_REPORT_SECONDS = 0.25  # how often the driver drains the progress queue


class WorkerDied(RuntimeError):
  """A pool process exited without returning (its task's source stays unfinished)."""


_WORKER_STATE: dict[str, Any] = {}


def _init_worker(progress, stop_event) -> None:
  _WORKER_STATE.update(progress=progress, stop=stop_event)


def _worker_task(work: Callable[..., Any], *args) -> Any:
  """`work(*args, report=, stop=)` in a pool worker: progress through the queue, stop by
  the event."""
  return work(*args, report=lambda d, t: _WORKER_STATE["progress"].put((d, t)),
              stop=_WORKER_STATE["stop"].is_set)


def run_pool(work: Callable[..., Any], tasks: Sequence[tuple[Any, ...]], num_workers: int,
             bar: "Bar") -> dict[Any, Any]:
  """{args[0]: work(*args, report=, stop=)} for each `args` of `tasks`, on `num_workers`
  spawned processes; `work` must be a module-level function (pickled by name).

  `report(documents, tokens)` increments reach `bar`; when a task raises, `stop()` turns
  true in the others (they should give up soon) and the exception is raised here.

  Raises:
    WorkerDied: a worker process exited (killed, os._exit, out of memory).
  """
  ctx = multiprocessing.get_context("spawn")
  progress, stop = ctx.Queue(), ctx.Event()
  results = {}
  with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=ctx,
                                              initializer=_init_worker,
                                              initargs=(progress, stop)) as pool:
    futures = {pool.submit(_worker_task, work, *args): args[0] for args in tasks}
    pending = set(futures)
    try:
      while pending:
        finished, pending = concurrent.futures.wait(
            pending, timeout=_REPORT_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)
        _drain(progress, bar)
        for future in finished:
          results[futures[future]] = future.result()
    except BaseException as e:
      stop.set()
      for future in pending:
        future.cancel()
      if isinstance(e, concurrent.futures.process.BrokenProcessPool):
        raise WorkerDied(f"a worker process died ({e}); rerun the same command to resume "
                         "(finished sources are kept)") from e
      raise
  _drain(progress, bar)
  return results


def _drain(progress, bar) -> None:
  while True:
    try:
      documents, tokens = progress.get_nowait()
    except queue_lib.Empty:
      return
    bar.add(documents, tokens)


class Bar:
  """tqdm on stderr counting documents (its rate = docs/s), with tokens/s in the postfix."""

  def __init__(self, enabled: bool, sources: int):
    self._tqdm = tqdm.tqdm(unit=" docs", file=sys.stderr,
                           disable=not enabled, dynamic_ncols=True)
    self._start, self._tokens, self._sources = time.monotonic(), 0, sources

  def add(self, documents: int, tokens: int) -> None:
    self._tokens += tokens
    rate = self._tokens / max(time.monotonic() - self._start, 1e-9)
    self._tqdm.set_postfix_str(f"{rate:,.0f} tokens/s, {self._sources} files", refresh=False)
    self._tqdm.update(documents)

  def close(self) -> None:
    self._tqdm.close()
