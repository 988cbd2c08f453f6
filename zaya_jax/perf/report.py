"""Outputs shared by the sweep and micro-benchmark tools: CSV files, text tables, PNG figures.

`mesh_sweep`, `collectives`, `gemm` and `memory` each choose their own columns and panels;
the writing is done here, once: `write_csv` (one dict per row, a fixed column order, empty
cells for missing or None values), `text_table` (fixed-width columns for the console) and
`new_figure` / `save_figure` (a matplotlib `Figure` on the Agg canvas, no pyplot state, saved
at 100 dpi under a wrapped title).
"""

from __future__ import annotations

import csv
import textwrap
from typing import Any, Collection, Iterable, Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


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


def save_figure(fig: Figure, path: str, title: str | None = None, wrap: int | None = None,
                fontsize: int = 8) -> None:
  """Writes `fig` to `path` (PNG, 100 dpi) after `tight_layout`, under the suptitle `title`
  (none if None) wrapped at `wrap` characters (not wrapped if None)."""
  if title is not None:
    fig.suptitle(title if wrap is None else textwrap.fill(title, wrap), fontsize=fontsize)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
