"""HF export (`zaya_jax.hf.save_pretrained`) round-trips `transformers.ZayaForCausalLM` exactly.

transformers 5.23 `from_pretrained` overwrites every router's skip balancing bias
(`balancing_biases[-1]`) with -1 after loading (`ZayaPreTrainedModel._init_weights` assigns it
unconditionally; its own save -> load round trip loses it too). So the files are compared
exactly, the loaded model exactly except that entry, and the logits test puts the saved
biases back.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tests.convert.common import read_export, reference_state, restore_skip_biases
from tests.model import hf_reference
from zaya_jax.hf import load_pretrained, save_pretrained, to_hf_state_dict

# Attention + lm_head biases so every optional tensor is exercised; 3 layers (EDA on 1, 2).
OVERRIDES = dict(attention_bias=True, lm_head_bias=True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """(hf_model, ids, our model loaded from hf.save_pretrained)."""
  hf, ids = hf_reference.build(seed=3, **OVERRIDES)
  path = tmp_path_factory.mktemp("hf_src")
  hf.save_pretrained(path)
  return hf, ids, load_pretrained(str(path))


def from_pretrained(path):
  model, info = transformers.ZayaForCausalLM.from_pretrained(
      str(path), output_loading_info=True, attn_implementation="eager")
  for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
    assert not info.get(k), f"{k}: {info[k]}"
  return model.eval()


@pytest.mark.parametrize("max_shard_size_bytes", [None, 20_000])
def test_export_reloads_identically(imported, tmp_path, max_shard_size_bytes):
  hf, _, ours = imported
  save_pretrained(ours, str(tmp_path), max_shard_size_bytes=max_shard_size_bytes)
  if max_shard_size_bytes is not None:
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  want = reference_state(hf)
  files = read_export(tmp_path)
  assert set(files) == set(want)
  for k, v in want.items():
    np.testing.assert_array_equal(files[k], v, err_msg=k)
  back = from_pretrained(tmp_path)
  got = reference_state(back)
  assert set(got) == set(want)
  for k, v in want.items():
    if k.endswith("balancing_biases"):  # transformers resets the skip entry on load
      got[k], v = got[k][:-1], v[:-1]
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  np.testing.assert_array_equal(back.lm_head.weight.detach().numpy(),
                                back.model.embed_tokens.weight.detach().numpy())
  # And our loader reads the export back to the same parameters.
  again = load_pretrained(str(tmp_path))
  for a, b in zip(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_key_coverage(imported):
  hf, _, ours = imported
  got = to_hf_state_dict(ours)
  want = reference_state(hf)
  assert sorted(got) == sorted(want)  # dict keys: each produced exactly once
  for k, v in want.items():
    assert got[k].shape == v.shape, k


def test_bfloat16_export(imported, tmp_path):
  hf, _, ours = imported
  save_pretrained(ours, str(tmp_path), dtype="bfloat16")
  back = from_pretrained(tmp_path)
  restore_skip_biases(back, tmp_path)
  for k, v in reference_state(hf).items():
    got = back.state_dict()[k]
    if k.endswith("balancing_biases"):  # kept float32
      np.testing.assert_array_equal(got.numpy(), v, err_msg=k)
      continue
    assert got.dtype == torch.bfloat16, k
    np.testing.assert_array_equal(got.float().numpy(), torch.tensor(v).bfloat16().float().numpy(), err_msg=k)


@pytest.mark.slow
def test_trained_model_logits_match(imported, tmp_path):
  """Perturbed ("trained") parameters export to a transformers model with the same logits."""
  _, ids, ours = imported
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  leaves = [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  trained = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)
  save_pretrained(trained, str(tmp_path))
  back = from_pretrained(tmp_path)
  restore_skip_biases(back, tmp_path)
  with torch.no_grad():
    want = back(ids).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, x: m(x))(trained, jnp.asarray(ids.numpy())))
  assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_export_over_an_earlier_export_replaces_its_weights_and_says_so(imported, tmp_path, caplog):
  """A sharded export, then an unsharded one into the same --out: the shards and index are
  removed (as transformers' save_pretrained does), and a warning names them (it was silent;
  found by a new-user trial, 2026-12-07). A first export into an empty folder says nothing."""
  from absl import logging as absl_logging
  _, _, ours = imported
  with caplog.at_level("WARNING", logger=absl_logging.get_absl_logger().name):
    save_pretrained(ours, str(tmp_path), max_shard_size_bytes=20_000)
    assert not [r for r in caplog.records if "earlier export" in r.getMessage()]
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3
    save_pretrained(ours, str(tmp_path))
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
  assert [r.getMessage() for r in caplog.records if "earlier export" in r.getMessage()] == [
      f"{tmp_path} held an earlier export: its {len(shards) + 1} weight file(s) ({shards[0]}, "
      f"{shards[1]}, {shards[2]}, ...) are replaced"]
