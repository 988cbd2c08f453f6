"""Optimizer groups (Muon / AdamW), Muon's update per matrix, WSD schedule, config errors.

- every parameter of the tiny model lands in the intended group, with and without
  `train.muon_router`, and Muon's matrix axes come from the logical axis names;
- Muon's update of stacked weights ([L, E, D, F] experts, [L, N, H, D] o_proj) equals Nesterov
  momentum + Newton-Schulz orthogonalisation of each layer's/expert's matrix written out here
  in numpy (the same coefficients and shape scaling as optax), over two steps, with weight
  decay; AdamW still trains the vectors;
- WSD schedule values at the phase boundaries (linear and 1-sqrt decay), scaled per group;
- invalid optimizer/schedule fields fail naming the field;
- a real train step with `optimizer="muon"` changes every parameter and keeps the loss finite.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import zaya1_tiny
from tests.helpers import random_batch, tiny_model_config
from zaya_jax.config import ConfigError, TrainConfig, resolve
from zaya_jax.train import init_train_state, train_step
from zaya_jax.train.optim import (describe_optimizer, make_optimizer, make_schedule,
                                  param_groups, update_or_skip)
from zaya_jax.train.state import abstract_model

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # optax.contrib.muon's default ("standard") quintic


@pytest.fixture(scope="module")
def tiny_params():
  return abstract_model(tiny_model_config(), seed=0)[1]


# --- groups ----------------------------------------------------------------------------------

ALWAYS_MUON = {  # path: (reduction axes, output axes) of the stored array
    "layers/self_attn/q_proj": ((1,), (2, 3)),  # [L, D, N, H]: D x (N*H) per layer
    "layers/self_attn/k_proj": ((1,), (2, 3)),
    "layers/self_attn/v_proj_current": ((1,), (2, 3)),
    "layers/self_attn/v_proj_delayed": ((1,), (2, 3)),
    "layers/self_attn/o_proj": ((1, 2), (3,)),  # [L, N, H, D]: (N*H) x D per layer
    "layers/mlp/experts/w_gate": ((2,), (3,)),  # [L, E, D, F]: D x F per layer and expert
    "layers/mlp/experts/w_up": ((2,), (3,)),
    "layers/mlp/experts/w_down": ((2,), (3,)),  # [L, E, F, D]
}
ROUTER = {
    "layers/mlp/router/down_proj": ((1,), (2,)),
    "layers/mlp/router/fc1": ((1,), (2,)),
    "layers/mlp/router/fc2": ((1,), (2,)),
    "layers/mlp/router/out_proj": ((1,), (2,)),
}
ALWAYS_ADAMW = [
    "embed_tokens", "norm/weight", "input_hidden_states_bias", "input_hidden_states_scale",
    "layers/input_layernorm/weight", "layers/self_attn/conv_depthwise",
    "layers/self_attn/conv_grouped", "layers/self_attn/conv_depthwise_bias",
    "layers/self_attn/temp", "layers/mlp/router/down_bias", "layers/mlp/router/fc1_bias",
    "layers/mlp/router/norm/weight", "layers/mlp/router/router_states_scale",
    "layers/post_mlp_residual_scale/residual_scale",
]


@pytest.mark.parametrize("muon_router", [False, True])
def test_each_parameter_lands_in_its_group(tiny_params, muon_router):
  train = TrainConfig(optimizer="muon", muon_router=muon_router)
  groups = param_groups(train, tiny_params)
  muon = dict(ALWAYS_MUON, **(ROUTER if muon_router else {}))
  for path in ALWAYS_ADAMW + ([] if muon_router else list(ROUTER)):
    assert groups[path] is None, path
  for path, (red, out) in muon.items():
    dn = groups[path]
    assert dn is not None, path
    assert (tuple(dn.reduction_axis), tuple(dn.output_axis)) == (red, out), path
  # Nothing else is on Muon, and every parameter has a group.
  assert {p for p, dn in groups.items() if dn is not None} == set(muon)
  flat = [p for p, _ in nnx.to_flat_state(tiny_params)]
  assert len(groups) == len(flat)
  # optimizer="adamw": everything AdamW.
  assert all(dn is None for dn in param_groups(TrainConfig(), tiny_params).values())


def test_describe_lists_every_parameter_once(tiny_params):
  train = TrainConfig(optimizer="muon", muon_router=True, schedule="wsd")
  text = describe_optimizer(train, tiny_params)
  rows = {line.split()[0]: line.split() for line in text.splitlines()[4:-1]}
  assert len(rows) == len(text.splitlines()[4:-1]) == len(param_groups(train, tiny_params))
  assert rows["layers/mlp/experts/w_down"][1:4] == ["muon", "0.02", "0"]
  assert " ".join(rows["layers/mlp/experts/w_down"][-5:]) == "layers,experts / expert_mlp / embed"
  assert " ".join(rows["layers/self_attn/o_proj"][-5:]) == "layers / q_heads,head_dim / embed"
  assert rows["embed_tokens"][1:4] == ["adamw", "0.0003", "0.1"]
  assert rows["norm/weight"][1:4] == ["adamw", "0.0003", "0"]  # no decay on norms


# --- Muon's update, written out --------------------------------------------------------------

def newton_schulz(x, steps=5, eps=1e-8):
  """optax's quintic Newton-Schulz on one matrix (float64), transposing tall matrices."""
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + eps)
  a_, b_, c_ = NS_COEFFS
  for _ in range(steps):
    a = x @ x.T
    x = a_ * x + (b_ * a + c_ * a @ a) @ x
  return x.T if tall else x


