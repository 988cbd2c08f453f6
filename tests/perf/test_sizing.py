"""Analytic sizing (zaya_jax.model.sizing / roofline) against independent counts.

- Parameters: `transformers.ZayaForCausalLM` built from `ModelConfig.to_hf_dict()` (numel of
  its parameters), our NNX model's `nnx.Param` leaves, and the *active* count measured as the
  parameters that receive a gradient when every token is routed to one expert.
- FLOPs: the dot FLOPs of the compiled forward's HLO (`hlo.dot_flops`, scan trip
  counts applied) of a tiny config with `force_balanced_routing`; training = 3 x forward
  checked on the compiled value-and-grad.
- ZAYA1-base's published sizes, roofline arithmetic, rules and the CLI.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import ZayaConfig, ZayaForCausalLM

from configs import zaya1_tiny
from zaya_jax.config.model import ModelConfig
from zaya_jax.model.transformer import ZayaForCausalLM as JaxZaya
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.perf.hlo import dot_flops
from zaya_jax.model import sizing
from zaya_jax.perf import roofline
from zaya_jax.parallel.accelerators import get_profile
from tests.model import hf_reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = dict(vocab_size=192, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
             num_experts=4, moe_intermediate_size=96, router_hidden_size=32,
             layer_types=("hybrid", "hybrid_sliding", "hybrid"), sliding_window=8)
CONFIGS = {
    "small": ModelConfig(**SMALL),
    "biases_gqa4_w3": ModelConfig(**dict(SMALL, num_heads=8, num_kv_heads=2, cca_time0=3, cca_time1=2,
                                         attention_bias=True, lm_head_bias=True)),
    "kv4_e6_2layers": ModelConfig(**dict(SMALL, num_layers=2, num_kv_heads=4, num_heads=4, num_experts=6,
                                         layer_types=("hybrid", "hybrid"), sliding_window=None,
                                         router_hidden_size=48)),
}


def hf_model(cfg: ModelConfig, seed: int = 0) -> ZayaForCausalLM:
  torch.manual_seed(seed)
  hf = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("model_type", "architectures")}
  return ZayaForCausalLM(ZayaConfig(**hf)).eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_counts_match_transformers(name):
  cfg = CONFIGS[name]
  model = hf_model(cfg)
  params = dict(model.named_parameters())  # tied lm_head.weight appears once
  counts = sizing.count_params(cfg)
  assert counts.total == sum(p.numel() for p in params.values())
  assert counts.embedding == params["model.embed_tokens.weight"].numel() + (
      params["lm_head.bias"].numel() if cfg.lm_head_bias else 0)
  experts = sum(p.numel() for k, p in params.items() if ".mlp.experts." in k)
  assert counts.breakdown["moe.experts"] == experts
  router = sum(p.numel() for k, p in params.items() if ".mlp.gate." in k)
  assert router == sum(counts.breakdown[k] for k in ("router.down_proj", "router.mlp", "router.out_proj"))
  assert sum(counts.breakdown.values()) == counts.total


def test_param_count_matches_nnx_model():
  """Our model keeps an unused EDA scale [R] on layer 0 that the HF checkpoint drops."""
  cfg = CONFIGS["biases_gqa4_w3"]
  state = nnx.state(nnx.eval_shape(lambda: JaxZaya(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
  assert n == sizing.count_params(cfg).total + cfg.router_hidden_size


@pytest.mark.parametrize("name", ["small", "biases_gqa4_w3"])
def test_active_params_are_those_one_expert_route_touches(name):
  """Route every token to expert 1, backprop, and count parameters with a gradient: exactly
  `active` (the untouched experts' slices of gate_up_proj / down_proj get none)."""
  cfg = CONFIGS[name]
  model = hf_model(cfg, seed=1)
  hf_reference.randomise(model, seed=1)  # nonzero temp etc., so every path carries gradient
  with torch.no_grad():
    for layer in model.model.layers:
      layer.mlp.gate.balancing_biases.copy_(torch.tensor([0.0, 10.0] + [0.0] * (cfg.num_experts - 1)))
  ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
  model(ids).logits.float().square().mean().backward()
  touched = 0
  for k, p in model.named_parameters():
    nonzero = p.grad is not None and p.grad.ne(0)
    if ".mlp.experts." in k:  # [E, ...]: count whole expert slices that got a gradient
      per_expert = nonzero.reshape(cfg.num_experts, -1).any(1)
      assert per_expert.tolist() == [e == 1 for e in range(cfg.num_experts)], k
      touched += int(per_expert.sum()) * p[0].numel()
    elif nonzero is not False and bool(nonzero.any()):
      touched += p.numel()
  assert touched == sizing.count_params(cfg).active


def _hlo_dot_flops(fn, *args) -> int:
  """Dot FLOPs of `fn`'s HLO as lowered (before XLA's optimisation passes, which keep the dots
  here and only cost compile time; the scan's trip count is read from its condition)."""
  return dot_flops(jax.jit(fn).lower(*args).as_text(dialect="hlo"))


@pytest.mark.slow
def test_forward_and_train_flops_match_hlo():
  """Compiled dot FLOPs of the forward = our GEMMs + the XLA path's attention (8 causal query
  blocks, each against the keys up to its end: `attention.causal_block_attention`) + the
  grouped conv (an einsum; the depthwise conv is elementwise). XLA:CPU lowers
  `ragged_dot` as a dense all-experts product: E x the top-1 expert FLOPs. The training step
  (grad) lowers to exactly 3 x the forward's dot FLOPs."""
  cfg = CONFIGS["small"].replace(force_balanced_routing=True, gmm_impl="ragged_dot")
  b, t = 2, 32
  graphdef, state = nnx.split(nnx.eval_shape(lambda: JaxZaya(cfg, rngs=nnx.Rngs(0))))
  ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
  fwd = lambda s, i: nnx.merge(graphdef, s)(i)
  loss = lambda s, i: jnp.mean(jnp.square(fwd(s, i)))
  got_fwd = _hlo_dot_flops(fwd, state, ids)
  got_train = _hlo_dot_flops(jax.grad(loss), state, ids)

  gemms = sizing.model_gemms(cfg, b * t)
  expert = sum(g.flops for g in gemms if g.name.startswith("moe."))
  per_tok = sizing.non_gemm_flops_per_token(cfg, t, causal=False)  # every query sees T keys
  block = t // 8  # query block i (of 8) reads keys [0, (i + 1) * block)
  blocks_fraction = sum(block * (i + 1) * block for i in range(8)) / t ** 2  # 36/64
  expected = (sum(g.flops for g in gemms) + (cfg.num_experts - 1) * expert
              + b * t * (blocks_fraction * (per_tok["attn.scores"] + per_tok["attn.values"])
                         + per_tok["cca.conv_grouped"]))
  assert got_fwd == expected
  assert got_train == 3 * got_fwd


def test_causal_halving_and_train_flops():
  cfg = CONFIGS["small"]
  assert sizing.mean_visible_keys(4) == 2.5  # (1 + 2 + 3 + 4) / 4
  assert sizing.mean_visible_keys(6, window=3) == (1 + 2 + 3 + 3 + 3 + 3) / 6
  t = 64
  per_tok = sizing.non_gemm_flops_per_token(cfg, t)
  nh = cfg.num_heads * cfg.head_dim
  keys = 2 * (t + 1) / 2 + sizing.mean_visible_keys(t, 8)  # two full layers, one sliding
  assert per_tok["attn.scores"] == pytest.approx(2 * nh * keys)
  d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
  gemm = sum(g.flops for g in sizing.model_gemms(cfg, 4 * e)) / (4 * e)
  # one expert per token: gate+up [D, 2F] and down [F, D]
  assert sum(g.flops for g in sizing.model_gemms(cfg, 4 * e) if g.name.startswith("moe.")) / (4 * e) == \
      cfg.num_layers * 2 * 3 * d * f
  assert sizing.train_flops_per_token(cfg, t) == pytest.approx(3 * (gemm + sum(per_tok.values())))


def test_zaya1_base_sizes():
  """Paper/spec: ~8.3B total and ~760M active parameters excluding embeddings."""
  cfg = ModelConfig()
  c = sizing.count_params(cfg)
  assert c.embedding == 262272 * 2048
  assert c.total_excl_embeddings == pytest.approx(8.3e9, rel=0.01)
  assert c.active_excl_embeddings == pytest.approx(760e6, rel=0.01)
  assert c.total == 8_840_488_784 and c.active_excl_embeddings == 753_608_528
  # 6N-style cross-check: GEMM FLOPs per token = 2 x active GEMM weights (embedding lookup and
  # vectors excluded, LM head included once).
  fwd_gemm = sum(g.flops for g in sizing.model_gemms(cfg, 16)) / 16
  vectors = sum(c.breakdown[k] for k in ("input_scale_bias", "norms", "residual_scales", "cca.conv",
                                         "cca.qk_norm_temp"))
  biases = cfg.num_layers * (cfg.router_hidden_size * 6 - cfg.router_hidden_size) - cfg.router_hidden_size
  assert fwd_gemm == 2 * (c.active - vectors - biases)


def test_gemm_arithmetic():
  g = sizing.Gemm("x", m=256, n=512, k=1024, count=3)
  assert g.flops == 2 * 256 * 512 * 1024 * 3
  assert g.bytes(2) == 2 * (256 * 1024 + 1024 * 512 + 256 * 512)
  assert g.arithmetic_intensity(2) == pytest.approx(2 * 256 * 512 * 1024 / g.bytes(2))
  dgrad, wgrad = g.backward()
  assert (dgrad.m, dgrad.n, dgrad.k) == (256, 1024, 512) and (wgrad.m, wgrad.n, wgrad.k) == (1024, 512, 256)
  # Expert parallelism: E/ep local experts each see tokens * ep / E rows.
  moe = {x.name: x for x in sizing.model_gemms(ModelConfig(), 4096, expert_parallel=8)}["moe.expert_down"]
  assert (moe.m, moe.count) == (2048, 40 * 2)


def test_estimate_roofline_and_memory():
  cfg, prof = ModelConfig(), get_profile("mi300x")
  est = roofline.estimate(cfg, prof, num_devices=64, batch_size=64, seq_len=4096, remat="full")
  # Params, grads, 2 Adam moments in float32, sharded over fsdp=64 (small router/conv replicated).
  c = sizing.count_params(cfg)
  repl = sum(v for k, v in c.breakdown.items() if c.sharding[k] == "replicated")
  assert est.memory["optimizer"] == pytest.approx(8 * ((c.total - repl) / 64 + repl))
  assert est.memory["logits"] == 4096 * cfg.vocab_size * 8
  # A compute-bound GEMM takes FLOPs / peak (x3 for training).
  lm = {g.name: (g, s) for g, s in est.gemms}["lm_head"]
  assert lm[1] == pytest.approx(3 * lm[0].flops / prof.bf16_flops)
  assert est.mfu == pytest.approx(est.flops_per_token * 64 * 4096 / (est.step_seconds * 64 * prof.bf16_flops))
  assert 0 < est.mfu < 1
  # Decode reads the dense weights and one expert per layer at batch 1 (bf16).
  dense = 2 * (c.total - c.breakdown["moe.experts"])
  assert est.decode_bytes["dense_weights"] == dense
  assert est.decode_bytes["expert_weights"] == pytest.approx(2 * c.breakdown["moe.experts"] / 16)
  # A measured GEMM table replaces the roofline per GEMM (called with count=1).
  seen = []
  hooked = roofline.estimate(cfg, prof, num_devices=64, batch_size=64, seq_len=4096,
                             gemm_seconds=lambda g, dt: seen.append((g.count, dt)) or 1e-3)
  assert {n for n, _ in seen} == {1} and {dt for _, dt in seen} == {"bfloat16", "float32"}
  assert sum(s for _, s in hooked.gemms) == pytest.approx(1e-3 * 3 * sum(g.count for g, _ in hooked.gemms))
  with pytest.raises(ValueError, match="batch_size"):
    roofline.estimate(cfg, prof, num_devices=64, batch_size=100, seq_len=4096)
  with pytest.raises(ValueError, match="mesh"):
    roofline.estimate(cfg, prof, num_devices=64, batch_size=64, seq_len=4096, mesh=MeshConfig(1, 3, 2))


def test_estimate_with_context_parallelism():
  """`mesh.context` C: twice the devices at C = 2 hold half the tokens each; the gathered K/V
  and the context collectives are the hand-computed ones; the attention time is the busiest
  zigzag shard's (exactly the mean for full attention, the window over the mean visible keys
  for a short window)."""
  cfg, prof = ModelConfig(), get_profile("mi300x")
  t, b = 32768, 8
  one = roofline.estimate(cfg, prof, num_devices=8, batch_size=b, seq_len=t, mesh=MeshConfig(1, 8, 1))
  two = roofline.estimate(cfg, prof, num_devices=16, batch_size=b, seq_len=t,
                          mesh=MeshConfig(1, 8, 1, 2))
  assert one.mesh["context"] == 1 and two.mesh == {"data": 1, "fsdp": 8, "expert": 1, "context": 2}
  assert one.tokens_per_device == t and two.tokens_per_device == t // 2
  assert two.memory["activations"] == pytest.approx(one.memory["activations"] / 2)
  assert two.memory["logits"] == one.memory["logits"] / 2
  assert not any(k.startswith("context") for k in {**one.memory, **one.comm_seconds})
  # One sequence per device; every layer keeps its gathered bf16 K and V of all t tokens.
  kv = t * 2 * cfg.num_kv_heads * cfg.head_dim * 2
  assert two.memory["context_gathered_kv"] == cfg.num_layers * kv
  # Two adjacent devices of one node: each receives the other's half (ring: (2-1)/2).
  assert two.comm_seconds["context_kv_all_gather"] == pytest.approx(
      cfg.num_layers * 2 * (kv / 2) / prof.scale_up_bandwidth)
  halo_rows = (cfg.cca_time0 + cfg.cca_time1 - 2) * (cfg.num_heads + cfg.num_kv_heads) + cfg.num_kv_heads // 2
  assert two.comm_seconds["context_halo"] == pytest.approx(
      cfg.num_layers * 2 * halo_rows * cfg.head_dim * 2 / prof.scale_up_bandwidth)
  # Full causal attention in zigzag order: shard 0 holds quarters 0 and 3 of the sequence,
  # shard 1 quarters 1 and 2; each sees the same keys, half of the whole sequence's: per
  # device, half the attention (contiguous shards would give the last one ~1.5x the mean).
  for context in (2, 4, 8):
    assert roofline.busiest_shard_attention_factor(cfg, t, context) == pytest.approx(1.0)
  assert two.other_seconds["attention"] == pytest.approx(one.other_seconds["attention"] / 2)
  # A sliding window much shorter than a chunk: every query past the first w sees the window,
  # the whole sequence's a little less on average (its first w queries see fewer keys); the
  # busiest shard is every shard but shard 0 (which holds the sequence start).
  w = 4096
  sliding = dataclasses.replace(cfg, layer_types=("hybrid_sliding",) * cfg.num_layers,
                                sliding_window=w)
  mean_keys = (w * (w + 1) / 2 + (t - w) * w) / t
  for context in (2, 4, 8):
    assert roofline.busiest_shard_attention_factor(sliding, t, context) == pytest.approx(w / mean_keys)
  # The same 3-axis mesh written with context 1 gives the same figures.
  again = roofline.estimate(cfg, prof, num_devices=8, batch_size=b, seq_len=t,
                            mesh=MeshConfig(1, 8, 1, 1))
  assert again.step_seconds == one.step_seconds and again.memory == one.memory
  with pytest.raises(ValueError, match=r"seq_len=32769 is not divisible by 2 x mesh context = 4 \(zigzag chunks\); use a multiple"):
    roofline.estimate(cfg, prof, num_devices=16, batch_size=b, seq_len=t + 1, mesh=MeshConfig(1, 8, 1, 2))
  with pytest.raises(ValueError, match="batch_size=4 is not divisible by the 8 batch shards .*use a multiple of 8"):
    roofline.estimate(cfg, prof, num_devices=16, batch_size=4, seq_len=t, mesh=MeshConfig(1, 8, 1, 2))
  with pytest.raises(ValueError, match=r"seq_len=16 / \(2 x mesh context=8\) = 1 token\(s\) per zigzag chunk is shorter than CCA's halo of 2 tokens; use a seq_len of at least 32"):
    roofline.estimate(cfg, prof, num_devices=64, batch_size=8, seq_len=16, mesh=MeshConfig(1, 8, 1, 8))


def test_rules_flag_misaligned_and_small_gemms():
  prof = get_profile("mi300x")
  good = sizing.check_rules(ModelConfig(), 16384, prof)
  assert {v.field.split(" [")[0] for v in good} == {"gemm attn.k_proj", "gemm attn.v_proj",
                                                    "gemm router.out_proj", "gemm router.out_proj.n"}
  bad = dataclasses.replace(ModelConfig(), hidden_size=2000, head_dim=96, moe_intermediate_size=1000)
  fields = {v.field: v for v in sizing.check_rules(bad, 16384, prof)}
  assert fields["model.hidden_size"].value == 2000 and "2048" in fields["model.hidden_size"].reason
  assert "model.head_dim" in fields and "model.moe_intermediate_size" in fields
  # 64 tokens over 16 experts: 4 rows per expert, latency-bound.
  small = {v.field: v for v in sizing.check_rules(ModelConfig(), 64, prof)}
  assert small["gemm moe.expert_down.m"].value == 4


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "launch.sizing", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.slow
def test_cli_tiny_and_bad_flags():
  out = _cli("--config=configs/zaya1_tiny.py", "--num_devices=8", "--batch_size=8", "--seq_len=256",
             "--mesh=1,-1,1,2")
  assert out.returncode == 0, out.stderr
  for part in ("Parameters", "FLOPs per token", "Memory per device", "GEMMs per device", "MFU",
               "Decode", "Prefill", "Sizing rule violations", "moe.expert_up_gate",
               "context=2", "context_gathered_kv", "comm: context_kv_all_gather"):
    assert part in out.stdout
  bad = _cli("--config=configs/zaya1_tiny.py", "--profile=tpu9")
  assert bad.returncode != 0 and "tpu9" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_cli_gemm_table_replaces_roofline_gemm_times(tmp_path):
  """With a measured table of a flat 1 TFLOP/s, every GEMM's time in the report is its
  forward + backward FLOPs / 1e12 (3x forward), not the profile's roofline; a missing table
  is a one-line error."""
  rows = ["kind,name,dtype,m,n,k,seconds"]
  for dtype in ("float32", "bfloat16"):
    for m, n, k in ((64, 64, 64), (512, 512, 512), (4096, 512, 64), (64, 4096, 4096)):
      rows.append(f"square,x,{dtype},{m},{n},{k},{2 * m * n * k / 1e12:.9e}")
  table = tmp_path / "bench_gemm.csv"
  table.write_text("\n".join(rows) + "\n")
  out = _cli("--config=configs/zaya1_tiny.py", "--num_devices=1", "--batch_size=8", "--seq_len=256",
             "--profile=mi300x", f"--gemm_table={table}")
  assert out.returncode == 0, out.stderr
  assert "GEMM times: measured" in out.stdout
  cfg = ModelConfig(**{**dict(zaya1_tiny.get_config().model),
                       "layer_types": tuple(zaya1_tiny.get_config().model.layer_types)})
  lm_head = next(g for g in sizing.model_gemms(cfg, 8 * 256) if g.name == "lm_head")
  line = next(l for l in out.stdout.splitlines() if l.startswith("lm_head "))
  assert float(line.split()[-1]) == pytest.approx(3 * lm_head.flops / 1e12 * 1e3, rel=2e-2)
  missing = _cli("--config=configs/zaya1_tiny.py", "--gemm_table=/nonexistent/bench_gemm.csv")
  assert missing.returncode != 0 and "--gemm_table" in missing.stderr
