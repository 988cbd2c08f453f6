"""Expert-parallel checks on 8 fake CPU devices, run in a fresh process.

JAX fixes its device count when the backend starts, and pytest has already started it (with
one CPU device) by the time tests/parallel runs. So the multi-device checks live here and
`test_expert_parallel.py` runs them once as

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel.ep_check --out F

which writes one JSON object `{case name: measurements}` to F (an error string per case that
raised, so the other cases still report). The test module asserts on the measurements.

What is measured (see `PARITY_RUNS`): the loss and the gradients w.r.t. every `nnx.Param` of
the training loss (masked next-token cross-entropy, as `zaya_jax.train.step.train_step`
computes it) on a mesh, against the same jitted function without a mesh. Cases that differ
only in the router's balancing biases (model state, passed as an argument) share one
compiled program, so most edge cases cost no compile.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

NUM_DEVICES = 8
BATCH, SEQ = 8, 16
MESHES_EP = ((1, 1, 8), (2, 1, 4), (1, 2, 4))  # (data, fsdp, expert), expert > 1
EDGE = ("diverse", "one_expert", "empty_expert", "all_skip")  # routing set by balancing biases
ONE_EXPERT, EMPTY_EXPERT = 5, 3  # the expert that takes every token / none

# (variant, config overrides, [(mesh, dispatch)], bias cases). Every (variant, mesh, dispatch)
# is one compile (~15-30 s on a busy 2-core machine), so the table is kept short. Variants
# with equal overrides share one no-mesh reference. "ragged_emulated" runs
# RaggedAllToAllDispatch with the collective emulated by all-gathers (see below).
PARITY_RUNS = (
    ("base", {}, [(m, d) for m in MESHES_EP for d in ("allgather", "all_to_all")]
     + [((8, 1, 1), "all_to_all")], EDGE),  # EP = 1: any dispatch resolves to "local"
    ("zero_skip", {"skip_mode": "zero"}, [((1, 1, 8), "all_to_all")], ("diverse", "all_skip")),
    ("balanced", {"force_balanced_routing": True}, [((2, 1, 4), "allgather")], ("diverse",)),
    ("ragged_emulated", {}, [((2, 1, 4), "ragged_all_to_all")], EDGE),
    # Pallas kernels (interpret mode) run per batch shard inside shard_map (zaya_jax/kernels.py)
    ("kernels", {"kernels": ("routing", "gmm", "attention")}, [((2, 1, 4), "allgather")],
     ("diverse",)),
)
DROP_RUNS = (((1, 1, 8), 0.5),)  # all_to_all below capacity (base config); parity at 8.0 is
# base/1x1x8/all_to_all
RAGGED_LOWER_MESHES = ((1, 1, 8), (2, 1, 4))


def case_names() -> list[str]:
  """Names of every parity case, in the order they run (plain Python: no JAX needed)."""
  names = []
  for variant, _, runs, edges in PARITY_RUNS:
    for mesh, dispatch in runs:
      names += [parity_name(variant, mesh, dispatch, e) for e in edges]
  return names


def parity_name(variant, mesh, dispatch, edge) -> str:
  return f"{variant}/{'x'.join(map(str, mesh))}/{dispatch}/{edge}"


def main(out_path: str) -> None:
  import jax

  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)  # before the backend starts
  # LLVM -O0 for XLA:CPU: halves compile time here; HLO passes (SPMD partitioning included)
  # still run, and the mesh runs and their references are compiled alike.
  jax.config.update("jax_disable_most_optimizations", True)
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from tests.helpers import random_model
  from zaya_jax.model import ModelConfig
  from zaya_jax.model.moe import MoE
  from zaya_jax.parallel import dispatch as dispatch_lib
  from zaya_jax.parallel.mesh import (EXPERT, MeshConfig, batch_sharding, check_divisibility,
                                      make_mesh, state_shardings)
  from zaya_jax.train.step import cross_entropy

  assert jax.device_count() == NUM_DEVICES, jax.devices()
  results: dict[str, dict] = {"_meta": {"devices": jax.device_count()}}
  t_start = time.time()

  cfg0 = ModelConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=8, moe_intermediate_size=32, router_hidden_size=16,
                     layer_types=("hybrid", "hybrid_sliding"), sliding_window=4,
                     dtype="float32", capacity_factor=8.0)
  e_x = cfg0.num_router_classes

  # --- batch: a packed row, a padded row, a masked document end --------------------------------
  g = np.random.default_rng(0)
  inputs = g.integers(3, cfg0.vocab_size, (BATCH, SEQ)).astype(np.int32)
  segment_ids = np.ones((BATCH, SEQ), np.int32)
  segment_ids[0, 9:] = 2  # two documents packed in row 0
  segment_ids[3, 11:] = 0  # padding at the end of row 3
  segment_ids[6, 5:] = 0
  positions = np.where(np.arange(SEQ)[None] >= 9, np.arange(SEQ) - 9, np.arange(SEQ))
  positions = np.where(np.arange(BATCH)[:, None] == 0, positions, np.arange(SEQ)[None])
  targets = np.roll(inputs, -1, axis=1)
  loss_mask = (segment_ids > 0).astype(np.float32)
  loss_mask[0, 8] = 0.0  # the last token of a document predicts nothing
  loss_mask[:, -1] = 0.0
  batch = dict(inputs=inputs, targets=targets, segment_ids=segment_ids,
               positions=positions.astype(np.int32), loss_mask=loss_mask)
  real_M = (segment_ids > 0).reshape(-1)
  results["_meta"].update(
      real_tokens=int(real_M.sum()), one_expert=ONE_EXPERT, empty_expert=EMPTY_EXPERT,
      scan_layers=cfg0.scan_layers, tokens_per_shard=BATCH * SEQ // NUM_DEVICES,
      # force_balanced_routing sends token m to expert m % E; counts skip padding
      balanced_counts=np.bincount(np.arange(BATCH * SEQ) % cfg0.num_experts,
                                  weights=real_M, minlength=e_x).tolist())

  def biases(edge: str) -> np.ndarray:
    """Balancing biases `[L, X]` for one routing case (router probs are in [0, 1])."""
    b = np.zeros((cfg0.num_layers, e_x), np.float32)
    b[:, -1] = -0.3  # diverse: the skip class wins for some tokens, most go to experts
    if edge == "one_expert":
      b[:, ONE_EXPERT] = 10.0
    elif edge == "empty_expert":
      b[:, EMPTY_EXPERT] = -10.0
    elif edge == "all_skip":
      b[:, -1] = 10.0
    return b

  # --- the training loss and its gradients --------------------------------------------------
  def split_model(cfg):
    model = random_model(cfg, seed=0)  # numpy-filled, realistic scales: token-dependent routing
    return nnx.split(model, nnx.Param, ...)

  def make_fn(graphdef):
    def loss_fn(params, model_state, batch):
      model = nnx.merge(graphdef, params, model_state, copy=True)
      logits, aux = model(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True)
      loss_sum, tokens = cross_entropy(logits, batch["targets"], batch["loss_mask"])
      return loss_sum / jnp.maximum(tokens, 1.0), aux

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

  def with_biases(model_state, edge):
    """`model_state` with the balancing biases of routing case `edge`."""
    bb = biases(edge)

    def put(path, leaf):
      hit = "'balancing_biases'" in jax.tree_util.keystr(path)
      return jnp.asarray(bb) if hit else leaf

    return jax.tree_util.tree_map_with_path(put, model_state)

  def run(fn, params, model_state, mesh=None):
    if mesh is None:
      (loss, aux), grads = fn(params, model_state, batch)
    else:
      with jax.set_mesh(mesh):
        p = jax.device_put(params, state_shardings(params, mesh))
        s = jax.device_put(model_state, state_shardings(model_state, mesh))
        b = jax.device_put(batch, batch_sharding(mesh))
        (loss, aux), grads = fn(p, s, b)
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(grads)}
    return float(loss), {k: np.asarray(v) for k, v in aux.items()}, flat

  def compare(got, ref) -> dict:
    loss, aux, grads = got
    loss0, aux0, grads0 = ref
    rel = {}
    for k, g0 in grads0.items():
      g1 = grads[k]
      # relative to the leaf's scale; the floor only matters for leaves that are all zero
      rel[k] = float(np.max(np.abs(g1 - g0)) / max(float(np.max(np.abs(g0))), 1e-6))
    worst = max(rel, key=rel.get)
    finite = bool(np.isfinite(loss) and all(np.isfinite(v).all() for v in grads.values()))
    return {"loss": loss, "loss_ref": loss0, "loss_rel": abs(loss - loss0) / abs(loss0),
            "grad_rel": rel[worst], "grad_worst_leaf": worst, "finite": finite,
            "counts": aux["expert_counts"].tolist(), "counts_ref": aux0["expert_counts"].tolist(),
            "dropped": aux["dropped_tokens"].tolist()}

  def mesh_of(shape):
    mesh = make_mesh(MeshConfig(*shape))
    check_divisibility(mesh, num_experts=cfg0.num_experts, hidden_size=cfg0.hidden_size,
                       batch_size=BATCH)
    return mesh

  # --- emulated ragged_all_to_all (XLA:CPU cannot compile the real one) ---------------------
  def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, *, axis_name, axis_index_groups=None):
    """The collective's documented semantics from all-gathers: receiver `me` writes source s's
    rows `[input_offsets_s[me], + recv_sizes[s])` at `output_offsets_s[me]`."""
    del send_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    rows_n = jax.lax.all_gather(operand, axis_name)  # [n, m_in, D]
    in_off = jax.lax.all_gather(input_offsets, axis_name)[:, me][:, None]  # [n, 1]
    out_off = jax.lax.all_gather(output_offsets, axis_name)[:, me][:, None]
    j = jnp.arange(operand.shape[0])[None]
    valid = (j >= in_off) & (j < in_off + recv_sizes[:, None])
    dest = jnp.where(valid, out_off + j - in_off, output.shape[0])
    return output.at[dest.reshape(-1)].set(rows_n.reshape(-1, operand.shape[-1]), mode="drop")

  def record(name, fn):
    t0 = time.time()
    try:
      results[name] = fn()
    except Exception as e:  # report and go on: one broken case must not hide the others
      results[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
    results[name]["seconds"] = round(time.time() - t0, 1)
    print(f"[{time.time() - t_start:6.1f}s] {name}: "
          f"{ {k: v for k, v in results[name].items() if k not in ('counts', 'counts_ref', 'traceback')} }",
          file=sys.stderr, flush=True)

  # --- parity runs ---------------------------------------------------------------------------
  real_ragged = jax.lax.ragged_all_to_all
  ref_cache = {}
  for variant, overrides, runs, edges in PARITY_RUNS:
    cfg = cfg0.replace(**overrides)
    graphdef, params, model_state = split_model(cfg)
    states = {e: with_biases(model_state, e) for e in edges}
    key = json.dumps(overrides, sort_keys=True)
    try:
      if key not in ref_cache:
        ref_cache[key] = (make_fn(graphdef), {})
      ref_fn, refs = ref_cache[key]
      for e in edges:
        if e not in refs:
          refs[e] = run(ref_fn, params, states[e])
    except Exception:
      refs = None
      err = traceback.format_exc()[-4000:]
    for mesh_shape, dispatch in runs:
      names = [parity_name(variant, mesh_shape, dispatch, e) for e in edges]
      if refs is None:
        for n in names:
          results[n] = {"error": "single-device reference failed", "traceback": err}
        continue
      gd, _, _ = split_model(cfg.replace(moe_dispatch=dispatch))
      fn = make_fn(gd)
      try:
        if variant == "ragged_emulated":
          jax.lax.ragged_all_to_all = emulated_ragged_all_to_all
        mesh = mesh_of(mesh_shape)
        resolved = dispatch_lib.resolve_dispatch(dispatch, dict(mesh.shape)[EXPERT])
        for e, n in zip(edges, names):
          record(n, lambda: {**compare(run(fn, params, states[e], mesh), refs[e]),
                             "resolved": resolved})
      finally:
        jax.lax.ragged_all_to_all = real_ragged

  # --- all_to_all below capacity: tokens drop, training goes on -----------------------------
  graphdef, params, model_state = split_model(cfg0)
  for mesh_shape, cf in DROP_RUNS:
    gd, _, _ = split_model(cfg0.replace(moe_dispatch="all_to_all", capacity_factor=cf))
    fn = make_fn(gd)

    def drop_case(edge, mesh_shape=mesh_shape, fn=fn):
      loss, aux, grads = run(fn, params, with_biases(model_state, edge), mesh_of(mesh_shape))
      return {"loss": loss, "dropped": aux["dropped_tokens"].tolist(),
              "counts": aux["expert_counts"].tolist(),
              "finite": bool(np.isfinite(loss) and all(np.isfinite(v).all() for v in grads.values()))}

    for edge in ("diverse", "one_expert"):
      record(f"drop/{'x'.join(map(str, mesh_shape))}/cf{cf}/{edge}", lambda: drop_case(edge))

  # --- what a dropped token becomes: exactly a skip-class token -----------------------------
  def drop_semantics():
    cfg = cfg0.replace(moe_dispatch="all_to_all", capacity_factor=0.5)
    moe_graph, moe_state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))
    gw = np.random.default_rng(1)
    moe_state = jax.tree.map(
        lambda x: jnp.asarray(0.3 * gw.standard_normal(x.shape), x.dtype), moe_state)
    moe = nnx.merge(moe_graph, moe_state)
    m, e = BATCH * SEQ, cfg.num_experts
    x = jnp.asarray(gw.standard_normal((m, cfg.hidden_size)), jnp.float32)
    p = np.array([0.4, 0.2] + [0.05] * (e - 2) + [0.1]); p /= p.sum()  # experts 0, 1 overflow
    cls = gw.choice(e + 1, size=m, p=p).astype(np.int32)
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
        idx = np.nonzero(c == k)[0]
        want_dropped[s * shard_m + idx[cap:]] = True
    y_ref, _ = jax.jit(lambda x, c: moe.expert_outputs(x, c))(x, jnp.asarray(np.where(want_dropped, e, cls)))
    y, y_ref = np.asarray(y), np.asarray(y_ref)
    return {"dropped": int(np.asarray(dropped).sum()), "want_dropped": int(want_dropped.sum()),
            "mask_equal": bool((np.asarray(dropped) == want_dropped).all()),
            "y_rel": float(np.max(np.abs(y - y_ref)) / np.max(np.abs(y_ref))),
            "dropped_rows_zero": bool((y[want_dropped] == 0).all())}

  record("drop_semantics", drop_semantics)

  # --- ragged_all_to_all: the full train step lowers (compiling needs a GPU) ----------------
  def ragged_lowers(mesh_shape):
    gd, params, model_state = split_model(cfg0.replace(moe_dispatch="ragged_all_to_all"))
    fn = make_fn(gd)
    mesh = mesh_of(mesh_shape)
    with jax.set_mesh(mesh):
      p = jax.device_put(params, state_shardings(params, mesh))
      s = jax.device_put(model_state, state_shardings(model_state, mesh))
      b = jax.device_put(batch, batch_sharding(mesh))
      text = fn.lower(p, s, b).as_text()
    return {"ragged_ops": text.count("@ragged_all_to_all"), "all_to_all_ops": text.count("all_to_all"),
            "text_chars": len(text)}

  for shape in RAGGED_LOWER_MESHES:
    record(f"ragged_lower/{'x'.join(map(str, shape))}", lambda: ragged_lowers(shape))

  # --- make_mesh with all 8 devices -----------------------------------------------------------
  def mesh_shapes():
    out = {"inferred": dict(make_mesh(MeshConfig(data=2, fsdp=-1, expert=2)).shape)}
    for bad in ((3, -1, 1), (1, 1, 4)):
      try:
        make_mesh(MeshConfig(*bad))
        out[str(bad)] = None
      except ValueError as e:
        out[str(bad)] = str(e)
    return out

  record("make_mesh", mesh_shapes)
  results["_meta"]["seconds"] = round(time.time() - t_start, 1)
  with open(out_path, "w") as fh:
    json.dump(results, fh, indent=1)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="where to write the JSON results")
  main(parser.parse_args().out)
