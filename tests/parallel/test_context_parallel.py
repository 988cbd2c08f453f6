# Shape letters: B T V L X (see zaya_jax/__init__.py).
"""Context parallelism: the model with its sequences split over `mesh.context` (zigzag order)
equals one device.

Multi-device tests are `multidevice` (8 fake CPU devices, the second pytest run); the config
and mesh validation that needs no devices runs in both.

Covered (float32, tiny model: D 32, 2 layers, one of them `hybrid_sliding` with window 5,
4 experts, scan on, CCA kernel widths 2 / 2: a halo of 2 conv rows and 1 value row):
- logits, the training loss (masked next-token cross-entropy through the fused LM head, as
  `zaya_jax.train.step` computes it), the routing counts and every `nnx.Param` gradient on
  meshes (data, fsdp, expert, context) = (1,1,1,4) on 4 devices, (1,1,1,8) on 8 (T = 32: 16
  chunks of 2 tokens, so the halo is a whole chunk and the window spans three chunks) and
  (2,1,2,2) (context 2 with data and expert parallelism; context 2 alone is
  tests/train/test_causality.py's mesh) against one device, relative error <= 1e-5 (of each
  leaf's max |value|), on a packed batch whose documents start exactly on, just before and
  just after chunk boundaries of all three kinds (the previous chunk on the previous shard,
  on the next shard, or on the same shard: positions 8, 20 and 16 at C = 4), with padding;
- the halo respects documents: a document starting exactly at a chunk boundary whose
  previous chunk is on another shard (8: the previous shard; 20: the next one) gets the same
  logits whatever the previous chunk holds (another document, or padding = the document
  alone), bit for bit;
- `check_context` / `resolve` / `check_divisibility` errors name the field and the fix.

Compiles: one jitted loss-and-gradient, traced once per mesh (3) plus the one-device
reference; the halo cases reuse the (1,1,1,4) program with other batches. Checked that the
tests fail with the halo zeroed (parity, 2x1x2x2 loss off by 2.6e-2) and with the halo's
segment ids ignored (the boundary test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import random_model
from zaya_jax.config.mesh import MeshConfig, check_context
from zaya_jax.config.model import ModelConfig
from zaya_jax.ops.cross_entropy import linear_cross_entropy
from zaya_jax.parallel.context import context_size, from_context_order, in_context_order
from zaya_jax.parallel.mesh import batch_sharding, check_divisibility, make_mesh, state_shardings

RTOL = 1e-5
B, T = 4, 32
CFG = ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=4, moe_intermediate_size=32, router_hidden_size=16,
                  layer_types=("hybrid", "hybrid_sliding"), sliding_window=5, dtype="float32")
MESHES = ((1, 1, 1, 4), (1, 1, 1, 8), (2, 1, 2, 2))  # (data, fsdp, expert, context)
# Document starts per row (each row's segments 1, 2, ...; -1 = padding from there on).
# Zigzag chunks (shard r holds chunks r and 2C - 1 - r): every 8 tokens at C = 2, 4 at C = 4,
# 2 at C = 8. At C = 4 the chunk before 8 is on the previous shard, the one before 20 on the
# next shard and the one before 16 on the same (middle) shard.
ROW_STARTS = ((8, 20), (7, 15, 25), (9, 16), (4, 10, 21, -29))


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
  """`[B, T]` packed batch with the documents of `ROW_STARTS` (row 3 padding from 29); the
  last token of each document predicts nothing."""
  g = np.random.default_rng(seed)
  inputs = g.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  segment_ids = np.ones((B, T), np.int32)
  for row, starts in enumerate(ROW_STARTS):
    for s in starts:
      if s < 0:
        segment_ids[row, -s:] = 0
      else:
        segment_ids[row, s:] += 1
  positions = np.zeros((B, T), np.int32)
  for row in range(B):
    for t in range(1, T):
      same = segment_ids[row, t] == segment_ids[row, t - 1]
      positions[row, t] = positions[row, t - 1] + 1 if same else 0
  loss_mask = (segment_ids > 0).astype(np.float32)
  loss_mask[:, :-1] *= segment_ids[:, 1:] == segment_ids[:, :-1]
  loss_mask[:, -1] = 0.0
  return dict(inputs=inputs, targets=np.roll(inputs, -1, axis=1), segment_ids=segment_ids,
              positions=positions, loss_mask=loss_mask)


def loss_and_grads(graphdef):
  """Jitted `(params, model_state, batch) -> ((loss, (logits_BTV, counts_LX)), grads)`: the
  training loss (`backbone` -> `head_inputs` -> `linear_cross_entropy`, targets and mask in
  the model's sequence order, as zaya_jax/train/step.py) and the logits in natural order."""
  def loss_fn(params, model_state, batch):
    model = nnx.merge(graphdef, params, model_state, copy=True)
    x_BTD, aux = model.backbone(batch["inputs"], batch["segment_ids"], batch["positions"])
    loss_sum, tokens = linear_cross_entropy(*model.head_inputs(x_BTD),
                                            in_context_order(batch["targets"]),
                                            in_context_order(batch["loss_mask"]))
    logits_BTV = from_context_order(model.lm_head(x_BTD), context_size())
    return loss_sum / jnp.maximum(tokens, 1.0), (logits_BTV, aux["expert_counts"])
  return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def mesh_of(shape):
  n = int(np.prod(shape))
  mesh = make_mesh(MeshConfig(*shape), devices=jax.devices()[:n])
  check_divisibility(mesh, num_experts=CFG.num_experts, hidden_size=CFG.hidden_size,
                     batch_size=B, seq_len=T, halo=max(CFG.context_halo))
  return mesh


def run(fn, params, model_state, batch, mesh=None):
  """`(loss, logits, counts, {leaf path: grad})` as numpy, on `mesh` (sharded as training
  shards: batch rows over the batch axes, positions over `context`) or one device."""
  if mesh is None:
    (loss, (logits, counts)), grads = fn(params, model_state, batch)
  else:
    with jax.set_mesh(mesh):
      p = jax.device_put(params, state_shardings(params, mesh))
      s = jax.device_put(model_state, state_shardings(model_state, mesh))
      (loss, (logits, counts)), grads = fn(p, s, jax.device_put(batch, batch_sharding(mesh)))
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(grads)}
  return float(loss), np.asarray(logits), np.asarray(counts), flat


