"""CCA flash attention (Pallas) vs its jnp reference; Triton lowering.

`TestCcaAttentionInterpret` runs the kernels in the Pallas interpreter on CPU;
`TestCcaAttentionCompiled` runs them compiled (GPU only; tests/kernels/base.py).

Values and dq/dk/dv (gradients of a randomly weighted sum of the outputs) are compared on every
row, padding rows included: the kernel applies the reference's mask exactly (padding queries
attend over earlier padding keys). float32: atol/rtol 1e-5 (values), 2e-5 (gradients);
bfloat16: atol/rtol 2e-2 (values), 5e-2 (gradients), both sides computed in bfloat16 with float32
softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cca_attention import (AttentionBlockSizes, attention_reference,
                                          cca_flash_attention)
from pallas_kernels.common import GPU_PLATFORMS, triton_calls
from tests.helpers import assert_close
from tests.kernels.base import CompiledTest, InterpretTest, KernelParityTest

BLOCK16 = AttentionBlockSizes(block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16)
# Forward and backward tiles that differ, and q tiles != kv tiles.
BLOCK_MIXED = AttentionBlockSizes(block_q=16, block_kv=32, bwd_block_q=32, bwd_block_kv=16)


def _segments(batch: int, seq: int) -> jax.Array:
  """Row 0: documents of 1, 9, 13 and T-27 tokens (as far as T allows), then 4 padding (0)
  tokens; other rows: one document."""
  row0 = np.zeros(seq, np.int32)
  bounds = [0, 1, 10, 23, seq - 4]
  for doc, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
    row0[lo:max(lo, min(hi, seq))] = doc
  rows = [row0] + [np.ones(seq, np.int32)] * (batch - 1)
  return jnp.asarray(np.stack(rows))


def _inputs(batch, seq, heads, kv_heads, head_dim, dtype, seed=0):
  kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (batch, seq, heads, head_dim), jnp.float32)
  return q, k, v, w


CASES = [  # (batch, seq, heads, kv_heads, head_dim, window, block, dtype)
    pytest.param(1, 1, 2, 2, 16, None, BLOCK16, jnp.float32, id="T1-G1"),
    pytest.param(2, 37, 4, 2, 16, 64, BLOCK_MIXED, jnp.float32, id="T37-G2-window64-mixed"),
    pytest.param(2, 40, 4, 1, 32, 5, BLOCK16, jnp.float32, id="T40-G4-window5"),
    pytest.param(2, 37, 4, 2, 32, None, BLOCK16, jnp.bfloat16, id="T37-G2-bf16"),
]


class _CcaAttentionTests(KernelParityTest):

  @pytest.mark.slow
  @pytest.mark.parametrize("batch,seq,heads,kv_heads,head_dim,window,block,dtype", CASES)
  def test_matches_reference(self, batch, seq, heads, kv_heads, head_dim, window, block, dtype):
    q, k, v, w = _inputs(batch, seq, heads, kv_heads, head_dim, dtype)
    seg = _segments(batch, seq)
    scale = head_dim ** -0.5
    tol, gtol = (1e-5, 2e-5) if dtype == jnp.float32 else (2e-2, 5e-2)

    def loss(fn, **kw):
      def f(q, k, v):
        out = fn(q, k, v, seg, scale=scale, window=window, **kw)
        return jnp.sum(w * out.astype(jnp.float32)), out
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = loss(cca_flash_attention, block=block, interpret=self.interpret)
    (_, ref), ref_grads = loss(attention_reference)
    assert out.dtype == dtype and out.shape == q.shape
    f32 = lambda x: np.asarray(x.astype(jnp.float32))
    assert_close("out", f32(out), f32(ref), atol=tol, rtol=tol)
    for name, g, rg in zip("qkv", grads, ref_grads):
      assert np.all(np.isfinite(f32(g))), f"d{name} not finite"
      assert_close(f"d{name}", f32(g), f32(rg), atol=gtol, rtol=gtol)


class TestCcaAttentionCompiled(CompiledTest, _CcaAttentionTests):
  pass


class TestCcaAttentionInterpret(InterpretTest, _CcaAttentionTests):
  pass


def _shapes(b=1, t=8, n=4, kh=2, h=16, dtype=jnp.float32, seg_shape=None):
  s = jax.ShapeDtypeStruct
  return (s((b, t, n, h), dtype), s((b, t, kh, h), dtype), s((b, t, kh, h), dtype),
          s(seg_shape or (b, t), jnp.int32))


@pytest.mark.parametrize("args,kwargs,match", [
    ((jnp.zeros((8, 4, 16)),) + _shapes()[1:], {}, "q must be rank 4"),
    (_shapes(n=3, kh=2), {}, "multiple of kv heads"),
    (_shapes(h=24), {}, "multiple of 16"),
    (_shapes()[:2] + (jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16),) + _shapes()[3:], {},
     "dtypes differ"),
    (_shapes(seg_shape=(1, 9)), {}, "segment_ids shape"),
    (_shapes(), {"window": 0}, "window"),
    (_shapes(), {"block": AttentionBlockSizes(block_q=24)}, "block.block_q"),
])
def test_validation(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda *a: cca_flash_attention(*a, scale=0.25, **kwargs), *args)


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_lowers_to_triton(platform):
  """Forward: one Triton kernel; grad: forward + dq + dk/dv kernels (N=8, K=2, H=128, bf16)."""
  args = _shapes(b=1, t=256, n=8, kh=2, h=128, dtype=jnp.bfloat16)
  fwd = lambda q, k, v, s: cca_flash_attention(q, k, v, s, scale=128 ** -0.5, window=64,
                                               interpret=False)
  grad = jax.grad(lambda q, k, v, s: jnp.sum(fwd(q, k, v, s).astype(jnp.float32)), (0, 1, 2))
  assert triton_calls(fwd, args, platform) >= 1
  assert triton_calls(grad, args, platform) >= 2
