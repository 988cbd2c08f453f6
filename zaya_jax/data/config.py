"""DataConfig: the frozen, validated description of where training text comes from.

Built from the `data` group of the ml_collections config; the pipeline modules take this
dataclass, never the whole ConfigDict.
"""

from __future__ import annotations

import dataclasses

from zaya_jax.data.mixture import parse_mixture


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Corpus, tokenizer and split of the language-model data pipeline.

  Raises:
    ValueError: on construction, naming the offending field and the fix (e.g. an
      `eval_fraction` outside [0, 1) or a negative `num_workers`).
  """

  # "stdlib" = every *.py file of this Python's standard library, one document each;
  # otherwise comma-separated paths / glob patterns of .txt (one document per file),
  # .jsonl (one document per line, text under `text_field`) or .json files (a list of
  # strings or of objects with `text_field`, or one such object).
  source: str = "stdlib"
  text_field: str = "text"  # key of the document text in .jsonl / .json objects
  # "byte" = built-in byte-level tokenizer (V = 259); otherwise the path of a local Hugging
  # Face tokenizer.json (ZAYA1 uses the Gemma-3 tokenizer). Nothing is ever downloaded.
  tokenizer: str = "byte"
  # Fraction of documents held out for evaluation, chosen by a stable hash (blake2b) of the
  # document id, so the split does not depend on the corpus order, the seed or the process.
  eval_fraction: float = 0.02
  shuffle_seed: int = 0  # document shuffling seed (combined with the train seed)
  # Row shuffle (zaya_jax/data/row_shuffle.py): a global batch takes its rows from a seeded
  # permutation of each window of `shuffle_window` consecutive packed rows, so its rows are
  # not consecutive cuts of the same few documents. Raw text buffers the window in memory
  # (shuffle_window * seq_len * 16 bytes per process); prepared corpora store nothing.
  shuffle_rows: bool = True
  shuffle_window: int = 10_000  # rows per row-shuffle window (>= 1)
  # Eval sample: the eval batches are the held-out split's rows in a seeded random order
  # (each window of `shuffle_window` rows permuted, the seed from `shuffle_seed` alone, not
  # the train seed), so N eval batches are a sample of the whole split rather than its
  # first few documents, and runs of any train seed are evaluated on the same batches.
  # False = the held-out rows in document-id order (the eval sets before 2026-12-04).
  shuffle_eval: bool = True
  num_workers: int = 0  # grain worker processes; 0 = read and tokenize in-process
  add_bos: bool = True  # prepend the tokenizer's bos_id to every document
  add_eos: bool = True  # append the tokenizer's eos_id to every document
  # A .jsonl line that is not a JSON record holding a string under `text_field`, found when
  # the corpus is listed: "error" stops before training, naming file:line; "skip" leaves it
  # out and warns with the count and the first few file:line.
  bad_records: str = "error"
  # A prepared directory (`source` or mixture entries: made by launch.prepare_data, holding a
  # manifest.json) is read through a global sample index: the tokenizer is the manifest's
  # (`tokenizer`, `add_bos`, `add_eos`, `text_field` and `bad_records` are not used then).
  # Weighted mixture of prepared directories, "DIR_A:0.7,DIR_B:0.3" (weights > 0, normalized);
  # when set, `source` is ignored. "" = read `source` alone.
  mixture: str = ""
  # Rows of a prepared directory: "concat" (documents concatenated and cut every seq_len
  # tokens, a document may be split across rows) | "best_fit" (whole documents only, best-fit
  # packing within windows of `best_fit_window` documents; rows padded). Raw text: "concat".
  packing: str = "concat"
  best_fit_window: int = 1024  # documents per best_fit packing window
  # best_fit only: a document longer than seq_len + 1 tokens is "truncate"d to its first
  # seq_len + 1 tokens, or "drop"ped.
  long_documents: str = "truncate"
  verify_checksums: bool = False  # check every shard's sha256 at start (reads the whole corpus)
  # A checkpointed data position of prepared corpora written before the bounded-memory index
  # (format zaya-global-v1, issue 27) addresses another document order: "refuse" (stop with
  # one line) | "restart" (resume the model, optimizer and step; the data order restarts at
  # row 0 of this index).
  v1_state: str = "refuse"

  def __post_init__(self):
    if not self.source.strip():
      raise ValueError(
          "data.source is empty; set it to 'stdlib' or to comma-separated paths/globs of "
          ".txt/.jsonl/.json files."
      )
    if not self.text_field:
      raise ValueError("data.text_field is empty; set it to the JSON key holding the text.")
    if not self.tokenizer:
      raise ValueError("data.tokenizer is empty; set it to 'byte' or a tokenizer.json path.")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(
          f"data.eval_fraction={self.eval_fraction} must be in [0, 1); e.g. 0.02 holds out "
          "2% of the documents."
      )
    if self.bad_records not in ("error", "skip"):
      raise ValueError(
          f"data.bad_records={self.bad_records!r} must be 'error' (stop, naming file:line) or "
          "'skip' (leave bad .jsonl lines out, with a warning)."
      )
    if self.packing not in ("concat", "best_fit"):
      raise ValueError(f"data.packing={self.packing!r} must be 'concat' or 'best_fit'.")
    if self.long_documents not in ("truncate", "drop"):
      raise ValueError(f"data.long_documents={self.long_documents!r} must be 'truncate' or "
                       "'drop'.")
    if not isinstance(self.shuffle_rows, bool):
      raise ValueError(f"data.shuffle_rows={self.shuffle_rows!r} must be True or False.")
    if not isinstance(self.shuffle_eval, bool):
      raise ValueError(f"data.shuffle_eval={self.shuffle_eval!r} must be True or False.")
    if isinstance(self.shuffle_window, bool) or not isinstance(
        self.shuffle_window, int) or self.shuffle_window < 1:
      raise ValueError(f"data.shuffle_window={self.shuffle_window!r} must be an integer >= 1 "
                       "(rows per row-shuffle window, e.g. 10000).")
    if self.v1_state not in ("refuse", "restart"):
      raise ValueError(f"data.v1_state={self.v1_state!r} must be 'refuse' or 'restart'.")
    if self.best_fit_window < 1:
      raise ValueError(f"data.best_fit_window={self.best_fit_window} must be >= 1 (documents "
                       "per packing window).")
    if self.mixture.strip():
      parse_mixture(self.mixture)  # raises naming data.mixture
    if self.num_workers < 0:
      raise ValueError(
          f"data.num_workers={self.num_workers} must be >= 0 (0 = in-process reading)."
      )
