"""The training benchmark's config for one 2-core CPU host (`python -m launch.benchmark`).

ZAYA1's architecture at a size whose float32 training step takes about a second on 2 cores:
d_model 512, 8 layers, 8 query / 2 kv heads of 64, 16 experts of width 512, router width 64,
vocab 16384, batch 4 x 512 tokens. The LM head is ~40% of the step's FLOPs, close to
ZAYA1-base's proportion, so the benchmark weighs the same parts of the step:
  python -m launch.benchmark --config=configs/bench_cpu.py --compare_transformers
"""

from configs import base


def get_config():
  """Returns the bench_cpu ConfigDict: base with smaller sizes, float32, batch 4 x 512."""
  config = base.get_config()

  m = config.model
  m.vocab_size = 16384  # tokens (a multiple of 64)
  m.hidden_size = 512
  m.num_layers = 8
  m.layer_types = ("hybrid",) * 8  # full causal attention in every layer
  m.gmm_impl = "fused"  # what "auto" picks on CPU, set so the config says it (zaya_jax/ops/grouped_matmul.py)
  # Layers unrolled, not an nnx.scan: on 2 CPU cores 0.86x the step time (the scan's dynamic
  # slices of each layer's weights and saved activations were 14% of the op time; 41 s to
  # compile against 29 s). ZAYA1-base keeps the scan (compile time independent of depth).
  m.scan_layers = False
  m.num_heads = 8
  m.num_kv_heads = 2
  m.head_dim = 64
  m.num_experts = 16
  m.moe_intermediate_size = 512
  m.router_hidden_size = 64
  m.dtype = "float32"
  m.pad_token_id = 0  # the byte tokenizer's ids (the benchmark feeds synthetic tokens)
  m.bos_token_id = 1
  m.eos_token_id = 2

  t = config.train
  t.batch_size = 4  # sequences per step
  t.seq_len = 512  # tokens per sequence
  t.warmup_steps = 0  # no LR warm-up: every timed step applies a full-size update

  return config
