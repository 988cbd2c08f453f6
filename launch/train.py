"""Train ZAYA1: `python -m launch.train --config=configs/zaya1_tiny.py --workdir=DIR`.

Override any config field from the command line (a misspelt field is an error):
  --config.train.lr=1e-3 --config.model.num_layers=2 \
  --config.model.layer_types="('hybrid','hybrid_sliding')"
Running the same command again resumes from the newest checkpoint in DIR/checkpoints.
Intentionally short: all logic lives in `zaya_jax.train.run`.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from zaya_jax.config import ConfigError
from zaya_jax.train import run

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file, e.g. configs/zaya1_tiny.py.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints and metrics.jsonl; rerun to resume.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Multi-host (jax.distributed.initialize) and the device mesh arrive with sharding support.
  logging.info("config:\n%s", _CONFIG.value)
  try:
    run(_CONFIG.value, _WORKDIR.value)
  except ConfigError as e:  # A user error: print the field and the fix, no traceback.
    sys.exit(f"invalid config: {e}")


if __name__ == "__main__":
  app.run(main)
