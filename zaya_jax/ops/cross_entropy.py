# Shape letters: B T D V (see zaya_jax/__init__.py); n = loss chunks, C = positions per chunk.
"""The fused LM head + cross-entropy of the training loss (`linear_cross_entropy`).

Positions run in chunks, each chunk's logits built, reduced and dropped, and its gradient
w.r.t. the head's input and weight formed in the same pass, so neither the `[B, T, V]` logits
nor their gradient are ever stored whole. Its speed against logits + cross-entropy is in
README's "Pallas kernels and ops" section.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Positions of T per loss chunk target this many tokens (B * C) on one device.
LOSS_CHUNK_TOKENS = 512


def loss_chunks(batch: int, seq_len: int) -> int:
  """Chunks n (dividing `seq_len`) of `linear_cross_entropy` for a `[batch, seq_len]` batch.

  About LOSS_CHUNK_TOKENS tokens per chunk on one device. Under a multi-device mesh one chunk:
  each chunk's weight gradient is a sum over the (sharded) batch, which GSPMD would reduce
  across devices once per chunk instead of once per step.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.size > 1:
    return 1
  want = max(1, min(seq_len, batch * seq_len // LOSS_CHUNK_TOKENS))
  return max(n for n in range(1, want + 1) if seq_len % n == 0)


def _split_chunks(x_BT_: jax.Array, n: int) -> jax.Array:
  """`[B, T, ...]` -> `[n, B, T / n, ...]`: chunk i holds positions `[i T/n, (i+1) T/n)`."""
  b, t = x_BT_.shape[:2]
  return jnp.moveaxis(x_BT_.reshape(b, n, t // n, *x_BT_.shape[2:]), 1, 0)


def _chunk_logits(y_BCD, w_VD, bias_V):
  logits_BCV = jnp.einsum("BCD,VD->BCV", y_BCD, w_VD, preferred_element_type=jnp.float32)
  return logits_BCV if bias_V is None else logits_BCV + bias_V


def _chunk_nll(logits_BCV, targets_BC, mask_BC):
  """`(lse_BC, sum of masked -log p(target))` of one chunk's float32 logits."""
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
  return lse_BC, jnp.sum((lse_BC - target_BC) * mask_BC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear_nll_sum(y_BTD, w_VD, bias_V, targets_BT, mask_BT, chunks):
  def body(total, xs):
    y_BCD, targets_BC, mask_BC = xs
    return total + _chunk_nll(_chunk_logits(y_BCD, w_VD, bias_V), targets_BC, mask_BC)[1], None

  xs = (_split_chunks(y_BTD, chunks), _split_chunks(targets_BT, chunks), _split_chunks(mask_BT, chunks))
  return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


def _linear_nll_sum_fwd(y_BTD, w_VD, bias_V, targets_BT, mask_BT, chunks):
  """The loss and its gradients w.r.t. y, w, bias (for a cotangent of 1), chunk by chunk:
  d loss / d logits = mask * (softmax - onehot(target)), used at once and dropped."""
  v = w_VD.shape[0]
  w32_VD = w_VD.astype(jnp.float32)

  def body(carry, xs):
    total, dw_VD, dbias_V = carry
    y_BCD, targets_BC, mask_BC = xs
    logits_BCV = _chunk_logits(y_BCD, w_VD, bias_V)
    lse_BC, nll = _chunk_nll(logits_BCV, targets_BC, mask_BC)
    dlogits_BCV = jnp.exp(logits_BCV - lse_BC[..., None]) - jax.nn.one_hot(targets_BC, v, dtype=jnp.float32)
    dlogits_BCV = dlogits_BCV * mask_BC[..., None]
    dy_BCD = jnp.einsum("BCV,VD->BCD", dlogits_BCV, w32_VD).astype(y_BTD.dtype)
    dw_VD = dw_VD + jnp.einsum("BCV,BCD->VD", dlogits_BCV, y_BCD.astype(jnp.float32))
    if dbias_V is not None:
      dbias_V = dbias_V + jnp.sum(dlogits_BCV, axis=(0, 1))
    return (total + nll, dw_VD, dbias_V), dy_BCD

  init = (jnp.zeros((), jnp.float32), jnp.zeros(w_VD.shape, jnp.float32),
          None if bias_V is None else jnp.zeros(bias_V.shape, jnp.float32))
  xs = (_split_chunks(y_BTD, chunks), _split_chunks(targets_BT, chunks), _split_chunks(mask_BT, chunks))
  (total, dw_VD, dbias_V), dy_nBCD = jax.lax.scan(body, init, xs)
  dy_BTD = jnp.moveaxis(dy_nBCD, 0, 1).reshape(y_BTD.shape)
  dbias_V = None if dbias_V is None else dbias_V.astype(bias_V.dtype)
  return total, (dy_BTD, dw_VD.astype(w_VD.dtype), dbias_V)


def _linear_nll_sum_bwd(chunks, residuals, g):
  del chunks
  dy_BTD, dw_VD, dbias_V = residuals
  scale = lambda d: None if d is None else (g * d).astype(d.dtype)
  return scale(dy_BTD), scale(dw_VD), scale(dbias_V), None, None


_linear_nll_sum.defvjp(_linear_nll_sum_fwd, _linear_nll_sum_bwd)


def linear_cross_entropy(y_BTD: jax.Array, w_VD: jax.Array, bias_V: jax.Array | None,
                         targets_BT: jax.Array, loss_mask_BT: jax.Array,
                         chunks: int | None = None) -> tuple[jax.Array, jax.Array]:
  """`zaya_jax.train.step.cross_entropy(y @ w.T + bias, targets, loss_mask)` without the
  `[B, T, V]` logits.

  The positions run in `chunks` blocks (a `lax.scan`); the forward pass of the gradient
  (`custom_vjp`) also forms each chunk's gradients w.r.t. `y`, `w` and `bias` from its logits
  and drops them, so the backward pass only scales them: 3 matmuls as with stored logits, but
  one chunk's logits in memory. The gradient w.r.t. the loss mask is not formed (zero).

  Args:
    y_BTD: the LM head's input (`ZayaForCausalLM.head_inputs`), compute dtype.
    w_VD: the tied embedding, compute dtype.
    bias_V: float32 head bias, or None.
    targets_BT: int32 next-token ids in [0, V).
    loss_mask_BT: float32 weights, 1 for tokens that count, 0 for padding.
    chunks: position blocks, dividing T (None: `loss_chunks`).
  Returns:
    `(sum of -log p(target) over masked tokens, number of masked tokens)`, both float32 [].
  """
  b, t = targets_BT.shape
  chunks = loss_chunks(b, t) if chunks is None else chunks
  if t % chunks:
    raise ValueError(f"linear_cross_entropy: chunks={chunks} must divide seq_len={t}")
  mask_BT = loss_mask_BT.astype(jnp.float32)
  total = _linear_nll_sum(y_BTD, w_VD, bias_V, targets_BT.astype(jnp.int32), mask_BT, chunks)
  return total, jnp.sum(mask_BT)