def orthogonalise_per_matrix(m, batch_ndim, reduction_ndim):
  """`m` [*batch, *reduction, *output] -> NS of each batch entry's (red x out) matrix."""
  b, r = batch_ndim, batch_ndim + reduction_ndim
  batch, red, out = m.shape[:b], m.shape[b:r], m.shape[r:]
  mats = m.reshape(int(np.prod(batch)), int(np.prod(red)), int(np.prod(out)))
  scale = np.sqrt(max(1.0, mats.shape[2] / mats.shape[1]))  # optax's width scaling
  return (scale * np.stack([newton_schulz(x) for x in mats])).reshape(m.shape)


class Toy(nnx.Module):
  def __init__(self, rngs):
    def param(shape, names):
      return nnx.Param(jax.random.normal(rngs.params(), shape), out_sharding=names,
                       eager_sharding=False)
    self.w_up = param((2, 3, 4, 6), ("layers", "experts", "embed", "expert_mlp"))
    self.o_proj = param((2, 2, 3, 4), ("layers", "q_heads", "head_dim", "embed"))
    self.norm = param((2, 4), ("layers", "embed"))


@pytest.mark.slow
def test_muon_update_is_per_layer_and_expert_orthogonalised_momentum():
  lr, wd, beta = 0.05, 0.1, 0.9
  train = TrainConfig(optimizer="muon", schedule="wsd", decay_fraction=0.0, warmup_steps=0,
                      num_steps=100, muon_lr=lr, muon_weight_decay=wd, muon_momentum=beta,
                      lr=1e-3, grad_clip_norm=0.0)
  params = nnx.state(Toy(nnx.Rngs(0)), nnx.Param)
  tx = make_optimizer(train, params)
  opt_state = tx.init(params)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
           for _ in range(2)]

  want = {k: np.asarray(params[k][...], np.float64) for k in ("w_up", "o_proj", "norm")}
  mu = {k: 0.0 for k in ("w_up", "o_proj")}
  got = params
  for t, g in enumerate(grads, start=1):
    updates, opt_state = update(g, opt_state, got)
    got = jax.tree.map(lambda p, u: p + u, got, updates)
    for k, batch_ndim, red_ndim in (("w_up", 2, 1), ("o_proj", 1, 2)):
      gk = np.asarray(g[k][...], np.float64)
      mu[k] = beta * mu[k] + (1 - beta) * gk
      nesterov = beta * mu[k] / (1 - beta ** (t + 1)) + (1 - beta) * gk / (1 - beta ** t)
      ortho = orthogonalise_per_matrix(nesterov, batch_ndim, red_ndim)
      want[k] = want[k] - lr * (ortho + wd * want[k])
      np.testing.assert_allclose(np.asarray(got[k][...]), want[k], rtol=2e-4, atol=2e-5,
                                 err_msg=f"{k} after step {t}")
    # AdamW on the [L, D] norm: the first update is -lr * g / (|g| + eps), no decay.
    if t == 1:
      gn = np.asarray(g["norm"][...])
      np.testing.assert_allclose(np.asarray(got["norm"][...]),
                                 want["norm"] - 1e-3 * gn / (np.abs(gn) + 1e-8), rtol=1e-5)

  # The reference is sensitive to the axes: orthogonalising across experts instead differs.
  m = np.asarray(grads[0]["w_up"][...], np.float64)
  wrong = np.moveaxis(orthogonalise_per_matrix(np.moveaxis(m, 1, 2), 2, 1), 2, 1)
  assert not np.allclose(wrong, orthogonalise_per_matrix(m, 2, 1), atol=1e-3)


