"""DataConfig: the frozen, validated description of where training text comes from.

Built from the `data` group of the ml_collections config; the pipeline modules take this
dataclass, never the whole ConfigDict.
"""

from __future__ import annotations

import dataclasses


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
  num_workers: int = 0  # grain worker processes; 0 = read and tokenize in-process
  add_bos: bool = True  # prepend the tokenizer's bos_id to every document
  add_eos: bool = True  # append the tokenizer's eos_id to every document
  # A .jsonl line that is not a JSON record holding a string under `text_field`, found when
  # the corpus is listed: "error" stops before training, naming file:line; "skip" leaves it
  # out and warns with the count and the first few file:line.
  bad_records: str = "error"

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
    if self.num_workers < 0:
      raise ValueError(
          f"data.num_workers={self.num_workers} must be >= 0 (0 = in-process reading)."
      )
