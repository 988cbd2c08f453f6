"""Best-fit packing as a global row index: whole documents only, computed from lengths.

# Shapes: S shards, n documents of one shard, W documents per packing window.

`BestFitRows` is the `data.packing="best_fit"` implementation of the `RowIndex` protocol
(`zaya_jax.data.global_index`): `row(r)` gives the pieces `(document id, start, stop)` of
token-pair positions that make up global row r of `seq_len` pairs. Every piece here is a
whole document (`start == 0`) except an over-length document under `"truncate"`.

The packing, per epoch e (epochs follow each other without end):
  1. the shards in epoch e's order (`global_index.shard_order`), and within each shard its
     packable train documents in epoch e's order (`global_index.shard_documents`): the same
     two-level order as concat packing, so no per-document array of the corpus is built;
  2. each shard's documents cut into consecutive windows of W documents (the last window of
     a shard may be shorter: windows never cross a shard, so every window is packed from
     one shard's lengths alone);
  3. each window packed by best-fit decreasing: its documents by length, longest first (ties
     in window order), each put into the fullest open bin it still fits (ties: the bin
     opened first), a new bin opened when none fits; no document is split;
  4. the rows are the window's bins in the order they were opened; windows and shards follow
     each other in order.
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
global batch).

Cost: a shard is packed (all its windows, O(n log W) from its lengths) when a row of it is
first asked for; the rows per (epoch, shard) are walked by `shard_walk.ShardWalk` (one int per
shard walked), and the bins of the last few shards are cached. A resume starts at the data
state's anchor (the shard boundary before the resume row), so it packs one shard or a few, never
every window before the resume row.

Threads: grain's prefetch threads call `row()` of one index at once; the walk and the caches
are guarded by locks (issue 23: an unguarded cache once packed empty windows forever).
Pickling (grain's worker processes) drops the caches and the locks; the copy makes its own.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Literal

import numpy as np

from zaya_jax.data.global_index import shard_documents, shard_order
from zaya_jax.data.shard_walk import Anchor, ShardWalk

Piece = tuple[int, int, int]
_CACHED_SHARDS = 4  # (epoch, shard) bin lists kept
_CACHED_ORDERS = 2


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
    corpus: a `prepared.PreparedCorpus` (or any object with its `num_shards`, `shard_docs`,
      `shard_first`, `shard_split`); its split decides the train documents.
    seed: (data.shuffle_seed, train.seed), the seeds of every epoch's order.
    seq_len: pairs per row (the bin capacity), >= 1.
    window: W documents packed together, >= 1; larger packs tighter, costs more per window.
    long_documents: "truncate" (first seq_len pairs kept) or "drop" (left out).

  Raises:
    ValueError: bad arguments; (from `row`) an epoch with no train document to pack.
  """

  def __init__(self, corpus, seed: tuple, seq_len: int, window: int,
               long_documents: Literal["truncate", "drop"] = "truncate"):
    if seq_len < 1 or window < 1:
      raise ValueError(f"best_fit packing: seq_len ({seq_len}) and window ({window}) must "
                       "be >= 1")
    if long_documents not in ("truncate", "drop"):
      raise ValueError(f"best_fit packing: long_documents={long_documents!r}; use "
                       "'truncate' or 'drop'")
    self.corpus = corpus
    self.seed = tuple(int(s) for s in seed)
    self.seq_len = int(seq_len)
    self.window = int(window)
    self.long_documents = long_documents
    self.walk = ShardWalk(corpus.num_shards, self.order, self.shard_rows,
                          f"best_fit row (no train document of 1..{seq_len} pairs to pack, "
                          f"long_documents={long_documents!r}; use long_documents='truncate' "
                          "or a larger seq_len)")
    self._reset()

  def _reset(self) -> None:
    self._lock = threading.Lock()
    self._orders: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._bins: collections.OrderedDict[tuple[int, int], list] = collections.OrderedDict()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_orders", "_bins")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset()

  def order(self, e: int) -> np.ndarray:
    """Epoch e's shard order (cached for 2 epochs). Thread-safe."""
    with self._lock:
      if e not in self._orders:
        self._orders[e] = shard_order(self.corpus.num_shards, self.seed, e)
        while len(self._orders) > _CACHED_ORDERS:
          self._orders.popitem(last=False)
      return self._orders[e]

  def packable(self, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(keep bool [n], pairs kept int64 [n]) of shard s: train documents of >= 1 pair (and
    <= seq_len under "drop"); pairs truncated to seq_len."""
    _, pairs, train = self.corpus.shard_split(s)
    keep = train & (pairs > 0)
    if self.long_documents == "drop":
      keep &= pairs <= self.seq_len
    return keep, np.minimum(pairs, self.seq_len)

  def bins(self, e: int, s: int) -> list[list[Piece]]:
    """The rows of shard s in epoch e: their pieces (global id, 0, pairs kept), a few shards
    cached. Thread-safe."""
    key = (e, s)
    with self._lock:
      if key in self._bins:
        self._bins.move_to_end(key)
        return self._bins[key]
    keep, pairs = self.packable(s)
    local = shard_documents(self.corpus, self.seed, e, s, keep)
    docs = (local + self.corpus.shard_first[s]).tolist()
    sizes = pairs[local].tolist()
    out: list[list[Piece]] = []
    for w in range(0, local.size, self.window):
      for b in best_fit_decreasing(pairs[local[w:w + self.window]], self.seq_len):
        out.append([(docs[w + i], 0, sizes[w + i]) for i in b])
    with self._lock:
      self._bins[key] = out
      while len(self._bins) > _CACHED_SHARDS:
        self._bins.popitem(last=False)
    return out

  def shard_rows(self, e: int, s: int) -> int:
    """Rows of shard s in epoch e (packs it)."""
    return len(self.bins(e, s))

  def locate(self, r: int) -> tuple[int, int, int]:
    """(epoch, shard id, row within the shard's bins) of global row r >= 0. Thread-safe.

    Raises:
      IndexError: r < 0.
    """
    if r < 0:
      raise IndexError(f"best_fit packing: row {r} < 0")
    e, _, s, offset, _ = self.walk.locate(r)
    return e, s, offset

  def row(self, r: int) -> list[Piece]:
    """The pieces (global document id, 0, pairs kept) of global row r, in bin order.
    Thread-safe."""
    e, s, b = self.locate(r)
    return list(self.bins(e, s)[b])

  def padding_fraction(self, r: int) -> float:
    """1 - (pairs in row r) / seq_len: the share of row r that is padding, in [0, 1)."""
    return 1.0 - sum(stop - start for _, start, stop in self.row(r)) / self.seq_len

  def anchor(self, r: int) -> list[int]:
    """A position at or before row r to resume from: [epoch, shard position, first row]."""
    return list(self.walk.anchor(r))

  def add_anchor(self, anchor: Anchor) -> None:
    """Makes a saved `anchor(...)` known (rows from it on need no walk from row 0)."""
    self.walk.add_anchor(anchor)

  def rows_per_epoch(self, epoch: int = 0) -> int:
    """Rows of an epoch: packs every shard of it, O(N): for tests and reports."""
    return sum(self.shard_rows(epoch, s) for s in range(self.corpus.num_shards))
