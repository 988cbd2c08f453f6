"""The "quantile" and "adamw" balancing modes (zaya_jax/train/quantile.py, balance.py):
the quantile solve balances the batch it was computed from exactly, handles ties and empty
layers; both modes balance a skewed synthetic router; the AdamW rule matches optax."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import zaya1_tiny
from tests.helpers import random_batch, tiny_model_config
from zaya_jax.config import BalanceConfig, ConfigError, TrainConfig
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.model.quantile import (GAP_EDGES, class_targets, gap_histogram, gap_quantile,
                                    histogram_biases, quantile_biases, route_counts)
from zaya_jax.parallel.mesh import make_mesh, use_mesh
from zaya_jax.train import balance as B
from zaya_jax.train import run
from zaya_jax.train.loop import global_batch
from zaya_jax.train.optim import balance_rate_schedule, make_schedule
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import init_train_state

L, E, F, N = 2, 8, 16, 4096  # layers, experts, token features, tokens per step
X = E + 1


def skewed_probs(key, n=N, temperature=1.0, favour=1.0, token_key=None):
  """float32 [L, n, X]: a random router (drawn from `key`) over random tokens (from
  `token_key`, default from `key` too), experts 0 and 1 favoured by `favour` logits."""
  kw, kx = jax.random.split(key)
  kx = kx if token_key is None else token_key
  w_LFX = temperature * jax.random.normal(kw, (L, F, X)) / np.sqrt(F)
  favour_X = jnp.zeros((X,)).at[:2].set(favour)
  x_LNF = jax.random.normal(kx, (L, n, F))
  return jax.nn.softmax(jnp.einsum("lnf,lfx->lnx", x_LNF, w_LFX) + favour_X, -1)


solve = jax.jit(quantile_biases, static_argnums=(3, 4))
B0 = jnp.zeros((L, X)).at[:, -1].set(-1.0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_quantile_biases_balance_their_own_batch_exactly(temperature):
  probs = skewed_probs(jax.random.key(0), temperature=temperature)
  valid = jnp.ones((N,), bool).at[-37:].set(False)  # some padding: 4059 tokens to place
  before = np.asarray(route_counts(probs, valid, B0))
  assert before[:, :E].max() > 2 * (4059 / E)  # skewed: experts 0/1 take most tokens
  b = solve(probs, valid, B0, None, 64)
  counts = np.asarray(route_counts(probs, valid, b))
  want = np.asarray(class_targets(jnp.full((L,), 4059, jnp.int32), E, None))
  print(f"T={temperature}: before {before[0].tolist()} after {counts[0].tolist()}")
  np.testing.assert_array_equal(np.abs(counts[:, :E] - want[:, :E]) <= 1, True)
  assert counts[:, :E].sum() == 2 * 4059 and np.all(counts[:, E] == 0)
  np.testing.assert_array_equal(np.asarray(b)[:, -1], -1.0)  # skip bias fixed
  np.testing.assert_allclose(np.asarray(b)[:, :E].mean(-1), 0.0, atol=1e-6)  # centred


def test_quantile_with_a_skip_target_solves_the_skip_class_too():
  probs = skewed_probs(jax.random.key(1))
  valid = jnp.ones((N,), bool)
  b = solve(probs, valid, B0, 0.25, 64)
  counts = np.asarray(route_counts(probs, valid, b))
  np.testing.assert_array_equal(counts[:, E], 1024)  # round(0.25 * 4096)
  np.testing.assert_array_equal(np.abs(counts[:, :E] - 384) <= 1, True)  # (4096 - 1024) / 8


@pytest.mark.slow
def test_quantile_ties_and_empty_layers():
  # Identical tokens: no bias can split them; the solve stays finite.
  same = jnp.broadcast_to(jax.nn.softmax(jnp.arange(X, dtype=jnp.float32)), (L, 64, X))
  b = solve(same, jnp.ones((64,), bool), B0, None, 8)
  assert np.all(np.isfinite(np.asarray(b)))
  assert np.asarray(route_counts(same, jnp.ones((64,), bool), b))[:, :E].max() == 64
  # All padding, or every token on a (fixed, raised) skip class: the biases stay as they are.
  probs = skewed_probs(jax.random.key(2), n=256)
  start = jnp.asarray(np.random.default_rng(0).normal(size=(L, X)), jnp.float32)
  np.testing.assert_array_equal(solve(probs, jnp.zeros((256,), bool), start, None, 8), start)
  high_skip = B0.at[:, -1].set(5.0)
  np.testing.assert_array_equal(solve(probs, jnp.ones((256,), bool), high_skip, None, 8),
                                high_skip)


@pytest.mark.slow
def test_quantile_step_ema_clamp_and_skipped_update():
  probs = skewed_probs(jax.random.key(3), n=1024)
  valid = jnp.ones((1024,), bool)
  counts = jnp.zeros((L, X))
  state = B.init_balance_state(L, X)
  solved = histogram_biases(probs, valid, B0, None)
  b, st = B.quantile_step(BalanceConfig(mode="quantile", quantile_ema=0.75,
                                        quantile_integral=0.0), B0, state, probs, valid)
  np.testing.assert_allclose(b, 0.75 * B0 + 0.25 * solved, rtol=1e-6, atol=1e-7)
  jax.tree.map(np.testing.assert_array_equal, st, state)
  b, _ = B.quantile_step(BalanceConfig(mode="quantile", bias_clamp=0.01, quantile_integral=0.0),
                         B0, state, probs, valid)
  assert float(jnp.max(jnp.abs(b[:, :E]))) == pytest.approx(0.01) and np.all(b[:, -1] == -1.0)
  b, _ = B.quantile_step(BalanceConfig(mode="quantile"), B0, state, probs, valid, jnp.bool_(False))
  np.testing.assert_array_equal(b, B0)
  with pytest.raises(ValueError, match="quantile"):
    B.controller_step(BalanceConfig(mode="quantile"), B0, state, counts)


def simulate(cfg: BalanceConfig, steps: int, n: int = N):
  """Routes fresh random tokens through one fixed, skewed router (`skewed_probs`) for `steps`
  steps, the biases updated after each step by `cfg.mode`. Returns per step the max/mean
  expert load (max over layers) [steps], the normalised load entropy (min over layers)
  [steps], and the final biases [L, X]."""
  valid = jnp.ones((n,), bool)
  router = jax.random.key(7)

  def body(carry, token_key):
    b_LX, st = carry
    probs = skewed_probs(router, n=n, token_key=token_key)
    counts = route_counts(probs, valid, b_LX).astype(jnp.float32)
    stats = B.load_stats(counts)
    if cfg.mode == "quantile":
      b_LX, st = B.quantile_step(cfg, b_LX, st, probs, valid)
    else:
      b_LX, st = B.controller_step(cfg, b_LX, st, counts)
    return (b_LX, st), (jnp.max(stats["max_over_mean"]), jnp.min(stats["load_entropy"]))

  keys = jax.random.split(jax.random.key(8), steps)
  (b, _), (mom, ent) = jax.jit(lambda: jax.lax.scan(
      body, (B0, B.init_balance_state(L, X)), keys))()
  return np.asarray(mom), np.asarray(ent), np.asarray(b)


def settle_step(mom: np.ndarray, threshold: float = 1.1) -> int | None:
  """First step from which max/mean stays below `threshold` to the end (None: never)."""
  above = np.nonzero(mom >= threshold)[0]
  return 0 if above.size == 0 else (int(above[-1]) + 1 if above[-1] + 1 < len(mom) else None)


@pytest.mark.slow
def test_quantile_balances_a_skewed_router_within_five_steps():
  """The "quantile" rule (`quantile_apply="next"`: one histogram step per train step, EMA
  0.5) on a fixed skewed router over fresh tokens: without the integral
  (`quantile_integral=0`) from max/mean ~2.9 it is at the sampling noise by step 5 and stays
  there. With `quantile_integral=0.15` (the default before `quantile_reroute`) it overshoots once while its integral
  winds up on the first large shifts and is at the same noise by step 10."""
  for ki, settled in ((0.0, 5), (0.15, 10)):
    mom, ent, _ = simulate(BalanceConfig(mode="quantile", quantile_integral=ki), steps=30)
    print(f"quantile, integral {ki}: max/mean {mom[0]:.2f} -> {mom[settled:].max():.3f} from "
          f"step {settled}; entropy >= {ent[settled:].min():.4f}")
    assert mom[0] > 2.0
    # Then only sampling noise (the histogram's batch's and this batch's): 512 tokens per
    # expert, std ~sqrt(2 * 512) = 32 tokens (6%), max over 8 experts x 2 layers.
    late, late_ent = mom[settled:], ent[settled:]
    assert np.median(late) < 1.15 and late.max() < 1.3 and late_ent.min() > 0.995, (ki, mom)


def test_quantile_integral_adds_the_running_sum_of_the_solved_shifts():
  """`quantile_integral` ki: b <- b + (1 - ema) d + ki I with I <- I + d (d the full histogram
  shift), I carried in the controller state's `integral`; a skipped step changes neither."""
  probs = skewed_probs(jax.random.key(3), n=1024)
  valid = jnp.ones((1024,), bool)
  cfg = BalanceConfig(mode="quantile", quantile_integral=0.2)
  state = B.init_balance_state(L, X)
  prior = jnp.zeros((L, X)).at[:, :E].set(jnp.linspace(-0.01, 0.01, E))
  state = dict(state, integral=prior)
  d = histogram_biases(probs, valid, B0, None) - B0
  b, st = B.quantile_step(cfg, B0, state, probs, valid)
  np.testing.assert_allclose(st["integral"], prior + d, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(b, B0 + 0.5 * d + 0.2 * (prior + d), rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(b)[:, -1], -1.0)  # the skip bias stays
  b, st = B.quantile_step(cfg, B0, state, probs, valid, jnp.bool_(False))
  np.testing.assert_array_equal(b, B0)
  np.testing.assert_array_equal(st["integral"], prior)
  # ki = 0 (no integral) leaves the state alone.
  _, st = B.quantile_step(BalanceConfig(mode="quantile", quantile_integral=0.0), B0, state,
                          probs, valid)
  np.testing.assert_array_equal(st["integral"], prior)


def drifting_share_error(cfg: BalanceConfig, steps: int = 60, drift: float = 0.03,
                         n: int = N) -> np.ndarray:
  """Per step, expert 0's share of the expert tokens minus 1/E (layer mean) [steps], when the
  router's preference for experts 0 and 1 grows by `drift` logits every step (a router that
  keeps learning against the biases), the biases updated after each step by `cfg`."""
  valid = jnp.ones((n,), bool)
  router = jax.random.key(7)

  def body(carry, inputs):
    b_LX, st = carry
    t, token_key = inputs
    probs = skewed_probs(router, n=n, favour=1.0 + drift * t, token_key=token_key)
    counts = route_counts(probs, valid, b_LX).astype(jnp.float32)
    share = counts[:, 0] / jnp.sum(counts[:, :E], axis=-1)
    b_LX, st = B.quantile_step(cfg, b_LX, st, probs, valid)
    return (b_LX, st), jnp.mean(share) - 1.0 / E

  keys = jax.random.split(jax.random.key(8), steps)
  _, err = jax.jit(lambda: jax.lax.scan(
      body, (B0, B.init_balance_state(L, X)), (jnp.arange(steps, dtype=jnp.float32), keys)))()
  return np.asarray(err)


@pytest.mark.slow
def test_quantile_integral_removes_the_lag_behind_a_drifting_router():
  """A lagged rule behind a router that drifts at a constant rate: the EMA step alone (a type-1
  loop) holds a constant overload of the favoured experts; with the integral (type 2) it
  decays to the sampling noise."""
  lag = drifting_share_error(BalanceConfig(mode="quantile", quantile_integral=0.0))  # no integral
  pi = drifting_share_error(BalanceConfig(mode="quantile", quantile_integral=0.15))
  print(f"expert 0 share error, steps 30-60: EMA alone {lag[30:].mean():+.4f}, "
        f"with integral {pi[30:].mean():+.4f} (target share {1 / E:.3f})")
  assert lag[30:].mean() > 0.004  # a persistent overload of the drifting expert
  assert abs(pi[30:].mean()) < 0.25 * lag[30:].mean()


def test_gap_histogram_and_quantile_match_a_numpy_reference():
  """`gap_histogram` bins every valid token's score gap (own score minus the best other
  class's) per layer and class like np.searchsorted; `gap_quantile` returns a shift with the
  target count of gaps above it, up to the tokens of the bin it interpolates in."""
  probs = skewed_probs(jax.random.key(4), n=512)
  valid = jnp.ones((512,), bool).at[-20:].set(False)
  biases = B0.at[:, :E].set(jnp.linspace(-0.05, 0.05, E))
  hist = np.asarray(gap_histogram(probs, valid, biases))
  scores = np.asarray(probs, np.float64) + np.asarray(biases)[:, None, :]
  edges = np.asarray(GAP_EDGES)
  for l in range(L):
    for x in range(X):
      other = np.max(np.delete(scores[l], x, axis=-1), axis=-1)
      gaps = (scores[l, :, x] - other).astype(np.float32)[np.asarray(valid)]
      want = np.bincount(np.searchsorted(edges, gaps, side="right"), minlength=len(edges) + 1)
      np.testing.assert_array_equal(hist[l, x], want, err_msg=f"layer {l} class {x}")
      # Tokens routed to x (gap > 0) are the counts of the bins above the edge at 0.
      np.testing.assert_array_equal(
          hist[l, x, len(edges) // 2 + 1:].sum(),
          np.asarray(route_counts(probs, valid, biases))[l, x])
  target = jnp.full((L, X), 60.0)
  delta = np.asarray(gap_quantile(jnp.asarray(hist), target))
  for l in range(L):
    for x in range(X):
      other = np.max(np.delete(scores[l], x, axis=-1), axis=-1)
      gaps = (scores[l, :, x] - other)[np.asarray(valid)]
      above = int(np.sum(gaps > delta[l, x]))
      j = np.searchsorted(edges, delta[l, x], side="right")
      assert abs(above - 60) <= hist[l, x, j], (l, x, above, delta[l, x])


@pytest.mark.slow
def test_histogram_steps_on_one_batch_converge_to_the_targets():
  """Repeated half steps of `histogram_biases` on one batch reach the exact solve's balance
  (every expert within 2% of its share), keep the skip bias and centre the expert biases;
  a skip target is met too."""
  probs = skewed_probs(jax.random.key(5), n=N)
  valid = jnp.ones((N,), bool)
  step = jax.jit(histogram_biases, static_argnums=(3, 4, 5))
  b = step(probs, valid, B0, None, 12, 0.5)
  counts = np.asarray(route_counts(probs, valid, b))
  assert np.abs(counts[:, :E] / (N / E) - 1).max() < 0.02, counts
  np.testing.assert_array_equal(np.asarray(b)[:, -1], -1.0)
  np.testing.assert_allclose(np.asarray(b)[:, :E].mean(-1), 0.0, atol=1e-6)
  b = step(probs, valid, B0, 0.25, 12, 0.5)
  counts = np.asarray(route_counts(probs, valid, b))
  assert np.abs(counts[:, E] / 1024 - 1).max() < 0.02, counts
  assert np.abs(counts[:, :E] / 384 - 1).max() < 0.03, counts
  # No valid token: the biases stay.
  np.testing.assert_array_equal(step(probs, jnp.zeros((N,), bool), B0, None, 1, 1.0), B0)


@pytest.mark.slow
def test_adamw_balances_a_skewed_router():
  cfg = BalanceConfig(mode="adamw")
  mom, ent, b = simulate(cfg, steps=150, n=16384)  # 2048 tokens per expert: noise ~3%
  settled = settle_step(mom)
  print(f"adamw (lr {cfg.adamw_lr}): max/mean {mom[0]:.2f} -> <1.1 from step {settled}; "
        f"last 50 <= {mom[-50:].max():.3f}; entropy {ent[-50:].min():.4f}")
  assert mom[0] > 2.0
  assert settled is not None and settled <= 80, mom
  assert mom[-50:].max() < 1.1 and ent[-50:].min() > 0.99
  np.testing.assert_array_equal(b[:, -1], -1.0)  # skip bias fixed (no skip_target)
  np.testing.assert_allclose(b[:, :E].mean(axis=1), 0.0, atol=1e-5)  # centred updates


def test_adamw_update_is_optax_adamw_on_the_routed_share_minus_uniform():
  cfg = BalanceConfig(mode="adamw", adamw_lr=0.05, adamw_b1=0.5, adamw_b2=0.9,
                      adamw_weight_decay=0.1, skip_target=0.1)
  counts = jnp.array([[6.0, 2.0, 0.0, 0.0, 2.0]])  # E = 4: 8 expert tokens of 10
  b0 = jnp.array([[0.1, -0.2, 0.0, 0.3, -1.0]])
  st = B.init_balance_state(1, 5)
  b, st = B.controller_step(cfg, b0, st, counts)
  b, st = B.controller_step(cfg, b, st, counts)
  grad = np.array([[0.75 - 0.25, 0.0, -0.25, -0.25, 0.2 - 0.1]])  # share - target
  tx = optax.adamw(0.05, b1=0.5, b2=0.9, eps=1e-8, weight_decay=0.1)
  want, ost = np.asarray(b0), tx.init(jnp.asarray(b0))
  for _ in range(2):
    u, ost = tx.update(jnp.asarray(grad), ost, jnp.asarray(want))
    u = np.array(u)
    u[:, :4] -= u[:, :4].mean()  # centred expert updates
    want = want + u
  np.testing.assert_allclose(np.asarray(b), want, rtol=1e-5, atol=1e-7)
  assert int(st["adamw"][0].count) == 2


def test_config_rejects_bad_mode_settings():
  with pytest.raises(ConfigError, match="balance.mode"):
    BalanceConfig(mode="sinkhorn")
  with pytest.raises(ConfigError, match="balance.adamw_b2"):
    BalanceConfig(adamw_b2=1.0)
  with pytest.raises(ConfigError, match="balance.quantile_ema"):
    BalanceConfig(quantile_ema=-0.1)
  with pytest.raises(ConfigError, match="balance.quantile_sweeps"):
    BalanceConfig(quantile_sweeps=0)
  with pytest.raises(ConfigError, match="balance.adamw_eps"):
    BalanceConfig(adamw_eps=0.0)
  with pytest.raises(ConfigError, match="balance.quantile_reroute"):
    BalanceConfig(quantile_reroute=1)
  for bad in (1.5, -0.5, True, "1"):
    with pytest.raises(ConfigError, match=r"balance.rate_lr_power=.* must be a number in \[0, 1\]"):
      BalanceConfig(rate_lr_power=bad)


# Balancing on meshes (multidevice: 8 fake CPU devices). For each mode ("quantile_current":
# quantile with `quantile_apply="current"`, "quantile_reroute": with `quantile_reroute`), a tiny model trains `MESH_STEPS` steps on one
# device, on meshes (data, fsdp, expert) = (1, 1, 8) and (2, 1, 4), and on one device with
# `train.grad_accum_steps=2`, on the same batches, with the step training compiles
# (`setup_training`); the per-step routing counts and biases are compared with one device's.
MESH_STEPS = 3
MESH_LAYOUTS = {"1 device": (MeshConfig(1, 1, 1), 1, 1), "(1,1,8)": (MeshConfig(1, 1, 8), 8, 1),
                "(2,1,4)": (MeshConfig(2, 1, 4), 8, 1),
                "1 device, accum 2": (MeshConfig(1, 1, 1), 1, 2)}


def mesh_batches() -> list[dict[str, np.ndarray]]:
  """`MESH_STEPS` numpy batches of 8 x 16 tokens with documents and padding."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(MESH_STEPS):
    parts = [random_batch(rng, b=2, t=16) for _ in range(4)]
    out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
  return out


def train_on_layout(mode: str, mesh_cfg: MeshConfig, devices: int, accum: int) -> dict:
  """`{"counts": [steps, L, X] routed non-padding tokens, "biases": [steps, L, X] after each
  update}` (numpy float) of `MESH_STEPS` training steps of balancing `mode`."""
  model_cfg = dataclasses.replace(tiny_model_config(), num_experts=8)
  train_cfg = TrainConfig(num_steps=10, warmup_steps=1, lr=3e-2, batch_size=8, seq_len=16,
                          grad_accum_steps=accum)
  apply = "current" if mode == "quantile_current" else "next"
  balance = BalanceConfig(mode=mode.split("_")[0], adamw_lr=3e-2, quantile_apply=apply,
                          quantile_reroute=mode == "quantile_reroute")
  mesh = make_mesh(mesh_cfg, jax.devices()[:devices])
  with use_mesh(mesh):
    built = setup_training(model_cfg, train_cfg, mesh, balance)
    state = init_train_state(model_cfg, built.tx, train_cfg.seed, mesh)
    counts, biases = [], []
    for batch in mesh_batches():
      tokens = float((batch["segment_ids"] > 0).sum())
      state, m = built.step(state, global_batch(batch, built.data_sharding))
      counts.append(np.rint(np.asarray(m["expert_load"]) * tokens))
      biases.append(np.asarray(B.get_biases(state.model_state)))
  return {"counts": np.stack(counts), "biases": np.stack(biases)}


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mode", ["quantile", "quantile_reroute", "adamw", "quantile_current"])
def test_counts_and_biases_equal_on_meshes_and_with_grad_accumulation(mode):
  """Routing counts every step equal exactly on 1 device, meshes (1,1,8) and (2,1,4) and
  with 2 micro-batches (and, for "quantile", on (data 2, expert 2, context 2)). "adamw" biases depend on the counts only: equal bit for bit.
  "quantile" biases are midpoints between two tokens' margins, and the router
  probabilities themselves differ by float32 rounding between layouts (XLA:CPU blocks the
  router matmuls by the per-device batch), and each step's training moves them apart a
  little more: equal to 1e-5 (observed <= 2.3e-6 after 3 steps).
  "quantile_reroute" re-scores the batch's stored router inputs (sharded like the batch)
  with the updated router, whose parameters differ between layouts by the gradients'
  summation order: the rerouted probabilities differ by up to ~5e-6, and a token whose gap
  lies that close to a histogram bin edge lands in the next bin, which moves its class's
  interpolated quantile by (bin width) / (tokens in the bin), a few 1e-4 at these 104 tokens
  per step (5.2e-4 once in 3 steps: on (1,1,8) under the suite's XLA flags, on the
  2-micro-batch run under the default flags; 0 on every other layout): within 1e-3, with
  the counts exact.
  "quantile_current" solves each micro-batch for itself, so with 2 micro-batches its counts
  are the sum of two even splits of 52 tokens (6 or 7 per expert, +-1 each): within 4."""
  layouts = dict(MESH_LAYOUTS)
  if mode in ("quantile", "quantile_reroute"):  # its histogram masks padding with the
    # batch's segment ids, which must follow the model's zigzag token order under context
    # parallelism
    layouts["(2,1,2,2) context 2"] = (MeshConfig(2, 1, 2, 2), 8, 1)
  runs = {name: train_on_layout(mode, *layout) for name, layout in layouts.items()}
  ref = runs["1 device"]
  assert len(np.unique(np.asarray(ref["counts"])[-1, 0])) > 2  # several classes chosen
  if mode == "quantile_current":
    accum = np.asarray(runs.pop("1 device, accum 2")["counts"])[:, :, :-1]
    assert np.all(accum.max(-1) - accum.min(-1) <= 4)
  for name, got in runs.items():
    np.testing.assert_array_equal(got["counts"], ref["counts"], err_msg=name)
    if mode == "adamw":
      np.testing.assert_array_equal(got["biases"], ref["biases"], err_msg=name)
    else:
      atol = 1e-3 if mode == "quantile_reroute" else 1e-5
      np.testing.assert_allclose(got["biases"], ref["biases"], rtol=0, atol=atol, err_msg=name)
  if mode == "quantile_current":  # every step's routing was solved for that step's batch
    counts = np.asarray(ref["counts"])[:, :, :-1]
    assert np.all(counts.max(-1) - counts.min(-1) <= 2)


@pytest.mark.slow
@pytest.mark.usefixtures("default_xla_optimizations")  # 200 steps: -O2 runs a step 2.5x faster
def test_default_mode_recovers_from_a_collapse_on_the_tiny_config(tmp_path):
  """zaya1_tiny with `train.warmup_steps=1` (the setting that put every layer's tokens on
  one expert by step 10 under the old PID controller): by step 200 the default (causal)
  balancing (`quantile`, EMA 0.5, `quantile_reroute`, `train.router_lr_scale=0.1`) holds the
  normalised entropy of every layer's load summed over the 16 steps 185-200 (32K tokens)
  >= 0.95 (issue 22's target). Until 2026-12-06 the test stopped at step 100 to keep the
  suite short (issue 24) and asserted the same of steps 85-100: the default passed there
  with 0.9523 on its worst layer on one CPU and failed with 0.920 on another (the
  trajectory is chaotic, and the CLI runs below are under 0.95 at step 100 too), so the
  test runs the whole 200-step schedule and checks the target itself.
  With the tiny config's experts at half the learning rate (`train.expert_lr_scale=0.5`,
  2026-12-07) this test's lowest layer was at 0.914 over steps 85-100 and 0.998 over 185-200.
  Measured on the 200-step CLI runs, lowest layer's window entropy for windows ending at
  steps 100 / 120 / 160 / 200 (experts at the full rate):
    the default (2026-12-06), seed 0: 0.919 / 0.972 / 0.977 / 0.993; seed 1: 0.858 / 0.935 /
      0.971 / 0.995 (the CLI's XLA flags differ from the suite's: another trajectory);
    the 2026-12-03 default (no reroute, integral 0.15), seed 0: 0.987 / 0.989 / 0.978 / 0.997; seed 1: 0.952 / 0.962 / 0.914 / 0.986;
    the previous default (`quantile_integral=0`, `router_lr_scale=1`), seed 0: 0.793 / 0.893
      / 0.971 / 0.976; seed 1: 0.781 / 0.904 / 0.856 / 0.985 (it failed the step-100 check and
      passes this one: the slower recovery is the README's to report, not this test's);
    `balance.mode="pid"` (the old controller, router_lr_scale 1), seed 0: 0.512 / 0.696 at steps
      100 / 120.
  With balancing off every layer's load stays on one expert (entropy ~0): the test fails.
  A causal rule's per-step load carries the batch-to-batch noise of 8 rows
  (`launch.balance_floor`), so the window is the measure (issue 22's target). (With 10x the
  learning rate as well the router's softmax saturates to exactly one-hot within ~10 steps;
  identical probabilities cannot be split by any bias: README "Load balancing".)"""
  workdir = tmp_path / "run"
  config = zaya1_tiny.get_config()  # in-process: what `python -m launch.train` runs
  t = config.train
  t.num_steps, t.warmup_steps, t.log_every, t.eval_every, t.eval_batches = 200, 1, 1, 0, 0
  config.checkpoint.every_steps = 0
  run(config, str(workdir))
  with open(workdir / "metrics.jsonl") as f:
    rows = {r["step"]: r for r in map(json.loads, f) if r["kind"] == "train"}

  def window_entropy(last):
    load = np.sum([np.asarray(rows[s]["expert_load"])[:, :-1] for s in range(last - 15, last + 1)],
                  axis=0)
    share = load / load.sum(-1, keepdims=True)
    return -np.sum(share * np.log(np.where(share > 0, share, 1.0)), -1) / np.log(share.shape[-1])

  for last in (100, 200):
    print(f"windowed load entropy per layer, steps {last - 15}-{last}:",
          window_entropy(last).round(4).tolist())
  entropy = window_entropy(200)
  assert entropy.shape == (4,) and np.all(entropy >= 0.95), entropy


def test_rate_lr_power_scales_each_bias_update_by_the_lr_over_its_peak():
  """`balance.rate_lr_power` p: the factor is 1 through the warm-up, then (the AdamW group's
  lr over `train.lr`) ** p (`min_lr_ratio` ** p at the horizon); in the compiled training
  step with p = 1 the biases move by that factor times the update the controller computes
  (the run without the option, from the same state), and nothing else changes."""
  train_cfg = TrainConfig(num_steps=4, warmup_steps=1, lr=3e-2, batch_size=8, seq_len=16)
  lr = make_schedule(train_cfg)
  for power in (1.0, 0.5):
    rate = balance_rate_schedule(train_cfg, power)
    factors = [float(rate(s)) for s in range(5)]
    assert factors[0] == 1.0
    np.testing.assert_allclose(factors[1:], [(float(lr(s)) / 3e-2) ** power for s in range(1, 5)],
                               rtol=1e-6)
    assert 0.5 < factors[1] < 1.0
    assert factors[4] == pytest.approx(train_cfg.min_lr_ratio ** power)
  factor = float(balance_rate_schedule(train_cfg, 1.0)(1))
  model_cfg = dataclasses.replace(tiny_model_config(), num_experts=8)
  mesh = make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])
  biases = {}
  with use_mesh(mesh):
    for power in (0.0, 1.0):
      built = setup_training(model_cfg, train_cfg, mesh, BalanceConfig(rate_lr_power=power))
      state = init_train_state(model_cfg, built.tx, train_cfg.seed, mesh)
      seen = [np.asarray(B.get_biases(state.model_state))]
      for batch in mesh_batches()[:2]:
        state, _ = built.step(state, global_batch(batch, built.data_sharding))
        seen.append(np.asarray(B.get_biases(state.model_state)))
      biases[power] = seen
  full, follow = biases[0.0], biases[1.0]
  np.testing.assert_array_equal(follow[1], full[1])  # step 0 is in the warm-up: factor 1
  assert np.abs(full[2] - full[1]).max() > 1e-3  # the second update moves the biases
  np.testing.assert_allclose(follow[2] - follow[1], factor * (full[2] - full[1]),
                             rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["quantile", "pid"])
def test_exclude_layers_keep_their_biases_and_the_others_move_as_without(mode):
  """`balance.exclude_layers`: the named layers' biases stay where they are (their routing
  is free, as with balancing off); every other layer's update is bit-identical to the
  update without the option."""
  from flax import nnx
  from zaya_jax.model.transformer import create_model
  cfg = dataclasses.replace(tiny_model_config(), num_experts=E)
  _, _, rest = nnx.split(create_model(cfg, seed=0), nnx.Param, ...)
  n_layers, m = cfg.num_layers, 256
  assert n_layers >= 2
  logits = jax.random.normal(jax.random.key(1), (n_layers, m, X)) + jnp.zeros((X,)).at[0].set(2.0)
  probs_LMX = jax.nn.softmax(logits, -1)
  counts_LX = jax.nn.one_hot(jnp.argmax(probs_LMX, -1), X).sum(1)
  valid_M = jnp.ones((m,), bool)
  state = B.init_balance_state(n_layers, X)
  before = B.get_biases(rest)

  def update(exclude):
    bal = BalanceConfig(mode=mode, exclude_layers=exclude)
    new, _ = B.update_model_state(bal, rest, state, counts_LX, True, probs_LMX, valid_M)
    return np.asarray(B.get_biases(new))

  free, excluded = update(()), update((0,))
  assert np.abs(free[0] - np.asarray(before[0])).max() > 1e-3  # the rule moves layer 0 ...
  np.testing.assert_array_equal(excluded[0], np.asarray(before[0]))  # ... unless excluded
  np.testing.assert_array_equal(excluded[1:], free[1:])


def test_exclude_layers_config_errors_name_the_field():
  assert BalanceConfig(exclude_layers=[2, 0]).exclude_layers == (2, 0)  # JSON's list
  for bad in ((0, 0), (-1,), (0.5,), (True,), 3):
    with pytest.raises(ConfigError, match=r"balance.exclude_layers=.* must be a tuple of distinct"):
      BalanceConfig(exclude_layers=bad)
  from zaya_jax.config import resolve
  config = zaya1_tiny.get_config()
  config.balance.exclude_layers = (4,)
  with pytest.raises(ConfigError, match=r"balance.exclude_layers=\(4,\) names a layer the model "
                     r"lacks; model.num_layers=4, so use indices 0..3"):
    resolve(config)
