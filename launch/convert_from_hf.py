"""Import a Hugging Face `ZayaForCausalLM` directory as step 0 of a training run.

  python -m launch.convert_from_hf --hf_dir=HF_DIR --workdir=DIR --config=configs/zaya1_tiny.py
  python -m launch.train --workdir=DIR --config=configs/zaya1_tiny.py   # resumes from it

The `--config` (with the same `--config.*` overrides as launch.train) is the training config
to pair with: its model group must describe the same architecture as HF_DIR/config.json (an
error names the differing fields; compute-only fields and skip_mode are free). Writes a step-0
checkpoint in the training layout: the HF parameters and balancing biases, fresh optimizer
moments, the run's seed, a fresh data iterator, and the resolved config. Run it as a single
process, then resume with the same process count (the data iterator position is per process).

Memory: about twice the float32 parameter bytes (`zaya_jax.convert.runs.import_to_run`);
tests/convert/measure_import_memory.py measures it on a 0.3 GB model. Bad input (no such
--hf_dir, a config.json or checkpoint that does not fit the config, a --workdir that already
holds a checkpoint) exits non-zero with one line naming the problem.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from zaya_jax.config import ConfigError, resolve
from zaya_jax.convert import ConvertError, runs
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config to pair with, e.g. configs/zaya1_tiny.py.", lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Local transformers save_pretrained directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "New run directory (must hold no checkpoint).")
flags.mark_flags_as_required(["config", "hf_dir", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = resolve(_CONFIG.value)
  except ConfigError as e:
    sys.exit(f"invalid config: {e}")
  try:
    ckpt_dir = runs.import_to_run(cfg, _HF_DIR.value, _WORKDIR.value)
  except ConvertError as e:
    sys.exit(str(e))
  print(f"wrote {ckpt_dir}/0; resume with: python -m launch.train --workdir={_WORKDIR.value} "
        "--config=<the same config and overrides>")


def run_main():
  """Console script `zaya-convert-from-hf` (pyproject.toml): the same as `python -m launch.convert_from_hf`."""
  app.run(main)


if __name__ == "__main__":
  run_main()
