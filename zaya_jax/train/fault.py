"""Fault tolerance helpers of the training loop: preemption signals and a hang watchdog.

`StopSignals` turns SIGTERM (SLURM/Kubernetes preemption) and SIGINT (Ctrl-C) into a flag
the loop polls after each step, so it can write a checkpoint and exit 0 instead of dying
mid-step; a second SIGINT kills the process at once (the default action, installed by the
first signal, so it works inside a compilation or any other C++ call, where no Python
handler runs until the call returns). In a multi-process run `any_process` makes every
process agree on the step at which to stop (one host may get the signal first).

`Watchdog` bounds the wall time of each guarded region (a train step, its metrics fetch, an
evaluation, a save, a restore, the stop-signal agreement). A region that overruns —
typically a collective waiting forever for a dead or hung host — gets every Python thread's
stack printed to stderr and the process exits with `Watchdog.EXIT_CODE`, so the job
scheduler restarts it and the run resumes from its last checkpoint.
"""

from __future__ import annotations

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
            "and exiting (Ctrl-C / SIGINT again aborts at once, without a checkpoint)",
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

  A Python timer thread prints which region hung and the config field to raise, dumps every
  thread's stack (`faulthandler.dump_traceback`) and calls `os._exit(EXIT_CODE)`. A second,
  C-level `faulthandler.dump_traceback_later` timer fires `grace_s` later in case the Python
  thread cannot run (the GIL held by the hung code); it exits with status 1.

  Args:
    timeout_s: seconds a region may take; 0 disables the watchdog (guard() does nothing).
    grace_s: extra seconds before the C-level backstop fires.
  """

  EXIT_CODE = 3

  def __init__(self, timeout_s: float, grace_s: float = 30.0):
    self.timeout_s = float(timeout_s)
    self.grace_s = float(grace_s)
    self._timer: threading.Timer | None = None

  def _fire(self, what: str) -> None:
    sys.stderr.write(f"\nwatchdog: {what} did not finish within train.step_timeout_s="
                     f"{self.timeout_s:g} s (a hung collective or a dead host?). Stacks of all "
                     "threads follow; exiting with status "
                     f"{self.EXIT_CODE}. Rerun the same command to resume from the last "
                     "checkpoint; raise train.step_timeout_s if steps are legitimately this "
                     "slow.\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(self.EXIT_CODE)  # pylint: disable=protected-access

  def arm(self, what: str) -> None:
    """Starts the timeout for a region named `what`, replacing any armed one (so
    consecutive regions need no disarm between them). No-op when disabled."""
    self.disarm()
    if not self.timeout_s:
      return
    self._timer = threading.Timer(self.timeout_s, self._fire, args=(what,))
    self._timer.daemon = True
    self._timer.start()
    faulthandler.dump_traceback_later(self.timeout_s + self.grace_s, exit=True)

  def disarm(self) -> None:
    """Cancels the armed timeout, if any."""
    timer, self._timer = self._timer, None
    if timer is not None:
      timer.cancel()
      faulthandler.cancel_dump_traceback_later()

  @contextlib.contextmanager
  def guard(self, what: str) -> Iterator[None]:
    """Runs the body under the timeout (`arm`, then `disarm`); `what` names the region in the
    message. Guards do not nest: an inner one disarms the outer."""
    self.arm(what)
    try:
      yield
    finally:
      self.disarm()
