# Shape letters: V D L N K H J W E F R X (see zaya_jax/__init__.py).
"""The Hugging Face `ZayaForCausalLM` key table and its per-entry layout transforms.

`HF_TABLE` is one declarative table: our parameter path, the HF key (with `{i}` for the
layer), and a transform kind between PyTorch's layout (Linear `[out, in]`, Conv1d
`[out, in/groups, width]`) and ours (einsum-ready `[in, ..., out]`). Per-layer tensors are
stacked on a leading L axis. `to_ours` (import) and `to_hf` (export) are exact inverses;
`hf_shape` is the HF shape each kind expects. Matches: spec "Hugging Face checkpoint layout".
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Rule(NamedTuple):
  ours: str  # dotted path in nnx.to_pure_dict(state); "layers." entries are stacked over L
  hf: str  # safetensors key; "{i}" = layer index
  kind: str  # transform, see to_ours


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
# experts_gate / experts_up (halves of gate_up_proj), experts_down; see hf_shape / to_ours.

# Keys the HF checkpoint may hold that carry no information for us.
IGNORED_HF_KEYS = ("lm_head.weight",)  # tied to model.embed_tokens.weight


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The HF tensor shape that converts to our `shape` (one layer) under `kind`.

  Raises:
    ValueError: for a kind outside the table's transform kinds.
  """
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


def to_ours(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """One HF tensor (one layer, shape `hf_shape(kind, shape)`) -> our layout of `shape`."""
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


def to_hf(kind: str, x: np.ndarray, hf_shape: tuple[int, ...],
           out: np.ndarray | None = None) -> np.ndarray:
  """Our tensor (one layer) -> its HF layout `hf_shape`: the exact inverse of `to_ours`.

  Args:
    kind: transform kind of the rule (see `to_ours`; "eda_scale" is handled by the caller).
    x: our array of one layer, shape `s` with `hf_shape(kind, s) == hf_shape`.
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


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
  """`{"a": {"b": x}}` -> `{"a.b": x}`: the dotted paths of `HF_TABLE`'s `ours` column."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, path + "."))
    else:
      out[path] = v
  return out


def set_path(tree: dict, path: str, value) -> None:
  """`tree[a][b] = value` for the dotted `path` "a.b" (the parents must exist)."""
  *parents, leaf = path.split(".")
  for p in parents:
    tree = tree[p]
  tree[leaf] = value
