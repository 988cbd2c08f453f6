"""Shared helpers for the model tests: a tolerance check whose message shows the error size,
and slicing one layer out of a stacked (scanned) model into a single-layer module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def assert_close(name: str, got, want, atol: float = 1e-5, rtol: float = 1e-5) -> None:
  """`|got - want| <= atol + rtol * |want|` elementwise; the message prints max and mean |diff|.

  Args:
    name: what is compared, for the failure message.
    got: our array (any array-like).
    want: the reference array, same shape.
    atol: absolute tolerance.
    rtol: relative tolerance (relative to |want|).
  """
  got = np.asarray(got, dtype=np.float64)
  want = np.asarray(want, dtype=np.float64)
  assert got.shape == want.shape, f"{name}: shape {got.shape} != reference shape {want.shape}"
  diff = np.abs(got - want)
  bad = diff > atol + rtol * np.abs(want)
  assert not bad.any(), (
      f"{name}: {int(bad.sum())}/{bad.size} elements off; max|diff|={diff.max():.3g} "
      f"mean|diff|={diff.mean():.3g} max|want|={np.abs(want).max():.3g} (atol {atol}, rtol {rtol})")


def layer_slice(stacked_module: nnx.Module, i: int) -> dict:
  """Pure dict (numpy leaves) of layer `i` of a module whose leaves carry a leading layer axis."""
  pure = nnx.to_pure_dict(nnx.state(stacked_module))

  def take(tree):
    return {k: take(v) if isinstance(v, dict) else np.asarray(v)[i] for k, v in tree.items()}

  return take(pure)


def module_with(make, pure: dict) -> nnx.Module:
  """Builds `make()` abstractly (no random init) and fills every variable from `pure`."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)


def random_model(cfg, seed: int = 0):
  """`ZayaForCausalLM(cfg)` with numpy-random parameters at realistic scales.

  Built with `nnx.eval_shape` and filled from numpy, because `nnx.Rngs` initialisation
  compiles one threefry program per parameter shape (tens of seconds on a small CPU).
  Residual/norm scales ~1, biases ~0.1, `temp` ~2, router `out_proj` ~1.5 (token-dependent
  routing), other matrices ~0.2, balancing biases 0 (skip class -1, as initialised).
  """
  from zaya_jax.model import ZayaForCausalLM  # local: conftest is imported by every test module

  g = np.random.default_rng(seed)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))

  def fill(path, leaf):
    keys = [getattr(k, "key", None) for k in path]
    name, shape = keys[-1], leaf.shape
    normal = lambda mean, std: (mean + std * g.standard_normal(shape)).astype(np.float32)
    if name == "balancing_biases":
      return np.zeros(shape, np.float32) + np.where(np.arange(shape[-1]) == shape[-1] - 1, -1.0, 0.0).astype(np.float32)
    if name == "temp":
      return normal(2.0, 0.5)
    if name in ("weight", "router_states_scale") or name.endswith("_scale"):
      return normal(1.0, 0.1)
    if "bias" in name:
      return normal(0.0, 0.1)
    if name == "out_proj" and "router" in keys:
      return normal(0.0, 1.5)
    if name == "embed_tokens":
      return normal(0.0, 1.0)
    return normal(0.0, 0.2)

  pure = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
  return nnx.merge(graphdef, state)
