"""Checksums on 8 fake CPU devices, run in a fresh process by test_integrity.py.

JAX fixes its device count when the backend starts (pytest's process has one CPU device), so

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.checkpoint.sharded_check OUT

computes `integrity.checksum_tree` of `example_tree()` on one device and under several
shardings, saves it with Orbax on one mesh, restores it onto another and verifies it, and
writes `{case: record}` as JSON to OUT (an error string for a case that raised).
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback

import numpy as np


def example_tree():
  """numpy arrays: an expert tensor [L=2, E=8, 16, 8] f32, a bf16 matrix, an int32 scalar."""
  import ml_dtypes
  rng = np.random.default_rng(0)
  return {
      "layers": {"experts": {"w": rng.normal(size=(2, 8, 16, 8)).astype(np.float32)}},
      "embed": rng.normal(size=(64, 32)).astype(ml_dtypes.bfloat16),
      "count": np.int32(12345),
  }


def main(out_path: str) -> None:
  import jax
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from zaya_jax.checkpoint import integrity

  tree = example_tree()
  results = {}
  layouts = {  # (mesh shape, axis names, spec of the expert tensor, spec of the matrix)
      "experts_over_8": ((8,), ("x",), P(None, "x"), P("x")),
      "experts_4_by_features_2": ((4, 2), ("e", "f"), P(None, "e", "f"), P("f", "e")),
      "layers_2_experts_4": ((2, 4), ("l", "e"), P("l", "e"), P(None, "e")),
      "replicated_8": ((8,), ("x",), P(), P()),
  }

  def place(layout):
    shape, names, spec_w, spec_m = layouts[layout]
    mesh = jax.make_mesh(shape, names, devices=jax.devices())
    return {
        "layers": {"experts": {"w": jax.device_put(tree["layers"]["experts"]["w"],
                                                   NamedSharding(mesh, spec_w))}},
        "embed": jax.device_put(tree["embed"], NamedSharding(mesh, spec_m)),
        "count": jax.device_put(tree["count"], NamedSharding(mesh, P())),
    }

  cases = {"one_device": lambda: integrity.checksum_tree(jax.device_put(tree, jax.devices()[0]))}
  for layout in layouts:
    cases[layout] = lambda layout=layout: integrity.checksum_tree(place(layout))

  def save_and_restore_elsewhere():
    directory = tempfile.mkdtemp()
    placed = place("experts_over_8")
    record = integrity.checksum_tree(placed)
    with ocp.CheckpointManager(directory) as manager:
      manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(placed)))
      manager.wait_until_finished()
    other = place("layers_2_experts_4")
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          other)
    with ocp.CheckpointManager(directory) as manager:
      restored = manager.restore(1, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target))).state
    assert restored["layers"]["experts"]["w"].sharding == other["layers"]["experts"]["w"].sharding
    integrity.verify_tree("state", restored, record, directory)
    return record

  cases["orbax_saved_on_one_mesh_restored_on_another"] = save_and_restore_elsewhere
  for name, fn in cases.items():
    try:
      results[name] = fn()
    except Exception:  # reported per case; the test prints it
      results[name] = traceback.format_exc()
  with open(out_path, "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
