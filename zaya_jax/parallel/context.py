# Shape letters: B T (see zaya_jax/__init__.py); t = tokens per context shard (T / C), c =
# tokens per chunk (T / 2C).
"""Context parallelism: every sequence split over the C devices of `mesh.context` in zigzag
(head-tail) order, so that with causal attention every shard does the same work.

The sequence of T tokens is cut into 2C chunks of c = T / (2C) tokens; shard r holds chunks r
and 2C - 1 - r (t = 2c tokens: one early, one late). Chunk r's queries see r + 1 key chunks
and chunk 2C - 1 - r's see 2C - r, so every shard attends over 2C + 1 (query chunk, key chunk)
blocks; in contiguous order the last shard would do ~(2C - 1) / C times the mean. The model
reorders its `[B, T]` inputs once (`to_context_order`; int32 token ids, segment ids and
positions: B T numbers) and every activation `[B, T, ...]` stays in that order, sharded
`P(BATCH_AXES, CONTEXT)` (a plain block split of the reordered T), until the loss, which is a
sum over tokens: the training step reorders its targets and loss mask the same way
(`in_context_order`) instead of un-permuting `[B, T, D]` activations. Positions (RoPE, the
causal and window masks) are those of the natural order, computed before reordering, so
packing needs nothing special: segment ids travel with the tokens.

Everything per token (embedding, norms, router, experts, residual scales, LM head and loss)
runs on the local shard under GSPMD, and the sums of the loss, the token counts and the routing
counts reduce over `context` as over `data` (jit's global semantics). Only CCA mixes tokens
over time; it runs per shard inside `jax.shard_map` (zaya_jax/model/cca.py) with the
collectives of this module:

- `previous_rows`: each local chunk's n preceding tokens, n = W0 + W1 - 2 pre-convolution
  `[q0, k0]` rows and the delayed value's 1 row (`ModelConfig.context_halo`). Chunk r's
  predecessor (chunk r - 1) is the first chunk of shard r - 1: one `ppermute` r -> r + 1 (shard
  0 receives zeros, which CCA gives segment id 0 = "no document", so they never contribute).
  Chunk 2C - 1 - r's predecessor (chunk 2C - 2 - r) is the second chunk of shard r + 1: one
  `ppermute` r + 1 -> r; on the middle shard r = C - 1 it is its own first chunk (no
  communication). `previous_rows_joint` sends the conv rows and the value row together: one
  `ppermute` each way per layer and pass;
- `gather_sequence`: the all-gather of CCA's compressed keys/values (and segment ids) over
  `context`, returned in natural order; each shard's two query chunks attend to the key
  chunks before them (`zaya_jax.ops.zigzag_attention.zigzag_block_attention`). Its
  transpose, in the backward pass, is the reduce-scatter of dK / dV.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zaya_jax.config.mesh import BATCH_AXES, CONTEXT, check_context

# `jax.named_scope` of CCA's context-parallel shard_map: its collectives (K/V all-gather, dK/dV
# reduce-scatter, halo permutes) carry it in their HLO `op_name` (zaya_jax.perf.hlo).
CONTEXT_SCOPE = "cca_context"

__all__ = ["CONTEXT_SCOPE", "check_context", "context_size", "from_context_order", "gather_sequence",
           "in_context_order", "previous_rows", "previous_rows_joint", "to_context_order", "token_order"]


def context_size() -> int:
  """Devices on the `context` axis of the current abstract mesh (1 without a mesh or axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT not in mesh.axis_names:
    return 1
  return int(dict(mesh.shape)[CONTEXT])


def to_context_order(x_BT_: jax.Array, c: int, axis: int = 1) -> jax.Array:
  """Natural -> zigzag order of the sequence axis: `[..., T, ...]` whose block r of t = T / c
  tokens is chunks r and 2c - 1 - r of the natural sequence (chunks of T / 2c tokens).

  Args:
    x_BT_: any array; `axis` (static) is the sequence axis, of length divisible by 2c.
    c: context shards (static); 1 is the identity.
  Returns:
    The same shape and dtype. `from_context_order(to_context_order(x, c), c) == x`.
  """
  if c == 1:
    return x_BT_
  x = jnp.moveaxis(x_BT_, axis, 0)
  n, rest = x.shape[0], x.shape[1:]
  halves = x.reshape(2, c, n // (2 * c), *rest)
  y = jnp.stack([halves[0], halves[1][::-1]], axis=1).reshape(n, *rest)
  return jnp.moveaxis(y, 0, axis)


def from_context_order(x_BT_: jax.Array, c: int, axis: int = 1) -> jax.Array:
  """Zigzag -> natural order of the sequence axis (the inverse of `to_context_order`)."""
  if c == 1:
    return x_BT_
  y = jnp.moveaxis(x_BT_, axis, 0)
  n, rest = y.shape[0], y.shape[1:]
  pairs = y.reshape(c, 2, n // (2 * c), *rest)
  x = jnp.concatenate([pairs[:, 0], pairs[::-1, 1]], axis=0).reshape(n, *rest)
  return jnp.moveaxis(x, 0, axis)


def in_context_order(x_BT_: jax.Array, axis: int = 1) -> jax.Array:
  """`to_context_order` with the current mesh's `context` size, sharded like activations
  (`P(BATCH_AXES, CONTEXT)` on axes `axis - 1`, `axis`); the identity without context
  parallelism. For the `[B, T]` arrays that must line up with the model's activations: its
  inputs (`ZayaForCausalLM.backbone`), the targets, loss mask and padding mask of the loss
  and of the balancing statistics (zaya_jax/train/step.py)."""
  c = context_size()
  if c == 1:
    return x_BT_
  y = to_context_order(x_BT_, c, axis)
  spec = [None] * y.ndim
  spec[axis - 1], spec[axis] = BATCH_AXES, CONTEXT
  return jax.lax.with_sharding_constraint(y, P(*spec))


def token_order(b: int, t: int):
  """`(to_tokens, from_tokens)`: `[B, T, ...]` <-> `[M, ...]` (M = B T) in the order in which
  every device's tokens form one contiguous block of M, for the MoE's `P(TOKEN_AXES)`.

  Without context parallelism that is the plain reshape (B-major). With C > 1 context shards
  and n batch shards, M runs over (batch shard, context shard, row in the batch shard,
  position in the context shard): a plain reshape would interleave the context shards'
  tokens and make GSPMD move them between devices before the MoE's `shard_map`.
  `from_tokens(to_tokens(x)) == x`; per-token work and sums over M do not see the order.
  """
  c = context_size()
  if c == 1:
    return (lambda x: x.reshape(b * t, *x.shape[2:])), (lambda x: x.reshape(b, t, *x.shape[1:]))
  mesh = jax.sharding.get_abstract_mesh()
  n = 1
  for a in BATCH_AXES:
    n *= int(dict(mesh.shape).get(a, 1))

  def to_tokens(x_BT_):
    rest = x_BT_.shape[2:]
    x = x_BT_.reshape(n, b // n, c, t // c, *rest)
    return jnp.swapaxes(x, 1, 2).reshape(b * t, *rest)

  def from_tokens(x_M_):
    rest = x_M_.shape[1:]
    x = x_M_.reshape(n, c, b // n, t // c, *rest)
    return jnp.swapaxes(x, 1, 2).reshape(b, t, *rest)

  return to_tokens, from_tokens


def previous_rows(x_RC_: jax.Array, n: int) -> jax.Array:
  """Inside `shard_map` over `context`: the n tokens before each of this shard's two chunks.

  Args:
    x_RC_: this shard's chunks as rows, `[2B, c, ...]` (any dtype): row 2b is chunk r of
      batch row b, row 2b + 1 its chunk 2C - 1 - r (`[B, t, ...]` reshaped); `n <= c`.
    n: rows wanted (static); 0 gives an empty `[2B, 0, ...]` array without a collective.
  Returns:
    `[2B, n, ...]`, x's dtype: for chunk r the last n tokens of chunk r - 1 (shard r - 1's
    first chunk; zeros on shard 0), for chunk 2C - 1 - r those of chunk 2C - 2 - r (shard
    r + 1's second chunk; on shard C - 1 its own first chunk).
  """
  if n == 0:
    return x_RC_[:, :0]
  c = jax.lax.axis_size(CONTEXT)
  rest = x_RC_.shape[2:]
  tails = x_RC_[:, x_RC_.shape[1] - n:].reshape(-1, 2, n, *rest)
  first, second = tails[:, 0], tails[:, 1]
  from_previous = jax.lax.ppermute(first, CONTEXT, perm=[(r, r + 1) for r in range(c - 1)])
  from_next = jax.lax.ppermute(second, CONTEXT, perm=[(r, r - 1) for r in range(1, c)])
  middle = jax.lax.axis_index(CONTEXT) == c - 1
  before_second = jnp.where(middle, first, from_next)
  return jnp.stack([from_previous, before_second], axis=1).reshape(-1, n, *rest)


def previous_rows_joint(xs_RC_: list[jax.Array], ns: list[int]) -> list[jax.Array]:
  """`[previous_rows(x, n) for x, n in zip(xs_RC_, ns)]` in one exchange per direction: the
  arrays' tails are flattened and concatenated, so a CCA layer's conv rows and delayed-value
  row travel in one `ppermute` each way instead of one per array (half the collectives per
  layer and pass; the same bytes). Arrays of different dtypes are exchanged one by one.

  Args:
    xs_RC_: `[2B, c, ...]` chunk rows as for `previous_rows` (same 2B and c).
    ns: rows wanted of each (static; each <= c).
  Returns:
    One `[2B, n, ...]` array per input, as `previous_rows` gives it.
  """
  if len(xs_RC_) == 1 or len({x.dtype for x in xs_RC_}) > 1 or 0 in ns:
    return [previous_rows(x, n) for x, n in zip(xs_RC_, ns)]
  rows = xs_RC_[0].shape[0]
  tails = [x[:, x.shape[1] - n:].reshape(rows, -1) for x, n in zip(xs_RC_, ns)]
  joint = previous_rows(jnp.concatenate(tails, axis=1)[:, None], 1)[:, 0]
  edges = np.cumsum([0] + [t.shape[1] for t in tails])
  return [joint[:, a:b].reshape(rows, n, *x.shape[2:])
          for a, b, x, n in zip(edges[:-1], edges[1:], xs_RC_, ns)]


def gather_sequence(x_Bt_: jax.Array) -> jax.Array:
  """Inside `shard_map` over `context`: every shard's `[B, t, ...]` block gathered and put back
  in natural order, `[B, T, ...]` = the whole sequence (an all-gather; its transpose is the
  reduce-scatter of the cotangent)."""
  c = jax.lax.axis_size(CONTEXT)
  return from_context_order(jax.lax.all_gather(x_Bt_, CONTEXT, axis=1, tiled=True), c)
