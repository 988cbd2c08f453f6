"""Expert parallelism: a training step on a (data, fsdp, expert) mesh equals one device.

The multi-device checks need 8 fake CPU devices, which JAX only gives a process that sets
them before its backend starts; pytest's process has started it already. So
`tests/parallel/ep_check.py` runs once in a subprocess (module fixture `ep`) and reports
measurements as JSON; the tests here assert on them. Mesh validation that needs no devices
runs in-process.

Covered (float32, tiny model: D 64, 2 layers incl. one hybrid_sliding, 8 experts, scan on):
- loss and every `nnx.Param` gradient of the training loss (masked next-token
  cross-entropy over a packed and padded batch), relative error <= 1e-5, for meshes
  (1,1,8), (2,1,4), (1,2,4) x dispatch allgather / all_to_all (capacity 8, nothing drops) and
  the EP = 1 mesh (8,1,1) (dispatch resolves to "local");
- routing edge cases set by the balancing biases: diverse routing, all tokens to one expert,
  an expert with no tokens, every token to the skip class (skip_mode scaled_identity and
  zero), force_balanced_routing; the expert counts show the routing happened;
- ragged_all_to_all: the full step lowers with the `ragged_all_to_all` custom call on
  (1,1,8) and (2,1,4); with the collective emulated by all-gathers (its documented
  semantics) the dispatch's offset arithmetic gives the single-device loss and gradients;
- all_to_all below capacity (factor 0.5): tokens drop, the step stays finite, and a dropped
  token's expert output is exactly that of a skip-class token;
- make_mesh / MeshConfig / check_divisibility / resolve_dispatch errors name the numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from tests.parallel import ep_check
from zaya_jax.parallel.dispatch import resolve_dispatch
from zaya_jax.parallel.mesh import MESH_AXES, MeshConfig, check_divisibility

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RTOL = 1e-5
SUBPROCESS_TIMEOUT_S = 1200  # ~14 compiles; ~3-5 min on a busy 2-core machine


@pytest.fixture(scope="module")
def ep(tmp_path_factory):
  """Measurements of `ep_check` on 8 fake CPU devices, `{case name: dict}`."""
  out = tmp_path_factory.mktemp("ep") / "results.json"
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
         "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
  try:
    proc = subprocess.run([sys.executable, "-m", "tests.parallel.ep_check", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"ep_check took over {SUBPROCESS_TIMEOUT_S} s; stderr tail:\n{(e.stderr or '')[-6000:]}")
  if proc.returncode != 0 or not out.exists():
    pytest.fail(f"ep_check exited {proc.returncode}; stderr tail:\n{proc.stderr[-8000:]}")
  return json.loads(out.read_text())


def get(ep, name):
  """One case's measurements; fails with the subprocess traceback if that case raised."""
  assert name in ep, f"{name}: not measured (cases: {sorted(ep)})"
  r = ep[name]
  if "error" in r:
    pytest.fail(f"{name} raised: {r['error']}\n{r.get('traceback', '')}")
  return r


def check_routing(variant, edge, counts_LX, meta):
  """The routing the case asked for happened, per layer (counts of non-padding tokens)."""
  c = np.asarray(counts_LX)
  real, e = meta["real_tokens"], c.shape[1] - 1
  np.testing.assert_array_equal(c.sum(-1), real)
  if variant == "balanced":
    np.testing.assert_array_equal(c, np.broadcast_to(meta["balanced_counts"], c.shape))
    return
  if edge == "diverse":
    assert ((c[:, :e] > 0).sum(-1) >= 6).all(), f"routing not diverse: {c}"
    assert c[:, e].sum() > 0, f"no token took the skip class: {c}"
    assert (c[:, :e].max(-1) < real / 2).all(), f"one expert dominates: {c}"
  elif edge == "one_expert":
    want = np.zeros_like(c)
    want[:, meta["one_expert"]] = real
    np.testing.assert_array_equal(c, want)
  elif edge == "empty_expert":
    assert (c[:, meta["empty_expert"]] == 0).all(), c
    assert ((c[:, :e] > 0).sum(-1) >= 5).all(), f"routing not diverse: {c}"
  elif edge == "all_skip":
    np.testing.assert_array_equal(c[:, e], real)
  else:
    raise ValueError(edge)


@pytest.mark.slow
@pytest.mark.parametrize("name", ep_check.case_names())
def test_loss_and_grads_match_single_device(ep, name):
  variant, mesh, dispatch, edge = name.split("/")
  r = get(ep, name)
  assert r["finite"], f"{name}: non-finite loss or gradient"
  assert r["loss_rel"] <= RTOL, f"{name}: loss {r['loss']} vs {r['loss_ref']} (rel {r['loss_rel']:.3g})"
  assert r["grad_rel"] <= RTOL, (
      f"{name}: gradient {r['grad_worst_leaf']} off by {r['grad_rel']:.3g} of its max |value|")
  assert r["dropped"] == [0.0] * len(r["dropped"]), f"{name}: dropped tokens {r['dropped']}"
  np.testing.assert_array_equal(r["counts"], r["counts_ref"], err_msg=f"{name}: routing differs")
  check_routing(variant, edge, r["counts"], ep["_meta"])
  ep_size = int(mesh.split("x")[2])
  assert r["resolved"] == (dispatch if ep_size > 1 else "local")


