"""`zaya_jax.ops.grouped_matmul`: the tiled and looped implementations equal `jax.lax.ragged_dot` in
values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.ops import grouped_matmul as ops

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
