"""A run with loader worker processes (data.num_workers > 0) releases their shared memory
and stops them when it ends (issue 23 item 4: every such run, fresh or resumed, ended with
`resource_tracker: There appear to be 5 leaked shared_memory objects to clean up at shutdown`,
the last batch's five arrays). The resumed cases run through the CLI in
tests/train/test_resume.py (raw text) and tests/data/test_global_batches.py (prepared)."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
from absl import flags
from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

from tests.train.inproc import tiny_run_config
from zaya_jax.train import run


def _shared_memory_arrays() -> int:
  return sum(type(o) is SharedMemoryArray for o in gc.get_objects())  # type(): no __class__ call


@pytest.mark.slow
def test_a_run_with_loader_workers_leaves_no_shared_memory_or_worker(tmp_path):
  if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags
    flags.FLAGS.mark_as_parsed()
  config = tiny_run_config(num_steps=3, eval_batches=0)
  config.data.num_workers = 1
  before = set(multiprocessing.active_children())
  assert _shared_memory_arrays() == 0
  run(config, str(tmp_path))
  # No gc.collect(): at interpreter exit the cycle holding the last batch was never collected.
  assert _shared_memory_arrays() == 0
  assert set(multiprocessing.active_children()) <= before  # the loader worker was stopped
