# Shape letters: B T S N K H M X E D F (see zaya_jax/__init__.py).
"""The one place that picks, per op, the XLA implementation or the Pallas kernel.

`ModelConfig.kernels` lists the ops that run as Pallas kernels (pallas_kernels/, written for
the Triton lowering: ROCm and CUDA); every other op runs as the XLA/jnp implementation. On a
CPU backend the kernels run in Pallas interpret mode (correct, slow: for tests). The model
calls only the three functions below, never pallas_kernels directly.

  "attention"  CCA's softmax attention -> pallas_kernels.cca_attention (flash attention with
               segment ids, causal, optional window; no [B, T, S] mask is built)
  "routing"    top-1 choice, gate and the token permutation -> pallas_kernels.routing
  "gmm"        the experts' grouped matmuls -> pallas_kernels.gmm
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from zaya_jax import ops
from zaya_jax.model.attention import causal_block_attention
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.mesh import BATCH_AXES


def _per_batch_shard(fn, *args):
  """`fn(*args)`, run per shard of the batch axes inside `shard_map` when a mesh is set.

  A `pallas_call` has no sharding rule: under a multi-device mesh GSPMD would gather its
  inputs. Every arg and output here has the batch (or token) dimension first and is
  independent across it, so each device runs the kernel on its own rows. `check_vma=False`:
  Pallas interpret mode (CPU) slices varying arrays with unvarying indices, which the
  varying-axes checker rejects.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(*args)
  rows = P(BATCH_AXES)
  return jax.shard_map(fn, in_specs=(rows,) * len(args), out_specs=rows, check_vma=False)(*args)


def uses_kernel(cfg: ModelConfig, op: str) -> bool:
  """True if `op` ("attention" | "routing" | "gmm") runs as a Pallas kernel under `cfg`."""
  return op in cfg.kernels


def gmm_impl(cfg: ModelConfig) -> str:
  """The `zaya_jax.ops.grouped_matmul` impl for the experts: "pallas" or `cfg.gmm_impl`."""
  return "pallas" if uses_kernel(cfg, "gmm") else cfg.gmm_impl


def attention(cfg: ModelConfig, q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array,
              segment_ids_BT: jax.Array, mask_BTS: jax.Array | None, sliding: jax.Array | bool,
              scale: float) -> jax.Array:
  """CCA's softmax attention, `[B, T, N, H]` in q's dtype.

  Args:
    q_BTNH, k_BTKH, v_BTKH: queries (after QK-norm and RoPE), keys, values (GQA: N % K == 0).
    segment_ids_BT: int32 document ids, 0 = padding.
    mask_BTS: the XLA path's bool causal mask (`attention.attention_mask`); None with the
      kernel. The XLA path computes only the causal block triangle (`causal_block_attention`).
    sliding: bool [] (may be traced, e.g. a per-layer flag inside `nnx.scan`): this layer
      attends within `cfg.sliding_window` tokens.
    scale: logit scale (head_dim ** -0.5).

  Padding query rows (segment id 0) attend to the padding keys before them in both paths
  (finite values, equal in both); they are masked out of every loss.
  """
  if not uses_kernel(cfg, "attention"):
    return causal_block_attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, scale=scale)
  from pallas_kernels.cca_attention import cca_flash_attention  # pylint: disable=import-outside-toplevel

  def run(window, q, k, v, seg):
    return _per_batch_shard(lambda *a: cca_flash_attention(*a, scale=scale, window=window),
                            q, k, v, seg)

  args = (q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)
  if cfg.sliding_window is None or "hybrid_sliding" not in cfg.layer_types:
    return run(None, *args)
  if isinstance(sliding, bool):
    return run(cfg.sliding_window if sliding else None, *args)
  # A per-layer flag traced inside nnx.scan: both kernels are compiled, one runs.
  return jax.lax.cond(sliding, lambda: run(cfg.sliding_window, *args), lambda: run(None, *args))


class RouteResult(NamedTuple):
  """Top-1 routing of M tokens over X = E + 1 classes (last = skip).

  class_M: int32 chosen class; gate_M: float32 softmax probability of it (differentiable);
  order_M / group_sizes_X: the stable permutation grouping tokens by class and the tokens per
  class, or None when the XLA path leaves the sort to the dispatcher.
  """

  class_M: jax.Array
  gate_M: jax.Array
  order_M: jax.Array | None = None
  group_sizes_X: jax.Array | None = None


def route(cfg: ModelConfig, logits_MX: jax.Array, probs_MX: jax.Array,
          balancing_biases_X: jax.Array) -> RouteResult:
  """ZAYA1's top-1 choice: `argmax(softmax(logits) + balancing_biases)`, gate unbiased.

  Matches `transformers` ZayaRouter: the biases steer the choice only (no gradient), the gate
  is the unbiased probability of the chosen class, not renormalised.
  """
  if uses_kernel(cfg, "routing"):
    from pallas_kernels.routing import route as route_kernel  # pylint: disable=import-outside-toplevel

    biases_X = balancing_biases_X.astype(jnp.float32)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      r = route_kernel(logits_MX.astype(jnp.float32), biases_X)
      return RouteResult(r.class_M, r.gate_M, r.order_M, r.group_sizes_X)
    # Per token shard; the permutation would be shard-local, and EP dispatchers sort anyway.
    class_M, gate_M = jax.shard_map(
        lambda l, b: tuple(route_kernel(l, b)[:2]), in_specs=(P(BATCH_AXES), P()),
        out_specs=(P(BATCH_AXES), P(BATCH_AXES)), check_vma=False)(
            logits_MX.astype(jnp.float32), biases_X)
    return RouteResult(class_M, gate_M)
  biased_MX = jax.lax.stop_gradient(probs_MX) + balancing_biases_X
  class_M = jnp.argmax(biased_MX, axis=-1).astype(jnp.int32)
  gate_M = jnp.take_along_axis(probs_MX, class_M[:, None], axis=-1)[:, 0]
  return RouteResult(class_M, gate_M)


def grouped_matmul(cfg: ModelConfig, x_MD: jax.Array, w_EDF: jax.Array,
                   group_sizes_E: jax.Array) -> jax.Array:
  """`zaya_jax.ops.grouped_matmul` with the impl `gmm_impl(cfg)` picks."""
  return ops.grouped_matmul(x_MD, w_EDF, group_sizes_E, gmm_impl(cfg))