# --- schedules -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,mid", [("linear", 0.55), ("1-sqrt", 0.1 + 0.9 * 0.5)])
def test_wsd_schedule(shape, mid):
  cfg = TrainConfig(num_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="wsd",
                    decay_fraction=0.2, decay_shape=shape)
  sched = make_schedule(cfg)
  mid_update = 90 if shape == "linear" else 85  # 1-sqrt: a quarter of the decay -> 1 - 0.5
  # Update k runs at step k - 1 and uses the shape's value at k.
  for update, want in [(1, 0.1), (5, 0.5), (10, 1.0), (50, 1.0), (79, 1.0), (80, 1.0),
                       (mid_update, mid), (100, 0.1), (1000, 0.1)]:
    np.testing.assert_allclose(float(sched(update - 1)), want, rtol=1e-6, atol=1e-7,
                               err_msg=f"update {update}")
  np.testing.assert_allclose(float(make_schedule(cfg, peak=0.02)(49)), 0.02, rtol=1e-6)
  np.testing.assert_allclose(float(make_schedule(cfg, peak=0.02)(99)), 0.002, rtol=1e-6)
  flat = make_schedule(dataclasses.replace(cfg, decay_fraction=0.0))
  assert [float(flat(s)) for s in (9, 99, 500)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedule_ends_on_the_final_rate(schedule):
  """The last update uses peak * min_lr_ratio and the first decay update a decayed rate
  (issue 14: cosine ended at 0.127 instead of 0.1, WSD applied 1.0, 0.7, 0.4)."""
  num_steps = 12 if schedule == "cosine" else 15
  cfg = TrainConfig(num_steps=num_steps, warmup_steps=3, lr=1.0, min_lr_ratio=0.1,
                    schedule=schedule, decay_fraction=0.2)  # wsd: 3 decay updates
  sched = make_schedule(cfg)
  rates = [float(sched(step)) for step in range(num_steps)]  # updates 1..num_steps
  np.testing.assert_allclose(rates[:3], [1 / 3, 2 / 3, 1.0], rtol=1e-6)
  np.testing.assert_allclose(rates[-1], 0.1, rtol=1e-6)
  if schedule == "wsd":
    np.testing.assert_allclose(rates[3:], [1.0] * 9 + [0.7, 0.4, 0.1], rtol=1e-6)
  else:  # cosine from the peak at update 3 to the end at update 12
    np.testing.assert_allclose(rates[3], 0.1 + 0.45 * (1 + np.cos(np.pi / 9)), rtol=1e-6)
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_no_warmup_builds_no_zero_length_piece(schedule, caplog):
  """Issue 23: warmup_steps=0 (configs/bench_cpu.py, every benchmark) built optax's 0-step
  warm-up, which logs "A polynomial schedule was set with a non-positive `transition_steps`
  value" at INFO. The cosine without it is the same schedule: equal to optax's, bit for bit."""
  cfg = TrainConfig(num_steps=37, warmup_steps=0, lr=3e-4, min_lr_ratio=0.1, schedule=schedule)
  with caplog.at_level("DEBUG"):
    sched = make_schedule(cfg)
  assert not [r for r in caplog.records if "transition_steps" in r.getMessage()]
  rates = np.array([float(sched(step)) for step in range(40)])  # updates 1..40
  if schedule == "cosine":
    want = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=3e-4, warmup_steps=0,
                                              decay_steps=37, end_value=3e-4 * 0.1)
    np.testing.assert_array_equal(rates, [float(want(k)) for k in range(1, 41)])
    assert rates[0] > rates[20] > rates[36]
  else:  # no warm-up: the peak from update 1 until the decay (the last 7 updates)
    np.testing.assert_allclose(rates[:30], 3e-4, rtol=1e-6)
    assert rates[29] > rates[30] > rates[36]
  np.testing.assert_allclose(rates[36:], 3e-5, rtol=1e-6)  # the end rate from update 37 on


