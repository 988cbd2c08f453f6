"""Per-block parity against the imported `transformers` Zaya submodules (float32, atol/rtol 1e-5).

For each config a randomised `ZayaForCausalLM` (tests/model/hf_reference.py) is saved and
reloaded with `load_pretrained`; layer i is sliced out of our stacked parameters into a
single-layer `CCA` / `Router` / `MoE`. Each block gets the exact input the reference block
received inside a full forward pass (captured by hooks), so routing sees realistic, balanced
router states: in every tested layer the skip class and several experts win tokens.
Layer 0 has no EDA; layer 1 has EDA (and is the sliding-window layer of the "sliding" config).
"""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.model import hf_reference
from tests.helpers import assert_close, layer_slice, module_with
from zaya_jax.hf import load_pretrained
from zaya_jax.model.cca import CCA
from zaya_jax.model.moe import MoE
from zaya_jax.model.rope import rope_cos_sin
from zaya_jax.model.router import Router
from zaya_jax.ops.attention import attention_mask

ATOL = RTOL = 1e-5

CONFIGS = {
    # 3 full-attention layers, GQA ratio 2, cca_time0 = cca_time1 = 2.
    "base": dict(),
    # Layer 1 attends through a 5-token window (T = 24), with its own RoPE theta.
    "sliding": dict(layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=5),
    # A wider depthwise conv (3 taps) and biases on q/k/v/o (the delayed value's bias at t = 0).
    "time0_3": dict(cca_time0=3, attention_bias=True),
}
LAYERS = (0, 1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
  """The HF model, our reloaded model, and every layer's captured block inputs for one config."""
  hf, ids = hf_reference.build(seed=3 + len(request.param), **CONFIGS[request.param])
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  ours = load_pretrained(str(path))
  assert ours.cfg.skip_mode == "zero"

  attn_in, mlp_in = {}, {}
  hooks = []
  for i, layer in enumerate(hf.model.layers):
    hooks.append(layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs, i=i: attn_in.__setitem__(i, kwargs["hidden_states"].clone()), with_kwargs=True))
    hooks.append(layer.mlp.register_forward_pre_hook(
        lambda m, args, i=i: mlp_in.__setitem__(i, (args[0].clone(), None if args[1] is None else args[1].clone()))))
  with torch.no_grad():
    hf(ids)
  for h in hooks:
    h.remove()
  return types.SimpleNamespace(name=request.param, hf=hf, ours=ours, ids=ids, attn_in=attn_in, mlp_in=mlp_in)


def _np(t: torch.Tensor) -> np.ndarray:
  return t.detach().numpy()


def _is_sliding(case, i: int) -> bool:
  return case.hf.config.layer_types[i] == "hybrid_sliding"


def _hf_additive_mask(t: int, window: int | None) -> torch.Tensor:
  """`[1, 1, T, T]` float32 additive mask as HF's eager attention consumes it: causal, windowed."""
  q = torch.arange(t)[:, None]
  kv = torch.arange(t)[None, :]
  allowed = kv <= q
  if window is not None:
    allowed &= kv > q - window
  return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]


def _our_cca(case, i: int) -> CCA:
  return module_with(lambda: CCA(case.ours.cfg), layer_slice(case.ours.layers, i)["self_attn"])


def _our_rope_and_mask(case, i: int, b: int, t: int, window: int | None = None):
  cfg = case.ours.cfg
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  theta = cfg.rope_theta_sliding if _is_sliding(case, i) else cfg.rope_theta
  cos, sin = rope_cos_sin(positions, cfg.rotary_dim, theta)
  segment_ids = jnp.ones((b, t), jnp.int32)
  return segment_ids, cos, sin, attention_mask(segment_ids, window)


def _hf_choice(case, i: int, logits: torch.Tensor) -> np.ndarray:
  """The reference's unmasked top-1 class per token (E = skip), asserting no near-ties."""
  biased = torch.softmax(logits.float(), -1) + case.hf.model.layers[i].mlp.gate.balancing_biases
  top2 = torch.topk(biased, 2, dim=-1).values
  margin = (top2[:, 0] - top2[:, 1]).min().item()
  assert margin > 1e-5, f"{case.name} layer {i}: a routing near-tie (margin {margin:.2g}) makes the test ill-posed"
  return _np(torch.argmax(biased, -1))


