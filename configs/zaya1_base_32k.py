"""ZAYA1-base context extension: 4K -> 32K tokens at RoPE base 1M on two context shards.

ZAYA1's recipe (ZAYA1-8B report, Table II and §III): after the 4K pretraining at RoPE base
10K, 32K-token sequences at RoPE base 1M, with all-gather K/V context parallelism on two
ranks. This config is `zaya1_base.py` with
  train.seq_len 4096 -> 32768 (train.batch_size 256 -> 32: the same 1M tokens per step),
  model.rope_theta -> 1e6 (full-attention layers; sliding layers keep theirs),
  mesh.context = 2 (each 32K sequence split over two devices, 16K tokens each as two 8K
    zigzag chunks, zaya_jax/parallel/context.py),
  model.remat = True (activation memory of a 16K shard per device).
Parameters do not depend on the RoPE bases or the sequence length, so a 4K checkpoint
continues here in one of two ways:
  - a new run from its weights (fresh optimizer and schedule, step 0):
      python -m launch.train --config=configs/zaya1_base_32k.py --workdir=RUN_32K \
          --config.train.init_from=RUN_4K --config.data.tokenizer=... --config.data.source=...
  - resuming the 4K workdir itself (optimizer state and step kept): --workdir=RUN_4K with
    this config and a larger train.num_steps (see train.schedule_extend for the learning
    rate); the RoPE bases may change on resume (zaya_jax.config.RESUME_CHANGEABLE_MODEL_FIELDS)
    and the data order restarts for the new sequence length (zaya_jax/checkpoint/compat.py).
The tokenizer is not shipped: supply data.tokenizer as for zaya1_base.py.
"""

from configs import zaya1_base


def get_config():
  """Returns the ZAYA1-base 32K context-extension ConfigDict; data.tokenizer must be set."""
  config = zaya1_base.get_config()
  config.train.seq_len = 32_768  # tokens per sequence (packed documents)
  config.train.batch_size = 32  # sequences per step: 32 x 32K = 1M tokens, as 256 x 4K
  config.model.rope_theta = 1_000_000.0  # RoPE base of "hybrid" layers at 32K (ZAYA1: 1M)
  config.model.remat = True  # rematerialise layers: a 16K-token shard's activations per device
  config.mesh.context = 2  # two context shards of 16K tokens each, zigzag (ZAYA1: 2 ranks at 32K)
  return config
