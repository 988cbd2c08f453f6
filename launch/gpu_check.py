"""The GPU acceptance run: kernels vs references, Pallas vs XLA timings, a 2-layer train step.

  python -m launch.gpu_check [--out=DIR] [--skip=timings,train_step]

On one GPU (ROCm or CUDA; under 5 minutes): each Pallas kernel (routing, gmm, CCA attention)
compiled for the local GPU against its jnp reference on values and gradients (float32 and
bfloat16); Pallas vs XLA timings at ZAYA1-base per-device shapes (attention fwd+bwd T=4096,
GQA 8/2, H=128; gmm at 16 experts x 256 rows, D=F=2048, against `jax.lax.ragged_dot`;
routing of 4096 tokens); one bfloat16 train step of ZAYA1-base's widths at 2 layers with the
kernels on and off (tokens/s, MFU against the detected accelerator's peak). On a CPU it runs
the kernels in Pallas interpret mode, the timings and the train step at tiny shapes, and
lists what it skipped and why. Prints tables; writes DIR/gpu_check.json. Exits 1 if a parity
check fails. All logic lives in `zaya_jax.perf.gpu_check`.
"""

import json
import os
import sys

from absl import app, flags

from configs import zaya1_base, zaya1_tiny
from zaya_jax.config import ConfigError, cli_paths, synthetic_configs
from zaya_jax.logs import quiet_third_party
from zaya_jax.perf import gpu_check
from zaya_jax.perf.benchmark import BenchConfigs

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_OUT = flags.DEFINE_string("out", "/tmp/gpu_check", "Folder for gpu_check.json.")
_SKIP = flags.DEFINE_list("skip", [], "Sections not to run: parity, timings, train_step.")


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  try:
    base = BenchConfigs(*synthetic_configs(zaya1_base.get_config()))
    tiny = BenchConfigs(*synthetic_configs(zaya1_tiny.get_config()))
    gpu_check.check_skip(tuple(_SKIP.value))
  except (ConfigError, ValueError) as e:
    sys.exit(f"invalid arguments: {e}")
  result = gpu_check.run_all(base, tiny, skip=tuple(_SKIP.value))
  print(gpu_check.format_report(result))
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, "gpu_check.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result.as_dict(), f, indent=1)
  print(f"\nwrote {path}")
  if not result.ok:
    sys.exit(1)


def run_main():
  """Console script `zaya-gpu-check` (pyproject.toml): the same as `python -m launch.gpu_check`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
