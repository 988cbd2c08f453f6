# Shape letters: B T H (see zaya_jax/__init__.py); P = rotary dims (head_dim * partial_rotary_factor).
"""Partial rotary position embedding, rotate-half convention.

Matches: HF `ZayaRotaryEmbedding` (default rope type) and `apply_rotary_pos_emb`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_cos_sin(positions_BT: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables float32 `[B, T, P]` for integer positions `[B, T]` (P = rotary_dim).

  `inv_freq[i] = theta ** (-2i / P)`; the frequency vector is duplicated (rotate-half layout).
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
  freqs = positions_BT.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTnH: jax.Array, cos_BTP: jax.Array, sin_BTP: jax.Array) -> jax.Array:
  """Rotates the first P dims of each head of `x [B, T, heads, H]`; the rest pass through."""
  p = cos_BTP.shape[-1]
  cos = cos_BTP[:, :, None, :].astype(x_BTnH.dtype)
  sin = sin_BTP[:, :, None, :].astype(x_BTnH.dtype)
  x_rot, x_pass = x_BTnH[..., :p], x_BTnH[..., p:]
  x1, x2 = x_rot[..., : p // 2], x_rot[..., p // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
