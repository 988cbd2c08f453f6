"""HFTokenizer's special ids: a tokenizer_config.json beside tokenizer.json names them (as
transformers reads them), else the standard spellings."""

from __future__ import annotations

import json

import pytest
import tokenizers

from zaya_jax.data.tokenizer import HFTokenizer


def _write_tokenizer(directory) -> str:
  vocab = {"<unk>": 0, "<pad>": 1, "<bos>": 2, "<eos>": 3, "<end_of_turn>": 4, "a": 5, "b": 6}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  path = str(directory / "tokenizer.json")
  tok.save(path)
  return path


def test_standard_spellings_without_a_tokenizer_config(tmp_path):
  tok = HFTokenizer(_write_tokenizer(tmp_path))
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (1, 2, 3)


@pytest.mark.parametrize("eos", ["<end_of_turn>", {"content": "<end_of_turn>", "special": True}])
def test_tokenizer_config_names_the_eos(tmp_path, eos):
  path = _write_tokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "pad_token": None}))
  tok = HFTokenizer(path)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (1, 2, 4)  # eos named; pad, bos by spelling
  assert tok.encode("a b") == [5, 6]
