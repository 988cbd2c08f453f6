"""The per-step load-balance floor of a causal rule, on a frozen checkpoint.

  python -m launch.balance_floor --workdir=/tmp/zaya_tiny --batches=64

Reads the run's checkpoint and its own training batches, and prints the median worst-layer
max/mean expert load per step under the exact solve of the previous batch (the "oracle"
floor), the default histogram rule run over the same frozen batches, and the stored biases;
and the share of routings the rule's update moves to another class per batch (churn).
Logic: `zaya_jax.perf.balance_floor`.
"""

import json
import sys

from absl import app, flags

from zaya_jax.checkpoint import find_run_checkpoint
from zaya_jax.config import ConfigError
from zaya_jax.logs import quiet_third_party
from zaya_jax.perf.balance_floor import balance_floor
from zaya_jax.train.evaluate import run_config_of

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (holding checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
_BATCHES = flags.DEFINE_integer("batches", 64, "Training batches to route (>= 2).", lower_bound=2)
_SKIP = flags.DEFINE_integer("skip_batches", 0, "Training batches to skip first.", lower_bound=0)
_OUT = flags.DEFINE_string("out", None, "Write the per-step figures to this JSON file.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    ckpt_dir, step, saved = find_run_checkpoint(_WORKDIR.value, _STEP.value)
    r = balance_floor(run_config_of(saved), ckpt_dir, step, _BATCHES.value, _SKIP.value)
  except (ConfigError, ValueError) as e:
    sys.exit(f"launch.balance_floor: {str(e).splitlines()[0]}")
  print(f"{ckpt_dir}/{step}, {_BATCHES.value} training batches: median worst-layer max/mean "
        f"per step: oracle (exact solve of the previous batch) {r['median_oracle']:.3f} | "
        f"histogram rule {r['median_histogram']:.3f} | stored biases {r['median_stored']:.3f}; "
        f"the rule's update moves {100 * r['median_churn']:.2f}% of a batch's (token, layer) "
        "routings to another class (median)")
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(r, f)


def run_main():
  """Console script `zaya-balance-floor` (pyproject.toml): as `python -m launch.balance_floor`."""
  app.run(main)


if __name__ == "__main__":
  run_main()
