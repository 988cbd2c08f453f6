"""Unit tests of the loop's fault-tolerance helpers (zaya_jax/train/fault.py)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

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
  assert "train step 4 did not finish within train.step_timeout_s=1" in proc.stderr
  assert "train step 3" not in proc.stderr and "step 3" not in proc.stderr
  assert "hung_collective" in proc.stderr  # the main thread's stack is in the dump
  assert "not reached" not in proc.stdout


def test_disabled_watchdog_guards_nothing():
  with Watchdog(0).guard("anything"):
    pass
