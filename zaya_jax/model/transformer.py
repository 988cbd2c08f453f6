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

from zaya_jax.config.model import ModelConfig
from zaya_jax.model.attention import document_positions
from zaya_jax.model.cca import CCA
from zaya_jax.model.layers import RMSNorm, ResidualScale, compute_dtype, normal, ones, param, zeros
from zaya_jax.model.moe import MoE
from zaya_jax.model.rope import rope_cos_sin
from zaya_jax.ops.attention import attention_mask
from zaya_jax.parallel.context import context_size, from_context_order, in_context_order


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

  def __call__(self, x_BTD, r_prev_BTR, segment_ids_BT, cos_BTP, sin_BTP, mask_BTS, sliding=False,
               batch_balance=None):
    """`x_BTD` float32 residual, `r_prev_BTR` previous router state ->
    `(x_BTD, r_BTR, (counts_X, dropped, router_stats))` (routing statistics, see
    `MoEOutput.stats`; `batch_balance` as in `MoE.__call__`).
    `mask_BTS` is None with `attention_impl="pallas"` (`sliding` tells it the layer type)."""
    a_BTD = self.input_layernorm(x_BTD)
    o_BTD = self.self_attn(a_BTD, segment_ids_BT, cos_BTP, sin_BTP, mask_BTS, sliding)
    x_BTD = self.post_attention_residual_scale(o_BTD, x_BTD)
    b_BTD = self.post_attention_layernorm(x_BTD)
    moe = self.mlp(b_BTD, r_prev_BTR, segment_ids_BT, router_stats=True,
                   batch_balance=batch_balance)
    x_BTD = self.post_mlp_residual_scale(moe.y_BTD, x_BTD)
    return x_BTD, moe.r_BTR, (moe.counts_X, moe.dropped, moe.stats)

  def extend(self, x_BTD, r_prev_BTR, cache, start, cos_BTP, sin_BTP, sliding=False):
    """`__call__` for T new tokens continuing the `start` cached ones (one document per row):
    `(x_BTD, r_BTR, new_cache)`. See `CCA.extend` for `cache`; the MoE is per token."""
    a_BTD = self.input_layernorm(x_BTD)
    o_BTD, cache = self.self_attn.extend(a_BTD, cache, start, cos_BTP, sin_BTP, sliding)
    x_BTD = self.post_attention_residual_scale(o_BTD, x_BTD)
    b_BTD = self.post_attention_layernorm(x_BTD)
    seg_BT = jnp.ones(x_BTD.shape[:2], jnp.int32)
    moe = self.mlp(b_BTD, r_prev_BTR, seg_BT)
    x_BTD = self.post_mlp_residual_scale(moe.y_BTD, x_BTD)
    return x_BTD, moe.r_BTR, cache


