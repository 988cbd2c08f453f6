# Shape letters: L M X E (see zaya_jax/__init__.py).
"""Quantile balancing: the balancing biases that route a batch exactly evenly (top-1).

A token t goes to class `argmax_x (p[t, x] + b[x])` (zaya_jax/model/router.py). Seen from one
class x with every other bias fixed, t goes to x iff its *margin*

    m_x[t] = p[t, x] - max_{y != x} (p[t, y] + b[y])

exceeds `-b[x]`; so the bias that admits exactly `c` tokens to x is minus a threshold between
the c-th and the (c+1)-th largest margin: the (1 - c/N) quantile of the margins. Setting one
class's bias moves tokens only between that class and the others, so the solve sweeps the
classes in turn (a coordinate step on the dual of the capacity-constrained assignment, whose
subgradient in b[x] is count_x(b) - c_x) and repeats; with continuous probabilities every
class holds its target count after a few sweeps (8 experts: ~8 sweeps from zero biases, fewer
warm-started from the last step's biases); the solve stops once every class is within one
token of its target, or after `balance.quantile_sweeps` sweeps (default 64).

Targets. The skip class (last) keeps its bias unless `skip_target` is set: then it is solved
like the experts, with a target of `round(skip_target * N)` of the N non-padding tokens. The
expert-routed tokens n (N, or N minus the skip target) are split as evenly as integers allow:
expert e gets `n // E + (e < n % E)`. When the skip bias is fixed, the expert biases are
centred (mean 0) after each sweep, so their level against the skip bias never drifts (with
the initial skip bias -1 the skip class then never wins: max_e(p_e + b_e) >= mean_e b_e = 0 >=
p_skip - 1).

Global over a mesh. Nothing gathers tokens: each threshold is found by bisection on the
count `#{t: m_x[t] > thr}`, an integer sum over the (sharded) token axis that XLA reduces
across devices, and placed exactly halfway between the two neighbouring margins found with a
global min and max. Integer sums and min/max do not depend on how the tokens are split, so
the biases are bit-identical on 1 device and on any mesh (and with gradient accumulation,
which hands the solver all micro-batches' tokens). Per bisection step one all-reduce of [L]
int32 per class; no token data crosses devices.

Edge cases: a layer with no non-padding tokens, or (skip fixed) with every token on the skip
class, keeps its biases; tied margins (e.g. identical tokens) cannot be split by any bias and
end on one side, without NaN.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zaya_jax.ops.sharding import batch_axes, single_device

# Bisection steps on each threshold: halves the initial interval (at most 3 probability units:
# margins lie in [-2, 1]) 32 times, to below the float32 spacing of the margins, so the search
# isolates the gap between the c-th and the (c+1)-th margin whenever they differ.
SEARCH_STEPS = 32


def class_targets(n_L: jax.Array, num_experts: int, skip_count_L: jax.Array | None) -> jax.Array:
  """int32 [L, X]: tokens each class should receive.

  Args:
    n_L: int32 tokens to place per layer (non-padding, or those not on a fixed skip class).
    num_experts: E.
    skip_count_L: int32 target of the skip class, or None when the skip bias is fixed (then
      its target column is 0 and unused).
  """
  skip_L = jnp.zeros_like(n_L) if skip_count_L is None else skip_count_L
  expert_n_L = n_L - skip_L
  e = jnp.arange(num_experts, dtype=jnp.int32)
  experts_LE = expert_n_L[:, None] // num_experts + (e[None, :] < expert_n_L[:, None] % num_experts)
  return jnp.concatenate([experts_LE, skip_L[:, None]], axis=-1).astype(jnp.int32)


def _threshold(margin_LM: jax.Array, valid_M: jax.Array, target_L: jax.Array) -> jax.Array:
  """float32 [L]: a threshold `thr` with exactly `target` valid margins above it (when the
  margins allow it), halfway between the two margins that bound the gap."""
  inf = jnp.float32(jnp.inf)
  valid_LM = jnp.broadcast_to(valid_M[None, :], margin_LM.shape)
  count = lambda thr_L: jnp.sum(valid_LM & (margin_LM > thr_L[:, None]), axis=-1, dtype=jnp.int32)
  top_L = jnp.max(jnp.where(valid_LM, margin_LM, -inf), axis=-1)
  bottom_L = jnp.min(jnp.where(valid_LM, margin_LM, inf), axis=-1)

  def bisect(_, lo_hi):  # invariant: count(lo) > target >= count(hi)
    lo_L, hi_L = lo_hi
    mid_L = 0.5 * (lo_L + hi_L)
    above = count(mid_L) > target_L
    return jnp.where(above, mid_L, lo_L), jnp.where(above, hi_L, mid_L)

  _, hi_L = jax.lax.fori_loop(0, SEARCH_STEPS, bisect, (bottom_L - 1.0, top_L))
  # The margins on either side of `hi`: the smallest one above it and the largest at or below.
  upper_L = jnp.min(jnp.where(valid_LM & (margin_LM > hi_L[:, None]), margin_LM, inf), axis=-1)
  lower_L = jnp.max(jnp.where(valid_LM & (margin_LM <= hi_L[:, None]), margin_LM, -inf), axis=-1)
  lower_L = jnp.where(jnp.isfinite(lower_L), lower_L, hi_L)
  upper_L = jnp.where(jnp.isfinite(upper_L), upper_L, lower_L + 1.0)  # target 0: above them all
  return 0.5 * (upper_L + lower_L)


def route_counts(probs_LMX: jax.Array, valid_M: jax.Array, biases_LX: jax.Array) -> jax.Array:
  """int32 [L, X]: valid tokens per class under `argmax(probs + biases)` (the router's rule)."""
  class_LM = jnp.argmax(probs_LMX + biases_LX[:, None, :], axis=-1)
  onehot_LMX = jax.nn.one_hot(class_LM, probs_LMX.shape[-1], dtype=jnp.int32)
  return jnp.sum(onehot_LMX * valid_M[None, :, None].astype(jnp.int32), axis=1)


def quantile_biases(probs_LMX: jax.Array, valid_M: jax.Array, biases_LX: jax.Array,
                    skip_target: float | None, sweeps: int) -> jax.Array:
  """The balancing biases that route this batch evenly (module docstring), float32 [L, X].

  Args:
    probs_LMX: float32 router softmax of every token of the global batch, per layer (the
      token axis may be sharded over any mesh axes).
    valid_M: bool, True for non-padding tokens.
    biases_LX: float32 current biases (the warm start; the skip bias is kept unless
      `skip_target` is set).
    skip_target: target fraction of the tokens for the skip class, or None / < 0 (fixed).
    sweeps: most coordinate sweeps over the solved classes (fewer once balanced).

  Returns:
    Biases under which `route_counts` gives every expert its `class_targets` count (±1 where
    margins tie or sweeps run out); rows of layers with nothing to place are `biases_LX`.
  """
  probs_LMX = probs_LMX.astype(jnp.float32)
  biases_LX = biases_LX.astype(jnp.float32)
  num_classes = probs_LMX.shape[-1]
  num_experts = num_classes - 1
  skip_on = skip_target is not None and skip_target >= 0
  solved = num_classes if skip_on else num_experts  # classes whose bias is solved, skip last
  n_valid = jnp.sum(valid_M, dtype=jnp.int32)
  classes_X = jnp.arange(num_classes)

  def targets(b_LX):
    if skip_on:
      n_L = jnp.full(b_LX.shape[:1], n_valid, jnp.int32)
      return class_targets(n_L, num_experts, jnp.round(skip_target * n_L).astype(jnp.int32))
    n_L = n_valid - route_counts(probs_LMX, valid_M, b_LX)[:, -1]  # tokens not on the skip class
    return class_targets(n_L, num_experts, None)

  active_L = targets(biases_LX)[:, :num_experts].sum(-1) > 0

  def class_step(x, b_LX):
    scores_LMX = probs_LMX + b_LX[:, None, :]
    other_LM = jnp.max(jnp.where(classes_X == x, -jnp.inf, scores_LMX), axis=-1)
    p_LM = jnp.sum(jnp.where(classes_X == x, probs_LMX, 0.0), axis=-1)
    target_L = jnp.sum(jnp.where(classes_X == x, targets(b_LX), 0), axis=-1)
    new_L = -_threshold(p_LM - other_LM, valid_M, target_L)
    return jnp.where((classes_X == x)[None, :] & active_L[:, None], new_L[:, None], b_LX)

  def sweep(carry):
    i, b_LX = carry
    b_LX = jax.lax.fori_loop(0, solved, class_step, b_LX)
    centred_X = classes_X < solved
    mean_L1 = jnp.sum(jnp.where(centred_X, b_LX, 0.0), -1, keepdims=True) / solved
    return i + 1, jnp.where(centred_X & active_L[:, None], b_LX - mean_L1, b_LX)

  def unbalanced(carry):  # some solved class of an active layer is more than 1 token off
    i, b_LX = carry
    off_LX = jnp.abs(route_counts(probs_LMX, valid_M, b_LX) - targets(b_LX))
    off = jnp.max(jnp.where((classes_X < solved)[None, :] & active_L[:, None], off_LX, 0))
    return (i < sweeps) & (off > 1)

  return jax.lax.while_loop(unbalanced, sweep, (jnp.int32(0), biases_LX))[1]


# Finite bin edges of the score gap d (probability units; `histogram_biases`): 0 and
# +-1e-5 * 2^(k/4) for k = 0 .. 79 (up to ~9.5, beyond any gap of biases within +-4), so a bin
# spans 19% of its distance from the boundary: 161 edges, 162 bins.
# numpy, not jnp: importing this module must not start the XLA backend (multi-process runs
# call jax.distributed.initialize first).
_POSITIVE_EDGES = (1e-5 * 2.0 ** (np.arange(80) / 4)).astype(np.float32)
GAP_EDGES = np.concatenate([-_POSITIVE_EDGES[::-1], np.zeros((1,), np.float32), _POSITIVE_EDGES])


def gap_histogram(probs_LMX: jax.Array, valid_M: jax.Array, biases_LX: jax.Array) -> jax.Array:
  """int32 [L, X, K]: per layer and class, the valid tokens per bin of their score gap.

  A token's score gap for class x is `d = (p[x] + b[x]) - max_{y != x} (p[y] + b[y])`: it is
  routed to x iff d > 0, and a bias change of -delta on x alone admits exactly the tokens with
  d > delta. Bin i of K = len(GAP_EDGES) + 1 holds `GAP_EDGES[i-1] <= d < GAP_EDGES[i]` (the
  first and last bins are open).

  Under a mesh (the token axis M split in blocks over every mesh axis, as the batch is) each
  device bins its own tokens inside `jax.shard_map` and one `psum` of the [L, X, K] partial
  histograms is the only cross-device traffic: one all-reduce per call, whatever L, X or M.
  """
  local = functools.partial(_local_gap_histogram, biases_LX=biases_LX.astype(jnp.float32))
  if single_device():
    return local(probs_LMX, valid_M)
  axes = batch_axes()
  summed = lambda p, v: jax.lax.psum(local(p, v), axes)
  return jax.shard_map(summed, in_specs=(P(None, axes, None), P(axes)), out_specs=P(),
                       check_vma=False)(probs_LMX, valid_M)


def _local_gap_histogram(probs_LMX: jax.Array, valid_M: jax.Array,
                         biases_LX: jax.Array) -> jax.Array:
  """`gap_histogram` of the tokens at hand (no cross-device reduction)."""
  probs_LMX = probs_LMX.astype(jnp.float32)
  num_layers, _, num_classes = probs_LMX.shape
  scores_LMX = probs_LMX + biases_LX[:, None, :]
  top2_LM2 = jax.lax.top_k(scores_LMX, 2)[0]
  # max over the other classes: the runner-up for the top class, the top score otherwise
  is_top_LMX = scores_LMX >= top2_LM2[..., :1]
  other_LMX = jnp.where(is_top_LMX, top2_LM2[..., 1:], top2_LM2[..., :1])
  bin_LMX = jnp.searchsorted(jnp.asarray(GAP_EDGES), scores_LMX - other_LMX, side="right")
  k = GAP_EDGES.shape[0] + 1
  segment_LMX = (jnp.arange(num_layers)[:, None, None] * num_classes
                 + jnp.arange(num_classes)[None, None, :]) * k + bin_LMX
  weight_LMX = jnp.broadcast_to(valid_M[None, :, None], scores_LMX.shape).astype(jnp.int32)
  hist = jax.ops.segment_sum(weight_LMX.reshape(-1), segment_LMX.reshape(-1),
                             num_segments=num_layers * num_classes * k)
  return hist.reshape(num_layers, num_classes, k)


def gap_quantile(hist_LXK: jax.Array, target_LX: jax.Array) -> jax.Array:
  """float32 [L, X]: the shift delta with `target` tokens of gap above it, read from the
  histogram (linear within a bin; clamped to the outermost finite edges)."""
  hist_LXK = hist_LXK.astype(jnp.float32)
  edges = jnp.asarray(GAP_EDGES)
  # at_or_above[j] = tokens with d >= GAP_EDGES[j] = bins j+1 .. K-1
  at_or_above_LXJ = jnp.cumsum(hist_LXK[..., ::-1], axis=-1)[..., ::-1][..., 1:]
  target_LX1 = target_LX.astype(jnp.float32)[..., None]
  j_LX = jnp.sum(at_or_above_LXJ >= target_LX1, axis=-1) - 1  # last edge with >= target above
  last = GAP_EDGES.shape[0] - 1
  jc_LX = jnp.clip(j_LX, 0, last - 1)
  lo_LX, hi_LX = edges[jc_LX], edges[jc_LX + 1]
  count_lo_LX = jnp.take_along_axis(at_or_above_LXJ, jc_LX[..., None], -1)[..., 0]
  in_bin_LX = jnp.take_along_axis(hist_LXK, jc_LX[..., None] + 1, -1)[..., 0]
  frac_LX = jnp.clip((count_lo_LX - target_LX) / jnp.maximum(in_bin_LX, 1.0), 0.0, 1.0)
  delta_LX = lo_LX + frac_LX * (hi_LX - lo_LX)
  delta_LX = jnp.where(j_LX < 0, edges[0], delta_LX)
  return jnp.where(j_LX >= last, edges[last], delta_LX)


def histogram_biases(probs_LMX: jax.Array, valid_M: jax.Array, biases_LX: jax.Array,
                     skip_target: float | None, iters: int = 1,
                     step: float = 1.0) -> jax.Array:
  """One simultaneous (Jacobi) quantile step for every class, float32 [L, X]: each solved
  class's bias moves by minus the gap quantile that would give it its `class_targets` count
  with the other biases as they are (`gap_histogram`, `gap_quantile`).

  The step that `balance.quantile_apply="next"` takes after each training step, from that
  step's router probabilities, for the next steps: one all-reduce of the [L, X, K] histogram,
  whatever the number of classes, layers or devices (the exact `quantile_biases` needs ~35
  global reductions per class and sweep). Moving all classes at once double-counts the tokens
  that two classes exchange (the step is Newton's with the Jacobian's diagonal), so it may
  overshoot by up to 2x: `balance.quantile_ema` 0.5 (the default) halves it. The expert biases
  are centred (mean 0) when the skip bias is fixed; a layer with no expert-routed tokens
  keeps its biases.

  Args:
    probs_LMX, valid_M, biases_LX, skip_target: as `quantile_biases`.

  Returns:
    The full-step biases (`quantile_step` mixes them with the current ones by the EMA).
  """
  biases_LX = biases_LX.astype(jnp.float32)
  for _ in range(iters):
    biases_LX = biases_LX - step * _histogram_delta(probs_LMX, valid_M, biases_LX, skip_target)
  return biases_LX


def _histogram_delta(probs_LMX, valid_M, biases_LX, skip_target):
  """float32 [L, X]: minus the bias change of one full `histogram_biases` step."""
  num_experts = biases_LX.shape[-1] - 1
  skip_on = skip_target is not None and skip_target >= 0
  hist_LXK = gap_histogram(probs_LMX, valid_M, biases_LX)
  n_L = jnp.sum(hist_LXK[:, 0, :], axis=-1)  # every valid token, once per class
  zero_bin = GAP_EDGES.shape[0] // 2 + 1  # the first bin at or above d = 0
  on_skip_L = jnp.sum(hist_LXK[:, -1, zero_bin:], axis=-1)
  skip_L = jnp.round(skip_target * n_L).astype(jnp.int32) if skip_on else None
  placed_L = n_L if skip_on else n_L - on_skip_L
  target_LX = class_targets(placed_L, num_experts, skip_L)
  delta_LX = gap_quantile(hist_LXK, target_LX)
  solved_X = jnp.arange(num_experts + 1) < (num_experts + 1 if skip_on else num_experts)
  delta_LX = jnp.where(solved_X, delta_LX, 0.0)
  if not skip_on:
    delta_LX = jnp.where(solved_X, delta_LX - jnp.sum(delta_LX, -1, keepdims=True) / num_experts,
                         0.0)
  active_L1 = (placed_L - (skip_L if skip_on else 0) > 0)[:, None]
  return jnp.where(active_L1, delta_LX, 0.0)


@dataclasses.dataclass(frozen=True)
class BatchBalance:
  """Routing with biases solved from the batch being routed (`balance.quantile_apply=
  "current"`): each layer solves `quantile_biases` on its own router probabilities, warm-
  started from its stored biases, and routes the same tokens with the result, so every step's
  expert load is even to a token. Training only: evaluation and generation route with the
  stored biases. Attributes: `skip_target` and `sweeps` as in `quantile_biases`."""

  skip_target: float | None = None
  sweeps: int = 64

  def solve(self, probs_MX: jax.Array, valid_M: jax.Array, biases_X: jax.Array) -> jax.Array:
    """float32 [X]: the biases that route these `[M, X]` probabilities evenly."""
    return quantile_biases(probs_MX[None], valid_M, biases_X[None], self.skip_target,
                           self.sweeps)[0]
