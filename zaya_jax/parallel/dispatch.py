# Shape letters: M D E X (see zaya_jax/__init__.py); e = local experts E/n, n = |expert| axis,
# P = rows handed to the local experts, C = capacity per (source shard, expert).
"""Token dispatch/combine for the MoE: who multiplies which token by which expert.

Every strategy has the same two calls, run per shard inside the MoE's `shard_map` (or on one
device):

    rows_PD, group_sizes_e, meta = d.dispatch(x_MD, class_M)   # rows grouped by local expert;
                                                                 # meta: the strategy's *Meta
    y_PD = experts(rows_PD, group_sizes_e)                       # local grouped GEMM
    y_MD, dropped_M = d.combine(y_PD, meta)                      # back to token order

`class_M` is the router's choice in [0, E]; class E (skip) is never dispatched and comes back
as zeros, like a dropped token (`dropped_M` marks tokens that lost their expert to capacity).

| strategy            | collectives over `expert`            | dropless | XLA:CPU |
|---------------------|--------------------------------------|----------|---------|
| `local`             | none (EP = 1)                        | yes      | yes     |
| `allgather`         | all-gather tokens, reduce-scatter out| yes      | yes     |
| `all_to_all`        | 2 x all-to-all of [E, C, D] buffers  | no (capacity factor) | yes |
| `ragged_all_to_all` | 2 x ragged all-to-all + count gather | yes      | lowers only (GPU path) |
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zaya_jax.parallel.mesh import EXPERT

DISPATCHES = ("auto", "local", "allgather", "all_to_all", "ragged_all_to_all")


def resolve_dispatch(name: str, expert_axis_size: int) -> str:
  """`"auto"` -> `"ragged_all_to_all"` on GPU, `"allgather"` elsewhere; `"local"` when EP = 1."""
  if name not in DISPATCHES:
    raise ValueError(f"model.moe_dispatch={name!r}; must be one of {DISPATCHES}")
  if expert_axis_size == 1:
    return "local"
  if name == "auto":
    return "ragged_all_to_all" if jax.default_backend() in ("gpu", "cuda", "rocm") else "allgather"
  if name == "local":
    raise ValueError(f"model.moe_dispatch='local' needs mesh.expert=1, got {expert_axis_size}")
  return name


def sort_by_key(key_M: jax.Array, num_keys: int):
  """`(order_M, counts_K)`: stable sort of rows by integer key in [0, num_keys)."""
  order_M = jnp.argsort(key_M, stable=True)
  return order_M, jnp.bincount(key_M, length=num_keys).astype(jnp.int32)


def unsort(y_sorted: jax.Array, order_M: jax.Array) -> jax.Array:
  """Inverse of gathering with `order_M`: output row `order_M[i]` = input row i."""
  return jnp.zeros_like(y_sorted).at[order_M].set(y_sorted, unique_indices=True)


class SortMeta(NamedTuple):
  """`LocalDispatch` / `AllGatherDispatch` metadata: `order_M` int32 [P], the stable sort of the
  (gathered) tokens by local expert that `combine` undoes."""

  order_M: jax.Array


class AllToAllMeta(NamedTuple):
  """`AllToAllDispatch` metadata: each token's buffer slot int32 [M] (E*C = dropped), bool [M]
  kept / dropped-by-capacity masks, and the static n (shards), e (local experts), c (capacity)."""

  slot_M: jax.Array
  kept_M: jax.Array
  dropped_M: jax.Array
  n: int
  e: int
  c: int


class RaggedMeta(NamedTuple):
  """`RaggedAllToAllDispatch` metadata: the sort of our tokens by expert (`order_M`) and of the
  received rows by local expert (`order_P`), and the int32 [n] ragged exchange tables: rows
  received from each shard, where each source keeps our results, rows sent, send offsets."""

  order_M: jax.Array
  order_P: jax.Array
  recv_n: jax.Array
  back_off_n: jax.Array
  send_n: jax.Array
  in_off_n: jax.Array


@dataclasses.dataclass(frozen=True)
class LocalDispatch:
  """All experts on this shard: sort tokens by class; skip rows sort last (past the groups).

  `sorted_by`: optional precomputed `(order_M, counts_X)` of `class_M` (the Pallas routing
  kernel's permutation and tokens per class), used instead of sorting here.
  """

  num_experts: int
  sorted_by: tuple[jax.Array, jax.Array] | None = None

  def dispatch(self, x_MD, class_M) -> tuple[jax.Array, jax.Array, SortMeta]:
    if self.sorted_by is None:
      order_M, counts_X = sort_by_key(class_M, self.num_experts + 1)
    else:
      order_M, counts_X = self.sorted_by
    return x_MD[order_M], counts_X[: self.num_experts], SortMeta(order_M)

  def combine(self, y_PD, meta: SortMeta) -> tuple[jax.Array, jax.Array]:
    return unsort(y_PD, meta.order_M), jnp.zeros(y_PD.shape[:1], bool)


@dataclasses.dataclass(frozen=True)
class AllGatherDispatch:
  """Dropless EP that runs anywhere: every shard of the `expert` axis gathers all tokens of
  its EP group, multiplies those routed to its own experts, and a reduce-scatter returns each
  token's result to its owner (n x the token traffic of all-to-all; for CPU tests)."""

  num_experts: int
  axis: str = EXPERT

  def dispatch(self, x_MD, class_M):
    n = jax.lax.axis_size(self.axis)
    e = self.num_experts // n
    x_all = jax.lax.all_gather(x_MD, self.axis, tiled=True)
    local_M = jax.lax.all_gather(class_M, self.axis, tiled=True) - jax.lax.axis_index(self.axis) * e
    key_M = jnp.where((local_M >= 0) & (local_M < e), local_M, e)  # e = not mine (or skip)
    order_M, counts = sort_by_key(key_M, e + 1)
    return x_all[order_M], counts[:e], SortMeta(order_M)

  def combine(self, y_PD, meta: SortMeta) -> tuple[jax.Array, jax.Array]:
    y_all = unsort(y_PD, meta.order_M)  # rows of other shards' experts are zero
    y_MD = jax.lax.psum_scatter(y_all, self.axis, scatter_dimension=0, tiled=True)
    return y_MD, jnp.zeros(y_MD.shape[:1], bool)


@dataclasses.dataclass(frozen=True)
class AllToAllDispatch:
  """Fixed-capacity EP: each shard sends at most C = ceil(capacity_factor * M / E) tokens to
  each expert in an `[E, C, D]` buffer (one all-to-all there, one back). Tokens past an
  expert's capacity are dropped: they bypass the experts as the skip class would."""

  num_experts: int
  capacity_factor: float
  axis: str = EXPERT

  def capacity(self, tokens: int) -> int:
    return max(1, math.ceil(self.capacity_factor * tokens / self.num_experts))

  def dispatch(self, x_MD, class_M) -> tuple[jax.Array, jax.Array, AllToAllMeta]:
    m, d = x_MD.shape
    n = jax.lax.axis_size(self.axis)
    e, c, big_e = self.num_experts // n, self.capacity(m), self.num_experts
    order_M, counts_X = sort_by_key(class_M, big_e + 1)
    starts_X = jnp.cumsum(counts_X) - counts_X
    pos_M = unsort(jnp.arange(m) - starts_X[class_M[order_M]], order_M)  # rank inside its expert
    routed_M = class_M < big_e
    kept_M = routed_M & (pos_M < c)
    slot_M = jnp.where(kept_M, class_M * c + pos_M, big_e * c)  # big_e*c = out of range: dropped
    buf = jnp.zeros((big_e * c, d), x_MD.dtype).at[slot_M].set(x_MD, mode="drop")
    # Chunk k of the buffer (experts of shard k) goes to shard k; we receive [source, e, C, D].
    recv = jax.lax.all_to_all(buf, self.axis, 0, 0, tiled=True)
    rows = recv.reshape(n, e, c, d).transpose(1, 0, 2, 3).reshape(e * n * c, d)
    meta = AllToAllMeta(slot_M, kept_M, routed_M & ~kept_M, n, e, c)
    return rows, jnp.full((e,), n * c, jnp.int32), meta

  def combine(self, y_PD, meta: AllToAllMeta) -> tuple[jax.Array, jax.Array]:
    slot_M, kept_M, dropped_M, n, e, c = meta
    d = y_PD.shape[-1]
    back = y_PD.reshape(e, n, c, d).transpose(1, 0, 2, 3).reshape(n * e * c, d)
    buf = jax.lax.all_to_all(back, self.axis, 0, 0, tiled=True)  # [E*C, D] in our slot layout
    y_MD = jnp.where(kept_M[:, None], buf.at[slot_M].get(mode="fill", fill_value=0), 0)
    return y_MD, dropped_M


@dataclasses.dataclass(frozen=True)
class RaggedAllToAllDispatch:
  """Dropless EP for GPUs: tokens sorted by expert travel with `ragged_all_to_all` in
  variable-sized chunks (sizes exchanged by an all-gather of per-expert counts), are regrouped
  by local expert, and return the same way. Receive buffers hold the worst case n x M rows.
  XLA:CPU cannot compile `ragged-all-to-all`; on CPU this path is only lowered."""

  num_experts: int
  axis: str = EXPERT

  def dispatch(self, x_MD, class_M) -> tuple[jax.Array, jax.Array, RaggedMeta]:
    m, d = x_MD.shape
    n = jax.lax.axis_size(self.axis)
    me = jax.lax.axis_index(self.axis)
    e = self.num_experts // n
    order_M, counts_X = sort_by_key(class_M, self.num_experts + 1)
    # counts[s, k]: tokens of source shard s for expert k; sizes[s, t]: rows s sends to t.
    counts_nE = jax.lax.all_gather(counts_X[: self.num_experts], self.axis)
    sizes_nn = counts_nE.reshape(n, n, e).sum(-1)
    send_n = sizes_nn[me]
    in_off_n = jnp.cumsum(send_n) - send_n
    recv_n = sizes_nn[:, me]
    out_off_n = (jnp.cumsum(sizes_nn, axis=0) - sizes_nn)[me]  # where our rows land at each t
    recv = jax.lax.ragged_all_to_all(x_MD[order_M], jnp.zeros((n * m, d), x_MD.dtype), in_off_n,
                                     send_n, out_off_n, recv_n, axis_name=self.axis)
    # Received rows: source-major, then by local expert. Regroup by local expert.
    local_ne = jax.lax.dynamic_slice_in_dim(counts_nE, me * e, e, axis=1)
    bucket = jnp.searchsorted(jnp.cumsum(local_ne.reshape(-1)), jnp.arange(n * m), side="right")
    key = jnp.where(bucket < n * e, bucket % e, e)
    order_P, counts = sort_by_key(key, e + 1)
    back_off_n = (jnp.cumsum(sizes_nn, axis=1) - sizes_nn)[:, me]  # where sources keep our rows
    meta = RaggedMeta(order_M, order_P, recv_n, back_off_n, send_n, in_off_n)
    return recv[order_P], counts[:e], meta

  def combine(self, y_PD, meta: RaggedMeta) -> tuple[jax.Array, jax.Array]:
    order_M, order_P, recv_n, back_off_n, send_n, in_off_n = meta
    m = order_M.shape[0]
    y_recv = unsort(y_PD, order_P)
    y_sorted = jax.lax.ragged_all_to_all(y_recv, jnp.zeros((m, y_PD.shape[-1]), y_PD.dtype),
                                         jnp.cumsum(recv_n) - recv_n, recv_n, back_off_n, send_n,
                                         axis_name=self.axis)
    return unsort(y_sorted, order_M), jnp.zeros((m,), bool)


Dispatcher = LocalDispatch | AllGatherDispatch | AllToAllDispatch | RaggedAllToAllDispatch


def make_dispatcher(name: str, num_experts: int, capacity_factor: float) -> Dispatcher:
  """The dispatcher for a resolved strategy name (see `resolve_dispatch`)."""
  if name == "local":
    return LocalDispatch(num_experts)
  if name == "allgather":
    return AllGatherDispatch(num_experts)
  if name == "all_to_all":
    return AllToAllDispatch(num_experts, capacity_factor)
  if name == "ragged_all_to_all":
    return RaggedAllToAllDispatch(num_experts)
  raise ValueError(f"unknown dispatch {name!r}; must be one of {DISPATCHES}")
