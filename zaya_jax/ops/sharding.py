# Shape letters: B M (see zaya_jax/__init__.py).
"""Running a Pallas call per batch shard under a device mesh.

A `pallas_call` has no sharding rule: under a multi-device mesh GSPMD would gather its
inputs. The kernels here are independent across their leading batch (or token) dimension,
so each device runs the kernel on its own rows inside `jax.shard_map`. The batch axes are
all axes of the current abstract mesh (`zaya_jax.config.mesh.BATCH_AXES` today: every mesh
axis shards the batch outside the MoE), so ops need no config.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P


def batch_axes() -> tuple[str, ...]:
  """The axes of the current abstract mesh (() without one): those that shard the batch."""
  return tuple(jax.sharding.get_abstract_mesh().axis_names)


def single_device() -> bool:
  """True without a mesh or with a one-device mesh: nothing to shard."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


def per_batch_shard(fn: Callable[..., Any], *batched: jax.Array,
                    shared: tuple[jax.Array, ...] = ()) -> Any:
  """`fn(*batched, *shared)`, per shard of the batch axes inside `shard_map` when a mesh is set.

  Args:
    fn: the kernel call; every output has the batch (or token) dimension first.
    batched: arrays with the batch (or token) dimension first, split over the batch axes.
    shared: arrays every shard reads whole (e.g. the balancing biases `[X]`).
  Returns:
    `fn`'s output (an array or a tuple of arrays), sharded over the batch axes.

  `check_vma=False`: Pallas interpret mode (CPU) slices varying arrays with unvarying indices,
  which the varying-axes checker rejects.
  """
  if single_device():
    return fn(*batched, *shared)
  rows = P(batch_axes())
  return jax.shard_map(fn, in_specs=(rows,) * len(batched) + (P(),) * len(shared),
                       out_specs=rows, check_vma=False)(*batched, *shared)


def varying_like(tree: Any, *like: jax.Array) -> Any:
  """`tree` (a loop's initial carry) marked varying over every mesh axis that any of `like`
  varies over: inside `shard_map` (with its varying-axes check) a `fori_loop` / `scan` carry
  must have the type of the body's output, which varies wherever its inputs do. Outside
  `shard_map`, or when nothing varies, `tree` is returned as is.

  Args:
    tree: arrays (any pytree), typically freshly made zeros.
    like: the arrays the loop body reads.
  """
  axes = set().union(*(_varying_axes(x) for x in like))
  if not axes:
    return tree

  def mark(x):
    missing = tuple(sorted(axes - _varying_axes(x)))  # pcast refuses axes already varying
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(mark, tree)


def summed_like(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """A custom VJP's cotangent `ct` brought to the type of its `primal` input: summed
  (`psum`) over the mesh axes `ct` varies over and `primal` does not, which is what autodiff
  does for an input that enters a varying computation unvarying (the transpose of the
  implicit `pcast` to varying is a `psum`). Outside `shard_map`, `ct` as is."""
  extra = tuple(sorted(_varying_axes(ct) - _varying_axes(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


def _varying_axes(x: jax.Array) -> set[str]:
  """The mesh axes `x` varies over inside `shard_map` (empty outside)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "mat", None)  # jax 0.10: ManualAxisType; older: aval.vma
  return set(manual.varying if manual is not None else getattr(aval, "vma", ()))
