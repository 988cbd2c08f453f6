"""Grain pipelines: documents -> tokens -> packed rows of T tokens -> batches of B rows.

# Shapes: B batch rows (per process), T sequence length (seq_len).

Every batch is a dict of numpy arrays, all [B, T]:
  inputs       int32    token ids
  targets      int32    the next token of the same document; pad_id on padding
  segment_ids  int32    1, 2, ... per document piece within the row; 0 = padding
  positions    int32    position inside the document piece, restarting at 0 per segment
  loss_mask    float32  1.0 where `targets` is a real next token of the same document

How documents become rows:
  * A document is tokenized as [bos] + tokens + [eos] (per `add_bos` / `add_eos`) and
    shifted *before* packing: inputs = ids[:-1], targets = ids[1:]. So every input token
    carries its own document's next token, there are no cross-document pairs to mask, and
    loss_mask is simply segment_ids > 0. (The final eos is a target, never an input.)
  * grain's `ConcatThenSplitIterDataset` concatenates these pairs and cuts them every T
    tokens, with no padding except at the very end of a finite (eval) stream. A document
    longer than the room left in a row is split; its continuation opens the next row as
    segment 1 with positions restarting at 0 (attention is segment-masked, so the piece
    cannot see its earlier context anyway; the target of the last token of the first piece
    is still the true next token).
  * Training repeats forever; each epoch is reshuffled (grain folds the epoch into the
    shuffle seed). With data.shuffle_rows the packed rows are then shuffled in windows of
    data.shuffle_window rows (`zaya_jax.data.row_shuffle`), so a batch's rows are not
    consecutive cuts of the same document. The iterator state is a few integers: restoring
    replays at most one partially packed row (and, with the row shuffle, re-packs the current
    window), so resume is exact and cheap, also when T changes (`PackedIterator`,
    `carry_position`).
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags, logging
import grain
import numpy as np

from zaya_jax.data import global_iterator, prepared, row_shuffle, sources
from zaya_jax.data.config import DataConfig
from zaya_jax.data.mixture import parse_mixture
from zaya_jax.data.tokenizer import Tokenizer, load_tokenizer

# grain reads documents in threads; tokenization is GIL-bound Python (byte tokenizer) or
# Rust that releases the GIL (HF), so a couple of threads and a short read-ahead suffice.
# The buffer holds whole tokenized documents (a stdlib file is ~20k tokens), so keep it small.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


@dataclasses.dataclass(frozen=True)
class TokenizeDocument:
  """{"text": str} -> {"inputs": [n] int32, "targets": [n] int32}, n = len(ids) - 1.

  ids = [bos] + tokenizer.encode(text) + [eos]; inputs = ids[:-1], targets = ids[1:].
  Returns None for documents with fewer than 2 ids (nothing to predict); grain drops them.
  """

  tokenizer: Tokenizer
  add_bos: bool
  add_eos: bool

  def __call__(self, document: dict[str, str]) -> dict[str, np.ndarray] | None:
    ids = self.tokenizer.encode(document["text"])
    if self.add_bos:
      ids = [self.tokenizer.bos_id, *ids]
    if self.add_eos:
      ids.append(self.tokenizer.eos_id)
    if len(ids) < 2:
      return None
    ids = np.asarray(ids, dtype=np.int32)
    return {"inputs": ids[:-1], "targets": ids[1:]}


@dataclasses.dataclass(frozen=True)
class FinalizeBatch:
  """grain's packed batch -> the contract's batch (see the module docstring).

  Renames `inputs_segment_ids` / `inputs_positions` (grain's names for the packing
  metadata), writes pad_id where segment_ids == 0, and adds loss_mask.
  """

  pad_id: int

  def __call__(self, packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids_BT = packed["inputs_segment_ids"].astype(np.int32)
    is_token_BT = segment_ids_BT > 0
    return {
        "inputs": np.where(is_token_BT, packed["inputs"], self.pad_id).astype(np.int32),
        "targets": np.where(is_token_BT, packed["targets"], self.pad_id).astype(np.int32),
        "segment_ids": segment_ids_BT,
        "positions": np.where(is_token_BT, packed["inputs_positions"], 0).astype(np.int32),
        "loss_mask": is_token_BT.astype(np.float32),
    }


_WINDOW_START = "parent_window_start_state"  # grain's WindowShuffle iterator state key


def _slices_as_tuples(state):
  """Copy of an iterator state with every `remainder_slices` entry turned back into a tuple.

  grain 0.2.18's ConcatThenSplit compares slices with `!= (-1, -1)`; after the JSON round
  trip of `grain.checkpoint` they are lists, `[-1, -1] != (-1, -1)`, and a state saved at a
  row boundary would restore with the next document silently emptied.
  """
  if isinstance(state, dict):
    return {
        key: ({k: tuple(v) for k, v in value.items()} if key == "remainder_slices"
              else _slices_as_tuples(value))
        for key, value in state.items()
    }
  if isinstance(state, (list, tuple)):
    return type(state)(_slices_as_tuples(value) for value in state)
  return state


class PackedIterator(grain.DatasetIterator):
  """The training iterator: passes batches through; its state is grain's packing state.

  The state (grain 0.2.18's ConcatThenSplit) is the parent position and token slice of the
  document being packed at the last moment the row buffer was empty, plus the number of rows
  emitted since: rows of the writing run's T. `saved_seq_len` (set by the checkpointer from
  the saved config before a restore) names that T; when it differs from this iterator's,
  `set_state` converts the position to the same document token (`carry_position`), so a
  `train.seq_len` change on resume neither skips nor repeats tokens. `set_state` also repairs
  the JSON round trip of the slices (`_slices_as_tuples`).

  With data.shuffle_rows the packed rows pass through grain's `WindowShuffleIterDataset`
  (windows of `shuffle_window` rows, `zaya_jax.data.row_shuffle`); the state is then
  `{"parent_window_start_state": the packing state at the window's start, "window_index",
  "pos_in_window"}`: restoring re-packs that window and drops the rows already read. A state
  of the other kind (the shuffle turned on or off on resume) is converted, with a warning.

  Attributes:
    seq_len: T of the rows this iterator yields.
    saved_seq_len: T the next `set_state` state counts in; None = `seq_len`.
    shuffle_window: rows per row-shuffle window, 0 without the shuffle.
  """

  def __init__(self, parent: grain.DatasetIterator, seq_len: int,
               tokens: grain.MapDataset | None, shuffle_window: int = 0):
    super().__init__(parent)
    self.seq_len = seq_len
    self.shuffle_window = shuffle_window  # rows per row-shuffle window; 0 = no shuffle
    self.saved_seq_len: int | None = None
    self._tokens = tokens  # documents in packing order (None: built in worker processes)

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    state = _slices_as_tuples(state)
    saved = self.saved_seq_len or self.seq_len
    if self._tokens is None:  # worker processes: per-worker states, passed through as saved
      if saved != self.seq_len:
        raise ValueError(f"cannot convert a data position from rows of {saved} tokens to "
                         f"{self.seq_len} with data.num_workers > 0")
      self._parent.set_state(state)
      return
    shuffled_state = isinstance(state, dict) and _WINDOW_START in state
    packing = state[_WINDOW_START] if shuffled_state else state
    window_index = state["window_index"] if shuffled_state else 0
    read = state["pos_in_window"] if shuffled_state else 0  # rows of that window handed out
    if saved != self.seq_len:
      packing = carry_position(packing, saved, self.seq_len, self._document_length)
      if read:
        logging.warning("data: train.seq_len changed inside a row-shuffle window; its %d "
                        "rows are cut anew at %d tokens from the window's start, so the "
                        "tokens of the %d rows already read are read again",
                        self.shuffle_window, self.seq_len, read)
      read = 0
    if not self.shuffle_window:
      if shuffled_state:
        logging.warning("data: the saved position is inside a row-shuffle window and "
                        "data.shuffle_rows is now off; the window's rows are read again in "
                        "order from its start (%d rows already read are repeated)", read)
      self._parent.set_state(packing)
      return
    if not shuffled_state:
      logging.warning("data: the saved position has no row shuffle (data.shuffle_rows was "
                      "off); rows are shuffled from here on, in windows of %d",
                      self.shuffle_window)
    self._parent.set_state({_WINDOW_START: packing, "window_index": window_index,
                            "pos_in_window": read})

  def _document_length(self, index: int) -> int:
    features = self._tokens[index]
    return 0 if features is None else len(features["inputs"])


def carry_position(state: dict, saved_seq_len: int, seq_len: int, document_length) -> dict:
  """A packing state counted in rows of `saved_seq_len` tokens -> the same token position,
  expressed so that rows of `seq_len` tokens start there.

  The saved position is `elements_from_buffer_after_checkpoint` rows of `saved_seq_len`
  tokens after the start of the remainder slice (or of document `next_index`, without a
  remainder). Walking that many tokens through the documents gives the document and token
  offset of the next unread token; the result is a state whose remainder is that document
  from that token on, with no rows to replay.

  Args:
    state: the iterator state (in-process pipeline: parent state `{"next_index": i}`).
    saved_seq_len, seq_len: T of the saved rows and of the rows to come.
    document_length: index in the packing order -> tokens of that document's `inputs`
      (0 for a document the tokenizer dropped).

  Returns:
    The converted state (a new dict).
  """
  skip = int(state["elements_from_buffer_after_checkpoint"]) * saved_seq_len
  index = int(state["parent_state"]["next_index"])
  slices = state["remainder_slices"]
  start, stop = slices["inputs"]
  if (start, stop) == (-1, -1):  # no remainder: the stream starts at document `index`
    start, stop = 0, document_length(index)
  while skip >= stop - start:
    skip -= stop - start
    index += 1
    start, stop = 0, document_length(index)
  return {"parent_state": {**state["parent_state"], "next_index": index},
          "remainder_slices": {key: (start + skip, stop) for key in slices},
          "elements_from_buffer_after_checkpoint": 0}


def empty_split_message(cfg: DataConfig, split: str, num_documents: int) -> str:
  """The advice for an empty `split` ("train" | "eval") of `num_documents` documents.

  A document is held out when a hash of its id falls below data.eval_fraction, so a small
  corpus can hold out none even with eval_fraction > 0: the message then says so, how many
  held-out documents that fraction expects, and the fixes (a larger fraction, more documents,
  or train.eval_batches=0 to train without evaluation).
  """
  where = f"data.source={cfg.source!r} ({num_documents} documents)"
  if split == "train":
    return (f"data.eval_fraction={cfg.eval_fraction} holds out every document of {where}, "
            "leaving the train split empty; lower data.eval_fraction or add documents.")
  if cfg.eval_fraction == 0:
    return (f"data.eval_fraction=0 holds out no document of {where} for evaluation; set "
            "data.eval_fraction > 0 (e.g. 0.02) or train.eval_batches=0 (no evaluation).")
  suggest = min(0.5, max(2.0 * cfg.eval_fraction, 3.0 / max(num_documents, 1)))
  return (f"data.eval_fraction={cfg.eval_fraction} held out none of the {num_documents} "
          f"documents of data.source={cfg.source!r} (expected about "
          f"{cfg.eval_fraction * num_documents:.2g}: the corpus is too small for that "
          f"fraction); raise data.eval_fraction (e.g. {suggest:.2g}), add documents, or set "
          "train.eval_batches=0 to train without evaluation.")


def _split_for_process(
    cfg: DataConfig, *, split: str, process_index: int, process_count: int,
    documents: list[sources.DocumentRef] | None = None,
) -> list[sources.DocumentRef]:
  """This process's documents of one split: refs[process_index::process_count], of
  `documents` (`sources.list_documents(cfg)`, listed here if None)."""
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in [0, {process_count}).")
  if documents is None:
    documents = sources.list_documents(cfg)
  train, held_out = sources.split_documents(documents, cfg.eval_fraction)
  refs = train if split == "train" else held_out
  if not refs:
    raise ValueError(empty_split_message(cfg, split, len(documents)))
  shard = refs[process_index::process_count]
  if not shard:
    raise ValueError(
        f"data.source={cfg.source!r} has {len(refs)} {split} documents, fewer than "
        f"process_count={process_count}; every process needs at least one. Add documents."
    )
  return shard


def _tokens(documents: grain.MapDataset, tokenizer: Tokenizer, cfg: DataConfig) -> grain.MapDataset:
  """documents -> TokenizeDocument (random access: `carry_position` reads lengths from it)."""
  return documents.map(TokenizeDocument(tokenizer, cfg.add_bos, cfg.add_eos))


def _packed_batches(
    tokens: grain.MapDataset,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    drop_remainder: bool,
    shuffle_window: int = 0,
    shuffle_seed: int = 0,
) -> grain.IterDataset:
  """tokenized documents -> ConcatThenSplit(T) -> [WindowShuffle(W)] -> batch(B) ->
  FinalizeBatch; `shuffle_window` 0 = rows in packing order."""
  if seq_len < 1 or batch_size < 1:
    raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must both be >= 1.")
  rows = grain.experimental.ConcatThenSplitIterDataset(
      tokens.to_iter_dataset(_READ_OPTIONS),
      length_struct={"inputs": seq_len, "targets": seq_len},
  )
  if shuffle_window:
    rows = grain.experimental.WindowShuffleIterDataset(rows, window_size=shuffle_window,
                                                       seed=shuffle_seed)
  return rows.batch(batch_size, drop_remainder=drop_remainder).map(
      FinalizeBatch(tokenizer.pad_id)
  )


def make_train_iterator(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    documents: list[sources.DocumentRef] | None = None,
) -> grain.DatasetIterator:
  """Infinite, deterministic, checkpointable iterator over packed training batches.

  Args:
    cfg: the data config.
    seq_len: T, tokens per row.
    batch_size: B, rows per batch *on this process*.
    seed: training seed; the document order is a function of (cfg.shuffle_seed, seed).
    process_index, process_count: this process reads only the train documents
      [process_index::process_count] (in corpus order, before shuffling), so processes see
      disjoint documents.
    documents: the corpus as `sources.list_documents(cfg)` lists it, for a caller that has
      listed it already (None: listed here); unused for prepared directories.

  Returns:
    A `PackedIterator` yielding dicts of [B, T] numpy arrays (module docstring).
    `it.get_state()` / `it.set_state(state)` and `grain.checkpoint.CheckpointSave(it)` /
    `CheckpointRestore(it)` resume exactly, also from a state of rows of another T
    (`PackedIterator.saved_seq_len`, in-process reading only). With cfg.num_workers > 0
    batches are built in that many worker processes (a different, equally deterministic
    order than in-process).

  A prepared directory (data.source with a manifest.json, or data.mixture) is read through
  the global sample index instead (`zaya_jax.data.global_iterator`): batches independent of
  process_count and num_workers, a process-independent state.

  Raises:
    ValueError: naming the data.* field at fault (empty corpus or split, bad tokenizer).
  """
  if prepared.uses_prepared(cfg):
    return global_iterator.make_global_train_iterator(
        cfg, seq_len=seq_len, batch_size=batch_size, seed=seed, process_index=process_index,
        process_count=process_count)
  tokenizer = load_tokenizer(cfg)
  refs = _split_for_process(cfg, split="train", process_index=process_index,
                            process_count=process_count, documents=documents)
  shuffle_seed = int(np.random.SeedSequence([cfg.shuffle_seed, seed]).generate_state(1)[0])
  documents = (
      grain.MapDataset.source(sources.DocumentSource(refs, cfg.text_field))
      .seed(shuffle_seed)
      .shuffle()
      .repeat(None)  # infinite; each epoch reshuffled
  )
  tokens = _tokens(documents, tokenizer, cfg)
  window = cfg.shuffle_window if cfg.shuffle_rows else 0
  batches = _packed_batches(
      tokens, tokenizer, seq_len=seq_len, batch_size=batch_size, drop_remainder=True,
      shuffle_window=window, shuffle_seed=row_shuffle.window_seed((cfg.shuffle_seed, seed)),
  )
  if cfg.num_workers > 0:
    if not flags.FLAGS.is_parsed():  # grain reads its absl flags in the worker processes.
      raise ValueError(
          f"data.num_workers={cfg.num_workers} needs parsed absl flags; start the program "
          "with absl.app.run(main) (or call absl.flags.FLAGS.mark_as_parsed()), or set "
          "data.num_workers=0."
      )
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.num_workers))
    tokens = None  # the workers' state is per worker: no position conversion
  return PackedIterator(iter(batches), seq_len, tokens, window)


def make_eval_batches(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    process_index: int = 0,
    process_count: int = 1,
    corpora: list | None = None,
    documents: list[sources.DocumentRef] | None = None,
) -> list[dict[str, np.ndarray]]:
  """The first `max_batches` batches of the held-out split, read in-process.

  With data.shuffle_eval (default) the split's packed rows come in a seeded random order,
  each window of data.shuffle_window rows permuted (seeded by data.shuffle_seed alone, not
  the train seed), so the batches are a sample of the whole split, not its first documents:
  raw text then tokenizes up to one window of held-out rows (or the whole split) before the
  first batch. Without it, the rows in document-id order.

  The last batch is padded to B rows with rows of padding (loss_mask 0). Fewer than
  `max_batches` batches come back if this process's eval documents run out; with several
  processes the counts may then differ, so take the minimum across processes (or choose
  `max_batches` small enough) before a collective eval step.

  Returns:
    A list of dicts of [B, T] numpy arrays, the same format as training batches.

  A prepared directory: `zaya_jax.data.global_iterator.make_global_eval_batches` (global
  batches, this process's slice: the same count on every process), from `corpora` when given
  (the training iterator's opened sources). Raw text: from `documents` when given (the corpus
  as `sources.list_documents(cfg)` lists it; None: listed here).

  Raises:
    ValueError: naming data.eval_fraction if the eval split is empty.
  """
  if prepared.uses_prepared(cfg):
    return global_iterator.make_global_eval_batches(
        cfg, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches,
        process_index=process_index, process_count=process_count, corpora=corpora)
  if max_batches < 1:
    raise ValueError(f"max_batches={max_batches} must be >= 1.")
  tokenizer = load_tokenizer(cfg)
  refs = _split_for_process(cfg, split="eval", process_index=process_index,
                            process_count=process_count, documents=documents)
  documents = grain.MapDataset.source(sources.DocumentSource(refs, cfg.text_field))
  batches = []
  window = cfg.shuffle_window if cfg.shuffle_eval else 0
  for batch in _packed_batches(
      _tokens(documents, tokenizer, cfg), tokenizer, seq_len=seq_len, batch_size=batch_size,
      drop_remainder=False, shuffle_window=window,
      shuffle_seed=row_shuffle.eval_seed(cfg.shuffle_seed),
  ):
    batches.append(_pad_rows(batch, batch_size, tokenizer.pad_id))
    if len(batches) == max_batches:
      break
  return batches


def make_eval_sets(cfg: DataConfig, corpora: list | None = None,
                   documents: list[sources.DocumentRef] | None = None,
                   **kwargs) -> dict[str, list[dict[str, np.ndarray]]]:
  """The eval batches per source: {"": `make_eval_batches(cfg, ...)`} for one corpus; for
  `data.mixture`, {name: that source's first `max_batches` eval batches} with name = the
  directory's basename (the directory itself if two share one), so each source's eval loss
  is reported on its own (a mixture's weights do not mix the eval split).

  Args: as `make_eval_batches` (keyword arguments); `corpora`: the training iterator's opened
    sources, one per mixture entry in order (None: open them); `documents`: the listed raw
    corpus (None: list it).

  Raises:
    ValueError: as `make_eval_batches`, naming the source whose eval split is empty.
  """
  if not cfg.mixture.strip():
    return {"": make_eval_batches(cfg, corpora=corpora, documents=documents, **kwargs)}
  paths = [path for path, _ in parse_mixture(cfg.mixture)]
  names = [os.path.basename(os.path.normpath(p)) for p in paths]
  out = {}
  for i, (path, name) in enumerate(zip(paths, names)):
    single = dataclasses.replace(cfg, mixture="", source=path)
    try:
      out[name if names.count(name) == 1 else path] = make_eval_batches(
          single, corpora=None if corpora is None else [corpora[i]], **kwargs)
    except ValueError as e:
      raise ValueError(f"data.mixture source {path!r}: {e}") from e
  return out


def _pad_rows(batch: dict[str, np.ndarray], batch_size: int, pad_id: int) -> dict:
  """Appends padding rows (pad_id tokens, segment 0, loss_mask 0) up to `batch_size`."""
  missing = batch_size - batch["inputs"].shape[0]
  if missing == 0:
    return batch
  fill = {"inputs": pad_id, "targets": pad_id}
  return {
      key: np.concatenate(
          [value, np.full((missing, value.shape[1]), fill.get(key, 0), dtype=value.dtype)]
      )
      for key, value in batch.items()
  }
