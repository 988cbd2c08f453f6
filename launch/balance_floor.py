"""The per-step load-balance floor of a causal rule, on a frozen checkpoint.

  python -m launch.balance_floor --workdir=/tmp/zaya_tiny --batches=64

Reads the run's checkpoint and its own training batches, and prints the median worst-layer
max/mean expert load per step under the exact solve of the previous batch (the "oracle"
floor), the default histogram rule run over the same frozen batches, and the stored biases;
and the share of routings the rule's update moves to another class per batch (churn).

  python -m launch.balance_floor --workdir=/tmp/zaya_tiny --fit_batches=128 --test_batches=32 \
      --eval_batches=32

also gives the floor of the load at evaluation: per layer, the max/mean of one fixed bias
over whole token sets (training batches `fit` and `test` after the skipped ones, the first
`eval_batches` of the held-out split, as `launch.evaluate` reads them), for the stored biases
and for biases solved exactly on `fit`, and how close the eval routing is to ties (the router's
top probability, the best-minus-second biased score gap, the biases' spread, the share of
tokens whose gap is below one update of the rule).
Logic: `zaya_jax.perf.balance_floor`.
"""

import json
import sys

from absl import app, flags

from zaya_jax.checkpoint import find_run_checkpoint
from zaya_jax.config import ConfigError, cli_paths
from zaya_jax.logs import quiet_third_party
from zaya_jax.perf.balance_floor import balance_floor, fixed_bias_floor
from zaya_jax.train.evaluate import run_config_of

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (holding checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the latest.")
_BATCHES = flags.DEFINE_integer("batches", 64, "Training batches to route (>= 2).", lower_bound=2)
_SKIP = flags.DEFINE_integer("skip_batches", 0, "Training batches to skip first.", lower_bound=0)
_FIT = flags.DEFINE_integer("fit_batches", 0, "Training batches to solve one fixed bias on, for "
                            "the load-at-evaluation floor; 0 = not measured.", lower_bound=0)
_TEST = flags.DEFINE_integer("test_batches", 32, "Training batches after the fit ones to route "
                             "with it.", lower_bound=1)
_EVAL = flags.DEFINE_integer("eval_batches", 32, "Held-out batches to route with it.", lower_bound=1)
_WINDOW = flags.DEFINE_integer("window", 16, "Steps per block of the windowed figures (as "
                               "launch.balance_report --window); printed when --batches - 1 "
                               "covers one block.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Write the per-step figures to this JSON file.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if _OUT.value and (problem := cli_paths.unwritable_file_problem(_OUT.value, "--out")):
    sys.exit(f"invalid flags: {problem}")
  try:
    ckpt_dir, step, saved = find_run_checkpoint(_WORKDIR.value, _STEP.value)
    cfg = run_config_of(saved)
    r = balance_floor(cfg, ckpt_dir, step, _BATCHES.value, _SKIP.value, _WINDOW.value)
    if _FIT.value:
      r["fixed_bias"] = fixed_bias_floor(cfg, ckpt_dir, step, fit_batches=_FIT.value,
                                         test_batches=_TEST.value, eval_batches=_EVAL.value,
                                         skip_batches=_SKIP.value + _BATCHES.value,
                                         bias_step_L=r["bias_step"])
  except (ConfigError, ValueError) as e:
    sys.exit(f"launch.balance_floor: {str(e).splitlines()[0]}")
  scaled = (f" (x {r['rate']:.3g}: balance.rate_lr_power={cfg.balance.rate_lr_power:g} at step "
            f"{step})" if cfg.balance.rate_lr_power else "")
  print(f"{ckpt_dir}/{step}, {_BATCHES.value} training batches: median worst-layer max/mean "
        f"per step: oracle (exact solve of the previous batch) {r['median_oracle']:.3f} | "
        f"histogram rule {r['median_histogram']:.3f} | stored biases {r['median_stored']:.3f}; "
        f"the rule's update{scaled} moves {100 * r['median_churn']:.2f}% of a batch's (token, "
        "layer) routings to another class (median)")
  if "window_oracle" not in r:
    print(f"no windowed figures: --batches={_BATCHES.value} gives {_BATCHES.value - 1} steps, "
          f"fewer than --window={_WINDOW.value}")
  else:
    print(f"loads summed over {(_BATCHES.value - 1) // _WINDOW.value} blocks of "
          f"{_WINDOW.value} steps, median worst-layer max/mean: oracle "
          f"{r['window_oracle']:.3f} | histogram rule {r['window_histogram']:.3f} | stored "
          f"biases {r['window_stored']:.3f} (median lowest-layer H/ln E "
          f"{r['window_entropy_oracle']:.4f} / {r['window_entropy_histogram']:.4f} / "
          f"{r['window_entropy_stored']:.4f})")
  if _FIT.value:
    fit_at = _SKIP.value + _BATCHES.value
    sets = {"fit": f"training batches {fit_at + 1}-{fit_at + _FIT.value}",
            "test": f"training batches {fit_at + _FIT.value + 1}-{fit_at + _FIT.value + _TEST.value}",
            "eval": f"the first {_EVAL.value} held-out batches"}
    print("one fixed bias over whole token sets, per-layer max/mean expert load "
          "(fit / test / eval: " + "; ".join(f"{k} = {v}" for k, v in sets.items()) + "):")
    for name, label in (("stored", "stored biases"), ("solved_on_fit", "solved exactly on fit")):
      for s, loads in r["fixed_bias"][name].items():
        print(f"  {label:22s} on {s:4s}: " + " ".join(f"{x:.2f}" for x in loads))
    m = r["fixed_bias"]["margins"]
    print("how close the eval routing is to ties, per layer (stored biases):")
    for key, label, fmt in (("top_prob_median", "median top router probability", ".3f"),
                            ("gap_median", "median best - second-best biased score", ".4f"),
                            ("bias_spread", "std of the experts' biases", ".3f")):
      print(f"  {label:40s}: " + " ".join(f"{x:{fmt}}" for x in m[key]))
    print(f"  {'median |bias change| of one update':40s}: "
          + " ".join(f"{x:.4f}" for x in r["bias_step"]))
    print(f"  {'tokens whose gap is below that change':40s}: "
          + " ".join(f"{100 * x:.0f}%" for x in m["below_step_share"]))
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(r, f)


def run_main():
  """Console script `zaya-balance-floor` (pyproject.toml): as `python -m launch.balance_floor`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
