"""Opening a prepared corpus (`zaya_jax.data.manifest`): manifest, shard checks, records, split.

# Shapes: S shards, n documents of one shard, N documents in all.

Nothing lists the corpus and nothing per document is held for the whole corpus: opening reads
`manifest.json` and stats the shard files (O(S)). A shard's `.lengths.npy` is memory-mapped
and checked (its size and sum against the manifest) the first time a row needs it, and the
records are read by random access, one ArrayRecord reader per shard opened on demand (a few
kept open). So a process holds O(S) integers plus a few shards' worth of per-document arrays,
whatever N (issue 27).

The eval split holds out a document iff a stable 64-bit hash (splitmix64) of its global id,
as a fraction of 2**64, is below `data.eval_fraction`: the same on every process and run,
independent of the seed, decided per shard when the shard is read (`shard_split`), never over
all ids at once.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from typing import Any

import grain
import numpy as np

from zaya_jax.data.mixture import parse_mixture
from zaya_jax.data.manifest import (MANIFEST_FILE, TOKEN_DTYPE, Manifest, ManifestError,
                                    check_shards, is_prepared_dir, read_manifest)

_CACHED_SHARDS = 8  # per-shard split arrays kept (LRU)
_OPEN_READERS = 16  # ArrayRecord readers kept open (LRU)


def eval_scores(doc_ids: np.ndarray) -> np.ndarray:
  """float64 [n] in [0, 1): splitmix64(doc_id) / 2**64 for int [n] global document ids."""
  with np.errstate(over="ignore"):
    z = doc_ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def manifest_digest(directory: str) -> str:
  """sha256 (16 hex digits) of `directory/manifest.json`: identifies the corpus in states."""
  with open(os.path.join(directory, MANIFEST_FILE), "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


class PreparedCorpus:
  """One prepared directory, opened (module docstring: O(S) memory, shards read on demand).

  Attributes:
    directory, manifest (its Manifest), digest (`manifest_digest`), eval_fraction.
    shard_docs: int64 [S] documents per shard; shard_first: int64 [S + 1] the global id of
      each shard's first document (last = N).
    tokens_total: tokens of the corpus (bos/eos included), from the manifest.

  Thread-safe (grain's prefetch threads share it) and picklable (caches, readers and the lock
  are left out and rebuilt), so grain worker processes can read it.
  """

  def __init__(self, directory: str, eval_fraction: float, verify_checksums: bool = False,
               field: str = "data.source", manifest: Manifest | None = None):
    """Reads and checks the manifest and the shards' sizes (sha256 if `verify_checksums`).

    `manifest`: given instead of read (a synthetic corpus, zaya_jax/perf/loader_scale.py; no
    file is checked then).

    Raises:
      ManifestError: (a ValueError) one line naming `field`, the file and the fix: no
        manifest, a missing/truncated/altered shard, an empty corpus.
    """
    self.directory = directory
    self.field = field
    self.eval_fraction = float(eval_fraction)
    if manifest is None:
      if os.path.isdir(directory) and not is_prepared_dir(directory):
        raise ManifestError(
            f"{field}={directory!r} is a directory without {MANIFEST_FILE}, so not a prepared "
            "corpus; make one with python -m launch.prepare_data --source=GLOBS "
            f"--tokenizer=byte|PATH --out={directory}, or give a glob of raw text files such "
            f"as {os.path.join(directory, '*.txt')}")
      try:
        manifest = read_manifest(directory)
        check_shards(directory, manifest, verify_checksums)
      except ManifestError as e:
        raise ManifestError(f"{field}={directory!r}: {e}") from e
      self.digest = manifest_digest(directory)
    else:
      self.digest = hashlib.sha256(f"{manifest.sources[0].path}:{len(manifest.shards)}:"
                                   f"{manifest.tokens}".encode()).hexdigest()[:16]
    self.manifest: Manifest = manifest
    self.shard_docs = np.fromiter((s.documents for s in manifest.shards), np.int64,
                                  len(manifest.shards))
    self.shard_first = np.concatenate([[0], np.cumsum(self.shard_docs)]).astype(np.int64)
    self.tokens_total = int(sum(s.tokens for s in manifest.shards))
    if self.shard_first[-1] == 0:
      raise ManifestError(f"{field}={directory!r}: the corpus holds no document; prepare it "
                          "from non-empty sources")
    self._reset()

  def _reset(self) -> None:
    self._lock = threading.Lock()
    self._splits: collections.OrderedDict[int, tuple] = collections.OrderedDict()
    self._readers: collections.OrderedDict[int, Any] = collections.OrderedDict()

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_splits", "_readers")}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._reset()

  @property
  def tokenizer(self):
    """The manifest's TokenizerInfo (vocab_size, bos_id, eos_id, pad_id)."""
    return self.manifest.tokenizer

  @property
  def num_shards(self) -> int:
    return int(self.shard_docs.size)

  def __len__(self) -> int:
    return int(self.shard_first[-1])

  def shard_lengths(self, s: int) -> np.ndarray:
    """int [n] tokens of each document of shard s (a memory map of its `.lengths.npy`).

    Raises:
      ManifestError: the file cannot be read, or its size or sum disagrees with the manifest.
    """
    shard = self.manifest.shards[s]
    path = os.path.join(self.directory, shard.lengths)
    try:
      lengths = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
      raise ManifestError(f"{self.field}={self.directory!r}: {path} cannot be read ({e}); "
                          "prepare the corpus again") from e
    if lengths.shape != (shard.documents,) or int(lengths.sum(dtype=np.int64)) != shard.tokens:
      raise ManifestError(f"{self.field}={self.directory!r}: {path} holds {lengths.shape[0]} "
                          f"lengths summing to {int(lengths.sum(dtype=np.int64))}, the manifest "
                          f"says {shard.documents} documents, {shard.tokens} tokens; prepare "
                          "the corpus again")
    return lengths

  def shard_split(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths int64 [n], pairs int64 [n], train bool [n]) of shard s: tokens, (input,
    target) pairs max(length - 1, 0) and the split (module docstring) of its documents, cached
    for the last few shards. Thread-safe.

    Raises:
      ManifestError: as `shard_lengths`.
    """
    with self._lock:
      if s in self._splits:
        self._splits.move_to_end(s)
        return self._splits[s]
    lengths = np.asarray(self.shard_lengths(s), dtype=np.int64)
    ids = np.arange(self.shard_first[s], self.shard_first[s + 1], dtype=np.int64)
    out = (lengths, np.maximum(lengths - 1, 0), eval_scores(ids) >= self.eval_fraction)
    with self._lock:
      self._splits[s] = out
      while len(self._splits) > _CACHED_SHARDS:
        self._splits.popitem(last=False)
    return out

  def locate(self, doc_id: int) -> tuple[int, int]:
    """(shard, index within the shard) of a global document id in [0, N)."""
    s = int(np.searchsorted(self.shard_first, doc_id, side="right")) - 1
    return s, int(doc_id - self.shard_first[s])

  def read_record(self, s: int, i: int) -> bytes:
    """The raw record i of shard s (ArrayRecord random access; readers opened on demand)."""
    with self._lock:
      reader = self._readers.get(s)
      if reader is None:
        reader = grain.sources.ArrayRecordDataSource(
            [os.path.join(self.directory, self.manifest.shards[s].path)])
        self._readers[s] = reader
        while len(self._readers) > _OPEN_READERS:
          self._readers.popitem(last=False)
      else:
        self._readers.move_to_end(s)
    return reader[i]

  def tokens(self, doc_id: int) -> np.ndarray:
    """int32 [length] token ids of one document (one record read).

    Raises:
      ManifestError: the record's size disagrees with its lengths file.
    """
    s, i = self.locate(doc_id)
    ids = np.frombuffer(self.read_record(s, i), dtype=TOKEN_DTYPE).astype(np.int32)
    expected = int(self.shard_split(s)[0][i])
    if ids.size != expected:
      raise ManifestError(f"{self.directory}: document {doc_id} holds {ids.size} tokens, its "
                          f"lengths file says {expected}; prepare the corpus again")
    return ids


def open_sources(cfg) -> list[tuple[PreparedCorpus, float]]:
  """The prepared corpora of a DataConfig with their weights: `data.mixture`'s entries, or
  `data.source` alone (weight 1).

  Raises:
    ManifestError: as PreparedCorpus, naming data.mixture / data.source; also when the
      corpora of a mixture were prepared with different tokenizers.
  """
  if cfg.mixture.strip():
    entries, field = parse_mixture(cfg.mixture), "data.mixture"
  else:
    entries, field = [(cfg.source, 1.0)], "data.source"
  corpora = [(PreparedCorpus(path, cfg.eval_fraction, cfg.verify_checksums, field), weight)
             for path, weight in entries]
  first = corpora[0][0]
  for corpus, _ in corpora[1:]:
    if corpus.tokenizer != first.tokenizer:
      raise ManifestError(
          f"data.mixture: {corpus.directory!r} was prepared with tokenizer "
          f"{corpus.tokenizer.name!r} (vocab {corpus.tokenizer.vocab_size}) and "
          f"{first.directory!r} with {first.tokenizer.name!r} (vocab "
          f"{first.tokenizer.vocab_size}); prepare every source with the same tokenizer")
  return corpora


def uses_prepared(cfg) -> bool:
  """True if the DataConfig reads prepared directories: data.mixture, or a data.source that
  is one directory (with a manifest.json, or without one: then opening it fails with the
  prepare_data command to make it)."""
  if cfg.mixture.strip():
    return True
  return cfg.source != "stdlib" and os.path.isdir(cfg.source)
