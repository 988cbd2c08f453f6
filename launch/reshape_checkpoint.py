"""Inspect a training checkpoint, or write a smaller copy of it for evaluation and export.

  python -m launch.reshape_checkpoint --src=WORKDIR_OR_CHECKPOINT_DIR [--step=N] --summary
  python -m launch.reshape_checkpoint --src=/tmp/zaya_tiny --dst=/tmp/zaya_tiny_eval \
      --drop_optimizer --dtype=bfloat16

--summary prints every tensor (path, shape, dtype, sharding as saved, bytes), totals per item,
the step, train_meta, and whether the checksums verify. --dst writes DST/checkpoints/<step>:
the same step with the optimizer state dropped (--drop_optimizer) and/or the parameters cast
(--dtype), fresh checksums, the config (recording the change) and the data iterator position,
then re-reads it and checks every expert's weights against the (cast) source. The source is
never modified, and an existing DST checkpoint is never overwritten.

A copy without optimizer state is for evaluation and `launch.convert_to_hf --workdir=DST`;
`launch.train` refuses to resume it. Logic: zaya_jax/checkpoint/reshape.py.
"""

import sys

from absl import app, flags

from zaya_jax.checkpoint import reshape
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_SRC = flags.DEFINE_string("src", None, "Training workdir, its checkpoints/ dir, or a step dir.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_DST = flags.DEFINE_string("dst", None, "New workdir to write the reshaped checkpoint into.")
_DROP_OPTIMIZER = flags.DEFINE_bool("drop_optimizer", False,
                                    "Leave out the optimizer state (the copy cannot resume training).")
_DTYPE = flags.DEFINE_enum("dtype", None, list(reshape.DTYPES),
                           "Cast the parameters to this dtype (default: keep the saved dtypes).")
_SUMMARY = flags.DEFINE_bool("summary", False, "Print what the source checkpoint holds.")
flags.mark_flags_as_required(["src"])


def main(argv):
  if not _SUMMARY.value and _DST.value is None:
    sys.exit("launch.reshape_checkpoint: nothing to do: pass --summary and/or --dst=NEW_WORKDIR")
  if _DST.value is None and (_DROP_OPTIMIZER.value or _DTYPE.value):
    sys.exit("launch.reshape_checkpoint: --drop_optimizer and --dtype need --dst=NEW_WORKDIR")
  if _DST.value is not None and (problem := cli_paths.unwritable_dir_problem(_DST.value, "--dst")):
    sys.exit(f"launch.reshape_checkpoint: {problem}")
  try:
    if _SUMMARY.value:
      print(reshape.summarize(_SRC.value, _STEP.value))
    if _DST.value is not None:
      for line in reshape.reshape(_SRC.value, _DST.value, step=_STEP.value,
                                  drop_optimizer=_DROP_OPTIMIZER.value, dtype=_DTYPE.value):
        print(line)
  except ValueError as e:  # bad paths, an existing --dst, a corrupt source: one message
    sys.exit(f"reshape_checkpoint: {e}")
  except OSError as e:  # --dst cannot be created though the up-front check passed
    sys.exit(f"reshape_checkpoint: --dst={_DST.value}: cannot write there: "
             f"{e.strerror or e}; pass a directory you can write to")


def run_main():
  """Console script `zaya-reshape-checkpoint` (pyproject.toml): the same as `python -m launch.reshape_checkpoint`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
