"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask.

Decay applies to weight matrices only (AdamW paper practice, as in nanoGPT / MaxText).
Excluded: every parameter whose rank *per layer* is < 2 (judged from its logical axis names,
the `out_sharding` metadata, without the `layers` axis that `nnx.scan` stacks on, so a
`[L, D]` stacked RMSNorm weight counts as a vector), and every parameter whose path names a
norm, scale, bias or temperature (e.g. `conv_depthwise_bias`, `[L, C, H]`).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from zaya_jax.config import TrainConfig

STACKED_AXIS = "layers"  # logical name of the layer axis added by the scan over layers
NO_DECAY_WORDS = ("norm", "scale", "bias", "temp")  # path parts containing these: no decay


def make_schedule(train: TrainConfig) -> optax.Schedule:
  """Learning rate per update: 0 -> `lr` linearly over `warmup_steps`, then cosine to
  `lr * min_lr_ratio` at `num_steps` (constant after). Argument: updates already applied."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=train.lr,
      warmup_steps=train.warmup_steps,
      decay_steps=train.num_steps,  # total length, warmup included (optax convention)
      end_value=train.lr * train.min_lr_ratio,
  )


def per_layer_ndim(variable: nnx.Variable) -> int:
  """Rank of one layer's slice of `variable`: its ndim minus a leading stacked `layers` axis."""
  names = variable.get_metadata().get("out_sharding")
  ndim = len(variable.shape)
  if names and names[0] == STACKED_AXIS:
    ndim -= 1
  return ndim


def decay_mask(params: nnx.State) -> nnx.State:
  """Same tree as `params` (a prefix of it, for optax): True where weight decay applies.

  Args:
    params: the `nnx.Param` state of the model (concrete or abstract).

  Returns:
    A tree of bools: True for matrices per layer (rank >= 2) not named like a norm, scale,
    bias or temperature.
  """
  def decays(path, v: nnx.Variable) -> bool:
    parts = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
    named = any(w in p for p in parts for w in NO_DECAY_WORDS)
    return per_layer_ndim(v) >= 2 and not named

  return jax.tree_util.tree_map_with_path(decays, params,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(train: TrainConfig, params: nnx.State) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip_norm)` then AdamW on `make_schedule(train)`.

  Args:
    train: the training config (lr, schedule, betas, eps, weight decay, clip norm).
    params: the trainable state (concrete or abstract), used only to build the decay mask.
  """
  adamw = optax.adamw(
      learning_rate=make_schedule(train),
      b1=train.b1,
      b2=train.b2,
      eps=train.eps,
      weight_decay=train.weight_decay,
      mask=decay_mask(params),
  )
  if train.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(train.grad_clip_norm), adamw)
  return adamw