class ZayaForCausalLM(nnx.Module):
  """ZAYA1 causal language model with tied embeddings.

  `model(input_ids, segment_ids=None, positions=None, return_aux=False)`:
    input_ids    int32 `[B, T]`;
    segment_ids  int32 `[B, T]`, 1, 2, ... per packed document, 0 = padding (default: all 1);
    positions    int32 `[B, T]` RoPE positions (default: position inside each document).
  Returns float32 logits `[B, T, V]`, and with `return_aux=True` also
  `{"expert_counts": float32 [L, X]` (non-padding tokens routed to each class per layer),
  `"dropped_tokens": float32 [L]` (non-padding tokens dropped by a capacity-limited dispatch),
  and means over non-padding tokens `"router_entropy": float32 [L]` (-sum_x p log p, nats),
  `"router_mean_probs": float32 [L, X]` (router softmax), `"router_z2": float32 [L]`
  (logsumexp(router logits)^2)}; the router ones are differentiable (auxiliary losses);
  and `"router_probs": float32 [L, B*T, X]`, every token's router softmax, and
  `"router_inputs": [L, B*T, D]` in the compute dtype, every token's router input (the
  post-attention-normed hidden state; both without gradient, for quantile balancing and
  `router_probs`, dropped by XLA when unused).
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
    x_BTD, aux = self.backbone(input_ids, segment_ids, positions)
    # Under context parallelism the activations are in zigzag order (see `backbone`).
    logits_BTV = from_context_order(self.lm_head(x_BTD), context_size())
    return (logits_BTV, aux) if return_aux else logits_BTV

  # Step 1: embedding and input scaling; the residual stream is float32 from here on.
  def embed(self, input_ids_BT: jax.Array) -> jax.Array:
    """int32 `[B, T]` token ids -> the float32 residual `[B, T, D]` entering layer 0."""
    h_BTD = self.embed_tokens[...][input_ids_BT]
    return ((h_BTD + self.input_hidden_states_bias[...]) * self.input_hidden_states_scale[...]).astype(jnp.float32)

  # Step 2: the layers. Layer 0 receives a zero router state, so EDA is a no-op there.
  def scan_layers(self, layer_step, x_BTD: jax.Array, *per_layer, remat: bool = False):
    """Runs `layer_step((x, r), layer, sliding, *slices) -> ((x, r), y)` over the L stacked
    layers with `nnx.scan` (unrolled without `cfg.scan_layers`), from the residual `x_BTD` and
    a zero float32 router state `[B, T, R]`; `sliding` is the layer's bool [] type flag and
    `slices` the layer's slices of `per_layer` (leading axis L). `remat`: rematerialise each
    layer in the backward pass. Returns `(x_BTD after the last layer, ys stacked over L)`."""
    cfg = self.cfg
    if remat:
      layer_step = nnx.remat(layer_step, prevent_cse=False)
    run_layers = nnx.scan(layer_step, in_axes=(nnx.Carry, 0, 0) + (0,) * len(per_layer),
                          out_axes=(nnx.Carry, 0), unroll=1 if cfg.scan_layers else True)
    b, t, _ = x_BTD.shape
    r0_BTR = jnp.zeros((b, t, cfg.router_hidden_size), jnp.float32)
    is_sliding_L = jnp.asarray(np.array([lt == "hybrid_sliding" for lt in cfg.layer_types]))
    (x_BTD, _), ys = run_layers((x_BTD, r0_BTR), self.layers, is_sliding_L, *per_layer)
    return x_BTD, ys

  def backbone(self, input_ids, segment_ids=None, positions=None, batch_balance=None):
    """Everything before the LM head: `(x_BTD, aux)`, the float32 residual after the last
    layer (before the final norm) and the aux dict of `__call__(..., return_aux=True)`, plus
    `"routing_biases"` float32 [L, X], the biases each layer routed with: the stored ones,
    or with `batch_balance` (a `zaya_jax.model.quantile.BatchBalance`, for training) those
    solved from this batch's router probabilities.
    The training loss takes it to `head_inputs` and a fused LM head + cross-entropy
    (`zaya_jax.ops.cross_entropy.linear_cross_entropy`), never building the `[B, T, V]` logits.

    Under context parallelism (`mesh.context` = C > 1) the inputs, in natural order, are
    reordered once to the zigzag order of `zaya_jax.parallel.context` (positions computed
    before), and `x_BTD` and `router_probs` come back in that order: per-token targets and
    masks must be put in it with `in_context_order` (sums over tokens do not see it)."""
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
    input_ids_BT, segment_ids_BT, positions_BT = (
        in_context_order(x) for x in (input_ids_BT, segment_ids_BT, positions_BT))

    x_BTD = self.embed(input_ids_BT)

    # Per-layer-type RoPE tables and masks, selected inside the scan by a per-layer flag.
    # The Pallas attention kernel masks from the segment ids, and under context parallelism
    # each sequence shard builds its own `[B, T/C, T]` mask: no global [B, T, S] masks then.
    kernel_attention = cfg.attention_impl == "pallas" or context_size() > 1
    cos_f, sin_f = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta)
    mask_f = None if kernel_attention else attention_mask(segment_ids_BT)
    if cfg.attention_window is not None:
      cos_s, sin_s = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta_sliding)
      mask_s = None if kernel_attention else attention_mask(segment_ids_BT, cfg.sliding_window)
    else:
      cos_s, sin_s, mask_s = cos_f, sin_f, mask_f

    def layer_step(carry, layer, sliding):
      x, r = carry
      pick = lambda s, f: None if f is None else jnp.where(sliding, s, f)
      x, r, stats = layer(x, r, segment_ids_BT, pick(cos_s, cos_f), pick(sin_s, sin_f),
                          pick(mask_s, mask_f), sliding, batch_balance)
      return (x, r), stats

    x_BTD, (counts_LX, dropped_L, router_L) = self.scan_layers(layer_step, x_BTD, remat=cfg.remat)

    return x_BTD, {"expert_counts": counts_LX, "dropped_tokens": dropped_L,
                   "router_entropy": router_L["entropy"],
                   "router_mean_probs": router_L["mean_probs"], "router_z2": router_L["z2"],
                   "router_probs": router_L["probs"], "routing_biases": router_L["biases"],
                   "router_inputs": router_L["inputs"]}

  def router_probs(self, inputs_LMD: jax.Array) -> jax.Array:
    """Every layer's router softmax, float32 [L, M, X], of the router inputs `inputs_LMD`
    [L, M, D] (any float dtype; `backbone`'s aux "router_inputs", M tokens), computed with
    this model's router parameters: the router MLP alone, with EDA chained over the layers
    from a zero state as in `backbone`. With the parameters that produced the inputs it
    equals `backbone`'s "router_probs"; `balance.quantile_reroute` calls it with the
    parameters after the optimizer update (zaya_jax/train/step.py)."""
    def step(r_MR, router, h_MD):
      r_MR, _, probs_MX = router.probabilities(h_MD, r_MR)
      return r_MR, probs_MX
    run = nnx.scan(step, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    r0_MR = jnp.zeros((inputs_LMD.shape[1], self.cfg.router_hidden_size), jnp.float32)
    return run(r0_MR, self.layers.mlp.router, inputs_LMD)[1]

  # Step 3: final norm and the tied LM head.
  def head_inputs(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The LM head's operands: `(y_BTD, w_VD, bias_V)`, the final-normed residual and the tied
    embedding in the compute dtype, and the float32 head bias (None without
    `lm_head_bias`); logits = `y @ w.T + bias` in float32."""
    dtype = compute_dtype(self.cfg.dtype)
    y_BTD = self.norm(x_BTD).astype(dtype)
    bias_V = self.lm_head_bias[...] if self.cfg.lm_head_bias else None
    return y_BTD, self.embed_tokens[...].astype(dtype), bias_V

  def lm_head(self, x_BTD: jax.Array) -> jax.Array:
    """Final RMSNorm and the tied LM head: float32 residual `[B, T, D]` -> float32 logits `[B, T, V]`."""
    y_BTD, w_VD, bias_V = self.head_inputs(x_BTD)
    logits_BTV = jnp.einsum("BTD,VD->BTV", y_BTD, w_VD, preferred_element_type=jnp.float32)
    if bias_V is not None:
      logits_BTV = logits_BTV + bias_V
    return logits_BTV

  # --- Incremental decoding with a cache (zaya_jax/generate.py) --------------------------------
  def forward_with_cache(self, input_ids, cache, *, last_only=False):
    """Logits of T new tokens that continue the tokens held in `cache`, and the updated cache.

    Equal (up to float summation order) to the logits at positions `n .. n+T-1` of `model(all
    tokens)`, n = `cache["length"]`, for one document per row without padding (every row has
    the same length). The router state passes across layers inside this call, so it needs no
    cache. Attention always runs on the XLA path; run without a device mesh.

    Args:
      input_ids: int32 `[B, T]`, the next T tokens of every row.
      cache: from `init_cache(cfg, B, S)` or a previous call; `n + T <= S` is required (beyond
        it the returned logits are NaN).
      last_only: return only the logits of the last new token, `[B, V]` (the LM head runs on
        one position: what a prefill needs).
    Returns:
      `(logits, new_cache)`: float32 `[B, T, V]` (or `[B, V]`), and the cache holding n + T
      tokens.
    """
    cfg = self.cfg
    input_ids_BT = jnp.asarray(input_ids, jnp.int32)
    if input_ids_BT.ndim != 2:
      raise ValueError(f"input_ids must be int [B, T], got shape {input_ids_BT.shape}")
    b, t = input_ids_BT.shape
    if cache["k"].shape[1] != b:
      raise ValueError(f"input_ids has batch {b} but the cache was made for batch "
                       f"{cache['k'].shape[1]}; call init_cache(cfg, batch={b}, max_len=...)")
    start = cache["length"]
    x_BTD = self.embed(input_ids_BT)
    positions_1T = (start + jnp.arange(t, dtype=jnp.int32))[None]
    cos_f, sin_f = rope_cos_sin(positions_1T, cfg.rotary_dim, cfg.rope_theta)
    cos_s, sin_s = rope_cos_sin(positions_1T, cfg.rotary_dim, cfg.rope_theta_sliding)

    def layer_step(carry, layer, sliding, layer_cache):
      x, r = carry
      x, r, layer_cache = layer.extend(x, r, layer_cache, start, jnp.where(sliding, cos_s, cos_f),
                                       jnp.where(sliding, sin_s, sin_f), sliding)
      return (x, r), layer_cache

    layer_caches = {k: v for k, v in cache.items() if k != "length"}
    x_BTD, layer_caches = self.scan_layers(layer_step, x_BTD, layer_caches)

    if last_only:
      x_BTD = x_BTD[:, -1:]
    logits_BTV = self.lm_head(x_BTD)
    overflow = start + t > cache["k"].shape[2]
    logits_BTV = jnp.where(overflow, jnp.nan, logits_BTV)
    new_cache = dict(layer_caches, length=start + t)
    return (logits_BTV[:, 0] if last_only else logits_BTV), new_cache

  def prefill(self, input_ids, cache, *, last_only=True):
    """The prompt `[B, P]` into `cache` (normally empty): `(logits [B, V] of the last prompt
    token, or [B, P, V] with last_only=False; new_cache)`. See `forward_with_cache`."""
    return self.forward_with_cache(input_ids, cache, last_only=last_only)

  def decode_step(self, token_ids, cache):
    """One new token per row, int32 `[B]` -> `(logits [B, V], new_cache)`."""
    token_ids_B1 = jnp.asarray(token_ids, jnp.int32)[:, None]
    return self.forward_with_cache(token_ids_B1, cache, last_only=True)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> dict:
  """An empty decoding cache for `batch` rows of up to `max_len` tokens (prompt + new tokens).

  A dict of arrays stacked over layers (a pytree: jit/scan carry it), compute dtype:
    k, v    `[L, B, S, K, H]` keys (after QK-norm and RoPE) and values, S = max_len (sliding
            layers keep all S too and mask by position);
    conv    `[L, B, W0+W1-2, J, H]` the CCA conv inputs `concat(q0, k0)` of the last
            W0+W1-2 tokens (zeros before the first token, like the convolution's padding);
    v_prev  `[L, B, K/2, H]` the previous token's delayed value projection without its bias
            (zeros before the first token: the delayed value of token 0 is the bias);
    length  int32 [] tokens held (the same for every row).
  Raises:
    ValueError: if `batch` or `max_len` is not a positive integer.
  """
  for name, v in (("batch", batch), ("max_len", max_len)):
    if not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"init_cache: {name}={v!r} must be a positive integer")
  dtype = compute_dtype(cfg.dtype)
  l, k, h, j = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads + cfg.num_kv_heads
  wc = cfg.cca_time0 + cfg.cca_time1 - 2
  return {
      "k": jnp.zeros((l, batch, max_len, k, h), dtype),
      "v": jnp.zeros((l, batch, max_len, k, h), dtype),
      "conv": jnp.zeros((l, batch, wc, j, h), dtype),
      "v_prev": jnp.zeros((l, batch, k // 2, h), dtype),
      "length": jnp.zeros((), jnp.int32),
  }


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
