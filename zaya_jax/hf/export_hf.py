# Shape letters: L X (see zaya_jax/__init__.py).
"""Export: our model as a `transformers` `ZayaForCausalLM.from_pretrained` directory.

`to_hf_state_dict(model)` is every HF tensor (the exact inverse of the import, through
`zaya_jax.hf.hf_table.HF_TABLE`); `save_pretrained(model, out_dir, ...)` writes them as
safetensors (sharded above a size) with config.json and generation_config.json;
`skip_can_win(model)` names the layers where transformers' handling of the skip class can
give different outputs from ours.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys

import jax
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

from zaya_jax.hf.hf_config import write_hf_configs
from zaya_jax.hf.hf_table import HF_TABLE, flatten, hf_shape, to_hf
from zaya_jax.model import ZayaForCausalLM


def to_hf_state_dict(model: ZayaForCausalLM) -> dict[str, np.ndarray]:
  """Every tensor of the HF `ZayaForCausalLM` checkpoint of `model`, as float32 numpy arrays.

  Every layer's keys are produced; layer 0's `router_states_scale` (HF has no EDA there) and
  the optional biases this config lacks are not; `lm_head.weight` is tied to
  `model.embed_tokens.weight` and is not written either (as `transformers` saves it).

  Args:
    model: our model (any skip_mode; see `save_pretrained` for the skip caveat).
  Returns:
    `{hf_key: array}` in `HF_TABLE` order, ready for `safetensors.numpy.save_file`.
  """
  num_layers = model.cfg.num_layers
  flat = flatten(nnx.to_pure_dict(nnx.state(model)))
  flat = {k: np.asarray(jax.device_get(v), np.float32) for k, v in flat.items()}
  out: dict[str, np.ndarray] = {}
  for rule in HF_TABLE:
    if rule.ours not in flat:
      continue  # optional tensor this config does not have (biases)
    x = flat[rule.ours]
    kind = "copy" if rule.kind == "eda_scale" else rule.kind
    if rule.ours.startswith("layers."):
      for i in range(num_layers):
        if rule.kind == "eda_scale" and i == 0:
          continue  # layer 0 has no EDA: HF has no router_states_scale there
        key = rule.hf.format(i=i)
        out[key] = to_hf(kind, x[i], hf_shape(kind, x.shape[1:]), out=out.get(key))
    else:
      out[rule.hf] = to_hf(kind, x, hf_shape(kind, x.shape))
  return out


def skip_can_win(model: ZayaForCausalLM) -> list[int]:
  """Layers whose skip class can win routing (so skip_mode matters), from the balancing biases.

  Skip never wins iff `p_skip + b_skip <= max_e(p_e + b_e)` for all router probabilities; as
  `p_skip <= 1` and `p_e >= 0`, `b_skip + 1 <= max_e b_e` guarantees it (released checkpoints:
  skip -1, experts 0). Layers where this does not hold are reported.

  Args:
    model: our model; its `balancing_biases` are `[L, X]`.
  Returns:
    The indices of the layers where `b_skip + 1 > max_e b_e` (empty when skip never wins, and
    so transformers' zeroing of skipped tokens and our `skip_mode` agree).
  """
  flat = flatten(nnx.to_pure_dict(nnx.state(model)))
  b = np.asarray(jax.device_get(flat["layers.mlp.router.balancing_biases"]), np.float64)  # [L, X]
  return [i for i in range(b.shape[0]) if not b[i, -1] + 1.0 <= b[i, :-1].max()]


PROGRESS_MIN_BYTES = 2 * 10**9  # exports this large show a progress bar even without a terminal


def _match_mode(path: str, like: str) -> None:
  """Gives `path` the permission bits of `like` (safetensors writes through a 0600 temp file;
  `like` was created by `open`, so it has the umask's mode)."""
  os.chmod(path, stat.S_IMODE(os.stat(like).st_mode))


def _dtype_name(dtype) -> str:
  name = np.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"save_pretrained dtype {name!r}; must be float32 or bfloat16")
  return name


def save_pretrained(model: ZayaForCausalLM, out_dir: str, dtype=np.float32,
                    max_shard_size_bytes: int | None = None,
                    tokenizer_file: str | None = None, progress: bool | None = None) -> list[str]:
  """Writes `model` as a `transformers.ZayaForCausalLM.from_pretrained` directory.

  Writes `config.json` (`cfg.to_hf_dict()` + dtype), `generation_config.json` (bos/eos/pad
  ids), and `model.safetensors`, or, when the tensors exceed `max_shard_size_bytes`,
  `model-0000k-of-0000n.safetensors` shards + `model.safetensors.index.json`.

  Transformers zeroes the MoE output of tokens routed to the skip class; a model trained with
  `skip_mode="scaled_identity"` passes `gate * x` instead. The export is exact either way,
  but if some layer's skip class can win (`skip_can_win`) transformers' outputs will differ
  from ours; a warning names those layers.

  Args:
    model: our model.
    out_dir: output directory (created; existing files of the same names are overwritten).
    dtype: storage dtype, `np.float32` or bfloat16 (`ml_dtypes.bfloat16` / "bfloat16");
      the router balancing biases are always stored float32.
    max_shard_size_bytes: largest shard size; None = one file.
    tokenizer_file: a `tokenizer.json` to copy alongside, or None.
    progress: a progress bar on stderr (bytes written, per safetensors file); None = when
      stderr is a terminal or the tensors exceed `PROGRESS_MIN_BYTES`.
  Every file written has the mode of a file this process creates (0644 under umask 022).
  Returns:
    The paths of the safetensors files written.
  Raises:
    ValueError: on an unsupported dtype.
  """
  cfg = model.cfg
  name = _dtype_name(dtype)
  np_dtype = np.float32 if name == "float32" else ml_dtypes.bfloat16
  if cfg.skip_mode == "scaled_identity":
    layers = skip_can_win(model)
    if layers:
      logging.warning(
          "skip_mode='scaled_identity' and the skip class can win routing in layers %s "
          "(b_skip + 1 > max_e b_e): transformers zeroes the MoE output of skipped tokens while "
          "this model passes gate * x, so the exported model's outputs will differ.", layers)
  os.makedirs(out_dir, exist_ok=True)
  # Balancing biases stay float32 (transformers keeps them in a float32 buffer; routing
  # decisions hinge on small bias differences).
  tensors = {k: np.ascontiguousarray(v if k.endswith("balancing_biases") else v.astype(np_dtype))
             for k, v in to_hf_state_dict(model).items()}

  write_hf_configs(cfg, out_dir, name)

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for k, v in tensors.items():
    if max_shard_size_bytes is not None and shards[-1] and size + v.nbytes > max_shard_size_bytes:
      shards.append({})
      size = 0
    shards[-1][k] = v
    size += v.nbytes
  stale = sorted(f for f in os.listdir(out_dir) if f == "model.safetensors.index.json" or (
      f.startswith("model") and f.endswith(".safetensors")))
  if stale:  # a previous export's files must not mix with this one (as save_pretrained does)
    logging.warning("%s held an earlier export: its %d weight file(s) (%s) are replaced",
                    out_dir, len(stale), ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else ""))
  for name in stale:
    os.remove(os.path.join(out_dir, name))
  metadata = {"format": "pt"}
  total = sum(v.nbytes for v in tensors.values())
  if progress is None:
    progress = sys.stderr.isatty() or total >= PROGRESS_MIN_BYTES
  bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out_dir}",
             disable=not progress, file=sys.stderr, mininterval=1.0)
  like = os.path.join(out_dir, "config.json")
  n = len(shards)
  names = (["model.safetensors"] if n == 1 else
           [f"model-{j:05d}-of-{n:05d}.safetensors" for j in range(1, n + 1)])
  paths, weight_map = [], {}
  with bar:
    for fname, shard in zip(names, shards):
      paths.append(os.path.join(out_dir, fname))
      save_file(shard, paths[-1], metadata=metadata)
      _match_mode(paths[-1], like)
      weight_map.update({k: fname for k in shard})
      bar.update(sum(v.nbytes for v in shard.values()))
  if n > 1:
    index = {"metadata": {"total_size": int(total)}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  if tokenizer_file is not None:
    shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
  return paths