@pytest.fixture(scope="module")
def cp():
  """The model, its jitted loss-and-gradient and the one-device reference on `make_batch()`."""
  assert jax.device_count() >= 8, jax.devices()
  graphdef, params, state = nnx.split(random_model(CFG, seed=0), nnx.Param, ...)
  fn = loss_and_grads(graphdef)
  batch = make_batch()
  return {"fn": fn, "params": params, "state": state, "batch": batch,
          "ref": run(fn, params, state, batch), "meshes": {}}


def rel_err(got, want) -> float:
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


@pytest.mark.multidevice
@pytest.mark.parametrize("shape", MESHES, ids=["x".join(map(str, m)) for m in MESHES])
def test_context_parallel_matches_one_device(cp, shape):
  loss0, logits0, counts0, grads0 = cp["ref"]
  loss, logits, counts, grads = run(cp["fn"], cp["params"], cp["state"], cp["batch"],
                                    mesh_of(shape))
  name = "x".join(map(str, shape))
  assert np.isfinite(loss) and all(np.isfinite(g).all() for g in grads.values()), name
  loss_rel = abs(loss - loss0) / abs(loss0)
  assert loss_rel <= RTOL, f"{name}: loss {loss} vs {loss0} (rel {loss_rel:.3g})"
  logits_rel = rel_err(logits, logits0)
  assert logits_rel <= RTOL, f"{name}: logits off by {logits_rel:.3g} of their max |value|"
  np.testing.assert_array_equal(counts, counts0, err_msg=f"{name}: routing differs")
  assert (counts0[:, :-1] > 0).sum() >= 6, f"routing not diverse: {counts0}"
  assert set(grads) == set(grads0)
  rel = {k: rel_err(grads[k], g0) for k, g0 in grads0.items()}
  worst = max(rel, key=rel.get)
  print(f"{name}: loss rel {loss_rel:.2e}, logits rel {logits_rel:.2e}, "
        f"worst grad {worst} rel {rel[worst]:.2e}")
  assert rel[worst] <= RTOL, f"{name}: gradient {worst} off by {rel[worst]:.3g} of its max |value|"


