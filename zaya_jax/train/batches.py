# Shape letters: B T (see zaya_jax/__init__.py).
"""The training loop's side of the data iterator: batches in, global arrays out, errors named.

`next_batch` reads this process's numpy batch (an error of the iterator becomes `DataError`,
so the loop can tell the data's errors from training's), `global_batch` makes the global
`[B, T]` arrays of it, and `close_data` ends an iterator's worker processes.
"""

from __future__ import annotations

import jax
import numpy as np


class DataError(Exception):
  """Raised from the data iterator (the cause): an error of the data, not of training."""


def next_batch(data_iter) -> dict[str, np.ndarray]:
  """`next(data_iter)`: this process's `[B / processes, T]` batch, any error wrapped in
  `DataError`.

  A batch made by grain's worker processes (data.num_workers > 0) lives in shared memory
  (numpy subclasses); it is copied into plain arrays here, so the shared memory is released
  as soon as the batch is read, not when the garbage collector reaches the device arrays
  that alias it (after the run's end, so the resource tracker warned of leaked
  shared_memory objects at every exit).
  """
  try:
    batch = next(data_iter)
  except Exception as e:
    raise DataError(str(e)) from e
  return {k: v if type(v) is np.ndarray else np.array(v) for k, v in batch.items()}


def global_batch(batch: dict[str, np.ndarray],
                 sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
  """This process's `[B / processes, T]` numpy batch -> global `[B, T]` arrays in `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def close_data(data_iter) -> None:
  """Closes a data iterator (grain's: its worker processes and their shared memory)."""
  close = getattr(data_iter, "close", None)
  if close is not None:
    close()
