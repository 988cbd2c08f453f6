"""The global sample index: global row r -> the document pieces that fill it.

# Shapes: S shards of a prepared corpus, n documents of one shard, T sequence length.

A row is a list of pieces `(doc_id, start, stop)` in *pair* coordinates of the document: with
ids = the document's record (bos/eos included), the piece contributes inputs = ids[start:stop]
and targets = ids[start + 1:stop + 1], so a document of L ids has n = L - 1 pairs (shifted
before packing, as in zaya_jax/data/pipeline.py) and 0 <= start < stop <= n. The pieces of a
row fill it in order; their sizes sum to at most T (less = padding at the end of the row).

Rows are a function of (the corpus, the split, the seeds, T, r) only, computed by random
access and never by iterating the corpus: so the global batch at step s is rows
[s*B, (s+1)*B) whatever the number of processes, devices or loader workers
(`zaya_jax.data.global_iterator`).

`ConcatRows` is "concat" packing of the training documents, epoch after epoch. Epoch e's
document order is two-level, so that no per-document array of the corpus is ever built:
  * the shards in the order `np.random.default_rng([shuffle_seed, train_seed, e, 0])
    .permutation(S)`;
  * within shard s, its train documents in the order of
    `default_rng([shuffle_seed, train_seed, e, 1, s]).permutation(n)` (materialised for the
    shard being read only: 16 bytes per document of one shard, a few shards cached).
The stream is epoch 0's documents' pairs, then epoch 1's, ...; row r is pairs
[r*T, (r+1)*T) of it (it may straddle shard and epoch boundaries; a continuation opens the
next row as a new segment). The shard holding pair p is found by `shard_walk.ShardWalk`
(per-shard train pair counts, read when a shard is first needed; anchors let a resume start
late without walking from pair 0). Every train document is in every epoch exactly once; the
data-state row shuffle (`row_shuffle`) then mixes rows within windows.

`eval_rows` is the same cut of the held-out documents in id order, once (finite).
"""

from __future__ import annotations

import collections
import threading
from typing import Iterator, Protocol

import numpy as np

from zaya_jax.data.shard_walk import Anchor, ShardWalk

Piece = tuple[int, int, int]  # (doc_id, start, stop): pairs [start, stop) of the document
_CACHED_STREAMS = 4  # (epoch, shard) document streams kept
_CACHED_ORDERS = 2  # epochs' shard orders kept


class RowIndex(Protocol):
  """Random access to the packed rows of one source: `row(r)` for any r >= 0.

  `row` must be safe to call from several threads at once (grain's prefetch threads share
  one index) and the index picklable (grain's worker processes get a copy): an index with
  caches guards them with a lock, which its pickled state leaves out. `anchor(r)` /
  `add_anchor(a)` save and restore a position to start from (JSON-able list of ints).
  """

  seq_len: int

  def row(self, r: int) -> list[Piece]:
    """The pieces of global row r (empty: a row of padding, e.g. past the end of eval)."""


def shard_order(num_shards: int, seeds: tuple[int, int], epoch: int) -> np.ndarray:
  """int64 [S]: the shards of epoch `epoch` in stream order (module docstring)."""
  return np.random.default_rng([*seeds, epoch, 0]).permutation(num_shards)


def shard_documents(corpus, seeds: tuple[int, int], epoch: int, s: int,
                    keep: np.ndarray) -> np.ndarray:
  """int64 [m]: local indices of shard s's documents with keep[i] (bool [n]), in epoch
  `epoch`'s order within the shard (module docstring)."""
  local = np.random.default_rng([*seeds, epoch, 1, s]).permutation(int(corpus.shard_docs[s]))
  return local[keep[local]]


def cut(docs: np.ndarray, ends: np.ndarray, offset: int, want: int) -> tuple[list[Piece], int]:
  """Up to `want` pairs of a stream from its pair `offset` on.

  Args:
    docs: int64 [m] global ids of the stream's documents, in order.
    ends: int64 [m] cumulative pairs (ends[k] = pairs of docs[:k + 1]).

  Returns (pieces, pairs taken); fewer than `want` only when the stream ends. Documents
  without pairs are skipped.
  """
  pieces: list[Piece] = []
  taken = 0
  k = int(np.searchsorted(ends, offset, side="right"))
  while taken < want and k < docs.size:
    end = int(ends[k])
    begin = int(ends[k - 1]) if k else 0
    size = min(want - taken, end - offset)
    if size > 0:
      start = offset - begin
      pieces.append((int(docs[k]), start, start + size))
      taken += size
      offset += size
    k += 1
  return pieces, taken


