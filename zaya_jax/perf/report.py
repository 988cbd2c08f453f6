"""Outputs shared by the sweep and micro-benchmark tools: CSV files, text tables, PNG figures.

`mesh_sweep`, `collectives`, `gemm` and `memory` each choose their own columns and panels;
the writing is done here, once: `write_csv` (one dict per row, a fixed column order, empty
cells for missing or None values), `text_table` (fixed-width columns for the console) and
`new_figure` / `save_figure` (a matplotlib `Figure` on the Agg canvas, no pyplot state, saved
at 100 dpi under a wrapped title). `save_figure` makes every title and axis label fit inside
the figure (wrapping the ones that do not, then laying out again): `tight_layout` alone left a
title wider than its figure cut off at the left edge ("t load over 20 train records..."), and
`overflowing_texts` lists what still sticks out (tests check every plot with it).
"""

from __future__ import annotations

import csv
import textwrap
from typing import Any, Collection, Iterable, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

_FIT_ATTEMPTS = 4  # wrap-and-relayout rounds of `save_figure`
_SLACK_PX = 1.0  # a text may touch the figure's edge by this much (rounding)


def write_csv(path: str, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
  """Writes `rows` to `path` as CSV: a header line `columns`, then one line per row.

  Args:
    path: the file written (overwritten), UTF-8.
    columns: the column names, in order; keys of a row outside them are ignored.
    rows: one mapping per line; a missing key or a None value is an empty cell.
  """
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in columns} for r in rows)


def text_table(head: Sequence[Any] | None, lines: Iterable[Sequence[Any]], *,
               left: Collection[int] = (), widths: Sequence[int] | None = None,
               sep: str = "  ") -> str:
  """Fixed-width text table: cells right-aligned (columns `left` left-aligned), each line
  right-stripped.

  Args:
    head: the header line, or None for none.
    lines: the rows; cells are formatted with `str`.
    left: indices of the columns aligned left (free text).
    widths: column widths; default the widest cell of each column (header included).
    sep: the text between columns.
  """
  rows = ([] if head is None else [tuple(head)]) + [tuple(line) for line in lines]
  if widths is None:
    widths = [max(len(str(x)) for x in col) for col in zip(*rows)]
  return "\n".join(sep.join(str(x).ljust(w) if i in left else str(x).rjust(w)
                            for i, (x, w) in enumerate(zip(line, widths))).rstrip()
                   for line in rows)


def new_figure(width: float, height: float) -> Figure:
  """A matplotlib Figure of `width` x `height` inches on the Agg (PNG) canvas."""
  fig = Figure(figsize=(width, height))
  FigureCanvasAgg(fig)
  return fig


def _drawn_tick_labels(axis) -> list[Text]:
  """The tick labels an axis draws: those of ticks inside its view interval (matplotlib keeps
  labels for ticks beyond the limits too, never drawn)."""
  lo, hi = sorted(axis.get_view_interval())
  span = (hi - lo) * 1e-9
  return [label for tick in axis.get_major_ticks() + axis.get_minor_ticks()
          if lo - span <= tick.get_loc() <= hi + span
          for label in (tick.label1, tick.label2) if label.get_visible()]


def _titles_and_labels(fig: Figure, ticks: bool = True) -> list[Text]:
  """The figure's suptitle and each visible axes' titles, axis labels and (`ticks`) tick
  labels (empty texts left out)."""
  texts = [fig._suptitle] if fig._suptitle is not None else []  # pylint: disable=protected-access
  for ax in fig.axes:
    if not ax.get_visible():
      continue
    texts += [ax.title, ax._left_title, ax._right_title,  # pylint: disable=protected-access
              ax.xaxis.label, ax.yaxis.label]
    if ticks:
      texts += [label for axis in (ax.xaxis, ax.yaxis) for label in _drawn_tick_labels(axis)]
  return [t for t in texts if t.get_visible() and t.get_text().strip()]


def _outside(fig: Figure, text: Text, renderer) -> bool:
  box, extent = fig.bbox, text.get_window_extent(renderer)
  return (extent.x0 < box.x0 - _SLACK_PX or extent.x1 > box.x1 + _SLACK_PX
          or extent.y0 < box.y0 - _SLACK_PX or extent.y1 > box.y1 + _SLACK_PX)


def overflowing_texts(fig: Figure) -> list[str]:
  """The titles, axis labels and tick labels of `fig` (as laid out now) that reach outside
  the figure, i.e. would be cut off in the PNG; [] when everything fits."""
  renderer = fig.canvas.get_renderer()
  return [t.get_text() for t in _titles_and_labels(fig) if _outside(fig, t, renderer)]


def _wrap_to_fit(fig: Figure, text: Text, renderer) -> bool:
  """Re-wraps `text` (a title or label) so that it fits the figure's width (its height for a
  vertical label) around its anchor; False if it cannot be narrowed further."""
  box, extent = fig.bbox, text.get_window_extent(renderer)
  vertical = text.get_rotation() % 180 == 90
  lo, hi, size = ((box.y0, box.y1, extent.height) if vertical else (box.x0, box.x1, extent.width))
  a, b = (extent.y0, extent.y1) if vertical else (extent.x0, extent.x1)
  align = "center" if vertical else text.get_horizontalalignment()
  if align == "left":
    room = hi - a
  elif align == "right":
    room = b - lo
  else:
    middle = (a + b) / 2
    room = 2 * min(middle - lo, hi - middle)
  lines = text.get_text().split("\n")
  longest = max(len(line) for line in lines)
  width = int(longest * max(room, 1.0) / max(size, 1.0) * 0.95)
  if width >= longest or width < 8:
    return False
  text.set_text("\n".join(textwrap.fill(line, width) for line in lines))
  return True


def save_figure(fig: Figure, path: str, title: str | None = None, wrap: int | None = None,
                fontsize: int = 8) -> None:
  """Writes `fig` to `path` (PNG, 100 dpi) under the suptitle `title` (none if None) wrapped
  at `wrap` characters (not wrapped if None). Laid out with `tight_layout`; a title or axis
  label that still reaches outside the figure is wrapped to fit and the layout redone (up to
  `_FIT_ATTEMPTS` rounds), so no text is cut off."""
  if title is not None:
    fig.suptitle(title if wrap is None else textwrap.fill(title, wrap), fontsize=fontsize)
  fig.tight_layout()
  for _ in range(_FIT_ATTEMPTS):
    renderer = fig.canvas.get_renderer()
    wrapped = [_wrap_to_fit(fig, t, renderer) for t in _titles_and_labels(fig, ticks=False)
               if _outside(fig, t, renderer)]
    if not any(wrapped):
      break
    fig.tight_layout()
  fig.savefig(path, dpi=100)
