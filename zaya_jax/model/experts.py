# Shape letters: M D F E (see zaya_jax/__init__.py); E may be the local experts under EP.
"""SwiGLU experts on rows already sorted by expert: `y = (silu(x Wg) * (x Wu)) Wd`.

Compute only: the caller sorts tokens and passes `group_sizes [E]`. Rows past
`sum(group_sizes)` (e.g. skip-class tokens sorted last) produce zeros. Dropless: each row is
multiplied by its own expert only (`ops.grouped_matmul`: `jax.lax.ragged_dot` or a tiled
equivalent, chosen by `ModelConfig.gmm_impl`), never a dense all-experts product.
Matches: HF `ZayaExperts` (`gate_up_proj[e]` = [gate; up] rows, `down_proj[e]`).
"""

from __future__ import annotations

import jax
from flax import nnx

from zaya_jax import kernels, ops
from zaya_jax.config.model import ModelConfig
from zaya_jax.model.layers import compute_dtype, normal, param


def swiglu_experts(x_MD: jax.Array, w_gate_EDF: jax.Array, w_up_EDF: jax.Array,
                   w_down_EFD: jax.Array, group_sizes_E: jax.Array, gmm_impl: str) -> jax.Array:
  """Grouped SwiGLU on sorted rows; weights already in the compute dtype. Returns `[M, D]`."""
  x = x_MD.astype(w_gate_EDF.dtype)
  gmm = lambda a, w: ops.grouped_matmul(a, w, group_sizes_E, gmm_impl)
  h_MF = jax.nn.silu(gmm(x, w_gate_EDF)) * gmm(x, w_up_EDF)
  return gmm(h_MF, w_down_EFD)


class Experts(nnx.Module):
  """E SwiGLU experts with weights `w_gate [E, D, F]`, `w_up [E, D, F]`, `w_down [E, F, D]`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    init = normal(cfg.initializer_range)
    self.dtype = compute_dtype(cfg.dtype)
    self.gmm_impl = kernels.gmm_impl(cfg)
    self.w_gate = param(rngs, init, (e, d, f), ("experts", "embed", "expert_mlp"))
    self.w_up = param(rngs, init, (e, d, f), ("experts", "embed", "expert_mlp"))
    self.w_down = param(rngs, init, (e, f, d), ("experts", "expert_mlp", "embed"))

  def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(w_gate, w_up, w_down)` cast to the compute dtype."""
    return tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down))

  def __call__(self, x_MD: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """`x_MD` rows sorted by expert, `group_sizes_E` int32 -> `[M, D]` in the compute dtype."""
    return swiglu_experts(x_MD, *self.weights(), group_sizes_E, self.gmm_impl)
