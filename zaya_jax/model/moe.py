# Shape letters: B T D M X E (see zaya_jax/__init__.py).
"""The MoE block: router -> permute (sort by expert) -> experts -> unpermute -> gate.

Skip class (index E) semantics are a config value (`ModelConfig.skip_mode`):
- `"zero"`: a skipped token's MoE output is 0 (HF `ZayaSparseMoeBlock`);
- `"scaled_identity"`: it is `gate * x`, x the MoE input (Zyphra's original trainer).
Both agree while the skip class cannot win (released checkpoints: skip bias -1).
Matches: HF `ZayaSparseMoeBlock.forward`; spec §2 "Experts".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zaya_jax.model.config import ModelConfig
from zaya_jax.model.experts import Experts
from zaya_jax.model.router import Router


def permute(x_MD: jax.Array, class_M: jax.Array, num_classes: int):
  """Sorts rows by router class (stable). Returns `(x_sorted_MD, order_M, counts_X)`."""
  order_M = jnp.argsort(class_M, stable=True)
  counts_X = jnp.bincount(class_M, length=num_classes).astype(jnp.int32)
  return x_MD[order_M], order_M, counts_X


def unpermute(y_sorted_MD: jax.Array, order_M: jax.Array) -> jax.Array:
  """Inverse of `permute`: row `order_M[i]` of the output is row i of `y_sorted_MD`."""
  return jnp.zeros_like(y_sorted_MD).at[order_M].set(y_sorted_MD, unique_indices=True)


class MoE(nnx.Module):
  """ZAYA1 MoE block (router + E SwiGLU experts + skip class), top-1, dropless on one device."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    self.num_experts = cfg.num_experts
    self.skip_mode = cfg.skip_mode
    self.router = Router(cfg, rngs=rngs)
    self.experts = Experts(cfg, rngs=rngs)

  def __call__(self, b_BTD: jax.Array, r_prev_BTR: jax.Array, segment_ids_BT: jax.Array):
    """Args: `b_BTD` the post-attention-normed input; `r_prev_BTR` float32 router state of the
    previous layer (zeros for layer 0); `segment_ids_BT` (0 = pad, only for the counts).

    Returns `(y_BTD, r_BTR, counts_X)`: the gated MoE output (compute dtype), this layer's
    router state, and float32 numbers of non-padding tokens routed to each class.
    """
    bsz, t, d = b_BTD.shape
    e = self.num_experts
    x_MD = b_BTD.reshape(bsz * t, d)
    class_M, gate_M, r_MR, _ = self.router(x_MD, r_prev_BTR.reshape(bsz * t, -1))
    x_sorted, order_M, counts_X = permute(x_MD, class_M, e + 1)
    # Skip-class rows sort last, past sum(counts[:E]): ragged_dot leaves them zero.
    y_MD = unpermute(self.experts(x_sorted, counts_X[:e]), order_M)
    skipped_M1 = (class_M == e)[:, None]
    if self.skip_mode == "scaled_identity":
      y_MD = jnp.where(skipped_M1, x_MD.astype(y_MD.dtype), y_MD)
    else:
      y_MD = jnp.where(skipped_M1, 0, y_MD)
    y_MD = y_MD * gate_M[:, None].astype(y_MD.dtype)
    real_M = (segment_ids_BT.reshape(-1) != 0).astype(jnp.float32)
    counts_X = jnp.zeros((e + 1,), jnp.float32).at[class_M].add(real_M)
    return y_MD.reshape(bsz, t, d), r_MR.reshape(bsz, t, -1), counts_X
