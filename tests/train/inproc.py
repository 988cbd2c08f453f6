"""A tiny in-process training run for tests/train/test_init_from.py, test_schedule_extend.py
and test_evaluate.py (the same sizes as `tests.helpers.CLI_TRAIN_OVERRIDES`)."""

from __future__ import annotations

from configs import zaya1_tiny

STEPS = 6


def tiny_run_config(**train):
  """The ConfigDict of a 2-layer, 4-expert model, 6 steps of 2 x 32 tokens, a checkpoint
  every 3 steps, one eval batch at the end; `train` overrides train fields."""
  config = zaya1_tiny.get_config()
  m = config.model
  m.hidden_size, m.num_layers, m.layer_types = 32, 2, ("hybrid", "hybrid_sliding")
  m.sliding_window, m.num_heads, m.num_kv_heads, m.head_dim = 8, 2, 2, 16
  m.num_experts, m.moe_intermediate_size, m.router_hidden_size = 4, 32, 16
  t = config.train
  t.seq_len, t.batch_size, t.num_steps, t.warmup_steps = 32, 2, STEPS, 1
  t.log_every, t.eval_every, t.eval_batches = 1, 0, 1
  for k, v in train.items():
    setattr(t, k, v)
  config.checkpoint.every_steps = 3
  config.checkpoint.async_save = False
  return config
