# Shape letters: L M X (see zaya_jax/__init__.py); S steps.
"""The load-balance floor of a lagged (causal) balancing rule, measured on a frozen model.

A causal rule routes batch s with biases fixed before it sees batch s. The best such biases
for one step are those solved exactly on the previous batch (`quantile_biases` of batch s-1:
the "oracle"); what they leave on batch s is sampling noise between batches, not controller
lag. This module freezes a trained checkpoint, reads the run's own training batches (the
shuffled rows of its data config) and reports, per step s = 1 .. S-1, the worst layer's
max/mean expert load of batch s under

  oracle    the exact solve of batch s-1 (the floor: no causal rule does better per step on
            average with the model fixed),
  histogram the "quantile" rule of the run's config (`quantile_step`: the histogram step,
            `balance.quantile_ema`, `quantile_integral` from a zero state; each update
            scaled by `balance.rate_lr_power`'s factor at the checkpoint's step) run over
            the same frozen batches from the stored biases,
  stored    the checkpoint's stored biases (what evaluation and generation use),

and their medians. Nothing trains; the model is the checkpoint's.

`fixed_bias_floor` asks the same of the load at evaluation, where one fixed bias routes a
whole held-out set: it routes three token sets with the frozen model (`fit`: training batches
after the run's own, `test`: the training batches after those, `eval`: the first batches of
the held-out split, as `launch.evaluate` reads them) under the stored biases and under biases
solved exactly on `fit`, and gives each pair's per-layer max/mean. The biases solved on `fit`
are the best one fixed bias learned from training data can do; what they leave on `test` is
sampling noise between training samples, what they leave on `eval` also the held-out split's
own mix of content (its documents route differently from the training mix).

`routing_margins` says how much of that routing the biases decide: per layer, how peaked the
router is, the gap between a token's best and second-best biased score, the biases' spread
over experts and the share of tokens whose gap is below one typical update of the rule
(`balance_floor`'s "bias_step"): a token that close to a tie moves with each update.
"""

from __future__ import annotations

import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zaya_jax.checkpoint import open_manager, restore_model_state
from zaya_jax.config import RunConfig
from zaya_jax.data import make_eval_batches, make_train_iterator
from zaya_jax.model.quantile import quantile_biases, route_counts
from zaya_jax.parallel.context import in_context_order
from zaya_jax.parallel.mesh import abstract_with_shardings, make_mesh, use_mesh
from zaya_jax.perf.balance_report import windowed
from zaya_jax.train.balance import get_biases, init_balance_state, load_stats, quantile_step
from zaya_jax.train.optim import balance_rate_schedule
from zaya_jax.train.setup import setup_training


def worst_max_over_mean(counts_LX) -> float:
  """The worst layer's `balance/max_over_mean` of one routing (`load_stats`)."""
  return float(jnp.max(load_stats(counts_LX)["max_over_mean"]))


def _frozen_router(cfg: RunConfig, ckpt_dir: str, step: int | None):
  """(stored biases float32 [L, X], `probs_of(batch) -> (router probs [L, M, X], valid [M])`)
  of the checkpoint's frozen model; call inside `use_mesh(make_mesh(cfg.mesh))`."""
  built = setup_training(cfg.model, cfg.train, make_mesh(cfg.mesh), None)
  target = abstract_with_shardings(built.abstract_state, built.state_sharding).to_items()["model"]
  params, rest = nnx.split_state(restore_model_state(ckpt_dir, target, step), nnx.Param, ...)

  @jax.jit
  def probs_of(batch):
    model = nnx.merge(built.graphdef, params, rest, copy=True)
    _, aux = model.backbone(batch["inputs"], batch["segment_ids"], batch["positions"])
    return aux["router_probs"], in_context_order(batch["segment_ids"]).reshape(-1) > 0

  return get_biases(rest), lambda batch: probs_of({k: jnp.asarray(v) for k, v in batch.items()})


def max_over_mean_per_layer(counts_LX) -> list[float]:
  """Per layer: `balance/max_over_mean` of one routing's counts [L, X] (`load_stats`)."""
  return [float(x) for x in load_stats(counts_LX)["max_over_mean"]]


