# Shape letters: B T D N K H J W (see zaya_jax/__init__.py); I = output dim of a grouped-conv head.
"""Compressed Convolutional Attention (CCA), spec §2 "CCA projection" (arXiv 2510.04476).

Differences from standard GQA attention, in order:
- q and k are mixed over time by two causal convolutions (depthwise, then grouped per head)
  and keep a residual path of averaged projections (`m = (q0 + k0_rep) / 2`);
- values are half current-token, half previous-token ("delayed") projections, split by whole
  kv heads;
- q and k are L2-normalised to norm sqrt(H), keys scaled by a learned per-kv-head `temp`;
- partial RoPE on the first `rotary_dim` dims, theta per layer type.

Packed documents: the convolutions and the delayed value never read a token of another
document; inputs before a document's first token count as zero, exactly as the reference
treats positions before the sequence start (see ../shared/DESIGN.md).
Matches: HF `ZayaCCAProjection`, `ZayaQKNorm`, `ZayaAttention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from zaya_jax.config.mesh import BATCH_AXES, CONTEXT
from zaya_jax.config.model import ModelConfig
from zaya_jax.model.attention import shift_right, shifted_same_document
from zaya_jax.model.layers import compute_dtype, normal, param, zeros
from zaya_jax.model.rope import apply_rope
from zaya_jax.ops.attention import attention, dot_product_attention
from zaya_jax.ops.zigzag_attention import zigzag_block_attention
from zaya_jax.parallel.context import (CONTEXT_SCOPE, context_size, gather_sequence,
                                       previous_rows_joint)


class CCA(nnx.Module):
  """One CCA attention block: `[B, T, D]` normalised input -> `[B, T, D]` output (before residual scaling)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    j = n + k
    init = normal(cfg.initializer_range)
    self.cfg = cfg
    self.q_proj = param(rngs, init, (d, n, h), ("embed", "q_heads", "head_dim"))  # BTD,DNH->BTNH
    self.k_proj = param(rngs, init, (d, k, h), ("embed", "kv_heads", "head_dim"))  # BTD,DKH->BTKH
    self.v_proj_current = param(rngs, init, (d, k // 2, h), ("embed", "kv_heads", "head_dim"))
    self.v_proj_delayed = param(rngs, init, (d, k // 2, h), ("embed", "kv_heads", "head_dim"))
    # Depthwise conv over time: one filter of width W0 per channel (channel = (head j, dim h)).
    self.conv_depthwise = param(rngs, init, (cfg.cca_time0, j, h), (None, "conv", "head_dim"))
    self.conv_depthwise_bias = param(rngs, zeros, (j, h), ("conv", "head_dim"))
    # Grouped conv over time: width W1, full H x H mixing inside each of the J heads.
    self.conv_grouped = param(rngs, init, (cfg.cca_time1, j, h, h), (None, "conv", "head_dim", None))
    self.conv_grouped_bias = param(rngs, zeros, (j, h), ("conv", "head_dim"))
    self.temp = param(rngs, zeros, (k,), ("kv_heads",))  # key scale after QK-norm (HF init 0)
    self.o_proj = param(rngs, init, (n, h, d), ("q_heads", "head_dim", "embed"))  # BTNH,NHD->BTD
    if cfg.attention_bias:
      self.q_bias = param(rngs, zeros, (n, h), ("q_heads", "head_dim"))
      self.k_bias = param(rngs, zeros, (k, h), ("kv_heads", "head_dim"))
      self.v_current_bias = param(rngs, zeros, (k // 2, h), ("kv_heads", "head_dim"))
      self.v_delayed_bias = param(rngs, zeros, (k // 2, h), ("kv_heads", "head_dim"))
      self.o_bias = param(rngs, zeros, (d,), ("embed",))

  def _bias(self, name: str, dtype):
    return getattr(self, name)[...].astype(dtype) if self.cfg.attention_bias else 0

  def causal_conv(self, c_BTJH: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Depthwise (width W0) then grouped (width W1) causal convolution of `[B, T, J, H]`.

    Output tap j of the grouped conv reads the depthwise output at `t - (W1-1-j)`, which reads
    inputs at `t - (W1-1-j) - (W0-1-i)`. Each such input is masked to the document of `t`; the
    depthwise bias enters every tap, as in the reference's zero-padded conv.
    """
    w0, w1 = self.cfg.cca_time0, self.cfg.cca_time1
    dtype = c_BTJH.dtype
    w_dw = self.conv_depthwise[...].astype(dtype)  # [W0, J, H]
    w_g = self.conv_grouped[...].astype(dtype)  # [W1, J, H, I]
    shifted = []
    for s in range(w0 + w1 - 1):
      keep = shifted_same_document(segment_ids_BT, s)[:, :, None, None]
      shifted.append(jnp.where(keep, shift_right(c_BTJH, s), 0).astype(dtype))
    out_BTJI = self.conv_grouped_bias[...].astype(dtype)
    for tap_g in range(w1):
      d_BTJH = self.conv_depthwise_bias[...].astype(dtype)
      for tap_d in range(w0):
        d_BTJH = d_BTJH + w_dw[tap_d] * shifted[(w0 - 1 - tap_d) + (w1 - 1 - tap_g)]
      out_BTJI = out_BTJI + jnp.einsum("BTJH,JHI->BTJI", d_BTJH, w_g[tap_g])
    return out_BTJI

  def qkv(self, a_BTD: jax.Array, segment_ids_BT: jax.Array, halo=None):
    """CCA projection: returns q `[B, T, N, H]`, k `[B, T, K, H]`, v `[B, T, K, H]` (before QK-norm).

    `halo`: None for whole sequences; under context parallelism
    `zaya_jax.parallel.context.previous_rows_joint`, which returns, for each array given, the
    n tokens before each row (the rows are then sequence chunks; the conv rows and the
    delayed-value row travel together). The convolutions run over `[the W0 + W1 - 2 q0/k0
    rows before the chunk, the chunk]` and the delayed value reads the row before it; their
    segment ids come along, so a token of another document (or the zeros the first chunk
    receives, segment 0) contributes nothing, exactly as inside one sequence.
    """
    cfg = self.cfg
    dtype = compute_dtype(cfg.dtype)
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t, _ = a_BTD.shape
    # Padding tokens feed zeros forward (HF multiplies by the 2-D padding mask).
    a_BTD = jnp.where((segment_ids_BT != 0)[..., None], a_BTD, 0).astype(dtype)
    q0_BTNH = jnp.einsum("BTD,DNH->BTNH", a_BTD, self.q_proj[...].astype(dtype)) + self._bias("q_bias", dtype)
    k0_BTKH = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.k_proj[...].astype(dtype)) + self._bias("k_bias", dtype)
    # Residual means: m = (q0 + k0 repeated to the query heads) / 2; the key path averages m
    # over each group of G query heads.
    m_BTKGH = (q0_BTNH.reshape(b, t, k, n // k, h) + k0_BTKH[:, :, :, None, :]) * 0.5
    c_BTJH = jnp.concatenate([q0_BTNH, k0_BTKH], axis=2)
    # Values: current-token heads, then previous-token heads (whole kv heads each).
    v_cur = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.v_proj_current[...].astype(dtype))
    v_cur = v_cur + self._bias("v_current_bias", dtype)
    v_del = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.v_proj_delayed[...].astype(dtype))
    v_del_bias = self._bias("v_delayed_bias", dtype)
    v_del = v_del + v_del_bias
    if halo is None:
      conv_BTJH = self.causal_conv(c_BTJH, segment_ids_BT)
      prev_ok = shifted_same_document(segment_ids_BT, 1)
      v_prev = shift_right(v_del, 1)
    else:
      conv_rows, value_rows = cfg.context_halo
      seg_rows = max(conv_rows, value_rows)
      (seg_halo,) = halo([segment_ids_BT], [seg_rows])
      c_halo, v_halo = halo([c_BTJH, v_del], [conv_rows, value_rows])  # one exchange each way
      seg_ext = jnp.concatenate([seg_halo, segment_ids_BT], axis=1)
      c_ext = jnp.concatenate([c_halo, c_BTJH], axis=1)
      conv_BTJH = self.causal_conv(c_ext, seg_ext[:, seg_rows - conv_rows:])[:, conv_rows:]
      prev_ok = shifted_same_document(seg_ext, 1)[:, seg_rows:]
      v_prev = jnp.concatenate([v_halo, v_del], axis=1)[:, value_rows - 1:][:, :t]
    q_BTNH = conv_BTJH[:, :, :n] + m_BTKGH.reshape(b, t, n, h)
    k_BTKH = conv_BTJH[:, :, n:] + jnp.mean(m_BTKGH, axis=3)
    # A document's first token sees the delayed projection of a zero vector (its bias).
    v_del = jnp.where(prev_ok[:, :, None, None], v_prev, jnp.zeros_like(v_del) + v_del_bias)
    v_BTKH = jnp.concatenate([v_cur, v_del], axis=2)
    return q_BTNH, k_BTKH, v_BTKH

  def qk_norm(self, q_BTNH: jax.Array, k_BTKH: jax.Array):
    """`x * sqrt(H) / max(||x||, eps)` (eps = machine epsilon of the compute dtype); keys times `temp`.

    Written as `rsqrt(max(||x||^2, eps^2))`: the same value, but a zero vector (a padding
    token, which the segment-masked convolutions zero) gets a zero gradient. Through
    `jnp.linalg.norm` it would get NaN (d||x||/dx = x / ||x|| = 0/0), poisoning every weight.
    """
    dtype = q_BTNH.dtype
    eps = float(jnp.finfo(dtype).eps)
    scale = self.cfg.head_dim ** 0.5

    def norm(x):
      x32 = x.astype(jnp.float32)
      sumsq = jnp.sum(jnp.square(x32), axis=-1, keepdims=True)
      return x32 * (scale * jax.lax.rsqrt(jnp.maximum(sumsq, eps * eps)))

    k = norm(k_BTKH) * self.temp[...][:, None]
    return norm(q_BTNH).astype(dtype), k.astype(dtype)

  def __call__(self, a_BTD: jax.Array, segment_ids_BT: jax.Array, cos_BTP: jax.Array,
               sin_BTP: jax.Array, mask_BTS: jax.Array | None,
               sliding: jax.Array | bool = False) -> jax.Array:
    """Args: `a_BTD` normed input; `segment_ids_BT` int32 (0 = pad); RoPE tables float32
    `[B, T, rotary_dim]`; `mask_BTS` this layer's bool attention mask (None with
    `attention_impl="pallas"`, which masks from the segment ids, and under context
    parallelism, where each shard builds its own); `sliding` bool []: a sliding-window layer.
    Returns `[B, T, D]` in the compute dtype.

    Under a mesh with `context` > 1 the block runs per sequence shard (`context_parallel`)."""
    if context_size() > 1:
      return self.context_parallel(a_BTD, segment_ids_BT, cos_BTP, sin_BTP, sliding)
    dtype = compute_dtype(self.cfg.dtype)
    q, k, v = self.qkv(a_BTD, segment_ids_BT)
    q, k = self.qk_norm(q, k)
    q, k = apply_rope(q, cos_BTP, sin_BTP), apply_rope(k, cos_BTP, sin_BTP)
    o_BTNH = attention(q, k, v, segment_ids_BT, mask_BTS, scale=self.cfg.head_dim ** -0.5,
                       window=self.cfg.attention_window, sliding=sliding,
                       impl=self.cfg.attention_impl, backward=self.cfg.attention_backward)
    return jnp.einsum("BTNH,NHD->BTD", o_BTNH, self.o_proj[...].astype(dtype)) + self._bias("o_bias", dtype)

  # --- Context parallelism (zaya_jax/parallel/context.py) ------------------------------------
  def context_parallel(self, a_BTD: jax.Array, segment_ids_BT: jax.Array, cos_BTP: jax.Array,
                       sin_BTP: jax.Array, sliding: jax.Array | bool = False) -> jax.Array:
    """`__call__` with T split over the `context` mesh axis in zigzag order: one
    `jax.shard_map` over the mesh, activations `P(BATCH_AXES, CONTEXT)` (the model's sequence
    order is `zaya_jax.parallel.context.to_context_order`), this block's parameters
    replicated into it (an FSDP shard is gathered at the boundary, its gradient
    reduce-scattered back).

    Per shard r (t = T / C tokens: chunks r and 2C - 1 - r of c = T / 2C tokens): the
    projections and convolutions with each chunk's halo (`qkv` on the two chunks as rows,
    `halo=previous_rows_joint`), QK-norm, RoPE (tables of the natural positions), then the two
    query chunks against the keys/values and segment ids all-gathered over `context`,
    masked causally, by document and by the window at natural positions
    (`zigzag_block_attention`: flash-style over the blocks of the causal triangle, the same
    number on every shard).
    Equal to `__call__` on the whole sequence (in natural order) up to float summation order.
    """
    graphdef, state = nnx.split(self)
    seq = lambda ndim: P(BATCH_AXES, CONTEXT, *(None,) * (ndim - 2))
    window = self.cfg.attention_window
    scale = self.cfg.head_dim ** -0.5
    shards = context_size()

    def shard(state, a_BtD, seg_Bt, cos_BtP, sin_BtP, sliding):
      cca = nnx.merge(graphdef, state)
      dtype = compute_dtype(cca.cfg.dtype)
      b, t = seg_Bt.shape
      as_chunks = lambda x: x.reshape(2 * b, t // 2, *x.shape[2:])  # [B, t] -> [2B, c] rows
      as_shard = lambda x: x.reshape(b, t, *x.shape[2:])
      q, k, v = map(as_shard, cca.qkv(as_chunks(a_BtD), as_chunks(seg_Bt), halo=previous_rows_joint))
      q, k = cca.qk_norm(q, k)
      q, k = apply_rope(q, cos_BtP, sin_BtP), apply_rope(k, cos_BtP, sin_BtP)
      k_BTKH, v_BTKH, seg_BT = gather_sequence(k), gather_sequence(v), gather_sequence(seg_Bt)
      o_BtNH = zigzag_block_attention(q, k_BTKH, v_BTKH, seg_Bt, seg_BT,
                                      jax.lax.axis_index(CONTEXT), shards, scale,
                                      window=window, sliding=sliding)
      return (jnp.einsum("BTNH,NHD->BTD", o_BtNH, cca.o_proj[...].astype(dtype))
              + cca._bias("o_bias", dtype))

    # The scope names this block's collectives in the HLO metadata (CONTEXT_SCOPE), so the
    # mesh sweep tells them from the MoE's, which run in a shard_map of their own.
    with jax.named_scope(CONTEXT_SCOPE):
      return jax.shard_map(shard, in_specs=(P(), seq(3), seq(2), seq(3), seq(3), P()),
                           out_specs=seq(3))(state, a_BTD, segment_ids_BT, cos_BTP, sin_BTP,
                                             jnp.asarray(sliding))

  # --- Incremental decoding (zaya_jax/generate.py) --------------------------------------------
  def extend(self, a_BTD: jax.Array, cache: dict, start: jax.Array, cos_BTP: jax.Array,
             sin_BTP: jax.Array, sliding: jax.Array | bool = False):
    """CCA on T new tokens of one document that continue the `start` tokens held in `cache`.

    The same function as `__call__` on the whole sequence (all tokens real, one document),
    evaluated only at positions `start .. start+T-1`: the convolutions read the cached last
    W0+W1-2 conv inputs, the delayed value reads the cached previous delayed projection, and
    attention reads the cached keys/values (causal; on sliding layers `q - kv < window`).
    Attention always runs on the XLA path (`dot_product_attention`), whatever `cfg.attention_impl`.

    Args:
      a_BTD: normed input of the new tokens.
      cache: this layer's cache (see `transformer.init_cache`): `k`, `v` `[B, S, K, H]`
        (S = max length; positions >= start are ignored), `conv` `[B, W0+W1-2, J, H]` (the
        conv inputs `concat(q0, k0)` of the last W0+W1-2 tokens, zeros before the start),
        `v_prev` `[B, K/2, H]` (the previous token's delayed value projection, without bias;
        zeros before the start).
      start: int32 [], tokens already in the cache (the position of the first new token).
      cos_BTP, sin_BTP: RoPE tables of positions `start + arange(T)` (B may be 1).
      sliding: bool [], a `hybrid_sliding` layer.
    Returns:
      `(out_BTD, new_cache)`: the block output in the compute dtype and the cache holding
      `start + T` tokens.
    """
    cfg = self.cfg
    dtype = compute_dtype(cfg.dtype)
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t, _ = a_BTD.shape
    a_BTD = a_BTD.astype(dtype)
    q0_BTNH = jnp.einsum("BTD,DNH->BTNH", a_BTD, self.q_proj[...].astype(dtype)) + self._bias("q_bias", dtype)
    k0_BTKH = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.k_proj[...].astype(dtype)) + self._bias("k_bias", dtype)
    m_BTKGH = (q0_BTNH.reshape(b, t, k, n // k, h) + k0_BTKH[:, :, :, None, :]) * 0.5
    # Conv over [cached inputs, new inputs]; outputs of the cached part are dropped. The
    # cached zeros before the start equal `causal_conv`'s zero padding.
    wc = cache["conv"].shape[1]
    hist_BUJH = jnp.concatenate([cache["conv"].astype(dtype), jnp.concatenate([q0_BTNH, k0_BTKH], axis=2)],
                                axis=1)
    conv_BTJH = self.causal_conv(hist_BUJH, jnp.ones(hist_BUJH.shape[:2], jnp.int32))[:, wc:]
    q_BTNH = conv_BTJH[:, :, :n] + m_BTKGH.reshape(b, t, n, h)
    k_BTKH = conv_BTJH[:, :, n:] + jnp.mean(m_BTKGH, axis=3)
    v_cur = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.v_proj_current[...].astype(dtype))
    v_cur = v_cur + self._bias("v_current_bias", dtype)
    v_del_proj = jnp.einsum("BTD,DKH->BTKH", a_BTD, self.v_proj_delayed[...].astype(dtype))
    v_del_all = jnp.concatenate([cache["v_prev"][:, None].astype(dtype), v_del_proj], axis=1)
    v_del = v_del_all[:, :t] + self._bias("v_delayed_bias", dtype)
    v_BTKH = jnp.concatenate([v_cur, v_del], axis=2)

    q_BTNH, k_BTKH = self.qk_norm(q_BTNH, k_BTKH)
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos_BTP, sin_BTP), apply_rope(k_BTKH, cos_BTP, sin_BTP)
    k_BSKH = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_BTKH.astype(cache["k"].dtype), start, axis=1)
    v_BSKH = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_BTKH.astype(cache["v"].dtype), start, axis=1)
    s = k_BSKH.shape[1]
    q_pos = start + jnp.arange(t, dtype=jnp.int32)[:, None]
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    allowed_TS = kv_pos <= q_pos
    if cfg.sliding_window is not None:
      allowed_TS &= jnp.logical_or(jnp.logical_not(sliding), kv_pos > q_pos - cfg.sliding_window)
    o_BTNH = dot_product_attention(q_BTNH, k_BSKH.astype(dtype), v_BSKH.astype(dtype), allowed_TS[None],
                                   scale=cfg.head_dim ** -0.5)
    out_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, self.o_proj[...].astype(dtype)) + self._bias("o_bias", dtype)
    new_cache = {
        "k": k_BSKH,
        "v": v_BSKH,
        "conv": hist_BUJH[:, hist_BUJH.shape[1] - wc:].astype(cache["conv"].dtype),
        "v_prev": v_del_proj[:, -1].astype(cache["v_prev"].dtype),
    }
    return out_BTD, new_cache
