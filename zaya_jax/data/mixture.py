"""Weighted mixtures of row indices, in phases: `data.mixture="DIR_A:0.7,DIR_B:0.3"`.

`MixedRows` maps global row r to (source i, row k of source i) with grain's mixing
arithmetic (`grain.MapDataset.mix`, i.e. `SelectionWithProportionsMap`): the float weights
are scaled so the smallest is 100 and truncated to ints p_i (grain's
`_float_to_int_proportions`); of the first r rows, source 0 gets
r - floor(r (P - p_0) / P), the remaining rows are split the same way among sources 1.. with
P reduced by p_0, and so on. So the long-run share of source i is exactly p_i / sum(p)
(0.7/0.3 -> 233/333 = 0.6997), every prefix is within one row of it per source, and
`counts(r)` is that closed form in O(sources). The arithmetic is re-derived here rather than
called through grain's MapDataset so that a row's source is a stable function of
(weights, r) whatever grain's internals become; tests/data/test_mixture.py checks it equals
`grain.MapDataset.mix` row for row.

Phases: a mixture changed on resume at global row R0 starts a new phase. A phase is
(start_row, weights, offsets): row r >= start_row of phase j is row
offsets_j[i] + k of source i, where (i, k) is the mixing of r - start_row with phase j's
weights, and offsets_j = the rows each source had used before R0. So each source's stream
continues where it stopped: no source row is used twice or skipped. A weight of 0 leaves a
source out of a phase (a source dropped from, or not yet in, the mixture).

`state()` is JSON (names, phases) for the checkpointed data state; `from_state` rebuilds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

Piece = tuple[int, int, int]
_SCALE_MIN_TO = 100  # grain's _float_to_int_proportions default


class RowIndex(Protocol):
  """What a source provides (zaya_jax.data.global_index.RowIndex)."""

  def row(self, r: int) -> list[Piece]: ...


class MixtureError(ValueError):
  """A bad mixture specification or state; the message says what to change."""


def parse_mixture(text: str) -> list[tuple[str, float]]:
  """Parses "PATH:WEIGHT,PATH:WEIGHT,..." (the `data.mixture` string).

  The weight is after the last ':' (paths may hold ':'); weights need not sum to 1.

  Returns:
    [(path, weight)] in the order given.

  Raises:
    MixtureError: empty, an entry without ':', a weight that is not a number or <= 0, a path
      given twice (one line each, naming the entry).
  """
  out: list[tuple[str, float]] = []
  if not text.strip():
    raise MixtureError("data.mixture is empty; give DIR:WEIGHT[,DIR:WEIGHT...], e.g. "
                       "'web:0.7,code:0.3'")
  for entry in text.split(","):
    entry = entry.strip()
    path, sep, weight = entry.rpartition(":")
    path = path.strip()
    if not sep or not path:
      raise MixtureError(f"data.mixture entry {entry!r} is not DIR:WEIGHT (e.g. 'web:0.7')")
    try:
      w = float(weight)
    except ValueError:
      raise MixtureError(f"data.mixture entry {entry!r}: weight {weight!r} is not a number"
                         ) from None
    if not w > 0 or w == float("inf"):
      raise MixtureError(f"data.mixture entry {entry!r}: weight must be a finite number > 0 "
                         "(leave a source out instead of giving it 0)")
    if any(p == path for p, _ in out):
      raise MixtureError(f"data.mixture: {path!r} is given twice; give each directory once")
    out.append((path, w))
  return out


def int_proportions(weights: Sequence[float]) -> tuple[int, ...]:
  """grain's integer proportions: positive weights scaled so the smallest is 100, truncated;
  a weight of 0 stays 0 (that source is not mixed)."""
  if any(w < 0 for w in weights) or not any(w > 0 for w in weights):
    raise MixtureError(f"mixture weights {list(weights)}: need >= 0 and at least one > 0")
  scale = _SCALE_MIN_TO / min(w for w in weights if w > 0)
  return tuple(int(w * scale) if w > 0 else 0 for w in weights)


def mix_counts(r: int, proportions: Sequence[int]) -> list[int]:
  """Rows each source gets among mixed rows [0, r), grain's arithmetic, O(sources).

  Args:
    r: rows, >= 0. proportions: ints >= 0 (zeros are skipped), as from int_proportions.
  """
  counts = [0] * len(proportions)
  remaining = sum(proportions)
  left = r
  for i, p in enumerate(proportions):
    if p == 0:
      continue
    rest = left * (remaining - p) // remaining
    counts[i] = left - rest
    remaining -= p
    left = rest
  return counts


def mix_locate(r: int, proportions: Sequence[int]) -> tuple[int, int]:
  """(source i, row k within source i) of mixed row r >= 0: the source whose count grows
  from [0, r) to [0, r+1); k = its count in [0, r). grain's _dataset_and_key_of_next_element
  with zero proportions skipped."""
  remaining = sum(proportions)
  k, k1 = r, r + 1
  for i, p in enumerate(proportions):
    if p == 0:
      continue
    nk, nk1 = k * (remaining - p) // remaining, k1 * (remaining - p) // remaining
    if k - nk != k1 - nk1:
      return i, k - nk
    remaining -= p
    k, k1 = nk, nk1
  raise AssertionError(f"mix_locate({r}, {tuple(proportions)}): no source")  # unreachable


@dataclasses.dataclass(frozen=True)
class Phase:
  """Rows from `start_row` on mix with `weights`; source i continues at row `offsets[i]`."""

  start_row: int
  weights: tuple[float, ...]
  offsets: tuple[int, ...]

  @property
  def proportions(self) -> tuple[int, ...]:
    return int_proportions(self.weights)


class MixedRows:
  """Global rows drawn from several row indices by weight, in phases (module docstring).

  Args:
    sources: one RowIndex per source (each endless, e.g. epochs repeating).
    weights: the first phase's weights, one per source, >= 0 (at least one > 0).
    phases: instead of `weights`, the phases so far (from a checkpoint); the newest applies
      from its start_row on.
    names: a name per source (its directory) recorded in state(); default "0", "1", ...

  Raises:
    MixtureError: lengths that disagree, bad weights, phases out of order.
  """

  def __init__(self, sources: Sequence[RowIndex], weights: Sequence[float] | None = None,
               phases: Sequence[Phase] | None = None, names: Sequence[str] | None = None):
    self.sources = list(sources)
    n = len(self.sources)
    self.names = [str(i) for i in range(n)] if names is None else [str(x) for x in names]
    if (weights is None) == (phases is None):
      raise MixtureError("MixedRows: give weights (a new mixture) or phases (a resumed one)")
    if phases is None:
      phases = [Phase(0, tuple(float(w) for w in weights), (0,) * n)]
    self.phases = list(phases)
    if len(self.names) != n or not self.phases or self.phases[0].start_row != 0:
      raise MixtureError(f"MixedRows: {n} sources, {len(self.names)} names, first phase must "
                         "start at row 0")
    for a, b in zip(self.phases, self.phases[1:]):
      if b.start_row < a.start_row:
        raise MixtureError(f"MixedRows: phase at row {b.start_row} after one at {a.start_row}")
    for ph in self.phases:
      if len(ph.weights) != n or len(ph.offsets) != n:
        raise MixtureError(f"MixedRows: a phase has {len(ph.weights)} weights for {n} sources")
      ph.proportions  # pylint: disable=pointless-statement  # validates the weights

  @property
  def weights(self) -> tuple[float, ...]:
    """The newest phase's weights."""
    return self.phases[-1].weights

  def _phase(self, r: int) -> Phase:
    if r < 0:
      raise IndexError(f"mixture: row {r} < 0")
    for ph in reversed(self.phases):
      if ph.start_row <= r:
        return ph
    raise AssertionError("first phase starts at 0")  # unreachable

  def locate(self, r: int) -> tuple[int, int]:
    """(source i, row of source i) that global row r is."""
    ph = self._phase(r)
    i, k = mix_locate(r - ph.start_row, ph.proportions)
    return i, ph.offsets[i] + k

  def row(self, r: int) -> tuple[int, list[Piece]]:
    """(source i, its RowIndex pieces) of global row r; document ids are source i's."""
    i, k = self.locate(r)
    return i, self.sources[i].row(k)

  def counts(self, r: int) -> list[int]:
    """Rows each source gave to global rows [0, r), r >= 0; O(sources) per call."""
    if r == 0:
      return [0] * len(self.sources)
    ph = self._phase(r - 1)
    local = mix_counts(r - ph.start_row, ph.proportions)
    return [o + c for o, c in zip(ph.offsets, local)]

  def with_phase(self, start_row: int, weights: Sequence[float]) -> MixedRows:
    """This mixture with `weights` from global row `start_row` on (a resume with a changed
    mixture); `self` when the weights are unchanged. Rows before start_row are unchanged; a
    phase that began at start_row itself (a second resume at the same row) is replaced.

    Raises:
      MixtureError: start_row before the newest phase's start, or bad weights.
    """
    weights = tuple(float(w) for w in weights)
    if weights == self.weights:
      return self
    if start_row < self.phases[-1].start_row:
      raise MixtureError(f"mixture: a new phase at row {start_row} cannot start before the "
                         f"current one (row {self.phases[-1].start_row})")
    kept = [ph for ph in self.phases if ph.start_row < start_row]
    new = Phase(int(start_row), weights, tuple(self.counts(start_row)))
    return MixedRows(self.sources, phases=[*kept, new], names=self.names)

  def state(self) -> dict[str, Any]:
    """JSON-able: {"names": [...], "phases": [{"start_row", "weights", "offsets"}, ...]}."""
    return {"names": list(self.names),
            "phases": [{"start_row": p.start_row, "weights": list(p.weights),
                        "offsets": list(p.offsets)} for p in self.phases]}

  @classmethod
  def from_state(cls, state: dict[str, Any], sources: Sequence[RowIndex],
                 names: Sequence[str]) -> MixedRows:
    """Rebuilds a checkpointed mixture over `sources` named `names`.

    `names` must start with the checkpoint's names, in order; sources beyond them (new in
    this run's mixture) get weight 0 in the old phases. Call with_phase afterwards to apply
    this run's weights from the resume row.

    Raises:
      MixtureError: the checkpoint's sources are not the first of `names` (names both).
    """
    old = list(state["names"])
    names = [str(x) for x in names]
    if names[:len(old)] != old:
      raise MixtureError(f"mixture state: the checkpoint mixed {old}, this run gives {names}; "
                         "keep the checkpoint's directories first and in order (weight 0 to "
                         "leave one out)")
    extra = len(names) - len(old)
    phases = [Phase(int(p["start_row"]), tuple(float(w) for w in p["weights"]) + (0.0,) * extra,
                    tuple(int(o) for o in p["offsets"]) + (0,) * extra)
              for p in state["phases"]]
    return cls(sources, phases=phases, names=names)
