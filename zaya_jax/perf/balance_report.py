"""Load-balance table of training runs, from their `metrics.jsonl` (launch.balance_report).

For each workdir (a `launch.train` run logged with `train.log_every=1`, so every step has a
record) one row: per layer, the median and the worst per-step max/mean expert load over a
window of steps (default 200-400); the normalised load entropy H(p)/ln E at given steps
(min over layers, with the worst layer); the mean skip rate and router entropy over the
window; the mean train loss over the window's last 10 steps and the last eval loss. Those
figures are per step (each step's own routing counts), never averaged over steps before the
ratio. Windowed figures (issue 22's measure of a lagged rule, whose per-step load carries the
batch-to-batch noise): the expert loads summed over consecutive blocks of `window` steps,
then the worst layer's max/mean and the lowest layer's normalised entropy per block, and
their medians over the blocks.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from zaya_jax.train import metrics


def _per_layer(rows: list[dict[str, Any]], key: str) -> np.ndarray:
  """float64 [steps, L] of a per-layer train metric."""
  return np.asarray([r[key] for r in rows], np.float64)


def windowed(loads_SLX: np.ndarray, window: int) -> tuple[float, float]:
  """(median worst-layer max/mean, median lowest-layer H/ln E) of the expert loads summed
  over consecutive blocks of `window` steps (a last partial block is dropped).

  Args:
    loads_SLX: per step, layer and class the routed tokens (`expert_load`; the skip class
      last, left out).
    window: steps per block, >= 1.

  Raises:
    ValueError: fewer than `window` steps.
  """
  experts_SLE = np.asarray(loads_SLX, np.float64)[..., :-1]
  blocks = experts_SLE.shape[0] // window
  if blocks < 1:
    raise ValueError(f"{experts_SLE.shape[0]} steps < one window of {window}")
  summed_BLE = experts_SLE[:blocks * window].reshape(blocks, window, *experts_SLE.shape[1:]).sum(1)
  # As `zaya_jax.train.balance.load_stats` (float64 here): a layer with no expert tokens in
  # a block counts as even (max/mean 1, entropy 1),
  mean_BL = summed_BLE.mean(-1)
  mom_BL = np.where(mean_BL > 0, summed_BLE.max(-1) / np.maximum(mean_BL, 1e-30), 1.0)
  # and one expert (a dense model: ln E = 0) is even too.
  if summed_BLE.shape[-1] == 1:
    return float(np.median(mom_BL.max(-1))), 1.0
  q_BLE = summed_BLE / np.maximum(summed_BLE.sum(-1, keepdims=True), 1e-30)
  ent_BL = -np.sum(np.where(q_BLE > 0, q_BLE * np.log(np.where(q_BLE > 0, q_BLE, 1.0)), 0.0),
                   -1) / np.log(summed_BLE.shape[-1])
  ent_BL = np.where(mean_BL > 0, ent_BL, 1.0)
  return float(np.median(mom_BL.max(-1))), float(np.median(ent_BL.min(-1)))


def summarize(workdir: str, first: int = 200, last: int = 400,
              entropy_steps: Sequence[int] = (100, 200, 400),
              window_steps: int = 16) -> dict[str, Any]:
  """The balance figures of one run (module docstring).

  Args:
    workdir: a launch.train workdir with metrics.jsonl.
    first, last: the window of steps (inclusive) for the per-step statistics.
    entropy_steps: steps at which the normalised load entropy is reported.
    window_steps: steps per block of the windowed figures (`windowed`).

  Returns:
    A dict: `run` (the workdir's name), `steps` (train records in the window),
    `median_LE` / `worst_L` (max/mean per layer: median and max over the window),
    `entropy_at` {step: (min over layers, its layer)} (None where the step has no record),
    `entropy_median` (median over the window of the min-over-layers entropy),
    `skip_rate`, `router_entropy` (window means, averaged over layers), `train_loss`
    (mean over the window's last 10 records), `eval_loss` (the last eval record's; None
    without one), `per_step_worst_median` (median over the window of the worst layer's
    max/mean), `window_max_over_mean` and `window_entropy` (`windowed`; None when the
    window has fewer than `window_steps` steps or no `expert_load`).

  Raises:
    FileNotFoundError: no metrics.jsonl; ValueError: no train record with the balance
      metrics in the window.
  """
  records = metrics.read_metrics(workdir, flag="--workdirs")
  train = {r["step"]: r for r in records
           if r.get("kind") == "train" and r.get("balance/max_over_mean") is not None}
  window = [train[s] for s in sorted(train) if first <= s <= last]
  if not window:
    raise ValueError(f"{workdir}: no train records with balance metrics in steps "
                     f"{first}-{last}; train with --config.train.log_every=1 for >= {first} steps, "
                     "or give --first/--last inside the steps the run logged")
  mom = _per_layer(window, "balance/max_over_mean")
  entropy = {}
  for step in entropy_steps:
    row = train.get(step)
    if row is None or row.get("balance/load_entropy") is None:
      entropy[step] = None
    else:
      ent = np.asarray(row["balance/load_entropy"])
      entropy[step] = (float(ent.min()), int(ent.argmin()))
  has_entropy = all(r.get("balance/load_entropy") is not None for r in window)
  evals = [r for r in records if r.get("kind") == "eval"]
  win_mom = win_ent = None
  if len(window) >= window_steps and all(r.get("expert_load") is not None for r in window):
    win_mom, win_ent = windowed(np.asarray([r["expert_load"] for r in window]), window_steps)
  return {
      "run": os.path.basename(os.path.normpath(workdir)),
      "steps": len(window),
      "median_L": np.median(mom, axis=0),
      "worst_L": mom.max(axis=0),
      "entropy_at": entropy,
      "entropy_median": (float(np.median(_per_layer(window, "balance/load_entropy").min(1)))
                         if has_entropy else None),
      "skip_rate": float(_per_layer(window, "balance/skip_rate").mean()),
      "router_entropy": float(_per_layer(window, "router/entropy").mean()),
      "train_loss": float(np.mean([r["loss"] for r in window[-10:]])),
      "eval_loss": float(evals[-1]["loss"]) if evals else None,
      "per_step_worst_median": float(np.median(mom.max(axis=1))),
      "window_max_over_mean": win_mom,
      "window_entropy": win_ent,
  }


def markdown_table(rows: list[dict[str, Any]], first: int = 200, last: int = 400) -> str:
  """A Markdown table of `summarize` results, one line per run."""
  steps = list(rows[0]["entropy_at"]) if rows else []
  fmt = lambda v: " ".join(f"{x:.2f}" for x in v)
  opt = lambda v, spec: "-" if v is None else format(v, spec)  # a figure the run may lack
  head = (f"| run | max/mean median per layer, steps {first}-{last} | worst per layer | "
          + " | ".join(f"H/ln E @{s} (min layer)" for s in steps)
          + " | median min-layer H/ln E | worst-layer max/mean per step (median) | window "
          "max/mean (median) | window min-layer H/ln E (median) | skip rate | router entropy "
          "(nats) | train loss | eval loss |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    ent = ["-" if r["entropy_at"][s] is None else
           f"{r['entropy_at'][s][0]:.3f} (L{r['entropy_at'][s][1]})" for s in steps]
    lines.append(
        f"| {r['run']} | {fmt(r['median_L'])} | {fmt(r['worst_L'])} | " + " | ".join(ent)
        + f" | {opt(r['entropy_median'], '.3f')} | {r['per_step_worst_median']:.2f}"
        f" | {opt(r['window_max_over_mean'], '.2f')} | {opt(r['window_entropy'], '.4f')}"
        f" | {r['skip_rate']:.3f} | {r['router_entropy']:.2f} | {r['train_loss']:.3f} | "
        f"{opt(r['eval_loss'], '.4f')} |")
  return "\n".join(lines)
