"""`zaya_jax.ops.grouped_matmul`: the tiled and looped implementations equal `jax.lax.ragged_dot` in
values and gradients; the fused SwiGLU experts (`zaya_jax.ops.fused_experts`) equal the
three-matmul SwiGLU over `ragged_dot` in values and in the gradients of x and all three weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.ops import grouped_matmul as ops
from zaya_jax.ops.fused_experts import fused_swiglu_experts

CASES = {
    "random": [5, 0, 9, 3, 7],
    "empty_groups": [0, 12, 0, 0, 12],
    "all_one_group": [0, 0, 24, 0, 0],
    "rows_past_last_group": [3, 4, 0, 2, 1],  # sum 10 < M = 24: the rest (skip rows) give 0
    "no_rows_routed": [0, 0, 0, 0, 0],
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tiled", "looped"])
@pytest.mark.parametrize("tile", [1, 4, 7, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_equals_ragged_dot(case, tile, impl):
  m, d, f = 24, 8, 6
  gs = jnp.asarray(CASES[case], jnp.int32)
  kx, kw, kc = jax.random.split(jax.random.key(hash(case) % 1000), 3)
  x = jax.random.normal(kx, (m, d))
  w = jax.random.normal(kw, (len(CASES[case]), d, f))
  cot = jax.random.normal(kc, (m, f))
  ref, ref_vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, gs), x, w)
  got, got_vjp = jax.vjp(lambda x, w: ops.grouped_matmul(x, w, gs, impl, tile=tile), x, w)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  assert not np.asarray(got[int(gs.sum()):]).any(), "rows past the last group must be zero"
  for g, r in zip(got_vjp(cot), ref_vjp(cot)):
    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-5)


@pytest.mark.slow
def test_single_row_and_unknown_impl():
  x = jnp.ones((1, 3))
  w = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
  gs = jnp.asarray([0, 1], jnp.int32)
  np.testing.assert_allclose(ops.grouped_matmul(x, w, gs, "tiled"), x @ w[1])
  np.testing.assert_allclose(ops.grouped_matmul(x, w, gs, "looped"), x @ w[1])
  with pytest.raises(ValueError, match="impl='dense'"):
    ops.grouped_matmul(x, w, gs, "dense")


def _swiglu_inputs(case, dtype=jnp.float32, d=8, f=6):
  m, e = 24, len(CASES[case])
  ks = jax.random.split(jax.random.key(hash(case) % 1000 + 7), 5)
  x = jax.random.normal(ks[0], (m, d), dtype)
  w = [jax.random.normal(k, s, dtype) / 2 for k, s in zip(ks[1:4], ((e, d, f), (e, d, f), (e, f, d)))]
  return x, w, jax.random.normal(ks[4], (m, d), dtype), jnp.asarray(CASES[case], jnp.int32)


@pytest.mark.parametrize("tile", [1, 7, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_swiglu_equals_three_ragged_dots(case, tile):
  x, w, cot, gs = _swiglu_inputs(case)
  plain = lambda x, *w: ops.swiglu_experts(x, *w, gs, "ragged_dot")
  fused = lambda x, *w: fused_swiglu_experts(x, *w, gs, tile=tile)
  ref, ref_vjp = jax.vjp(plain, x, *w)
  got, got_vjp = jax.jit(fused)(x, *w), jax.vjp(fused, x, *w)[1]
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  assert not np.asarray(got[int(gs.sum()):]).any(), "rows past the last group must be zero"
  for name, g, r in zip(("x", "w_gate", "w_up", "w_down"), got_vjp(cot), ref_vjp(cot)):
    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-5, err_msg=name)


def test_fused_swiglu_bfloat16_matches_looped():
  """In bfloat16 the fused pass keeps the unfused path's dtypes (each product in bf16, weight
  gradients summed in float32), so it lands within bf16 rounding of the `"looped"` path."""
  x, w, cot, gs = _swiglu_inputs("random", jnp.bfloat16, d=32, f=16)
  ref, ref_vjp = jax.vjp(lambda x, *w: ops.swiglu_experts(x, *w, gs, "looped"), x, *w)
  got, got_vjp = jax.vjp(lambda x, *w: ops.swiglu_experts(x, *w, gs, "fused"), x, *w)
  assert got.dtype == jnp.bfloat16
  f32 = lambda a: np.asarray(a, np.float32)
  np.testing.assert_allclose(f32(got), f32(ref), atol=2e-2, rtol=2e-2)
  for name, g, r in zip(("x", "w_gate", "w_up", "w_down"), got_vjp(cot), ref_vjp(cot)):
    assert g.dtype == r.dtype == jnp.bfloat16, name
    scale = np.abs(f32(r)).max()
    np.testing.assert_allclose(f32(g), f32(r), atol=2e-2 * scale, err_msg=name)
