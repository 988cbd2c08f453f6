"""STREAM kernels: byte accounting, sizes, results against NumPy, and the `launch.bench_memory`
CLI on tiny sizes. No timing is asserted (the host is shared)."""

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.parallel import accelerators
from zaya_jax.perf import memory
from tests.perf.cli import run_concurrently

CLI_RUNS = {
    "smoke": ["--min_kib=1", "--max_kib=4", "--repeats=1", "--warmup=1"],
    "kernels": ["--kernels=memset"],
    "min_gt_max": ["--min_kib=64", "--max_kib=4"],
    "dtype": ["--dtype=int4"],
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  """`launch.bench_memory` once per CLI_RUNS entry: name -> (return code, output, OUT folder)."""
  return run_concurrently("launch.bench_memory", CLI_RUNS, tmp_path_factory.mktemp("bench_memory"))


def test_stream_byte_counting():
  assert memory.stream_bytes("copy", 1000, 4) == 8000  # read a, write b
  assert memory.stream_bytes("scale", 1000, 4) == 8000
  assert memory.stream_bytes("add", 1000, 4) == 12000  # read a, b, write c
  assert memory.stream_bytes("triad", 1000, 2) == 6000
  with pytest.raises(ValueError, match="kernels: 'memset'"):
    memory.stream_bytes("memset", 1, 4)


def test_array_sizes_are_powers_of_two():
  assert memory.array_sizes(1024, 8192, 4) == [1024, 2048, 4096, 8192]
  assert memory.array_sizes(1000, 5000, 4) == [1024, 2048, 4096]
  with pytest.raises(ValueError, match="min_bytes=8192 > max_bytes=1024"):
    memory.array_sizes(8192, 1024, 4)
  with pytest.raises(ValueError, match="itemsize"):
    memory.array_sizes(2, 1024, 4)


@pytest.mark.parametrize("kernel", memory.KERNELS)
def test_kernels_match_numpy_and_write_in_place(kernel):
  rng = np.random.default_rng(0)
  host = [rng.random(100, np.float32) for _ in range(3)]
  arrays = [jax.device_put(x) for x in host]
  before = list(arrays)
  call = memory.in_place(kernel, arrays, jnp.float32(3.0))
  got = call()
  a, b, c = host
  want = {"copy": a, "scale": 3 * a, "add": a + b, "triad": b + 3 * c}[kernel]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  np.testing.assert_allclose(memory.reference(kernel, *host, 3.0), want, rtol=1e-6)
  for i, (now, then) in enumerate(zip(arrays, before)):
    if i == memory.DEST[kernel]:  # donated: the result took its place
      assert now is got and then.is_deleted()
    else:
      assert now is then and not then.is_deleted()


@pytest.mark.parametrize("dtype", memory.DTYPES)
def test_run_stream_accounts_bytes_and_checks_results(dtype):
  h100 = accelerators.get_profile("h100")
  rows = memory.run_stream(memory.KERNELS, [1024, 4096], dtype, repeats=1, warmup=1,
                           profile=h100, log=lambda _: None)
  itemsize = 4 if dtype == "float32" else 2
  assert [(r.array_bytes, r.kernel) for r in rows] == [
      (s, k) for s in (1024, 4096) for k in memory.KERNELS]
  for r in rows:
    assert r.correct and r.dtype == dtype
    assert r.elements == r.array_bytes // itemsize
    assert r.bytes_moved == memory.ARRAYS_MOVED[r.kernel] * r.array_bytes
    assert r.gb_per_s == pytest.approx(r.bytes_moved / r.seconds / 1e9)
    assert r.peak_gb_per_s == pytest.approx(3350.0)
  with pytest.raises(ValueError, match="dtype"):
    memory.run_stream(["copy"], [1024], "int8")


@pytest.mark.slow
def test_cli_writes_csv_and_png(cli_runs):
  rc, output, out = cli_runs["smoke"]
  assert rc == 0, output[-3000:]
  assert "figures describe: cpu backend" in output
  assert "no accelerator profile" in output
  with open(out / "bench_memory.csv", newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == memory.CSV_COLUMNS
    got = list(reader)
  assert len(got) == 3 * 4  # 1, 2, 4 KiB x 4 kernels
  assert all(r["correct"] == "1" and r["peak_gb_per_s"] == "" for r in got)
  assert {int(r["array_bytes"]) for r in got} == {1024, 2048, 4096}
  assert (out / "bench_memory.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("run, flag", [("kernels", "--kernels"), ("min_gt_max", "--min_kib"),
                                       ("dtype", "--dtype")])
def test_cli_rejects_bad_flags(cli_runs, run, flag):
  rc, output, _ = cli_runs[run]
  assert rc != 0
  assert flag in output, output[-2000:]
