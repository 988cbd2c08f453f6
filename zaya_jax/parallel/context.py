# Shape letters: B T S (see zaya_jax/__init__.py); t = tokens per context shard (T / |context|).
"""Context parallelism: every sequence split into |context| contiguous shards of t = T / C tokens.

Under a mesh whose `context` axis has C > 1 devices, activations `[B, T, ...]` are sharded
`P(BATCH_AXES, CONTEXT)`: shard r holds global positions `[r t, (r + 1) t)` of every row of
its batch block. Everything per token (embedding, norms, router, experts, residual scales,
LM head and loss) runs on the local shard under GSPMD, and the sums of the loss, the token
counts and the routing counts reduce over `context` as over `data` (jit's global semantics).
Only CCA mixes tokens over time; it runs per shard inside `jax.shard_map`
(zaya_jax/model/cca.py) with the two collectives of this module:

- `previous_rows`: the last n rows of the previous shard (one `ppermute` r -> r + 1; shard 0
  receives zeros, which CCA gives segment id 0 = "no document", so they never contribute).
  CCA's causal convolutions need n = W0 + W1 - 2 pre-convolution `[q0, k0]` rows and the
  delayed value 1 row (`ModelConfig.context_halo`);
- `gather_sequence`: the all-gather of CCA's compressed keys/values (and segment ids) over
  `context`; each shard's queries attend to all T keys with the causal and document masks at
  global positions (`shard_offset`). Its transpose, in the backward pass, is the
  reduce-scatter of dK / dV.

The shard order is contiguous (not zigzag / head-tail): with causal masking the last shard
does ~(2C - 1) / C times the mean attention work (see README "Context parallelism").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zaya_jax.config.mesh import BATCH_AXES, CONTEXT, check_context

__all__ = ["check_context", "context_size", "gather_sequence", "previous_rows", "shard_offset",
           "token_order"]


def context_size() -> int:
  """Devices on the `context` axis of the current abstract mesh (1 without a mesh or axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or CONTEXT not in mesh.axis_names:
    return 1
  return int(dict(mesh.shape)[CONTEXT])


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


def previous_rows(x_BT_: jax.Array, n: int) -> jax.Array:
  """Inside `shard_map` over `context`: the last `n` rows (axis 1) of the previous shard.

  Args:
    x_BT_: this shard's `[B, t, ...]` block (any dtype); `n <= t`.
    n: rows wanted (static); 0 gives an empty `[B, 0, ...]` array without a collective.
  Returns:
    `[B, n, ...]`, x's dtype: shard r gets rows `[t - n, t)` of shard r - 1; shard 0 zeros.
  """
  if n == 0:
    return x_BT_[:, :0]
  c = jax.lax.axis_size(CONTEXT)
  return jax.lax.ppermute(x_BT_[:, x_BT_.shape[1] - n:], CONTEXT,
                          perm=[(r, r + 1) for r in range(c - 1)])


def gather_sequence(x_BT_: jax.Array) -> jax.Array:
  """Inside `shard_map` over `context`: every shard's `[B, t, ...]` block concatenated in
  shard order, `[B, C t, ...]` = the whole sequence (an all-gather; its transpose is the
  reduce-scatter of the cotangent)."""
  return jax.lax.all_gather(x_BT_, CONTEXT, axis=1, tiled=True)


def shard_offset(t: int) -> jax.Array:
  """Inside `shard_map` over `context`: int32 [], the global position of this shard's first
  token (`r * t`)."""
  return (jax.lax.axis_index(CONTEXT) * t).astype(jnp.int32)
