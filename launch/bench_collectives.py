"""Collective micro-benchmarks: busbw vs message size, nccl-tests style, every result checked.

  python -m launch.bench_collectives --out=/tmp/coll
  python -m launch.bench_collectives --out=/tmp/coll --collectives=all_reduce,all_to_all \
      --num_devices=2,4,8 --min_bytes=4096 --max_bytes=16777216 --repeats=20 --dtype=bfloat16
  python -m launch.bench_collectives --out=/tmp/coll --meshes="2,1,4;1,2,4" --axes=fsdp,expert

`--num_devices`: for each n, a row of n devices (mesh data=1, fsdp=1, expert=n) and the
collectives over it. `--meshes` (data,fsdp,expert; ';'-separated) instead runs them over
`--axes` of each mesh, the other axes forming concurrent groups. Sizes run from --min_bytes
to --max_bytes in powers of two (the nccl-tests "size" of each collective; see
`zaya_jax.perf.collectives`). On a CPU-only host the tool asks for `--num_cpu_devices` fake
devices when XLA_FLAGS sets none; the figures then characterise this host, which it prints.
Multi-process: as `launch.train` (--coordinator_address/--num_processes/--process_id, SLURM
or mpirun); only process 0 writes. Writes OUT/collectives.csv and OUT/collectives.png; exits
non-zero if any result is wrong. All logic lives in `zaya_jax.perf.collectives`.
"""

import sys

import jax
from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.parallel import distributed
from zaya_jax.parallel.mesh import use_cpu_devices
from pallas_kernels import timing
from zaya_jax.perf import collectives, nccl
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_OUT = flags.DEFINE_string("out", None, "Output folder for collectives.csv and collectives.png.")
_COLLECTIVES = flags.DEFINE_list("collectives", list(nccl.COLLECTIVES),
                                 f"Collectives to run, from {','.join(nccl.COLLECTIVES)}.")
_NUM_DEVICES = flags.DEFINE_list(
    "num_devices", None, "Group sizes n, each dividing the device count (default: 2, 4, ... "
    "powers of two up to all devices). Not with --meshes.")
_MESHES = flags.DEFINE_string("meshes", None, "Mesh shapes data,fsdp,expert separated by ';' "
                              "(collectives over --axes); instead of --num_devices.")
_AXES = flags.DEFINE_list("axes", ["expert"], "Mesh axes the collectives run over (with --meshes).")
_MIN_BYTES = flags.DEFINE_integer("min_bytes", 4096, "Smallest message, bytes.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 16 * 2**20, "Largest message, bytes.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per row (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed calls per row before the timed ones.")
_DTYPE = flags.DEFINE_string("dtype", "float32", f"Element type: {', '.join(collectives.DTYPES)}.")
_NUM_CPU = flags.DEFINE_integer("num_cpu_devices", 8, "Fake CPU devices when XLA_FLAGS sets none.",
                                lower_bound=1)
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank in [0, num_processes).")
flags.mark_flags_as_required(["out"])


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  try:  # Before any JAX computation: the backend must not exist yet.
    collectives.validate(_COLLECTIVES.value, _MIN_BYTES.value, _MAX_BYTES.value, _REPEATS.value,
                         _WARMUP.value, _DTYPE.value)
    use_cpu_devices(_NUM_CPU.value)
    distributed.maybe_initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    bench_groups = collectives.bench_groups(_MESHES.value, _AXES.value, _NUM_DEVICES.value)
    collectives.check_min_bytes(bench_groups, _MIN_BYTES.value, _DTYPE.value)
  except ValueError as e:
    sys.exit(f"invalid flags: {e}")
  lead = jax.process_index() == 0
  log = (lambda line: print(line, flush=True)) if lead else None
  note = timing.host_description()
  if lead:
    print(f"{distributed.describe()}\n{note}\n{collectives.format_table([])}", flush=True)
  sizes = nccl.message_sizes(_MIN_BYTES.value, _MAX_BYTES.value)
  rows = collectives.run_sweep(_COLLECTIVES.value, bench_groups, sizes, _DTYPE.value,
                               _REPEATS.value, _WARMUP.value, log=log)
  wrong = collectives.wrong_results(rows)
  if lead:
    collectives.write_report(rows, _OUT.value, f"bus bandwidth, {_DTYPE.value}, median of "
                             f"{_REPEATS.value}. {note}", note)
  if wrong:
    sys.exit(wrong)


def run_main():
  """Console script `zaya-bench-collectives` (pyproject.toml): the same as `python -m launch.bench_collectives`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
