# Shape letters: B T D V L R X (see zaya_jax/__init__.py).
"""ZAYA1: the decoder layer and the causal LM, spec §2 "Forward pass".

How ZAYA1 differs from a vanilla MoE transformer:
- attention is CCA (cca.py): convolved, compressed q/k with residual means, half-delayed
  values, L2 QK-norm with a learned key temperature, partial RoPE, theta per layer type;
- learned residual scaling (scale and bias on both branches) after attention and after the MoE;
- the router is an MLP on a down-projected state that is averaged across depth (EDA);
- top-1 routing over E experts plus a skip class, balanced by biases outside the gradient;
- residual stream in float32; embeddings tied with the LM head; input scaling after embedding.

Layers are stacked (leading axis L) and run with `nnx.scan`, so compile time does not grow
with depth. Matches: HF `ZayaDecoderLayer`, `ZayaModel`, `ZayaForCausalLM`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax import kernels
from zaya_jax.model.attention import attention_mask, document_positions
from zaya_jax.model.cca import CCA
from zaya_jax.model.config import ModelConfig
from zaya_jax.model.layers import RMSNorm, ResidualScale, compute_dtype, normal, ones, param, zeros
from zaya_jax.model.moe import MoE
from zaya_jax.model.rope import rope_cos_sin


class ZayaLayer(nnx.Module):
  """One decoder layer: norm -> CCA -> residual scale -> norm -> router/experts -> residual scale."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.input_layernorm = RMSNorm(d, eps, rngs=rngs)
    self.self_attn = CCA(cfg, rngs=rngs)
    self.post_attention_residual_scale = ResidualScale(d, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, eps, rngs=rngs)
    self.mlp = MoE(cfg, rngs=rngs)
    self.post_mlp_residual_scale = ResidualScale(d, rngs=rngs)

  def __call__(self, x_BTD, r_prev_BTR, segment_ids_BT, cos_BTP, sin_BTP, mask_BTS, sliding=False):
    """`x_BTD` float32 residual, `r_prev_BTR` previous router state ->
    `(x_BTD, r_BTR, (counts_X, dropped))` (routing statistics, see `MoE.__call__`).
    `mask_BTS` is None when attention runs as the Pallas kernel (`sliding` tells it the
    layer type)."""
    a_BTD = self.input_layernorm(x_BTD)
    o_BTD = self.self_attn(a_BTD, segment_ids_BT, cos_BTP, sin_BTP, mask_BTS, sliding)
    x_BTD = self.post_attention_residual_scale(o_BTD, x_BTD)
    b_BTD = self.post_attention_layernorm(x_BTD)
    y_BTD, r_BTR, counts_X, dropped = self.mlp(b_BTD, r_prev_BTR, segment_ids_BT)
    x_BTD = self.post_mlp_residual_scale(y_BTD, x_BTD)
    return x_BTD, r_BTR, (counts_X, dropped)


