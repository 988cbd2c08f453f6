"""Plot a training run: `python -m launch.plot --workdir=DIR [--out=DIR/plots] [--window=20]`.

Reads DIR/metrics.jsonl (written by launch.train; not the TensorBoard event files) and writes
loss.png, expert_load.png and balance.png (`zaya_jax.perf.run_plots.make_plots` describes
them), and prints their paths. Works while the run is still training (it only reads).
"""

import sys

from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.perf import run_plots
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIR = flags.DEFINE_string("workdir", None, "The --workdir of a launch.train run.")
_OUT = flags.DEFINE_string("out", None, "Folder for the PNGs (default: WORKDIR/plots).")
_WINDOW = flags.DEFINE_integer("window", 20, "Train records averaged in expert_load.png.")
flags.mark_flag_as_required("workdir")


def main(argv):
  if _OUT.value and (problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out")):
    sys.exit(f"launch.plot: {problem}")
  try:
    paths = run_plots.make_plots(_WORKDIR.value, _OUT.value, _WINDOW.value)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f"launch.plot: {e}")
  for path in paths:
    print(path)


def run_main():
  """Console script `zaya-plot` (pyproject.toml): the same as `python -m launch.plot`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
