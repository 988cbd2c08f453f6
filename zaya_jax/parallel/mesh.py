"""The device mesh and the one table that maps logical axes to mesh axes.

Mesh axes (`MESH_AXES`, in this order, all `AxisType.Auto`):

| mesh axis | meaning                   | shards                                                      |
|-----------|---------------------------|-------------------------------------------------------------|
| `data`    | pure replicas (DDP)       | batch                                                       |
| `fsdp`    | FSDP / ZeRO-3             | batch; parameter dim `embed` (gathered for compute)         |
| `expert`  | expert parallelism (EP)   | batch outside the MoE; experts inside it (tokens move by all-to-all) |
| `context` | context parallelism (CP)  | the sequence dim of activations (zaya_jax/parallel/context.py) |

Parameters carry logical axis names (zaya_jax/model/layers.py); `LOGICAL_RULES` resolves
them. Activations shard on the batch axes (`BATCH_AXES`) and their sequence dim on `context`
directly, so params can shard on `embed` while activations shard on the batch.
"""

from __future__ import annotations

import contextlib
import math
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zaya_jax.config.mesh import (BATCH_AXES, CONTEXT, DATA, EXPERT, FSDP, MESH_AXES, MeshConfig,
                                  check_context)


LOGICAL_RULES = (
    ("embed", FSDP),  # D of every weight: FSDP shards it, XLA all-gathers it for compute
    ("vocab", None),  # V: the tied embedding / LM head is sharded on D (fsdp) only
    ("q_heads", None), ("kv_heads", None), ("head_dim", None),  # attention: few heads, replicate
    ("conv", None),  # CCA conv channels
    ("experts", EXPERT),  # E: each EP shard holds E / |expert| experts
    ("expert_mlp", None),  # F
    ("router", None), ("classes", None),  # the router is tiny: replicated
    ("layers", None),  # the scan axis L
)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
  """A `Mesh` over `devices` (default: all) with axes `MESH_AXES`, all `AxisType.Auto`."""
  devices = jax.devices() if devices is None else devices
  sizes = cfg.shape(len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  if len(devices) == len(jax.devices()):  # all devices: let JAX order them for the topology
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Enters `jax.set_mesh(mesh)` and Flax's `nnx.logical_axis_rules(LOGICAL_RULES)` together, so
  that model code (shard_map in the MoE) and Flax (`nnx.eval_shape`, sharding metadata) both
  resolve logical names through this module's table."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(LOGICAL_RULES):
    yield mesh


def check_divisibility(mesh: Mesh, *, num_experts: int, hidden_size: int, batch_size: int,
                       grad_accum_steps: int = 1, seq_len: int | None = None,
                       halo: int = 1, attention_impl: str = "xla") -> None:
  """Fails at start if the mesh does not divide the model or the batch.

  `seq_len` (None: not checked) with CCA's `halo` (`max(ModelConfig.context_halo)`) and
  `attention_impl`: the `context` axis must split the sequence into shards CCA can run on
  (`zaya_jax.config.mesh.check_context`).

  Raises:
    ValueError: naming the config field and both numbers, e.g. `model.num_experts=6 is not
      divisible by mesh.expert=4`.
  """
  s = dict(mesh.shape)
  if num_experts % s[EXPERT]:
    raise ValueError(f"model.num_experts={num_experts} is not divisible by mesh.expert={s[EXPERT]}; "
                     "choose an expert axis that divides the number of experts")
  if hidden_size % s[FSDP]:
    raise ValueError(f"model.hidden_size={hidden_size} is not divisible by mesh.fsdp={s[FSDP]}; "
                     "choose an fsdp axis that divides the hidden size")
  n = math.prod(s[a] for a in BATCH_AXES)
  if batch_size % n:
    raise ValueError(f"train.batch_size={batch_size} is not divisible by the {n} batch shards "
                     f"(mesh data*fsdp*expert = {s[DATA]}*{s[FSDP]}*{s[EXPERT]}); use a multiple of {n}")
  micro = batch_size // grad_accum_steps
  if micro % n:
    raise ValueError(f"train.batch_size={batch_size} / train.grad_accum_steps={grad_accum_steps} = "
                     f"{micro} sequences per micro-batch is not divisible by the {n} batch shards; "
                     f"use a micro-batch that is a multiple of {n} (fewer accumulation steps)")
  if seq_len is not None:
    check_context(s.get(CONTEXT, 1), seq_len, halo, attention_impl)


def logical_to_spec(names) -> P:
  """PartitionSpec for a tuple of logical axis names, through `LOGICAL_RULES`."""
  rules = dict(LOGICAL_RULES)
  return P(*(rules.get(n) if n is not None else None for n in names))


def state_shardings(tree, mesh: Mesh):
  """`NamedSharding`s for every array of `tree` (an nnx.State, a TrainState, optimizer state).

  Arrays inside an `nnx.Variable` are sharded by its logical names (`out_sharding` metadata)
  through `LOGICAL_RULES`; other arrays (step, RNG, optimizer counts) are replicated. The
  result has the same pytree structure as `tree`, so it serves as jit in/out shardings,
  `jax.device_put` targets and Orbax restore shardings.
  """

  def one(x):
    if isinstance(x, nnx.Variable):
      names = x.get_metadata().get("out_sharding")
      return x.replace(NamedSharding(mesh, logical_to_spec(names) if names else P()))
    return NamedSharding(mesh, P())

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_with_shardings(abstract_tree, shardings):
  """Restore targets: `abstract_tree` with every leaf a `jax.ShapeDtypeStruct` carrying its
  sharding, for reading a checkpoint onto a mesh (or one device) other than the writer's.

  Args:
    abstract_tree: a pytree of arrays or `jax.ShapeDtypeStruct`s (shape and dtype are kept).
    shardings: one `jax.sharding.Sharding` for every leaf (e.g. one CPU device), or a pytree
      of the same structure (e.g. `state_shardings(abstract_tree, mesh)`).
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings),
                        abstract_tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of `[B, T]` input batches: B over every batch axis, T over `context` (if the
  mesh has that axis)."""
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT if CONTEXT in mesh.axis_names else None))


def use_cpu_devices(num_devices: int) -> None:
  """Asks XLA:CPU for `num_devices` fake devices, as
  `XLA_FLAGS=--xla_force_host_platform_device_count=N` does; only before JAX starts its
  backend (afterwards the device count is fixed and this is a no-op)."""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError:  # backend already initialised
    pass
