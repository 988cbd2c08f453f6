# Shape letters: M X D (see zaya_jax/__init__.py).
"""Routing kernel (`pallas_kernels.routing`) vs its jnp reference and the XLA dispatch path.

Every case checks all six `Routing` outputs (integers exactly, the gate to 1e-6) and the
gradient of sum(w * gate) w.r.t. the logits (and the zero gradient of the biases) against
`jax.vjp` of `route_reference`. Cases share (M, X, block) where they can, so one compile
serves several (interpret mode compiles per shape). `TestRoutingInterpret` runs on CPU; the
compiled `TestRoutingCompiled` needs a GPU (tests/kernels/base.py). The lowering checks need no GPU: both forward
kernels lower to Triton custom calls for ROCm and CUDA (the backward is jnp, by design).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import GPU_PLATFORMS, triton_calls
from pallas_kernels.routing import (Routing, RoutingBlockSizes, permute, route, route_reference,
                                    unpermute)
from tests.helpers import assert_close
from tests.kernels.base import CompiledTest, InterpretTest, KernelParityTest
from zaya_jax.parallel.dispatch import sort_by_key, unsort

INT_FIELDS = ("class_M", "order_M", "inverse_M", "group_sizes_X", "group_offsets_X")


def _logits(m, x, seed=0, scale=2.0):
  return scale * jax.random.normal(jax.random.key(seed), (m, x), jnp.float32)


def _biases(x, **set_at):
  b = 0.05 * jax.random.normal(jax.random.key(7), (x,), jnp.float32)
  for idx, v in set_at.items():
    b = b.at[int(idx[1:])].set(v)
  return b


def _ties(m, x):
  # Small integer logits: equal logits give bit-identical probabilities, so many rows tie.
  return jax.random.randint(jax.random.key(3), (m, x), 0, 2).astype(jnp.float32)


# name -> (logits, biases, block_m). M=200 with block 64: 4 blocks, the last one partial.
CASES = {
    "random": (_logits(200, 17), _biases(17), 64),
    "all_to_one_expert": (_logits(200, 17, 1), _biases(17, c3=3.0), 64),
    "expert_with_zero_tokens": (_logits(200, 17, 2), _biases(17, c0=-2.0, c5=-2.0), 64),
    "all_skip": (_logits(200, 17, 4), _biases(17, c16=3.0), 64),
    "ties_first_index": (_ties(200, 17), jnp.zeros((17,), jnp.float32), 64),
    "all_tied": (jnp.zeros((200, 17), jnp.float32), jnp.zeros((17,), jnp.float32), 64),
    "single_token": (_logits(1, 17, 5), _biases(17), 128),
    "x5_non_power_of_two": (_logits(200, 5, 6), _biases(5), 64),
    "x2_one_expert": (_logits(200, 2, 8), _biases(2), 64),
}


@functools.lru_cache(maxsize=None)
def _value_and_grads(interpret: bool | None, block_m: int):
  """Jitted (sum(w * gate), Routing), (d logits, d biases); None = the reference.

  Cached per configuration so cases of the same shape reuse one compile.
  """
  def loss(l, b, w):
    if interpret is None:
      r = route_reference(l, b)
    else:
      r = route(l, b, block=RoutingBlockSizes(block_m=block_m), interpret=interpret)
    return jnp.sum(w * r.gate_M), r
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _assert_routing_equal(got: Routing, want: Routing):
  for name in INT_FIELDS:
    g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
    assert g.dtype == np.int32, (name, g.dtype)
    np.testing.assert_array_equal(g, w, err_msg=name)
  assert got.gate_M.dtype == jnp.float32
  assert_close("gate_M", got.gate_M, want.gate_M, atol=1e-6, rtol=0)


class _RoutingTests(KernelParityTest):

  def route(self, logits, biases, block_m=128):
    w = jnp.ones(logits.shape[:1], jnp.float32)
    return _value_and_grads(self.interpret, block_m)(logits, biases, w)[0][1]

  @pytest.mark.slow
  @pytest.mark.parametrize("case", list(CASES))
  def test_values_and_gradients_match_reference(self, case):
    logits, biases, block_m = CASES[case]
    w = jax.random.normal(jax.random.key(11), logits.shape[:1], jnp.float32)
    (_, got), (dl_got, db_got) = _value_and_grads(self.interpret, block_m)(logits, biases, w)
    (_, want), (dl_want, db_want) = _value_and_grads(None, 0)(logits, biases, w)
    _assert_routing_equal(got, want)
    assert_close("d logits", dl_got, dl_want, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(db_got, 0.0)
    np.testing.assert_array_equal(db_want, 0.0)
    # The case exercises what its name says.
    sizes = np.asarray(got.group_sizes_X)
    m = logits.shape[0]
    if case == "all_to_one_expert":
      assert sizes[3] == m
    if case == "expert_with_zero_tokens":
      assert sizes[0] == sizes[5] == 0 and (sizes > 0).sum() > 5
    if case == "all_skip":
      assert sizes[-1] == m
    if case == "all_tied":
      assert (np.asarray(got.class_M) == 0).all()
    if case == "ties_first_index":
      assert sizes[0] > m // 2  # class 0 wins every row where its logit is 1

  @pytest.mark.parametrize("case", ["random", "x5_non_power_of_two"])
  def test_matches_xla_dispatch_path(self, case):
    """Same permutation and counts as `LocalDispatch` (argsort stable + bincount)."""
    logits, biases, block_m = CASES[case]
    got = self.route(logits, biases, block_m)
    x = logits.shape[1]
    order_M, counts_X = sort_by_key(got.class_M, x)
    np.testing.assert_array_equal(got.order_M, order_M)
    np.testing.assert_array_equal(got.group_sizes_X, counts_X)
    np.testing.assert_array_equal(got.inverse_M[got.order_M], np.arange(logits.shape[0]))
    x_MD = jax.random.normal(jax.random.key(12), (logits.shape[0], 8), jnp.float32)
    rows_PD = permute(x_MD, got)
    np.testing.assert_array_equal(rows_PD, x_MD[order_M])
    np.testing.assert_array_equal(unpermute(rows_PD, got), unsort(rows_PD, order_M))
    np.testing.assert_array_equal(unpermute(rows_PD, got), x_MD)

  @pytest.mark.slow
  def test_zaya1_shape(self):
    """ZAYA1: 16 experts + skip, several full blocks at the default block size."""
    logits, biases = _logits(256, 17, 13), _biases(17, c16=-1.0)
    _assert_routing_equal(self.route(logits, biases), route_reference(logits, biases))


class TestRoutingCompiled(CompiledTest, _RoutingTests):
  pass


class TestRoutingInterpret(InterpretTest, _RoutingTests):
  pass


@pytest.mark.parametrize("logits_shape, biases_shape, dtype, match", [
    ((8,), (8,), jnp.float32, "rank 2"),
    ((4, 17), (16,), jnp.float32, r"balancing_biases must have shape \[X\]"),
    ((4, 1), (1,), jnp.float32, "X=1"),
    ((0, 17), (17,), jnp.float32, "M=0"),
    ((4, 17), (17,), jnp.int32, "logits must be a floating dtype"),
])
def test_validation_errors(logits_shape, biases_shape, dtype, match):
  with pytest.raises(ValueError, match=match):
    route(jnp.zeros(logits_shape, dtype), jnp.zeros(biases_shape, jnp.float32), interpret=True)


def test_block_size_errors():
  with pytest.raises(ValueError, match="block_m=48"):
    RoutingBlockSizes(block_m=48)
  with pytest.raises(ValueError, match="num_warps=3"):
    RoutingBlockSizes(num_warps=3)


@pytest.mark.parametrize("platform", GPU_PLATFORMS)
def test_lowers_to_triton(platform):
  """M=4096, X=17: both forward kernels lower; under grad the forward keeps >= 1 kernel."""
  args = (jax.ShapeDtypeStruct((4096, 17), jnp.float32), jax.ShapeDtypeStruct((17,), jnp.float32))
  assert triton_calls(lambda l, b: route(l, b, interpret=False), args, platform) == 2
  grad = jax.grad(lambda l, b: route(l, b, interpret=False).gate_M.sum())
  assert triton_calls(grad, args, platform) >= 1