class ZayaForCausalLM(nnx.Module):
  """ZAYA1 causal language model with tied embeddings.

  `model(input_ids, segment_ids=None, positions=None, return_aux=False)`:
    input_ids    int32 `[B, T]`;
    segment_ids  int32 `[B, T]`, 1, 2, ... per packed document, 0 = padding (default: all 1);
    positions    int32 `[B, T]` RoPE positions (default: position inside each document).
  Returns float32 logits `[B, T, V]`, and with `return_aux=True` also
  `{"expert_counts": float32 [L, X]` (non-padding tokens routed to each class per layer),
  `"dropped_tokens": float32 [L]}` (non-padding tokens dropped by a capacity-limited dispatch).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d = cfg.hidden_size
    self.embed_tokens = param(rngs, normal(cfg.initializer_range), (cfg.vocab_size, d), ("vocab", "embed"))
    self.input_hidden_states_scale = param(rngs, ones, (d,), ("embed",))
    self.input_hidden_states_bias = param(rngs, zeros, (d,), ("embed",))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs):
      return ZayaLayer(cfg, rngs=rngs)

    self.layers = make_layers(rngs)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs)
    if cfg.lm_head_bias:
      self.lm_head_bias = param(rngs, zeros, (cfg.vocab_size,), ("vocab",))

  def __call__(self, input_ids, segment_ids=None, positions=None, *, return_aux=False):
    cfg = self.cfg
    input_ids_BT, segment_ids_BT, positions_BT = input_ids, segment_ids, positions
    input_ids_BT = jnp.asarray(input_ids_BT, jnp.int32)
    if input_ids_BT.ndim != 2:
      raise ValueError(f"input_ids must be int [B, T], got shape {input_ids_BT.shape}")
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones_like(input_ids_BT)
    segment_ids_BT = jnp.asarray(segment_ids_BT, jnp.int32)
    if segment_ids_BT.shape != input_ids_BT.shape:
      raise ValueError(f"segment_ids shape {segment_ids_BT.shape} != input_ids shape {input_ids_BT.shape}")
    if positions_BT is None:
      positions_BT = document_positions(segment_ids_BT)

    # Step 1: embedding and input scaling; the residual stream is float32 from here on.
    h_BTD = self.embed_tokens[...][input_ids_BT]
    x_BTD = ((h_BTD + self.input_hidden_states_bias[...]) * self.input_hidden_states_scale[...]).astype(jnp.float32)

    # Per-layer-type RoPE tables and masks, selected inside the scan by a per-layer flag.
    # The Pallas attention kernel masks from the segment ids: no [B, T, S] masks then.
    kernel_attention = kernels.uses_kernel(cfg, "attention")
    cos_f, sin_f = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta)
    mask_f = None if kernel_attention else attention_mask(segment_ids_BT)
    is_sliding_L = np.array([t == "hybrid_sliding" for t in cfg.layer_types])
    if is_sliding_L.any():
      cos_s, sin_s = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta_sliding)
      mask_s = None if kernel_attention else attention_mask(segment_ids_BT, cfg.sliding_window)
    else:
      cos_s, sin_s, mask_s = cos_f, sin_f, mask_f

    # Step 2: the layers. Layer 0 receives a zero router state, so EDA is a no-op there.
    def layer_step(carry, layer, sliding):
      x, r = carry
      pick = lambda s, f: None if f is None else jnp.where(sliding, s, f)
      x, r, stats = layer(x, r, segment_ids_BT, pick(cos_s, cos_f), pick(sin_s, sin_f),
                          pick(mask_s, mask_f), sliding)
      return (x, r), stats

    if cfg.remat:
      layer_step = nnx.remat(layer_step, prevent_cse=False)
    run_layers = nnx.scan(layer_step, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
                          unroll=1 if cfg.scan_layers else True)
    b, t, _ = x_BTD.shape
    r0_BTR = jnp.zeros((b, t, cfg.router_hidden_size), jnp.float32)
    (x_BTD, _), (counts_LX, dropped_L) = run_layers((x_BTD, r0_BTR), self.layers, jnp.asarray(is_sliding_L))

    # Step 3: final norm and the tied LM head.
    dtype = compute_dtype(cfg.dtype)
    y_BTD = self.norm(x_BTD).astype(dtype)
    logits_BTV = jnp.einsum("BTD,VD->BTV", y_BTD, self.embed_tokens[...].astype(dtype),
                            preferred_element_type=jnp.float32)
    if cfg.lm_head_bias:
      logits_BTV = logits_BTV + self.lm_head_bias[...]
    if return_aux:
      return logits_BTV, {"expert_counts": counts_LX, "dropped_tokens": dropped_L}
    return logits_BTV


def init_rngs(seed: int) -> nnx.Rngs:
  """Parameter-init RNGs from an `rbg` key (XLA RngBitGenerator).

  XLA:CPU compiles threefry draws slowly (~25 s for the tiny config's init, ~5 s with rbg);
  rbg values are deterministic for a given seed and backend.
  """
  return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def create_model(cfg: ModelConfig, seed: int = 0) -> ZayaForCausalLM:
  """A randomly initialised `ZayaForCausalLM`, built inside one compiled program.

  Eager construction compiles every parameter's random draw separately; here the init is one
  program drawing from `init_rngs(seed)`.
  """
  return nnx.jit(lambda: ZayaForCausalLM(cfg, rngs=init_rngs(seed)))()
