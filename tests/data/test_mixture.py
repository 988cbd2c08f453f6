"""Mixtures: parse errors, grain's exact mixing arithmetic, closed-form counts, long-run
weights, phases that keep each source's stream continuous, JSON state round trip."""

import json

import grain
import numpy as np
import pytest

from zaya_jax.data.mixture import (MixedRows, MixtureError, int_proportions, mix_counts,
                                   mix_locate, parse_mixture)


class Rows:
  """A stand-in RowIndex: row k of source s is one piece naming (s, k)."""

  def __init__(self, s):
    self.s = s

  def row(self, k):
    return [(self.s, k, k + 1)]


def _sources(n):
  return [Rows(s) for s in range(n)]


def test_parse_mixture():
  assert parse_mixture("DIR_A:0.7, DIR_B:0.3") == [("DIR_A", 0.7), ("DIR_B", 0.3)]
  assert parse_mixture("gs://b/x:2,/d/y:1") == [("gs://b/x", 2.0), ("/d/y", 1.0)]
  for bad, msg in [("", "empty"), ("DIR_A", "not DIR:WEIGHT"), (":0.5", "not DIR:WEIGHT"),
                   ("A:x", "is not a number"), ("A:0", "> 0"), ("A:-1", "> 0"),
                   ("A:nan", "> 0"), ("A:1,A:2", "given twice")]:
    with pytest.raises(MixtureError, match=msg) as e:
      parse_mixture(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1.0, 3.0, 0.25, 2.0]])
def test_equals_grain_mix(weights):
  """Row for row, grain.MapDataset.mix over one range dataset per source."""
  n = 10**4
  parents = [grain.MapDataset.range(n).map(lambda k, i=i: (i, k)) for i in range(len(weights))]
  mixed = grain.MapDataset.mix(parents, weights)
  ours = MixedRows(_sources(len(weights)), weights)
  want = [mixed[r] for r in range(n)]
  assert [ours.locate(r) for r in range(n)] == want
  assert int_proportions(weights) == tuple(
      int(w * 100 / min(weights)) for w in weights)


@pytest.mark.parametrize("props", [(233, 100), (250, 150, 100), (100, 0, 300)])
def test_counts_closed_form_equals_brute_force(props):
  seen = [0] * len(props)
  for r in range(5000):
    assert mix_counts(r, props) == seen
    i, k = mix_locate(r, props)
    assert k == seen[i] and props[i] > 0  # each source's rows in order, none skipped
    seen[i] += 1


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2]])
def test_long_run_weights(weights):
  rows = 10**5
  m = MixedRows(_sources(len(weights)), weights)
  got = np.array(m.counts(rows)) / rows
  assert np.allclose(got, weights, rtol=0.01)
  p = np.array(int_proportions(weights))
  assert np.all(np.abs(np.array(m.counts(rows)) - rows * p / p.sum()) <= 1)  # exact, +-1 row
  sample = np.bincount([m.locate(r)[0] for r in range(0, rows, 7)], minlength=len(weights))
  assert np.allclose(sample / sample.sum(), weights, rtol=0.01)


def test_phase_change_keeps_streams_continuous():
  m = MixedRows(_sources(3), [0.7, 0.3, 0.0], names=["web", "code", "math"])
  r0, r1, end = 1001, 2500, 6000
  m = m.with_phase(r0, [0.2, 0.5, 0.3]).with_phase(r1, [0.0, 0.5, 0.5])
  assert [p.start_row for p in m.phases] == [0, r0, r1]
  used = [[] for _ in range(3)]
  for r in range(end):
    i, k = m.locate(r)
    assert m.row(r) == (i, [(i, k, k + 1)])
    used[i].append(k)
    if r + 1 in (r0, r1, end) or r % 97 == 0:
      assert m.counts(r + 1) == [len(u) for u in used]
  for u in used:
    assert u == list(range(len(u)))  # no source row twice, none skipped
  assert len(used[2]) > 0 and m.counts(r0)[2] == 0  # math only from the second phase on
  assert m.counts(end)[0] == m.counts(r1)[0]  # web left out of the last phase
  local = np.diff([m.counts(r1), m.counts(end)], axis=0)[0]
  assert np.allclose(local / (end - r1), [0, 0.5, 0.5], atol=1e-3)


def test_same_weights_no_new_phase_and_same_row_replaces():
  m = MixedRows(_sources(2), [0.7, 0.3])
  assert m.with_phase(500, [0.7, 0.3]) is m
  a = m.with_phase(500, [0.5, 0.5])
  b = a.with_phase(800, [0.1, 0.9])
  # a second resume at row 800 with other weights replaces the phase that began there
  c = b.with_phase(800, [0.9, 0.1])
  assert [(p.start_row, p.weights) for p in c.phases] == [
      (0, (0.7, 0.3)), (500, (0.5, 0.5)), (800, (0.9, 0.1))]
  assert [c.locate(r) for r in range(800)] == [b.locate(r) for r in range(800)]
  assert c.phases[2].offsets == b.phases[2].offsets == tuple(a.counts(800))
  with pytest.raises(MixtureError, match="cannot start before"):
    c.with_phase(600, [0.3, 0.7])


def test_state_round_trip_and_new_source():
  m = MixedRows(_sources(2), [0.7, 0.3], names=["A", "B"]).with_phase(300, [0.4, 0.6])
  state = json.loads(json.dumps(m.state()))
  back = MixedRows.from_state(state, _sources(2), ["A", "B"])
  assert [back.locate(r) for r in range(1000)] == [m.locate(r) for r in range(1000)]
  grown = MixedRows.from_state(state, _sources(3), ["A", "B", "C"]).with_phase(700, [1, 1, 1])
  assert [grown.locate(r) for r in range(700)] == [m.locate(r) for r in range(700)]
  assert grown.counts(700) == m.counts(700) + [0]
  assert grown.weights == (1.0, 1.0, 1.0)
  with pytest.raises(MixtureError, match="keep the checkpoint's directories first"):
    MixedRows.from_state(state, _sources(2), ["B", "A"])


def test_bad_mixture():
  with pytest.raises(MixtureError, match="at least one > 0"):
    MixedRows(_sources(2), [0, 0])
  with pytest.raises(MixtureError, match="2 weights for 3 sources"):
    MixedRows(_sources(3), [1, 2])
