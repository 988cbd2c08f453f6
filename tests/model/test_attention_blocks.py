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
