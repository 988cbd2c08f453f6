"""Best-fit packing as a global row index: whole documents only, computed from lengths.

`BestFitRows` is the `data.packing="best_fit"` implementation of the `RowIndex` protocol
(`zaya_jax.data.global_index`): `row(r)` gives the pieces `(document id, start, stop)` of
token-pair positions that make up global row r of `seq_len` pairs. Every piece here is a
whole document (`start == 0`) except an over-length document under `"truncate"`.

The packing, per epoch e (epochs follow each other without end):
  1. the train documents in the seeded permutation `np.random.default_rng([*seed, e])`;
  2. cut into consecutive windows of `window` documents (the last window of an epoch may be
     shorter);
  3. each window packed by best-fit decreasing: its documents by length, longest first (ties
     in permutation order), each put into the fullest open bin it still fits (ties: the bin
     opened first), a new bin opened when none fits; no document is split;
  4. the rows are the window's bins in the order they were opened; the windows follow each
     other in order.
Documents longer than `seq_len` pairs are cut to their first `seq_len` pairs
(`long_documents="truncate"`, the piece `(doc, 0, seq_len)` fills a row alone) or left out
(`"drop"`). Documents of 0 pairs (a single token) carry no target and are always left out.

Reference of behaviour: grain's `BestFitPackIterDataset` (`BestFitPackedBatch`) places each
element into the fullest bin it fits, ties to the lowest bin. Fed one window's documents in
the decreasing order above with `num_packing_bins >= window` and `shuffle_bins=False`, it
produces exactly these bins in this order (tests/data/test_best_fit.py checks it). The index
is computed here from lengths rather than with grain's iterator because the global index
must be known before any token is read, identically on every process, and support random
access to any row (resume on another process count; each process takes its slice of every
global batch): grain's packer is a stream that must read the records it packs and whose
state is its position in that stream.

Cost: packing a window is O(window log window) from lengths only. Nothing is packed up
front: per epoch, windows are packed in order as far as the highest row asked for, keeping
the cumulative row count per packed window (an int64 per window), so `row(r)` maps r to
(epoch, window) by searchsorted; the bins of the most recent windows are cached. Reaching
row r the first time costs packing every window before it once (a resume at row R pays it
once, from lengths: ~1-3 us per document).

Threads: grain's prefetch threads call `row()` of one index at once. The caches are read and
extended under one lock (`_lock`); without it two threads crossing an epoch boundary together
could both append a window to the same cumulative count, which then never reached the epoch's
window count, and `locate` packed empty windows forever (issue 23). Pickling (grain's worker
processes) drops the caches and the lock; the copy makes its own.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Literal

import numpy as np

Piece = tuple[int, int, int]
_CACHED_WINDOWS = 64


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
  """Packs items into bins of `capacity`, best-fit decreasing.

  Args:
    lengths: int [n], each in [1, capacity].
    capacity: the bin size.

  Returns:
    The bins in the order they were opened, each a list of item indices (into `lengths`)
    in the order they were placed. Items go longest first (ties: lower index first), each
    into the fullest bin it still fits (ties: the bin opened first).
  """
  order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
  bins: list[list[int]] = []
  free: list[tuple[int, int]] = []  # (free space, bin index), sorted
  for item in order.tolist():
    n = int(lengths[item])
    at = bisect.bisect_left(free, (n, -1))
    if at == len(free):
      bins.append([item])
      left, b = capacity - n, len(bins) - 1
    else:
      left, b = free.pop(at)
      bins[b].append(item)
      left -= n
    if left > 0:
      bisect.insort(free, (left, b))
  return bins


class BestFitRows:
  """Global rows of whole documents, best-fit packed per window (see the module docstring).

  Args:
    lengths_N: int [documents]: token pairs (tokens - 1) of every document, indexed by
      global document id.
    train_ids: int [train documents]: the global ids of the train documents.
    seed: ints seeding the per-epoch permutation (`np.random.default_rng([*seed, epoch])`).
    seq_len: pairs per row (the bin capacity), >= 1.
    window: documents packed together, >= 1; larger packs tighter, costs more per window.
    long_documents: "truncate" (first seq_len pairs kept) or "drop" (left out).

  Raises:
    ValueError: bad arguments, or no train document left to pack (the message says why).
  """

  def __init__(self, lengths_N: np.ndarray, train_ids: np.ndarray, seed: tuple, seq_len: int,
               window: int, long_documents: Literal["truncate", "drop"] = "truncate"):
    if seq_len < 1 or window < 1:
      raise ValueError(f"best_fit packing: seq_len ({seq_len}) and window ({window}) must "
                       "be >= 1")
    if long_documents not in ("truncate", "drop"):
      raise ValueError(f"best_fit packing: long_documents={long_documents!r}; use "
                       "'truncate' or 'drop'")
    lengths_N = np.asarray(lengths_N, np.int64)
    ids = np.asarray(train_ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= lengths_N.size):
      raise ValueError(f"best_fit packing: train ids outside [0, {lengths_N.size})")
    n = lengths_N[ids]
    keep = n > 0
    if long_documents == "drop":
      keep &= n <= seq_len
    self.dropped_long = int(((n > seq_len) & (long_documents == "drop")).sum())
    self._ids = ids[keep]
    if self._ids.size == 0:
      raise ValueError(f"best_fit packing: no train document of 1..{seq_len} pairs to pack "
                       f"({ids.size} train documents, long_documents={long_documents!r}); "
                       "use long_documents='truncate' or a larger seq_len")
    self._pairs = np.minimum(lengths_N, seq_len)  # by global id, truncated
    self.seed = tuple(int(s) for s in seed)
    self.seq_len = int(seq_len)
    self.window = int(window)
    self.long_documents = long_documents
    self._windows_per_epoch = -(-self._ids.size // self.window)
    self._reset_caches()

  def _reset_caches(self) -> None:
    """Empty caches and a new lock (at construction and after unpickling)."""
    self._lock = threading.Lock()  # held by every public method that reads the caches
    self._cums: list[list[int]] = []
    self._perms: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._bins: collections.OrderedDict[tuple[int, int], list[list[int]]] = (
        collections.OrderedDict())

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items()
            if k not in ("_lock", "_cums", "_perms", "_bins")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset_caches()

  @property
  def documents_per_epoch(self) -> int:
    """Train documents packed each epoch (after the drop rule)."""
    return int(self._ids.size)

  def _perm(self, e: int) -> np.ndarray:
    """The train documents of epoch e in its seeded order (the last 2 epochs cached)."""
    if e not in self._perms:
      self._perms[e] = np.random.default_rng([*self.seed, e]).permutation(self._ids)
      if len(self._perms) > 2:
        self._perms.popitem(last=False)
    return self._perms[e]

  # The underscored methods below expect the caller to hold self._lock.

  def _pack(self, e: int, w: int) -> list[list[int]]:
    """Bins of window w of epoch e: lists of global document ids."""
    key = (e, w)
    if key in self._bins:
      self._bins.move_to_end(key)
      return self._bins[key]
    docs = self._perm(e)[w * self.window:(w + 1) * self.window]
    bins = [docs[b].tolist() for b in best_fit_decreasing(self._pairs[docs], self.seq_len)]
    self._bins[key] = bins
    if len(self._bins) > _CACHED_WINDOWS:
      self._bins.popitem(last=False)
    return bins

  def _cum(self, e: int) -> list[int]:
    """cum[w] = rows of epoch e before window w, for the len(cum) - 1 windows packed."""
    while len(self._cums) <= e:
      self._cums.append([0])
    return self._cums[e]

  def _pack_next(self, e: int) -> bool:
    """Packs the next window of epoch e; False when the epoch was complete."""
    cum = self._cum(e)
    if len(cum) - 1 == self._windows_per_epoch:
      return False
    cum.append(cum[-1] + len(self._pack(e, len(cum) - 1)))
    return True

  def locate(self, r: int) -> tuple[int, int, int]:
    """(epoch, window, bin within the window) of global row r >= 0. Thread-safe.

    Raises:
      IndexError: r < 0.
    """
    if r < 0:
      raise IndexError(f"best_fit packing: row {r} < 0")
    with self._lock:
      return self._locate(r)

  def _locate(self, r: int) -> tuple[int, int, int]:
    e, first = 0, 0
    while True:
      cum, local = self._cum(e), r - first
      while cum[-1] <= local and self._pack_next(e):
        pass
      if local < cum[-1]:
        w = bisect.bisect_right(cum, local) - 1
        return e, w, local - cum[w]
      first += cum[-1]
      e += 1

  def row(self, r: int) -> list[Piece]:
    """The pieces (global document id, 0, pairs kept) of global row r, in bin order.
    Thread-safe."""
    if r < 0:
      raise IndexError(f"best_fit packing: row {r} < 0")
    with self._lock:
      e, w, b = self._locate(r)
      docs = self._pack(e, w)[b]
    return [(d, 0, int(self._pairs[d])) for d in docs]

  def padding_fraction(self, r: int) -> float:
    """1 - (pairs in row r) / seq_len: the share of row r that is padding, in [0, 1)."""
    return 1.0 - sum(stop - start for _, start, stop in self.row(r)) / self.seq_len

  def rows_per_epoch(self, epoch: int = 0) -> int:
    """Rows of an epoch (packs all its windows once). Thread-safe."""
    with self._lock:
      while self._pack_next(epoch):
        pass
      return self._cum(epoch)[-1]

