"""`causal_block_attention` (the XLA training path: the causal block triangle only) equals
`dot_product_attention` over the full square, in values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.ops.attention import attention_mask, causal_block_attention, dot_product_attention


def segments(t):
  """Row 0: three documents; row 1: one document, then padding (segment id 0)."""
  seg = np.ones((2, t), np.int32)
  seg[0, t // 3:] = 2
  seg[0, 2 * t // 3:] = 3
  seg[1, t - 5:] = 0
  return jnp.asarray(seg)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [1, 3, 8, 23, 64])
@pytest.mark.parametrize("window", [None, 5])
def test_block_attention_equals_full(blocks, window):
  b, t, n, k, h = 2, 23, 4, 2, 8  # T = 23: uneven blocks, a short last one
  kq, kk, kv, kc = jax.random.split(jax.random.key(blocks + (window or 0)), 4)
  q = jax.random.normal(kq, (b, t, n, h))
  key = jax.random.normal(kk, (b, t, k, h))
  val = jax.random.normal(kv, (b, t, k, h))
  cot = jax.random.normal(kc, (b, t, n, h))
  mask = attention_mask(segments(t), window)

  @jax.jit  # one program per case (eagerly, blocks=23 dispatches hundreds of tiny ops)
  def values_and_grads(q, key, val, cot):
    ref, ref_vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, 0.3), q, key, val)
    got, got_vjp = jax.vjp(lambda *a: causal_block_attention(*a, mask, 0.3, blocks=blocks),
                           q, key, val)
    return got, ref, got_vjp(cot), ref_vjp(cot)

  got, ref, got_grads, ref_grads = values_and_grads(q, key, val, cot)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  for g, r in zip(got_grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def test_context_order_round_trip_and_layout():
  """`to_context_order`: block r of t = T / C tokens is chunks r and 2C - 1 - r; any axis."""
  from zaya_jax.parallel.context import from_context_order, to_context_order  # pylint: disable=import-outside-toplevel
  x = np.arange(2 * 24 * 3).reshape(2, 24, 3)
  for c in (1, 2, 3, 4, 6, 12):
    y = np.asarray(to_context_order(jnp.asarray(x), c))
    chunk = 24 // (2 * c)
    for r in range(c):
      want = np.concatenate([x[:, r * chunk:(r + 1) * chunk],
                             x[:, (2 * c - 1 - r) * chunk:(2 * c - r) * chunk]], axis=1)
      np.testing.assert_array_equal(y[:, r * 2 * chunk:(r + 1) * 2 * chunk], want)
    np.testing.assert_array_equal(from_context_order(jnp.asarray(y), c), x)
    np.testing.assert_array_equal(
        to_context_order(jnp.asarray(np.moveaxis(x, 1, 2)), c, axis=2), np.moveaxis(y, 1, 2))


@pytest.mark.parametrize("shards,block", [(1, 512), (2, 512), (4, 512), (2, 2), (4, 2)],
                         ids=["1", "2", "4", "2-blocks_of_2", "4-blocks_of_1"])
@pytest.mark.parametrize("window", [None, 5])
def test_zigzag_block_attention_equals_full(shards, block, window):
  """Each shard's two query chunks against all keys (`zigzag_block_attention`, shard index
  given, no mesh) equal the rows of `dot_product_attention` over the whole sequence, in
  values and in the gradients of q, k and v summed over the shards (what the all-gather's
  reduce-scatter forms; the custom backward pass against autodiff of the reference).
  Documents start on, before and after chunk boundaries; padding. Blocks: whole chunks, and
  chunks of 6 and 3 tokens cut into blocks of 2 and 1 (3 per chunk)."""
  from zaya_jax.ops.zigzag_attention import zigzag_block_attention  # pylint: disable=import-outside-toplevel
  from zaya_jax.parallel.context import from_context_order, to_context_order  # pylint: disable=import-outside-toplevel
  b, t, n, k, h = 2, 24, 4, 2, 8
  kq, kk, kv, kc = jax.random.split(jax.random.key(shards + (window or 0)), 4)
  q = jax.random.normal(kq, (b, t, n, h))
  key = jax.random.normal(kk, (b, t, k, h))
  val = jax.random.normal(kv, (b, t, k, h))
  cot = jax.random.normal(kc, (b, t, n, h))
  seg = segments(t)
  mask = attention_mask(seg, window)
  sliding = window is not None

  @jax.jit
  def values_and_grads(q, key, val, cot):
    def zigzag(q, key, val):
      q_z, seg_z = to_context_order(q, shards), to_context_order(seg, shards)
      per = t // shards
      outs = [zigzag_block_attention(q_z[:, r * per:(r + 1) * per], key, val,
                                     seg_z[:, r * per:(r + 1) * per], seg, jnp.int32(r), shards,
                                     0.3, window=5, sliding=sliding, block=block)
              for r in range(shards)]
      return from_context_order(jnp.concatenate(outs, axis=1), shards)
    ref, ref_vjp = jax.vjp(lambda *a: dot_product_attention(*a, mask, 0.3), q, key, val)
    got, got_vjp = jax.vjp(zigzag, q, key, val)
    return got, ref, got_vjp(cot), ref_vjp(cot)

  got, ref, got_grads, ref_grads = values_and_grads(q, key, val, cot)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  for g, r in zip(got_grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
