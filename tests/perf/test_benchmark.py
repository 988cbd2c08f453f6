"""The training benchmark (zaya_jax.perf.benchmark, launch.benchmark) on the tiny config.

Smoke runs of the CLI in a subprocess (a fresh JAX, as a user runs it): the printed report and
the JSON hold positive, mutually consistent figures (tokens/s x step time = tokens per step,
MFU = achieved / peak, achieved = FLOPs/token x tokens/s with the sizing count). Timings are
never asserted.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from configs import zaya1_tiny
from zaya_jax.perf import benchmark
from zaya_jax.model.sizing import train_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config=configs/zaya1_tiny.py", "--config.train.batch_size=2",
        "--config.train.seq_len=64", "--steps=2", "--warmup=1", "--matmul_size=256"]


def run_cli(*args, timeout=600):
  return subprocess.run([sys.executable, "-m", "launch.benchmark", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, check=False)


def check_figures(r):
  for key in ("step_s", "tokens_per_s", "flops_per_token", "achieved_flops", "peak_flops", "mfu",
              "peak_memory_bytes", "compile_s"):
    assert r[key] > 0, (key, r[key])
  assert r["tokens_per_step"] == r["batch_size"] * r["seq_len"] == 2 * 64
  assert math.isclose(r["tokens_per_s"] * r["step_s"], r["tokens_per_step"], rel_tol=1e-9)
  assert math.isclose(r["mfu"], r["achieved_flops"] / r["peak_flops"], rel_tol=1e-9)
  assert math.isclose(r["achieved_flops"], r["flops_per_token"] * r["tokens_per_s"], rel_tol=1e-9)
  assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
  assert math.isfinite(r["loss"])


@pytest.mark.slow
def test_cli_with_compare_transformers(tmp_path):
  """The one end-to-end CLI run of launch.benchmark (issue 24: the plain smoke run and this
  one were two subprocesses; this one checks everything the plain run printed and wrote)."""
  out = tmp_path / "bench.json"
  proc = run_cli(*TINY, "--compare_transformers", "--profile_steps=1", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  check_figures(r)
  cfgs = benchmark.bench_configs(zaya1_tiny.get_config())
  assert r["flops_per_token"] == pytest.approx(train_flops_per_token(cfgs.model, 64))
  for line in ("tokens/s:", "step time (median):", "achieved:", "MFU:", "peak memory:"):
    assert line in proc.stdout, proc.stdout
  assert r["hf_threads"] == r["threads"] == benchmark.cpu_threads()
  assert r["hf_tokens_per_s"] > 0
  assert math.isclose(r["hf_tokens_per_s"] * r["hf_step_s"], r["tokens_per_step"], rel_tol=1e-9)
  assert math.isclose(r["ratio"], r["tokens_per_s"] / r["hf_tokens_per_s"], rel_tol=1e-9)
  assert math.isclose(r["hf_mfu"], r["mfu"] / r["ratio"], rel_tol=1e-9)
  # The profile of one more step: the LM head + loss and the experts are among its sources.
  sources = {src: share for src, _, share in r["profile"]["by_source"]}
  assert any(s.startswith("ops/cross_entropy.py:") for s in sources), sources
  assert any(s.startswith("ops/fused_experts.py:") for s in sources), sources  # "auto" on CPU
  assert sum(sources.values()) == pytest.approx(1.0)
  assert "by source (innermost zaya_jax frame)" in proc.stdout, proc.stdout
  assert "speed-up vs transformers:" in proc.stdout
  # Without the comparison the report has no transformers lines (same figures, HF keys gone).
  plain = benchmark.format_report({k: v for k, v in r.items() if not k.startswith("hf_")
                                   and k != "ratio"})
  assert "tokens/s:" in plain and "transformers" not in plain


@pytest.mark.parametrize("args, flag", [
    (["--steps=0"], "steps"),
    (["--warmup=0"], "warmup"),
    (["--stepz=3"], "stepz"),
    (["--config.model.hidden_sizee=3"], "hidden_sizee"),
])
@pytest.mark.slow
def test_bad_flag_exits_nonzero(args, flag):
  proc = run_cli("--config=configs/zaya1_tiny.py", *args, timeout=120)
  assert proc.returncode != 0
  assert flag in proc.stderr, proc.stderr[-2000:]


def test_bench_cpu_config():
  """configs/bench_cpu.py has the sizes the issue asks for and validates."""
  from configs import bench_cpu  # pylint: disable=import-outside-toplevel
  cfgs = benchmark.bench_configs(bench_cpu.get_config())
  m = cfgs.model
  assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (512, 8, 8, 2, 64)
  assert (m.num_experts, m.moe_intermediate_size, m.router_hidden_size, m.vocab_size) == (16, 512, 64, 16384)
  assert (cfgs.train.batch_size, cfgs.train.seq_len, m.dtype) == (4, 512, "float32")
