"""GEMM throughput vs matrix dimensions on this machine (the paper's kernel-sizing benchmarks).

  python -m launch.bench_gemm --out=/tmp/gemm                      # small CPU sweep, 64..1024
  python -m launch.bench_gemm --config=configs/zaya1_base.py --tokens=4096 \
      --min_size=128 --max_size=16384 --base_size=4096 --out=/tmp/gemm_gpu   # on a GPU

Sweeps (`--sweeps`): `square` M = N = K = s; `m`, `n`, `k` vary one dimension with the other
two at `--base_size`; `grid` M x N over powers of two at K = `--base_size` (heat map). Sizes are
the powers of two in [--min_size, --max_size] and their neighbours p + o, o in `--offsets`
(default +-64; add -1,1 to see misaligned shapes). `--config` adds the model's own GEMMs
(forward and backward) at `--tokens` tokens per device. Each shape is timed in every
`--dtypes` dtype; TFLOP/s are compared with `--profile`'s peak (default: the detected
accelerator's; on CPU the best square matmul of the same run, which the output says), and
shapes below `--low_fraction` of the dtype's best are marked `*`. Writes OUT/bench_gemm.csv
(readable by `zaya_jax.perf.gemm_table.GemmTable.from_csv`, the sizing command's `--gemm_table`)
and OUT/bench_gemm.png. All logic lives in `zaya_jax.perf.gemm`.
"""

import sys

from absl import app, flags

from zaya_jax.config import build_group
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel import accelerators
from zaya_jax.perf import gemm
from pallas_kernels.timing import host_description
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Config whose model GEMMs to add, e.g. configs/zaya1_base.py.",
    lock_config=True)
_TOKENS = flags.DEFINE_integer("tokens", 4096, "Tokens per device (M) of the model's GEMMs.",
                               lower_bound=1)
_EP = flags.DEFINE_integer("expert_parallel", 1, "Size of the expert mesh axis (rows per expert).",
                           lower_bound=1)
_DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Dtypes: bfloat16, float32.")
_SWEEPS = flags.DEFINE_list("sweeps", list(gemm.SWEEPS), f"Sweeps, any of {gemm.SWEEPS}.")
_MIN = flags.DEFINE_integer("min_size", 64, "Smallest swept dimension.", lower_bound=1)
_MAX = flags.DEFINE_integer("max_size", 1024, "Largest swept dimension.", lower_bound=1)
_BASE = flags.DEFINE_integer("base_size", 512, "Fixed dimensions of the m/n/k lines; grid K.",
                             lower_bound=1)
_OFFSETS = flags.DEFINE_list("offsets", ["-64", "64"], "Neighbours p + o of each power of two.")
_PROFILE = flags.DEFINE_string("profile", None, f"Peak profile, one of {sorted(accelerators.PROFILES)}"
                               "; default: detected (none on CPU: measured peak).")
_LOW = flags.DEFINE_float("low_fraction", 0.5, "Mark shapes below this fraction of the best.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per shape (median).", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls per shape (the first compiles).",
                               lower_bound=0)
_OUT = flags.DEFINE_string("out", None, "Folder for bench_gemm.csv and bench_gemm.png.")
flags.mark_flag_as_required("out")

flags.register_validator("dtypes", lambda v: _valid(gemm.parse_dtypes, v),
                         f"must name dtypes among {gemm.DTYPES}")
flags.register_validator("sweeps", lambda v: bool(v) and set(v) <= set(gemm.SWEEPS),
                         f"must be a non-empty subset of {gemm.SWEEPS}")
flags.register_validator("offsets", lambda v: all(o.lstrip("-").isdigit() for o in v),
                         "must be integers")
flags.register_validator("min_size", lambda v: v >= 1, "must be >= 1")
flags.register_validator("tokens", lambda v: v >= 1, "must be >= 1")
flags.register_validator("repeats", lambda v: v >= 1, "must be >= 1")
flags.register_validator("low_fraction", lambda v: 0 < v <= 1, "must be in (0, 1]")
flags.register_validator("profile", lambda v: v is None or v.lower() in accelerators.PROFILES,
                         f"must be one of {sorted(accelerators.PROFILES)}")
flags.register_multi_flags_validator(
    ["min_size", "max_size"], lambda f: f["min_size"] <= f["max_size"],
    "--min_size must be <= --max_size")


def _valid(parse, value) -> bool:
  try:
    parse(value)
  except ValueError:
    return False
  return True


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  try:
    sizes = gemm.sweep_sizes(_MIN.value, _MAX.value, [int(o) for o in _OFFSETS.value])
    grid = gemm.powers_of_two(_MIN.value, _MAX.value)
    shapes = gemm.sweep_shapes(_SWEEPS.value, sizes, grid, _BASE.value)
    if _CONFIG.value is not None:
      model_cfg = build_group(ModelConfig, _CONFIG.value, "model")
      shapes += gemm.model_shapes(model_cfg, _TOKENS.value, _EP.value)
  except ValueError as e:
    sys.exit(f"invalid arguments: {e}")
  profile = accelerators.resolve_profile(_PROFILE.value)
  note = f"figures describe: {host_description()}"
  print(note, flush=True)
  print(f"{len(shapes)} shapes x {len(_DTYPES.value)} dtypes; peak: "
        f"{profile.name if profile else 'measured (best square matmul of this run)'}", flush=True)
  results = gemm.run_sweep(shapes, gemm.parse_dtypes(_DTYPES.value), repeats=_REPEATS.value,
                           warmup=_WARMUP.value, profile=profile, low_fraction=_LOW.value)
  gemm.write_report(results, _OUT.value, note, _LOW.value)


def run_main():
  """Console script `zaya-bench-gemm` (pyproject.toml): the same as `python -m launch.bench_gemm`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
