"""Model options that must not change the numbers (scan / unrolled / remat, sharded checkpoints),
bfloat16 compute, and the errors for bad configs and bad checkpoints."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from tests.model import hf_reference
from configs import zaya1_tiny
from tests.helpers import assert_close, random_model
from zaya_jax.config import COMPUTE_ONLY_MODEL_FIELDS, ConfigError, resolve
from zaya_jax.hf import load_pretrained
from zaya_jax.model import ModelConfig

# Tiny: 2 layers (the second sliding, window 4 < T), GQA 2, 4 experts + skip.
CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  num_experts=4, moe_intermediate_size=16, router_hidden_size=8,
                  layer_types=("hybrid", "hybrid_sliding"), sliding_window=4, skip_mode="zero")
B, T = 2, 10


def _batch():
  g = np.random.default_rng(0)
  ids = g.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  segment_ids = np.array([[1] * T, [1] * 4 + [2] * 4 + [0] * 2], np.int32)  # packed + padded row
  return jnp.asarray(ids), jnp.asarray(segment_ids)


def _logits_and_grads(cfg: ModelConfig):
  """float32 logits and d(mean next-token loss)/d(params) of `random_model(cfg, seed=0)`."""
  model = random_model(cfg, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids, segment_ids = _batch()

  @jax.jit
  def loss_and_logits(params, rest):
    logits = nnx.merge(graphdef, params, rest)(ids, segment_ids)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll), logits

  (_, logits), grads = jax.value_and_grad(loss_and_logits, has_aux=True)(params, rest)
  return np.asarray(logits), nnx.to_pure_dict(grads)


@pytest.fixture(scope="module")
def scanned():
  return _logits_and_grads(CFG.replace(scan_layers=True, remat=False))


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(scan_layers=False, remat=False), dict(scan_layers=True, remat=True)],
                         ids=["unrolled", "scan_remat"])
def test_layer_execution_options_do_not_change_numbers(scanned, options):
  want_logits, want_grads = scanned
  logits, grads = _logits_and_grads(CFG.replace(**options))
  assert_close(f"{options} logits", logits, want_logits, atol=1e-5, rtol=1e-5)
  got_flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
  assert len(got_flat) == len(want_flat)
  for path, g in got_flat:
    assert_close(f"{options} grad {jax.tree_util.keystr(path)}", g, want_flat[path], atol=1e-5, rtol=1e-4)
  assert np.abs(want_grads["layers"]["self_attn"]["conv_grouped"]).max() > 0


@pytest.mark.slow
def test_bfloat16_compute_close_to_float32(scanned):
  want_logits, _ = scanned
  model = random_model(CFG.replace(dtype="bfloat16"), seed=0)
  ids, segment_ids = _batch()
  logits = nnx.jit(lambda m, i, s: m(i, s))(model, ids, segment_ids)
  assert logits.dtype == jnp.float32 and logits.shape == (B, T, CFG.vocab_size)
  # Parameters stay float32; only the matmuls run in bfloat16.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  keep = np.asarray(segment_ids) != 0
  got, want = np.asarray(logits)[keep], want_logits[keep]
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert rel < 5e-2, f"bfloat16 logits relative error {rel:.3g}"
  assert rel > 0, "bfloat16 compute was not used"


# --- ModelConfig validation ---------------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(num_heads=3), "num_heads"),  # not divisible by num_kv_heads=2
    (dict(num_heads=6, num_kv_heads=3), "num_kv_heads"),  # odd: no current/delayed split
    (dict(layer_types=("hybrid", "global")), "layer_types"),
    (dict(layer_types=("hybrid",)), "layer_types"),  # 1 type for 2 layers
    (dict(sliding_window=None), "sliding_window"),  # a hybrid_sliding layer without a window
    (dict(sliding_window=0), "sliding_window"),
    (dict(skip_mode="identity"), "skip_mode"),
    (dict(dtype="float16"), "dtype"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(partial_rotary_factor=0.3), "partial_rotary_factor"),
    (dict(attention_impl="flash"), "attention_impl"),
    (dict(routing_impl="auto"), "routing_impl"),
    (dict(gmm_impl="dense"), "gmm_impl"),
])
def test_config_errors_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=rf"model\.{field}\b"):
    CFG.replace(**overrides)


def test_replaced_kernels_field_names_the_new_fields():
  config = zaya1_tiny.get_config()
  with config.unlocked():
    config.model.kernels = ("gmm",)
  with pytest.raises(ConfigError, match=r"^model\.kernels was replaced by model\.attention_impl / "
                     r"model\.routing_impl / model\.gmm_impl='pallas'$"):
    resolve(config)


def test_compute_only_fields_are_tagged_in_the_dataclass():
  assert set(COMPUTE_ONLY_MODEL_FIELDS) == {
      "dtype", "scan_layers", "remat", "attention_impl", "attention_backward", "routing_impl", "gmm_impl",
      "moe_dispatch", "capacity_factor", "force_balanced_routing"}


# --- load_pretrained: bad and sharded checkpoints -----------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A saved 2-layer randomised HF checkpoint (single file) and its input ids."""
  hf, ids = hf_reference.build(seed=5, batch=1, seq=12, num_hidden_layers=2)
  path = tmp_path_factory.mktemp("hf_single")
  hf.save_pretrained(path)
  assert os.path.exists(path / "model.safetensors")
  return hf, path, ids


