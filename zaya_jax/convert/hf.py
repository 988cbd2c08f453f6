# Shape letters: V D L N K H J W E F R X (see zaya_jax/__init__.py).
"""Hugging Face `ZayaForCausalLM` checkpoints <-> zaya-jax parameters.

The mapping is one declarative table (`HF_TABLE`): our parameter path, the HF key (with `{i}`
for the layer), and a transform kind between PyTorch's layout (Linear `[out, in]`, Conv1d
`[out, in/groups, width]`) and ours (einsum-ready `[in, ..., out]`). Per-layer tensors are
stacked on a leading L axis. Matches: spec "Hugging Face checkpoint layout".

Public API: `load_pretrained(hf_dir, dtype=jnp.float32) -> ZayaForCausalLM` (import), and
`to_hf_state_dict(model)` / `save_pretrained(model, out_dir, ...)` (export, the exact inverse).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from zaya_jax.model import ModelConfig, ZayaForCausalLM


class Rule(NamedTuple):
  ours: str  # dotted path in nnx.to_pure_dict(state); "layers." entries are stacked over L
  hf: str  # safetensors key; "{i}" = layer index
  kind: str  # transform, see _to_ours


_ATTN = "model.layers.{i}.self_attn."
_QKV = _ATTN + "qkv_proj."
_GATE = "model.layers.{i}.mlp.gate."
_RS = ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")

HF_TABLE: tuple[Rule, ...] = (
    Rule("embed_tokens", "model.embed_tokens.weight", "copy"),
    Rule("input_hidden_states_scale", "model.input_hidden_states_scale", "copy"),
    Rule("input_hidden_states_bias", "model.input_hidden_states_bias", "copy"),
    Rule("norm.weight", "model.norm.weight", "copy"),
    Rule("lm_head_bias", "lm_head.bias", "copy"),
    Rule("layers.input_layernorm.weight", "model.layers.{i}.input_layernorm.weight", "copy"),
    Rule("layers.self_attn.q_proj", _QKV + "q_proj.weight", "linear"),
    Rule("layers.self_attn.k_proj", _QKV + "k_proj.weight", "linear"),
    Rule("layers.self_attn.v_proj_current", _QKV + "v_proj_current.weight", "linear"),
    Rule("layers.self_attn.v_proj_delayed", _QKV + "v_proj_delayed.weight", "linear"),
    Rule("layers.self_attn.q_bias", _QKV + "q_proj.bias", "flat"),
    Rule("layers.self_attn.k_bias", _QKV + "k_proj.bias", "flat"),
    Rule("layers.self_attn.v_current_bias", _QKV + "v_proj_current.bias", "flat"),
    Rule("layers.self_attn.v_delayed_bias", _QKV + "v_proj_delayed.bias", "flat"),
    Rule("layers.self_attn.conv_depthwise", _QKV + "conv_qk_depthwise.weight", "conv_depthwise"),
    Rule("layers.self_attn.conv_depthwise_bias", _QKV + "conv_qk_depthwise.bias", "flat"),
    Rule("layers.self_attn.conv_grouped", _QKV + "conv_qk_grouped.weight", "conv_grouped"),
    Rule("layers.self_attn.conv_grouped_bias", _QKV + "conv_qk_grouped.bias", "flat"),
    Rule("layers.self_attn.temp", _ATTN + "qk_norm.temp", "copy"),
    Rule("layers.self_attn.o_proj", _ATTN + "o_proj.weight", "linear_out"),
    Rule("layers.self_attn.o_bias", _ATTN + "o_proj.bias", "copy"),
    *(Rule(f"layers.post_attention_residual_scale.{n}", f"model.layers.{{i}}.post_attention_residual_scale.{n}", "copy") for n in _RS),
    Rule("layers.post_attention_layernorm.weight", "model.layers.{i}.post_attention_layernorm.weight", "copy"),
    Rule("layers.mlp.router.down_proj", _GATE + "down_proj.weight", "linear"),
    Rule("layers.mlp.router.down_bias", _GATE + "down_proj.bias", "copy"),
    Rule("layers.mlp.router.router_states_scale", _GATE + "router_states_scale", "eda_scale"),
    Rule("layers.mlp.router.norm.weight", _GATE + "router_mlp.norm.weight", "copy"),
    Rule("layers.mlp.router.fc1", _GATE + "router_mlp.fc1.weight", "linear"),
    Rule("layers.mlp.router.fc1_bias", _GATE + "router_mlp.fc1.bias", "copy"),
    Rule("layers.mlp.router.fc2", _GATE + "router_mlp.fc2.weight", "linear"),
    Rule("layers.mlp.router.fc2_bias", _GATE + "router_mlp.fc2.bias", "copy"),
    Rule("layers.mlp.router.out_proj", _GATE + "router_mlp.out_proj.weight", "linear"),
    Rule("layers.mlp.router.balancing_biases", _GATE + "balancing_biases", "copy"),
    Rule("layers.mlp.experts.w_gate", "model.layers.{i}.mlp.experts.gate_up_proj", "experts_gate"),
    Rule("layers.mlp.experts.w_up", "model.layers.{i}.mlp.experts.gate_up_proj", "experts_up"),
    Rule("layers.mlp.experts.w_down", "model.layers.{i}.mlp.experts.down_proj", "experts_down"),
    *(Rule(f"layers.post_mlp_residual_scale.{n}", f"model.layers.{{i}}.post_mlp_residual_scale.{n}", "copy") for n in _RS),
)

# Transform kinds: copy (same shape), flat (HF 1-D -> our [heads, H]), linear (HF [out, in] ->
# ours [in, *out]), linear_out (HF [out, in] -> ours [*in, out]), conv_depthwise, conv_grouped,
# experts_gate / experts_up (halves of gate_up_proj), experts_down; see _hf_shape / _to_ours.

# Keys the HF checkpoint may hold that carry no information for us.
_IGNORED_HF_KEYS = ("lm_head.weight",)  # tied to model.embed_tokens.weight


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The HF tensor shape that converts to our `shape` (one layer) under `kind`."""
  size = int(np.prod(shape))
  if kind == "copy":
    return shape
  if kind == "flat":
    return (size,)
  if kind == "linear":  # ours [in, *out]
    return (size // shape[0], shape[0])
  if kind == "linear_out":  # ours [*in, out]
    return (shape[-1], size // shape[-1])
  if kind == "conv_depthwise":  # ours [W0, J, H]
    return (shape[1] * shape[2], 1, shape[0])
  if kind == "conv_grouped":  # ours [W1, J, H_in, H_out]
    return (shape[1] * shape[3], shape[2], shape[0])
  if kind in ("experts_gate", "experts_up"):  # ours [E, D, F]
    return (shape[0], 2 * shape[2], shape[1])
  if kind == "experts_down":  # ours [E, F, D]
    return (shape[0], shape[2], shape[1])
  raise ValueError(f"unknown transform kind {kind!r}")


def _to_ours(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """One HF tensor (one layer, shape `_hf_shape(kind, shape)`) -> our layout of `shape`."""
  if kind in ("copy", "flat"):
    return w.reshape(shape)
  if kind in ("linear", "linear_out"):  # [prod(out), in] -> [in, *out]; [out, prod(in)] -> [*in, out]
    return w.T.reshape(shape)
  if kind == "conv_depthwise":  # [C, 1, W0] -> [W0, J, H]
    return w[:, 0, :].T.reshape(shape)
  if kind == "conv_grouped":  # [C=J*H_out, H_in, W1] -> [W1, J, H_in, H_out]
    w1, j, h_in, h_out = shape
    return w.reshape(j, h_out, h_in, w1).transpose(3, 0, 2, 1)
  if kind in ("experts_gate", "experts_up"):  # [E, 2F, D] -> [E, D, F] (gate rows first)
    f = shape[2]
    half = w[:, :f] if kind == "experts_gate" else w[:, f:]
    return half.transpose(0, 2, 1)
  if kind == "experts_down":  # [E, D, F] -> [E, F, D]
    return w.transpose(0, 2, 1)
  raise ValueError(f"unknown transform kind {kind!r}")


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


class _SafetensorsReader:
  """Reads tensors by key from `model.safetensors` or a sharded `model.safetensors.index.json`."""

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


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(_flatten(v, path + "."))
    else:
      out[path] = v
  return out


def _set(tree: dict, path: str, value) -> None:
  *parents, leaf = path.split(".")
  for p in parents:
    tree = tree[p]
  tree[leaf] = value


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
  targets = _flatten(pure)
  reader = _SafetensorsReader(hf_dir)
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
      _set(pure, rule.ours, jax.device_put(out, may_alias=True))
    del out
    reader.release()
  if missing:
    raise ValueError(f"{hf_dir}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")
  unexpected = sorted(keys - used - set(_IGNORED_HF_KEYS))
  if unexpected:
    raise ValueError(f"{hf_dir}: {len(unexpected)} unexpected tensors (config mismatch?), e.g. {unexpected[:5]}")
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _convert(key: str, kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """`_to_ours` after checking the HF shape exactly (a transposed tensor must not load)."""
  want = _hf_shape(kind, shape)
  if tuple(w.shape) != want:
    raise ValueError(f"{key}: shape {tuple(w.shape)} in the checkpoint, expected {want} for this "
                     "config.json (transposed tensor or config mismatch?)")
  return _to_ours(kind, w, shape)


# --- Export: our parameters -> a `transformers` save_pretrained directory ----------------------


def _to_hf(kind: str, x: np.ndarray, hf_shape: tuple[int, ...],
           out: np.ndarray | None = None) -> np.ndarray:
  """Our tensor (one layer) -> its HF layout `hf_shape`: the exact inverse of `_to_ours`.

  Args:
    kind: transform kind of the rule (see `_to_ours`; "eda_scale" is handled by the caller).
    x: our array of one layer, shape `s` with `_hf_shape(kind, s) == hf_shape`.
    hf_shape: the HF tensor shape.
    out: for "experts_gate" / "experts_up" only, the `[E, 2F, D]` `gate_up_proj` buffer the
      half is written into (gate rows first); allocated (zeros) when None.
  Returns:
    An array of `hf_shape` (for the expert halves, `out` with that half filled).
  """
  x = np.asarray(x)
  if kind in ("copy", "flat"):
    return x.reshape(hf_shape)
  if kind == "linear":  # [in, *out] -> [prod(out), in]
    return x.reshape(x.shape[0], -1).T.reshape(hf_shape)
  if kind == "linear_out":  # [*in, out] -> [out, prod(in)]
    return x.reshape(-1, x.shape[-1]).T.reshape(hf_shape)
  if kind == "conv_depthwise":  # [W0, J, H] -> [C=J*H, 1, W0]
    return x.reshape(x.shape[0], -1).T[:, None, :].reshape(hf_shape)
  if kind == "conv_grouped":  # [W1, J, H_in, H_out] -> [J*H_out, H_in, W1]
    return x.transpose(1, 3, 2, 0).reshape(hf_shape)
  if kind in ("experts_gate", "experts_up"):  # [E, D, F] -> one half of [E, 2F, D]
    if out is None:
      out = np.zeros(hf_shape, x.dtype)
    f = x.shape[2]
    rows = slice(0, f) if kind == "experts_gate" else slice(f, 2 * f)
    out[:, rows] = x.transpose(0, 2, 1)
    return out
  if kind == "experts_down":  # [E, F, D] -> [E, D, F]
    return x.transpose(0, 2, 1).reshape(hf_shape)
  raise ValueError(f"unknown transform kind {kind!r}")


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
  flat = _flatten(nnx.to_pure_dict(nnx.state(model)))
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
        out[key] = _to_hf(kind, x[i], _hf_shape(kind, x.shape[1:]), out=out.get(key))
    else:
      out[rule.hf] = _to_hf(kind, x, _hf_shape(kind, x.shape))
  return out


def _skip_can_win(model: ZayaForCausalLM) -> list[int]:
  """Layers whose skip class can win routing (so skip_mode matters), from the balancing biases.

  Skip never wins iff `p_skip + b_skip <= max_e(p_e + b_e)` for all router probabilities; as
  `p_skip <= 1` and `p_e >= 0`, `b_skip + 1 <= max_e b_e` guarantees it (released checkpoints:
  skip -1, experts 0). Layers where this does not hold are reported.
  """
  flat = _flatten(nnx.to_pure_dict(nnx.state(model)))
  b = np.asarray(jax.device_get(flat["layers.mlp.router.balancing_biases"]), np.float64)  # [L, X]
  return [i for i in range(b.shape[0]) if not b[i, -1] + 1.0 <= b[i, :-1].max()]


def _dtype_name(dtype) -> str:
  name = np.dtype(dtype).name
  if name not in ("float32", "bfloat16"):
    raise ValueError(f"save_pretrained dtype {name!r}; must be float32 or bfloat16")
  return name


def save_pretrained(model: ZayaForCausalLM, out_dir: str, dtype=np.float32,
                    max_shard_size_bytes: int | None = None,
                    tokenizer_file: str | None = None) -> list[str]:
  """Writes `model` as a `transformers.ZayaForCausalLM.from_pretrained` directory.

  Writes `config.json` (`cfg.to_hf_dict()` + dtype), `generation_config.json` (bos/eos/pad
  ids), and `model.safetensors`, or, when the tensors exceed `max_shard_size_bytes`,
  `model-0000k-of-0000n.safetensors` shards + `model.safetensors.index.json`.

  Transformers zeroes the MoE output of tokens routed to the skip class; a model trained with
  `skip_mode="scaled_identity"` passes `gate * x` instead. The export is exact either way,
  but if some layer's skip class can win (`_skip_can_win`) transformers' outputs will differ
  from ours; a warning names those layers.

  Args:
    model: our model.
    out_dir: output directory (created; existing files of the same names are overwritten).
    dtype: storage dtype, `np.float32` or bfloat16 (`ml_dtypes.bfloat16` / "bfloat16");
      the router balancing biases are always stored float32.
    max_shard_size_bytes: largest shard size; None = one file.
    tokenizer_file: a `tokenizer.json` to copy alongside, or None.
  Returns:
    The paths of the safetensors files written.
  Raises:
    ValueError: on an unsupported dtype.
  """
  cfg = model.cfg
  name = _dtype_name(dtype)
  np_dtype = np.float32 if name == "float32" else ml_dtypes.bfloat16
  if cfg.skip_mode == "scaled_identity":
    layers = _skip_can_win(model)
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

  hf_config = cfg.to_hf_dict()
  hf_config["torch_dtype"] = name
  hf_config["dtype"] = name
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
               "pad_token_id": cfg.pad_token_id}, f, indent=2)

  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for k, v in tensors.items():
    if max_shard_size_bytes is not None and shards[-1] and size + v.nbytes > max_shard_size_bytes:
      shards.append({})
      size = 0
    shards[-1][k] = v
    size += v.nbytes
  for stale in os.listdir(out_dir):  # a previous export's files must not mix with this one
    if stale == "model.safetensors.index.json" or (
        stale.startswith("model") and stale.endswith(".safetensors")):
      os.remove(os.path.join(out_dir, stale))
  metadata = {"format": "pt"}
  paths = []
  if len(shards) == 1:
    paths.append(os.path.join(out_dir, "model.safetensors"))
    save_file(shards[0], paths[0], metadata=metadata)
  else:
    weight_map = {}
    n = len(shards)
    for j, shard in enumerate(shards, 1):
      fname = f"model-{j:05d}-of-{n:05d}.safetensors"
      paths.append(os.path.join(out_dir, fname))
      save_file(shard, paths[-1], metadata=metadata)
      weight_map.update({k: fname for k in shard})
    index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
             "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  if tokenizer_file is not None:
    shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
  return paths
