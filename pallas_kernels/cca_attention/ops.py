"""Public op: `cca_flash_attention`, the Pallas counterpart of `attention_reference`.

Pads the sequence to a multiple of the blocks (segment id 0: padding, never visible to a real
query because it lies in the causal future) and head_dim to a power of 2 (zeros: no change to
logits, sliced off the output), then runs the `kernel.py` forward under a `jax.custom_vjp`
whose backward runs the dq and dk/dv kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cca_attention import kernel
from pallas_kernels.common import resolve_interpret


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
  """Tile sizes and Triton compiler parameters (block sizes: powers of 2, at least 16).

  Attributes:
    block_q, block_kv: forward tiles along queries / keys.
    num_warps, num_stages: forward Triton compiler parameters.
    bwd_block_q, bwd_block_kv: tiles of both backward kernels (dq: a q block loops over kv
      blocks; dk/dv: a kv block loops over the q blocks of its G query heads).
    bwd_num_warps, bwd_num_stages: backward Triton compiler parameters.
  """
  block_q: int = 64
  block_kv: int = 64
  num_warps: int = 4
  num_stages: int = 2
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2

  def fitted(self, seq_len: int) -> "AttentionBlockSizes":
    """Blocks shrunk to `max(16, next_power_of_2(seq_len))` so short sequences pad little."""
    cap = max(16, 1 << max(seq_len - 1, 0).bit_length())
    fit = {f: min(getattr(self, f), cap) for f in _BLOCK_FIELDS}
    return dataclasses.replace(self, **fit)


_BLOCK_FIELDS = ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _validate(q, k, v, segment_ids, scale, window, block: AttentionBlockSizes) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be rank 4 [B, T, heads, H], got shape {x.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: k {k.shape}, v {v.shape}")
  b, t, n, h = q.shape
  if k.shape[0] != b or k.shape[1] != t or k.shape[3] != h:
    raise ValueError(f"k shape {k.shape} must be [B, T, K, H] = [{b}, {t}, K, {h}] (q {q.shape})")
  if n % k.shape[2]:
    raise ValueError(f"query heads N={n} (q {q.shape}) must be a multiple of kv heads "
                     f"K={k.shape[2]} (k {k.shape})")
  if h % 16:
    raise ValueError(f"head_dim H={h} (q {q.shape}) must be a multiple of 16")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
  if segment_ids.shape != (b, t):
    raise ValueError(f"segment_ids shape {segment_ids.shape} must be [B, T] = [{b}, {t}]")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be integer, got {segment_ids.dtype}")
  if window is not None and (not isinstance(window, int) or window < 1):
    raise ValueError(f"window must be None or a positive int, got {window!r}")
  if not isinstance(scale, (int, float)):
    raise ValueError(f"scale must be a Python float, got {type(scale).__name__}")
  for f in _BLOCK_FIELDS:
    size = getattr(block, f)
    if size < 16 or size & (size - 1):
      raise ValueError(f"block.{f}={size} must be a power of 2 and at least 16")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, segment_ids, scale, window, block, interpret):
  out, _ = _forward(q, k, v, segment_ids, scale, window, block, interpret)
  return out


def _forward(q, k, v, segment_ids, scale, window, block, interpret):
  return kernel.attention_forward(
      q, k, v, segment_ids, scale=scale, window=window, block_q=block.block_q,
      block_kv=block.block_kv, num_warps=block.num_warps, num_stages=block.num_stages,
      interpret=interpret)


def _attention_fwd(q, k, v, segment_ids, scale, window, block, interpret):
  out, lse = _forward(q, k, v, segment_ids, scale, window, block, interpret)
  return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(scale, window, block, interpret, residuals, dout):
  q, k, v, segment_ids, out, lse = residuals
  dq, dk, dv = kernel.attention_backward(
      q, k, v, segment_ids, out, lse, dout, scale=scale, window=window,
      block_q=block.bwd_block_q, block_kv=block.bwd_block_kv, num_warps=block.bwd_num_warps,
      num_stages=block.bwd_num_stages, interpret=interpret)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def cca_flash_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
                        segment_ids_BT: jax.Array, *, scale: float, window: int | None = None,
                        block: AttentionBlockSizes | None = None,
                        interpret: bool | None = None) -> jax.Array:
  """Document-masked causal GQA flash attention; equals `attention_reference` on every row.

  Query t sees key s iff `segment_ids[s] == segment_ids[t]`, `s <= t` and (with a window)
  `s > t - window`. Padding tokens (segment id 0) are treated like one more document, exactly
  as in the XLA path: a padding query attends over the padding keys at or before it, so every
  row has a visible key and the output is finite everywhere. Differentiable in q, k, v
  (`jax.custom_vjp`; Pallas backward kernels); segment_ids gets no cotangent.

  Args:
    q_BTNH: `[B, T, N, H]` queries (float32, bfloat16 or float16).
    k_BTKH, v_BTKH: `[B, T, K, H]`, q's dtype; N a multiple of K (query head n reads kv head
      `n // (N / K)`); H a multiple of 16 (padded to a power of 2 inside).
    segment_ids_BT: integer `[B, T]`, 0 = padding.
    scale: logit scale (Python float). window: sliding window (positive int) or None.
    block: tile sizes; default `AttentionBlockSizes()`, shrunk for short sequences.
    interpret: Pallas interpret mode; None = on CPU only.

  Returns:
    `[B, T, N, H]` in q's dtype.

  Raises:
    ValueError: wrong ranks or shapes, N not a multiple of K, H not a multiple of 16, dtype
      mismatch, bad window, scale or block sizes.
  """
  block = AttentionBlockSizes() if block is None else block
  _validate(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, scale, window, block)
  _, t, _, h = q_BTNH.shape
  block = block.fitted(t)
  tp = _round_up(t, max(getattr(block, f) for f in _BLOCK_FIELDS))
  hp = 1 << (h - 1).bit_length()
  pad = ((0, 0), (0, tp - t), (0, 0), (0, hp - h))
  q, k, v = (jnp.pad(x, pad) for x in (q_BTNH, k_BTKH, v_BTKH))
  segment_ids = jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (0, tp - t)))
  out = _attention(q, k, v, segment_ids, float(scale), window, block,
                   resolve_interpret(interpret))
  return out[:, :t, :, :h]
