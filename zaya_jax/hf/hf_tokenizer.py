"""The tokenizer files of a Hugging Face directory, written so `AutoTokenizer` loads them.

`transformers.AutoTokenizer.from_pretrained(dir)` with only `tokenizer.json` and a ZAYA1
`config.json` picks the model type's default class (GemmaTokenizer), which looks for
SentencePiece tokens the file may not have. `write_tokenizer_files` writes, next to
`tokenizer.json`:
  tokenizer_config.json    tokenizer_class "PreTrainedTokenizerFast" (loads tokenizer.json
                           as it is), the special tokens as strings, model_max_length
  special_tokens_map.json  the same special tokens
The strings are the tokenizer's own tokens at the model's bos/eos/pad ids (so
`AutoTokenizer(...).bos_token_id == config.bos_token_id`), and the tokenizer model's
`unk_token` if it has one.

`byte_tokenizer_json()` is `zaya_jax.data.ByteTokenizer` as a tokenizer.json (same ids, same
decoding), written for runs that trained on bytes.
"""

from __future__ import annotations

import json
import os
import shutil

import tokenizers

from zaya_jax.data.tokenizer import ByteTokenizer
from zaya_jax.hf.hf_config import ConvertError
from zaya_jax.model import ModelConfig

BYTE_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ByteTokenizer ids 0, 1, 2


def _write_json(obj: dict, path: str) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)


def special_tokens(tokenizer_file: str, cfg: ModelConfig) -> dict[str, str]:
  """`{"bos_token": ..., "eos_token": ..., "pad_token": ..., ["unk_token": ...]}`: the tokens
  of `tokenizer_file` at `cfg`'s bos/eos/pad ids, and the tokenizer model's unk token.

  Raises:
    ConvertError: the file cannot be read, or an id is not in its vocabulary (named).
  """
  try:
    tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    with open(tokenizer_file) as f:
      unk = (json.load(f).get("model") or {}).get("unk_token")
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ConvertError(f"{tokenizer_file}: not a readable tokenizer.json ({e})") from e
  out = {}
  for name in ("bos", "eos", "pad"):
    token_id = getattr(cfg, f"{name}_token_id")
    token = tok.id_to_token(token_id)
    if token is None:
      raise ConvertError(f"model.{name}_token_id={token_id} is not in the vocabulary of "
                         f"{tokenizer_file} ({tok.get_vocab_size()} tokens); the run's tokenizer "
                         "and model disagree")
    out[f"{name}_token"] = token
  if unk is not None and tok.token_to_id(unk) is not None:
    out["unk_token"] = unk
  return out


def write_tokenizer_files(tokenizer_file: str, out_dir: str, cfg: ModelConfig,
                          model_max_length: int) -> list[str]:
  """Copies `tokenizer_file` to `out_dir/tokenizer.json` and writes `tokenizer_config.json`
  and `special_tokens_map.json` (see the module docstring).

  Args:
    tokenizer_file: a Hugging Face tokenizer.json.
    out_dir: an existing directory.
    cfg: the model config whose bos/eos/pad ids name the special tokens.
    model_max_length: tokens, written as `model_max_length` (e.g. the run's train.seq_len).
  Returns:
    The paths written.
  Raises:
    ConvertError: see `special_tokens`.
  """
  specials = special_tokens(tokenizer_file, cfg)
  target = os.path.join(out_dir, "tokenizer.json")
  if os.path.abspath(tokenizer_file) != os.path.abspath(target):
    shutil.copyfile(tokenizer_file, target)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
            "model_max_length": int(model_max_length), "clean_up_tokenization_spaces": False}
  paths = [target, os.path.join(out_dir, "tokenizer_config.json"),
           os.path.join(out_dir, "special_tokens_map.json")]
  _write_json(config, paths[1])
  _write_json(specials, paths[2])
  return paths


def _byte_chars() -> list[str]:
  """256 printable characters standing for the bytes 0..255, in byte order: the printable
  Latin-1 bytes stand for themselves, the others for code points from 256 up (the ByteLevel
  pre-tokenizer's alphabet)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


def byte_tokenizer_json(path: str) -> None:
  """Writes `ByteTokenizer` (pad 0, bos 1, eos 2, byte b -> b + 3) as a tokenizer.json:
  a ByteLevel pre-tokenizer (no prefix space, no regex split) over a merge-free BPE whose
  vocabulary is the 256 byte characters at ids 3..258, so the `tokenizers` encoding of any
  text equals `ByteTokenizer().encode(text)`."""
  n = ByteTokenizer.num_special
  vocab = {t: i for i, t in enumerate(BYTE_SPECIAL_TOKENS)}
  vocab.update({c: b + n for b, c in enumerate(_byte_chars())})
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
  tok.save(path)
