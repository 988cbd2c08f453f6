# Shape letters: M X (see zaya_jax/__init__.py); b = token blocks ceil(M / block_m),
# Y = X padded to a power of two >= 16 inside the kernels.
"""Pallas (Triton) kernels for top-1 routing and the stable grouping of tokens by class.

Triton has no global sort, so the permutation is built as a counting sort in two launches:

1. `classify_kernel`, one program per block of `block_m` tokens: softmax, biases, first-index
   argmax and gate in float32, plus the block's class histogram `hist_bY`.
2. A tiny exclusive scan in jnp (`block_bases`): `base_bY[b, c]` = the first sorted position
   of class c's tokens of block b = group_offset[c] + tokens of class c in blocks < b.
3. `rank_kernel`, one program per block: token m of class c goes to base_bY[b, c] + (tokens of
   class c before m in its block), an in-block cumulative sum over the one-hot `[block_m, Y]`.
   That is `inverse_M`; the same program scatters `order_M[inverse_M[m]] = m`.

Ranks keep token order within a class, so the sort is stable, as `jnp.argsort(stable=True)`.
Blocks past M are masked; padded classes get -inf logits and -inf biases, so they are never
chosen and carry probability 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import out_struct


def padded_classes(num_classes: int) -> int:
  """Y: `num_classes` rounded up to a power of two, at least 16 (Triton tile minimum)."""
  return max(16, pl.next_power_of_2(num_classes))


def classify_kernel(logits_ref, biases_ref, class_ref, gate_ref, hist_ref, *,
                    num_tokens: int, num_classes: int, block_m: int, block_x: int):
  """One block of tokens: class, gate and the block's class histogram.

  Refs (whole arrays; this program reads rows [b * block_m, (b + 1) * block_m)):
    logits_ref [M, X] float32, biases_ref [X] float32 -> class_ref [M] int32,
    gate_ref [M] float32, hist_ref [b, Y] int32 (row b written here).
  """
  b = pl.program_id(0)
  start = b * block_m
  row_m = start + jnp.arange(block_m)
  col_y = jnp.arange(block_x)
  valid_m = row_m < num_tokens
  valid_y = col_y < num_classes
  logits = pltriton.load(logits_ref.at[pl.ds(start, block_m), pl.ds(0, block_x)],
                         mask=valid_m[:, None] & valid_y[None, :], other=0.0)
  # Padded classes: -inf logits (probability 0) and -inf biases (never chosen). Padded rows
  # keep finite logits (0) so no NaN appears; they are masked out of every store.
  logits = jnp.where(valid_y[None, :], logits.astype(jnp.float32), -jnp.inf)
  biases = pltriton.load(biases_ref.at[pl.ds(0, block_x)], mask=valid_y, other=-jnp.inf)
  shifted = logits - jnp.max(logits, axis=1, keepdims=True)
  e = jnp.exp(shifted)
  probs = e / jnp.sum(e, axis=1, keepdims=True)
  biased = probs + biases.astype(jnp.float32)[None, :]
  best = jnp.max(biased, axis=1, keepdims=True)
  # First index on ties, as jnp.argmax: the smallest column that reaches the maximum.
  cls_m = jnp.min(jnp.where(biased == best, col_y[None, :], block_x), axis=1).astype(jnp.int32)
  chosen = col_y[None, :] == cls_m[:, None]
  gate_m = jnp.sum(jnp.where(chosen, probs, 0.0), axis=1)  # one non-zero term: exact
  pltriton.store(class_ref.at[pl.ds(start, block_m)], cls_m, mask=valid_m)
  pltriton.store(gate_ref.at[pl.ds(start, block_m)], gate_m, mask=valid_m)
  hist_y = jnp.sum((chosen & valid_m[:, None]).astype(jnp.int32), axis=0)
  pltriton.store(hist_ref.at[pl.ds(b, 1), pl.ds(0, block_x)], hist_y[None, :])


def rank_kernel(class_ref, base_ref, inverse_ref, order_ref, *,
                num_tokens: int, block_m: int, block_x: int):
  """One block of tokens: sorted position of each token, and the scatter into the order.

  Refs: class_ref [M] int32, base_ref [b, Y] int32 -> inverse_ref [M] int32 (rows of this
  block), order_ref [M] int32 (positions this block's tokens land on).
  """
  b = pl.program_id(0)
  start = b * block_m
  row_m = start + jnp.arange(block_m, dtype=jnp.int32)
  col_y = jnp.arange(block_x)
  valid_m = row_m < num_tokens
  # Padded rows read class Y (matches no column), so they take no rank and no place.
  cls_m = pltriton.load(class_ref.at[pl.ds(start, block_m)], mask=valid_m, other=block_x)
  base_y = pltriton.load(base_ref.at[pl.ds(b, 1), pl.ds(0, block_x)])
  onehot = (cls_m[:, None] == col_y[None, :]).astype(jnp.int32)
  before = jnp.cumsum(onehot, axis=0) - onehot  # same-class tokens earlier in the block
  dest_m = jnp.sum(onehot * (before + base_y), axis=1).astype(jnp.int32)
  pltriton.store(inverse_ref.at[pl.ds(start, block_m)], dest_m, mask=valid_m)
  # Padded rows aim past the end at distinct places (never one shared index: interpret mode
  # emulates a masked store as read-modify-write, where a duplicate index could undo a write).
  pltriton.store(order_ref.at[jnp.where(valid_m, dest_m, row_m)], row_m, mask=valid_m)


def block_bases(hist_bY: jax.Array, num_classes: int):
  """Exclusive scan of the per-block histograms (jnp: [b, Y] is tiny).

  Returns:
    base_bY int32 [b, Y]: first sorted position of class c's tokens of block b.
    group_sizes_X int32 [X] and group_offsets_X int32 [X].
  """
  sizes_Y = jnp.sum(hist_bY, axis=0)
  offsets_Y = jnp.cumsum(sizes_Y) - sizes_Y
  base_bY = offsets_Y[None, :] + jnp.cumsum(hist_bY, axis=0) - hist_bY
  return (base_bY.astype(jnp.int32), sizes_Y[:num_classes].astype(jnp.int32),
          offsets_Y[:num_classes].astype(jnp.int32))


def route_forward(logits_MX: jax.Array, balancing_biases_X: jax.Array, *, block_m: int,
                  num_warps: int, num_stages: int, interpret: bool):
  """The two `pallas_call`s and the scan between them (no checks: see `ops.route`).

  Returns (class_M, gate_M, order_M, inverse_M, group_sizes_X, group_offsets_X) as in
  `reference.Routing`.
  """
  m, x = logits_MX.shape
  block_x = padded_classes(x)
  num_blocks = pl.cdiv(m, block_m)
  params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  class_M, gate_M, hist_bY = pl.pallas_call(
      functools.partial(classify_kernel, num_tokens=m, num_classes=x, block_m=block_m,
                        block_x=block_x),
      grid=(num_blocks,),
      out_shape=(out_struct((m,), jnp.int32, logits_MX, balancing_biases_X),
                 out_struct((m,), jnp.float32, logits_MX, balancing_biases_X),
                 out_struct((num_blocks, block_x), jnp.int32, logits_MX, balancing_biases_X)),
      compiler_params=params,
      interpret=interpret,
      name="routing_classify",
  )(logits_MX, balancing_biases_X)
  base_bY, group_sizes_X, group_offsets_X = block_bases(hist_bY, x)
  inverse_M, order_M = pl.pallas_call(
      functools.partial(rank_kernel, num_tokens=m, block_m=block_m, block_x=block_x),
      grid=(num_blocks,),
      out_shape=(out_struct((m,), jnp.int32, logits_MX, balancing_biases_X),
                 out_struct((m,), jnp.int32, logits_MX, balancing_biases_X)),
      compiler_params=params,
      interpret=interpret,
      name="routing_rank",
  )(class_M, base_bY)
  return class_M, gate_M, order_M, inverse_M, group_sizes_X, group_offsets_X
