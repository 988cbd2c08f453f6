"""TrainState: everything that changes during training, as one pytree of arrays.

The model is kept functional: `nnx.split(model, nnx.Param, ...)` gives a static `GraphDef`
plus two `nnx.State` pytrees, the trainable `params` (every `nnx.Param`) and `model_state`
(everything else: the router `BalancingBias` of every layer). Gradients and the optimizer see
only `params`; checkpoints hold both. Plain pytrees through `jax.jit` keep Orbax
checkpointing and (later) sharding simple.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zaya_jax.model import ModelConfig, ZayaForCausalLM, init_rngs
from zaya_jax.parallel.mesh import state_shardings
from zaya_jax.train.balance import BalanceState, init_balance_state


@flax.struct.dataclass
class TrainState:
  """One training step's worth of state.

  Attributes:
    step: int32 [], optimizer updates applied so far.
    params: nnx.State of the model's `nnx.Param`s (float32), the only trained leaves.
    model_state: nnx.State of the model's other variables (router balancing biases, float32).
    opt_state: optax state of the optimizer over `params`.
    rng: uint32 [2], raw PRNG key data of the training key (split per step when needed).
    skipped_steps: int32 [], updates skipped so far because the loss or a gradient was not
      finite (`train/skipped_steps`); skipped updates still advance `step`.
    consecutive_skips: int32 [], skipped updates since the last applied one (the loop rolls
      back to the last checkpoint once it reaches `train.max_consecutive_skips`).
    balance: the balancing-bias controller's state (zaya_jax/train/balance.py), float32
      `{"integral": [L, X], "prev_error": [L, X], "adamw": ...}`, replicated; None in states
      built without it (treated as zeros by `train_step`; such a state cannot be checkpointed).
  """

  step: jax.Array
  params: nnx.State
  model_state: nnx.State
  opt_state: Any
  rng: jax.Array
  skipped_steps: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
  consecutive_skips: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.zeros((), jnp.int32))
  balance: BalanceState | None = None

  def to_items(self) -> dict[str, Any]:
    """The checkpoint's array items (zaya_jax/checkpoint/__init__.py): `{"model": params and
    model_state merged into one nnx.State, "opt_state": ..., "train_meta": {"step", "rng",
    "skipped_steps", "consecutive_skips", "balance"}}`. Works on abstract states too
    (`jax.ShapeDtypeStruct` leaves: a restore target).

    Raises:
      ValueError: if `balance` is None (build it with `init_balance_state`): every checkpoint
        holds the controller state, so one without it could never be resumed.
    """
    if self.balance is None:
      raise ValueError("TrainState.balance is None: a checkpoint holds the balancing "
                       "controller's state; build it with zaya_jax.train.balance."
                       "init_balance_state(num_layers, num_router_classes)")
    meta = {"step": self.step, "rng": self.rng, "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips, "balance": self.balance}
    return {"model": nnx.merge_state(self.params, self.model_state), "opt_state": self.opt_state,
            "train_meta": meta}

  @classmethod
  def from_items(cls, items: dict[str, Any]) -> TrainState:
    """The TrainState of restored `to_items()` items (`nnx.Param`s split from the rest)."""
    params, model_state = nnx.split_state(items["model"], nnx.Param, ...)
    meta = items["train_meta"]
    return cls(step=meta["step"], params=params, model_state=model_state,
               opt_state=items["opt_state"], rng=meta["rng"], skipped_steps=meta["skipped_steps"],
               consecutive_skips=meta["consecutive_skips"], balance=meta["balance"])


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`(graphdef, params, model_state)`: `nnx.Param`s apart from every other variable."""
  return nnx.split(model, nnx.Param, ...)


def abstract_model(model_cfg: ModelConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`split_model` of a model built under `nnx.eval_shape`: shapes only, no memory, no FLOPs."""
  model = nnx.eval_shape(lambda: ZayaForCausalLM(model_cfg, rngs=init_rngs(seed)))
  return split_model(model)


def init_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation,
                     seed: int, mesh: jax.sharding.Mesh | None = None) -> TrainState:
  """A fresh TrainState at step 0: parameters from `init_rngs(seed)`, zero optimizer moments.

  Built inside `jax.jit`, so the large initialisers run compiled; with a `mesh`, every array
  is created directly in its sharding (`train_state_shardings`), never whole on one device.
  """

  def init() -> TrainState:
    _, params, model_state = split_model(ZayaForCausalLM(model_cfg, rngs=init_rngs(seed)))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        model_state=model_state,
        opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        balance=init_balance_state(model_cfg.num_layers, model_cfg.num_router_classes),
    )

  if mesh is None:
    return jax.jit(init)()
  shardings = state_shardings(jax.eval_shape(init), mesh)
  return jax.jit(init, out_shardings=shardings)()


def train_state_shardings(abstract_state: TrainState, mesh: jax.sharding.Mesh) -> TrainState:
  """NamedShardings of a TrainState on `mesh` (zaya_jax.parallel.mesh.LOGICAL_RULES)."""
  return state_shardings(abstract_state, mesh)


def abstract_train_state(model_cfg: ModelConfig, tx: optax.GradientTransformation,
                         seed: int) -> TrainState:
  """`init_train_state` as `jax.ShapeDtypeStruct` leaves (for Orbax restore targets)."""
  return jax.eval_shape(lambda: init_train_state(model_cfg, tx, seed))
