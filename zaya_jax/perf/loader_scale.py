"""The prepared-data index at scale: open, first batch, resume and rows/s on N synthetic documents.

# Shapes: N documents, S shards, B rows per batch, T sequence length.

`measure_scale` writes the manifest of a `zaya_jax.data.synthetic.SyntheticCorpus` (N
documents of mean length M in shards of n; lengths drawn per shard on demand, no token or
lengths file written) to a directory, then times, in this process:
  * open: reading that manifest.json back and opening the corpus (O(S));
  * first batch: the row index (concat or best_fit, row-shuffled as training does) and the
    first [B, T] batch, tokens made up per document;
  * resume: a fresh index given a data state anchor near the end of epoch 1 (the shard
    boundary before row 0.95 x the epoch's rows) and the batch there. With `walk=True` the
    anchor is the true one, found by walking the whole epoch first (O(N): every shard's
    lengths drawn once; its time is `walk_s`); without, it is made from the expected rows per
    shard (the same cost to resume from, but not the true rows: for N where walking an epoch
    takes too long);
  * rows/s over `steps` batches after the first;
and the resident memory (VmRSS, and the peak VmHWM) of the process after each phase.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from zaya_jax.data import DataConfig
from zaya_jax.data import global_iterator, manifest as manifest_lib, synthetic


@dataclasses.dataclass(frozen=True)
class ScaleResult:
  """One `measure_scale` run. Times in seconds, memory in MiB (VmRSS of this process).

  Attributes:
    documents, shards, seq_len, batch_size, packing: what was measured.
    manifest_s: building and writing the synthetic manifest (not part of open).
    open_s, first_batch_s: reading the manifest + opening; index + first batch.
    resume_s: a fresh index + anchor + the batch at the resume row; resume_row: that row.
    walk_s: walking one epoch to find the true anchor (None: the anchor was estimated).
    rows_per_s: rows assembled per second after the first batch, over `steps` batches
      (made-up tokens: the index and batch assembly, no record read).
    index_rows_per_s: rows located per second (pieces only, no tokens), `steps` batches.
    rss_start_mib, rss_open_mib, rss_first_mib, rss_end_mib, peak_mib: VmRSS before opening,
      after open, after the first batch, at the end; VmHWM (the process's peak) at the end.
  """

  documents: int
  shards: int
  seq_len: int
  batch_size: int
  packing: str
  manifest_s: float
  open_s: float
  first_batch_s: float
  resume_s: float
  resume_row: int
  walk_s: float | None
  rows_per_s: float
  index_rows_per_s: float
  rss_start_mib: float
  rss_open_mib: float
  rss_first_mib: float
  rss_end_mib: float
  peak_mib: float


def memory_mib() -> tuple[float, float]:
  """(VmRSS, VmHWM) of this process in MiB, from /proc/self/status (0, 0 where absent)."""
  values = {"VmRSS": 0.0, "VmHWM": 0.0}
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        key = line.split(":")[0]
        if key in values:
          values[key] = int(line.split()[1]) / 1024
  except OSError:
    pass
  return values["VmRSS"], values["VmHWM"]


def measure_scale(documents: int, directory: str, *, seq_len: int = 4096, batch_size: int = 32,
                  steps: int = 20, docs_per_shard: int = 1 << 16, mean_tokens: int = 1400,
                  eval_fraction: float = 0.02, packing: str = "concat", walk: bool = True,
                  seed: int = 0) -> ScaleResult:
  """Times the index on `documents` synthetic documents (module docstring).

  Args:
    documents: N >= 1. directory: where manifest.json is written (created if missing).
    seq_len, batch_size: T and B of the batches; steps: batches timed for rows/s (>= 1).
    docs_per_shard, mean_tokens: the synthetic shards (n documents, M tokens on average).
    eval_fraction, packing: as data.eval_fraction / data.packing.
    walk: find the true resume anchor by walking an epoch (O(N)); else estimate it.

  Raises:
    ValueError: steps < 1, or bad synthetic arguments (from SyntheticCorpus / DataConfig).
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  cfg = DataConfig(source=directory, eval_fraction=eval_fraction, packing=packing)
  rss_start, _ = memory_mib()
  t = time.perf_counter()
  os.makedirs(directory, exist_ok=True)
  manifest_lib.write_manifest(directory, synthetic.synthetic_manifest(
      documents, docs_per_shard, mean_tokens, seed))
  manifest_s = time.perf_counter() - t

  def open_corpus():
    return synthetic.SyntheticCorpus(documents, docs_per_shard, mean_tokens, seed,
                                     eval_fraction, manifest=manifest_lib.read_manifest(directory))

  t = time.perf_counter()
  corpus = open_corpus()
  open_s = time.perf_counter() - t
  rss_open, _ = memory_mib()

  def batch_at(rows, first_row: int) -> dict[str, np.ndarray]:
    source = global_iterator.SingleSource(rows)
    return global_iterator.BuildBatch(source, (corpus,), seq_len, batch_size, batch_size, 0,
                                      first_row, corpus.tokenizer.pad_id)(0)

  t = time.perf_counter()
  rows = global_iterator.row_index(cfg, corpus, seq_len, seed)
  batch_at(rows, 0)
  first_batch_s = time.perf_counter() - t
  rss_first, _ = memory_mib()

  t = time.perf_counter()
  for k in range(1, steps + 1):
    batch_at(rows, k * batch_size)
  rows_per_s = steps * batch_size / (time.perf_counter() - t)
  t = time.perf_counter()
  for r in range((steps + 1) * batch_size, (2 * steps + 1) * batch_size):
    rows.row(r)
  index_rows_per_s = steps * batch_size / (time.perf_counter() - t)

  epoch_rows = _expected_epoch_rows(corpus, cfg, seq_len)
  resume_row = int(0.95 * epoch_rows) // batch_size * batch_size
  walk_s = None
  if walk:
    t = time.perf_counter()
    anchor = rows.anchor(resume_row)
    walk_s = time.perf_counter() - t
  else:
    window = getattr(rows, "window", 1)  # the anchor must precede the row-shuffle window
    anchor = _estimated_anchor(corpus, resume_row // window * window, seq_len, packing)
  t = time.perf_counter()
  fresh = global_iterator.row_index(cfg, open_corpus(), seq_len, seed)
  fresh.add_anchor(anchor)
  batch_at(fresh, resume_row)
  resume_s = time.perf_counter() - t
  rss_end, peak = memory_mib()
  return ScaleResult(documents=documents, shards=corpus.num_shards, seq_len=seq_len,
                     batch_size=batch_size, packing=packing, manifest_s=manifest_s,
                     open_s=open_s, first_batch_s=first_batch_s, resume_s=resume_s,
                     resume_row=resume_row, walk_s=walk_s, rows_per_s=rows_per_s,
                     index_rows_per_s=index_rows_per_s,
                     rss_start_mib=rss_start, rss_open_mib=rss_open, rss_first_mib=rss_first,
                     rss_end_mib=rss_end, peak_mib=peak)


def _expected_epoch_rows(corpus, cfg: DataConfig, seq_len: int) -> int:
  """Rows of one epoch expected from the manifest (train pairs / T)."""
  pairs = (corpus.tokens_total - len(corpus)) * (1.0 - cfg.eval_fraction)
  if cfg.packing == "best_fit":  # ~ rows of whole documents: about one row per T pairs, padded
    pairs /= 0.97
  return max(1, int(pairs) // seq_len)


def _estimated_anchor(corpus, row: int, seq_len: int, packing: str) -> list[int]:
  """An anchor at or before `row` from the expected units per shard (not the true one)."""
  per_shard = (corpus.tokens_total - len(corpus)) / corpus.num_shards
  if packing == "best_fit":
    per_shard /= seq_len * 0.97
    unit = row
  else:
    unit = row * seq_len
  k = min(corpus.num_shards - 1, int(unit // max(per_shard, 1)))
  return [0, k, int(k * per_shard)]


def format_scale(results: list[ScaleResult], required_rows_per_s: float | None = None) -> str:
  """A table: one line per result (times in s, memory in MiB, rows/s and x the need)."""
  head = (f"{'documents':>15} {'shards':>8} {'open s':>7} {'first s':>7} {'resume s':>8} "
          f"{'walk s':>7} {'rows/s':>8} {'x need':>6} {'index rows/s':>12} {'RSS start':>9} {'open':>6} "
          f"{'first':>6} {'end':>6} {'peak':>6}")
  lines = [head]
  for r in results:
    need = f"{r.rows_per_s / required_rows_per_s:.1f}" if required_rows_per_s else "-"
    walk = f"{r.walk_s:.2f}" if r.walk_s is not None else "est."
    lines.append(f"{r.documents:>15,} {r.shards:>8,} {r.open_s:>7.2f} {r.first_batch_s:>7.2f} "
                 f"{r.resume_s:>8.2f} {walk:>7} {r.rows_per_s:>8.0f} {need:>6} {r.index_rows_per_s:>12.0f} "
                 f"{r.rss_start_mib:>9.0f} {r.rss_open_mib:>6.0f} {r.rss_first_mib:>6.0f} "
                 f"{r.rss_end_mib:>6.0f} {r.peak_mib:>6.0f}")
  return "\n".join(lines)