@pytest.mark.slow
@pytest.mark.parametrize("i", LAYERS)
def test_cca_qkv_projection(case, i):
  """q, k, v after the convolutions, residual means and delayed values, before QK-norm."""
  a = case.attn_in[i]
  with torch.no_grad():
    q_want, k_want, v_want = case.hf.model.layers[i].self_attn.qkv_proj(a, None, None)
  b, t, _ = a.shape
  q, k, v = _our_cca(case, i).qkv(jnp.asarray(_np(a)), jnp.ones((b, t), jnp.int32))
  assert_close(f"{case.name} layer {i} q", q, _np(q_want), ATOL, RTOL)
  assert_close(f"{case.name} layer {i} k", k, _np(k_want), ATOL, RTOL)
  assert_close(f"{case.name} layer {i} v", v, _np(v_want), ATOL, RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("i", LAYERS)
def test_cca_attention_block(case, i):
  """The whole CCA block (projection, QK-norm, partial RoPE, masked GQA attention, o_proj)."""
  hf_attn = case.hf.model.layers[i].self_attn
  a = case.attn_in[i]
  b, t, _ = a.shape
  window = case.hf.config.sliding_window if _is_sliding(case, i) else None
  if window is not None:
    assert window < t, "the sliding window must be shorter than the sequence to be exercised"
  position_ids = torch.arange(t)[None]
  with torch.no_grad():
    pos_emb = case.hf.model.rotary_emb(a, position_ids, case.hf.config.layer_types[i])
    want, _ = hf_attn(a, attention_mask={"causal": _hf_additive_mask(t, window), "conv": None},
                      position_embeddings=pos_emb)
  cca = _our_cca(case, i)
  segment_ids, cos, sin, mask = _our_rope_and_mask(case, i, b, t, window)
  got = cca(jnp.asarray(_np(a)), segment_ids, cos, sin, mask)
  assert got.dtype == jnp.float32
  assert_close(f"{case.name} layer {i} CCA output", got, _np(want), ATOL, RTOL)
  if window is not None:  # the window matters: without it the output is visibly different
    full = cca(jnp.asarray(_np(a)), segment_ids, cos, sin, attention_mask(segment_ids))
    assert np.abs(np.asarray(full) - _np(want)).max() > 1e-3


@pytest.mark.parametrize("i", LAYERS)
def test_router(case, i):
  """Router state after EDA, probabilities, top-1 class (skip included) and gate."""
  gate_mod = case.hf.model.layers[i].mlp.gate
  h, r_prev = case.mlp_in[i]
  assert (r_prev is None) == (i == 0)
  b, t, d = h.shape
  e = case.hf.config.num_experts
  with torch.no_grad():
    logits, probs_k, index_k, r_next = gate_mod(h, r_prev)
  r_prev_np = np.zeros((b * t, gate_mod.router_hidden_size), np.float32) if r_prev is None else _np(r_prev).reshape(b * t, -1)
  router = module_with(lambda: Router(case.ours.cfg), layer_slice(case.ours.layers, i)["mlp"]["router"])
  cls, gate, r, probs = (np.asarray(v) for v in router(jnp.asarray(_np(h).reshape(b * t, d)), jnp.asarray(r_prev_np)))

  name = f"{case.name} layer {i}"
  assert_close(f"{name} router state r", r, _np(r_next).reshape(b * t, -1), ATOL, RTOL)
  assert_close(f"{name} router probs", probs, _np(torch.softmax(logits, -1)), ATOL, RTOL)
  want_cls = _hf_choice(case, i, logits)
  np.testing.assert_array_equal(cls, want_cls, err_msg=f"{name}: chosen classes differ")
  # HF masks a chosen skip class to (index 0, prob 0) before its experts; we keep class E.
  skip = cls == e
  index_k, probs_k = _np(index_k)[:, 0], _np(probs_k)[:, 0]
  np.testing.assert_array_equal(index_k, np.where(skip, 0, cls))
  np.testing.assert_array_equal(probs_k[skip], 0.0)
  assert_close(f"{name} gate (experts)", gate[~skip], probs_k[~skip], ATOL, RTOL)
  assert_close(f"{name} gate (skip) = p_skip", gate[skip], probs[skip, e], ATOL, RTOL)
  # Routing is exercised: the skip class and several experts win tokens.
  assert skip.any(), f"{name}: no token chose the skip class"
  assert len(np.unique(cls[~skip])) >= 3, f"{name}: experts chosen {np.unique(cls)}"


@pytest.mark.slow
@pytest.mark.parametrize("i", LAYERS)
def test_moe_block(case, i):
  """MoE output (skip_mode "zero", as HF), the router state handed on, and per-class counts."""
  h, r_prev = case.mlp_in[i]
  b, t, d = h.shape
  with torch.no_grad():
    want, r_next = case.hf.model.layers[i].mlp(h, r_prev)
    logits = case.hf.model.layers[i].mlp.gate(h, r_prev)[0]
  cfg = case.ours.cfg
  r_prev_np = np.zeros((b, t, cfg.router_hidden_size), np.float32) if r_prev is None else _np(r_prev)
  moe = module_with(lambda: MoE(cfg), layer_slice(case.ours.layers, i)["mlp"])
  assert moe.skip_mode == "zero"
  y, r, counts = moe(jnp.asarray(_np(h)), jnp.asarray(r_prev_np), jnp.ones((b, t), jnp.int32))[:3]
  name = f"{case.name} layer {i}"
  assert_close(f"{name} MoE output", y, _np(want), ATOL, RTOL)
  assert_close(f"{name} MoE router state", r, _np(r_next), ATOL, RTOL)
  want_counts = np.bincount(_hf_choice(case, i, logits), minlength=cfg.num_experts + 1)
  np.testing.assert_array_equal(np.asarray(counts), want_counts)
  assert want_counts[-1] > 0 and (want_counts[:-1] > 0).sum() >= 3, f"{name}: routing not exercised {want_counts}"
  # Skipped tokens contribute exactly zero.
  skipped = (_hf_choice(case, i, logits) == cfg.num_experts).reshape(b, t)
  np.testing.assert_array_equal(np.asarray(y)[skipped], 0.0)
