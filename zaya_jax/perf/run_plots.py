# Shape letters: L X (see zaya_jax/__init__.py).
"""Plots of a training run, from its `metrics.jsonl` (`python -m launch.plot`).

`make_plots(workdir)` reads WORKDIR/metrics.jsonl (written by launch.train; not the
TensorBoard event files) and writes
  loss.png          train and eval loss (nats per token) vs step; gradient norm and learning
                    rate in panels below; red ticks mark steps whose update was skipped
  expert_load.png   heat map layers x classes (experts, skip class last) of the fraction of
                    tokens routed, averaged over the last `window` train records
  balance.png       per layer and train record: max/mean expert load (1 = even, E = one
                    expert) and the normalised load entropy H(p)/ln E (1 = even, 0 = one
                    expert; the ZAYA1-8B report's Fig. 4 metric), one line per layer
It works while the run is still training (it only reads).
"""

from __future__ import annotations

import os

import numpy as np
from matplotlib.figure import Figure

from zaya_jax.perf import report
from zaya_jax.train import metrics

_ANNOTATE_MAX_CELLS = 400  # heat maps with more cells get no numbers (unreadable)


def plot_loss(records: list[dict], path: str, title: str) -> Figure:
  """Writes `path`: loss (train, eval), gradient norm and learning rate vs step; returns the
  Figure."""
  train_steps, train_loss = metrics.series(records, "train", "loss")
  eval_steps, eval_loss = metrics.series(records, "eval", "loss")
  panels = [("loss", None)]
  grad = metrics.series(records, "train", "grad_norm")
  lr = metrics.series(records, "train", "lr")
  if grad[0].size:
    panels.append(("grad_norm", grad))
  if lr[0].size:
    panels.append(("lr", lr))
  heights = [3.0] + [1.4] * (len(panels) - 1)
  fig = report.new_figure(9.0, sum(heights) + 1.0)
  axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                      gridspec_kw={"height_ratios": heights})[:, 0]
  ax = axes[0]
  ax.plot(train_steps, train_loss, color="C0", lw=1.0, label="train")
  if eval_steps.size:
    ax.plot(eval_steps, eval_loss, "o-", color="C1", ms=4, lw=1.5, label="eval")
    ax.annotate(f"{eval_loss[-1]:.3f} (ppl {np.exp(min(eval_loss[-1], 700.0)):.3g})",
                (eval_steps[-1], eval_loss[-1]), textcoords="offset points", xytext=(-4, 8),
                ha="right", fontsize=8, color="C1")
  for i, step in enumerate(_skipped_steps(records)):
    ax.axvline(step, color="red", lw=0.6, alpha=0.5, label=None if i else "skipped update")
  finite = train_loss[np.isfinite(train_loss)]
  if finite.size > 4:  # the first steps (~ln V) would flatten the rest of the curve
    ax.set_ylim(max(0.0, float(np.min(finite)) - 0.1), float(np.percentile(finite, 98)) + 0.2)
  ax.set_ylabel("loss (nats/token)")
  ax.legend(loc="upper right", fontsize=8)
  for ax, (name, (steps, values)) in zip(axes[1:], panels[1:]):
    ax.plot(steps, values, color="C2" if name == "lr" else "C4", lw=1.0)
    ax.set_ylabel("learning rate" if name == "lr" else "grad norm")
    positive = values[np.isfinite(values) & (values > 0)]
    if name == "grad_norm" and positive.size and positive.max() > 20 * positive.min():
      ax.set_yscale("log")  # spikes of 100x would flatten a linear axis
    if name == "lr":
      ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[-1].set_xlabel("step")
  report.save_figure(fig, path, title, fontsize=9)
  return fig


def _skipped_steps(records: list[dict]) -> list[float]:
  """Steps at which the train records' `skipped_steps` count went up (at most 200)."""
  steps, counts = metrics.series(records, "train", "skipped_steps")
  rises = steps[1:][np.diff(counts) > 0].tolist()
  if counts.size and counts[0] > 0:
    rises.insert(0, steps[0])
  return rises[:200]


def balance_target(load_LX: np.ndarray) -> float:
  """The balancing target of each expert as a fraction of all of a layer's tokens, averaged
  over layers: 1/E of the expert-routed tokens, i.e. (1 - skip share) / E, with the skip
  class last in `load_LX` [L, E+1] (fractions of each layer's tokens). NaN if no data."""
  num_experts = load_LX.shape[1] - 1
  if num_experts < 1 or not np.isfinite(load_LX).any():
    return float("nan")
  return float(np.nanmean((1.0 - load_LX[:, -1]) / num_experts))


def balance_target_text(load_LX: np.ndarray) -> str:
  """`target 1/E = 0.125 of expert-routed tokens (0.123 of all at skip 0.016)`: the title note."""
  num_experts = load_LX.shape[1] - 1
  skip = float(np.nanmean(load_LX[:, -1])) if np.isfinite(load_LX).any() else float("nan")
  return (f"target 1/E = {1 / max(num_experts, 1):.3f} of expert-routed tokens "
          f"({balance_target(load_LX):.3f} of all at skip {skip:.3f})")


