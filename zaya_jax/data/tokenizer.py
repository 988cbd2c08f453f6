"""Tokenizers: the built-in byte-level one and local Hugging Face tokenizer.json files.

Both follow the `Tokenizer` protocol. `encode` never adds special tokens: the pipeline adds
bos/eos itself (per `DataConfig.add_bos` / `add_eos`), whatever the tokenizer's own
post-processor would do. `tokenizer_mismatch` checks a model's vocabulary and special ids
against the tokenizer of the data (for prepared corpora: the one in their manifests).
"""

from __future__ import annotations

import json
import os
from typing import Protocol

import tokenizers

from zaya_jax.data.config import DataConfig
from zaya_jax.data.manifest import ManifestError, is_prepared_dir, read_manifest
from zaya_jax.data.mixture import parse_mixture
from zaya_jax.data.prepared import uses_prepared

# Special-token spellings tried in order. Gemma (ZAYA1's tokenizer) comes first; the rest
# cover Llama/SentencePiece, GPT-2/Qwen and BERT-style vocabularies.
_PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")
_BOS_TOKENS = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS_TOKENS = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "[SEP]")

# model field -> the tokenizer's attribute (`Tokenizer`, manifest `TokenizerInfo`)
SPECIAL_IDS = (("pad_token_id", "pad_id"), ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"))


class Tokenizer(Protocol):
  """What the data pipeline and the trainer need from a tokenizer."""

  vocab_size: int  # V: every id is in [0, V)
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without any special tokens."""
    ...

  def decode(self, ids: list[int]) -> str:
    """Text of `ids`; special tokens are dropped."""
    ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: pad 0, bos 1, eos 2, byte b -> b + 3 (V = 259).

  Needs no files, so tests and the stdlib smoke corpus run anywhere.
  """

  pad_id = 0
  bos_id = 1
  eos_id = 2
  num_special = 3
  vocab_size = 256 + num_special

  def encode(self, text: str) -> list[int]:
    return [b + self.num_special for b in text.encode("utf-8")]

  def decode(self, ids: list[int]) -> str:
    data = bytes(i - self.num_special for i in ids if self.num_special <= i < self.vocab_size)
    return data.decode("utf-8", errors="replace")


class HFTokenizer:
  """A local Hugging Face `tokenizer.json`, loaded with the `tokenizers` library.

  Attributes:
    vocab_size: `tokenizer.get_vocab_size()` (added tokens included).
    pad_id, bos_id, eos_id: the ids of the `pad_token` / `bos_token` / `eos_token` named by
      a `tokenizer_config.json` beside the file, as `transformers.AutoTokenizer` reads them
      (e.g. a chat model whose eos is "<end_of_turn>"); for a role it does not name, the
      first spelling found in `_PAD_TOKENS`, `_BOS_TOKENS`, `_EOS_TOKENS` ("<pad>", "<bos>",
      "<eos>" for Gemma). Without a pad
      token, pad_id = eos_id (padding is always masked out of the loss); without a bos
      token, bos_id = eos_id (the GPT-2 convention of one `<|endoftext|>` separator).
  """

  def __init__(self, path: str):
    """Loads `path`.

    Raises:
      ValueError: naming `data.tokenizer` if the file is missing or unreadable, or if it has
        no recognisable eos (nor bos) token.
    """
    if not os.path.isfile(path):
      raise ValueError(
          f"data.tokenizer={path!r} is neither 'byte' nor an existing file; give the path of "
          "a local Hugging Face tokenizer.json (nothing is downloaded)."
      )
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON.
      raise ValueError(
          f"data.tokenizer={path!r} could not be read as a Hugging Face tokenizer.json: {e}"
      ) from e
    self.path = path
    self.vocab_size = self._tokenizer.get_vocab_size()
    named = _named_special_tokens(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    pad_id = self._find(named.get("pad_token", ()) + _PAD_TOKENS)
    bos_id = self._find(named.get("bos_token", ()) + _BOS_TOKENS)
    eos_id = self._find(named.get("eos_token", ()) + _EOS_TOKENS)
    if eos_id is None:
      eos_id = bos_id  # A single document-separator token serves both roles.
    if eos_id is None:
      raise ValueError(
          f"data.tokenizer={path!r} has none of the special tokens {_EOS_TOKENS + _BOS_TOKENS}"
          "; add an '<eos>' (and '<bos>', '<pad>') token to the tokenizer.json."
      )
    self.eos_id = eos_id
    self.bos_id = eos_id if bos_id is None else bos_id
    self.pad_id = eos_id if pad_id is None else pad_id

  def _find(self, spellings: tuple[str, ...]) -> int | None:
    for token in spellings:
      token_id = self._tokenizer.token_to_id(token)
      if token_id is not None:
        return token_id
    return None

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int]) -> str:
    return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _named_special_tokens(config_path: str) -> dict[str, tuple[str, ...]]:
  """{"bos_token": ("<bos>",), ...} from a transformers `tokenizer_config.json` (values are
  strings or {"content": str} dicts); {} if the file is absent or unreadable."""
  try:
    with open(config_path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    return {}
  named = {}
  for role in ("pad_token", "bos_token", "eos_token"):
    value = config.get(role) if isinstance(config, dict) else None
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str) and value:
      named[role] = (value,)
  return named


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
  """The tokenizer named by `cfg.tokenizer`: "byte" or a tokenizer.json path.

  Raises:
    ValueError: naming `data.tokenizer` if the file cannot be used (see `HFTokenizer`).
  """
  if cfg.tokenizer == "byte":
    return ByteTokenizer()
  return HFTokenizer(cfg.tokenizer)


