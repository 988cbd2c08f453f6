"""Our dropless MoE (sort -> ragged_dot -> unsort) against a readable loop-over-experts reference.

Values *and* gradients (w.r.t. the input and every router/expert parameter) for random
routing, all tokens to one expert, an expert without tokens, every token skipped, and a
single token; both skip modes. Also: balancing biases are state (no gradient, not
`nnx.Param`), and the full model's `expert_counts` ignore padding tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import assert_close, module_with, random_model
from zaya_jax.model import BalancingBias, ModelConfig
from zaya_jax.model.moe import MoE

E, D, F, R = 4, 16, 8, 8  # experts, hidden, expert width, router width
CFG = ModelConfig(vocab_size=64, hidden_size=D, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8,
                  num_experts=E, moe_intermediate_size=F, router_hidden_size=R, layer_types=("hybrid",) * 2)
SKIP_MODES = ("zero", "scaled_identity")
ATOL = RTOL = 1e-5


# --- the reference -----------------------------------------------------------------------------

def reference_router(p: dict, x_MD, r_prev_MR):
  """Router MLP in plain jnp: returns (probs [M, E+1], r [M, R])."""
  r = x_MD @ p["down_proj"] + p["down_bias"] + r_prev_MR * p["router_states_scale"]
  z = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + CFG.rms_norm_eps) * p["norm"]["weight"]
  z = jax.nn.gelu(z @ p["fc1"] + p["fc1_bias"], approximate=False)
  z = jax.nn.gelu(z @ p["fc2"] + p["fc2_bias"], approximate=False)
  return jax.nn.softmax(z @ p["out_proj"], axis=-1), r


def reference_classes(p: dict, x_MD, r_prev_MR, biases_X) -> np.ndarray:
  """Top-1 class per token (E = skip) from the biased probabilities, as concrete numpy."""
  probs, _ = reference_router(p, x_MD, r_prev_MR)
  return np.argmax(np.asarray(probs) + biases_X, axis=-1)


def reference_moe(p: dict, x_MD, r_prev_MR, class_M, skip_mode: str):
  """Loop over experts: each expert's rows get `swiglu_e(x) * gate`; skip rows 0 or `gate * x`.

  (Rows are selected with `where` rather than gathered, so every case has the same shapes.)
  """
  probs, r = reference_router(p["router"], x_MD, r_prev_MR)
  gate_M1 = jnp.take_along_axis(probs, class_M[:, None], axis=-1)
  w = p["experts"]
  y = jnp.zeros_like(x_MD)
  for e in range(E):
    rows_M1 = (class_M == e)[:, None]
    swiglu_e = (jax.nn.silu(x_MD @ w["w_gate"][e]) * (x_MD @ w["w_up"][e])) @ w["w_down"][e]
    y = jnp.where(rows_M1, swiglu_e * gate_M1, y)
  if skip_mode == "scaled_identity":
    y = jnp.where((class_M == E)[:, None], x_MD * gate_M1, y)
  return y, r


def reference_values_and_grads(params, x_MD, r_prev_MR, class_M, cy_MD, cr_MR, skip_mode):
  """((y, r), (dL/dparams, dL/dx)) of the reference, L = sum(y * cy) + sum(r * cr)."""

  def loss(params, x_MD):
    y, r = reference_moe(params, x_MD, r_prev_MR, class_M, skip_mode)
    return jnp.sum(y * cy_MD) + jnp.sum(r * cr_MR), (y, r)

  (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_MD)
  return outputs, grads


def our_values_and_grads(params, biases_X, x_MD, r_prev_MR, cy_MD, cr_MR, skip_mode):
  """((y, r, counts), (dL/dparams, dL/dx)) of our `MoE`, the same loss as the reference."""
  m = x_MD.shape[0]
  segment_ids = jnp.ones((1, m), jnp.int32)

  def loss(params, x_MD):
    state = {"router": {**params["router"], "balancing_biases": biases_X}, "experts": params["experts"]}
    moe = module_with(lambda: MoE(CFG.replace(skip_mode=skip_mode)), state)
    y, r, counts = moe(x_MD[None], r_prev_MR[None], segment_ids)[:3]
    y, r = y.reshape(m, D), r.reshape(m, R)
    return jnp.sum(y * cy_MD) + jnp.sum(r * cr_MR), (y, r, counts)

  (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x_MD)
  return outputs, grads


# --- fixtures ------------------------------------------------------------------------------------

def random_params(seed: int) -> dict:
  """Pure dict of MoE parameters at realistic scales, with token-dependent router logits."""
  g = np.random.default_rng(seed)
  n = lambda *shape, std=1.0, mean=0.0: (mean + std * g.standard_normal(shape)).astype(np.float32)
  return {
      "router": {
          "down_proj": n(D, R, std=D ** -0.5), "down_bias": n(R, std=0.1),
          "router_states_scale": n(R, mean=0.7, std=0.3), "norm": {"weight": n(R, mean=1.0, std=0.2)},
          "fc1": n(R, R, std=R ** -0.5), "fc1_bias": n(R, std=0.1),
          "fc2": n(R, R, std=R ** -0.5), "fc2_bias": n(R, std=0.1),
          "out_proj": n(R, E + 1, std=1.5),
          "balancing_biases": np.zeros(E + 1, np.float32),
      },
      "experts": {"w_gate": n(E, D, F, std=D ** -0.5), "w_up": n(E, D, F, std=D ** -0.5),
                  "w_down": n(E, F, D, std=F ** -0.5)},
  }


def routing_case(name: str, seed: int = 0):
  """Returns (params, x [B, T, D], r_prev [B, T, R]) with balancing biases set for the case."""
  g = np.random.default_rng(seed + 100)
  b, t = (1, 1) if name == "single_token" else (2, 12)
  x = g.standard_normal((b, t, D)).astype(np.float32)
  r_prev = g.standard_normal((b, t, R)).astype(np.float32)
  p = random_params(seed)
  probs, _ = reference_router(p["router"], x.reshape(-1, D), r_prev.reshape(-1, R))
  # Minus a per-class quantile: every class wins some tokens (used by the balanced cases).
  bias = -np.quantile(np.asarray(probs), 0.75, axis=0).astype(np.float32)
  if name == "single_token":
    bias = np.zeros(E + 1, np.float32)
  elif name == "one_expert":
    bias = np.zeros(E + 1, np.float32)
    bias[2] = 2.0  # probabilities are <= 1: expert 2 always wins
  elif name == "empty_expert":
    bias[1] = -2.0  # expert 1 never wins
  elif name == "all_skip":
    bias = np.zeros(E + 1, np.float32)
    bias[E] = 2.0
  p["router"]["balancing_biases"] = bias
  return p, x, r_prev


CASES = ("random", "one_expert", "empty_expert", "all_skip", "single_token")


def expected_counts(name: str, counts: np.ndarray, m: int) -> None:
  """The routing pattern each case is meant to exercise actually happened."""
  if name == "random":
    assert (counts > 0).all(), f"every class should win some tokens: {counts}"
  elif name == "one_expert":
    assert counts[2] == m, counts
  elif name == "empty_expert":
    assert counts[1] == 0 and (np.delete(counts, 1) > 0).all(), counts
  elif name == "all_skip":
    assert counts[E] == m, counts
  elif name == "single_token":
    assert counts.sum() == 1, counts


@pytest.mark.slow
@pytest.mark.parametrize("skip_mode", SKIP_MODES)
@pytest.mark.parametrize("name", CASES)
def test_moe_matches_loop_reference(name, skip_mode):
  """Values, counts, and gradients w.r.t. x and every parameter (balancing biases excluded)."""
  p, x_BTD, r_prev_BTR = routing_case(name)
  m = x_BTD.shape[0] * x_BTD.shape[1]
  x_MD, r_prev_MR = jnp.asarray(x_BTD.reshape(m, D)), jnp.asarray(r_prev_BTR.reshape(m, R))
  biases = p["router"].pop("balancing_biases")
  params = jax.tree.map(jnp.asarray, p)
  class_M = reference_classes(params["router"], x_MD, r_prev_MR, biases)
  g = np.random.default_rng(7)
  cy = jnp.asarray(g.standard_normal((m, D)), jnp.float32)  # loss = sum(y * cy) + sum(r * cr)
  cr = jnp.asarray(g.standard_normal((m, R)), jnp.float32)

  (y, r, counts), (g_params, g_x) = our_values_and_grads(params, jnp.asarray(biases), x_MD, r_prev_MR, cy, cr,
                                                          skip_mode=skip_mode)
  (y_want, r_want), (want_params, want_x) = reference_values_and_grads(
      params, x_MD, r_prev_MR, jnp.asarray(class_M), cy, cr, skip_mode=skip_mode)
  label = f"{name}/{skip_mode}"
  assert_close(f"{label} y", y, y_want, ATOL, RTOL)
  assert_close(f"{label} r", r, r_want, ATOL, RTOL)
  want_counts = np.bincount(class_M, minlength=E + 1)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)
  assert counts.dtype == jnp.float32
  expected_counts(name, want_counts, m)

  assert_close(f"{label} dL/dx", g_x, want_x, ATOL, RTOL)
  got_flat = jax.tree_util.tree_flatten_with_path(g_params)[0]
  want_flat = dict(jax.tree_util.tree_flatten_with_path(want_params)[0])
  assert len(got_flat) == len(want_flat) == 12
  for path, got in got_flat:
    assert_close(f"{label} dL/d{jax.tree_util.keystr(path)}", got, want_flat[path], ATOL, RTOL)
  if name == "empty_expert":  # an expert without tokens gets exactly zero gradient
    for k in ("w_gate", "w_up", "w_down"):
      np.testing.assert_array_equal(np.asarray(g_params["experts"][k][1]), 0.0)
  if name == "all_skip" and skip_mode == "zero":  # nothing reaches the experts or the gate
    for k in ("w_gate", "w_up", "w_down"):
      np.testing.assert_array_equal(np.asarray(g_params["experts"][k]), 0.0)
    np.testing.assert_array_equal(np.asarray(g_params["router"]["out_proj"]), 0.0)


def test_balancing_biases_are_state_without_gradient():
  p, x_BTD, r_prev_BTR = routing_case("random")
  moe = module_with(lambda: MoE(CFG), p)
  param_paths = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
      nnx.to_pure_dict(nnx.state(moe, nnx.Param)))[0]}
  all_paths = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(p)[0]}
  assert param_paths == all_paths - {"['router']['balancing_biases']"}
  assert isinstance(moe.router.balancing_biases, BalancingBias)
  assert not isinstance(moe.router.balancing_biases, nnx.Param)
  np.testing.assert_array_equal(
      np.asarray(nnx.to_pure_dict(nnx.state(moe, BalancingBias))["router"]["balancing_biases"]),
      p["router"]["balancing_biases"])
  # Differentiating w.r.t. the whole state, biases included, gives the biases a zero gradient.
  graphdef, state = nnx.split(moe)
  segment_ids = jnp.ones(x_BTD.shape[:2], jnp.int32)

  def loss(state):
    y, r = nnx.merge(graphdef, state)(jnp.asarray(x_BTD), jnp.asarray(r_prev_BTR), segment_ids)[:2]
    return jnp.sum(y ** 2) + jnp.sum(r)

  grads = nnx.to_pure_dict(jax.grad(loss)(state))
  np.testing.assert_array_equal(np.asarray(grads["router"]["balancing_biases"]), 0.0)
  assert np.abs(np.asarray(grads["router"]["out_proj"])).max() > 0  # the router does learn


@pytest.mark.slow
def test_expert_counts_ignore_padding():
  """Per-layer counts cover exactly the non-padding tokens, whatever the padding tokens hold."""
  cfg = CFG.replace(skip_mode="zero")
  model = random_model(cfg, seed=1)
  forward = nnx.jit(lambda m, ids, seg: m(ids, seg, return_aux=True)[1]["expert_counts"])
  t, n_pad = 12, 5
  g = np.random.default_rng(2)
  ids = g.integers(3, cfg.vocab_size, (2, t)).astype(np.int32)
  segment_ids = np.ones((2, t), np.int32)
  segment_ids[1, t - n_pad:] = 0
  padded = ids.copy()
  padded[1, t - n_pad:] = cfg.pad_token_id
  counts = np.asarray(forward(model, padded, segment_ids))
  assert counts.shape == (cfg.num_layers, E + 1) and counts.dtype == np.float32
  np.testing.assert_array_equal(counts.sum(-1), 2 * t - n_pad)
  # Other tokens at the padding positions: the same counts (causal, and padding is not counted).
  np.testing.assert_array_equal(np.asarray(forward(model, ids, segment_ids)), counts)
  # Without padding every token counts.
  np.testing.assert_array_equal(np.asarray(forward(model, ids, np.ones_like(segment_ids))).sum(-1), 2 * t)
  assert ((counts > 0).sum(-1) >= 2).all(), f"routing collapsed to one class in a layer: {counts}"