def plot_expert_load(load_LX: np.ndarray, steps: list[int], path: str, title: str) -> Figure:
  """Writes `path`: heat map of `load_LX` (fraction of tokens, skip class last); returns the
  Figure."""
  num_layers, num_classes = load_LX.shape
  fig = report.new_figure(max(5.0, 0.55 * num_classes + 2.5), max(3.0, 0.4 * num_layers + 1.8))
  ax = fig.subplots()
  top = float(np.nanmax(load_LX)) if np.isfinite(load_LX).any() else 1.0
  image = ax.imshow(load_LX, cmap="viridis", vmin=0.0, vmax=max(top, 1e-9), aspect="auto",
                    interpolation="nearest")
  fig.colorbar(image, ax=ax, label="fraction of the layer's tokens")
  ax.set_xticks(range(num_classes))
  ax.set_xticklabels([str(i) for i in range(num_classes - 1)] + ["skip"], fontsize=8)
  ax.set_yticks(range(num_layers))
  ax.set_yticklabels([f"layer {i}" for i in range(num_layers)], fontsize=8)
  ax.set_xlabel(f"class ({num_classes - 1} experts + skip)")
  if num_classes > 1:
    ax.axvline(num_classes - 1.5, color="white", lw=1.5)
  if load_LX.size <= _ANNOTATE_MAX_CELLS:
    for (i, j), value in np.ndenumerate(load_LX):
      ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
              color="black" if value > 0.6 * top else "white")
  span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
  ax.set_title(f"{title}\nmean expert load over {len(steps)} train records ({span}); "
               f"{balance_target_text(load_LX)}", fontsize=9)
  report.save_figure(fig, path)
  return fig


def per_layer_series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """`(steps [n], values [n, L])` of a per-layer train metric (records that have it)."""
  rows = [r for r in records if r.get("kind") == "train" and r.get(key) is not None]
  if not rows:
    return np.zeros((0,)), np.zeros((0, 0))
  return (np.asarray([r["step"] for r in rows], np.float64),
          np.asarray([r[key] for r in rows], np.float64))


def plot_balance(records: list[dict], path: str, title: str) -> Figure:
  """Writes `path`: max/mean expert load and normalised load entropy per layer vs step;
  returns the Figure."""
  fig = report.new_figure(9.0, 6.0)
  top, bottom = fig.subplots(2, 1, sharex=True)
  for ax, key, label in ((top, "balance/max_over_mean", "max / mean expert load"),
                         (bottom, "balance/load_entropy", "load entropy H(p) / ln E")):
    steps, values = per_layer_series(records, key)
    for layer in range(values.shape[1]):
      ax.plot(steps, values[:, layer], lw=0.8, label=f"layer {layer}")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  top.axhline(1.0, color="black", lw=0.6, ls="--")
  bottom.axhline(0.99, color="black", lw=0.6, ls="--")
  bottom.set_ylim(0.0, 1.02)
  bottom.set_xlabel("step")
  if values.shape[1] <= 16:
    top.legend(loc="upper right", fontsize=7, ncol=2)
  report.save_figure(fig, path, f"{title}: per-step expert load balance (skip class excluded)",
                     fontsize=9)
  return fig


def make_plots(workdir: str, out: str | None = None, window: int = 20) -> list[str]:
  """Reads `workdir/metrics.jsonl` and writes loss.png, expert_load.png and balance.png to `out`.

  Args:
    workdir: a launch.train workdir.
    out: output folder (created); default `workdir/plots`.
    window: train records averaged in the expert-load heat map, >= 1.

  Returns:
    The paths written (expert_load.png only when the records have `expert_load`,
    balance.png only when they have the per-layer balance metrics).

  Raises:
    FileNotFoundError: no metrics.jsonl in `workdir`.
    ValueError: no train records, or `window` < 1.
  """
  if window < 1:
    raise ValueError(f"--window={window} must be >= 1 (the number of train records averaged)")
  records = metrics.read_metrics(workdir)
  train = metrics.train_records(records, workdir)
  out = out or os.path.join(workdir, "plots")
  os.makedirs(out, exist_ok=True)
  name = os.path.basename(os.path.normpath(os.path.abspath(workdir)))
  written = [os.path.join(out, "loss.png")]
  plot_loss(records, written[0], f"{name}: {len(train)} train records, last step {train[-1]['step']}")
  if any(r.get("expert_load") is not None for r in train):
    load_LX, steps = metrics.mean_expert_load(records, window)
    written.append(os.path.join(out, "expert_load.png"))
    plot_expert_load(load_LX, steps, written[-1], name)
  if per_layer_series(records, "balance/load_entropy")[0].size:
    written.append(os.path.join(out, "balance.png"))
    plot_balance(records, written[-1], name)
  return written
