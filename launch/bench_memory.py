"""Memory bandwidth of this machine in the STREAM sense: copy, scale, add, triad over sizes.

  python -m launch.bench_memory --out=/tmp/mem                  # 16 KiB .. 256 MiB per array
  python -m launch.bench_memory --max_kib=4194304 --out=/tmp/mem_gpu   # up to 4 GiB on a GPU

Array sizes are powers of two from `--min_kib` to `--max_kib` KiB per array, so they cross the
caches. GB/s use STREAM's byte counting (copy and scale move 2 arrays, add and triad 3); each
result is checked against NumPy. Figures are compared with `--profile`'s HBM bandwidth (default:
the detected accelerator's; a CPU has none, and the output says the figures describe this
host). Writes OUT/bench_memory.csv and OUT/bench_memory.png; exits 1 if a result was wrong.
All logic lives in `zaya_jax.perf.memory`.
"""

import sys

from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.parallel import accelerators
from zaya_jax.perf import memory
from pallas_kernels.timing import host_description
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_KERNELS = flags.DEFINE_list("kernels", list(memory.KERNELS), f"Any of {memory.KERNELS}.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", memory.DTYPES, "Element dtype.")
_MIN = flags.DEFINE_integer("min_kib", 16, "Smallest array, KiB (rounded up to a power of two).")
_MAX = flags.DEFINE_integer("max_kib", 262144, "Largest array, KiB (256 MiB by default).")
_PROFILE = flags.DEFINE_string("profile", None, f"Profile, one of {sorted(accelerators.PROFILES)}"
                               "; default: detected (none on CPU).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per kernel and size (median).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls per kernel and size.")
_OUT = flags.DEFINE_string("out", None, "Folder for bench_memory.csv and bench_memory.png.")
flags.mark_flag_as_required("out")

flags.register_validator("kernels", lambda v: bool(v) and set(v) <= set(memory.KERNELS),
                         f"must be a non-empty subset of {memory.KERNELS}")
flags.register_validator("min_kib", lambda v: v >= 1, "must be >= 1")
flags.register_validator("repeats", lambda v: v >= 1, "must be >= 1")
flags.register_validator("profile", lambda v: v is None or v.lower() in accelerators.PROFILES,
                         f"must be one of {sorted(accelerators.PROFILES)}")
flags.register_multi_flags_validator(["min_kib", "max_kib"], lambda f: f["min_kib"] <= f["max_kib"],
                                     "--min_kib must be <= --max_kib")


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  itemsize = 4 if _DTYPE.value == "float32" else 2
  try:
    sizes = memory.array_sizes(_MIN.value * 1024, _MAX.value * 1024, itemsize)
  except ValueError as e:
    sys.exit(f"invalid arguments: {e}")
  profile = accelerators.resolve_profile(_PROFILE.value)
  note = f"figures describe: {host_description()}"
  print(note, flush=True)
  results = memory.run_stream(_KERNELS.value, sizes, _DTYPE.value, repeats=_REPEATS.value,
                              warmup=_WARMUP.value, profile=profile)
  wrong = memory.write_report(results, _OUT.value, note, profile)
  if wrong:
    sys.exit(wrong)


def run_main():
  """Console script `zaya-bench-memory` (pyproject.toml): the same as `python -m launch.bench_memory`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
