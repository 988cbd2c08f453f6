"""Every RowIndex is safe for concurrent `row()` calls (issue 23 item 0).

grain's prefetch threads call `row(r)` of the same object at once. `BestFitRows` once packed
empty windows forever after two threads crossed an epoch boundary together (a training run
hung at the last step of its first epoch), and `ConcatRows` could raise KeyError evicting a
cached epoch another thread was using. Here 4 threads ask rows in random orders across at
least 3 epoch boundaries, for 50 seeds, and must get exactly what one thread gets, within a
bound that only a hang exceeds. The interpreter's thread switch interval is cut to 1 us so
that threads interleave inside the caches' updates (with the default 5 ms they rarely do).
"""

from __future__ import annotations

import pickle
import sys
import threading
import time

import numpy as np
import pytest

from zaya_jax.data.best_fit import BestFitRows
from zaya_jax.data.global_index import ConcatRows
from zaya_jax.data.mixture import MixedRows
from zaya_jax.data.row_shuffle import ShuffledRows
from zaya_jax.data.synthetic import LengthsCorpus

SEEDS = 50
THREADS = 4
SEQ = 64
# Epoch boundaries crossed per kind: 3, and 12 for ConcatRows, whose old race (a KeyError
# evicting a cached epoch) needs many cache misses to show in most runs.
EPOCHS = {"best_fit": 3, "concat": 12, "mixed": 3, "shuffled": 3}
HANG_BOUND_S = 600.0  # for all 50 seeds of one kind; a pass takes ~1-3 s idle, > 120 s on 2 busy cores


def _corpus(seed: int):
  rng = np.random.default_rng(seed)
  pairs = rng.integers(0, 3 * SEQ // 2, size=90)  # some of 0 pairs, some over SEQ
  return LengthsCorpus(np.array_split(pairs + 1, 3), eval_fraction=0.2)  # 3 shards


def _best_fit(seed):
  return BestFitRows(_corpus(seed), seed=(seed, 1), seq_len=SEQ, window=16)


def _concat(seed):
  return ConcatRows(_corpus(seed), SEQ, shuffle_seed=seed, train_seed=1)


def _mixed(seed):
  return MixedRows([_best_fit(seed), _concat(seed + 1000)], [0.6, 0.4])


def _shuffled(seed):  # data.shuffle_rows over best_fit: stateless itself, its inner index locks
  return ShuffledRows(_best_fit(seed), 7, (seed, 1))


def _rows_spanning_epochs(kind: str, seed: int) -> int:
  """Rows to ask for: past EPOCHS[kind] epoch boundaries of every source."""
  epochs = EPOCHS[kind]
  concat_rows = -(-epochs * _concat(seed).pairs_per_epoch() // SEQ) + 1
  if kind == "concat":
    return concat_rows
  b = _best_fit(seed)
  best_fit_rows = sum(b.rows_per_epoch(e) for e in range(epochs)) + 1
  if kind in ("best_fit", "shuffled"):
    return best_fit_rows
  concat_rows = -(-epochs * _concat(seed + 1000).pairs_per_epoch() // SEQ) + 1
  return int(max(best_fit_rows / 0.6, concat_rows / 0.4)) + 2  # mixed: 0.6 / 0.4 of the rows


# (Eval rows are a one-pass generator, `global_index.eval_rows`, read by one thread.)
MAKE = {"best_fit": _best_fit, "concat": _concat, "mixed": _mixed, "shuffled": _shuffled}


@pytest.fixture
def fast_thread_switches():
  before = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  yield
  sys.setswitchinterval(before)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MAKE))
def test_concurrent_rows_equal_serial_rows(kind, fast_thread_switches):
  deadline = time.monotonic() + HANG_BOUND_S
  for seed in range(SEEDS):
    n = _rows_spanning_epochs(kind, seed)
    serial = MAKE[kind](seed)
    want = [serial.row(r) for r in range(n)]
    shared = MAKE[kind](seed)  # fresh: the threads race to fill its caches
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(n) for _ in range(THREADS)]
    got: list[dict[int, object]] = [{} for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def ask(i):
      try:
        start.wait()
        for r in orders[i]:
          got[i][int(r)] = shared.row(int(r))
      except BaseException as e:  # pylint: disable=broad-except  # reported below
        errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    assert not hung, (f"{kind}, seed {seed}: {hung} of {THREADS} threads still in row() after "
                      f"{HANG_BOUND_S:.0f} s (a hang)")
    assert not errors, f"{kind}, seed {seed}: {errors[0]!r}"
    for i in range(THREADS):
      bad = [r for r in range(n) if got[i][r] != want[r]]
      assert not bad, f"{kind}, seed {seed}, thread {i}: rows {bad[:5]} differ from serial"


@pytest.mark.parametrize("kind", sorted(MAKE))
def test_used_index_pickles_and_gives_the_same_rows(kind):
  """grain's worker processes pickle the index (with its lock and caches) after use."""
  rows = MAKE[kind](3)
  n = _rows_spanning_epochs(kind, 3)
  want = [rows.row(r) for r in range(n)]
  copy = pickle.loads(pickle.dumps(rows))
  assert [copy.row(r) for r in reversed(range(n))] == want[::-1]
