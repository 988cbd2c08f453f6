# Shape letters: D V L N K H J R X E F W (see zaya_jax/__init__.py); m, n, k = GEMM dims.
"""Analytic sizing of a ZAYA1 model: its GEMMs, FLOPs per token, parameter counts, sizing rules.

Everything is arithmetic on `ModelConfig` (no arrays are built), so it runs instantly for
ZAYA1-base. The roofline, memory and latency estimates that build on these numbers live in
`zaya_jax.perf.roofline`; `python -m launch.sizing` prints both. In the model layer so the
training loop can count FLOPs per token (MFU) and parameters (its header).

Conventions (each stated where it is used):
- One GEMM `C[m, n] = A[m, k] @ B[k, n]` costs `2 m n k` FLOPs; a training step costs 3x the
  forward (forward, input gradient, weight gradient). Recomputation under remat is *not*
  counted (MFU counts model FLOPs, as in PaLM Appendix B).
- Experts count active experts only: top-1 with uniform routing and no skipped tokens, the
  upper bound (a token routed to the skip class costs no expert FLOPs).
- Attention scores and values count only the keys a query sees: the exact causal mean
  `(T + 1) / 2` keys per query on full layers and the mean of `min(t, window)` on sliding
  layers ("causal halving").
- CCA convolutions count `2 W0 C` (depthwise) and `2 W1 J H^2` (grouped, full mixing inside
  each head of H channels) FLOPs per token, C = J H, J = N + K.
- Parameter counts follow the Hugging Face checkpoint (`ZayaForCausalLM.parameters()`): tied
  LM head, no `router_states_scale` on layer 0, `balancing_biases` excluded (a float32 buffer
  set by the balancing controller, not a trained parameter). This repo's NNX model keeps a
  (unused) `router_states_scale [R]` on layer 0 too: `+R` parameters.
Source: paper arXiv 2511.17127 §2-3; spec ../shared/spec/zaya1_architecture.md.
"""

from __future__ import annotations

import dataclasses
import math

from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.accelerators import AcceleratorProfile

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Gemm:
  """One GEMM `C[m, n] = A[m, k] @ B[k, n]`, run `count` times per forward pass of a step.

  Attributes:
    name: stable id, e.g. "attn.q_proj", "moe.expert_up_gate", "lm_head".
    m: rows (tokens; for expert GEMMs tokens per expert).
    n: output features.
    k: contracted dimension.
    count: runs per forward pass (per layer x layers; expert GEMMs x experts too).
  """

  name: str
  m: int
  n: int
  k: int
  count: int

  @property
  def flops(self) -> int:
    """Forward FLOPs of all `count` runs: `2 m n k count`."""
    return 2 * self.m * self.n * self.k * self.count

  def bytes(self, dtype_bytes: int) -> int:
    """Bytes one run moves at minimum: read A and B, write C once, `dtype_bytes` per element."""
    return (self.m * self.k + self.k * self.n + self.m * self.n) * dtype_bytes

  def arithmetic_intensity(self, dtype_bytes: int) -> float:
    """FLOP/byte of one run: `2 m n k / bytes(dtype_bytes)`."""
    return 2 * self.m * self.n * self.k / self.bytes(dtype_bytes)

  def backward(self) -> tuple["Gemm", "Gemm"]:
    """The two GEMMs of its backward pass: input gradient `dA[m, k] = dC @ B^T` (contracts
    n) and weight gradient `dB[k, n] = A^T @ dC` (contracts m); same FLOPs each."""
    return (Gemm(self.name + ".dgrad", self.m, self.k, self.n, self.count),
            Gemm(self.name + ".wgrad", self.k, self.n, self.m, self.count))