def _edited_copy(src, dst, edit):
  """Copies the checkpoint at `src` to `dst` with `edit(tensors)` applied to the safetensors."""
  os.makedirs(dst)
  shutil.copy(src / "config.json", dst / "config.json")
  tensors = load_file(str(src / "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  return str(dst)


def test_missing_tensor_is_named(hf_dir, tmp_path):
  _, src, _ = hf_dir
  key = "model.layers.1.mlp.gate.router_mlp.fc1.weight"
  path = _edited_copy(src, tmp_path / "ckpt", lambda t: t.pop(key))
  with pytest.raises(ValueError, match=re.escape(key)):
    load_pretrained(path)


def test_wrong_shape_is_named(hf_dir, tmp_path):
  _, src, _ = hf_dir
  key = "model.layers.0.self_attn.qkv_proj.k_proj.weight"  # [Hkv*dh, D] = [32, 64]

  def edit(t):
    t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] - 1)

  with pytest.raises(ValueError, match=re.escape(key)):
    load_pretrained(_edited_copy(src, tmp_path / "ckpt", edit))


def test_transposed_tensor_is_rejected(hf_dir, tmp_path):
  _, src, _ = hf_dir
  key = "model.layers.0.self_attn.qkv_proj.k_proj.weight"  # [32, 64] saved as [64, 32]

  def edit(t):
    t[key] = t[key].T.contiguous()

  with pytest.raises(ValueError, match=re.escape(key)):
    load_pretrained(_edited_copy(src, tmp_path / "ckpt", edit))


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
  _, src, _ = hf_dir
  key = "model.layers.0.mlp.gate.extra_scale"

  def edit(t):
    t[key] = torch.zeros(3)

  with pytest.raises(ValueError, match=re.escape(key)):
    load_pretrained(_edited_copy(src, tmp_path / "ckpt", edit))


@pytest.mark.slow
def test_sharded_checkpoint_loads_identically(hf_dir, tmp_path):
  hf, src, ids = hf_dir
  sharded = tmp_path / "sharded"
  hf.save_pretrained(sharded, max_shard_size="50KB")
  with open(sharded / "model.safetensors.index.json") as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) > 1 and not os.path.exists(sharded / "model.safetensors")
  forward = nnx.jit(lambda m, i: m(i))
  ids = jnp.asarray(ids.numpy())
  want = np.asarray(forward(load_pretrained(str(src)), ids))
  got = np.asarray(forward(load_pretrained(str(sharded)), ids))
  np.testing.assert_array_equal(got, want)
  with torch.no_grad():
    assert_close("sharded logits vs transformers", got, hf(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy(),
                 atol=1e-4, rtol=1e-4)
