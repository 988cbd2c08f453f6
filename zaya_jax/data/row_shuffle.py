"""Row shuffle: the rows of a global batch come from all over the corpus, not one document.

# Shapes: W rows per shuffle window (data.shuffle_window), B rows per global batch.

Packed rows are consecutive cuts of the document stream, so without a shuffle the B rows of
one batch are mostly pieces of the same few documents (an 8 x 256 batch of the stdlib corpus
is usually one source file). That correlation makes every per-batch statistic noisy, above
all the expert loads the balancing biases chase (zaya_jax/train/balance.py). Megatron-LM's
GPTDataset permutes its packed samples with a third, seeded index (`shuffle_idx`); OLMo-core
reshuffles its rows every epoch.

Here the row stream is cut into windows of W consecutive rows, and logical row r is physical
row

    w * W + pi_w(r - w * W),   w = r // W,

with pi_w a keyed bijection of [0, W) (grain's `index_shuffle`, a 4-round Feistel-style
permutation computed per index, seed = `window_seed(seeds) + w` mod 2^32). Below
`SMALL_WINDOW` rows, index_shuffle cycle-walks for milliseconds per call (measured per call:
W = 8: 18 ms, W = 1,024: 104 us, W = 4,096: 74 us; W >= 8,192: 7-9 us), so a small window's
permutation is drawn whole with numpy from the same seed and kept (at most `_KEPT` windows of
< 8,192 int64, 64 KB each). Nothing is stored per row, every window is a permutation (each physical row is used exactly once), and the map
is a function of (seeds, W, r) alone: the same on every process, in every loader worker, and
resumable from the logical row number. Row r's physical row lies in the same window, so a
shuffled stream runs at most W rows ahead of the unshuffled one.

Raw text (zaya_jax/data/pipeline.py), whose rows come out of a sequential packer, uses grain's
`WindowShuffleIterDataset` instead (the same idea over a buffer of W rows, W * T * 16 bytes
of host memory per process).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator

import numpy as np
from grain.experimental import index_shuffle

ROUNDS = 4  # Feistel rounds of index_shuffle (grain's WindowShuffle uses 4)
SMALL_WINDOW = 8192  # rows; smaller windows are permuted whole (module docstring)
_KEPT = 8  # small windows' permutations kept (a thread-safe LRU cache, shared by all indices)


def window_seed(seeds: tuple[int, ...]) -> int:
  """uint32 base seed of the windows' permutations, from (data.shuffle_seed, train.seed)."""
  return int(np.random.SeedSequence([*seeds, 0x5EED]).generate_state(1)[0])


_EVAL_TAG = 0xE7A1  # separates the eval sample's seed from the training windows' seeds


def eval_seed(shuffle_seed: int) -> int:
  """uint32 seed of the eval sample's window permutations, from data.shuffle_seed alone (not
  the train seed: runs of any seed are evaluated on the same batches)."""
  return window_seed((int(shuffle_seed), _EVAL_TAG))


def shuffle_windows(rows: Iterable, window: int, seed: int) -> Iterator:
  """A finite row stream with each window of `window` consecutive rows (the last one
  possibly shorter) in the order of a permutation drawn from `seed` + window number (numpy
  `default_rng`); the eval sample of prepared corpora. Reads the stream one window ahead.

  Raises:
    ValueError: if `window` < 1.
  """
  if window < 1:
    raise ValueError(f"data.shuffle_window={window} must be >= 1 (rows per window).")
  it = iter(rows)
  for w in itertools.count():
    block = list(itertools.islice(it, window))
    if not block:
      return
    order = np.random.default_rng((seed + w) & 0xFFFFFFFF).permutation(len(block))
    yield from (block[i] for i in order)
    if len(block) < window:
      return


def shuffled_row(r: int, window: int, base_seed: int) -> int:
  """The physical row of logical row `r` (module docstring); a bijection on each window.

  Args:
    r: logical row >= 0.
    window: W >= 1 rows per window.
    base_seed: `window_seed(...)`, in [0, 2^32).
  """
  w, i = divmod(int(r), window)
  if window == 1:
    return int(r)
  seed = (base_seed + w) & 0xFFFFFFFF
  if window < SMALL_WINDOW:
    return w * window + int(_window_permutation(window, seed)[i])
  return w * window + index_shuffle(i, max_index=window - 1, seed=seed, rounds=ROUNDS)


@functools.lru_cache(maxsize=_KEPT)
def _window_permutation(window: int, seed: int) -> np.ndarray:
  """[window] int64, a permutation of [0, window) drawn from `seed` (windows < SMALL_WINDOW).
  Read-only: the cached array is shared."""
  perm = np.random.default_rng(seed).permutation(window)
  perm.flags.writeable = False
  return perm


class ShuffledRows:
  """A `RowIndex` (zaya_jax/data/global_index.py) whose row r is the inner index's row
  `shuffled_row(r)`. Stateless beyond its arguments: safe for concurrent `row()` calls and
  picklable for loader workers.

  Args:
    rows: the inner RowIndex (ConcatRows, BestFitRows, ...), endless.
    window: W, rows per shuffle window (>= 1; 1 = no shuffle).
    seeds: (data.shuffle_seed, train.seed).

  Raises:
    ValueError: if `window` < 1.
  """

  def __init__(self, rows, window: int, seeds: tuple[int, ...]):
    if window < 1:
      raise ValueError(f"data.shuffle_window={window} must be >= 1 (rows per window).")
    self.rows = rows
    self.seq_len = rows.seq_len
    self.window = int(window)
    self.base_seed = window_seed(tuple(int(s) for s in seeds))

  def physical(self, r: int) -> int:
    """The inner row that logical row `r` reads."""
    return shuffled_row(r, self.window, self.base_seed)

  def row(self, r: int):
    return self.rows.row(self.physical(r))

  def anchor(self, r: int) -> list[int]:
    """The inner index's anchor before the window of logical row r: every row that logical
    rows >= r read lies at or after it."""
    return self.rows.anchor(r // self.window * self.window)

  def add_anchor(self, anchor) -> None:
    self.rows.add_anchor(anchor)


def same_document_share(batches_of_pieces: list[list[list[tuple[int, int, int]]]]) -> float:
  """Fraction of row pairs inside a batch that share a document, over all batches.

  Args:
    batches_of_pieces: per batch, per row, the row's pieces `(doc_id, start, stop)`.

  Returns:
    (pairs i < j of rows of one batch holding a piece of the same document) / (all such
    pairs); 0.0 when no batch has two rows.
  """
  shared = total = 0
  for rows in batches_of_pieces:
    docs = [{p[0] for p in pieces} for pieces in rows]
    for i in range(len(docs)):
      for j in range(i + 1, len(docs)):
        total += 1
        shared += bool(docs[i] & docs[j])
  return shared / total if total else 0.0
