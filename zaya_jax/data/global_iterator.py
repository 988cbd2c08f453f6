"""The process-count-independent training iterator over prepared corpora.

# Shapes: B global batch rows (train.batch_size), b = B / P rows of this process (P processes),
# T sequence length.

Global batch k (counted from the iterator's start row R0) is global rows
[R0 + k*B, R0 + (k+1)*B) of a row index (`zaya_jax.data.global_index`, or a mixture of such;
with data.shuffle_rows each source's rows are permuted within windows, `row_shuffle`);
process p builds rows [R0 + k*B + p*b, R0 + k*B + (p+1)*b), reading the records of its pieces
by random access. The batches are a `grain.MapDataset` over k, so they are the same with 0 or
N loader workers (`mp_prefetch` keeps the order), and the same global batch on any P.

`GlobalBatchIterator`'s state counts batches handed out (prefetching does not matter) and is
the same on every process:
  {"format": "zaya-global-v2", "global_batch": k, "next_row": R0 + k*B, "seq_len": T,
   "data": what identifies the rows (manifest digests, packing, seeds),
   "anchors": per source, the shard boundary at or before the first row it has still to give
     (`ConcatRows.anchor` / `BestFitRows.anchor`: [epoch, shard position, unit]), so that a
     resume locates its rows from there instead of walking every shard from row 0,
   "mixture": the mixture's phases (`MixedRows.state()`), for data.mixture only}
so it restores on another process count, worker count or batch size (it continues at
`next_row`). A "zaya-global-v1" state (the per-document index before issue 27, whose
document order this index does not reproduce) is refused with one line naming
`data.v1_state="restart"`, which resumes it with the data order restarted at row 0. A resume with other mixture weights starts a new phase at `next_row`
(`MixedRows.with_phase`): every source continues where it stopped, none repeats or skips a
row, and the change is logged. A state of another `seq_len` is refused (`set_state` raises; the checkpointer
restarts the data order with a warning instead, see zaya_jax/checkpoint/compat.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

from absl import flags, logging
import grain
import numpy as np

from zaya_jax.data import best_fit, global_index, mixture, prepared, row_shuffle

STATE_FORMAT = "zaya-global-v2"
V1_FORMAT = "zaya-global-v1"  # the per-document index (before issue 27)


class DataStateError(ValueError):
  """A saved data position this code will not apply; the message names the migration.
  The checkpointer reports it as a user error (one line), not as a corrupt checkpoint."""
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


class SingleSource:
  """A RowIndex seen as a mixture of one source: `row(r) -> (0, pieces)`."""

  def __init__(self, rows):
    self.rows = rows
    self.seq_len = rows.seq_len

  def row(self, r: int):
    return 0, self.rows.row(r)


def source_indexes(rows) -> list:
  """The per-source row indexes of a SingleSource or a MixedRows."""
  return list(rows.sources) if isinstance(rows, mixture.MixedRows) else [rows.rows]


def source_counts(rows, next_row: int) -> list[int]:
  """Rows each source gave to global rows [0, next_row)."""
  return rows.counts(next_row) if isinstance(rows, mixture.MixedRows) else [next_row]


def assemble_rows(rows: list[tuple[int, list]], corpora: list, seq_len: int,
                  pad_id: int) -> dict[str, np.ndarray]:
  """[(source, pieces)] * b -> the batch dict of [b, T] arrays (zaya_jax/data/pipeline.py).

  Each piece (doc, start, stop) becomes one segment: inputs = ids[start:stop], targets =
  ids[start + 1:stop + 1], positions 0..stop-start-1, segment ids 1, 2, ... per row; the rest
  of the row is padding (pad_id, segment 0, loss_mask 0).
  """
  b = len(rows)
  inputs = np.full((b, seq_len), pad_id, np.int32)
  targets = np.full((b, seq_len), pad_id, np.int32)
  segment_ids = np.zeros((b, seq_len), np.int32)
  positions = np.zeros((b, seq_len), np.int32)
  cache: dict[tuple[int, int], np.ndarray] = {}
  for i, (source, pieces) in enumerate(rows):
    col = 0
    for segment, (doc, start, stop) in enumerate(pieces, 1):
      key = (source, doc)
      if key not in cache:
        cache[key] = corpora[source].tokens(doc)
      ids = cache[key]
      n = stop - start
      if col + n > seq_len:
        raise ValueError(f"row pieces overflow seq_len={seq_len}: {pieces}")
      inputs[i, col:col + n] = ids[start:stop]
      targets[i, col:col + n] = ids[start + 1:stop + 1]
      segment_ids[i, col:col + n] = segment
      positions[i, col:col + n] = np.arange(n, dtype=np.int32)
      col += n
  return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
          "positions": positions, "loss_mask": (segment_ids > 0).astype(np.float32)}


@dataclasses.dataclass(frozen=True)
class BuildBatch:
  """k -> this process's [b, T] slice of global batch k (rows from `start_row`). Picklable."""

  rows: Any  # row(r) -> (source, pieces)
  corpora: tuple
  seq_len: int
  global_batch: int  # B
  local_batch: int  # b
  process_index: int
  start_row: int
  pad_id: int

  def __call__(self, k: int) -> dict[str, np.ndarray]:
    first = self.start_row + k * self.global_batch + self.process_index * self.local_batch
    return assemble_rows([self.rows.row(first + j) for j in range(self.local_batch)],
                         list(self.corpora), self.seq_len, self.pad_id)


