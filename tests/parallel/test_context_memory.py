# Shape letters: B T (see zaya_jax/__init__.py).
"""Context parallelism at 32K tokens: per-device activation memory falls ~1/context, and the
32K step runs.

A small model (D 32, 2 layers incl. one sliding, 4 experts) on one 32768-token sequence: the
training loss and gradient compile on meshes (1,1,1,C) of C = 2, 4, 8 fake CPU devices, and
XLA's memory analysis of each program gives the per-device temporary (activation) bytes. The
one-device program is not compiled (the one-device XLA attention keeps `[T, T]` scores: 8 GiB
per head and layer); each doubling of C must roughly halve the figure (ratio between 0.35 and
0.65). Then the C = 8 program steps once on the 32K sequence (finite loss and gradients).
Measured (jax 0.10.2, CPU, 2026-12-02): temp 1057 / 544 / 288 MiB per device at C = 2 / 4 / 8
with the flash-style zigzag attention (`zaya_jax.ops.zigzag_attention`); the step 27 s on 2
cores. Before it, 15300 / 6913 / 3283 MiB with the zigzag blocks' probabilities kept for the
backward pass, and 31988 / 16004 / 8013 MiB with contiguous shards and `[t, T]` scores, too
much to step 32K on 8 fake devices. Compiled at XLA's default -O2 (the
`default_xla_optimizations` fixture): the three compiles take 20 s instead of 7, the 32K step
about 40 s instead of 90 (102 -> 59 s alone, 2026-12-06; the same figures at either level:
1021 / 524 / 278 MiB). Slow: about 1 min.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import random_model
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.ops.cross_entropy import linear_cross_entropy
from zaya_jax.parallel.context import in_context_order
from zaya_jax.parallel.mesh import batch_sharding, make_mesh, state_shardings

T_LONG = 32_768
CFG = ModelConfig(vocab_size=320, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=16, num_experts=4, moe_intermediate_size=32, router_hidden_size=16,
                  layer_types=("hybrid", "hybrid_sliding"), sliding_window=64, dtype="float32")


def _batch(t: int) -> dict[str, np.ndarray]:
  g = np.random.default_rng(0)
  inputs = g.integers(3, CFG.vocab_size, (1, t)).astype(np.int32)
  segment_ids = np.ones((1, t), np.int32)
  segment_ids[0, t // 3:] = 2  # two documents
  positions = np.where(np.arange(t) >= t // 3, np.arange(t) - t // 3, np.arange(t))[None]
  return dict(inputs=inputs, targets=np.roll(inputs, -1, axis=1), segment_ids=segment_ids,
              positions=positions.astype(np.int32), loss_mask=np.ones((1, t), np.float32))


def _loss_and_grads(graphdef):
  def loss_fn(params, model_state, batch):
    model = nnx.merge(graphdef, params, model_state, copy=True)
    x_BTD, _ = model.backbone(batch["inputs"], batch["segment_ids"], batch["positions"])
    loss_sum, tokens = linear_cross_entropy(*model.head_inputs(x_BTD),
                                            in_context_order(batch["targets"]),
                                            in_context_order(batch["loss_mask"]))
    return loss_sum / jnp.maximum(tokens, 1.0)
  return jax.jit(jax.value_and_grad(loss_fn))


def _placed(mesh, params, state, batch):
  return (jax.device_put(params, state_shardings(params, mesh)),
          jax.device_put(state, state_shardings(state, mesh)),
          jax.device_put(batch, batch_sharding(mesh)))


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.usefixtures("default_xla_optimizations")  # the 32K step: 90 s at -O0, 40 s at -O2
def test_activation_memory_falls_with_context():
  graphdef, params, state = nnx.split(random_model(CFG, seed=0), nnx.Param, ...)
  fn = _loss_and_grads(graphdef)
  abstract = lambda tree, sh: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
  temp, compiled = {}, {}
  for c in (2, 4, 8):
    mesh = make_mesh(MeshConfig(1, 1, 1, c), devices=jax.devices()[:c])
    batch = _batch(T_LONG)
    with jax.set_mesh(mesh):
      args = (abstract(params, state_shardings(params, mesh)),
              abstract(state, state_shardings(state, mesh)),
              abstract(batch, jax.tree.map(lambda _: batch_sharding(mesh), batch)))
      compiled[c] = fn.lower(*args).compile()
      temp[c] = compiled[c].memory_analysis().temp_size_in_bytes
  print({c: f"{b / 2**20:.0f} MiB" for c, b in temp.items()})
  for lo, hi in ((2, 4), (4, 8)):
    assert 0.35 <= temp[hi] / temp[lo] <= 0.65, temp
  mesh = make_mesh(MeshConfig(1, 1, 1, 8), devices=jax.devices()[:8])
  with jax.set_mesh(mesh):  # the C = 8 program measured above, not compiled a second time
    loss, grads = compiled[8](*_placed(mesh, params, state, _batch(T_LONG)))
  assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all()
                                          for g in jax.tree.leaves(grads))
