"""Load-balance table of training runs: `python -m launch.balance_report --workdirs=A,B,...
[--first=200 --last=400 --window=16 --entropy_steps=100,200,400]`.

Each workdir is a `launch.train` run logged every step (`--config.train.log_every=1`); prints
one Markdown row per run (zaya_jax/perf/balance_report.py: per-layer median and worst
per-step max/mean expert load in the window, normalised load entropy at the given steps,
skip rate, router entropy, train and eval loss; the median worst-layer max/mean per step and
the windowed load over blocks of --window steps).
"""

import sys

from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.perf import balance_report
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Comma-separated launch.train workdirs.")
_FIRST = flags.DEFINE_integer("first", 200, "First step of the window (inclusive).", lower_bound=0)
_LAST = flags.DEFINE_integer("last", 400, "Last step of the window (inclusive).", lower_bound=0)
_WINDOW = flags.DEFINE_integer("window", 16, "Steps per block of the windowed load figures "
                               "(16 steps of 8 x 256 tokens = 32K tokens).", lower_bound=1)
_ENTROPY_STEPS = flags.DEFINE_list("entropy_steps", ["100", "200", "400"],
                                   "Steps at which the normalised load entropy is reported.")
flags.mark_flag_as_required("workdirs")
flags.register_multi_flags_validator(["first", "last"], lambda f: f["first"] <= f["last"],
                                     "--first must be <= --last (the window's first and last step)")


def main(argv):
  if not _WORKDIRS.value:
    sys.exit("invalid flags: --workdirs is empty; e.g. --workdirs=/tmp/run_a,/tmp/run_b")
  if bad := [s for s in _ENTROPY_STEPS.value if not s.strip().isdigit()]:
    sys.exit(f"invalid flags: --entropy_steps={','.join(_ENTROPY_STEPS.value)}: {bad[0]!r} is "
             "not a step number; e.g. --entropy_steps=100,200,400")
  try:
    steps = [int(s) for s in _ENTROPY_STEPS.value]
    rows = [balance_report.summarize(w, _FIRST.value, _LAST.value, steps, _WINDOW.value)
            for w in _WORKDIRS.value]
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"launch.balance_report: {e}")
  print(balance_report.markdown_table(rows, _FIRST.value, _LAST.value))


def run_main():
  """Console script `zaya-balance-report` (pyproject.toml): the same as `python -m launch.balance_report`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
