"""gmm / tgmm / swiglu_experts_gmm (Pallas, Triton lowering) against the jnp reference.

`TestGmmCompiled` runs the compiled Triton kernels (skipped without a GPU); `TestGmmInterpret`
runs the same cases in the Pallas interpreter on CPU (tests/kernels/base.py). Tolerances (elementwise
`|got - want| <= atol + rtol * |want|`): float32 1e-5 / 1e-5, bfloat16 1e-2 / 1e-2 (inputs
scaled so values and gradients are O(1)..O(10)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import GPU_PLATFORMS, triton_calls
from pallas_kernels.gmm import GmmBlockSizes, gmm, swiglu_experts_gmm, tgmm
from pallas_kernels.gmm.reference import gmm_reference, tgmm_reference
from tests.helpers import assert_close
from tests.kernels.base import CompiledTest, InterpretTest, KernelParityTest
from zaya_jax.ops.grouped_matmul import swiglu_experts

TOLERANCES = {jnp.dtype(jnp.float32): dict(atol=1e-5, rtol=1e-5),
              jnp.dtype(jnp.bfloat16): dict(atol=1e-2, rtol=1e-2)}
HIGHEST = jax.lax.Precision.HIGHEST
SMALL = GmmBlockSizes(block_m=16, block_k=16, block_n=16)

# (id, m, k, n, group_sizes, block, dtype). The float32 cases share one shape (m, k, n not
# multiples of the 16-row blocks, so every kernel masks) and differ only in the traced group
# sizes, so they reuse one compilation; bfloat16 runs on the production block sizes.
CASES = [
    ("one_group", 50, 40, 24, [0, 50, 0, 0], SMALL, jnp.float32),
    ("empty_group_tile_spans_groups_rows_past_end", 50, 40, 24, [10, 0, 17, 13], SMALL,
     jnp.float32),
    ("groups_smaller_than_tile", 50, 40, 24, [3, 5, 2, 7], SMALL, jnp.float32),
    ("all_rows_skipped", 50, 40, 24, [0, 0, 0, 0], SMALL, jnp.float32),
    ("default_blocks_bf16", 100, 72, 40, [30, 0, 45, 20], GmmBlockSizes(), jnp.bfloat16),
]


def make_inputs(m, k, n, group_sizes, dtype, seed=0):
  """`lhs [m, k]`, `rhs [E, k, n]` (scaled by 1/sqrt(k)), cotangent `[m, n]`, group sizes."""
  keys = jax.random.split(jax.random.key(seed), 3)
  num_groups = len(group_sizes)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (num_groups, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  ct = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
  return lhs, rhs, ct, jnp.asarray(group_sizes, jnp.int32)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def kernel_value_and_grads(lhs, rhs, gs, ct, *, block, interpret):
  """`gmm` and its `(dlhs, drhs)` for cotangent `ct`, through `jax.grad` of a weighted sum."""
  def loss(lhs, rhs):
    out = gmm(lhs, rhs, gs, block=block, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

  (_, out), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(lhs, rhs)
  return out, grads


@jax.jit
def reference_vjp(lhs, rhs, gs, ct):
  """`gmm_reference` and its `(dlhs, drhs)` for cotangent `ct`, through `jax.vjp`."""
  out, vjp = jax.vjp(lambda a, b: gmm_reference(a, b, gs), lhs, rhs)
  return out, vjp(ct)


class _GmmTests(KernelParityTest):
  @pytest.mark.slow
  @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
  def test_gmm_values_and_grads(self, case):
    _, m, k, n, group_sizes, block, dtype = case
    lhs, rhs, ct, gs = make_inputs(m, k, n, group_sizes, dtype)
    tol = TOLERANCES[jnp.dtype(dtype)]
    out, (dlhs, drhs) = kernel_value_and_grads(lhs, rhs, gs, ct, block=block,
                                               interpret=self.interpret)
    want, (want_dlhs, want_drhs) = reference_vjp(lhs, rhs, gs, ct)
    assert out.dtype == dlhs.dtype == drhs.dtype == jnp.dtype(dtype)
    assert_close("gmm", out, want, **tol)
    assert_close("dlhs", dlhs, want_dlhs, **tol)
    assert_close("drhs", drhs, want_drhs, **tol)
    if dtype == jnp.float32:  # the production path computes the same op
      assert_close("ragged_dot", out, jax.lax.ragged_dot(lhs, rhs, gs, precision=HIGHEST), **tol)

  def test_tgmm(self):
    lhs, _, ct, gs = make_inputs(50, 40, 24, [10, 0, 17, 13, 0], jnp.float32, seed=1)
    got = tgmm(lhs, ct, gs, block=SMALL, interpret=self.interpret)
    assert got.shape == (5, 40, 24)
    assert_close("tgmm", got, tgmm_reference(lhs, ct, gs), **TOLERANCES[jnp.dtype(jnp.float32)])
    assert not np.asarray(got[1]).any() and not np.asarray(got[4]).any()  # empty groups

  @pytest.mark.slow
  def test_swiglu_experts_gmm_matches_model(self):
    m, d, f, group_sizes = 40, 32, 48, [12, 0, 9, 11]  # 8 rows skipped
    keys = jax.random.split(jax.random.key(2), 4)
    e = len(group_sizes)
    x = jax.random.normal(keys[0], (m, d), jnp.float32)
    w_gate = jax.random.normal(keys[1], (e, d, f), jnp.float32) / np.sqrt(d)
    w_up = jax.random.normal(keys[2], (e, d, f), jnp.float32) / np.sqrt(d)
    w_down = jax.random.normal(keys[3], (e, f, d), jnp.float32) / np.sqrt(f)
    gs = jnp.asarray(group_sizes, jnp.int32)
    ct = jax.random.normal(jax.random.key(3), (m, d), jnp.float32)

    def value_and_grads(fn):
      loss = lambda *a: (jnp.sum(fn(*a) * ct), fn(*a))
      return jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
          x, w_gate, w_up, w_down)

    ours = lambda *a: swiglu_experts_gmm(*a, gs, block=SMALL, interpret=self.interpret)
    model = lambda *a: swiglu_experts(*a, gs, "ragged_dot")
    (_, got_out), got = value_and_grads(ours)
    with jax.default_matmul_precision("highest"):  # no TF32 in the XLA path on a GPU
      (_, want_out), want = value_and_grads(model)
    assert_close("swiglu", got_out, want_out, atol=1e-5, rtol=1e-5)
    for name, g, w in zip(("dx", "dw_gate", "dw_up", "dw_down"), got, want):
      assert_close(name, g, w, atol=1e-5, rtol=1e-4)


class TestGmmCompiled(CompiledTest, _GmmTests):
  pass


class TestGmmInterpret(InterpretTest, _GmmTests):
  pass


@pytest.mark.parametrize("args, match", [
    (((4, 8, 16), (2, 16, 8), (2,), "int32"), r"lhs.shape=\(4, 8, 16\)"),
    (((4, 16), (16, 8), (2,), "int32"), r"rhs.shape=\(16, 8\)"),
    (((4, 16), (2, 12, 8), (2,), "int32"), r"k mismatch"),
    (((4, 16), (2, 16, 8), (3,), "int32"), r"group_sizes.shape=\(3,\)"),
    (((4, 16), (2, 16, 8), (2,), "float32"), r"group_sizes.dtype=float32"),
])
def test_gmm_validation(args, match):
  lhs_shape, rhs_shape, gs_shape, gs_dtype = args
  lhs = jax.ShapeDtypeStruct(lhs_shape, jnp.float32)
  rhs = jax.ShapeDtypeStruct(rhs_shape, jnp.float32)
  gs = jax.ShapeDtypeStruct(gs_shape, jnp.dtype(gs_dtype))
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda a, b, g: gmm(a, b, g, interpret=True), lhs, rhs, gs)


def test_validation_dtypes_and_blocks():
  lhs, ct = jnp.zeros((8, 16)), jnp.zeros((7, 16))
  rhs, gs = jnp.zeros((2, 16, 16)), jnp.zeros((2,), jnp.int32)
  with pytest.raises(ValueError, match=r"rhs.dtype=bfloat16"):
    gmm(lhs, rhs.astype(jnp.bfloat16), gs)
  with pytest.raises(ValueError, match=r"block_k=24"):
    gmm(lhs, rhs, gs, block=GmmBlockSizes(block_k=24))
  with pytest.raises(ValueError, match=r"block_m=8"):
    gmm(lhs, rhs, gs, block=GmmBlockSizes(block_m=8))
  with pytest.raises(ValueError, match=r"grad.shape=\(7, 16\)"):
    tgmm(lhs, ct, gs)


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_lowers_to_triton(platform):
  """gmm lowers to one Triton call; its gradient adds two more (dlhs gmm, drhs tgmm)."""
  args = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((4, 128, 96), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32))
  fwd = lambda a, b, g: gmm(a, b, g, interpret=False)
  loss = lambda a, b, g: fwd(a, b, g).astype(jnp.float32).sum()
  assert triton_calls(fwd, args, platform) >= 1
  assert triton_calls(jax.grad(loss, (0, 1)), args, platform) >= 2
