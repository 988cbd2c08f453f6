# Shape letters: L (see zaya_jax/__init__.py).
"""Import: a `transformers` save_pretrained directory (config.json + safetensors) as our model.

`load_pretrained(hf_dir)` reads `config.json` (`ModelConfig.from_hf_dict`) and converts every
tensor through `zaya_jax.hf.hf_table.HF_TABLE`, one parameter at a time; a missing,
unexpected or misshapen tensor, or a damaged safetensors file, is named in the error.
`SafetensorsReader` reads tensors by key from one file or a sharded index.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from zaya_jax.hf.hf_table import HF_TABLE, IGNORED_HF_KEYS, flatten, hf_shape, set_path, to_ours
from zaya_jax.model import ModelConfig, ZayaForCausalLM


def _open_safetensors(path: str):
  """`safe_open(path)`; ValueError naming the file if it is not a readable safetensors file."""
  try:
    return safe_open(path, framework="np")
  except FileNotFoundError as e:
    raise ValueError(f"{path}: no such file (listed by the safetensors index); re-export "
                     "the checkpoint") from e
  except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
    raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); the "
                     "file is damaged or cut short: re-download or re-export it") from e


class SafetensorsReader:
  """Reads tensors by key from `model.safetensors` or a sharded `model.safetensors.index.json`.

  Raises (from the constructor):
    FileNotFoundError: neither file is in `hf_dir`.
    ValueError: the index is not a safetensors index, or a file is not readable safetensors.
  """

  def __init__(self, hf_dir: str):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)["weight_map"]
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                         f"'weight_map'): {type(e).__name__}: {e}; re-export the checkpoint") from e
      self.files = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    elif os.path.exists(single):
      with _open_safetensors(single) as f:
        self.files = {k: single for k in f.keys()}
    else:
      raise FileNotFoundError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json found")
    self._open = {}

  def keys(self) -> set[str]:
    """Every tensor key of the checkpoint."""
    return set(self.files)

  def get(self, key: str) -> np.ndarray:
    """The tensor `key` as a new float32 numpy array (read from the memory-mapped file).

    Raises:
      ValueError: naming the file, if it cannot be read (truncated, not safetensors).
    """
    path = self.files[key]
    if path not in self._open:
      self._open[path] = _open_safetensors(path)
    try:
      return np.asarray(self._open[path].get_tensor(key), dtype=np.float32)
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError)
      raise ValueError(f"{path}: cannot read tensor {key!r} ({type(e).__name__}: {e}); the "
                       "file is damaged or cut short: re-download or re-export it") from e

  def release(self) -> None:
    """Closes the open files: their memory maps' pages stop counting in this process's RSS."""
    self._open.clear()


def load_pretrained(hf_dir: str, dtype=jnp.float32, **config_overrides) -> ZayaForCausalLM:
  """Loads a `transformers` `save_pretrained` directory (config.json + safetensors) as our model.

  Args:
    hf_dir: directory with `config.json` and `model.safetensors` or sharded
      `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`.
    dtype: compute dtype (`jnp.float32` or `jnp.bfloat16`); parameters are float32.
    **config_overrides: ModelConfig fields to override (default skip_mode "zero", as HF).
  Returns:
    `ZayaForCausalLM` on the default device; `model(input_ids)` gives float32 logits
    `[B, T, V]`. Memory: the parameters plus one layer's tensor and one parameter's file
    pages at a time (on CPU each parameter array is the numpy buffer it was converted into).
  Raises:
    FileNotFoundError: no config.json / safetensors in `hf_dir`.
    ValueError: a tensor is missing, unexpected, or has the wrong shape (named in the message),
      or a safetensors file is damaged or cut short (named, with the fix).
  """
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(f"{hf_dir}: no such directory (load_pretrained reads a local "
                            "save_pretrained directory; nothing is downloaded)")
  cfg_path = os.path.join(hf_dir, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{hf_dir}: no config.json")
  with open(cfg_path) as f:
    hf_config = json.load(f)
  cfg = ModelConfig.from_hf_dict(hf_config, dtype=jnp.dtype(dtype).name, **config_overrides)
  abstract = nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  targets = flatten(pure)
  reader = SafetensorsReader(hf_dir)
  keys = reader.keys()
  used: set[str] = set()
  missing: list[str] = []
  # One parameter at a time: its HF tensors are converted into a fresh numpy array that then
  # becomes the jax array without a copy on CPU (may_alias; it owns its memory, so nothing
  # aliases the files), and the files are closed after each parameter. Peak memory: the
  # model + one HF tensor (+ one parameter's worth of file pages), whatever the model size.
  for rule in HF_TABLE:
    if rule.ours not in targets:
      continue  # optional tensor this config does not have (biases)
    target_shape = tuple(targets[rule.ours].shape)
    out = np.empty(target_shape, np.float32)
    complete = True
    if rule.ours.startswith("layers."):
      kind = "copy" if rule.kind == "eda_scale" else rule.kind
      for i in range(cfg.num_layers):
        key = rule.hf.format(i=i)
        if key not in keys:
          if rule.kind == "eda_scale" and i == 0:  # layer 0 has no EDA: scale unused
            out[0] = 1.0
            continue
          missing.append(key)
          complete = False
          continue
        used.add(key)
        out[i] = _convert(key, kind, reader.get(key), target_shape[1:])
    elif rule.hf in keys:
      used.add(rule.hf)
      out[...] = _convert(rule.hf, rule.kind, reader.get(rule.hf), target_shape)
    else:
      missing.append(rule.hf)
      complete = False
    if complete:
      set_path(pure, rule.ours, jax.device_put(out, may_alias=True))
    del out
    reader.release()
  if missing:
    raise ValueError(f"{hf_dir}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")
  unexpected = sorted(keys - used - set(IGNORED_HF_KEYS))
  if unexpected:
    raise ValueError(f"{hf_dir}: {len(unexpected)} unexpected tensors (config mismatch?), e.g. {unexpected[:5]}")
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _convert(key: str, kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """`to_ours` after checking the HF shape exactly (a transposed tensor must not load)."""
  want = hf_shape(kind, shape)
  if tuple(w.shape) != want:
    raise ValueError(f"{key}: shape {tuple(w.shape)} in the checkpoint, expected {want} for this "
                     "config.json (transposed tensor or config mismatch?)")
  return to_ours(kind, w, shape)
