"""BestFitRows: whole documents per row, every train document once per epoch, grain's
best-fit bins, random access without rebuilding, the truncate/drop rule.

The corpora are `LengthsCorpus` (lengths alone, 3 shards, the eval split by hash)."""

import collections

import grain
import numpy as np
import pytest

from zaya_jax.data.best_fit import BestFitRows, best_fit_decreasing
from zaya_jax.data.global_index import shard_documents
from zaya_jax.data.synthetic import LengthsCorpus

SEQ = 64


@pytest.fixture(scope="module")
def corpus():
  """(pairs int [300] by global id, train ids, the LengthsCorpus)."""
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 80, size=300)  # pairs: some over SEQ, some of 0 pairs below
  lengths[[3, 17]] = 0
  opened = LengthsCorpus(np.array_split(lengths + 1, 3), eval_fraction=0.1)
  train = np.concatenate([opened.shard_first[s] + np.flatnonzero(opened.shard_split(s)[2])
                          for s in range(3)])
  assert 250 < train.size < 295
  return lengths, train, opened


def _epoch_rows(rows: BestFitRows, epoch: int = 0):
  first = sum(rows.rows_per_epoch(e) for e in range(epoch))
  return [rows.row(r) for r in range(first, first + rows.rows_per_epoch(epoch))]


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_every_train_document_once_per_epoch_whole(corpus, rule):
  lengths, train, opened = corpus
  rows = BestFitRows(opened, seed=(1, 2), seq_len=SEQ, window=40, long_documents=rule)
  for epoch in (0, 1):
    docs = collections.Counter()
    for pieces in _epoch_rows(rows, epoch):
      assert 0 < sum(b - a for _, a, b in pieces) <= SEQ
      for d, a, b in pieces:
        docs[d] += 1
        assert a == 0 and b == min(lengths[d], SEQ)  # whole, or truncated to SEQ
    want = {int(d) for d in train if lengths[d] > 0 and (rule == "truncate" or lengths[d] <= SEQ)}
    assert set(docs) == want and set(docs.values()) == {1}
  if rule == "drop":
    assert int((lengths[train] > SEQ).sum()) > 0  # some were dropped


def test_epochs_differ_and_seed_decides(corpus):
  lengths, train, opened = corpus
  a = BestFitRows(opened, seed=(1, 2), seq_len=SEQ, window=40)
  b = BestFitRows(opened, seed=(1, 2), seq_len=SEQ, window=40)
  c = BestFitRows(opened, seed=(1, 3), seq_len=SEQ, window=40)
  assert _epoch_rows(a, 0) != _epoch_rows(a, 1)
  assert [b.row(r) for r in range(50)] == [a.row(r) for r in range(50)]
  assert [c.row(r) for r in range(50)] != [a.row(r) for r in range(50)]


def test_random_access_equals_sequential(corpus):
  """A fresh index asked row r directly (a resume) gives what walking from 0 gives."""
  lengths, train, opened = corpus
  walk = BestFitRows(opened, seed=(5, 0), seq_len=SEQ, window=25)
  seq = [walk.row(r) for r in range(3 * walk.rows_per_epoch(0))]
  for r in (0, 7, len(seq) // 2, len(seq) - 1):
    fresh = BestFitRows(opened, seed=(5, 0), seq_len=SEQ, window=25)
    assert fresh.row(r) == seq[r]
    e, s, _ = fresh.locate(r)
    k = int(np.flatnonzero(fresh.order(e) == s)[0])
    assert fresh.walk.shards_walked() == 4 * e + k + 2  # packed no further than row r's shard
  backwards = BestFitRows(opened, seed=(5, 0), seq_len=SEQ, window=25)
  assert [backwards.row(r) for r in reversed(range(len(seq)))] == seq[::-1]


def test_packs_lazily(corpus):
  _, _, opened = corpus
  rows = BestFitRows(opened, seed=(0, 0), seq_len=SEQ, window=10)
  rows.row(0)
  assert rows.walk.shards_walked() == 2  # one shard packed: its start and end
  assert len(rows._bins) == 1  # pylint: disable=protected-access


def test_best_fit_decreasing_by_hand():
  # 7 -> bin0 (free 1); 5 -> bin1 (free 3); 4 -> bin2 (free 4); 3 -> bin1 (fullest fit, 0);
  # 2 -> bin2 (free 2); 2 -> bin2 (0); 1 -> bin0 (0)
  assert best_fit_decreasing(np.array([2, 7, 5, 1, 4, 3, 2]), 8) == [
      [1, 3], [2, 5], [4, 0, 6]]


def _grain_bins(pairs: np.ndarray, capacity: int) -> list[list[int]]:
  """grain's BestFitPackIterDataset over items fed longest first: the items of each row."""
  order = np.argsort(-pairs, kind="stable")
  ds = grain.MapDataset.source([np.full(pairs[i], i + 1, np.int32) for i in order])
  ds = ds.map(lambda x: {"inputs": x}).to_iter_dataset()
  packed = grain.experimental.BestFitPackIterDataset(
      ds, length_struct={"inputs": capacity}, num_packing_bins=len(pairs), shuffle_bins=False)
  out = []
  for row in packed:
    tokens, seg = row["inputs"], row["inputs_segment_ids"]
    out.append([int(tokens[seg == s][0]) - 1 for s in range(1, seg.max() + 1)])
  return out


def test_bins_equal_grains_best_fit(corpus):
  """One window of BestFitRows is exactly grain's packing of the same documents."""
  lengths, train, opened = corpus
  rows = BestFitRows(opened, seed=(9, 0), seq_len=SEQ, window=60)
  e, s, _ = rows.locate(0)
  keep, _ = rows.packable(s)
  docs = opened.shard_first[s] + shard_documents(opened, (9, 0), e, s, keep)[:60]
  pairs = np.minimum(lengths[docs], SEQ)
  assert (pairs > 0).all()
  grain_rows = [[int(docs[i]) for i in b] for b in _grain_bins(pairs, SEQ)]
  ours = [[d for d, _, _ in rows.row(r)] for r in range(len(grain_rows))]
  assert ours == grain_rows
  assert rows.rows_per_epoch(0) > len(grain_rows)  # the next window starts new rows
  nxt = rows.locate(len(grain_rows))
  assert nxt[:2] == (0, s) and nxt[2] == len(grain_rows)  # the shard's next window


def test_padding_fraction_and_window_tightness(corpus):
  lengths, train, opened = corpus
  pad = {}
  for window in (1, 8, 200):
    rows = BestFitRows(opened, seed=(3, 0), seq_len=SEQ, window=window)
    n = rows.rows_per_epoch(0)
    fr = [rows.padding_fraction(r) for r in range(n)]
    used = sum(b - a for r in range(n) for _, a, b in rows.row(r))
    assert np.isclose(np.mean(fr), 1 - used / (n * SEQ))
    assert all(0 <= f < 1 for f in fr)
    pad[window] = np.mean(fr)
  assert pad[200] < pad[8] < pad[1]  # window 1 = one document per row
  assert pad[200] < 0.05


def test_bad_arguments(corpus):
  _, _, opened = corpus
  with pytest.raises(ValueError, match="long_documents='cut'"):
    BestFitRows(opened, (0, 0), SEQ, 8, long_documents="cut")
  with pytest.raises(ValueError, match="window"):
    BestFitRows(opened, (0, 0), SEQ, 0)
  nothing = BestFitRows(LengthsCorpus([np.array([101, 1])]), (0, 0), 8, 4,
                        long_documents="drop")
  with pytest.raises(ValueError, match="no train document"):
    nothing.row(0)
