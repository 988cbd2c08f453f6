"""Opening a prepared corpus (`zaya_jax.data.manifest`): manifest, shard checks, records, split.

Nothing lists the corpus: a process reads `manifest.json`, the `.lengths.npy` files (4 bytes
per document) and, while training, only the records its rows need, by random access through
grain's `ArrayRecordDataSource` over all shards (global document id = record index).

The eval split holds out a document iff a stable 64-bit hash (splitmix64) of its global id,
as a fraction of 2**64, is below `data.eval_fraction`: vectorized over all ids, the same on
every process and run, independent of the seed.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import grain
import numpy as np

from zaya_jax.data.mixture import parse_mixture
from zaya_jax.data.manifest import (MANIFEST_FILE, TOKEN_DTYPE, Manifest, ManifestError,
                                    check_shards, is_prepared_dir, read_manifest)

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


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
  """One prepared directory, opened.

  Attributes:
    directory: the directory; manifest: its Manifest; digest: `manifest_digest`.
    lengths: int64 [N] tokens of each document (bos/eos included), global id order.
    pairs: int64 [N] (input, target) pairs of each document, max(lengths - 1, 0).
    train_ids, eval_ids: int64 sorted global ids of the two splits (disjoint, together 0..N-1).

  Picklable (the record source is reopened lazily), so grain worker processes can read it.
  """

  def __init__(self, directory: str, eval_fraction: float, verify_checksums: bool = False,
               field: str = "data.source"):
    """Reads and checks the manifest and the shards' sizes (sha256 if `verify_checksums`).

    Raises:
      ManifestError: (a ValueError) one line naming `field`, the file and the fix: no
        manifest, a missing/truncated/altered shard, lengths that disagree with the manifest.
    """
    self.directory = directory
    if os.path.isdir(directory) and not is_prepared_dir(directory):
      raise ManifestError(
          f"{field}={directory!r} is a directory without {MANIFEST_FILE}, so not a prepared "
          "corpus; make one with python -m launch.prepare_data --source=GLOBS "
          f"--tokenizer=byte|PATH --out={directory}, or give a glob of raw text files such "
          f"as {os.path.join(directory, '*.txt')}")
    try:
      self.manifest: Manifest = read_manifest(directory)
      check_shards(directory, self.manifest, verify_checksums)
    except ManifestError as e:
      raise ManifestError(f"{field}={directory!r}: {e}") from e
    self.digest = manifest_digest(directory)
    parts = []
    for shard in self.manifest.shards:
      path = os.path.join(directory, shard.lengths)
      try:
        lengths = np.load(path, allow_pickle=False)
      except (OSError, ValueError) as e:
        raise ManifestError(f"{field}={directory!r}: {path} cannot be read ({e}); prepare the "
                            "corpus again") from e
      if lengths.shape != (shard.documents,) or int(lengths.sum()) != shard.tokens:
        raise ManifestError(f"{field}={directory!r}: {path} holds {lengths.shape[0]} lengths "
                            f"summing to {int(lengths.sum())}, the manifest says "
                            f"{shard.documents} documents, {shard.tokens} tokens; prepare "
                            "the corpus again")
      parts.append(lengths.astype(np.int64))
    self.lengths = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
    if self.lengths.size == 0:
      raise ManifestError(f"{field}={directory!r}: the corpus holds no document; prepare it "
                          "from non-empty sources")
    self.pairs = np.maximum(self.lengths - 1, 0)
    ids = np.arange(self.lengths.size, dtype=np.int64)
    held_out = eval_scores(ids) < eval_fraction
    self.train_ids, self.eval_ids = ids[~held_out], ids[held_out]
    self._source = None

  @property
  def tokenizer(self):
    """The manifest's TokenizerInfo (vocab_size, bos_id, eos_id, pad_id)."""
    return self.manifest.tokenizer

  def __len__(self) -> int:
    return int(self.lengths.size)

  def tokens(self, doc_id: int) -> np.ndarray:
    """int32 [lengths[doc_id]] token ids of one document (one record read)."""
    if self._source is None:
      self._source = grain.sources.ArrayRecordDataSource(
          [os.path.join(self.directory, s.path) for s in self.manifest.shards])
    ids = np.frombuffer(self._source[int(doc_id)], dtype=TOKEN_DTYPE).astype(np.int32)
    if ids.size != self.lengths[doc_id]:
      raise ManifestError(f"{self.directory}: document {doc_id} holds {ids.size} tokens, its "
                          f"lengths file says {int(self.lengths[doc_id])}; prepare the corpus "
                          "again")
    return ids

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_source": None}


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

