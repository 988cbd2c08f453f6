# Shape letters: D V L N K H J R X E F W S (see zaya_jax/__init__.py).
"""Roofline estimates of one ZAYA1 training step, its memory per device, and decode/prefill latency.

Builds on the analytic counts of `zaya_jax.model.sizing`. The assumptions, all stated once:
- Parallelism: the mesh of parallel/mesh.py. Parameters, grads and AdamW states shard like
  the parameters (`embed` on fsdp, experts on fsdp x expert, the small router MLP / conv
  weights replicated); the global batch splits over data x fsdp x expert.
- Memory: float32 master parameters, float32 grads, AdamW's two float32 moments (16 bytes
  per parameter), plus the transient FSDP-gathered weights (two layers and the tied
  embedding, compute dtype), plus activations: per token and layer the tensors the XLA path
  saves for the backward pass (`activation_bytes_per_token`), or with `remat="full"` only
  each layer's input (residual and router state) plus one layer's working set; plus the
  float32 logits and their gradient. XLA fusion, buffer reuse and fragmentation are not
  modelled: treat activations as an estimate (compile with `launch.mesh_sweep` for XLA's).
- Time: each GEMM (forward, input-grad, weight-grad) takes `max(FLOPs / peak, bytes /
  HBM bandwidth)` (or the measured `gemm_seconds` hook); attention scores/values run at peak
  (a flash kernel); CCA convolutions `max(compute, memory)`; norms and other elementwise
  traffic are ignored (a lower bound on time). Collectives (FSDP all-gather / reduce-scatter,
  data all-reduce, EP all-to-all) are assumed overlapped with compute: step time =
  max(compute, communication), communication over the scale-up link when its group fits in
  one node, else the scale-out NIC.
- Decode: memory-bound on one device group: every step reads the non-expert weights, the
  experts the batch's tokens touch, and the KV cache + CCA state (`decode_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from zaya_jax.config.model import ModelConfig
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.parallel.accelerators import AcceleratorProfile
from zaya_jax.model.sizing import DTYPE_BYTES, Gemm, Violation, check_rules, count_params, gemm_dtype, \
    model_gemms, non_gemm_flops_per_token, train_flops_per_token

REMATS = ("none", "full")
F32 = 4


def _gemm_train_seconds(g: Gemm, dtype: str, timer: Callable[[Gemm, str], float],
                        training: bool = True) -> float:
  """Seconds of all runs of `g` (and, with `training`, its dgrad and wgrad) in its dtype."""
  dt = gemm_dtype(g, dtype)
  parts = (g, *g.backward()) if training else (g,)
  return sum(timer(dataclasses.replace(gg, count=1), dt) * gg.count for gg in parts)


def ridge_point(profile: AcceleratorProfile, dtype: str) -> float:
  """FLOP/byte above which a kernel is compute-bound: peak FLOP/s / HBM bytes/s."""
  return profile.peak_flops(dtype) / profile.hbm_bandwidth


def roofline_seconds(g: Gemm, profile: AcceleratorProfile, dtype: str) -> float:
  """Seconds of all `g.count` runs: `count * max(2mnk / peak, bytes / HBM bandwidth)`."""
  one = max(2 * g.m * g.n * g.k / profile.peak_flops(dtype),
            g.bytes(DTYPE_BYTES[dtype]) / profile.hbm_bandwidth)
  return one * g.count


def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, dtype: str) -> dict[str, float]:
  """Bytes per token of one layer's tensors kept for the backward pass (XLA path, no remat).

  Returns a dict by part; "attention" is the dense `[N, T, S]` float32 logits + probabilities
  of `zaya_jax/ops/attention.py` unless `cfg.attention_impl` is "pallas" (then a flash kernel keeps only
  the float32 log-sum-exp per head).
  """
  c = DTYPE_BYTES[dtype]
  d, n, k, h, r, x, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.router_hidden_size, cfg.num_router_classes, cfg.moe_intermediate_size)
  j, taps = n + k, cfg.cca_time0 + cfg.cca_time1 - 1
  dense_attn = cfg.attention_impl != "pallas"
  return {
      "residual_f32": 2 * F32 * d,  # layer input and post-attention residual
      "norm_outputs": 2 * c * d,  # a (attention input), b (MoE input)
      "cca_conv": c * j * h * (1 + taps + cfg.cca_time1 + 1),  # [q0,k0], shifted taps, depthwise, out
      "qk": (n + k) * h * (c + F32 + c),  # + residual means, QK-norm (f32), RoPE
      "v": c * k * h * 2,
      "attention": n * seq_len * (F32 + c) if dense_attn else n * F32,
      "attn_out": c * n * h,
      "router_f32": F32 * (d + 7 * r + 3 * x),  # input, r, norm, fc1/fc2 pre+post GELU, logits, probs
      "experts": c * (3 * d + 3 * f),  # sorted rows, gate, up, silu*up, y, gated y
  }


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Result of `estimate`. Bytes and seconds are per device; FLOPs per token unless named."""

  mesh: dict[str, int]
  batch_size: int
  seq_len: int
  tokens_per_device: int
  dtype: str
  remat: str
  memory: dict[str, float]  # bytes per device: params, grads, optimizer, gathered, activations, logits, total
  gemms: list[tuple[Gemm, float]]  # per-device forward GEMMs and seconds of fwd + dgrad + wgrad
  other_seconds: dict[str, float]  # attention core, CCA convs (fwd + bwd)
  comm_seconds: dict[str, float]  # per collective, per step
  compute_seconds: float
  step_seconds: float
  flops_per_token: float  # training, `sizing.train_flops_per_token`
  mfu: float
  decode_batch: int
  decode_bytes: dict[str, float]  # per decode step, one device
  decode_seconds: float  # per token (per step of the batch)
  prefill_seconds: float  # one prompt of seq_len tokens per sequence of the decode batch


