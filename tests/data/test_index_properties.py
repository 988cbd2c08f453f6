"""Properties of the bounded-memory row indexes on random corpora (issue 27).

Random corpora (`LengthsCorpus`: 1-5 shards, some empty; empty and one-token documents;
documents up to 6 rows long; eval fractions 0-0.3) for concat and best_fit packing, and a
mixture of 3 such sources:
  * every epoch's rows cover every pair of every train document exactly once (best_fit:
    every packable document once, whole or truncated), and nothing else;
  * a fresh index given `anchor(r)` gives rows r, r+1, ... as the original does, without
    walking from row 0;
  * a mixture's global rows are each source's rows 0, 1, 2, ... in order, none skipped.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from zaya_jax.data.best_fit import BestFitRows
from zaya_jax.data.global_index import ConcatRows
from zaya_jax.data.mixture import MixedRows
from zaya_jax.data.synthetic import LengthsCorpus

SEEDS = range(12)


def random_corpus(seed: int) -> tuple[LengthsCorpus, int]:
  """A random corpus and a seq_len T for it."""
  rng = np.random.default_rng(seed)
  seq_len = int(rng.integers(4, 24))
  shards = []
  for _ in range(int(rng.integers(1, 6))):
    n = int(rng.choice([0, 1, 5, 40]))
    kind = rng.choice(4, size=n, p=[0.1, 0.1, 0.6, 0.2])  # empty, one token, short, long
    lengths = np.select([kind == 0, kind == 1, kind == 2],
                        [0, 1, rng.integers(2, seq_len + 2, n)], rng.integers(seq_len, 6 * seq_len, n))
    shards.append(lengths)
  if sum(x.size for x in shards) == 0:
    shards[0] = np.array([seq_len + 3])
  if all((x > 1).sum() == 0 for x in shards):
    shards[-1] = np.append(shards[-1], 3 * seq_len)
  return LengthsCorpus(shards, eval_fraction=float(rng.choice([0.0, 0.1, 0.3]))), seq_len


def documents(corpus: LengthsCorpus) -> tuple[np.ndarray, np.ndarray]:
  """(pairs int64 [N], train bool [N]) by global id (O(N): tests only)."""
  parts = [corpus.shard_split(s) for s in range(corpus.num_shards)]
  return (np.concatenate([p[1] for p in parts]).astype(np.int64),
          np.concatenate([p[2] for p in parts]).astype(bool))


def concat_epochs_cover_every_pair_once(rows: ConcatRows, epochs: int) -> None:
  pairs, train = documents(rows.corpus)
  per_epoch = int(pairs[train].sum())
  seen = [collections.defaultdict(list) for _ in range(epochs)]
  for r in range(-(-epochs * per_epoch // rows.seq_len)):
    position = r * rows.seq_len
    pieces = rows.row(r)
    assert sum(b - a for _, a, b in pieces) == rows.seq_len  # concat rows are always full
    for doc, start, stop in pieces:
      e = position // per_epoch
      assert (position + stop - start - 1) // per_epoch == e, "a piece straddles epochs"
      if e < epochs:
        seen[e][doc].append((start, stop))
      position += stop - start
  want = set(np.flatnonzero(train & (pairs > 0)).tolist())
  for e in range(epochs):
    assert set(seen[e]) == want, f"epoch {e}: documents differ"
    for doc, spans in seen[e].items():
      covered = np.zeros(pairs[doc], np.int64)
      for start, stop in spans:
        covered[start:stop] += 1
      assert (covered == 1).all(), f"epoch {e} doc {doc}: pairs covered {covered.tolist()}"


def best_fit_epochs_hold_every_document_once(rows: BestFitRows, epochs: int) -> None:
  pairs, train = documents(rows.corpus)
  first = 0
  want = set(np.flatnonzero(train & (pairs > 0)).tolist())
  for e in range(epochs):
    count = rows.rows_per_epoch(e)
    docs = collections.Counter()
    for r in range(first, first + count):
      pieces = rows.row(r)
      assert 0 < sum(b - a for _, a, b in pieces) <= rows.seq_len
      for doc, start, stop in pieces:
        assert start == 0 and stop == min(pairs[doc], rows.seq_len)
        docs[doc] += 1
    assert set(docs) == want and set(docs.values()) == {1}, f"epoch {e}"
    first += count


@pytest.mark.parametrize("seed", SEEDS)
def test_concat_covers_every_pair_once_per_epoch_and_resumes_from_an_anchor(seed):
  corpus, seq_len = random_corpus(seed)
  rows = ConcatRows(corpus, seq_len, shuffle_seed=seed, train_seed=7)
  concat_epochs_cover_every_pair_once(rows, epochs=2)
  last = -(-2 * rows.pairs_per_epoch() // seq_len)
  for r in (1, last // 2, last - 1):
    fresh = ConcatRows(corpus, seq_len, shuffle_seed=seed, train_seed=7)
    anchor = rows.anchor(r)
    fresh.add_anchor(anchor)
    assert [fresh.row(x) for x in range(r, r + 4)] == [rows.row(x) for x in range(r, r + 4)]
    from_zero = fresh.walk._segments[0]  # pylint: disable=protected-access
    assert anchor[:2] == [0, 0] or len(from_zero.bounds) == 1  # no walk from row 0


@pytest.mark.parametrize("seed", SEEDS)
def test_best_fit_holds_every_document_once_per_epoch_and_resumes_from_an_anchor(seed):
  corpus, seq_len = random_corpus(seed)
  rows = BestFitRows(corpus, (seed, 7), seq_len, window=int(seed % 5 + 1))
  best_fit_epochs_hold_every_document_once(rows, epochs=2)
  r = rows.rows_per_epoch(0) + rows.rows_per_epoch(1) // 2
  fresh = BestFitRows(corpus, (seed, 7), seq_len, window=int(seed % 5 + 1))
  fresh.add_anchor(rows.anchor(r))
  assert [fresh.row(x) for x in range(r, r + 4)] == [rows.row(x) for x in range(r, r + 4)]
  segments = fresh.walk._segments  # pylint: disable=protected-access
  assert len(segments[0].bounds) == 1  # the segment from row 0 was never walked


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_three_source_mixture_uses_each_sources_rows_in_order(seed):
  (a, ta), (b, tb), (c, _) = (random_corpus(100 + 3 * seed + i) for i in range(3))
  seq_len = max(ta, tb)
  sources = [ConcatRows(a, seq_len, seed, 1), BestFitRows(b, (seed, 1), seq_len, window=3),
             ConcatRows(c, seq_len, seed, 2)]
  mixed = MixedRows(sources, [0.5, 0.3, 0.2])
  used: list[list[int]] = [[], [], []]
  total = 600
  for r in range(total):
    i, k = mixed.locate(r)
    used[i].append(k)
    assert mixed.row(r) == (i, sources[i].row(k))
  counts = mixed.counts(total)
  assert [len(u) for u in used] == counts and all(u == list(range(len(u))) for u in used)
  assert abs(counts[0] / total - 0.5) < 0.01
  # Each source, alone, covers its epochs (the mixture only decides which source a row is).
  for index, used_rows in ((sources[0], counts[0]), (sources[2], counts[2])):
    epochs = used_rows * seq_len // max(index.pairs_per_epoch(), 1)
    if epochs:
      concat_epochs_cover_every_pair_once(index, epochs=min(epochs, 2))
