"""Training is causal: nothing in a training step lets a token's loss depend on later tokens of
its sequence or on the other sequences of the batch.

The real `train_step` (forward with the step's balancing, head, loss) on a [4, 32] batch whose
loss mask keeps only the early positions (or only row 0): the step's loss must not change, bit
for bit, when the later tokens (or the other rows) change. Every mode whose forward routes with
the biases fixed before the step (the default "quantile" with `quantile_apply="next"`, with or
without `quantile_reroute` (which changes only the update after the step), "adamw",
"pid", "sign", balancing off) shares one forward (`batch_balance_of` is None for all of them),
so one compiled step covers them; the opt-in `quantile_apply="current"` (biases solved from the
routed batch itself) is shown to break both properties, which is also the proof that the test
can fail. With `mesh.context=2` (multidevice: 2 of the 8 fake CPU devices) the sequence is
split at EARLY, so the first shard must not see the second one; the loss equals one device's.
"""

import dataclasses

import jax
import numpy as np
import pytest

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.parallel.mesh import batch_sharding, make_mesh
from zaya_jax.train import init_train_state, make_optimizer, make_schedule, train_step
from zaya_jax.train.state import abstract_model
from zaya_jax.train.step import batch_balance_of

from tests.helpers import tiny_model_config

B, T, EARLY = 4, 32, 16
CAUSAL_MODES = [BalanceConfig(), BalanceConfig(quantile_reroute=False, quantile_integral=0.15),
                BalanceConfig(mode="adamw"), BalanceConfig(mode="pid"),
                BalanceConfig(mode="sign"), BalanceConfig(enabled=False)]


@pytest.fixture(scope="module")
def steps():
  model_cfg = dataclasses.replace(tiny_model_config(), num_experts=8)
  train_cfg = TrainConfig(num_steps=10, warmup_steps=2, lr=1e-2, batch_size=B, seq_len=T)
  graphdef, params_shape, _ = abstract_model(model_cfg, seed=0)
  tx = make_optimizer(train_cfg, params_shape)
  state = init_train_state(model_cfg, tx, seed=0)
  make = lambda cfg: jax.jit(lambda s, b: train_step(graphdef, tx, make_schedule(train_cfg), s, b,
                                                     balance=cfg)[1]["loss"])
  return state, {"causal": make(BalanceConfig()),
                 "current": make(BalanceConfig(quantile_apply="current")),
                 "context": make(BalanceConfig())}  # traced under a context mesh only


def _batch(seed):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, 259, (B, T)).astype(np.int32)
  return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1),
          "segment_ids": np.ones((B, T), np.int32),
          "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
          "loss_mask": np.ones((B, T), np.float32)}


def _changed(batch, rows, cols, seed):
  out = {k: v.copy() for k, v in batch.items()}
  new = np.random.default_rng(seed).integers(3, 259, (B, T)).astype(np.int32)
  out["inputs"][rows, cols] = new[rows, cols]
  out["targets"] = np.roll(out["inputs"], -1, axis=1)
  return out


def _early_only(batch):
  batch = {k: v.copy() for k, v in batch.items()}
  batch["loss_mask"][:, EARLY - 1:] = 0.0  # targets of positions < EARLY - 1 are early tokens
  return batch


def _row0_only(batch):
  batch = {k: v.copy() for k, v in batch.items()}
  batch["loss_mask"][1:] = 0.0
  return batch


def test_every_causal_mode_routes_with_fixed_biases():
  for cfg in CAUSAL_MODES:
    assert batch_balance_of(cfg) is None, cfg
  assert batch_balance_of(BalanceConfig(quantile_apply="current")) is not None


@pytest.mark.slow
def test_early_positions_do_not_see_later_tokens(steps):
  state, step = steps
  batch = _batch(0)
  later = _changed(batch, slice(None), slice(EARLY, None), seed=1)
  a = np.asarray(step["causal"](state, _early_only(batch)))
  b = np.asarray(step["causal"](state, _early_only(later)))
  assert np.isfinite(a) and a == b, (a, b)  # bit for bit
  # The in-batch solve is not causal: the early loss moves with the later tokens.
  a = np.asarray(step["current"](state, _early_only(batch)))
  b = np.asarray(step["current"](state, _early_only(later)))
  assert a != b, "quantile_apply='current' became causal: update this test and README"


def test_a_row_does_not_see_the_other_rows(steps):
  state, step = steps
  batch = _batch(2)
  others = _changed(batch, slice(1, None), slice(None), seed=3)
  a = np.asarray(step["causal"](state, _row0_only(batch)))
  b = np.asarray(step["causal"](state, _row0_only(others)))
  assert np.isfinite(a) and a == b, (a, b)
  a = np.asarray(step["current"](state, _row0_only(batch)))
  b = np.asarray(step["current"](state, _row0_only(others)))
  assert a != b, "quantile_apply='current' became causal: update this test and README"


@pytest.mark.multidevice
def test_causal_under_context_parallelism(steps):
  state, step = steps
  mesh = make_mesh(MeshConfig(1, 1, 1, 2), devices=jax.devices()[:2])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch = _batch(0)
  later = _changed(batch, slice(None), slice(EARLY, None), seed=1)  # the whole second shard
  others = _changed(batch, slice(1, None), slice(None), seed=3)
  with jax.set_mesh(mesh):
    placed = jax.device_put(state, replicated)
    loss = lambda b: np.asarray(step["context"](placed, jax.device_put(b, batch_sharding(mesh))))
    a, b = loss(_early_only(batch)), loss(_early_only(later))
    assert np.isfinite(a) and a == b, (a, b)
    a, b = loss(_row0_only(batch)), loss(_row0_only(others))
    assert np.isfinite(a) and a == b, (a, b)
    full = loss(batch)
  one = np.asarray(step["causal"](state, batch))
  assert abs(full - one) <= 1e-5 * abs(one), (full, one)