def _other_seconds(cfg: ModelConfig, profile: AcceleratorProfile, dtype: str, tokens: int,
                   seq_len: int, passes: int) -> dict[str, float]:
  """Seconds of the attention core (at peak: a flash kernel) and the CCA convolutions
  (`max(compute, memory)`, reading and writing the J H conv channels once per conv) over
  `tokens` tokens; `passes` = 1 (forward) or 3 (training)."""
  peak = profile.peak_flops(dtype)
  per_tok = non_gemm_flops_per_token(cfg, seq_len)
  conv_bytes = 2 * 2 * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim * DTYPE_BYTES[dtype]
  conv_flops = per_tok["cca.conv_depthwise"] + per_tok["cca.conv_grouped"]
  return {"attention": passes * tokens * (per_tok["attn.scores"] + per_tok["attn.values"]) / peak,
          "cca_conv": passes * tokens * max(conv_flops / peak,
                                            cfg.num_layers * conv_bytes / profile.hbm_bandwidth)}


def context_halo_elements(cfg: ModelConfig) -> int:
  """Elements of one sequence's halo send before one zigzag chunk, per CCA layer and pass:
  the `conv_rows` pre-convolution `[q0, k0]` rows (N + K heads) and the `value_rows`
  delayed-value rows (K / 2 heads) of `ModelConfig.context_halo`, H each (their segment ids
  not included)."""
  conv_rows, value_rows = cfg.context_halo
  return cfg.head_dim * (conv_rows * (cfg.num_heads + cfg.num_kv_heads)
                         + value_rows * cfg.num_kv_heads // 2)


def busiest_shard_attention_factor(cfg: ModelConfig, seq_len: int, context: int) -> float:
  """Attention FLOPs per query token of the busiest of `context` sequence shards in zigzag
  order (zaya_jax/parallel/context.py: shard r holds chunks r and 2C - 1 - r of T / 2C
  tokens), over the mean of the whole sequence: that shard sets a context-parallel step's
  time. Exact for causal and sliding-window layers alike, from `K(n)`, the visible keys of the
  first n queries (`n * S(n)`, `S` the mean visible keys of an n-token sequence): shard r
  sees `K((r+1)c) - K(rc) + K((2C-r)c) - K((2C-1-r)c)`. 1 for full attention at any C (the
  zigzag's point; contiguous shards would give about `(2C - 1) / C`), and 1 for `context` 1.
  Useful FLOPs only: the blocked kernel also computes the masked half of each diagonal block."""
  if context == 1:
    return 1.0
  def keys(n: int) -> float:  # attention FLOPs of the first n queries of a sequence
    if n == 0:
      return 0.0
    per_token = non_gemm_flops_per_token(cfg, n)
    return n * (per_token["attn.scores"] + per_token["attn.values"])
  chunk = seq_len // (2 * context)
  work = lambda a, b: keys(b * chunk) - keys(a * chunk)
  busiest = max(work(r, r + 1) + work(2 * context - 1 - r, 2 * context - r)
                for r in range(context))
  return busiest / (keys(seq_len) / context)


def collective_seconds(profile: AcceleratorProfile, payload: float, group: int, stride: int) -> float:
  """Seconds of an all-gather (or reduce-scatter) whose gathered result is `payload` bytes, over
  `group` devices spaced `stride` apart in the device order (nodes of `devices_per_node`).

  Hierarchical ring: inside a node the group's `g` local devices move `(g-1)/g` of the payload
  over the scale-up links; across `nodes` nodes each node moves `(nodes-1)/nodes` of it through
  its `g` NICs. Bandwidth-optimal; latency and congestion are ignored.
  """
  if group <= 1:
    return 0.0
  span = group * stride
  per_node = max(1, min(group, profile.devices_per_node // stride)) if span > profile.devices_per_node else group
  nodes = group // per_node
  intra = payload * (per_node - 1) / per_node / profile.scale_up_bandwidth
  inter = payload * (nodes - 1) / nodes / (per_node * profile.scale_out_bandwidth) if nodes > 1 else 0.0
  return intra + inter


def estimate(cfg: ModelConfig, profile: AcceleratorProfile, *, num_devices: int, batch_size: int,
             seq_len: int, dtype: str = "bfloat16", remat: str = "none", mesh: MeshConfig | None = None,
             decode_batch: int = 1, gemm_seconds: Callable[[Gemm, str], float] | None = None) -> Estimate:
  """Memory per device, roofline step time and MFU of one training step; decode and prefill.

  Args:
    cfg: the model.
    profile: the accelerator (`accelerators.get_profile`).
    num_devices: devices of the mesh.
    batch_size: global sequences per step.
    seq_len: tokens per sequence (also the decode context and the prefill prompt length).
    dtype: compute dtype of the GEMMs, "bfloat16" | "float32".
    remat: "none" | "full" (each layer recomputed in the backward pass).
    mesh: axis sizes `data, fsdp, expert, context` (default: FSDP over all devices). With
      `context` C > 1 (context parallelism, zaya_jax/parallel/context.py) each sequence is
      split over C devices in zigzag order: a device holds `batch_size / (devices / C)`
      sequences of `seq_len / C` tokens, keeps the all-gathered compressed K/V of its
      sequences per layer, and its step is the busiest shard's
      (`busiest_shard_attention_factor`: about 1 with the zigzag order).
    decode_batch: sequences decoded together (decode/prefill run on one device).
    gemm_seconds: measured time of one run of a GEMM (`count` is 1 in the Gemm passed) in
      `dtype`; default the roofline `max(compute, memory)`.
  Returns:
    An `Estimate`.
  Raises:
    ValueError: naming the argument, for an unknown dtype / remat, a mesh that does not fit
      `num_devices`, experts not divisible by the expert axis, a batch not divisible by
      the batch shards (data x fsdp x expert) or a `seq_len` not divisible by 2 x `context`.
  """
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"dtype={dtype!r}; must be one of {tuple(DTYPE_BYTES)}")
  if remat not in REMATS:
    raise ValueError(f"remat={remat!r}; must be one of {REMATS}")
  sizes = (mesh or MeshConfig()).shape(num_devices)
  fsdp, ep, dp, cp = sizes["fsdp"], sizes["expert"], sizes["data"], sizes["context"]
  if cfg.num_experts % ep:
    raise ValueError(f"mesh expert={ep} does not divide model.num_experts={cfg.num_experts}")
  batch_shards = num_devices // cp
  if batch_size % batch_shards:
    raise ValueError(f"batch_size={batch_size} is not divisible by the {batch_shards} batch shards "
                     f"(data x fsdp x expert); use a multiple of {batch_shards}")
  if cp > 1 and seq_len % (2 * cp):
    raise ValueError(f"seq_len={seq_len} is not divisible by 2 x mesh context = {2 * cp} "
                     f"(zigzag chunks); use a multiple of {2 * cp} or another context size")
  if cp > 1 and seq_len // (2 * cp) < max(cfg.context_halo):
    raise ValueError(f"seq_len={seq_len} / (2 x mesh context={cp}) = {seq_len // (2 * cp)} "
                     f"token(s) per zigzag chunk is shorter than CCA's halo of "
                     f"{max(cfg.context_halo)} tokens; use a seq_len of at least "
                     f"{2 * cp * max(cfg.context_halo)} or another context size")
  c = DTYPE_BYTES[dtype]
  peak = profile.peak_flops(dtype)
  seqs = batch_size // batch_shards  # sequences (or sequence shards) per device
  tokens = seqs * seq_len // cp
  timer = gemm_seconds or (lambda g, dt: roofline_seconds(g, profile, dt))

  # Memory per device.
  params = count_params(cfg)
  shard = {"fsdp": fsdp, "fsdp*expert": fsdp * ep, "replicated": 1}
  local = sum(v / shard[params.sharding[name]] for name, v in params.breakdown.items())
  per_layer = (params.total - params.embedding) / cfg.num_layers
  per_layer_active = per_layer - params.breakdown["moe.experts"] / cfg.num_layers * (1 - 1 / ep)
  acts = sum(activation_bytes_per_token(cfg, seq_len, dtype).values())
  if remat == "full":
    act_bytes = tokens * (cfg.num_layers * F32 * (cfg.hidden_size + cfg.router_hidden_size) + acts)
  else:
    act_bytes = tokens * cfg.num_layers * acts
  memory = {"params": F32 * local, "grads": F32 * local, "optimizer": 2 * F32 * local,
            "gathered_weights": c * (2 * per_layer_active + params.embedding),
            "activations": act_bytes, "logits": tokens * cfg.vocab_size * 2 * F32}
  kv_gathered = seqs * seq_len * 2 * cfg.num_kv_heads * cfg.head_dim * c  # one layer's K and V
  if cp > 1:  # every layer's gathered K/V is kept for the backward pass (one with full remat)
    memory["context_gathered_kv"] = kv_gathered * (1 if remat == "full" else cfg.num_layers)
  memory["total"] = sum(memory.values())

  # Compute: GEMMs forward + two backward GEMMs each, attention core, CCA convs.
  gemms = []
  for g in model_gemms(cfg, tokens, ep):
    gemms.append((g, _gemm_train_seconds(g, dtype, timer)))
  other = _other_seconds(cfg, profile, dtype, tokens, seq_len, passes=3)
  other["attention"] *= busiest_shard_attention_factor(cfg, seq_len, cp)
  compute = sum(s for _, s in gemms) + sum(other.values())

  # Communication per device per step (ring algorithms: (n-1)/n of the payload). Mesh axes
  # are laid out data, fsdp, expert, context (context innermost: `config.mesh.MESH_AXES`), so
  # an axis's devices are spaced by the product of the sizes after it.
  # Parameters one fsdp group gathers / reduce-scatters: every sharded one (experts: this
  # expert shard's); replicated ones are all-reduced over all devices, negligible here.
  fsdp_params = sum(v / (ep if params.sharding[k] == "fsdp*expert" else 1)
                    for k, v in params.breakdown.items() if params.sharding[k] != "replicated")
  forwards = 1 if remat == "none" else 2  # the forward pass (+ its recomputation)
  comm = {}
  if fsdp > 1:
    comm["fsdp_all_gather"] = (forwards + 1) * collective_seconds(profile, fsdp_params * c, fsdp,
                                                                  ep * cp)
    comm["fsdp_reduce_scatter"] = collective_seconds(profile, fsdp_params * F32, fsdp, ep * cp)
  if dp > 1:  # all-reduce = reduce-scatter + all-gather of the fsdp shard's float32 grads
    comm["data_all_reduce"] = 2 * collective_seconds(profile, local * F32, dp, fsdp * ep * cp)
  if cp > 1:
    # Parameters are replicated over `context`: their float32 gradients are all-reduced over
    # it too (priced on its own, before the data all-reduce: an upper bound).
    comm["context_grad_all_reduce"] = 2 * collective_seconds(profile, local * F32, cp, 1)
    # Per CCA layer: the K/V all-gather of each forward pass and the reduce-scatter of dK/dV.
    comm["context_kv_all_gather"] = (cfg.num_layers * (forwards + 1)
                                     * collective_seconds(profile, kv_gathered, cp, 1))
    # Per CCA layer and pass: the last pre-convolution [q0, k0] rows and delayed value row
    # before each of a device's two zigzag chunks (`ModelConfig.context_halo`): one send to
    # each neighbour, in opposite directions of the (full-duplex) links, so priced as one
    # send's time (forward and backward).
    comm["context_halo"] = (cfg.num_layers * (forwards + 1) * seqs * context_halo_elements(cfg)
                            * c / profile.scale_up_bandwidth)
  if ep > 1:  # dispatch + combine, forward + backward: each token's D row leaves and returns
    payload = 2 * 3 * cfg.num_layers * tokens * cfg.hidden_size * c  # rows this device sends
    comm["expert_all_to_all"] = collective_seconds(profile, payload, ep, cp)  # (ep-1)/ep leave
  step = max(compute, sum(comm.values()))
  flops_tok = train_flops_per_token(cfg, seq_len)
  mfu = flops_tok * batch_size * seq_len / (step * num_devices * peak)

  # Decode (one device, memory-bound) and prefill (roofline of the forward pass).
  dec = decode_bytes(cfg, decode_batch, seq_len, dtype)
  prefill_tokens = decode_batch * seq_len
  prefill = sum(_gemm_train_seconds(g, dtype, timer, training=False)
                for g in model_gemms(cfg, prefill_tokens))
  prefill += sum(_other_seconds(cfg, profile, dtype, prefill_tokens, seq_len, passes=1).values())
  return Estimate(mesh=sizes, batch_size=batch_size, seq_len=seq_len, tokens_per_device=tokens,
                  dtype=dtype, remat=remat, memory=memory, gemms=gemms, other_seconds=other,
                  comm_seconds=comm, compute_seconds=compute, step_seconds=step,
                  flops_per_token=flops_tok, mfu=mfu, decode_batch=decode_batch, decode_bytes=dec,
                  decode_seconds=sum(dec.values()) / profile.hbm_bandwidth, prefill_seconds=prefill)


def decode_bytes(cfg: ModelConfig, batch: int, context: int, dtype: str) -> dict[str, float]:
  """HBM bytes one decode step of `batch` sequences reads at `context` cached tokens each.

  Weights in the compute dtype: all non-expert weights (tied embedding: only the LM head's
  full read counts, the embedding lookup reads `batch` rows), plus the experts the batch's
  tokens touch, expected `E (1 - (1 - 1/E)^batch)` per layer under uniform routing; KV cache
  `2 K H` per token per layer (sliding layers read at most `window` tokens), CCA conv state
  `(W0 + W1 - 2) J H` and delayed value `K H / 2` per layer and sequence.
  """
  c = DTYPE_BYTES[dtype]
  p = count_params(cfg)
  e = cfg.num_experts
  one_expert = p.breakdown["moe.experts"] / e
  touched = e * (1 - (1 - 1 / e) ** batch)
  kv_tokens = sum(min(context, cfg.sliding_window) if t == "hybrid_sliding" else context
                  for t in cfg.layer_types)
  j, h = cfg.num_heads + cfg.num_kv_heads, cfg.head_dim
  state = cfg.num_layers * ((cfg.cca_time0 + cfg.cca_time1 - 2) * j * h + cfg.num_kv_heads * h // 2)
  return {"dense_weights": c * (p.total - p.breakdown["moe.experts"]),
          "expert_weights": c * touched * one_expert,
          "kv_cache": c * batch * kv_tokens * 2 * cfg.num_kv_heads * h,
          "cca_state": c * batch * state}


def check(cfg: ModelConfig, profile: AcceleratorProfile, est: Estimate) -> list[Violation]:
  """`sizing.check_rules` at the estimate's tokens per device, plus: memory per device above
  the accelerator's HBM, and a hidden size the fsdp axis does not divide (parallel/mesh.py)."""
  out = check_rules(cfg, est.tokens_per_device, profile, est.dtype, est.mesh["expert"])
  if cfg.hidden_size % est.mesh["fsdp"]:
    out.append(Violation("mesh.fsdp", est.mesh["fsdp"], f"does not divide model.hidden_size="
                         f"{cfg.hidden_size}: parameters shard D over fsdp"))
  if est.memory["total"] > profile.hbm_bytes:
    out.append(Violation("memory per device", f"{est.memory['total'] / 1e9:.1f} GB",
                         f"exceeds {profile.name}'s {profile.hbm_bytes / 1e9:.0f} GB; use --remat=full, "
                         "the attention kernel, more devices or a smaller batch"))
  return out


# --------------------------------------------------------------------------------------------
# Report (printed by `python -m launch.sizing`).
# --------------------------------------------------------------------------------------------


def _table(head: tuple[str, ...], rows: list[tuple]) -> str:
  cells = [head] + [tuple(str(v) for v in r) for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
  fmt = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
  return "\n".join(fmt(r) for r in cells)


def format_report(cfg: ModelConfig, profile: AcceleratorProfile, est: Estimate, violations: list) -> str:
  """The sizing report: parameters, FLOPs per token, memory, GEMMs, step time/MFU, decode and
  prefill, rule violations. `violations` from `sizing.check_rules`."""
  g9, t12 = 1e9, 1e12
  p = count_params(cfg)
  e = cfg.num_experts
  out = [f"{profile.name}: {profile.peak_flops(est.dtype) / t12:.1f} TFLOP/s {est.dtype} dense, "
         f"HBM {profile.hbm_bandwidth / t12:.2f} TB/s, {profile.hbm_bytes / g9:.0f} GB; mesh "
         + " ".join(f"{k}={v}" for k, v in est.mesh.items())
         + f" ({math.prod(est.mesh.values())} devices); batch {est.batch_size} x seq {est.seq_len} "
         f"= {est.tokens_per_device} tokens per device; remat={est.remat}"]

  rows = []
  for name, v in p.breakdown.items():
    active = v / e if name == "moe.experts" else v
    rows.append((name, f"{v / 1e6:,.2f}", f"{active / 1e6:,.2f}", p.sharding[name]))
  rows += [("total", f"{p.total / 1e6:,.2f}", f"{p.active / 1e6:,.2f}", ""),
           ("total excl. embeddings", f"{p.total_excl_embeddings / 1e6:,.2f}",
            f"{p.active_excl_embeddings / 1e6:,.2f}", "")]
  out += ["", "Parameters (millions; HF checkpoint convention, tied LM head; active = top-1, "
          "no skips):", _table(("component", "total", "active", "sharded over"), rows)]

  nf = non_gemm_flops_per_token(cfg, est.seq_len)
  gemm_tok = sum(g.flops for g in model_gemms(cfg, e)) / e
  lm = 2 * cfg.hidden_size * cfg.vocab_size
  rows = [("weight GEMMs excl. LM head", gemm_tok - lm), ("LM head", lm),
          ("attention scores + values (causal: mean visible keys)", nf["attn.scores"] + nf["attn.values"]),
          ("CCA convolutions", nf["cca.conv_depthwise"] + nf["cca.conv_grouped"])]
  fwd = sum(v for _, v in rows)
  rows = [(k, f"{v / g9:.3f}", f"{3 * v / g9:.3f}", f"{100 * v / fwd:.1f}%") for k, v in rows]
  rows.append(("total", f"{fwd / g9:.3f}", f"{est.flops_per_token / g9:.3f}", "100%"))
  out += ["", f"FLOPs per token (GFLOP; training = 3 x forward; seq_len {est.seq_len}):",
          _table(("part", "forward", "training", "share"), rows)]

  rows = [(k, f"{v / g9:.2f}") for k, v in est.memory.items()]
  fits = "fits" if est.memory["total"] <= profile.hbm_bytes else "DOES NOT FIT"
  out += ["", f"Memory per device (GB; {fits} in {profile.hbm_bytes / g9:.0f} GB; params/grads/AdamW "
          "moments float32):", _table(("part", "GB"), rows)]

  rows = [(g.name, g.m, g.n, g.k, g.count, f"{g.flops / g9:,.1f}",
           f"{g.arithmetic_intensity(DTYPE_BYTES[gemm_dtype(g, est.dtype)]):.0f}", f"{1e3 * s:.2f}")
          for g, s in est.gemms]
  out += ["", f"GEMMs per device per step (forward shapes; ridge point {ridge_point(profile, est.dtype):.0f} "
          "FLOP/B; router in float32; time = forward + dgrad + wgrad):",
          _table(("gemm", "m", "n", "k", "count", "GFLOP fwd", "FLOP/B", "ms"), rows)]

  rows = [(f"compute: {k}", f"{1e3 * v:.2f}") for k, v in est.other_seconds.items()]
  rows.append(("compute total (GEMMs + above)", f"{1e3 * est.compute_seconds:.2f}"))
  rows += [(f"comm: {k} (overlapped)", f"{1e3 * v:.2f}") for k, v in est.comm_seconds.items()]
  rows.append(("step = max(compute, comm)", f"{1e3 * est.step_seconds:.2f}"))
  tok_s = est.batch_size * est.seq_len / est.step_seconds
  out += ["", "Training step (roofline):", _table(("part", "ms"), rows),
          f"tokens/s {tok_s:,.0f} ({tok_s / math.prod(est.mesh.values()):,.0f} per device); "
          f"MFU {100 * est.mfu:.1f}% at {est.flops_per_token / g9:.3f} GFLOP/token"]

  rows = [(k, f"{v / g9:.3f}") for k, v in est.decode_bytes.items()]
  out += ["", f"Decode (one device, batch {est.decode_batch}, context {est.seq_len}; memory-bound): "
          f"{1e3 * est.decode_seconds:.2f} ms per token step "
          f"({est.decode_batch / est.decode_seconds:,.0f} tokens/s)",
          _table(("bytes read per step", "GB"), rows),
          f"Prefill ({est.decode_batch} x {est.seq_len} tokens, one device): "
          f"{1e3 * est.prefill_seconds:.1f} ms"]

  out += ["", f"Sizing rule violations ({len(violations)}):"]
  out += [f"  {v}" for v in violations] or ["  none"]
  return "\n".join(out)
