# Shape letters: B T (see zaya_jax/__init__.py).
"""Document bookkeeping of packed rows: positions inside documents, shifts within a document.

The attention op itself (masks, softmax attention, the Pallas kernel) is
`zaya_jax.ops.attention`. Packed rows carry `segment_ids [B, T]`: 1, 2, ... per document, 0
for padding. A query sees a key only inside its own document, causally; CCA's convolutions
and delayed values read only earlier tokens of the same document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_positions(segment_ids_BT: jax.Array) -> jax.Array:
  """Position of each token inside its document, int32 `[B, T]`, restarting at 0 per document."""
  _, t = segment_ids_BT.shape
  idx = jnp.arange(t, dtype=jnp.int32)
  prev = jnp.pad(segment_ids_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  start = jnp.where(segment_ids_BT != prev, idx, 0)
  return idx - jax.lax.cummax(start, axis=1)


def shifted_same_document(segment_ids_BT: jax.Array, shift: int) -> jax.Array:
  """bool `[B, T]`: token `t - shift` exists and lies in the same (non-padding) document as `t`."""
  if shift == 0:
    return segment_ids_BT != 0
  b, t = segment_ids_BT.shape
  prev = jnp.pad(segment_ids_BT, ((0, 0), (shift, 0)), constant_values=0)[:, :t]
  return (prev == segment_ids_BT) & (segment_ids_BT != 0)


def shift_right(x_BT_: jax.Array, shift: int) -> jax.Array:
  """`y[:, t] = x[:, t - shift]`, zeros for `t < shift` (time is axis 1)."""
  if shift == 0:
    return x_BT_
  pad = [(0, 0)] * x_BT_.ndim
  pad[1] = (shift, 0)
  return jnp.pad(x_BT_, pad)[:, : x_BT_.shape[1]]
