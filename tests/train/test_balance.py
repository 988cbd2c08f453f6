"""Balancing-bias controller (zaya_jax/train/balance.py): convergence on a synthetic skewed
router, the skip class, the off switches, and one real train step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zaya_jax.config import BalanceConfig, ConfigError, TrainConfig
from zaya_jax.train import balance as B
from zaya_jax.train import init_train_state, make_optimizer, make_schedule, train_step
from zaya_jax.train.state import abstract_model

from tests.helpers import random_batch, tiny_model_config

L, E, F, N = 2, 8, 16, 16384  # layers, experts, token features, tokens per step
X = E + 1


def simulate(cfg: BalanceConfig, steps: int, seed: int = 0, favour: float = 1.0):
  """Routes fresh random tokens with a fixed, skewed router for `steps` steps, updating the
  biases after each step. Returns (max/mean expert load per step [steps] (max over layers),
  final biases [L, X], skip rate per step [steps, L])."""
  kw, kx = jax.random.split(jax.random.key(seed))
  w_LFX = 0.1 * jax.random.normal(kw, (L, F, X))
  favour_X = jnp.zeros((X,)).at[:2].set(favour)  # experts 0 and 1 get most of the tokens

  def body(carry, key):
    b_LX, st = carry
    x_LNF = jax.random.normal(key, (L, N, F))
    p_LNX = jax.nn.softmax(jnp.einsum("lnf,lfx->lnx", x_LNF, w_LFX) + favour_X, -1)
    c_LN = jnp.argmax(p_LNX + b_LX[:, None, :], -1)
    counts_LX = jax.vmap(lambda c: jnp.zeros((X,)).at[c].add(1.0))(c_LN)
    stats = B.load_stats(counts_LX)
    b_LX, st = B.controller_step(cfg, b_LX, st, counts_LX)
    return (b_LX, st), (jnp.max(stats["max_over_mean"]), stats["skip_rate"])

  b0 = jnp.zeros((L, X)).at[:, -1].set(-1.0)
  (b, _), (mom, skip) = jax.jit(lambda: jax.lax.scan(
      body, (b0, B.init_balance_state(L, X)), jax.random.split(kx, steps)))()
  return np.asarray(mom), np.asarray(b), np.asarray(skip)


def settle_step(mom: np.ndarray, threshold: float = 1.1) -> int | None:
  """First step from which max/mean stays below `threshold` to the end."""
  above = np.nonzero(mom >= threshold)[0]
  return 0 if above.size == 0 else (int(above[-1]) + 1 if above[-1] + 1 < len(mom) else None)


@pytest.mark.slow
def test_pid_default_gains_balance_a_skewed_router():
  mom, b, _ = simulate(BalanceConfig(mode="pid"), steps=150)
  assert mom[0] > 3.0  # two experts take most of the tokens at the start
  settled = settle_step(mom)
  print(f"pid (kp=0.02): max/mean {mom[0]:.2f} -> <1.1 from step {settled}; last 50 <= {mom[-50:].max():.3f}")
  assert settled is not None and settled <= 100, mom
  assert mom[-50:].max() < 1.1
  np.testing.assert_array_equal(b[:, -1], -1.0)  # skip_target off: skip bias untouched
  assert np.all(b[:, :2] < b[:, 2:E].min(axis=1, keepdims=True))  # favoured experts pushed down
  np.testing.assert_allclose(b[:, :E].mean(axis=1), 0.0, atol=1e-5)  # centred expert updates


def test_sign_mode_balances_a_skewed_router():
  # The sign rule moves every bias by +-rate each step, so it dithers with amplitude ~rate
  # around the balance point: it needs a small rate, hence a milder skew to converge quickly.
  mom, b, _ = simulate(BalanceConfig(mode="sign", rate=5e-4), steps=150, favour=0.1)
  assert mom[0] > 2.0
  settled = settle_step(mom)
  print(f"sign (rate=5e-4): max/mean {mom[0]:.2f} -> <1.1 from step {settled}; last 50 <= {mom[-50:].max():.3f}")
  assert settled is not None and settled <= 100, mom
  assert mom[-50:].max() < 1.1
  np.testing.assert_array_equal(b[:, -1], -1.0)


def test_skip_target_steers_the_skip_rate():
  mom, b, skip = simulate(BalanceConfig(mode="pid", kp=0.1, skip_target=0.2), steps=150)  # from bias -1
  assert np.all(b[:, -1] > -1.0)  # the skip class had to be raised from ~0 skips
  np.testing.assert_allclose(skip[-20:].mean(axis=0), 0.2, atol=0.03)


def test_error_definition_and_empty_layers():
  counts = jnp.array([[6.0, 2.0, 0.0, 0.0, 2.0],  # 8 expert tokens of 10, E = 4
                      [0.0, 0.0, 0.0, 0.0, 0.0]])  # all padding: no error
  err = np.asarray(B.balance_error(counts, skip_target=0.5))
  np.testing.assert_allclose(err[0], [0.25 - 0.75, 0.0, 0.25, 0.25, 0.5 - 0.2], atol=1e-6)
  np.testing.assert_array_equal(err[1], 0.0)
  np.testing.assert_array_equal(np.asarray(B.balance_error(counts, None))[:, -1], 0.0)
  np.testing.assert_array_equal(np.asarray(B.balance_error(counts, -1.0))[:, -1], 0.0)


def test_load_stats_values_including_one_expert():
  # 2 layers x (3 experts + skip): [6, 2, 0 | 2] and [0, 0, 0 | 4] (every token skips).
  stats = B.load_stats(jnp.array([[6.0, 2.0, 0.0, 2.0], [0.0, 0.0, 0.0, 4.0]]))
  np.testing.assert_allclose(stats["max_over_mean"], [6.0 / (8.0 / 3.0), 1.0], rtol=1e-6)
  q = np.array([0.75, 0.25])
  np.testing.assert_allclose(stats["load_entropy"], [-(q * np.log(q)).sum() / np.log(3.0), 1.0],
                             rtol=1e-6)
  np.testing.assert_allclose(stats["skip_rate"], [0.2, 1.0], rtol=1e-6)
  # One expert (a dense model, E = 1): ln E = 0, the load is even; not 0/0 = nan.
  dense = B.load_stats(jnp.array([[7.0, 1.0], [0.0, 3.0]]))
  np.testing.assert_array_equal(dense["load_entropy"], [1.0, 1.0])
  np.testing.assert_array_equal(dense["max_over_mean"], [1.0, 1.0])


def test_pid_terms_integral_clamp_and_bias_clamp():
  cfg = BalanceConfig(mode="pid", kp=0.1, ki=0.01, kd=0.5, integral_clamp=0.3, bias_clamp=0.05)
  counts = jnp.array([[4.0, 0.0, 0.0, 0.0, 0.0]])  # e = [-0.75, 0.25, 0.25, 0.25, 0]
  st = B.init_balance_state(1, 5)
  b, st = B.controller_step(cfg, jnp.zeros((1, 5)), st, counts)
  e = np.array([-0.75, 0.25, 0.25, 0.25])
  i = np.clip(e, -0.3, 0.3)
  want = cfg.kp * e + cfg.ki * i + cfg.kd * e
  want = np.clip(want - want.mean(), -0.05, 0.05)
  np.testing.assert_allclose(np.asarray(b)[0, :4], want, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(st["integral"])[0, :4], i, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(st["prev_error"])[0, :4], e, rtol=1e-6)
  assert float(b[0, 4]) == 0.0


def test_disabled_or_skipped_step_changes_nothing():
  counts = jnp.array([[9.0, 1.0, 0.0, 0.0, 5.0]])
  b0 = jnp.array([[0.1, -0.2, 0.0, 0.3, -1.0]])
  st0 = {**B.init_balance_state(1, 5), "integral": jnp.full((1, 5), 0.1),
         "prev_error": jnp.full((1, 5), -0.1)}
  for cfg, apply in ((BalanceConfig(mode="pid", enabled=False, skip_target=0.1), True),
                     (BalanceConfig(mode="pid", skip_target=0.1), jnp.bool_(False)),
                     (BalanceConfig(mode="adamw", skip_target=0.1), jnp.bool_(False))):
    b, st = B.controller_step(cfg, b0, st0, counts, apply)
    np.testing.assert_array_equal(b, b0)
    jax.tree.map(np.testing.assert_array_equal, st, st0)


def test_config_errors_name_the_field():
  with pytest.raises(ConfigError, match="balance.mode"):
    BalanceConfig(mode="aux")
  with pytest.raises(ConfigError, match="balance.kp"):
    BalanceConfig(kp=-1.0)
  with pytest.raises(ConfigError, match="balance.integral_clamp"):
    BalanceConfig(integral_clamp=0.0)
  with pytest.raises(ConfigError, match="balance.skip_target"):
    BalanceConfig(skip_target=1.5)


@pytest.fixture(scope="module")
def tiny():
  model_cfg = tiny_model_config()
  train_cfg = TrainConfig(num_steps=10, warmup_steps=2, lr=1e-2, batch_size=2, seq_len=12)
  graphdef, params_shape, _ = abstract_model(model_cfg, seed=0)
  tx = make_optimizer(train_cfg, params_shape)
  state = init_train_state(model_cfg, tx, seed=0)
  cfg = BalanceConfig(mode="pid", router_z_loss=1e-3, load_balance_loss=1e-2)
  step = jax.jit(lambda s, b, p: train_step(graphdef, tx, make_schedule(train_cfg), s, b, p,
                                            balance=cfg))
  return model_cfg, state, step


@pytest.mark.slow
def test_train_step_moves_biases_against_the_load(tiny):
  model_cfg, state, step = tiny
  l, x = model_cfg.num_layers, model_cfg.num_router_classes
  assert state.balance["integral"].shape == (l, x)
  assert state.balance["prev_error"].shape == (l, x)
  b0 = np.asarray(B.get_biases(state.model_state))
  batch = random_batch(np.random.default_rng(2))
  new, m = step(state, batch, np.bool_(False))
  b1 = np.asarray(B.get_biases(new.model_state))
  np.testing.assert_array_equal(np.asarray(m["balance/biases"]), b1)
  load = np.asarray(m["expert_load"])[:, :-1]
  share = load / load.sum(-1, keepdims=True)
  delta = b1[:, :-1] - b0[:, :-1]
  # The most loaded expert of every layer goes down, the least loaded goes up.
  rows = np.arange(l)
  assert np.all(delta[rows, share.argmax(-1)] < 0) and np.all(delta[rows, share.argmin(-1)] > 0)
  np.testing.assert_array_equal(b1[:, -1], b0[:, -1])  # skip_target off
  err = np.asarray(new.balance["prev_error"])[:, :-1]
  np.testing.assert_allclose(err, 1.0 / model_cfg.num_experts - share, atol=1e-6)
  mom = np.asarray(m["balance/max_over_mean"])
  np.testing.assert_allclose(mom, share.max(-1) * model_cfg.num_experts, rtol=1e-5)
  assert float(m["balance/max_over_mean_max"]) == pytest.approx(mom.max())
  ent = np.asarray(m["router/entropy"])
  assert ent.shape == (l,) and np.all(ent > 0) and np.all(ent <= np.log(x) + 1e-5)
  assert np.isfinite(float(m["router/z_loss"])) and float(m["router/load_balance_loss"]) > 0
  assert np.asarray(m["balance/skip_rate"]).shape == (l,)

  # A skipped (non-finite) step moves neither the biases nor the controller state.
  bad, mb = step(new, batch, np.bool_(True))
  assert float(mb["skipped"]) == 1.0
  np.testing.assert_array_equal(np.asarray(B.get_biases(bad.model_state)), b1)
  jax.tree.map(np.testing.assert_array_equal, bad.balance, new.balance)


def test_state_without_controller_state_gets_zeros(tiny):
  """A TrainState built without controller state (e.g. launch.convert_from_hf) starts from
  zeros of shape [L, X] (traced only: no compile)."""
  model_cfg, state, _ = tiny
  train_cfg = TrainConfig(num_steps=10, warmup_steps=2, lr=1e-2, batch_size=2, seq_len=12)
  graphdef, params_shape, _ = abstract_model(model_cfg, seed=0)
  tx = make_optimizer(train_cfg, params_shape)
  legacy = dataclasses.replace(state, balance=None)
  new, _ = jax.eval_shape(lambda s, b: train_step(graphdef, tx, make_schedule(train_cfg), s, b,
                                                  balance=BalanceConfig()),
                          legacy, random_batch(np.random.default_rng(3)))
  assert new.balance["integral"].shape == (model_cfg.num_layers, model_cfg.num_router_classes)


@pytest.mark.slow
@pytest.mark.parametrize("router_init,mode", [("fan_in", "pid"), ("fan_in", "quantile"),
                                              ("fan_in", "adamw"), ("normal", "pid"),
                                              ("normal", "quantile")])
def test_fresh_model_router_can_be_balanced_only_with_fan_in_init(router_init, mode):
  """The balancing rule on a real, freshly initialised (frozen) model, fresh random bytes
  each step. With `router_init="fan_in"` the router's probabilities differ between tokens,
  so the biases split them: max/mean load falls from its initial value to < 1.5 (per-step
  sampling noise over 512 tokens per layer is ~1.2). With "normal" (HF's initializer_range
  0.02 on all three router layers) every token gets the same probabilities to ~1e-5, so
  each layer sends all its tokens to one expert whatever the PID's biases (max/mean = E);
  the quantiles of "quantile" (its histogram bins start at 1e-5 from the boundary) still
  split such tokens (< 1.5 there too)."""
  from zaya_jax.model.transformer import create_model
  from flax import nnx
  cfg = dataclasses.replace(tiny_model_config(), num_experts=8, router_init=router_init)
  graphdef, params, rest = nnx.split(create_model(cfg, seed=0), nnx.Param, ...)

  @jax.jit
  def counts(params, rest, ids):
    _, aux = nnx.merge(graphdef, params, rest)(ids, return_aux=True)
    return aux["expert_counts"], aux["router_probs"]

  rng = np.random.default_rng(0)
  bal, state, loads = BalanceConfig(mode=mode), B.init_balance_state(cfg.num_layers, 9), []
  valid = jnp.ones((4 * 128,), bool)
  update = jax.jit(lambda rest, state, c, probs: B.update_model_state(bal, rest, state, c, True,
                                                                      probs, valid))
  for _ in range(40):
    c, probs = counts(params, rest, jnp.asarray(rng.integers(3, 259, (4, 128))))
    loads.append(float(jnp.max(B.load_stats(c)["max_over_mean"])))
    rest, state = update(rest, state, c, probs)
  late = float(np.mean(loads[-10:]))
  print(f"{router_init} {mode}: max/mean {loads[0]:.2f} -> {late:.2f} (mean of the last 10)")
  if router_init == "fan_in" or mode == "quantile":
    assert late < 1.5, loads
  else:
    assert late > 7.0, loads
