"""Unit tests of the loop's fault-tolerance helpers (zaya_jax/train/fault.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from configs import zaya1_tiny
from zaya_jax.config import resolve
from zaya_jax.train.fault import StopSignals, Watchdog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stop_signals_record_sigterm_and_restore_handlers():
  before = signal.getsignal(signal.SIGTERM)
  with StopSignals() as stop:
    assert stop.received is None and not stop.any_process()
    os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: the process lives on
    assert stop.received == "SIGTERM" and stop.any_process()
    os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
    assert stop.received == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before


def test_first_ctrl_c_makes_the_second_one_the_default_action():
  """After one SIGINT a second one must kill the process by the kernel's default action,
  which also works inside a compilation (no Python handler, no KeyboardInterrupt)."""
  before = signal.getsignal(signal.SIGINT)
  with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
  assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_watchdog_dumps_stacks_and_exits_when_a_region_hangs():
  script = textwrap.dedent("""
      import time
      from zaya_jax.train.fault import Watchdog
      def hung_collective():
        time.sleep(60)
      wd = Watchdog(timeout_s=1.0, grace_s=30.0)
      with wd.guard("train step 3"):
        pass  # a region that finishes in time disarms the timer
      wd.arm("metrics of step 3")  # replaced by the next region: never fires
      wd.arm("stop-signal agreement after step 3")
      wd.disarm()
      with wd.guard("train step 4"):
        hung_collective()
      print("not reached")
  """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                        timeout=50)
  assert proc.returncode == Watchdog.EXIT_CODE, proc.stderr
  assert "train step 4 did not finish within train.step_timeout_s=1 s" in proc.stderr
  assert "train step 3" not in proc.stderr and "step 3" not in proc.stderr
  assert "hung_collective" in proc.stderr  # the main thread's stack is in the dump
  assert "not reached" not in proc.stdout


def test_disabled_watchdog_guards_nothing():
  with Watchdog(0).guard("anything"):
    pass


def test_the_watchdog_is_on_by_default():
  """Issue 23: a run hung in its data loader sat at full CPU until killed; the default was 0
  (off). The default now bounds every step by max(600 s, 20 x the median step time)."""
  train = resolve(zaya1_tiny.get_config()).train
  assert (train.step_timeout_s, train.step_timeout_factor) == (600.0, 20.0)


def test_watchdog_bound_follows_the_median_step_time():
  wd = Watchdog(timeout_s=600.0, factor=20.0)
  assert wd.bound() == 600.0 and wd.median_step_s is None  # no step timed yet: the floor
  for seconds in (1.0, 40.0, 2.0, 3.0, 2.5):  # median 2.5 (one slow step does not count)
    wd.record_step(seconds)
  assert wd.median_step_s == 2.5
  assert wd.bound() == 600.0  # 20 x 2.5 = 50 < the floor
  for _ in range(4):
    wd.record_step(45.0)  # the steps are slow now: 1, 2, 2.5, 3, 40, 45 x 4 -> median 40
  assert wd.median_step_s == 40.0
  assert wd.bound() == 800.0  # 20 x 40
  assert wd.bound(scale=4) == 3200.0  # an evaluation of 4 batches
  assert Watchdog(timeout_s=600.0, factor=0.0).bound() == 600.0  # factor 0: fixed bound
  off = Watchdog(timeout_s=0.0, factor=20.0)
  off.record_step(1.0)
  assert off.bound() == 0.0
  with pytest.raises(ValueError, match="factor=-1"):
    Watchdog(timeout_s=1.0, factor=-1.0)


@pytest.mark.slow
def test_adaptive_watchdog_fires_on_a_stuck_loader_after_fast_steps():
  """The loop's pattern: steps timed (record_step), then a data fetch that never returns. The
  bound is 20 x the 0.05 s median = 1 s (above the 0.5 s floor), and the message says so."""
  script = textwrap.dedent("""
      import time
      from zaya_jax.train.fault import Watchdog
      def stuck_loader():
        time.sleep(60)
      wd = Watchdog(timeout_s=0.5, factor=20.0, grace_s=30.0)
      for step in range(2, 12):
        with wd.guard(f"train step {step}"):
          time.sleep(0.01)
        wd.record_step(0.05)
      start = time.monotonic()
      with wd.guard("train step 12"):
        stuck_loader()
      print("not reached")
  """)
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                        timeout=50)
  took = time.monotonic() - start
  assert proc.returncode == Watchdog.EXIT_CODE, proc.stderr
  assert ("train step 12 did not finish within 1 s = train.step_timeout_factor=20 x the median "
          "step time 0.05 s (above the floor train.step_timeout_s=0.5 s)") in proc.stderr, proc.stderr
  assert "train.step_timeout_s=0 to turn the watchdog off" in proc.stderr
  assert "stuck_loader" in proc.stderr  # the stack dump shows where it hung
  assert "not reached" not in proc.stdout
  assert took < 45  # a generous bound: it fired, not the 60 s sleep or the subprocess timeout
