# Shape letters: B T (see zaya_jax/__init__.py).
"""Synthetic training batches: random token ids in the training sharding, and their abstract
twin, for the tools that compile or time the training step without a data pipeline
(`zaya_jax.perf.mesh_sweep`, `zaya_jax.perf.benchmark`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.mesh import batch_sharding

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def abstract_batch(batch_size: int, seq_len: int, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """`jax.ShapeDtypeStruct`s of one `[B, T]` training batch in `batch_sharding(mesh)`."""
  sharding = batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len),
                                  jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
          for k in BATCH_KEYS}


def synthetic_batch(model_cfg: ModelConfig, batch_size: int, seq_len: int,
                    mesh: jax.sharding.Mesh, seed: int = 0) -> dict[str, jax.Array]:
  """One `[B, T]` batch of random token ids (one packed document per row) in the training
  sharding; no data pipeline or tokenizer involved."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, model_cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "segment_ids": np.ones((batch_size, seq_len), np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)),
          "loss_mask": np.ones((batch_size, seq_len), np.float32)}
  return jax.device_put(host, batch_sharding(mesh))
