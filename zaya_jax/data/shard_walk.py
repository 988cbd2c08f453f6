"""Endless epochs over the shards of a corpus, located by position with O(shards) memory.

# Shapes: S shards.

A row index (`global_index.ConcatRows`: units are token pairs; `best_fit.BestFitRows`: units
are rows) lays its units on an endless line: epoch 0's shards in the order sigma_0, then
epoch 1's in sigma_1, and so on. Shard s of epoch e takes `size(e, s)` units, known only once
the shard is read. `ShardWalk.locate(p)` finds (epoch, shard, offset in the shard) of unit p
by walking shards forward from the nearest known shard boundary at or before p, and remembers
every boundary it passes (one int per shard walked: no per-document array).

An *anchor* is a boundary (epoch e, position k in sigma_e, unit where that shard starts).
`anchor(p)` gives the one at or before p; the checkpointed data state carries it and
`add_anchor` puts it back on resume, so resuming at a late position walks from there instead
of replaying every shard before it. Anchors depend on (corpus, seeds, seq_len) only: the same
on every process and in every loader worker.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Callable

import numpy as np

Anchor = tuple[int, int, int]  # (epoch, shard position in the epoch's order, first unit)


@dataclasses.dataclass
class _Segment:
  """Boundaries walked from shard position k0 of epoch e: bounds[i] = first unit of position
  k0 + i (the last entry: the end of the last shard walked)."""

  epoch: int
  k0: int
  bounds: list[int]


class ShardWalk:
  """Random access to (epoch, shard, offset) of a unit position (module docstring).

  Args:
    num_shards: S >= 1.
    order: e -> int [S] the shards of epoch e in order (a permutation of 0..S-1).
    size: (e, s) -> units of shard s in epoch e (>= 0).
    what: names the unit in errors (e.g. "token pair").

  Thread-safe (one lock around walking); picklable (the lock is rebuilt).
  """

  def __init__(self, num_shards: int, order: Callable[[int], np.ndarray],
               size: Callable[[int, int], int], what: str = "unit"):
    if num_shards < 1:
      raise ValueError(f"ShardWalk: num_shards={num_shards} must be >= 1")
    self.num_shards = int(num_shards)
    self._order, self._size, self.what = order, size, what
    self._segments = [_Segment(0, 0, [0])]
    self._lock = threading.Lock()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_lock"}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def _find(self, p: int) -> _Segment:
    starts = [seg.bounds[0] for seg in self._segments]
    i = bisect.bisect_right(starts, p) - 1
    if i < 0:
      raise IndexError(f"no shard boundary known at or before {self.what} {p}")
    return self._segments[i]

  def _insert(self, seg: _Segment) -> _Segment:
    for old in self._segments:
      if (old.epoch, old.k0) == (seg.epoch, seg.k0):
        return old
    starts = [s.bounds[0] for s in self._segments]
    self._segments.insert(bisect.bisect_right(starts, seg.bounds[0]), seg)
    return seg

  def _extend(self, seg: _Segment) -> _Segment:
    """Walks one more shard of `seg`, or opens the next epoch's segment at its end."""
    k = seg.k0 + len(seg.bounds) - 1
    if k == self.num_shards:  # the epoch is complete
      if seg.k0 == 0 and seg.bounds[-1] == seg.bounds[0]:
        raise ValueError(f"an epoch of this corpus holds no {self.what}")
      return self._insert(_Segment(seg.epoch + 1, 0, [seg.bounds[-1]]))
    s = int(self._order(seg.epoch)[k])
    seg.bounds.append(seg.bounds[-1] + int(self._size(seg.epoch, s)))
    return seg

  def locate(self, p: int) -> tuple[int, int, int, int, int]:
    """(epoch, shard position k, shard id s, offset of p in the shard, the shard's size) of
    unit p >= 0.

    Raises:
      IndexError: p < 0, or no anchor at or before p (cannot happen from a fresh walk).
      ValueError: a whole epoch holds no unit (e.g. every train document is empty).
    """
    if p < 0:
      raise IndexError(f"{self.what} {p} < 0")
    with self._lock:
      seg = self._find(p)
      while seg.bounds[-1] <= p:
        seg = self._extend(seg)  # one more shard, or the next epoch's segment (starts <= p)
      j = bisect.bisect_right(seg.bounds, p) - 1
      k = seg.k0 + j
      start, stop = seg.bounds[j], seg.bounds[j + 1]
      return seg.epoch, k, int(self._order(seg.epoch)[k]), p - start, stop - start

  def anchor(self, p: int) -> Anchor:
    """The shard boundary (epoch, k, first unit) at or before unit p (walks to p if needed)."""
    e, k, _, offset, _ = self.locate(p)
    return e, k, p - offset

  def add_anchor(self, anchor: Anchor) -> None:
    """Makes a saved anchor known, so positions from it on are found without walking from 0.

    Raises:
      ValueError: a malformed anchor (names the fix: a state of this corpus and index).
    """
    e, k, start = (int(x) for x in anchor)
    if e < 0 or not 0 <= k < self.num_shards or start < 0:
      raise ValueError(f"data state anchor {list(anchor)} is not (epoch >= 0, shard position "
                       f"in [0, {self.num_shards}), unit >= 0); resume with the data state of "
                       "this corpus")
    with self._lock:
      self._insert(_Segment(e, k, [start]))

  def shards_walked(self) -> int:
    """Boundaries held (memory: one int each)."""
    return sum(len(seg.bounds) for seg in self._segments)