@pytest.mark.multidevice
@pytest.mark.parametrize("start,end", [(8, 20), (20, 32)], ids=["from_previous", "from_next"])
def test_document_at_a_shard_boundary_ignores_the_previous_shard(cp, start, end):
  """Row 0's documents start at 8 and 20, chunk boundaries of (1,1,1,4) whose previous chunk
  is on the previous shard (8) and on the next shard (20): the logits of the document
  `[start, end)` do not change when the document before it changes, nor when it becomes
  padding (the document alone), bit for bit; they equal the one-device logits."""
  mesh = mesh_of((1, 1, 1, 4))
  batch = cp["batch"]
  before = start - 8 if start == 8 else 8
  other = {k: v.copy() for k, v in batch.items()}
  other["inputs"][0, before:start] = np.random.default_rng(7).integers(3, CFG.vocab_size,
                                                                       start - before)
  alone = {k: v.copy() for k, v in batch.items()}
  alone["segment_ids"][0, before:start] = 0
  alone["loss_mask"][0, before:start] = 0.0
  logits = [run(cp["fn"], cp["params"], cp["state"], b, mesh)[1][0, start:end]
            for b in (batch, other, alone)]
  np.testing.assert_array_equal(logits[1], logits[0])
  np.testing.assert_array_equal(logits[2], logits[0])
  assert rel_err(logits[0], cp["ref"][1][0, start:end]) <= RTOL
  # ... and the previous chunk does reach a document that spans the boundary (row 2 at 8,
  # row 1 at 20).
  row = 2 if start == 8 else 1
  spans = {k: v.copy() for k, v in batch.items()}
  spans["inputs"][row, start - 2:start] = (spans["inputs"][row, start - 2:start] + 1) % CFG.vocab_size
  changed = run(cp["fn"], cp["params"], cp["state"], spans, mesh)[1][row, start:start + 1]
  assert not np.array_equal(
      changed, run(cp["fn"], cp["params"], cp["state"], batch, mesh)[1][row, start:start + 1])


def test_check_context_names_the_field_and_fix():
  check_context(4, 16, 2, "xla")
  check_context(1, 15, 2, "pallas")  # nothing to check without context parallelism
  with pytest.raises(ValueError, match=r"train\.seq_len=20 is not divisible by 2 x mesh\.context = 8"):
    check_context(4, 20, 2, "xla")
  with pytest.raises(ValueError, match=r"= 2 token\(s\) per chunk is shorter than CCA's halo of 3 tokens .*; use fewer context shards or a train\.seq_len of at least 24$"):
    check_context(4, 16, 3, "xla")
  with pytest.raises(ValueError, match=r"model\.attention_impl='pallas' does not run under"):
    check_context(2, 16, 2, "pallas")
  assert CFG.context_halo == (2, 1)
  assert CFG.replace(cca_time0=3, cca_time1=4).context_halo == (5, 1)


def test_resolve_checks_the_context_axis():
  from configs import zaya1_tiny  # pylint: disable=import-outside-toplevel
  from zaya_jax.config import ConfigError, resolve  # pylint: disable=import-outside-toplevel

  config = zaya1_tiny.get_config()
  config.mesh.context = 3
  with pytest.raises(ConfigError, match=r"train\.seq_len=\d+ is not divisible by 2 x mesh\.context = 6"):
    resolve(config)
  config.mesh.context = 2
  assert resolve(config).mesh.context == 2
  config.model.attention_impl = "pallas"
  with pytest.raises(ConfigError, match="attention_impl='pallas'"):
    resolve(config)
