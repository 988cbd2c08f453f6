"""Fault tolerance helpers of the training loop: preemption signals and a hang watchdog.

`StopSignals` turns SIGTERM (SLURM/Kubernetes preemption) and SIGINT (Ctrl-C) into a flag
the loop polls after each step, so it can write a checkpoint and exit 0 instead of dying
mid-step; a second SIGINT kills the process at once (the default action, installed by the
first signal, so it works inside a compilation or any other C++ call, where no Python
handler runs until the call returns). In a multi-process run `any_process` makes every
process agree on the step at which to stop (one host may get the signal first).

`Watchdog` bounds the wall time of each guarded region (a train step with its data fetch, its
metrics fetch, an evaluation, a save, a restore, the stop-signal agreement). A region that
overruns — typically a collective waiting forever for a dead or hung host, or a data loader
that never returns — gets every Python thread's stack printed to stderr and the process exits
with `Watchdog.EXIT_CODE`, so the job scheduler restarts it and the run resumes from its last
checkpoint. It is on by default: the bound adapts to the run, max(`train.step_timeout_s`
(600 s), `train.step_timeout_factor` (20) x the median step time so far), so a slow model is
not killed and a hung fast one is not left burning its devices; `step_timeout_s=0` turns it
off.
"""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import types
from typing import Iterator

import jax
import numpy as np


class StopSignals:
  """Records SIGTERM/SIGINT instead of dying; use as a context manager around the loop.

  Attributes:
    received: name of the first signal received ("SIGTERM" / "SIGINT"), or None.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._previous: dict[int, object] = {}

  def _handle(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    if self.received is None:
      self.received = signal.Signals(signum).name
      print(f"received {self.received}: finishing the current step, then writing a checkpoint "
            "(none if it is this run's first step) and exiting (Ctrl-C / SIGINT again aborts "
            "at once, without a checkpoint)",
            file=sys.stderr, flush=True)
      # A second Ctrl-C terminates the process by the default action: at once, also during
      # a compilation (a Python handler, or KeyboardInterrupt, would wait for it to return and
      # then unwind through XLA's and Orbax's threads, which crashed the interpreter).
      signal.signal(signal.SIGINT, signal.SIG_DFL)

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():  # signal() only works there
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()

  def any_process(self) -> bool:
    """True if this or (in a multi-process run) any other process received a stop signal.

    Every process must call this at the same point of the same step: with several
    processes it is a collective (an all-gather of one int32 per process).
    """
    local = self.received is not None
    if jax.process_count() == 1:
      return local
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    flags = multihost_utils.process_allgather(np.asarray(local, np.int32))
    return bool(np.any(flags))


class Watchdog:
  """Exits the process, after printing all Python stacks, if a guarded region overruns.

  A region named `what` may take `bound(scale)` seconds: max(timeout_s, factor x scale x the
  median of the step times recorded so far (`record_step`)), or timeout_s before any is
  recorded (`scale`: how many steps' worth of work the region is, e.g. the batches of an
  evaluation). A Python timer thread then prints which region hung and the config field to
  raise, dumps every thread's stack (`faulthandler.dump_traceback`) and calls
  `os._exit(EXIT_CODE)`. A second, C-level `faulthandler.dump_traceback_later` timer fires
  `grace_s` later in case the Python thread cannot run (the GIL held by the hung code); it
  exits with status 1.

  Args:
    timeout_s: seconds a region may take at least (the bound's floor); 0 disables the
      watchdog (guard() does nothing).
    factor: multiple of the median step time a region may take when that is above
      `timeout_s`; 0 = the fixed bound `timeout_s`.
    grace_s: extra seconds before the C-level backstop fires.

  Raises:
    ValueError: a negative timeout_s, factor or grace_s.
  """

  EXIT_CODE = 3

  def __init__(self, timeout_s: float, factor: float = 0.0, grace_s: float = 30.0):
    if min(timeout_s, factor, grace_s) < 0:
      raise ValueError(f"Watchdog: timeout_s={timeout_s}, factor={factor} and "
                       f"grace_s={grace_s} must be >= 0")
    self.timeout_s = float(timeout_s)
    self.factor = float(factor)
    self.grace_s = float(grace_s)
    self._timer: threading.Timer | None = None
    self._steps_s: list[float] = []  # step times so far, sorted

  def record_step(self, seconds: float) -> None:
    """Adds one step's wall time (data fetch to stop-signal agreement; evaluations and saves
    left out) to the median the bound follows."""
    bisect.insort(self._steps_s, float(seconds))

  @property
  def median_step_s(self) -> float | None:
    """The median recorded step time (upper median), or None before the first."""
    return self._steps_s[len(self._steps_s) // 2] if self._steps_s else None

  def bound(self, scale: float = 1.0) -> float:
    """Seconds a region of `scale` steps' work may take: max(timeout_s, factor x scale x the
    median step time), timeout_s before any step time is recorded; 0 when disabled."""
    if not self.timeout_s:
      return 0.0
    median = self.median_step_s
    return max(self.timeout_s, self.factor * max(scale, 1.0) * (median or 0.0))

  def _explain(self, bound: float, scale: float) -> str:
    """Where `bound` came from, naming the config fields."""
    if bound <= self.timeout_s:
      return f"train.step_timeout_s={self.timeout_s:g} s"
    times = f" x {scale:g} steps' work" if scale > 1 else ""
    return (f"{bound:.0f} s = train.step_timeout_factor={self.factor:g} x the median step time "
            f"{self.median_step_s:.3g} s{times} (above the floor train.step_timeout_s="
            f"{self.timeout_s:g} s)")

  def _fire(self, what: str, bound: float, scale: float) -> None:
    sys.stderr.write(f"\nwatchdog: {what} did not finish within {self._explain(bound, scale)} "
                     "(a hung collective, a dead host or a stuck data loader?). Stacks of all "
                     "threads follow; exiting with status "
                     f"{self.EXIT_CODE}. Rerun the same command to resume from the last "
                     "checkpoint; raise train.step_timeout_s (or train.step_timeout_factor) if "
                     "this is legitimately this slow, or set train.step_timeout_s=0 to turn "
                     "the watchdog off.\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(self.EXIT_CODE)  # pylint: disable=protected-access

  def arm(self, what: str, scale: float = 1.0) -> None:
    """Starts the timeout (`bound(scale)`) for a region named `what`, replacing any armed one
    (so consecutive regions need no disarm between them). No-op when disabled."""
    self.disarm()
    if not self.timeout_s:
      return
    bound = self.bound(scale)
    self._timer = threading.Timer(bound, self._fire, args=(what, bound, scale))
    self._timer.daemon = True
    self._timer.start()
    faulthandler.dump_traceback_later(bound + self.grace_s, exit=True)

  def disarm(self) -> None:
    """Cancels the armed timeout, if any."""
    timer, self._timer = self._timer, None
    if timer is not None:
      timer.cancel()
      faulthandler.cancel_dump_traceback_later()

  @contextlib.contextmanager
  def guard(self, what: str, scale: float = 1.0) -> Iterator[None]:
    """Runs the body under the timeout (`arm`, then `disarm`); `what` names the region in the
    message. Guards do not nest: an inner one disarms the outer."""
    self.arm(what, scale)
    try:
      yield
    finally:
      self.disarm()
