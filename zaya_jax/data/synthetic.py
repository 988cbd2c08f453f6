"""Corpora defined by their lengths alone: for tests and the scale benchmark, no file written.

# Shapes: S shards, n documents of one shard, N documents in all, M mean tokens per document.

Both classes are `prepared.PreparedCorpus` with an in-memory manifest: the row indexes
(`global_index`, `best_fit`) read them exactly as they read a prepared directory, through
`shard_split`. Token ids are made up per document (`synthetic_tokens`), so batches can be
assembled without any record on disk.

* `LengthsCorpus`: given per-shard length arrays (tests: random corpora, empty and one-token
  documents, long documents).
* `SyntheticCorpus`: N documents in shards of `docs_per_shard`, each shard's lengths drawn on
  demand by a seeded function (the gaps between sorted uniform cut points of n * M tokens, so
  every document has >= 1 token, the mean is M and each shard's total is known without
  drawing it); nothing is held per document, so N = 10^10 opens like N = 10^6
  (`zaya_jax.perf.loader_scale`, `launch.bench_loader --synthetic_documents=N`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zaya_jax.data.manifest import Manifest, ShardInfo, SourceInfo, TokenizerInfo
from zaya_jax.data.prepared import PreparedCorpus

BYTE_TOKENIZER = TokenizerInfo(name="byte", sha256="byte", vocab_size=259, bos_id=1, eos_id=2,
                               pad_id=0)


def synthetic_tokens(doc_id: int, length: int, vocab_size: int) -> np.ndarray:
  """int32 [length]: made-up token ids of a document, in [3, vocab_size), distinct per id."""
  start = doc_id % (vocab_size - 3)
  return (np.arange(start, start + length, dtype=np.int32) % (vocab_size - 3) + 3)


def lengths_manifest(shard_docs: Sequence[int], shard_tokens: Sequence[int],
                     name: str) -> Manifest:
  """A Manifest of shards with these document and token counts and no files."""
  shards = tuple(ShardInfo(path=f"{name}/{s}", lengths=f"{name}/{s}.lengths", documents=int(d),
                           tokens=int(t), bytes=0, sha256="")
                 for s, (d, t) in enumerate(zip(shard_docs, shard_tokens)))
  return Manifest(tokenizer=BYTE_TOKENIZER, add_bos=False, add_eos=False, text_field="text",
                  sources=(SourceInfo(path=name, bytes=0, documents=int(sum(shard_docs))),),
                  shards=shards)


class LengthsCorpus(PreparedCorpus):
  """A corpus of the given per-shard token lengths (int [n] each), split by `eval_fraction`.

  Raises:
    ManifestError: no document at all; ValueError: a negative length.
  """

  def __init__(self, lengths: Sequence[np.ndarray], eval_fraction: float = 0.0,
               name: str = "lengths"):
    self._lengths = [np.asarray(x, np.int64) for x in lengths]
    if any((x < 0).any() for x in self._lengths):
      raise ValueError("LengthsCorpus: lengths must be >= 0")
    manifest = lengths_manifest([x.size for x in self._lengths],
                                [int(x.sum()) for x in self._lengths], name)
    super().__init__(name, eval_fraction, manifest=manifest)

  def shard_lengths(self, s: int) -> np.ndarray:
    return self._lengths[s]

  def tokens(self, doc_id: int) -> np.ndarray:
    s, i = self.locate(doc_id)
    return synthetic_tokens(doc_id, int(self._lengths[s][i]), self.tokenizer.vocab_size)


class SyntheticCorpus(PreparedCorpus):
  """N documents of mean length M in shards of `docs_per_shard`, lengths drawn per shard on
  demand (module docstring).

  Args:
    documents: N >= 1; docs_per_shard: n >= 1 (the last shard holds the rest).
    mean_tokens: M >= 1, tokens per document on average (each shard holds exactly n * M).
    seed: the lengths' seed; eval_fraction: as data.eval_fraction.
    manifest: the manifest of these arguments when already built (e.g. read back from a
      manifest.json, to time parsing it); default: built here.

  Raises:
    ValueError: naming the argument out of range.
  """

  def __init__(self, documents: int, docs_per_shard: int = 1 << 16, mean_tokens: int = 1400,
               seed: int = 0, eval_fraction: float = 0.0, manifest: Manifest | None = None):
    if documents < 1 or docs_per_shard < 1 or mean_tokens < 1:
      raise ValueError(f"SyntheticCorpus: documents={documents}, docs_per_shard="
                       f"{docs_per_shard}, mean_tokens={mean_tokens} must all be >= 1")
    self.mean_tokens, self.seed = int(mean_tokens), int(seed)
    if manifest is None:
      manifest = synthetic_manifest(documents, docs_per_shard, mean_tokens, seed)
    super().__init__(manifest.sources[0].path, eval_fraction, manifest=manifest)

  def shard_lengths(self, s: int) -> np.ndarray:
    n = int(self.shard_docs[s])
    total = n * self.mean_tokens
    rng = np.random.default_rng([self.seed, s])
    cuts = np.sort(rng.integers(0, total - n + 1, size=n - 1))
    edges = np.concatenate([[0], cuts, [total - n]])
    return (np.diff(edges) + 1).astype(np.int64)  # >= 1 each, summing to total

  def tokens(self, doc_id: int) -> np.ndarray:
    s, i = self.locate(doc_id)
    length = int(self.shard_split(s)[0][i])
    return synthetic_tokens(doc_id, length, self.tokenizer.vocab_size)


def synthetic_manifest(documents: int, docs_per_shard: int, mean_tokens: int,
                       seed: int) -> Manifest:
  """The Manifest of `SyntheticCorpus(documents, docs_per_shard, mean_tokens, seed)`: O(S)."""
  full, rest = divmod(int(documents), int(docs_per_shard))
  docs = [docs_per_shard] * full + ([rest] if rest else [])
  return lengths_manifest(docs, [d * mean_tokens for d in docs],
                          f"synthetic:N={documents},n={docs_per_shard},M={mean_tokens},"
                          f"seed={seed}")
