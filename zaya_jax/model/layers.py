# Shape letters: B T D V (see zaya_jax/__init__.py).
"""Small blocks of ZAYA1: parameter creation with logical axes, RMSNorm, residual scaling.

Logical axis names on parameters (resolved to mesh axes by a later parallelism table):
`embed` (D), `vocab` (V), `q_heads` (N), `kv_heads` (K), `head_dim` (H), `conv` (J / C),
`experts` (E), `expert_mlp` (F), `router` (R), `classes` (X), `layers` (L, added by the scan).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = Callable[..., jax.Array]


def param(rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int],
          names: Sequence[str | None]) -> nnx.Param:
  """A float32 `nnx.Param` of `shape` with logical axis `names` (metadata `out_sharding`)."""
  if len(names) != len(shape):
    raise ValueError(f"param: {len(names)} axis names {tuple(names)} for shape {tuple(shape)}")
  key = rngs.params() if rngs is not None else jax.random.key(0)
  # Logical names are metadata only: shardings are applied when the state is placed on a mesh
  # (jit out_shardings), so a model can be built with or without a mesh in context.
  return nnx.Param(init(key, tuple(shape), jnp.float32), out_sharding=tuple(names), eager_sharding=False)


def normal(std: float) -> Initializer:
  return jax.nn.initializers.normal(stddev=std)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """`weight * (x * rsqrt(mean(x^2) + eps))`, computed in float32, cast back before the weight.

  Matches: HF `ZayaRMSNorm.forward` (the weight multiplies after the cast to the input dtype).
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * y.astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned per-channel weight (init 1). Matches HF `ZayaRMSNorm`."""

  def __init__(self, dim: int, eps: float, name: str = "embed", *, rngs: nnx.Rngs | None = None):
    self.eps = eps
    self.weight = param(rngs, ones, (dim,), (name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)


class ResidualScale(nnx.Module):
  """`(h + hs_bias) * hs_scale + (x + res_bias) * res_scale`, per-channel, in float32.

  Spec step "Residual scaling"; matches HF `ZayaResidualScaling` (init 1/0/1/0).
  Args of `__call__`: `h_BTD` the block output (any float dtype), `x_BTD` the float32 residual.
  Returns the new float32 residual `[B, T, D]`.
  """

  def __init__(self, dim: int, *, rngs: nnx.Rngs | None = None):
    self.hidden_states_scale = param(rngs, ones, (dim,), ("embed",))
    self.hidden_states_bias = param(rngs, zeros, (dim,), ("embed",))
    self.residual_scale = param(rngs, ones, (dim,), ("embed",))
    self.residual_bias = param(rngs, zeros, (dim,), ("embed",))

  def __call__(self, h_BTD: jax.Array, x_BTD: jax.Array) -> jax.Array:
    h = (h_BTD.astype(jnp.float32) + self.hidden_states_bias[...]) * self.hidden_states_scale[...]
    r = (x_BTD.astype(jnp.float32) + self.residual_bias[...]) * self.residual_scale[...]
    return h + r


def compute_dtype(name: str):
  """`"float32"` / `"bfloat16"` (ModelConfig.dtype) -> jnp dtype."""
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
