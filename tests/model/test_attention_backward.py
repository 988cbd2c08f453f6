"""`causal_block_attention_recompute` (its own flash-style backward pass: saves the output and a
log-sum-exp per query, recomputes the probabilities) equals `causal_block_attention`
(autodiff, which keeps every block's probabilities) in values and in the gradients of q, k, v."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import assert_close
from zaya_jax.ops.attention import (attention, attention_mask, causal_block_attention,
                                    causal_block_attention_recompute)

B, T, N, K, H = 2, 24, 4, 2, 16  # GQA: G = 2 query heads per kv head
SCALE = H ** -0.5


def segments():
  """Row 0: two documents (10 + 14 tokens); row 1: one document, then padding (segment id 0)
  from position 19."""
  seg = np.ones((B, T), np.int32)
  seg[0, 10:] = 2
  seg[1, 19:] = 0
  return jnp.asarray(seg)


def inputs(seed, dtype=jnp.float32):
  """Random q `[B, T, N, H]`, k, v `[B, T, K, H]` and an output cotangent, entries ~N(0, 1)."""
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  return tuple(jax.random.normal(key, shape).astype(dtype) for key, shape in
               ((kq, (B, T, N, H)), (kk, (B, T, K, H)), (kv, (B, T, K, H)), (kc, (B, T, N, H))))


def values_and_grads(mask, blocks):
  """A jitted `(q, k, v, cot) -> (got, want, got_grads, want_grads)`: recompute vs autodiff."""

  @jax.jit
  def run(q, k, v, cot):
    want, want_vjp = jax.vjp(lambda *a: causal_block_attention(*a, mask, SCALE, blocks=blocks),
                             q, k, v)
    got, got_vjp = jax.vjp(
        lambda *a: causal_block_attention_recompute(*a, mask, SCALE, blocks=blocks), q, k, v)
    return got, want, got_vjp(cot), want_vjp(cot)

  return run


def check(name, got, want, got_grads, want_grads, atol, rtol):
  """Asserts equal dtypes and `|got - want| <= atol + rtol |want|` for the values and each
  gradient."""
  for part, g, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
    assert g.dtype == w.dtype, (name, part, g.dtype, w.dtype)
    assert_close(f"{name} {part}", g, w, atol=atol, rtol=rtol)


@pytest.mark.parametrize("blocks", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_recompute_equals_autodiff_float32(blocks, window):
  """float32: values and gradients within 2e-5 (entries ~1; the two differ only in float
  summation order: D from O instead of from P and dP, P as exp(x - max - log sum))."""
  q, k, v, cot = inputs(blocks + (window or 0))
  got, want, got_grads, want_grads = values_and_grads(attention_mask(segments(), window),
                                                      blocks)(q, k, v, cot)
  assert got.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in got_grads)
  check(f"blocks={blocks} window={window}", got, want, got_grads, want_grads, 2e-5, 2e-5)


def test_recompute_equals_autodiff_bfloat16():
  """bfloat16 inputs (3 blocks, window 5): outputs and gradients in bfloat16, within the
  bfloat16 tolerance of autodiff's (`TOLERANCES`: the two round P, dP, dS and O at different
  points); against float32 math on the same bfloat16 inputs, the largest error is within
  twice autodiff's plus 1e-2 (seen: 0.012 vs 0.007 for dq, from D = rowsum(dO * O) with O
  rounded to bfloat16)."""
  q32, k32, v32, cot32 = inputs(7)
  mask = attention_mask(segments(), 5)
  run = values_and_grads(mask, 3)
  got, want, got_grads, want_grads = run(*(x.astype(jnp.bfloat16) for x in (q32, k32, v32, cot32)))
  assert got.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in got_grads)
  check("bfloat16", got, want, got_grads, want_grads, 2e-2, 2e-2)
  _, exact, _, exact_grads = run(*(x.astype(jnp.bfloat16).astype(jnp.float32)
                                   for x in (q32, k32, v32, cot32)))
  for g, w, e in zip((got, *got_grads), (want, *want_grads), (exact, *exact_grads)):
    err_got = np.max(np.abs(np.asarray(g, np.float64) - np.asarray(e, np.float64)))
    err_want = np.max(np.abs(np.asarray(w, np.float64) - np.asarray(e, np.float64)))
    assert err_got <= 2 * err_want + 1e-2, (err_got, err_want)


def test_fully_masked_row_matches_autodiff():
  """A query row with nothing allowed (not made by `attention_mask`, where every query sees
  itself) gets the uniform softmax over its block's keys in both (finite), and no gradient
  into q; k and v gradients agree too."""
  q, k, v, cot = inputs(11)
  mask = np.array(attention_mask(segments(), None))  # a writable copy
  mask[1, 20] = False  # a padding query in block [16, 24) of 3
  mask[0, 3] = False  # a query in block [0, 8)
  got, want, got_grads, want_grads = values_and_grads(jnp.asarray(mask), 3)(q, k, v, cot)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got[1, 20], jnp.mean(v[1, :24], axis=0).repeat(N // K, 0),
                             atol=1e-5)
  np.testing.assert_allclose(got[0, 3], jnp.mean(v[0, :8], axis=0).repeat(N // K, 0), atol=1e-5)
  assert not np.asarray(got_grads[0][1, 20]).any() and not np.asarray(got_grads[0][0, 3]).any()
  check("fully masked rows", got, want, got_grads, want_grads, 2e-5, 2e-5)


def test_saves_no_probabilities_and_attention_wiring():
  """The residuals the vjp closes over (the leaves of `jax.vjp`'s function) hold no
  `[B, K, G, Tq, S]` block: only the inputs, the mask, the output and the `[B, K, G, T]`
  log-sum; autodiff's hold each block's probabilities (and broadcast masks).
  `attention(backward=...)` picks the implementation and rejects unknown names."""
  q, k, v, _ = inputs(3)
  mask = attention_mask(segments(), None)

  def shapes(fn):  # traced only (eval_shape): nothing runs
    residuals = jax.eval_shape(
        lambda *a: jax.tree.leaves(jax.vjp(lambda *x: fn(*x, mask, SCALE, blocks=3), *a)[1]),
        q, k, v)
    return [x.shape for x in residuals]

  autodiff_shapes, recompute_shapes = shapes(causal_block_attention), shapes(
      causal_block_attention_recompute)
  assert any(len(s) == 5 and s[-2:] == (8, 8) for s in autodiff_shapes), autodiff_shapes
  assert all(len(s) < 5 for s in recompute_shapes), recompute_shapes
  assert (B, K, N // K, T) in recompute_shapes, recompute_shapes

  seg = segments()
  kw = dict(scale=SCALE, window=None, sliding=False)
  np.testing.assert_array_equal(attention(q, k, v, seg, mask, **kw, backward="recompute"),
                                causal_block_attention_recompute(q, k, v, mask, SCALE))
  with pytest.raises(ValueError, match="backward"):
    attention(q, k, v, seg, mask, **kw, backward="flash")


def test_model_gradients_with_recompute_equal_autodiff():
  """The whole tiny model (every parameter random, sliding and full layers, two documents and
  padding) with `model.attention_backward="recompute"`: the loss and every parameter's
  gradient equal the autodiff backward's."""
  import dataclasses

  from flax import nnx

  from tests.helpers import random_batch, random_model, tiny_model_config
  batch = random_batch(np.random.default_rng(1))

  def loss_and_grads(backward):
    cfg = dataclasses.replace(tiny_model_config(), attention_backward=backward)
    graphdef, params, rest = nnx.split(random_model(cfg, seed=2), nnx.Param, ...)

    def loss(p):
      logits = nnx.merge(graphdef, p, rest, copy=True)(batch["inputs"], batch["segment_ids"],
                                                       batch["positions"])
      logp = jax.nn.log_softmax(logits, axis=-1)
      nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
      return jnp.sum(nll * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])
    return jax.jit(jax.value_and_grad(loss))(params)

  want, want_grads = loss_and_grads("autodiff")
  got, got_grads = loss_and_grads("recompute")
  np.testing.assert_allclose(got, want, rtol=1e-6)
  leaves = jax.tree_util.tree_leaves_with_path(want_grads)
  for (path, w), g in zip(leaves, jax.tree.leaves(got_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  assert any("self_attn" in n or "cca" in n for n in names), names[:8]
