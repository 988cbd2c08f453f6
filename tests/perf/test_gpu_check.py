"""`launch.gpu_check` on CPU: every section runs (kernels interpreted, tiny shapes) and the JSON
holds computed values, and every skip is named with its reason.

One CLI run in a subprocess (its own JAX process, as a user runs it); the kernel parity, the
tiny timings and two tiny train steps run there in Pallas interpret mode.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from zaya_jax.perf import gpu_check
from tests.perf.cli import REPO


# The CLI run interprets every kernel and compiles two tiny train steps: minutes here.
pytestmark_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_check")
  proc = subprocess.run([sys.executable, "-m", "launch.gpu_check", f"--out={out}"], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(out / "gpu_check.json", encoding="utf-8") as f:
    return json.load(f), proc.stdout


@pytestmark_slow
def test_parity_ran_every_kernel_in_both_dtypes_with_computed_errors(cpu_run):
  result, stdout = cpu_run
  assert result["device"]["platform"] == "cpu" and result["device"]["on_gpu"] is False
  got = {(p["kernel"], p["dtype"]) for p in result["parity"]}
  assert got == {(k, d) for k in ("routing", "gmm", "cca_attention")
                 for d in ("float32", "bfloat16")}
  for p in result["parity"]:
    assert p["interpret"] is True and p["ok"] is True, p
    names = {c["name"] for c in p["checks"]}
    assert any(n.startswith("d") for n in names), f"{p['kernel']}: no gradient check"
    for c in p["checks"]:
      assert math.isfinite(c["max_abs_err"])
  # The integer routing outputs are compared exactly; the float checks use the dtype's table.
  for p in result["parity"]:
    tol = {c["name"]: (c["atol"], c["rtol"]) for c in p["checks"]}
    if p["kernel"] == "routing":
      assert tol["class_M"] == (0.0, 0.0) and tol["order_M"] == (0.0, 0.0)
    else:
      assert tol["out"] == gpu_check.TOLERANCES[p["dtype"], "value"]
  assert result["ok"] is True and "ALL OK" in stdout


@pytestmark_slow
def test_timings_and_train_steps_hold_measured_values(cpu_run):
  result, stdout = cpu_run
  ops = {(t["op"], t["pass"], t["impl"]) for t in result["timings"]}
  for op, xla in (("cca_attention", "xla"), ("gmm", "ragged_dot"), ("routing", "xla")):
    for mode in ("forward", "fwd+bwd"):
      assert {(op, mode, "pallas"), (op, mode, xla)} <= ops
  for t in result["timings"]:
    assert t["seconds"] > 0 and t["shapes"].startswith("tiny")
    assert (t["ratio_xla_over_pallas"] is not None) == (t["impl"] == "pallas")
  steps = {t["kernels"]: t for t in result["train_step"]}
  assert set(steps) == {"on", "off"}
  assert steps["on"]["attention_impl"] == "pallas" and steps["off"]["attention_impl"] == "xla"
  for t in steps.values():
    assert t["tokens_per_s"] > 0 and 0 < t["mfu"] < 1 and math.isfinite(t["loss"])
  # Both rows divide by one peak, so their MFU ratio is their tokens/s ratio.
  assert steps["on"]["peak_flops"] == steps["off"]["peak_flops"]
  assert steps["on"]["mfu"] / steps["off"]["mfu"] == pytest.approx(
      steps["on"]["tokens_per_s"] / steps["off"]["tokens_per_s"], rel=1e-9)
  # Same init, same batch: the kernels change the loss only by rounding.
  assert abs(steps["on"]["loss"] - steps["off"]["loss"]) < 0.05 * abs(steps["off"]["loss"])
  assert "Train step" in stdout and "Timings" in stdout


@pytestmark_slow
def test_cpu_run_names_what_it_skipped(cpu_run):
  result, stdout = cpu_run
  whats = " | ".join(s["what"] for s in result["skipped"])
  for skipped in ("compiled Triton kernels", "timings at ZAYA1-base shapes",
                  "train step at ZAYA1-base widths"):
    assert skipped in whats
  assert all(s["why"] for s in result["skipped"])
  assert "Skipped:" in stdout


def test_compare_fails_on_a_real_difference_and_skip_names_are_checked():
  a = np.ones((3, 4), np.float32)
  assert gpu_check.compare("x", a, a, 1e-5, 1e-5)["ok"]
  off = gpu_check.compare("x", a + 1e-3, a, 1e-5, 1e-5)
  assert not off["ok"] and off["max_abs_err"] == pytest.approx(1e-3, rel=1e-3)
  assert not gpu_check.compare("x", a[:2], a, 1, 1)["ok"]
  assert not gpu_check.compare("x", a * np.nan, a, 1, 1)["ok"]
  with pytest.raises(ValueError, match="--skip=timing: unknown section"):
    gpu_check.check_skip(("timing",))
