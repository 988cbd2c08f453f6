"""Checksums (zaya_jax/checkpoint/integrity.py): the values, sharding independence, what a mismatch names.

- `checksum_tree` equals an independent numpy implementation of the documented formula
  (float32 and int32 as 32-bit words, bfloat16 as 16-bit words, bool widened; per-expert
  sums over each [l, e] slice with weights from the position inside the slice);
- the same values on one device, under four 8-device shardings, and after an Orbax save on
  one mesh and restore on another (`multidevice` tests: the second pytest run, 8 devices);
- one flipped bit in one expert of one layer is reported as exactly that (layer, expert);
  a tensor with fewer experts, a missing and an extra tensor are each named;
- a bfloat16-saved tensor restored as float32 verifies (exact cast back), a float32 tensor
  rounded to bfloat16 does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.checkpoint.conftest import IGNORE_ABANDONED_READS
from zaya_jax.checkpoint import integrity

EXPERT_TENSOR = "layers.mlp.experts.w_up.value"
pytestmark = IGNORE_ABANDONED_READS  # GC of other modules' failed reads


def reference_weights(n: int) -> np.ndarray:
  """Odd murmur3-fmix32 hashes of 0..n-1, in uint64 arithmetic reduced mod 2**32."""
  h = np.arange(n, dtype=np.uint64)
  mask = np.uint64(0xFFFFFFFF)
  h ^= h >> np.uint64(16)
  h = (h * np.uint64(0x85EBCA6B)) & mask
  h ^= h >> np.uint64(13)
  h = (h * np.uint64(0xC2B2AE35)) & mask
  h ^= h >> np.uint64(16)
  return h | np.uint64(1)


def reference_checksum(x: np.ndarray) -> int:
  if x.dtype == np.bool_:
    words = x.astype(np.uint64)
  elif x.dtype.itemsize == 2:
    words = x.view(np.uint16).astype(np.uint64)
  else:
    words = x.view(np.uint32).astype(np.uint64)
  flat = words.reshape(-1)
  return int((flat * reference_weights(flat.size) % 2**32).sum() % 2**32)


def test_checksums_equal_a_numpy_reference():
  rng = np.random.default_rng(0)
  tree = {
      "a": rng.normal(size=(5, 7)).astype(np.float32),
      "b": rng.normal(size=(33,)).astype(ml_dtypes.bfloat16),
      "c": rng.integers(-2**31, 2**31 - 1, size=(3, 4, 5)).astype(np.int32),
      "d": rng.random(size=(9,)) > 0.5,
      "layers": {"experts": {"w": rng.normal(size=(2, 3, 4, 5)).astype(np.float32)}},
  }
  record = integrity.checksum_tree(tree)
  assert set(record) == {"a", "b", "c", "d", "layers.experts.w"}
  for name, x in [("a", tree["a"]), ("b", tree["b"]), ("c", tree["c"]), ("d", tree["d"]),
                  ("layers.experts.w", tree["layers"]["experts"]["w"])]:
    assert record[name]["checksum"] == reference_checksum(x), name
    assert record[name]["shape"] == list(x.shape) and record[name]["dtype"] == str(x.dtype)
  w = tree["layers"]["experts"]["w"]
  want_LE = [[reference_checksum(w[l, e]) for e in range(3)] for l in range(2)]
  assert record["layers.experts.w"]["per_expert"] == want_LE
  assert "per_expert" not in record["a"]
  assert len({c for row in want_LE for c in row}) == 6  # every slice differs


def test_checksums_do_not_depend_on_placement():
  tree = example_tree()
  host = integrity.checksum_tree(tree)
  device = integrity.checksum_tree(jax.device_put(tree, jax.devices()[0]))
  mesh = jax.make_mesh((1,), ("x",))
  sharded = integrity.checksum_tree(jax.device_put(
      tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  assert host == device == sharded


def example_tree():
  """numpy arrays: an expert tensor [L=2, E=8, 16, 8] f32, a bf16 matrix, an int32 scalar."""
  rng = np.random.default_rng(0)
  return {
      "layers": {"experts": {"w": rng.normal(size=(2, 8, 16, 8)).astype(np.float32)}},
      "embed": rng.normal(size=(64, 32)).astype(ml_dtypes.bfloat16),
      "count": np.int32(12345),
  }


# (mesh shape, axis names, spec of the expert tensor, spec of the matrix) on 8 devices.
LAYOUTS = {
    "experts_over_8": ((8,), ("x",), P(None, "x"), P("x")),
    "experts_4_by_features_2": ((4, 2), ("e", "f"), P(None, "e", "f"), P("f", "e")),
    "layers_2_experts_4": ((2, 4), ("l", "e"), P("l", "e"), P(None, "e")),
    "replicated_8": ((8,), ("x",), P(), P()),
}


def place(tree, layout: str):
  """`tree` on the 8 devices with the shardings of `LAYOUTS[layout]`."""
  shape, names, spec_w, spec_m = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[:8])
  return {
      "layers": {"experts": {"w": jax.device_put(tree["layers"]["experts"]["w"],
                                                 NamedSharding(mesh, spec_w))}},
      "embed": jax.device_put(tree["embed"], NamedSharding(mesh, spec_m)),
      "count": jax.device_put(tree["count"], NamedSharding(mesh, P())),
  }


@pytest.mark.multidevice
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checksums_same_on_8_devices(layout):
  """The record of a tree sharded over 8 devices equals the host numpy tree's."""
  tree = example_tree()
  want = integrity.checksum_tree(tree)
  assert integrity.checksum_tree(jax.device_put(tree, jax.devices()[0])) == want
  assert integrity.checksum_tree(place(tree, layout)) == want