def routing_margins(probs_LMX, valid_M, biases_LX, bias_step_L=None) -> dict[str, list[float]]:
  """How close the routing `argmax(p + b)` is to ties, per layer (module docstring).

  Args:
    probs_LMX: float32 [L, M, X] router probabilities (X = E experts + the skip class, last).
    valid_M: bool [M], the tokens counted (padding False).
    biases_LX: float32 [L, X], the balancing biases (probability units).
    bias_step_L: optional [L], a typical |bias change| of one update (`balance_floor`'s
      "bias_step"); None leaves "below_step_share" out.

  Returns:
    {"top_prob_median": [L] median of max_x p (1/X = uniform), "gap_median": [L] median of
     the best minus the second-best p + b, "bias_spread": [L] standard deviation of the E
     experts' biases, and with bias_step_L "below_step_share": [L] the fraction of valid
     tokens whose gap is below bias_step_L}, medians over the valid tokens.
  """
  valid = jnp.asarray(valid_M, bool)
  probs = jnp.asarray(probs_LMX, jnp.float32)
  top2 = jax.lax.top_k(probs + jnp.asarray(biases_LX, jnp.float32)[:, None, :], 2)[0]
  gap_LM = top2[..., 0] - top2[..., 1]
  median = lambda v_LM: [float(jnp.median(v[valid])) for v in v_LM]
  out = {"top_prob_median": median(jnp.max(probs, axis=-1)), "gap_median": median(gap_LM),
         "bias_spread": [float(x) for x in jnp.std(jnp.asarray(biases_LX)[:, :-1], axis=-1)]}
  if bias_step_L is not None:
    below = gap_LM < jnp.asarray(bias_step_L, jnp.float32)[:, None]
    out["below_step_share"] = [float(jnp.sum(b & valid) / jnp.maximum(jnp.sum(valid), 1))
                               for b in below]
  return out


def fixed_bias_floor(cfg: RunConfig, ckpt_dir: str, step: int | None, *, fit_batches: int,
                     test_batches: int, eval_batches: int, skip_batches: int = 0,
                     bias_step_L=None) -> dict[str, Any]:
  """The per-layer load of one fixed bias over whole token sets (module docstring).

  Args:
    cfg: the run's config (its data, batch and model; `balance.quantile_sweeps` for the solve).
    ckpt_dir, step: the run's checkpoints directory and step (None: latest).
    fit_batches, test_batches: training batches (of `train.batch_size` x `train.seq_len`) read
      after skipping `skip_batches`: the first `fit_batches` are `fit`, the next `test`.
    eval_batches: the first batches of the held-out split (`launch.evaluate --eval_batches`).
    bias_step_L: optional [L] typical update size, for `routing_margins`.

  Returns:
    {biases: {set: [L] max/mean}} for biases "stored" and "solved_on_fit" and sets "fit",
    "test", "eval"; "stored" on "eval" is `launch.evaluate`'s per-layer `max_over_mean`; and
    "margins": `routing_margins` of the eval set under the stored biases.

  Raises:
    ValueError: a count below 1, or an empty eval split (names data.eval_fraction).
  """
  if min(fit_batches, test_batches, eval_batches) < 1:
    raise ValueError(f"fit_batches={fit_batches}, test_batches={test_batches} and "
                     f"eval_batches={eval_batches} must each be >= 1")
  with use_mesh(make_mesh(cfg.mesh)):
    stored_LX, probs_of = _frozen_router(cfg, ckpt_dir, step)

    def routed(batches):
      probs, valid = zip(*(probs_of(b) for b in batches))
      return jnp.concatenate(probs, axis=1), jnp.concatenate(valid)

    it = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                             batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    for _ in range(skip_batches):
      next(it)
    sets = {"fit": routed([next(it) for _ in range(fit_batches)]),
            "test": routed([next(it) for _ in range(test_batches)]),
            "eval": routed(make_eval_batches(cfg.data, seq_len=cfg.train.seq_len,
                                             batch_size=cfg.train.batch_size,
                                             max_batches=eval_batches))}
    fit_probs, fit_valid = sets["fit"]
    solved_LX = jax.jit(quantile_biases, static_argnums=(3, 4))(
        fit_probs, fit_valid, stored_LX, cfg.balance.skip_target, cfg.balance.quantile_sweeps)
    counts = jax.jit(route_counts)
    out: dict[str, Any] = {
        name: {s: max_over_mean_per_layer(counts(p, v, b)) for s, (p, v) in sets.items()}
        for name, b in (("stored", stored_LX), ("solved_on_fit", solved_LX))}
    out["margins"] = routing_margins(*sets["eval"], stored_LX, bias_step_L)
    return out


