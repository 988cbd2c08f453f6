"""The Hugging Face `config.json` side of a conversion: read it, write it, compare it.

The field map itself is `ModelConfig.to_hf_dict` / `ModelConfig.from_hf_dict` (in
`zaya_jax.config.model`: `zaya_jax.perf.benchmark` builds transformers' model from it too,
and perf sits beside convert, not above it). Here: reading a directory's `config.json` with
one-line errors (`read_hf_config`), writing `config.json` and `generation_config.json`
(`write_hf_configs`), and naming the architecture fields where a run config and a
checkpoint differ (`architecture_differences`).
"""

from __future__ import annotations

import json
import os

from zaya_jax.config.model import ModelConfig

# Fields of to_hf_dict() that do not change the tensors or the function.
FREE_HF_FIELDS = ("initializer_range",)


class ConvertError(Exception):
  """A conversion input that does not fit (a missing directory, a config or checkpoint that
  does not match); the message is one line naming it and the fix."""


def read_hf_config(hf_dir: str, **overrides) -> ModelConfig:
  """The ModelConfig of `hf_dir/config.json` (`ModelConfig.from_hf_dict`, then `overrides`).

  Raises:
    ConvertError: `hf_dir` is not a directory, has no config.json, or it is not a ZAYA1
      config (the message names the flag `--hf_dir` or the file).
  """
  if not os.path.isdir(hf_dir):
    raise ConvertError(f"--hf_dir={hf_dir}: no such directory (a local transformers "
                       "save_pretrained directory; nothing is downloaded)")
  path = os.path.join(hf_dir, "config.json")
  try:
    with open(path) as f:
      return ModelConfig.from_hf_dict(json.load(f), **overrides)
  except FileNotFoundError as e:
    raise ConvertError(f"--hf_dir={hf_dir}: no config.json (not a transformers "
                       "save_pretrained directory)") from e
  except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
    raise ConvertError(f"{path}: {e}") from e


def architecture_differences(run: ModelConfig, hf: ModelConfig, hf_dir: str) -> list[str]:
  """`field: config run vs HF_DIR/config.json hf` for every config.json field (except
  `FREE_HF_FIELDS`) where the run's model config and the checkpoint's differ."""
  a, b = run.to_hf_dict(), hf.to_hf_dict()
  return [f"{k}: config {a[k]!r} vs {hf_dir}/config.json {b.get(k)!r}"
          for k in a if k not in FREE_HF_FIELDS and a[k] != b.get(k)]


def write_hf_configs(cfg: ModelConfig, out_dir: str, dtype_name: str) -> None:
  """Writes `out_dir/config.json` (`cfg.to_hf_dict()`, torch_dtype and dtype = `dtype_name`)
  and `out_dir/generation_config.json` (bos/eos/pad ids); `out_dir` must exist."""
  hf_config = cfg.to_hf_dict()
  hf_config["torch_dtype"] = dtype_name
  hf_config["dtype"] = dtype_name
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
               "pad_token_id": cfg.pad_token_id}, f, indent=2)