class _Toy(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.zeros((3,), jnp.float32))


def test_skipped_updates_keep_schedule_and_bias_correction_on_the_step():
  """With a constant gradient g the Adam moments after n applied updates are known,
  mu = (1 - b1^n) g, nu = (1 - b2^n) g^2, so each parameter delta gives back the rate and
  the bias-correction count the update used. Updates 2 and 3 are skipped (issue 14: update
  4 applied schedule(1) with count 2 while the log said schedule(3))."""
  cfg = TrainConfig(num_steps=12, warmup_steps=4, lr=3e-3, schedule="wsd", b1=0.9, b2=0.95,
                    eps=1e-30, weight_decay=0.0, grad_clip_norm=0.0)
  params = nnx.state(_Toy(), nnx.Param)
  tx = make_optimizer(cfg, params)
  sched = make_schedule(cfg)
  g = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, jnp.float32), params)
  opt_state = tx.init(params)
  step_fn = jax.jit(lambda p, o, s, ok: update_or_skip(tx, g, o, p, s, ok))
  applied = 0
  for step, ok in enumerate([True, False, False, True, True, True]):
    new_params, opt_state = step_fn(params, opt_state, jnp.int32(step), jnp.bool_(ok))
    delta = float(params["w"][...][0] - new_params["w"][...][0])
    params = new_params
    if not ok:
      assert delta == 0.0, step
      continue
    applied += 1
    t = step + 1  # bias corrections count the step, as the schedule does
    want = float(sched(step)) * (1 - 0.9 ** applied) / (1 - 0.9 ** t) / np.sqrt(
        (1 - 0.95 ** applied) / (1 - 0.95 ** t))
    np.testing.assert_allclose(delta, want, rtol=1e-5, err_msg=f"update {t}")
  counts = [x for p, x in jax.tree_util.tree_leaves_with_path(opt_state)
            if jax.tree_util.keystr(p).endswith(".count")]
  assert counts and all(int(c) == 6 for c in counts)
  # A state whose counters lag its step (a checkpoint written before this rule): realigned.
  lagging = jax.tree_util.tree_map_with_path(
      lambda p, x: x - 3 if jax.tree_util.keystr(p).endswith(".count") else x, opt_state)
  _, realigned = step_fn(params, lagging, jnp.int32(6), jnp.bool_(True))
  _, straight = step_fn(params, opt_state, jnp.int32(6), jnp.bool_(True))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), realigned,
                                          straight)))



# --- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,field", [
    (dict(optimizer="sgd"), "train.optimizer"),
    (dict(schedule="linear"), "train.schedule"),
    (dict(decay_shape="cosine"), "train.decay_shape"),
    (dict(decay_fraction=1.5), "train.decay_fraction"),
    (dict(schedule="wsd", num_steps=100, warmup_steps=50, decay_fraction=0.6),
     "train.warmup_steps"),
    (dict(muon_lr=0.0), "train.muon_lr"),
    (dict(muon_weight_decay=-0.1), "train.muon_weight_decay"),
    (dict(muon_momentum=1.0), "train.muon_momentum"),
    (dict(muon_ns_steps=0), "train.muon_ns_steps"),
    (dict(muon_router="yes"), "train.muon_router"),
    (dict(muon_consistent_rms=-1.0), "train.muon_consistent_rms"),
])
def test_invalid_optimizer_fields_name_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    TrainConfig(**overrides)


def test_config_files_carry_the_optimizer_fields():
  config = zaya1_tiny.get_config()
  config.train.optimizer = "muon"
  config.train.schedule = "wsd"
  config.train.decay_shape = "1-sqrt"
  train = resolve(config).train
  assert (train.optimizer, train.schedule, train.decay_shape, train.muon_router) == (
      "muon", "wsd", "1-sqrt", False)


# --- a real train step -----------------------------------------------------------------------