class GlobalBatchIterator(grain.DatasetIterator):
  """Endless batches of a row index; its state is process-independent (module docstring).

  Attributes:
    process_independent: True: the checkpointer restores its state on any process count
      and worker count.
    seq_len: T; identity: the "data" entry of the state.
    corpora: [(PreparedCorpus, weight)] the rows are read from, opened once: the loop's
      eval batches and console header reuse them (`make_eval_sets(..., corpora=)`).
  """

  process_independent = True

  def __init__(self, make: Callable[[Any, int], grain.DatasetIterator], rows: Any, *,
               seq_len: int, global_batch: int, identity: dict[str, Any],
               corpora: list[tuple[Any, float]], v1_state: str = "refuse"):
    """`make(rows, start_row)` builds the inner iterator whose k-th element is batch k of
    `rows` (a `SingleSource` or a `mixture.MixedRows`) from `start_row` on."""
    super().__init__()
    self._make = make
    self.rows = rows
    self.seq_len = seq_len
    self.global_batch = global_batch
    self.identity = identity
    self.corpora = corpora
    self.v1_state = v1_state
    self._start_row = 0
    self._batches = 0  # handed out since the start row
    self._batch_base = 0  # the global batch count at the start row
    self._inner = make(rows, 0)

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._inner)
    self._batches += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    next_row = self._start_row + self._batches * self.global_batch
    anchors = [index.anchor(count) for index, count in
               zip(source_indexes(self.rows), source_counts(self.rows, next_row))]
    state = {"format": STATE_FORMAT, "global_batch": self._batch_base + self._batches,
             "next_row": next_row, "seq_len": self.seq_len, "data": self.identity,
             "anchors": anchors}
    if isinstance(self.rows, mixture.MixedRows):
      state["mixture"] = self.rows.state()
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues at the state's `next_row` (rebuilding the inner pipeline there).

    Raises:
      DataStateError: a zaya-global-v1 state with data.v1_state="refuse" (names the fix).
      ValueError: a state of another format (e.g. a raw-text pipeline's) or seq_len.
    """
    if isinstance(state, dict) and state.get("format") == V1_FORMAT:
      self._restart_v1(state)
      return
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
      raise ValueError(f"data iterator state is not a {STATE_FORMAT} state (written by another "
                       "kind of data pipeline); resume with the data config that wrote it")
    if int(state["seq_len"]) != self.seq_len:
      raise ValueError(f"data iterator state counts rows of {state['seq_len']} tokens, this "
                       f"iterator makes rows of {self.seq_len}")
    if state.get("data") != self.identity:
      logging.warning("data iterator: the data changed since the saved position (%s -> %s); "
                      "continuing at global row %d of the new data (a new phase)",
                      state.get("data"), self.identity, int(state["next_row"]))
    next_row = int(state["next_row"])
    if isinstance(self.rows, mixture.MixedRows):
      self.rows = self._resumed_mixture(state.get("mixture"), next_row)
    if state.get("data") == self.identity:  # anchors address this data's rows only
      for index, anchor in zip(source_indexes(self.rows), state.get("anchors", [])):
        index.add_anchor(anchor)
    self._start_row = next_row
    self._batch_base = int(state["global_batch"])
    self._batches = 0
    self._close_inner()  # its worker processes and shared memory, if it started any
    self._inner = self._make(self.rows, self._start_row)

  def _restart_v1(self, state: dict[str, Any]) -> None:
    """A zaya-global-v1 state: refused, or (data.v1_state="restart") the data order restarts
    at row 0 of this index with the saved batch count kept (warned)."""
    if self.v1_state != "restart":
      raise DataStateError(
          f"the checkpoint's data position is a {V1_FORMAT} state (global row "
          f"{state.get('next_row')} of the per-document index replaced by the bounded-memory "
          "index of issue 27, whose document order differs); resume once with "
          "--config.data.v1_state=restart to keep the model, optimizer and step and restart the "
          "data order at row 0")
    logging.warning("data iterator: %s state at global row %s: the data order restarts at row "
                    "0 of the bounded-memory index (data.v1_state=restart)", V1_FORMAT,
                    state.get("next_row"))
    self._start_row = 0
    self._batch_base = int(state.get("global_batch", 0))
    self._batches = 0
    self._close_inner()
    self._inner = self._make(self.rows, 0)

  def _close_inner(self) -> None:
    close = getattr(self._inner, "close", None)
    if close is not None:
      close()

  def close(self) -> None:
    """Stops the inner pipeline: grain's worker processes (data.num_workers > 0) and the
    shared memory of the batches they had made (else left to the resource tracker, which
    warns of leaked shared_memory objects at exit). Idempotent; no batch after it."""
    self._close_inner()
    super().close()

  def _resumed_mixture(self, saved: dict[str, Any] | None, next_row: int) -> mixture.MixedRows:
    """The checkpoint's phases over this run's sources, plus a new phase at `next_row` if
    this run's weights differ (logged)."""
    current = self.rows
    if saved is None:  # a state of a single-source run: this mixture starts at next_row
      logging.warning("data.mixture: the saved data position is not a mixture's; the mixture "
                      "%s starts at global row %d", dict(zip(current.names, current.weights)),
                      next_row)
      return current
    resumed = mixture.MixedRows.from_state(saved, current.sources, current.names)
    changed = resumed.with_phase(next_row, current.weights)
    if changed is not resumed:
      logging.warning("data.mixture changed at global row %d: %s -> %s (a new phase; every "
                      "source continues where it stopped)", next_row,
                      dict(zip(resumed.names, resumed.weights)),
                      dict(zip(current.names, current.weights)))
    return changed

  def start_prefetch(self) -> None:
    start = getattr(self._inner, "start_prefetch", None)
    if start is not None:
      start()


def batch_dataset(build: BuildBatch, num_workers: int) -> grain.IterDataset:
  """grain pipeline of `build` over k = 0, 1, ...: threads, or `num_workers` processes."""
  batches = grain.MapDataset.range(0, 2**62).map(build).to_iter_dataset(_READ_OPTIONS)
  if num_workers > 0:
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return batches


def row_index(cfg, corpus, seq_len: int, seed: int):
  """The RowIndex of one source's train documents per data.packing, row-shuffled per
  data.shuffle_rows (`zaya_jax.data.row_shuffle`; each mixture source on its own, so a
  mixture phase change still continues every source's row stream).

  Raises:
    ValueError: naming data.source / data.eval_fraction if an epoch holds no train pair
      (row 0 is located here, so this fails before training starts).
  """
  if cfg.packing == "best_fit":
    rows = best_fit.BestFitRows(corpus, seed=(cfg.shuffle_seed, seed), seq_len=seq_len,
                                window=cfg.best_fit_window, long_documents=cfg.long_documents)
  else:
    rows = global_index.ConcatRows(corpus, seq_len, cfg.shuffle_seed, seed)
  if cfg.shuffle_rows:
    rows = row_shuffle.ShuffledRows(rows, shuffle_window(cfg, corpus, seq_len),
                                    (cfg.shuffle_seed, seed))
  try:
    rows.row(0)
  except ValueError as e:
    raise ValueError(f"data.source={corpus.directory!r}: {e} (data.eval_fraction="
                     f"{cfg.eval_fraction}; every train document may have < 2 tokens); add "
                     "documents or lower data.eval_fraction.") from e
  return rows


def shuffle_window(cfg, corpus, seq_len: int) -> int:
  """Rows per row-shuffle window of one source: data.shuffle_window, capped at an estimate of
  the rows of one epoch from the manifest alone (the corpus's tokens - documents, the pairs
  of non-empty documents, times 1 - data.eval_fraction; with best_fit at most T pairs per
  document; over T), so that on a small corpus a window does not span many epochs. The same
  on every process: a function of the manifest and the config."""
  documents = len(corpus)
  pairs = max(0, corpus.tokens_total - documents) * (1.0 - cfg.eval_fraction)
  if cfg.packing == "best_fit":
    pairs = min(pairs, documents * (1.0 - cfg.eval_fraction) * seq_len)
  return max(1, min(cfg.shuffle_window, int(pairs) // seq_len))


def _check_processes(batch_size: int, process_index: int, process_count: int) -> None:
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, {process_count}).")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} (rows per process) must be >= 1.")


def make_global_train_iterator(cfg, *, seq_len: int, batch_size: int, seed: int,
                               process_index: int = 0,
                               process_count: int = 1) -> GlobalBatchIterator:
  """Training batches of the prepared corpora of `cfg` (data.source or data.mixture).

  Args: as `zaya_jax.data.pipeline.make_train_iterator`; `batch_size` is this process's b,
    the global batch is B = b * process_count.

  Raises:
    ValueError: (ManifestError included) naming the data.* field and the fix.
  """
  _check_processes(batch_size, process_index, process_count)
  corpora = prepared.open_sources(cfg)
  indexes = [row_index(cfg, corpus, seq_len, seed) for corpus, _ in corpora]
  if cfg.mixture.strip():
    rows = mixture.MixedRows(indexes, [w for _, w in corpora],
                             names=[c.directory for c, _ in corpora])
  else:
    rows = SingleSource(indexes[0])
  global_b = batch_size * process_count
  identity = {"digests": [c.digest for c, _ in corpora],  # weights: in the mixture's phases
              "packing": cfg.packing, "eval_fraction": cfg.eval_fraction,
              "seeds": [cfg.shuffle_seed, seed]}
  if cfg.packing == "best_fit":
    identity.update(window=cfg.best_fit_window, long_documents=cfg.long_documents)
  if cfg.shuffle_rows:
    identity.update(shuffle_window=cfg.shuffle_window)
  pad_id = corpora[0][0].tokenizer.pad_id
  sources = tuple(c for c, _ in corpora)
  if cfg.num_workers > 0:
    if not flags.FLAGS.is_parsed():  # grain reads its absl flags in the worker processes.
      raise ValueError(
          f"data.num_workers={cfg.num_workers} needs parsed absl flags; start the program "
          "with absl.app.run(main) (or call absl.flags.FLAGS.mark_as_parsed()), or set "
          "data.num_workers=0.")

  def make(rows, start_row: int):
    build = BuildBatch(rows, sources, seq_len, global_b, batch_size, process_index, start_row,
                       pad_id)
    return iter(batch_dataset(build, cfg.num_workers))

  return GlobalBatchIterator(make, rows, seq_len=seq_len, global_batch=global_b,
                             identity=identity, corpora=corpora, v1_state=cfg.v1_state)


def make_global_eval_batches(cfg, *, seq_len: int, batch_size: int, max_batches: int,
                             process_index: int = 0,
                             process_count: int = 1,
                             corpora: list[tuple[Any, float]] | None = None
                             ) -> list[dict[str, np.ndarray]]:
  """The first `max_batches` global batches of the held-out rows, this process's slice.

  `corpora`: the opened sources of `cfg` (a training iterator's `corpora`), so that they are
  not opened (lengths read, eval split hashed, shards checked) a second time; default: open.

  Per source, the eval documents in id order, concat-packed; a mixture's sources follow one
  another. With data.shuffle_eval (default) that row stream is then permuted in windows of
  data.shuffle_window rows (`row_shuffle.shuffle_windows`, seeded by data.shuffle_seed
  alone), so the batches are a random sample of the split; the short last row of a source
  may then sit in any batch. The batches are global (B = batch_size * process_count rows),
  so their count and the eval loss do not depend on the process count; the last one is
  padded with empty rows.

  Raises:
    ValueError: naming data.eval_fraction if no source holds out a document.
  """
  if max_batches < 1:
    raise ValueError(f"max_batches={max_batches} must be >= 1.")
  _check_processes(batch_size, process_index, process_count)
  corpora = [c for c, _ in (corpora or prepared.open_sources(cfg))]
  global_b = batch_size * process_count
  limit = max_batches * global_b  # rows needed at most: no shard past them is read
  rows = ((i, pieces) for i, c in enumerate(corpora)
          for pieces in global_index.eval_rows(c, seq_len))
  if cfg.shuffle_eval:
    rows = row_shuffle.shuffle_windows(rows, cfg.shuffle_window,
                                       row_shuffle.eval_seed(cfg.shuffle_seed))
  rows = list(itertools.islice(rows, limit))
  if not rows:
    raise ValueError(f"data.eval_fraction={cfg.eval_fraction} held out no document of "
                     f"{[c.directory for c in corpora]} ({sum(len(c) for c in corpora)} "
                     "documents); raise data.eval_fraction or set train.eval_batches=0.")
  count = min(max_batches, -(-len(rows) // global_b))
  pad_id = corpora[0].tokenizer.pad_id
  out = []
  for k in range(count):
    first = k * global_b + process_index * batch_size
    mine = [rows[r] if r < len(rows) else (0, []) for r in range(first, first + batch_size)]
    out.append(assemble_rows(mine, corpora, seq_len, pad_id))
  return out
