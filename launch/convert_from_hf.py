"""Import a Hugging Face `ZayaForCausalLM` directory as step 0 of a training run.

  python -m launch.convert_from_hf --hf_dir=HF_DIR --workdir=DIR [--config=configs/X.py]
  python -m launch.train --config=DIR/config.py --workdir=DIR   # trains on from it

The model config comes from HF_DIR/config.json, the checkpoint's architecture (as MaxText and
torchtitan do): one line lists the fields where `--config` (default configs/base.py) said
otherwise. `--config` and its `--config.*` overrides supply the training settings (train,
data, checkpoint, mesh, balance) and the compute-only model fields (dtype, remat, scan_layers,
*_impl, ...); an explicit `--config.model.*` override that disagrees with config.json is an
error naming every such field. The tokenizer is HF_DIR/tokenizer.json when there is one
(copied to DIR/tokenizer.json; `--config.data.tokenizer=...` overrides it), and the special
token ids are config.json's.

Writes DIR/checkpoints/0 in the training layout (the HF parameters and balancing biases, fresh
optimizer moments, the run's seed, a fresh data iterator, the resolved config) and
DIR/config.py, the full config to train with. Run it as a single process, then train with the
same process count (the data iterator position is per process).

Memory: about 2x the float32 parameter bytes are held when the checkpoint write starts
(the all-zero Adam moments share one zeros buffer; `zaya_jax.convert.runs.import_to_run`); with
the write's own buffers the peak is about 2.9x the float32 parameter bytes above start-up
(tests/convert/measure_import_memory.py measured 2.87x on a 0.29 GB model). Bad input (no such
--hf_dir, a checkpoint that does not fit config.json, a --workdir that already holds a
checkpoint) exits non-zero with one line naming the problem.
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from zaya_jax.convert import ConvertError, runs
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

BASE_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "base.py")
_CONFIG = cli_paths.define_config_file(
    "config", BASE_CONFIG, "Training settings (the model comes from HF_DIR/config.json); "
    "default configs/base.py.", lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Local transformers save_pretrained directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "New run directory (must hold no checkpoint).")
flags.mark_flags_as_required(["hf_dir", "workdir"])


def main(argv):
  explicit = config_flags.get_override_values(flags.FLAGS["config"])
  given = (config_flags.get_config_filename(flags.FLAGS["config"])
           if flags.FLAGS["config"].present else None)  # None: base.py's settings, said so
  try:
    run = runs.new_run_from_hf(_CONFIG.value, _HF_DIR.value, _WORKDIR.value, explicit,
                               config_source=given)
  except ConvertError as e:
    sys.exit(str(e))
  print(f"wrote {run.checkpoint_dir}/0 and {run.config_file}; train with: python -m "
        f"launch.train --config={run.config_file} --workdir={_WORKDIR.value}")


def run_main():
  """Console script `zaya-convert-from-hf` (pyproject.toml): the same as `python -m launch.convert_from_hf`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
