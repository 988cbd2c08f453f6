# Shape letters: B T N K G H (see zaya_jax/__init__.py); t = queries of one context shard
# (2 chunks of c), Q = query blocks of the shard (t / blk), S = key blocks of the sequence
# (T / blk), b = block length, P = (query block, key block) pairs.
"""Causal attention of one context-parallel shard (zigzag order) against the whole sequence's
keys: flash-style, over the causal block triangle, with its own backward pass.

Context parallelism (zaya_jax/parallel/context.py) cuts the T positions into 2C chunks of
c = T / (2C); shard r's queries are chunks r and 2C - 1 - r. Both chunks are cut into blocks
of b <= `block` tokens, the keys likewise; a query block reads the key blocks up to its own
(the causal triangle; with a window, the blocks before it are computed and fully masked).
Every shard visits the same number of (query block, key block) pairs, `(2C - 1) m^2 + m (m + 1)`
with m = c / b (2C + 1 for m = 1), listed per shard in a constant table and walked by one
`lax.scan`: the forward pass keeps each query's running max, sum of exponentials and output
(online softmax), and saves only the output and the log-sum-exp; the backward pass walks the
pairs again, recomputing each block's probabilities, and accumulates dQ, dK and dV. Memory is
`O(b^2)` per block instead of the `[t, T]` (or 2C + 1 `[c, c]`) probabilities autodiff keeps.

Values equal `dot_product_attention` with causal, document and window masks at natural
positions, up to float summation order (tests/model/test_attention_blocks.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.ops.sharding import varying_like

_MIN = float(np.finfo(np.float32).min)


def _block_length(c: int, block: int) -> int:
  """The largest divisor of the chunk length c that is at most `block`."""
  return max(d for d in range(1, min(c, block) + 1) if c % d == 0)


def block_pairs(shards: int, c: int, b: int) -> np.ndarray:
  """int32 `[C, P, 3]`: per shard r, its (query block, key block, first query position)
  triples in scan order, query blocks 0..m-1 of chunk r then m..2m-1 of chunk 2C - 1 - r,
  each with key blocks 0..its own. P is the same for every shard (asserted)."""
  m = c // b
  tables = []
  for r in range(shards):
    rows = []
    for slot, chunk in enumerate((r, 2 * shards - 1 - r)):
      for j in range(m):
        start = chunk * c + j * b
        rows += [(slot * m + j, kb, start) for kb in range(start // b + 1)]
    tables.append(rows)
  assert len({len(rows) for rows in tables}) == 1, [len(rows) for rows in tables]
  return np.asarray(tables, np.int32)


def _block_scores(q_bKGH, k_bKH, q_seg_b, k_seg_b, q_start, k_start, scale, window, sliding):
  """Masked float32 logits `[B, K, G, b(q), b(k)]` of one (query block, key block) pair."""
  b = q_bKGH.shape[1]
  offsets = jnp.arange(b, dtype=jnp.int32)
  q_pos, k_pos = q_start + offsets, k_start + offsets
  allowed = k_pos[None, :] <= q_pos[:, None]
  if window is not None:
    allowed &= jnp.logical_or(jnp.logical_not(sliding), k_pos[None, :] > q_pos[:, None] - window)
  mask = allowed[None] & (q_seg_b[:, :, None] == k_seg_b[:, None, :])
  logits = jnp.einsum("BqKGH,BkKH->BKGqk", q_bKGH, k_bKH,
                      preferred_element_type=jnp.float32) * scale
  return jnp.where(mask[:, None, None], logits, _MIN)


def _blocks(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, b):
  """Inputs cut into blocks: q `[B, Q, b, K, G, H]`, k / v `[B, S, b, K, H]`, segment ids
  `[B, Q, b]` / `[B, S, b]`."""
  bsz, t, n, h = q_BtNH.shape
  s, kh = k_BTKH.shape[1], k_BTKH.shape[2]
  return (q_BtNH.reshape(bsz, t // b, b, kh, n // kh, h), k_BTKH.reshape(bsz, s // b, b, kh, h),
          v_BTKH.reshape(bsz, s // b, b, kh, h), q_seg_Bt.reshape(bsz, t // b, b),
          k_seg_BT.reshape(bsz, s // b, b))


def _take(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)


def _put(x, i, value):
  return jax.lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), i, axis=1)


def _forward(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, shards, scale, window,
             b):
  """`(out [B, t, N, H] in q's dtype, lse [B, Q, K, G, b] float32)`."""
  q, k, v, q_seg, k_seg = _blocks(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, b)
  pairs = jnp.asarray(block_pairs(shards, q_BtNH.shape[1] // 2, b))[shard]
  bsz, nq, _, kh, g, h = q.shape
  init = (jnp.full((bsz, nq, kh, g, b), _MIN, jnp.float32),      # running max
          jnp.zeros((bsz, nq, kh, g, b), jnp.float32),           # sum of exponentials
          jnp.zeros((bsz, nq, b, kh, g, h), jnp.float32))        # unnormalised output
  init = varying_like(init, q, k, v, q_seg, k_seg, pairs, sliding)

  def visit(carry, pair):
    mx, den, acc = carry
    qb, kb, q_start = pair[0], pair[1], pair[2]
    logits = _block_scores(_take(q, qb), _take(k, kb), _take(q_seg, qb), _take(k_seg, kb),
                           q_start, kb * b, scale, window, sliding)
    mx_old = _take(mx, qb)
    mx_new = jnp.maximum(mx_old, jnp.max(logits, axis=-1))
    # Rows with nothing allowed yet carry exp(0) = 1 per masked key; the first allowed key
    # (every query allows itself, in the last block of its row) rescales them by exp(MIN) = 0.
    alpha = jnp.exp(mx_old - mx_new)
    p = jnp.exp(logits - mx_new[..., None])
    den_new = alpha * _take(den, qb) + jnp.sum(p, axis=-1)
    pv = jnp.einsum("BKGqk,BkKH->BqKGH", p.astype(v.dtype), _take(v, kb),
                    preferred_element_type=jnp.float32)
    acc_new = jnp.moveaxis(alpha, -1, 1)[..., None] * _take(acc, qb) + pv
    return (_put(mx, qb, mx_new), _put(den, qb, den_new), _put(acc, qb, acc_new)), None

  (mx, den, acc), _ = jax.lax.scan(visit, init, pairs)
  out = acc / jnp.moveaxis(den, -1, 2)[..., None]
  return out.reshape(q_BtNH.shape).astype(q_BtNH.dtype), mx + jnp.log(den)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _attention(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, shards, scale, window,
               b):
  return _forward(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, shards, scale,
                  window, b)[0]


def _attention_fwd(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, shards, scale,
                   window, b):
  out, lse = _forward(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, shards, scale,
                      window, b)
  return out, (q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, out, lse)


def _attention_bwd(shards, scale, window, b, res, d_out_BtNH):
  q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, shard, sliding, out_BtNH, lse = res
  q, k, v, q_seg, k_seg = _blocks(q_BtNH, k_BTKH, v_BTKH, q_seg_Bt, k_seg_BT, b)
  bsz, nq, _, kh, g, h = q.shape
  d_out = d_out_BtNH.reshape(q.shape).astype(jnp.float32)
  # D = rowsum(dO * O): the softmax's backward term, per query.
  delta = jnp.moveaxis(jnp.sum(d_out * out_BtNH.reshape(q.shape).astype(jnp.float32), -1), 2, -1)
  pairs = jnp.asarray(block_pairs(shards, q_BtNH.shape[1] // 2, b))[shard]
  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(v.shape, jnp.float32))
  init = varying_like(init, q, k, v, q_seg, k_seg, pairs, sliding, d_out, lse)

  def visit(carry, pair):
    dq, dk, dv = carry
    qb, kb, q_start = pair[0], pair[1], pair[2]
    q_b, k_b, v_b, do_b = _take(q, qb), _take(k, kb), _take(v, kb), _take(d_out, qb)
    logits = _block_scores(q_b, k_b, _take(q_seg, qb), _take(k_seg, kb), q_start, kb * b, scale,
                           window, sliding)
    p = jnp.exp(logits - _take(lse, qb)[..., None])             # [B, K, G, b, b]
    dv_b = jnp.einsum("BKGqk,BqKGH->BkKH", p, do_b)
    dp = jnp.einsum("BqKGH,BkKH->BKGqk", do_b, v_b.astype(jnp.float32))
    ds = p * (dp - _take(delta, qb)[..., None]) * scale
    dq_b = jnp.einsum("BKGqk,BkKH->BqKGH", ds, k_b.astype(jnp.float32))
    dk_b = jnp.einsum("BKGqk,BqKGH->BkKH", ds, q_b.astype(jnp.float32))
    return (_put(dq, qb, _take(dq, qb) + dq_b), _put(dk, kb, _take(dk, kb) + dk_b),
            _put(dv, kb, _take(dv, kb) + dv_b)), None

  (dq, dk, dv), _ = jax.lax.scan(visit, init, pairs)
  return (dq.reshape(q_BtNH.shape).astype(q_BtNH.dtype),
          dk.reshape(k_BTKH.shape).astype(k_BTKH.dtype),
          dv.reshape(v_BTKH.shape).astype(v_BTKH.dtype), None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def zigzag_block_attention(q_BtNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                           q_segment_ids_Bt: jax.Array, kv_segment_ids_BT: jax.Array,
                           shard: jax.Array | int, shards: int, scale: float,
                           window: int | None = None, sliding: jax.Array | bool = False,
                           block: int = 512) -> jax.Array:
  """Causal attention of context shard `shard`'s two query chunks against all keys (see the
  module docstring), differentiable in q, k and v.

  Args:
    q_BtNH: this shard's queries (after QK-norm and RoPE) in zigzag order, `[B, 2c, N, H]`:
      chunk r, then chunk 2C - 1 - r (GQA: N % K == 0).
    k_BTKH, v_BTKH: all keys / values in natural order, `[B, T, K, H]`, T = 2C c.
    q_segment_ids_Bt: int32 `[B, 2c]` document ids of the queries (0 = padding; padding
      queries attend to the padding keys before them, as in `dot_product_attention`).
    kv_segment_ids_BT: int32 `[B, T]` document ids of the keys, natural order.
    shard: int32 [] (may be traced: `axis_index`) this shard's index r in [0, C).
    shards: C (static).
    scale: logit scale.
    window: tokens a sliding layer's query sees (`q - kv < window`), or None.
    sliding: bool [] (may be traced): apply `window`.
    block: the longest query / key block (static); blocks are the largest divisor of c
      that is at most this.
  Returns:
    `[B, 2c, N, H]` in q's dtype. Gradients: q, k, v in their dtypes (float32 accumulation).
  Raises:
    ValueError: if the shapes do not make 2 x `shards` chunks of c tokens.
  """
  t, s = q_BtNH.shape[1], k_BTKH.shape[1]
  if t % 2 or s != shards * t:
    raise ValueError(f"zigzag_block_attention: {t} queries and {s} keys do not make "
                     f"2 x {shards} chunks of {t // 2} tokens")
  b = _block_length(t // 2, block)
  return _attention(q_BtNH, k_BTKH, v_BTKH, q_segment_ids_Bt, kv_segment_ids_BT,
                    jnp.asarray(shard, jnp.int32), jnp.asarray(sliding), shards, float(scale),
                    window, b)
