"""GEMM sweep: FLOP accounting, sweep shapes, the measured table's lookup and interpolation, and
the `launch.bench_gemm` CLI on tiny shapes. No timing is asserted (the host is shared)."""

import csv
import math

import pytest

from configs import zaya1_tiny
from zaya_jax.config import build_group
from zaya_jax.config.model import ModelConfig
from zaya_jax.model import sizing
from zaya_jax.parallel import accelerators
from zaya_jax.perf import gemm, gemm_table, roofline
from tests.perf.cli import run_concurrently

TINY = [gemm.GemmShape("square", "square 16", 16, 16, 16),
        gemm.GemmShape("square", "square 32", 32, 32, 32),
        gemm.GemmShape("m", "m 32", 32, 16, 16)]
CLI_RUNS = {
    "smoke": ["--sweeps=square,m,grid", "--min_size=16", "--max_size=32", "--base_size=16",
              "--offsets=-8", "--dtypes=float32", "--repeats=1", "--warmup=1",
              "--config=configs/zaya1_tiny.py", "--tokens=32"],
    "dtypes": ["--dtypes=int4"],
    "min_gt_max": ["--min_size=512", "--max_size=64"],
    "profile": ["--profile=tpu9"],
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  """`launch.bench_gemm` once per CLI_RUNS entry: name -> (return code, output, OUT folder)."""
  return run_concurrently("launch.bench_gemm", CLI_RUNS, tmp_path_factory.mktemp("bench_gemm"))


def test_flops_are_two_m_n_k():
  assert gemm.gemm_flops(2, 3, 4) == 48
  assert gemm.gemm_flops(4096, 262272, 2048) == 2 * 4096 * 262272 * 2048


def test_sweep_sizes_are_powers_of_two_and_neighbours():
  assert gemm.sweep_sizes(64, 512) == [64, 128, 192, 256, 320, 448, 512]
  assert gemm.sweep_sizes(100, 256, offsets=(-1, 1)) == [127, 128, 129, 255, 256]
  assert gemm.powers_of_two(3, 40) == [4, 8, 16, 32]
  with pytest.raises(ValueError, match="min_size=512 > max_size=64"):
    gemm.sweep_sizes(512, 64)


def test_sweep_shapes_vary_one_dimension_around_base():
  shapes = gemm.sweep_shapes(gemm.SWEEPS, [64, 128], [64, 128, 256], base=32)
  by_kind = {kind: [(s.m, s.n, s.k) for s in shapes if s.kind == kind] for kind in gemm.SWEEPS}
  assert by_kind["square"] == [(64, 64, 64), (128, 128, 128)]
  assert by_kind["m"] == [(64, 32, 32), (128, 32, 32)]
  assert by_kind["n"] == [(32, 64, 32), (32, 128, 32)]
  assert by_kind["k"] == [(32, 32, 64), (32, 32, 128)]
  assert len(by_kind["grid"]) == 9 and all(k == 32 for _, _, k in by_kind["grid"])
  with pytest.raises(ValueError, match="sweeps"):
    gemm.sweep_shapes(["diagonal"], [64], [64], 32)


def test_parse_dtypes_takes_aliases_and_rejects_others():
  assert gemm.parse_dtypes(["bf16", "float32", "fp32"]) == ("bfloat16", "float32")
  with pytest.raises(ValueError, match="dtypes: 'int4'"):
    gemm.parse_dtypes(["int4"])


def test_model_shapes_are_sizing_gemms_with_backward():
  cfg = build_group(ModelConfig, zaya1_tiny.get_config(), "model")
  forward = sizing.model_gemms(cfg, 64)
  shapes = gemm.model_shapes(cfg, 64)
  assert len(shapes) == 3 * len(forward)
  assert [(s.name, s.m, s.n, s.k, s.count) for s in shapes[:3]] == [
      (g.name, g.m, g.n, g.k, g.count) for g in (forward[0], *forward[0].backward())]
  assert {s.name for s in shapes} >= {"lm_head", "moe.expert_up_gate.wgrad", "router.out_proj"}
  assert len(gemm.model_shapes(cfg, 64, backward=False)) == len(forward)


def test_run_sweep_rates_against_profile_or_measured_peak():
  h200 = accelerators.get_profile("h200")
  rows = gemm.run_sweep(TINY, ["float32"], repeats=1, warmup=1, profile=h200, log=lambda _: None)
  assert [r.shape for r in rows] == TINY
  for r in rows:
    assert r.peak_source == "h200" and r.peak_tflops == pytest.approx(66.9)
    assert r.tflops == pytest.approx(gemm.gemm_flops(r.shape.m, r.shape.n, r.shape.k) / r.seconds / 1e12)
    assert r.frac_of_peak == pytest.approx(r.tflops / r.peak_tflops)
  rows = gemm.run_sweep(TINY, ["bf16"], repeats=1, warmup=1, low_fraction=0.9, log=lambda _: None)
  assert all(r.dtype == "bfloat16" and r.peak_source.startswith("measured") for r in rows)
  best_square = max(r.tflops for r in rows if r.shape.kind == "square")
  assert all(r.peak_tflops == best_square for r in rows)
  assert max(r.frac_of_best for r in rows) == pytest.approx(1.0)
  assert all(r.low_utilisation == (r.frac_of_best < 0.9) for r in rows)


def test_table_round_trip_exact_interpolated_and_missing_dtype(tmp_path):
  rows = gemm.run_sweep(TINY, ["float32"], repeats=1, warmup=1, log=lambda _: None)
  path = str(tmp_path / "g.csv")
  gemm.write_csv(rows, path)
  table = gemm_table.GemmTable.from_csv(path)
  assert table.dtypes == ("float32",)
  for r in rows:  # exact shapes: the measured time (6 significant digits in the CSV)
    assert table.seconds(r.shape, "float32") == pytest.approx(r.seconds, rel=1e-5)
    assert table.seconds(r.shape, "fp32") == table.seconds(r.shape, "float32")
  # An unmeasured shape: its rate lies between the measured rates.
  between = sizing.Gemm("x", 24, 24, 24, 7)
  rate = gemm.gemm_flops(24, 24, 24) / table.seconds(between, "float32")
  rates = [gemm.gemm_flops(r.shape.m, r.shape.n, r.shape.k) / r.seconds for r in rows]
  assert min(rates) * (1 - 1e-5) <= rate <= max(rates) * (1 + 1e-5)
  with pytest.raises(ValueError, match=r"no 'bfloat16' measurements.*float32.*--dtypes=bfloat16"):
    table.seconds(between, "bf16")


def test_table_interpolation_is_inverse_square_distance_geometric_mean():
  # 64^3 at 1 TFLOP/s and 256x64x64 at 4 TFLOP/s: 128x64x64 lies 1 (log2) from each, so its
  # rate is their geometric mean, 2 TFLOP/s.
  table = gemm_table.GemmTable([("float32", 64, 64, 64, gemm.gemm_flops(64, 64, 64) / 1e12),
                          ("float32", 256, 64, 64, gemm.gemm_flops(256, 64, 64) / 4e12)])
  assert table.achieved_flops(128, 64, 64, "float32") == pytest.approx(2e12)
  assert table.seconds(sizing.Gemm("g", 128, 64, 64, 1), "float32") == pytest.approx(
      gemm.gemm_flops(128, 64, 64) / 2e12)
  # 512x64x64 is 1 from the 256 row and 3 from the 64 row: weights 1 and 1/9.
  want = math.exp((math.log(4e12) + math.log(1e12) / 9) / (1 + 1 / 9))
  assert table.achieved_flops(512, 64, 64, "float32") == pytest.approx(want)
  # Beyond the measured range: the nearest shape's rate (no extrapolation).
  one = gemm_table.GemmTable([("float32", 64, 64, 64, 1e-6)])
  rate = gemm.gemm_flops(64, 64, 64) / 1e-6
  assert one.seconds(sizing.Gemm("g", 8192, 8192, 8192, 1), "float32") == pytest.approx(
      gemm.gemm_flops(8192, 8192, 8192) / rate)


def test_table_is_the_roofline_gemm_seconds_hook():
  # Every measured shape at 1 TFLOP/s: any interpolated shape runs at 1 TFLOP/s too, so each
  # model GEMM's training time (forward, dgrad, wgrad, x count) is 3 x its FLOPs / 1e12.
  rows = [(dtype, m, n, 64, gemm.gemm_flops(m, n, 64) / 1e12) for dtype in gemm.DTYPES
          for m in (64, 4096) for n in (64, 4096)]
  table = gemm_table.GemmTable(rows)
  cfg = build_group(ModelConfig, zaya1_tiny.get_config(), "model")
  est = roofline.estimate(cfg, accelerators.get_profile("mi300x"), num_devices=1, batch_size=2,
                          seq_len=64, dtype="bfloat16", gemm_seconds=table.seconds)
  assert len(est.gemms) == len(sizing.model_gemms(cfg, 128))
  for g, seconds in est.gemms:
    assert seconds == pytest.approx(3 * g.flops / 1e12)


def test_table_rejects_a_csv_without_the_columns(tmp_path):
  path = tmp_path / "bad.csv"
  path.write_text("kernel,seconds\ncopy,1.0\n")
  with pytest.raises(ValueError, match="missing columns"):
    gemm_table.GemmTable.from_csv(str(path))


@pytest.mark.slow
def test_cli_writes_csv_and_png(cli_runs):
  rc, output, out = cli_runs["smoke"]
  assert rc == 0, output[-3000:]
  assert "figures describe: cpu backend" in output
  assert "peak: measured" in output and "(measured: best matmul of this run (" in output
  with open(out / "bench_gemm.csv", newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == gemm.CSV_COLUMNS
    got = list(reader)
  cfg = build_group(ModelConfig, zaya1_tiny.get_config(), "model")
  n_model = len(gemm.model_shapes(cfg, 32))
  assert len(got) == 3 + 3 + 4 + n_model  # square 16 24 32; m 16 24 32; grid 2x2; model
  assert sum(r["kind"] == "model" for r in got) == n_model
  assert all(int(r["flops"]) == 2 * int(r["m"]) * int(r["n"]) * int(r["k"]) for r in got)
  assert (out / "bench_gemm.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("run, flag", [("dtypes", "--dtypes"), ("min_gt_max", "--min_size"),
                                       ("profile", "--profile")])
def test_cli_rejects_bad_flags(cli_runs, run, flag):
  rc, output, _ = cli_runs[run]
  assert rc != 0
  assert flag in output, output[-2000:]
