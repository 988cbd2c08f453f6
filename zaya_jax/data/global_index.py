"""The global sample index: global row r -> the document pieces that fill it.

# Shapes: N documents of a prepared corpus, T sequence length (seq_len).

A row is a list of pieces `(doc_id, start, stop)` in *pair* coordinates of the document: with
ids = the document's record (bos/eos included), the piece contributes inputs = ids[start:stop]
and targets = ids[start + 1:stop + 1], so a document of L ids has n = L - 1 pairs (shifted
before packing, as in zaya_jax/data/pipeline.py) and 0 <= start < stop <= n. The pieces of a
row fill it in order; their sizes sum to at most T (less = padding at the end of the row).

Rows are a function of (the corpus, the split, the seeds, T, r) only, computed by random
access and never by iterating: so the global batch at step s is rows [s*B, (s+1)*B) whatever
the number of processes, devices or loader workers (`zaya_jax.data.global_iterator`).

`ConcatRows` is "concat" packing of the training documents, epoch after epoch: epoch e's
order is a permutation of the train ids drawn from
`np.random.default_rng([shuffle_seed, train_seed, e])`; the stream is epoch 0's documents'
pairs, then epoch 1's, ...; row r is pairs [r*T, (r+1)*T) of it (it may straddle an epoch
boundary; a continuation opens the next row as a new segment). `SequentialRows` is the same
cut of a fixed document list, finite (eval). Other packings (best_fit) and mixtures implement
the same `RowIndex` protocol.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

Piece = tuple[int, int, int]  # (doc_id, start, stop): pairs [start, stop) of the document


class RowIndex(Protocol):
  """Random access to the packed rows of one source: `row(r)` for any r >= 0.

  `row` must be safe to call from several threads at once (grain's prefetch threads share
  one index) and the index picklable (grain's worker processes get a copy): an index with
  caches guards them with a lock, which its pickled state leaves out.
  """

  seq_len: int

  def row(self, r: int) -> list[Piece]:
    """The pieces of global row r (empty: a row of padding, e.g. past the end of eval)."""


def epoch_order(train_ids: np.ndarray, shuffle_seed: int, train_seed: int,
                epoch: int) -> np.ndarray:
  """int64 [len(train_ids)]: epoch `epoch`'s document order, a permutation of `train_ids`."""
  rng = np.random.default_rng([shuffle_seed, train_seed, epoch])
  return rng.permutation(np.asarray(train_ids, dtype=np.int64))


def _cut(order: np.ndarray, ends: np.ndarray, pairs: np.ndarray, offset: int,
         want: int) -> tuple[list[Piece], int]:
  """Up to `want` pairs of the stream `order` from stream pair `offset` on.

  `ends` = cumsum(pairs[order]) (int64). Returns (pieces, pairs taken); fewer than `want`
  only when the stream ends. Documents without pairs are skipped.
  """
  pieces: list[Piece] = []
  taken = 0
  k = int(np.searchsorted(ends, offset, side="right"))
  while taken < want and k < order.size:
    doc = int(order[k])
    end = int(ends[k])
    start = int(pairs[doc]) - (end - offset)
    size = min(want - taken, end - offset)
    if size > 0:
      pieces.append((doc, start, start + size))
      taken += size
      offset += size
    k += 1
  return pieces, taken


class ConcatRows:
  """"concat" packing of the train documents over endless reshuffled epochs (module doc).

  Args:
    pairs: int64 [N] pairs of each document (lengths - 1, floored at 0).
    train_ids: int64 [n_train] global ids of the training documents.
    seq_len: T.
    shuffle_seed, train_seed: the seeds of every epoch's permutation.

  Raises:
    ValueError: if the train documents hold no pair at all.
  """

  def __init__(self, pairs: np.ndarray, train_ids: np.ndarray, seq_len: int,
               shuffle_seed: int, train_seed: int):
    if seq_len < 1:
      raise ValueError(f"seq_len={seq_len} must be >= 1.")
    self.pairs = np.asarray(pairs, dtype=np.int64)
    self.train_ids = np.asarray(train_ids, dtype=np.int64)
    self.seq_len = seq_len
    self.seeds = (shuffle_seed, train_seed)
    self.pairs_per_epoch = int(self.pairs[self.train_ids].sum())
    if self.pairs_per_epoch == 0:
      raise ValueError(f"the {self.train_ids.size} train documents hold no token pair "
                       "(every document has < 2 tokens); add documents or lower "
                       "data.eval_fraction.")
    self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._lock = threading.Lock()  # grain's prefetch threads share the cache

  def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, ends) of epoch e: its permutation and cumsum of its pairs (cached, 2 kept).
    Thread-safe."""
    with self._lock:
      if e not in self._epochs:
        if len(self._epochs) >= 2:
          del self._epochs[min(self._epochs)]
        order = epoch_order(self.train_ids, *self.seeds, e)
        self._epochs[e] = (order, np.cumsum(self.pairs[order]))
      return self._epochs[e]

  def row(self, r: int) -> list[Piece]:
    """Pairs [r*T, (r+1)*T) of the endless stream, as pieces."""
    position = r * self.seq_len
    pieces: list[Piece] = []
    want = self.seq_len
    while want:
      e, offset = divmod(position, self.pairs_per_epoch)
      got, taken = _cut(*self.epoch(e), self.pairs, offset, want)
      pieces += got
      want -= taken
      position += taken
    return pieces

  def __getstate__(self):
    state = {**self.__dict__, "_epochs": {}}
    del state["_lock"]  # a lock does not pickle; the copy gets its own
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()


class SequentialRows:
  """"concat" packing of `doc_ids` in the given order, once: rows past the end are empty.

  Args:
    pairs: int64 [N] pairs of each document; doc_ids: the documents, in stream order.
    seq_len: T.

  Attributes:
    num_rows: rows holding at least one pair (ceil(total pairs / T)).
  """

  def __init__(self, pairs: np.ndarray, doc_ids: np.ndarray, seq_len: int):
    self.pairs = np.asarray(pairs, dtype=np.int64)
    self.order = np.asarray(doc_ids, dtype=np.int64)
    self.seq_len = seq_len
    self.ends = np.cumsum(self.pairs[self.order])
    total = int(self.ends[-1]) if self.ends.size else 0
    self.num_rows = -(-total // seq_len)

  def row(self, r: int) -> list[Piece]:
    return _cut(self.order, self.ends, self.pairs, r * self.seq_len, self.seq_len)[0]