def tokenizer_mismatch(cfg: DataConfig, vocab_size: int, special_ids: dict[str, int]) -> str | None:
  """Why a model cannot train on the tokens of `cfg`, or None if it can.

  The model's vocabulary must hold the tokenizer's (model.vocab_size >= its vocab_size) and
  its special ids must be the tokenizer's: the tokenizer named by data.tokenizer, or for
  prepared corpora (`uses_prepared(cfg)`) the one recorded in each manifest.

  Args:
    cfg: the DataConfig.
    vocab_size: model.vocab_size.
    special_ids: {"pad_token_id": .., "bos_token_id": .., "eos_token_id": ..} of the model.

  Returns:
    One line naming the model field, the tokenizer (data.tokenizer, or the data.source /
    data.mixture corpus) and the fix; None if they agree.

  Raises:
    ValueError: naming data.tokenizer if it cannot be loaded; ManifestError (a ValueError)
      naming data.source / data.mixture if a manifest cannot be read.
  """
  if not uses_prepared(cfg):
    try:
      tok = load_tokenizer(cfg)
    except (OSError, ValueError) as e:
      raise ValueError(f"data.tokenizer={cfg.tokenizer!r} cannot be loaded: {e}") from e
    where = f"data.tokenizer={cfg.tokenizer!r}"
    return _model_mismatch(tok, vocab_size, special_ids, (
        "model.vocab_size={have} < tokenizer vocab {vocab} ({where}); set "
        "--config.model.vocab_size={need} (the tokenizer's size rounded up to a multiple of 64)"),
        "model.{field}={have} but the tokenizer's {attr} is {want} ({where}); set "
        "--config.model.{field}={want}", where)
  if cfg.mixture.strip():
    paths, field = [p for p, _ in parse_mixture(cfg.mixture)], "data.mixture"
  else:
    paths, field = [cfg.source], "data.source"
  for path in paths:
    if os.path.isdir(path) and not is_prepared_dir(path):
      return None  # opening it names the missing manifest (PreparedCorpus)
    try:
      tok = read_manifest(path).tokenizer
    except ManifestError as e:
      raise ManifestError(f"{field}={path!r}: {e}") from e
    problem = _model_mismatch(tok, vocab_size, special_ids, (
        "model.vocab_size={have} < the vocab {vocab} of its tokenizer ({where}); set "
        "--config.model.vocab_size={need}"),
        "model.{field}={have} but the {attr} of its tokenizer is {want} ({where}); set "
        "--config.model.{field}={want}",
        f"{field}={path!r} was prepared with tokenizer {tok.name!r}")
    if problem:
      return problem
  return None


def _model_mismatch(tok, vocab_size: int, special_ids: dict[str, int], vocab_message: str,
                    id_message: str, where: str) -> str | None:
  """The first disagreement of the model with `tok` (vocab_size, then pad, bos, eos ids), as
  `vocab_message` / `id_message` filled in; None if none. The fix for the vocabulary is the
  tokenizer's size rounded up to a multiple of 64."""
  if vocab_size < tok.vocab_size:
    return vocab_message.format(have=vocab_size, vocab=tok.vocab_size, where=where,
                                need=-(-tok.vocab_size // 64) * 64)
  for field, attr in SPECIAL_IDS:
    want = getattr(tok, attr)
    if special_ids[field] != want:
      return id_message.format(field=field, have=special_ids[field], attr=attr, want=want,
                               where=where)
  return None