@pytest.mark.multidevice
def test_checksums_survive_orbax_save_on_one_mesh_and_restore_on_another(tmp_path):
  tree = example_tree()
  placed = place(tree, "experts_over_8")
  record = integrity.checksum_tree(placed)
  assert record == integrity.checksum_tree(tree)
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(placed)))
    manager.wait_until_finished()
  other = place(tree, "layers_2_experts_4")
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        other)
  with ocp.CheckpointManager(tmp_path) as manager:
    restored = manager.restore(1, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target))).state
  assert restored["layers"]["experts"]["w"].sharding == other["layers"]["experts"]["w"].sharding
  integrity.verify_tree("state", restored, record, str(tmp_path))


def flip_bit(x: np.ndarray, index: tuple[int, ...], bit: int) -> np.ndarray:
  y = np.array(x)
  words = y.view(np.uint32 if y.dtype.itemsize == 4 else np.uint16)
  words[index] ^= 1 << bit
  return y


@pytest.mark.slow
def test_flipped_bit_names_the_layer_and_expert(tiny):
  model = nnx.merge_state(tiny.state.params, tiny.state.model_state)
  saved = integrity.checksum_tree(model)
  assert integrity.verify_tree("model", model, saved, "ckpt") == 3 * 2 * 4  # 3 expert tensors
  leaves = {integrity.tensor_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(model)}
  assert saved[EXPERT_TENSOR]["shape"] == [2, 4, 32, 32]

  flipped = jax.tree_util.tree_map_with_path(
      lambda p, x: flip_bit(x, (1, 2, 5, 7), 0) if integrity.tensor_name(p) == EXPERT_TENSOR
      else x, model)
  with pytest.raises(integrity.ChecksumMismatchError) as e:
    integrity.verify_tree("model", flipped, saved, "ckpt/3")
  msg = str(e.value)
  assert f"{EXPERT_TENSOR}: 1 expert(s) differ: (layer 1, expert 2)\n" in msg + "\n", msg
  assert "(1 tensor(s))" in msg and "ckpt/3" in msg
  # The lowest mantissa bit: the value moved by one ulp, and that is still caught.
  changed = {integrity.tensor_name(p): x for p, x in
             jax.tree_util.tree_leaves_with_path(flipped)}[EXPERT_TENSOR]
  diff = np.abs(np.asarray(changed) - np.asarray(leaves[EXPERT_TENSOR]))
  assert np.count_nonzero(diff) == 1 and diff.max() < 1e-6


def test_missing_extra_and_reshaped_tensors_are_named():
  rng = np.random.default_rng(1)
  tree = {"layers": {"experts": {"w": rng.normal(size=(2, 4, 3)).astype(np.float32)}},
          "norm": np.ones(3, np.float32), "old": np.zeros(2, np.float32)}
  saved = integrity.checksum_tree(tree)
  restored = {"layers": {"experts": {"w": tree["layers"]["experts"]["w"][:, :3]}},  # 3 experts
              "norm": tree["norm"], "new": np.zeros(2, np.float32)}
  problems = integrity.compare(saved, integrity.checksum_tree(restored))
  assert problems == [
      "old: saved with shape [2] but missing from what was restored",
      "new: restored (shape [2]) but has no saved checksum, so the checkpoint lacks it",
      "layers.experts.w: saved with shape [2, 4, 3] but restored as [2, 3, 3] (a different "
      "number of layers or experts?)",
  ]


def test_bfloat16_saved_restored_as_float32_verifies_and_rounding_does_not():
  rng = np.random.default_rng(2)
  x_bf16 = rng.normal(size=(2, 4, 8)).astype(ml_dtypes.bfloat16)
  saved = integrity.checksum_tree({"experts": x_bf16})
  assert saved["experts"]["dtype"] == "bfloat16"
  integrity.verify_tree("model", {"experts": jnp.asarray(x_bf16, jnp.float32)}, saved, "c")

  x_f32 = rng.normal(size=(2, 4, 8)).astype(np.float32)
  saved = integrity.checksum_tree({"experts": x_f32})
  with pytest.raises(integrity.ChecksumMismatchError, match=r"8 expert\(s\) differ"):
    integrity.verify_tree("model", {"experts": jnp.asarray(x_f32, jnp.bfloat16)}, saved, "c")
