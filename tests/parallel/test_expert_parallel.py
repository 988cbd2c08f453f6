# Shape letters: B T D L X M (see zaya_jax/__init__.py).
"""Expert parallelism: a training step on a (data, fsdp, expert) mesh equals one device.

The mesh tests are `multidevice`: they run in the second pytest run, with 8 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8 ... pytest -m multidevice`; README), and
are skipped with fewer devices. Mesh validation that needs no devices runs in both.

Covered (float32, tiny model: D 64, 2 layers incl. one hybrid_sliding, 8 experts, scan on):
- loss and every `nnx.Param` gradient of the training loss (masked next-token
  cross-entropy over a packed and padded batch, through the fused LM head
  `linear_cross_entropy` as `zaya_jax.train.step` computes it), relative error <= 1e-5, for
  meshes (1,1,8), (2,1,4), (1,2,4) x dispatch allgather / all_to_all (capacity 8, nothing
  drops) and the EP = 1 mesh (8,1,1) (dispatch resolves to "local");
- routing edge cases set by the balancing biases: diverse routing, all tokens to one expert,
  an expert with no tokens, every token to the skip class (skip_mode scaled_identity and
  zero), force_balanced_routing; the expert counts show the routing happened;
- ragged_all_to_all: the full step lowers with the `ragged_all_to_all` custom call on
  (1,1,8) and (2,1,4); with the collective emulated by all-gathers (its documented
  semantics) the dispatch's offset arithmetic gives the single-device loss and gradients;
- all_to_all below capacity (factor 0.5): tokens drop, the step stays finite, and a dropped
  token's expert output is exactly that of a skip-class token;
- make_mesh / MeshConfig / check_divisibility / resolve_dispatch errors name the numbers.

Compiles: one jitted loss-and-gradient per (variant, dispatch) and one one-device reference
per distinct config (`Parity`, module fixture `parity`); the edge cases differ only in the
router's balancing biases (model state, an argument), so they reuse the compiled programs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from tests.helpers import random_model
from zaya_jax.config.mesh import EXPERT, MESH_AXES, MeshConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.model.moe import MoE
from zaya_jax.parallel.dispatch import resolve_dispatch
from zaya_jax.parallel.mesh import batch_sharding, check_divisibility, make_mesh, state_shardings
from zaya_jax.ops.cross_entropy import linear_cross_entropy

RTOL = 1e-5
NUM_DEVICES = 8
BATCH, SEQ = 8, 16
MESHES_EP = ((1, 1, 8), (2, 1, 4), (1, 2, 4))  # (data, fsdp, expert), expert > 1
EDGE = ("diverse", "one_expert", "empty_expert", "all_skip")  # routing set by balancing biases
ONE_EXPERT, EMPTY_EXPERT = 5, 3  # the expert that takes every token / none

CFG0 = ModelConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, num_experts=8, moe_intermediate_size=32, router_hidden_size=16,
                   layer_types=("hybrid", "hybrid_sliding"), sliding_window=4,
                   dtype="float32", capacity_factor=8.0)
# Config overrides per variant; variants with equal overrides share one one-device reference.
# "ragged_emulated" runs RaggedAllToAllDispatch with the collective emulated by all-gathers.
VARIANTS = {
    "base": {}, "zero_skip": {"skip_mode": "zero"}, "balanced": {"force_balanced_routing": True},
    "ragged_emulated": {},
    # "auto" is the fused SwiGLU on CPU (its loop carries marked varying inside shard_map);
    # the three-matmul looped gmm and the padded-tile gmm keep one mesh each
    "looped": {"gmm_impl": "looped"},
    "tiled": {"gmm_impl": "tiled"},
    # Pallas kernels (interpret mode) run per batch shard inside shard_map (zaya_jax/ops/sharding.py)
    "kernels": {"attention_impl": "pallas", "routing_impl": "pallas", "gmm_impl": "pallas"},
}
# (variant, [(mesh, dispatch)], edge cases): every (variant, dispatch) is one compile.
PARITY_RUNS = (
    ("base", [(m, d) for m in MESHES_EP for d in ("allgather", "all_to_all")]
     + [((8, 1, 1), "all_to_all")], EDGE),  # EP = 1: any dispatch resolves to "local"
    ("zero_skip", [((1, 1, 8), "all_to_all")], ("diverse", "all_skip")),
    ("balanced", [((2, 1, 4), "allgather")], ("diverse",)),
    ("ragged_emulated", [((2, 1, 4), "ragged_all_to_all")], EDGE),
    ("looped", [((1, 2, 4), "all_to_all")], EDGE),
    ("tiled", [((2, 1, 4), "allgather")], EDGE),
    ("kernels", [((2, 1, 4), "allgather")], ("diverse",)),
)
PARITY_CASES = [(v, m, d, e) for v, runs, edges in PARITY_RUNS for m, d in runs for e in edges]
DROP_RUNS = (((1, 1, 8), 0.5),)  # all_to_all below capacity (base config); parity at 8.0 is
# base/1x1x8/all_to_all
RAGGED_LOWER_MESHES = ((1, 1, 8), (2, 1, 4))


def mesh_id(shape) -> str:
  return "x".join(map(str, shape))


def parity_name(variant, mesh, dispatch, edge) -> str:
  return f"{variant}/{mesh_id(mesh)}/{dispatch}/{edge}"


def make_batch() -> dict[str, np.ndarray]:
  """`[BATCH, SEQ]` numpy batch: two documents packed in row 0 (the last token of the first
  predicts nothing), padding at the end of rows 3 and 6, the last position unmasked."""
  g = np.random.default_rng(0)
  inputs = g.integers(3, CFG0.vocab_size, (BATCH, SEQ)).astype(np.int32)
  segment_ids = np.ones((BATCH, SEQ), np.int32)
  segment_ids[0, 9:] = 2
  segment_ids[3, 11:] = 0
  segment_ids[6, 5:] = 0
  positions = np.where(np.arange(SEQ)[None] >= 9, np.arange(SEQ) - 9, np.arange(SEQ))
  positions = np.where(np.arange(BATCH)[:, None] == 0, positions, np.arange(SEQ)[None])
  loss_mask = (segment_ids > 0).astype(np.float32)
  loss_mask[0, 8] = 0.0
  loss_mask[:, -1] = 0.0
  return dict(inputs=inputs, targets=np.roll(inputs, -1, axis=1), segment_ids=segment_ids,
              positions=positions.astype(np.int32), loss_mask=loss_mask)


BATCH_NP = make_batch()
REAL_TOKENS = int((BATCH_NP["segment_ids"] > 0).sum())
TOKENS_PER_SHARD = BATCH * SEQ // NUM_DEVICES


def biases(edge: str) -> np.ndarray:
  """Balancing biases `[L, X]` for one routing case (router probs are in [0, 1])."""
  b = np.zeros((CFG0.num_layers, CFG0.num_router_classes), np.float32)
  b[:, -1] = -0.3  # diverse: the skip class wins for some tokens, most go to experts
  if edge == "one_expert":
    b[:, ONE_EXPERT] = 10.0
  elif edge == "empty_expert":
    b[:, EMPTY_EXPERT] = -10.0
  elif edge == "all_skip":
    b[:, -1] = 10.0
  return b


def with_biases(model_state, edge):
  """`model_state` with the balancing biases of routing case `edge`."""
  def put(path, leaf):
    hit = "'balancing_biases'" in jax.tree_util.keystr(path)
    return jnp.asarray(biases(edge)) if hit else leaf
  return jax.tree_util.tree_map_with_path(put, model_state)


def loss_and_grads(graphdef):
  """Jitted `(params, model_state, batch) -> ((mean loss, aux), grads)`: the training loss,
  `backbone` -> `head_inputs` -> `linear_cross_entropy` over the loss mask."""
  def loss_fn(params, model_state, batch):
    model = nnx.merge(graphdef, params, model_state, copy=True)
    x_BTD, aux = model.backbone(batch["inputs"], batch["segment_ids"], batch["positions"])
    loss_sum, tokens = linear_cross_entropy(*model.head_inputs(x_BTD), batch["targets"],
                                            batch["loss_mask"])
    return loss_sum / jnp.maximum(tokens, 1.0), aux
  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def mesh_of(shape):
  mesh = make_mesh(MeshConfig(*shape))
  check_divisibility(mesh, num_experts=CFG0.num_experts, hidden_size=CFG0.hidden_size,
                     batch_size=BATCH)
  return mesh


def run(fn, params, model_state, mesh=None):
  """`(loss, aux, {leaf path: grad})` as numpy, on `mesh` (sharded as training shards) or one
  device."""
  if mesh is None:
    (loss, aux), grads = fn(params, model_state, BATCH_NP)
  else:
    with jax.set_mesh(mesh):
      p = jax.device_put(params, state_shardings(params, mesh))
      s = jax.device_put(model_state, state_shardings(model_state, mesh))
      (loss, aux), grads = fn(p, s, jax.device_put(BATCH_NP, batch_sharding(mesh)))
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(grads)}
  return float(loss), {k: np.asarray(v) for k, v in aux.items()}, flat


def finite(loss, grads) -> bool:
  return bool(np.isfinite(loss) and all(np.isfinite(v).all() for v in grads.values()))


class Parity:
  """Models, jitted steps and one-device results, each built once per module."""

  def __init__(self):
    self._models, self._fns, self._refs = {}, {}, {}

  def model(self, variant):
    """`(graphdef, params, model_state)` of the random model of `variant` (seed 0)."""
    if variant not in self._models:
      self._models[variant] = nnx.split(random_model(CFG0.replace(**VARIANTS[variant]), seed=0),
                                        nnx.Param, ...)
    return self._models[variant]

  def fn(self, variant, dispatch=None, **overrides):
    """The jitted loss and gradient of `variant` with `moe_dispatch=dispatch` (None: the
    reference), one per key: "ragged_emulated" traces with the emulated collective."""
    key = (variant, dispatch, tuple(sorted(overrides.items())))
    if key not in self._fns:
      cfg = CFG0.replace(**VARIANTS[variant], **overrides)
      cfg = cfg if dispatch is None else cfg.replace(moe_dispatch=dispatch)
      self._fns[key] = loss_and_grads(nnx.split(random_model(cfg, seed=0), nnx.Param, ...)[0])
    return self._fns[key]

  def reference(self, variant, edge):
    """One-device `run` of `variant` on edge case `edge`, shared by equal overrides."""
    key = (tuple(sorted(VARIANTS[variant].items())), edge)
    if key not in self._refs:
      _, params, state = self.model(variant)
      self._refs[key] = run(self.fn(variant), params, with_biases(state, edge))
    return self._refs[key]


@pytest.fixture(scope="module")
def parity():
  assert jax.device_count() == NUM_DEVICES, jax.devices()
  return Parity()


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name, axis_index_groups=None):
  """The collective's documented semantics from all-gathers (XLA:CPU cannot compile the real
  one): receiver `me` writes source s's rows `[input_offsets_s[me], + recv_sizes[s])` at
  `output_offsets_s[me]`."""
  del send_sizes, axis_index_groups
  me = jax.lax.axis_index(axis_name)
  rows_n = jax.lax.all_gather(operand, axis_name)  # [n, m_in, D]
  in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me][:, None]  # [n, 1]
  out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me][:, None]
  j = jnp.arange(operand.shape[0])[None]
  valid = (j >= in_off) & (j < in_off + recv_sizes[:, None])
  dest = jnp.where(valid, out_off + j - in_off, output.shape[0])
  return output.at[dest.reshape(-1)].set(rows_n.reshape(-1, operand.shape[-1]), mode="drop")


def check_routing(variant, edge, counts_LX):
  """The routing the case asked for happened, per layer (counts of non-padding tokens)."""
  c = np.asarray(counts_LX)
  real, e = REAL_TOKENS, c.shape[1] - 1
  np.testing.assert_array_equal(c.sum(-1), real)
  if variant == "balanced":  # force_balanced_routing sends token m to expert m % E
    real_M = (BATCH_NP["segment_ids"] > 0).reshape(-1)
    want = np.bincount(np.arange(BATCH * SEQ) % CFG0.num_experts, weights=real_M, minlength=e + 1)
    np.testing.assert_array_equal(c, np.broadcast_to(want, c.shape))
    return
  if edge == "diverse":
    assert ((c[:, :e] > 0).sum(-1) >= 6).all(), f"routing not diverse: {c}"
    assert c[:, e].sum() > 0, f"no token took the skip class: {c}"
    assert (c[:, :e].max(-1) < real / 2).all(), f"one expert dominates: {c}"
  elif edge == "one_expert":
    want = np.zeros_like(c)
    want[:, ONE_EXPERT] = real
    np.testing.assert_array_equal(c, want)
  elif edge == "empty_expert":
    assert (c[:, EMPTY_EXPERT] == 0).all(), c
    assert ((c[:, :e] > 0).sum(-1) >= 5).all(), f"routing not diverse: {c}"
  elif edge == "all_skip":
    np.testing.assert_array_equal(c[:, e], real)
  else:
    raise ValueError(edge)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("variant,mesh,dispatch,edge", PARITY_CASES,
                         ids=[parity_name(*c) for c in PARITY_CASES])
def test_loss_and_grads_match_single_device(parity, monkeypatch, variant, mesh, dispatch, edge):
  name = parity_name(variant, mesh, dispatch, edge)
  loss0, aux0, grads0 = parity.reference(variant, edge)
  if variant == "ragged_emulated":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  _, params, state = parity.model(variant)
  m = mesh_of(mesh)
  loss, aux, grads = run(parity.fn(variant, dispatch), params, with_biases(state, edge), m)
  # relative to the leaf's scale; the floor only matters for leaves that are all zero
  rel = {k: float(np.max(np.abs(grads[k] - g0)) / max(float(np.max(np.abs(g0))), 1e-6))
         for k, g0 in grads0.items()}
  worst = max(rel, key=rel.get)
  assert finite(loss, grads), f"{name}: non-finite loss or gradient"
  loss_rel = abs(loss - loss0) / abs(loss0)
  assert loss_rel <= RTOL, f"{name}: loss {loss} vs {loss0} (rel {loss_rel:.3g})"
  assert rel[worst] <= RTOL, f"{name}: gradient {worst} off by {rel[worst]:.3g} of its max |value|"
  dropped = aux["dropped_tokens"].tolist()
  assert dropped == [0.0] * len(dropped), f"{name}: dropped tokens {dropped}"
  np.testing.assert_array_equal(aux["expert_counts"], aux0["expert_counts"],
                                err_msg=f"{name}: routing differs")
  check_routing(variant, edge, aux["expert_counts"])
  ep_size = mesh[2]
  assert resolve_dispatch(dispatch, dict(m.shape)[EXPERT]) == (dispatch if ep_size > 1 else "local")


@pytest.mark.multidevice
def test_case_table_covers_the_required_meshes():
  names = [parity_name(*c) for c in PARITY_CASES]
  for mesh in ("1x1x8", "2x1x4", "1x2x4"):
    for dispatch in ("allgather", "all_to_all"):
      for edge in EDGE:
        assert f"base/{mesh}/{dispatch}/{edge}" in names
  assert any(n.startswith("base/8x1x1/") for n in names)
  assert "zero_skip/1x1x8/all_to_all/all_skip" in names
  assert CFG0.scan_layers is True and jax.device_count() == NUM_DEVICES


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh,cf", DROP_RUNS, ids=[f"{mesh_id(m)}/cf{cf}" for m, cf in DROP_RUNS])
def test_all_to_all_below_capacity_drops_tokens(parity, mesh, cf):
  _, params, state = parity.model("base")
  fn = parity.fn("base", "all_to_all", capacity_factor=cf)
  tag = f"drop/{mesh_id(mesh)}/cf{cf}"
  loss, aux, grads = run(fn, params, with_biases(state, "diverse"), mesh_of(mesh))
  dropped = aux["dropped_tokens"].tolist()
  assert finite(loss, grads), f"{tag}: non-finite loss or gradient"
  assert all(d > 0 for d in dropped), f"{tag}: nothing dropped {dropped}"
  # every token to one expert: each shard keeps only `capacity` of them, all rows start real
  loss, aux, grads = run(fn, params, with_biases(state, "one_expert"), mesh_of(mesh))
  dropped = aux["dropped_tokens"].tolist()
  n_shards = int(np.prod(mesh))
  cap = max(1, int(np.ceil(cf * TOKENS_PER_SHARD / CFG0.num_experts)))
  assert finite(loss, grads)
  assert dropped == [REAL_TOKENS - n_shards * cap] * len(dropped), dropped


@pytest.mark.slow
@pytest.mark.multidevice
def test_dropped_token_is_a_skip_token():
  cfg = CFG0.replace(moe_dispatch="all_to_all", capacity_factor=0.5)
  moe_graph, moe_state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
  gw = np.random.default_rng(1)
  moe_state = jax.tree.map(lambda x: jnp.asarray(0.3 * gw.standard_normal(x.shape), x.dtype),
                           moe_state)
  moe = nnx.merge(moe_graph, moe_state)
  m, e = BATCH * SEQ, cfg.num_experts
  x = jnp.asarray(gw.standard_normal((m, cfg.hidden_size)), jnp.float32)
  p = np.array([0.4, 0.2] + [0.05] * (e - 2) + [0.1])  # experts 0, 1 overflow
  cls = gw.choice(e + 1, size=m, p=p / p.sum()).astype(np.int32)
  f = jax.jit(lambda x, c: moe.expert_outputs(x, c))
  with jax.set_mesh(mesh_of((1, 1, 8))):
    y, dropped = f(x, jnp.asarray(cls))
  # expected: per batch shard (m / 8 rows), the first C tokens of each expert are kept
  shard_m = m // NUM_DEVICES
  cap = max(1, math.ceil(cfg.capacity_factor * shard_m / e))
  want_dropped = np.zeros(m, bool)
  for s in range(NUM_DEVICES):
    c = cls[s * shard_m:(s + 1) * shard_m]
    for k in range(e):
      want_dropped[s * shard_m + np.nonzero(c == k)[0][cap:]] = True
  y_ref, _ = jax.jit(lambda x, c: moe.expert_outputs(x, c))(
      x, jnp.asarray(np.where(want_dropped, e, cls)))
  y, y_ref, dropped = np.asarray(y), np.asarray(y_ref), np.asarray(dropped)
  summary = dict(dropped=int(dropped.sum()), want_dropped=int(want_dropped.sum()))
  assert dropped.sum() > 0 and (dropped == want_dropped).all(), summary
  assert (y[want_dropped] == 0).all(), summary
  y_rel = float(np.max(np.abs(y - y_ref)) / np.max(np.abs(y_ref)))
  assert y_rel <= RTOL, {**summary, "y_rel": y_rel}


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mesh", RAGGED_LOWER_MESHES, ids=mesh_id)
def test_ragged_all_to_all_train_step_lowers(parity, mesh):
  """The full train step lowers with the real collective (compiling it needs a GPU)."""
  _, params, state = parity.model("base")
  fn = parity.fn("base", "ragged_all_to_all")
  m = mesh_of(mesh)
  with jax.set_mesh(m):
    p = jax.device_put(params, state_shardings(params, m))
    s = jax.device_put(state, state_shardings(state, m))
    text = fn.lower(p, s, jax.device_put(BATCH_NP, batch_sharding(m))).as_text()
  # forward dispatch + combine, and their transposes in the backward pass
  assert text.count("@ragged_all_to_all") >= 4, text.count("@ragged_all_to_all")


@pytest.mark.multidevice
def test_make_mesh_on_8_devices():
  assert dict(make_mesh(MeshConfig(data=2, fsdp=-1, expert=2)).shape) == {
      "data": 2, "fsdp": 2, "expert": 2, "context": 1}
  with pytest.raises(ValueError) as e:
    make_mesh(MeshConfig(3, -1, 1))
  assert "(3)" in str(e.value) and "8 devices" in str(e.value), e.value
  with pytest.raises(ValueError) as e:
    make_mesh(MeshConfig(1, 1, 4))
  assert "4 devices" in str(e.value) and "8 are available" in str(e.value), e.value


def test_mesh_config_rejects_two_inferred_axes():
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    MeshConfig(data=-1, fsdp=-1, expert=1)
  with pytest.raises(ValueError, match="mesh.expert=0"):
    MeshConfig(expert=0)


def test_mesh_shape_not_dividing_devices():
  with pytest.raises(ValueError, match=r"\(3\) does not divide the 8 devices"):
    MeshConfig(data=3, fsdp=-1).shape(8)
  assert MeshConfig(data=2, fsdp=-1, expert=2).shape(8) == {"data": 2, "fsdp": 2, "expert": 2,
                                                            "context": 1}


def abstract_mesh(shape):
  """An AbstractMesh of (data, fsdp, expert[, context]) sizes (context default 1)."""
  shape = tuple(shape) + (1,) * (len(MESH_AXES) - len(shape))
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
