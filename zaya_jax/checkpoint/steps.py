"""Offline step resolution: which complete steps a checkpoint directory holds, and which one a
tool reads (the requested one, or the latest). Shared by the offline tools
(`launch.convert_to_hf`, `launch.generate`: `find_run_checkpoint`) and the reshape tool
(`zaya_jax.checkpoint.reshape.resolve_source`); each phrases its own refusals.
"""

from __future__ import annotations

import os
from typing import Any

from zaya_jax.checkpoint.manager import open_manager, saved_config


def select_step(directory: str, step: int | None) -> tuple[int | None, list[int]]:
  """`(the step to read, every complete step held, oldest first)` of a checkpoint directory.

  The step to read is `step` if the directory holds it, the latest one if `step` is None, and
  None if the directory holds no checkpoint or not `step`. Orbax's unfinished
  `<step>.orbax-checkpoint-tmp` directories are not steps. Opens `directory` read-only.
  """
  manager = open_manager(directory, read_only=True)
  try:
    steps = sorted(manager.all_steps())
  finally:
    manager.close()
  if step is None:
    return (steps[-1] if steps else None), steps
  return (step if step in steps else None), steps


def find_run_checkpoint(workdir: str, step: int | None) -> tuple[str, int, dict[str, Any]]:
  """`(checkpoints directory, step, saved RunConfig dict)` of a training run's checkpoint.

  For the offline tools (`launch.convert_to_hf`, `launch.generate`).

  Args:
    workdir: the training run directory (holding `checkpoints/`).
    step: the requested step, or None for the latest.

  Raises:
    ValueError: no such directory, no checkpoint, no such step (listing the steps held), or
      an unreadable config; one line naming the path and the fix.
  """
  if not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir}: " + ("a file, not a directory; pass a training run's "
                                                 "--workdir" if os.path.exists(workdir)
                                                 else "no such directory"))
  ckpt_dir = os.path.abspath(os.path.join(workdir, "checkpoints"))
  if not os.path.isdir(ckpt_dir):
    raise ValueError(f"no checkpoint in {workdir}: {ckpt_dir} does not exist (is it a training "
                     "run's --workdir?)")
  chosen, steps = select_step(ckpt_dir, step)
  if not steps:
    raise ValueError(f"no checkpoint in {ckpt_dir}; train first (python -m launch.train ...)")
  if chosen is None:
    raise ValueError(f"--step={step}: no such checkpoint in {ckpt_dir}; it holds steps {steps}")
  manager = open_manager(ckpt_dir, read_only=True)
  try:
    saved = saved_config(manager, chosen)
  except Exception as e:  # Orbax raises several types for missing/corrupt items
    raise ValueError(f"cannot read the config of checkpoint {ckpt_dir}/{chosen}: {e}") from e
  finally:
    manager.close()
  return ckpt_dir, chosen, saved