@pytest.mark.slow
def test_case_table_covers_the_required_meshes(ep):
  names = ep_check.case_names()
  for mesh in ("1x1x8", "2x1x4", "1x2x4"):
    for dispatch in ("allgather", "all_to_all"):
      for edge in ep_check.EDGE:
        assert f"base/{mesh}/{dispatch}/{edge}" in names
  assert any(n.startswith("base/8x1x1/") for n in names)
  assert "zero_skip/1x1x8/all_to_all/all_skip" in names
  assert ep["_meta"]["scan_layers"] is True and ep["_meta"]["devices"] == 8


@pytest.mark.slow
def test_all_to_all_below_capacity_drops_tokens(ep):
  meta = ep["_meta"]
  for mesh, cf in ep_check.DROP_RUNS:
    tag = f"drop/{'x'.join(map(str, mesh))}/cf{cf}"
    r = get(ep, f"{tag}/diverse")
    assert r["finite"], f"{tag}: non-finite loss or gradient"
    assert all(d > 0 for d in r["dropped"]), f"{tag}: nothing dropped {r['dropped']}"
    # every token to one expert: each shard keeps only `capacity` of them, all rows start real
    r = get(ep, f"{tag}/one_expert")
    n_shards = int(np.prod(mesh))
    cap = max(1, int(np.ceil(cf * meta["tokens_per_shard"] / (len(r["counts"][0]) - 1))))
    assert r["finite"]
    assert r["dropped"] == [meta["real_tokens"] - n_shards * cap] * len(r["dropped"]), r["dropped"]


@pytest.mark.slow
def test_dropped_token_is_a_skip_token(ep):
  r = get(ep, "drop_semantics")
  assert r["dropped"] > 0 and r["mask_equal"], r
  assert r["dropped_rows_zero"], r
  assert r["y_rel"] <= RTOL, r


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ep_check.RAGGED_LOWER_MESHES, ids=lambda m: "x".join(map(str, m)))
def test_ragged_all_to_all_train_step_lowers(ep, mesh):
  r = get(ep, f"ragged_lower/{'x'.join(map(str, mesh))}")
  # forward dispatch + combine, and their transposes in the backward pass
  assert r["ragged_ops"] >= 4, r


@pytest.mark.slow
def test_make_mesh_on_8_devices(ep):
  r = get(ep, "make_mesh")
  assert r["inferred"] == {"data": 2, "fsdp": 2, "expert": 2}
  msg = r["(3, -1, 1)"]
  assert msg and "(3)" in msg and "8 devices" in msg, msg
  msg = r["(1, 1, 4)"]
  assert msg and "4 devices" in msg and "8 are available" in msg, msg


def test_mesh_config_rejects_two_inferred_axes():
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    MeshConfig(data=-1, fsdp=-1, expert=1)
  with pytest.raises(ValueError, match="mesh.expert=0"):
    MeshConfig(expert=0)


def test_mesh_shape_not_dividing_devices():
  with pytest.raises(ValueError, match=r"\(3\) does not divide the 8 devices"):
    MeshConfig(data=3, fsdp=-1).shape(8)
  assert MeshConfig(data=2, fsdp=-1, expert=2).shape(8) == {"data": 2, "fsdp": 2, "expert": 2}


def abstract_mesh(shape):
  return AbstractMesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def test_check_divisibility_names_field_and_numbers():
  ok = dict(num_experts=8, hidden_size=64, batch_size=8)
  check_divisibility(abstract_mesh((2, 1, 4)), **ok)
  with pytest.raises(ValueError, match=r"model\.num_experts=6 is not divisible by mesh\.expert=4"):
    check_divisibility(abstract_mesh((2, 1, 4)), **{**ok, "num_experts": 6})
  with pytest.raises(ValueError, match=r"model\.hidden_size=66 is not divisible by mesh\.fsdp=4"):
    check_divisibility(abstract_mesh((1, 4, 2)), **{**ok, "hidden_size": 66})
  with pytest.raises(ValueError, match=r"train\.batch_size=4 .* 8 batch shards"):
    check_divisibility(abstract_mesh((2, 1, 4)), **{**ok, "batch_size": 4})


def test_resolve_dispatch():
  assert resolve_dispatch("all_to_all", 1) == "local"
  assert resolve_dispatch("allgather", 4) == "allgather"
  with pytest.raises(ValueError, match="needs mesh.expert=1"):
    resolve_dispatch("local", 4)
  with pytest.raises(ValueError, match="moe_dispatch='bogus'"):
    resolve_dispatch("bogus", 4)