class ConcatRows:
  """"concat" packing of the train documents over endless reshuffled epochs (module doc).

  Args:
    corpus: a `prepared.PreparedCorpus` (or any object with its `num_shards`, `shard_docs`,
      `shard_first`, `shard_split`).
    seq_len: T.
    shuffle_seed, train_seed: the seeds of every epoch's order.

  Raises:
    ValueError: (from `row`) if an epoch's train documents hold no pair at all.
  """

  def __init__(self, corpus, seq_len: int, shuffle_seed: int, train_seed: int):
    if seq_len < 1:
      raise ValueError(f"seq_len={seq_len} must be >= 1.")
    self.corpus = corpus
    self.seq_len = int(seq_len)
    self.seeds = (int(shuffle_seed), int(train_seed))
    self._pairs = np.full(corpus.num_shards, -1, np.int64)  # train pairs per shard, -1 unread
    self.walk = ShardWalk(corpus.num_shards, self.order, self.shard_pairs, "train token pair")
    self._reset()

  def _reset(self) -> None:
    self._lock = threading.Lock()
    self._orders: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
    self._streams: collections.OrderedDict[tuple[int, int], tuple] = collections.OrderedDict()

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_orders", "_streams")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._reset()

  def order(self, e: int) -> np.ndarray:
    """Epoch e's shard order (cached for 2 epochs). Thread-safe."""
    with self._lock:
      if e not in self._orders:
        self._orders[e] = shard_order(self.corpus.num_shards, self.seeds, e)
        while len(self._orders) > _CACHED_ORDERS:
          self._orders.popitem(last=False)
      return self._orders[e]

  def shard_pairs(self, e: int, s: int) -> int:  # pylint: disable=unused-argument
    """Train pairs of shard s (the same every epoch; read once, kept: 8 bytes per shard)."""
    if self._pairs[s] < 0:
      _, pairs, train = self.corpus.shard_split(s)
      self._pairs[s] = int(pairs[train].sum())
    return int(self._pairs[s])

  def stream(self, e: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(global ids int64 [m], cumulative pairs int64 [m]) of shard s's train documents in
    epoch e's order (a few cached). Thread-safe."""
    key = (e, s)
    with self._lock:
      if key in self._streams:
        self._streams.move_to_end(key)
        return self._streams[key]
    _, pairs, train = self.corpus.shard_split(s)
    local = shard_documents(self.corpus, self.seeds, e, s, train)
    out = (local + self.corpus.shard_first[s], np.cumsum(pairs[local]))
    with self._lock:
      self._streams[key] = out
      while len(self._streams) > _CACHED_STREAMS:
        self._streams.popitem(last=False)
    return out

  def row(self, r: int) -> list[Piece]:
    """Pairs [r*T, (r+1)*T) of the endless stream, as pieces."""
    position = r * self.seq_len
    pieces: list[Piece] = []
    want = self.seq_len
    while want:
      e, _, s, offset, size = self.walk.locate(position)
      got, taken = cut(*self.stream(e, s), offset, min(want, size - offset))
      pieces += got
      want -= taken
      position += taken
    return pieces

  def anchor(self, r: int) -> list[int]:
    """A position at or before row r to resume from: [epoch, shard position, first pair]."""
    return list(self.walk.anchor(r * self.seq_len))

  def add_anchor(self, anchor: Anchor) -> None:
    """Makes a saved `anchor(...)` known (rows from it on need no walk from row 0)."""
    self.walk.add_anchor(anchor)

  def pairs_per_epoch(self) -> int:
    """Train pairs of one epoch. Reads every shard's lengths: O(N), for tests and reports."""
    return sum(self.shard_pairs(0, s) for s in range(self.corpus.num_shards))

  def epoch_documents(self, e: int) -> np.ndarray:
    """int64 [train documents]: epoch e's document order. O(N): for tests only."""
    return np.concatenate([self.stream(e, int(s))[0] for s in self.order(e)])


def eval_rows(corpus, seq_len: int) -> Iterator[list[Piece]]:
  """The held-out documents of `corpus` in id order, concat-packed into rows of `seq_len`
  pairs, once: yields each row's pieces (the last row may be short). Reads shards in order,
  only as far as the rows taken."""
  pending: list[Piece] = []
  room = seq_len
  for s in range(corpus.num_shards):
    _, pairs, train = corpus.shard_split(s)
    local = np.flatnonzero(~train)
    if local.size == 0:
      continue
    docs, ends = local + corpus.shard_first[s], np.cumsum(pairs[local])
    offset = 0
    while offset < int(ends[-1]):
      got, taken = cut(docs, ends, offset, room)
      pending += got
      room -= taken
      offset += taken
      if room == 0:
        yield pending
        pending, room = [], seq_len
  if pending:
    yield pending