@pytest.mark.slow
def test_muon_train_step_changes_every_parameter():
  model_cfg = tiny_model_config()
  train_cfg = TrainConfig(num_steps=10, warmup_steps=0, lr=1e-2, batch_size=2, seq_len=12,
                          optimizer="muon", muon_router=True, schedule="wsd",
                          muon_weight_decay=0.01)
  graphdef, params_shape, _ = abstract_model(model_cfg, seed=0)
  tx = make_optimizer(train_cfg, params_shape)
  state = init_train_state(model_cfg, tx, seed=0)
  before = jax.tree.map(np.asarray, state.params)
  step = jax.jit(lambda s, b: train_step(graphdef, tx, make_schedule(train_cfg), s, b))
  batch = random_batch(np.random.default_rng(1))
  losses = []
  for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and float(metrics["skipped"]) == 0.0
  changed = jax.tree_util.tree_leaves_with_path(
      jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before, state.params))
  unchanged = [jax.tree_util.keystr(p) for p, c in changed if not c]
  assert not unchanged, f"not updated: {unchanged}"


# --- router learning-rate scale --------------------------------------------------------------

_FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def test_router_and_expert_lr_scales_scale_only_their_updates(tiny_params):
  """`train.router_lr_scale` and `train.expert_lr_scale`: two steps of the same gradients;
  every router parameter's update (the matrices on Muon with `muon_router`, the vectors on
  AdamW) is the router scale x the unscaled one, every routed expert weight's (w_gate, w_up,
  w_down) the expert scale x, every other parameter's is the same, and the optimizer state is
  the same tree (so checkpoints restore whatever the scales)."""
  keys = iter(jax.random.split(jax.random.key(0), 1000))
  concrete = lambda tree: jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape), tree)
  params = concrete(tiny_params)
  grads = [concrete(tiny_params) for _ in range(2)]
  base = dict(optimizer="muon", muon_router=True, warmup_steps=0, num_steps=10, lr=1e-2,
              grad_clip_norm=0.0, router_lr_scale=1.0)  # unscaled (the router default is 0.1)
  scaled = {**base, "router_lr_scale": 0.25, "expert_lr_scale": 0.5}

  def updates(train):
    tx = make_optimizer(train, params)

    @jax.jit
    def two_steps(params, grads):
      state = tx.init(params)
      for g in grads:
        u, state = tx.update(g, state, params)
      return u, state
    # XLA:CPU's fusion emitters, whatever XLA_FLAGS the suite runs with (tests/conftest.py):
    # two separately compiled programs round alike only when compiled alike.
    compiled = two_steps.lower(params, grads).compile(_FUSION_EMITTERS)
    return compiled(params, grads)

  u1, s1 = updates(TrainConfig(**base))
  u2, s2 = updates(TrainConfig(**scaled))
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  flat1, flat2 = dict(nnx.to_flat_state(u1)), dict(nnx.to_flat_state(u2))
  routers = [p for p in flat1 if "router" in p]
  assert len(routers) == len(ROUTER) + 5  # the matrices and the biases, norm and EDA scale
  experts = [p for p in flat1 if "experts" in p]
  assert sorted(p[-1] for p in experts) == ["w_down", "w_gate", "w_up"]
  for path, v in flat1.items():
    want = np.asarray(v[...]) * (0.25 if "router" in path else 0.5 if "experts" in path else 1.0)
    np.testing.assert_allclose(np.asarray(flat2[path][...]), want, rtol=1e-6, atol=1e-12,
                               err_msg="/".join(map(str, path)))
    if "router" in path or "experts" in path:  # the scaled update differs from the unscaled
      assert np.abs(np.asarray(v[...])).max() > 0
  text = describe_optimizer(TrainConfig(**scaled), tiny_params)
  rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("layers")}
  assert rows["layers/mlp/router/fc1"][1:3] == ["muon", "0.005"]  # muon_lr 0.02 x 0.25
  assert rows["layers/mlp/router/fc1_bias"][1:3] == ["adamw", "0.0025"]
  assert rows["layers/mlp/experts/w_up"][1:3] == ["muon", "0.01"]  # muon_lr 0.02 x 0.5
  assert rows["layers/self_attn/q_proj"][1:3] == ["muon", "0.02"]


def test_router_lr_scale_must_be_positive():
  with pytest.raises(ConfigError, match="train.router_lr_scale=0"):
    TrainConfig(router_lr_scale=0)
  with pytest.raises(ConfigError, match="train.expert_lr_scale=-1 must be > 0"):
    TrainConfig(expert_lr_scale=-1)