def tokens_per_expert(tokens: int, num_experts: int) -> int:
  """Rows per expert under uniform top-1 routing without skips: `ceil(tokens / E)`."""
  return -(-tokens // num_experts)


def model_gemms(cfg: ModelConfig, tokens: int, expert_parallel: int = 1) -> list[Gemm]:
  """Every matmul with a weight operand in one forward pass over `tokens` tokens.

  Args:
    cfg: the model.
    tokens: tokens of the pass (M = batch x seq_len, per device when sharded).
    expert_parallel: size of the `expert` mesh axis. A device then holds E/expert_parallel
      experts and, after the all-to-all, receives the tokens routed to them: under uniform
      routing `m = tokens * expert_parallel / E` rows per local expert.
  Returns:
    Gemms in forward order. Attention scores/values and the CCA convolutions are not here
    (no weight operand / not a dense GEMM): see `non_gemm_flops_per_token`.
  Raises:
    ValueError: if `tokens` < 1 or `expert_parallel` does not divide E.
  """
  if tokens < 1:
    raise ValueError(f"tokens={tokens} must be >= 1")
  if expert_parallel < 1 or cfg.num_experts % expert_parallel:
    raise ValueError(f"expert_parallel={expert_parallel} must divide model.num_experts="
                     f"{cfg.num_experts}")
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  r, x, e, f, layers = (cfg.router_hidden_size, cfg.num_router_classes, cfg.num_experts,
                        cfg.moe_intermediate_size, cfg.num_layers)
  m, e_local = tokens, e // expert_parallel
  m_e = tokens_per_expert(tokens * expert_parallel, e)
  return [
      Gemm("attn.q_proj", m, n * h, d, layers),  # BTD,DNH->BTNH
      Gemm("attn.k_proj", m, k * h, d, layers),  # BTD,DKH->BTKH
      Gemm("attn.v_proj", m, k * h // 2, d, 2 * layers),  # current and delayed halves
      Gemm("attn.o_proj", m, d, n * h, layers),  # BTNH,NHD->BTD
      Gemm("router.down_proj", m, r, d, layers),  # MD,DR->MR
      Gemm("router.mlp", m, r, r, 2 * layers),  # fc1, fc2
      Gemm("router.out_proj", m, x, r, layers),  # MR,RX->MX
      Gemm("moe.expert_up_gate", m_e, 2 * f, d, layers * e_local),  # gate and up halves
      Gemm("moe.expert_down", m_e, d, f, layers * e_local),
      Gemm("lm_head", m, cfg.vocab_size, d, 1),  # BTD,VD->BTV (tied)
  ]


def gemm_dtype(g: Gemm, compute_dtype: str) -> str:
  """The dtype `g` runs in: the router always computes in float32 (model/router.py: a routing
  decision must not flip with the compute dtype); every other GEMM in `compute_dtype`."""
  return "float32" if g.name.startswith("router.") else compute_dtype


def mean_visible_keys(seq_len: int, window: int | None = None) -> float:
  """Mean over query positions t = 1..T of the keys it attends to: `min(t, window)`.

  Full causal attention: `(T + 1) / 2`, the "causal halving" of the `T` of a dense mask.
  """
  w = seq_len if window is None else min(window, seq_len)
  return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def non_gemm_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict[str, float]:
  """Forward FLOPs per token, all layers, of the matmuls without a weight operand.

  Returns:
    {"attn.scores": 2 N H S per layer, "attn.values": 2 N H S per layer (S = mean visible
    keys, `mean_visible_keys`; with `causal=False` S = T, what a dense masked XLA attention
    computes), "cca.conv_depthwise": 2 W0 J H per layer, "cca.conv_grouped": 2 W1 J H^2 per
    layer}.
  """
  nh = cfg.num_heads * cfg.head_dim
  j = cfg.num_heads + cfg.num_kv_heads
  keys = 0.0
  for t in cfg.layer_types:
    window = cfg.sliding_window if t == "hybrid_sliding" else None
    keys += mean_visible_keys(seq_len, window) if causal else seq_len
  return {
      "attn.scores": 2.0 * nh * keys,
      "attn.values": 2.0 * nh * keys,
      "cca.conv_depthwise": 2.0 * cfg.cca_time0 * j * cfg.head_dim * cfg.num_layers,
      "cca.conv_grouped": 2.0 * cfg.cca_time1 * j * cfg.head_dim ** 2 * cfg.num_layers,
  }


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward FLOPs per token: weight GEMMs (active experts only) + attention + CCA convs."""
  gemm = sum(g.flops for g in model_gemms(cfg, cfg.num_experts)) / cfg.num_experts
  return gemm + sum(non_gemm_flops_per_token(cfg, seq_len).values())


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token = 3 x forward (forward + input grads + weight grads).

  Forward = every weight GEMM (attention q/k/v/o projections, router down-proj, MLP and
  out_proj, one SwiGLU expert per token, tied LM head) + attention scores and values with
  causal halving (mean visible keys `(T+1)/2`; sliding layers `mean(min(t, window))`) + the
  two CCA convolutions. Experts: top-1, uniform routing, no skipped tokens (upper bound).
  Recomputation under remat is not counted. This is the numerator of MFU in
  `launch.benchmark` and `launch.sizing`.

  Raises:
    ValueError: if `seq_len` < 1.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be >= 1")
  return 3.0 * forward_flops_per_token(cfg, seq_len)


# --------------------------------------------------------------------------------------------
# Parameters.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  """Parameter counts (HF checkpoint convention, see the module docstring).

  Attributes:
    total: every parameter.
    active: parameters one token uses: all but the experts, plus one expert per layer (top-1;
      a token sent to the skip class uses none, so this is the upper bound).
    embedding: input embedding `V x D` (+ LM head bias); the LM head is tied (ZAYA1), else
      its `V x D` would be added.
    breakdown: component -> total parameters (all layers); sums to `total`.
    sharding: component -> logical sharding of its parameters: "fsdp" (has the `embed`
      axis), "fsdp*expert" (experts) or "replicated" (see parallel/mesh.py LOGICAL_RULES).
  """

  total: int
  active: int
  embedding: int
  breakdown: dict[str, int]
  sharding: dict[str, str]

  @property
  def total_excl_embeddings(self) -> int:
    return self.total - self.embedding

  @property
  def active_excl_embeddings(self) -> int:
    return self.active - self.embedding


def count_params(cfg: ModelConfig) -> ParamCounts:
  """Counts the parameters of `ZayaForCausalLM(cfg)` by component.

  Matches: `sum(p.numel() for p in transformers.ZayaForCausalLM(config).parameters())`.
  ZAYA1-base: 8.84B total = 8.30B excluding the 537M embedding; 755M active excluding it.
  """
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  r, x, e, f, layers = (cfg.router_hidden_size, cfg.num_router_classes, cfg.num_experts,
                        cfg.moe_intermediate_size, cfg.num_layers)
  j = n + k
  bias = cfg.attention_bias
  rows = {  # component: (parameters, sharding)
      "embedding": (cfg.vocab_size * d + (cfg.vocab_size if cfg.lm_head_bias else 0), "fsdp"),
      "input_scale_bias": (2 * d, "fsdp"),
      "attn.q_proj": (layers * (d * n * h + (n * h if bias else 0)), "fsdp"),
      "attn.k_proj": (layers * (d * k * h + (k * h if bias else 0)), "fsdp"),
      "attn.v_proj": (layers * (d * k * h + (k * h if bias else 0)), "fsdp"),
      "attn.o_proj": (layers * (n * h * d + (d if bias else 0)), "fsdp"),
      "cca.conv": (layers * (cfg.cca_time0 * j * h + j * h + cfg.cca_time1 * j * h * h + j * h),
                   "replicated"),
      "cca.qk_norm_temp": (layers * k, "replicated"),
      "norms": ((2 * layers + 1) * d, "fsdp"),  # input, post-attention; final
      "residual_scales": (layers * 8 * d, "fsdp"),  # 4 vectors x 2 per layer
      "router.down_proj": (layers * (d * r + r), "fsdp"),
      # EDA scale: layers 1..L-1 (layer 0 has no previous state); router RMSNorm; fc1, fc2.
      "router.mlp": ((layers - 1) * r + layers * (r + 2 * (r * r + r)), "replicated"),
      "router.out_proj": (layers * r * x, "replicated"),
      "moe.experts": (layers * e * 3 * d * f, "fsdp*expert"),  # gate, up [D, F]; down [F, D]
  }
  breakdown = {name: v for name, (v, _) in rows.items()}
  total = sum(breakdown.values())
  experts = breakdown["moe.experts"]
  return ParamCounts(total=total, active=total - experts + experts // e,
                     embedding=breakdown["embedding"], breakdown=breakdown,
                     sharding={name: s for name, (_, s) in rows.items()})


# --------------------------------------------------------------------------------------------
# Sizing rules.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Violation:
  """One broken sizing rule: the config field (or GEMM) concerned, its value, and why it matters."""

  field: str
  value: object
  reason: str

  def __str__(self) -> str:
    return f"{self.field}={self.value}: {self.reason}"


# Matrix-core tiles on MI300X (and H100) are multiples of 16-32 per dimension, and the fast
# hipBLASLt/CK kernels use macro tiles of 64-256; a dimension that is not a multiple of 64
# leaves a partial tile on every row/column block (paper §3: "multiples of 64").
ALIGN = 64
HEAD_DIMS = (64, 128)  # head dims with tuned attention kernels (flash-attention on MI300X)
MIN_GEMM_DIM = 128  # below one macro tile per dimension, the GEMM is launch/latency bound


def check_rules(cfg: ModelConfig, tokens: int, profile: AcceleratorProfile, dtype: str = "bfloat16",
                expert_parallel: int = 1) -> list[Violation]:
  """The sizing rules of paper §3, applied to `cfg` and its GEMMs over `tokens` tokens.

  Rules: hidden, vocab, expert width, router width, q/kv projection widths divisible by 64;
  head_dim 64 or 128; every GEMM with arithmetic intensity at least the accelerator's ridge
  point (peak FLOP/s / HBM bytes/s in the GEMM's dtype, `gemm_dtype`), else it is
  memory-bound (its input-grad and weight-grad GEMMs move the same three matrices, so they
  share its intensity); every GEMM dimension at least `MIN_GEMM_DIM` (e.g. rows per expert).

  Args:
    cfg: the model.
    tokens: tokens per device per step (the `m` of dense GEMMs).
    profile: the accelerator.
    dtype: compute dtype, "bfloat16" | "float32".
    expert_parallel: size of the `expert` mesh axis (see `model_gemms`).
  Returns:
    Violations, config fields first, then GEMMs in forward order.
  """
  out = []
  dims = {"model.hidden_size": cfg.hidden_size, "model.vocab_size": cfg.vocab_size,
          "model.moe_intermediate_size": cfg.moe_intermediate_size,
          "model.router_hidden_size": cfg.router_hidden_size,
          "model.num_heads*head_dim": cfg.num_heads * cfg.head_dim,
          "model.num_kv_heads*head_dim": cfg.num_kv_heads * cfg.head_dim}
  for name, v in dims.items():
    if v % ALIGN:
      out.append(Violation(name, v, f"not a multiple of {ALIGN}: partial matrix-core tiles on "
                           f"every GEMM that uses it; round to {math.ceil(v / ALIGN) * ALIGN}"))
  if cfg.head_dim not in HEAD_DIMS:
    out.append(Violation("model.head_dim", cfg.head_dim, f"not one of {HEAD_DIMS}: attention "
                         "kernels are tuned (and flash-attention is fastest) at 64 or 128"))
  for g in model_gemms(cfg, tokens, expert_parallel):
    dt = gemm_dtype(g, dtype)
    ridge = profile.peak_flops(dt) / profile.hbm_bandwidth
    ai = g.arithmetic_intensity(DTYPE_BYTES[dt])
    if ai < ridge:
      out.append(Violation(f"gemm {g.name} [m={g.m}, n={g.n}, k={g.k}, {dt}]", f"{ai:.0f} FLOP/B",
                           f"below the {profile.name} ridge point {ridge:.0f} FLOP/B: memory-bound, "
                           "cannot reach peak"))
    for axis, v in (("m", g.m), ("n", g.n), ("k", g.k)):
      if v < MIN_GEMM_DIM:
        what = "rows per expert" if g.name.startswith("moe.") and axis == "m" else f"dimension {axis}"
        out.append(Violation(f"gemm {g.name}.{axis}", v, f"{what} below {MIN_GEMM_DIM}: less than "
                             "one macro tile, latency-bound (kernel launch and tile fill dominate)"))
  return out
