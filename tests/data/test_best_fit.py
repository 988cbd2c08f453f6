"""BestFitRows: whole documents per row, every train document once per epoch, grain's
best-fit bins, random access without rebuilding, the truncate/drop rule."""

import collections

import grain
import numpy as np
import pytest

from zaya_jax.data.best_fit import BestFitRows, best_fit_decreasing

SEQ = 64


@pytest.fixture(scope="module")
def corpus():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 80, size=300)  # some over SEQ, some of 0 pairs below
  lengths[[3, 17]] = 0
  train = np.arange(0, 300)[np.arange(300) % 10 != 0]  # every 10th is eval
  return lengths, train


def _epoch_rows(rows: BestFitRows, epoch: int = 0):
  first = sum(rows.rows_per_epoch(e) for e in range(epoch))
  return [rows.row(r) for r in range(first, first + rows.rows_per_epoch(epoch))]


@pytest.mark.parametrize("rule", ["truncate", "drop"])
def test_every_train_document_once_per_epoch_whole(corpus, rule):
  lengths, train = corpus
  rows = BestFitRows(lengths, train, seed=(1, 2), seq_len=SEQ, window=40, long_documents=rule)
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
    assert rows.dropped_long == int((lengths[train] > SEQ).sum()) > 0


def test_epochs_differ_and_seed_decides(corpus):
  lengths, train = corpus
  a = BestFitRows(lengths, train, seed=(1, 2), seq_len=SEQ, window=40)
  b = BestFitRows(lengths, train, seed=(1, 2), seq_len=SEQ, window=40)
  c = BestFitRows(lengths, train, seed=(1, 3), seq_len=SEQ, window=40)
  assert _epoch_rows(a, 0) != _epoch_rows(a, 1)
  assert [b.row(r) for r in range(50)] == [a.row(r) for r in range(50)]
  assert [c.row(r) for r in range(50)] != [a.row(r) for r in range(50)]


def test_random_access_equals_sequential(corpus):
  """A fresh index asked row r directly (a resume) gives what walking from 0 gives."""
  lengths, train = corpus
  walk = BestFitRows(lengths, train, seed=(5,), seq_len=SEQ, window=25)
  seq = [walk.row(r) for r in range(3 * walk.rows_per_epoch(0))]
  for r in (0, 7, len(seq) // 2, len(seq) - 1):
    fresh = BestFitRows(lengths, train, seed=(5,), seq_len=SEQ, window=25)
    assert fresh.row(r) == seq[r]
    e, w, _ = fresh.locate(r)
    cums = fresh._cums  # pylint: disable=protected-access
    assert len(cums) == e + 1 and len(cums[e]) == w + 2  # packed no further than row r
  backwards = BestFitRows(lengths, train, seed=(5,), seq_len=SEQ, window=25)
  assert [backwards.row(r) for r in reversed(range(len(seq)))] == seq[::-1]


def test_packs_lazily(corpus):
  lengths, train = corpus
  rows = BestFitRows(lengths, train, seed=(0,), seq_len=SEQ, window=10)
  rows.row(0)
  assert len(rows._cums[0]) == 2  # pylint: disable=protected-access  # one window packed


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
  lengths, train = corpus
  rows = BestFitRows(lengths, train, seed=(9,), seq_len=SEQ, window=60)
  e, w, _ = rows.locate(0)
  docs = rows._perm(e)[:60]  # pylint: disable=protected-access
  pairs = np.minimum(lengths[docs], SEQ)
  pairs = pairs[pairs > 0]
  docs = docs[np.minimum(lengths[docs], SEQ) > 0]
  grain_rows = [[int(docs[i]) for i in b] for b in _grain_bins(pairs, SEQ)]
  ours = [[d for d, _, _ in rows.row(r)] for r in range(len(grain_rows))]
  assert ours == grain_rows
  assert rows.rows_per_epoch(0) > len(grain_rows)  # the next window starts new rows
  assert rows.locate(len(grain_rows)) == (0, 1, 0)


def test_padding_fraction_and_window_tightness(corpus):
  lengths, train = corpus
  pad = {}
  for window in (1, 8, 200):
    rows = BestFitRows(lengths, train, seed=(3,), seq_len=SEQ, window=window)
    n = rows.rows_per_epoch(0)
    fr = [rows.padding_fraction(r) for r in range(n)]
    used = sum(b - a for r in range(n) for _, a, b in rows.row(r))
    assert np.isclose(np.mean(fr), 1 - used / (n * SEQ))
    assert all(0 <= f < 1 for f in fr)
    pad[window] = np.mean(fr)
  assert pad[200] < pad[8] < pad[1]  # window 1 = one document per row
  assert pad[200] < 0.05


def test_bad_arguments(corpus):
  lengths, train = corpus
  with pytest.raises(ValueError, match="long_documents='cut'"):
    BestFitRows(lengths, train, (0,), SEQ, 8, long_documents="cut")
  with pytest.raises(ValueError, match="no train document"):
    BestFitRows(np.array([100, 0]), np.array([0, 1]), (0,), 8, 4, long_documents="drop")
  with pytest.raises(ValueError, match="train ids outside"):
    BestFitRows(lengths, np.array([300]), (0,), SEQ, 8)
