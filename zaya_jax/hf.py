# Shape letters: V D L N K H J W E F R X (see zaya_jax/__init__.py).
"""Hugging Face `ZayaForCausalLM` checkpoints <-> zaya-jax parameters.

The mapping is one declarative table (`HF_TABLE`): our parameter path, the HF key (with `{i}`
for the layer), and a transform kind between PyTorch's layout (Linear `[out, in]`, Conv1d
`[out, in/groups, width]`) and ours (einsum-ready `[in, ..., out]`). Per-layer tensors are
stacked on a leading L axis. Matches: spec "Hugging Face checkpoint layout".

Public API: `load_pretrained(hf_dir, dtype=jnp.float32) -> ZayaForCausalLM`.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

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
  if kind == "linear":  # [prod(out), in] -> [in, *out]
    return w.T.reshape(shape)
  if kind == "linear_out":  # [out, prod(in)] -> [*in, out]
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


class _SafetensorsReader:
  """Reads tensors by key from `model.safetensors` or a sharded `model.safetensors.index.json`."""

  def __init__(self, hf_dir: str):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      self.files = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    elif os.path.exists(single):
      with safe_open(single, framework="np") as f:
        self.files = {k: single for k in f.keys()}
    else:
      raise FileNotFoundError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json found")
    self._open = {}

  def keys(self) -> set[str]:
    return set(self.files)

  def get(self, key: str) -> np.ndarray:
    path = self.files[key]
    if path not in self._open:
      self._open[path] = safe_open(path, framework="np")
    return np.asarray(self._open[path].get_tensor(key), dtype=np.float32)


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
    `ZayaForCausalLM`; `model(input_ids)` gives float32 logits `[B, T, V]`.
  Raises:
    FileNotFoundError: no config.json / safetensors in `hf_dir`.
    ValueError: a tensor is missing, unexpected, or has the wrong shape (named in the message).
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
  used: set[str] = set()
  missing: list[str] = []
  for rule in HF_TABLE:
    if rule.ours not in targets:
      continue  # optional tensor this config does not have (biases)
    target_shape = tuple(targets[rule.ours].shape)
    if rule.ours.startswith("layers."):
      layers = []
      for i in range(cfg.num_layers):
        key = rule.hf.format(i=i)
        if key not in reader.keys():
          if rule.kind == "eda_scale" and i == 0:  # layer 0 has no EDA: scale unused
            layers.append(np.ones(target_shape[1:], np.float32))
            continue
          missing.append(key)
          continue
        used.add(key)
        kind = "copy" if rule.kind == "eda_scale" else rule.kind
        layers.append(_convert(key, kind, reader.get(key), target_shape[1:]))
      if len(layers) == cfg.num_layers:
        _set(pure, rule.ours, jnp.asarray(np.stack(layers)))
    else:
      key = rule.hf
      if key not in reader.keys():
        missing.append(key)
        continue
      used.add(key)
      _set(pure, rule.ours, jnp.asarray(_convert(key, rule.kind, reader.get(key), target_shape)))
  if missing:
    raise ValueError(f"{hf_dir}: {len(missing)} tensors missing from the checkpoint, e.g. {missing[:5]}")
  unexpected = sorted(reader.keys() - used - set(_IGNORED_HF_KEYS))
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
