# Shape letters: E D F (see zaya_jax/__init__.py); E may be the local experts under EP.
"""The experts' weights: E SwiGLU experts `y = (silu(x Wg) * (x Wu)) Wd`.

Compute lives in `zaya_jax.ops.grouped_matmul.swiglu_experts`, on rows already sorted by
expert (the MoE's dispatch sorts them), each row multiplied by its own expert only
(`ModelConfig.gmm_impl`), never a dense all-experts product.
Matches: HF `ZayaExperts` (`gate_up_proj[e]` = [gate; up] rows, `down_proj[e]`).
"""

from __future__ import annotations

import jax
from flax import nnx

from zaya_jax.config.model import ModelConfig
from zaya_jax.model.layers import compute_dtype, normal, param


class Experts(nnx.Module):
  """E SwiGLU experts with weights `w_gate [E, D, F]`, `w_up [E, D, F]`, `w_down [E, F, D]`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    init = normal(cfg.initializer_range)
    self.dtype = compute_dtype(cfg.dtype)
    self.w_gate = param(rngs, init, (e, d, f), ("experts", "embed", "expert_mlp"))
    self.w_up = param(rngs, init, (e, d, f), ("experts", "embed", "expert_mlp"))
    self.w_down = param(rngs, init, (e, f, d), ("experts", "expert_mlp", "embed"))

  def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(w_gate_EDF, w_up_EDF, w_down_EFD)` cast to the compute dtype."""
    return tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))