def balance_floor(cfg: RunConfig, ckpt_dir: str, step: int | None, num_batches: int,
                  start_batch: int = 0, window: int = 16) -> dict[str, Any]:
  """Per-step worst-layer max/mean of batches 1 .. num_batches-1 (module docstring).

  Args:
    cfg: the run's config (its data, batch and model).
    ckpt_dir, step: the run's checkpoints directory and step (None: latest).
    num_batches: S >= 2 training batches read from the start of the data order (after
      skipping `start_batch`).
    window: steps per block of the windowed figures (`launch.balance_report --window`).

  Returns:
    {"oracle": [S-1], "histogram": [S-1], "stored": [S-1], and "median_<name>" of each;
    when S-1 >= window, "window_<name>" of each: the median over consecutive blocks of
    `window` steps of the worst layer's max/mean of the block's summed loads
    (`zaya_jax.perf.balance_report.windowed`: what `launch.balance_report` reports for a
    training run, here with the model frozen), and "window_entropy_<name>" (the median
    lowest-layer H/ln E of the same blocks);
    "churn" [S] and "median_churn": per batch, the fraction of its (token, layer) pairs that
    the histogram rule's update after it moves to another class, the model fixed;
    "bias_step": [L], per layer the median |change| of an expert's bias in those updates,
    "rate": the factor on each of those updates (`balance.rate_lr_power`'s at the
    checkpoint's step; 1 without it)}.
  """
  if num_batches < 2:
    raise ValueError(f"num_batches={num_batches} must be >= 2")
  with use_mesh(make_mesh(cfg.mesh)):
    stored_LX, probs_of = _frozen_router(cfg, ckpt_dir, step)

    exact = jax.jit(quantile_biases, static_argnums=(3, 4))
    # The config's quantile update (EMA step and integral), as the training step applies it,
    # scaled as at the checkpoint's step with `balance.rate_lr_power`.
    rate = 1.0
    if cfg.balance.rate_lr_power:
      if step is None:
        manager = open_manager(ckpt_dir, read_only=True)
        step = manager.latest_step()
        manager.close()
      rate = float(balance_rate_schedule(cfg.train, cfg.balance.rate_lr_power)(step))

    def rule_step(b, st, p, v):
      new, st = quantile_step(cfg.balance, b, st, p, v)
      return b + rate * (new - b), st

    rule = jax.jit(rule_step)
    controller = init_balance_state(*stored_LX.shape)
    counts = jax.jit(route_counts)
    it = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                             batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    for _ in range(start_batch):
      next(it)
    bal = cfg.balance
    out: dict[str, list[float]] = {"oracle": [], "histogram": [], "stored": []}
    loads: dict[str, list[Any]] = {name: [] for name in out}  # per step [L, X] counts
    churn: list[float] = []
    steps_SLE = []
    prev = None
    b_hist = stored_LX
    for _ in range(num_batches):
      probs, valid = probs_of(next(it))
      if prev is not None:
        solved = exact(prev[0], prev[1], stored_LX, bal.skip_target, bal.quantile_sweeps)
        for name, b_LX in (("oracle", solved), ("histogram", b_hist), ("stored", stored_LX)):
          loads[name].append(jax.device_get(counts(probs, valid, b_LX)))
          out[name].append(worst_max_over_mean(loads[name][-1]))
      b_next, controller = rule(b_hist, controller, probs, valid)
      # Tokens of this batch that the rule's next biases send to another class (model fixed).
      churn.append(float(_moved_fraction(probs, valid, b_hist, b_next)))
      steps_SLE.append(jnp.abs(b_next - b_hist)[:, :-1])
      b_hist, prev = b_next, (probs, valid)
  steps_LN = jnp.stack(steps_SLE, axis=1).reshape(stored_LX.shape[0], -1)
  windows: dict[str, float] = {}
  if num_batches - 1 >= window:
    for name, per_step in loads.items():
      windows[f"window_{name}"], windows[f"window_entropy_{name}"] = windowed(
          np.stack(per_step), window)
  return {**out, **{f"median_{k}": statistics.median(v) for k, v in out.items()}, **windows,
          "churn": churn, "median_churn": statistics.median(churn), "rate": rate,
          "bias_step": [float(x) for x in jnp.median(steps_LN, axis=-1)]}


@jax.jit
def _moved_fraction(probs_LMX, valid_M, before_LX, after_LX):
  """float32 []: the fraction of valid (token, layer) pairs whose class `argmax(p + b)`
  differs between the biases `before` and `after`."""
  cls = lambda b_LX: jnp.argmax(probs_LMX + b_LX[:, None, :], axis=-1)
  changed_LM = (cls(before_LX) != cls(after_LX)) & valid_M[None, :]
  return jnp.sum(changed_LM) / jnp.maximum(jnp.sum(valid_M) * probs_LMX.shape[0], 1)
