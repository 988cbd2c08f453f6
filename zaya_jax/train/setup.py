"""One place that builds the jitted training step the way `zaya_jax.train.loop.run` runs it,
for the loop and for the tools that compile or time that same step (launch.mesh_sweep,
launch.benchmark)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax
from flax import nnx

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.mesh import batch_sharding
from zaya_jax.train.optim import balance_rate_schedule, make_optimizer, make_schedule
from zaya_jax.train.state import TrainState, abstract_model, abstract_train_state, train_state_shardings
from zaya_jax.train.step import make_train_step


class TrainSetup(NamedTuple):
  """The static pieces of one run's training step.

  Attributes:
    graphdef: the model's NNX graph definition.
    params_shape: `nnx.State` of `jax.ShapeDtypeStruct`s, the trainable parameters.
    tx: the optimizer (`make_optimizer`); schedule: its learning-rate schedule.
    abstract_state: the TrainState of `jax.ShapeDtypeStruct`s; state_sharding: its
      NamedShardings on the mesh; data_sharding: the `[B, T]` batch's sharding.
    step: the jitted, state-donating `make_train_step` with all of the above bound.
  """

  graphdef: nnx.GraphDef
  params_shape: nnx.State
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState
  state_sharding: Any
  data_sharding: jax.sharding.NamedSharding
  step: Callable[..., Any]


def setup_training(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh,
                   balance: BalanceConfig | None, fault_injection: bool = False) -> TrainSetup:
  """The training step of `model_cfg` / `train_cfg` on `mesh`, with the balancing-bias
  controller `balance` (None = off) and `train_cfg.grad_accum_steps` micro-batches, exactly
  as the training loop compiles it. Nothing is allocated; call inside `use_mesh(mesh)`.
  `fault_injection`: see `make_train_step` (the loop's test-only NaN injection)."""
  graphdef, params_shape, _ = abstract_model(model_cfg, train_cfg.seed)
  tx = make_optimizer(train_cfg, params_shape)
  schedule = make_schedule(train_cfg)
  abstract_state = abstract_train_state(model_cfg, tx, train_cfg.seed)
  state_sharding = train_state_shardings(abstract_state, mesh)
  data_sharding = batch_sharding(mesh)
  step = make_train_step(graphdef, tx, schedule, state_sharding, data_sharding,
                         fault_injection=fault_injection, balance=balance,
                         grad_accum_steps=train_cfg.grad_accum_steps,
                         balance_rate=(balance_rate_schedule(train_cfg, balance.rate_lr_power)
                                       if balance is not None and balance.rate_lr_power
                                       else None))
  return TrainSetup(graphdef, params_shape, tx, schedule, abstract_state, state_sharding,
                    data_sharding, step)
