"""Collective micro-benchmarks: nccl-tests formulas, the correctness check, the CLI.

Multi-device checks need 8 fake CPU devices, which JAX only gives a process that asks before
its backend starts: `device_checks` runs in the second pytest run (`multidevice`, 8 devices);
the CLI runs as `python -m launch.bench_collectives`, once on 8 devices and once as
2 processes x 4 devices over a coordinator on 127.0.0.1.

Covered: busbw / algbw factors and GB/s values; size conventions and rounding; the numpy
reference (all-gather / all-to-all chunk order, reduce-scatter = chunk of all-reduce); exact
sums in bfloat16; every collective correct on a (1,1,8) row and over the tuple of axes
(fsdp, expert) of a (2,2,2) mesh (groups of 4, two groups at once); wrong collectives (off
by one, wrong order, no exchange, wrong source) flagged; the CLI's CSV columns, row count
and PNG; bad flags exit non-zero naming the flag; two processes agree and only process 0
writes.
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from zaya_jax.config.mesh import MeshConfig
from zaya_jax.perf import collectives as C, nccl
from tests.helpers import subprocess_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 180
TINY = ["--min_bytes=4096", "--max_bytes=8192", "--repeats=2", "--warmup=1"]


def env(devices: int) -> dict[str, str]:
  """This environment with `devices` fake CPU devices and no cluster variables."""
  e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
  e.update({"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": subprocess_xla_flags(devices),
            "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)})
  return e


def cli(*args: str, devices: int = 8) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.bench_collectives", *args], cwd=REPO,
                        env=env(devices), capture_output=True, text=True, timeout=TIMEOUT_S)


# --------------------------------------------------------------------------------------------
# Pure functions: no devices.
# --------------------------------------------------------------------------------------------


def test_bus_factors_follow_nccl_tests():
  assert nccl.bus_factor("all_reduce", 8) == pytest.approx(1.75)
  assert nccl.bus_factor("all_reduce", 2) == pytest.approx(1.0)
  for name in ("reduce_scatter", "all_gather", "all_to_all"):
    assert nccl.bus_factor(name, 4) == pytest.approx(0.75)
    assert nccl.bus_factor(name, 8) == pytest.approx(0.875)
  assert nccl.bus_factor("broadcast", 8) == 1.0
  with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
    nccl.bus_factor("allreduce", 8)


def test_bandwidths_in_gb_per_s():
  algbw, busbw = nccl.bandwidths("all_reduce", 8, 2 * 10**9, 0.5)  # 2 GB in 0.5 s
  assert (algbw, busbw) == pytest.approx((4.0, 7.0))
  algbw, busbw = nccl.bandwidths("all_gather", 4, 16 * 2**20, 1e-3)
  assert algbw == pytest.approx(16.777216)
  assert busbw == pytest.approx(16.777216 * 0.75)
  assert nccl.bandwidths("broadcast", 4, 10**6, 1e-3) == pytest.approx((1.0, 1.0))


def test_sizes_and_buffers():
  assert nccl.message_sizes(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
  assert nccl.message_sizes(4096, 65535) == [4096, 8192, 16384, 32768]
  assert nccl.element_count(4096, 4, 8) == 1024
  assert nccl.element_count(4096, 4, 6) == 1020  # rounded down so 6 devices split it evenly
  assert nccl.buffer_lengths("reduce_scatter", 1024, 8) == (1024, 128)  # size = full input
  assert nccl.buffer_lengths("all_gather", 1024, 8) == (128, 1024)  # size = full output
  assert nccl.buffer_lengths("all_to_all", 1024, 8) == (1024, 1024)


def test_reference_semantics():
  members, L, B = [5, 2, 7, 0], 8, 48
  x = {m: nccl.input_block(m, L, B) for m in members}
  assert len({tuple(v) for v in x.values()}) == 4  # device-dependent inputs
  total = sum(x.values())
  np.testing.assert_array_equal(nccl.expected_block("all_reduce", members, 1, L, B), total)
  np.testing.assert_array_equal(nccl.expected_block("reduce_scatter", members, 3, L, B), total[6:8])
  np.testing.assert_array_equal(nccl.expected_block("broadcast", members, 2, L, B), x[5])
  ag = nccl.expected_block("all_gather", members, 0, 2, B)
  np.testing.assert_array_equal(ag, np.concatenate([x[m][:2] for m in members]))
  a2a = nccl.expected_block("all_to_all", members, 1, L, B)  # chunk 1 of everyone, in rank order
  np.testing.assert_array_equal(a2a, np.concatenate([x[m][2:4] for m in members]))


def test_inputs_sum_exactly_in_low_precision():
  for dtype, n in (("bfloat16", 8), ("bfloat16", 64), ("float16", 256), ("float32", 1024)):
    bound = nccl.value_bound("all_reduce", dtype, n)
    assert bound >= 1 and n * bound < 2 ** nccl.MANTISSA_BITS[dtype], (dtype, n, bound)
  assert nccl.value_bound("all_gather", "bfloat16", 64) == nccl.MAX_BOUND  # no arithmetic


def test_validate_names_the_flag():
  ok = dict(min_bytes=4096, max_bytes=8192, repeats=2, warmup=1, dtype="float32")
  C.validate(["all_reduce"], **ok)
  with pytest.raises(ValueError, match="--collectives: unknown allgather"):
    C.validate(["all_reduce", "allgather"], **ok)
  with pytest.raises(ValueError, match="--min_bytes=9000 is larger than --max_bytes=8192"):
    C.validate(["all_reduce"], **{**ok, "min_bytes": 9000})
  with pytest.raises(ValueError, match="--dtype=float64"):
    C.validate(["all_reduce"], **{**ok, "dtype": "float64"})
  with pytest.raises(ValueError, match="--repeats=0"):
    C.validate(["all_reduce"], **{**ok, "repeats": 0})


def test_wrong_rows_are_reported():
  row = dict(collective="all_gather", n=8, mesh="1,1,8", size_bytes=4096, correct=True,
             max_abs_err=0.0)
  assert C.wrong_results([row]) is None
  msg = C.wrong_results([row, {**row, "correct": False, "max_abs_err": 3.0}])
  assert msg.startswith("WRONG RESULTS in 1 of 2 rows") and "all_gather n=8" in msg


# --------------------------------------------------------------------------------------------
# On 8 fake CPU devices (`multidevice`: the second pytest run).
# --------------------------------------------------------------------------------------------


def device_checks() -> dict[str, list]:
  """On 8 devices: `{case: [correct, max |err|, lowering, group size]}`."""
  assert jax.device_count() == 8, jax.devices()
  out = {}

  def run(name, collective, group, op=None, dtype="float32", size=4096):
    r = C.measure(collective, group, size, dtype, repeats=1, warmup=0, op=op)
    out[name] = [bool(r["correct"]), r["max_abs_err"], r["lowering"], r["n"]]

  row, cube = C.line_group(8), C.mesh_group(MeshConfig(2, 2, 2), ("fsdp", "expert"))
  for collective in nccl.COLLECTIVES:
    run(f"{collective}/row", collective, row)
    run(f"{collective}/cube", collective, cube, dtype="bfloat16")
  axes = cube.axes
  wrong = {
      "all_reduce": lambda v: jax.lax.psum(v, axes) + 1,
      "reduce_scatter": lambda v: jax.lax.psum_scatter(v[::-1], axes, scatter_dimension=0,
                                                       tiled=True),
      "all_gather": lambda v: jax.lax.all_gather(v, axes, tiled=True)[::-1],
      "all_to_all": lambda v: v,  # nothing exchanged
      "broadcast": lambda v: jax.lax.psum(
          jax.numpy.where(jax.lax.axis_index(axes) == 1, v, 0 * v), axes),  # from rank 1
  }
  for collective, op in wrong.items():
    run(f"{collective}/wrong", collective, cube, op=op)
  return out


@pytest.fixture(scope="module")
def checks():
  return device_checks()


@pytest.mark.multidevice
@pytest.mark.parametrize("collective", nccl.COLLECTIVES)
def test_collectives_are_correct(checks, collective):
  for where, n in (("row", 8), ("cube", 4)):
    correct, err, lowering, got_n = checks[f"{collective}/{where}"]
    assert correct and err == 0, (collective, where, err)
    assert got_n == n
    # XLA:CPU: the broadcast is a masked all-reduce (no pbroadcast lowering).
    want = "all-reduce" if collective == "broadcast" else collective.replace("_", "-")
    assert lowering == want, (collective, lowering)


@pytest.mark.multidevice
@pytest.mark.parametrize("collective", nccl.COLLECTIVES)
def test_wrong_results_are_flagged(checks, collective):
  correct, err, _, _ = checks[f"{collective}/wrong"]
  assert not correct and err > 0, (collective, err)


# --------------------------------------------------------------------------------------------
# The CLI.
# --------------------------------------------------------------------------------------------


def read_csv(path):
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    return reader.fieldnames, list(reader)


@pytest.mark.slow
def test_cli_writes_csv_and_png(tmp_path):
  proc = cli(f"--out={tmp_path}", "--num_devices=2,8", *TINY)
  assert proc.returncode == 0, proc.stderr[-6000:]
  assert "fake CPU devices share them" in proc.stdout  # says what the figures describe
  columns, rows = read_csv(tmp_path / "collectives.csv")
  assert tuple(columns) == C.CSV_COLUMNS
  assert len(rows) == len(nccl.COLLECTIVES) * 2 * 2  # collectives x device counts x sizes
  assert {r["n"] for r in rows} == {"2", "8"}
  assert {r["size_bytes"] for r in rows} == {"4096", "8192"}
  assert all(r["correct"] == "True" and float(r["busbw_GBps"]) > 0 for r in rows)
  for r in rows:
    algbw = int(r["size_bytes"]) / float(r["time_s"]) / 1e9
    assert float(r["algbw_GBps"]) == pytest.approx(algbw, rel=1e-6)
    assert float(r["busbw_GBps"]) == pytest.approx(
        algbw * nccl.bus_factor(r["collective"], int(r["n"])), rel=1e-6)
  assert (tmp_path / "collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, flag", [
    (["--collectives=all_reduce,allgather"], "--collectives"),
    (["--num_devices=3"], "--num_devices=3"),
])
@pytest.mark.slow
def test_bad_flags_exit_naming_the_flag(tmp_path, args, flag):
  """One flag checked before the backend starts, one after (the rest: `test_validate_*`)."""
  proc = cli(f"--out={tmp_path}", *args)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("invalid flags:") and flag in last, proc.stderr[-3000:]
  assert not (tmp_path / "collectives.csv").exists()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes(tmp_path):
  """2 processes x 4 devices: groups of 2 (one device per process) and 8; process 0 writes."""
  address = f"127.0.0.1:{free_port()}"
  procs = []
  for i in range(2):
    log = open(tmp_path / f"proc{i}.log", "w")  # a file: a full pipe would stall a peer
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "launch.bench_collectives", f"--out={tmp_path / f'out{i}'}",
         "--num_devices=2,8", "--min_bytes=4096", "--max_bytes=4096", "--repeats=2",
         "--warmup=1", f"--coordinator_address={address}", "--num_processes=2",
         f"--process_id={i}"], cwd=REPO, env=env(4), stdout=log, stderr=subprocess.STDOUT))
  try:
    codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  logs = [(tmp_path / f"proc{i}.log").read_text() for i in range(2)]
  assert codes == [0, 0], (logs[0][-3000:], logs[1][-3000:])
  assert "2 processes, 8 devices" in logs[0]
  _, rows = read_csv(tmp_path / "out0" / "collectives.csv")
  assert len(rows) == len(nccl.COLLECTIVES) * 2
  assert all(r["processes"] == "2" and r["correct"] == "True" for r in rows)
  assert not (tmp_path / "out1").exists()  # only process 0 writes
