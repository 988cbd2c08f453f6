# Letters: L elements of one device's buffer; n devices in a group.
"""nccl-tests conventions and the exact integer reference of the collective micro-benchmarks.

Pure NumPy, no devices: the message size of each collective (`buffer_lengths`), the bus
bandwidth factors (`bus_factor`), and the device-dependent small-integer inputs
(`input_block`) with what each collective must leave on each rank (`expected_block`), bounded
(`value_bound`) so that every partial sum is exact in the dtype. `zaya_jax.perf.collectives`
runs the collectives and checks them against these.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
REDUCING = ("all_reduce", "reduce_scatter")  # the only ones that do arithmetic
# Integers below 2**bits are exact in the dtype.
MANTISSA_BITS = {"float32": 24, "bfloat16": 8, "float16": 11, "int32": 31}
MAX_BOUND = 48  # largest |input value|


def bus_factor(collective: str, n: int) -> float:
  """busbw / algbw of nccl-tests for a group of `n` devices (0 for n = 1, except broadcast).

  Raises:
    ValueError: unknown collective.
  """
  factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
             "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": 1.0}
  if collective not in factors:
    raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
  return factors[collective]


def bandwidths(collective: str, n: int, size_bytes: int, seconds: float) -> tuple[float, float]:
  """(algbw, busbw) in GB/s (1e9 bytes/s): size_bytes / seconds, times `bus_factor`."""
  algbw = size_bytes / seconds / 1e9
  return algbw, algbw * bus_factor(collective, n)


def buffer_lengths(collective: str, count: int, n: int) -> tuple[int, int]:
  """(input, output) elements per device for a message of `count` elements (nccl-tests "size"
  / itemsize): reduce-scatter's input and all-gather's output are the full `count`."""
  if collective == "reduce_scatter":
    return count, count // n
  if collective == "all_gather":
    return count // n, count
  return count, count


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
  """min_bytes, 2 min_bytes, 4 min_bytes, ... up to and including at most max_bytes."""
  sizes, size = [], min_bytes
  while size <= max_bytes:
    sizes.append(size)
    size *= 2
  return sizes


def element_count(size_bytes: int, itemsize: int, n: int) -> int:
  """Elements of a `size_bytes` message, rounded down to a multiple of `n` (so reduce-scatter,
  all-gather and all-to-all split it evenly); the row then records the size actually moved."""
  return size_bytes // itemsize // n * n


def value_bound(collective: str, dtype: str, n: int) -> int:
  """B: |inputs| <= B, so a sum of n of them (any order) is exact in `dtype`."""
  if collective not in REDUCING:
    return MAX_BOUND
  return max(1, min(MAX_BOUND, (2 ** MANTISSA_BITS[dtype] - 1) // n))


def input_block(device: int, length: int, bound: int) -> np.ndarray:
  """[L] int64: device `device`'s input, ((device * 131 + i * 7) % (2B + 1)) - B."""
  i = np.arange(length, dtype=np.int64)
  return (device * 131 + i * 7) % (2 * bound + 1) - bound


def expected_block(collective: str, members: Sequence[int], rank: int, in_len: int,
                   bound: int) -> np.ndarray:
  """[L_out] int64: what `collective` must leave on rank `rank` of the group `members`."""
  n = len(members)
  if collective == "broadcast":
    return input_block(members[0], in_len, bound)
  if collective in REDUCING:
    total = sum(input_block(m, in_len, bound) for m in members)
    if collective == "all_reduce":
      return total
    chunk = in_len // n
    return total[rank * chunk:(rank + 1) * chunk]
  if collective == "all_gather":
    return np.concatenate([input_block(m, in_len, bound) for m in members])
  if collective == "all_to_all":  # chunk j of the output is chunk `rank` of member j's input
    chunk = in_len // n
    return np.concatenate([input_block(m, in_len, bound)[rank * chunk:(rank + 1) * chunk]
                           for m in members])
  raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
