"""launch.balance_report's windowed figures (zaya_jax/perf/balance_report.py) against a
direct computation on synthetic per-step expert loads."""

import json

import numpy as np
import pytest

from zaya_jax.perf import balance_report


def write_run(workdir, loads_SLX, first_step=1):
  """A metrics.jsonl whose train records carry `loads_SLX` [steps, L, X] (skip class last)."""
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:
    for i, load_LX in enumerate(loads_SLX):
      experts = load_LX[:, :-1]
      f.write(json.dumps({
          "kind": "train", "step": first_step + i, "loss": 1.0 + i,
          "expert_load": load_LX.tolist(),
          "balance/max_over_mean": (experts.max(-1) / experts.mean(-1)).tolist(),
          "balance/load_entropy": [1.0] * len(load_LX), "balance/skip_rate": [0.0] * len(load_LX),
          "router/entropy": [1.0] * len(load_LX)}) + "\n")


def test_windowed_load_sums_blocks_of_steps_before_the_ratio(tmp_path):
  rng = np.random.default_rng(0)
  loads = rng.integers(0, 50, size=(37, 3, 5)).astype(np.float64)  # 37 steps, 3 layers, 4 experts + skip
  loads[:, 1, 0] += 200  # layer 1 favours expert 0
  write_run(tmp_path / "run", loads)
  got = balance_report.summarize(str(tmp_path / "run"), first=1, last=37, entropy_steps=(1,),
                                 window_steps=8)
  blocks = loads[:32, :, :4].reshape(4, 8, 3, 4).sum(1)  # the 5 steps of a partial block dropped
  worst = [max(b[l].max() / b[l].mean() for l in range(3)) for b in blocks]
  q = blocks / blocks.sum(-1, keepdims=True)
  lowest = [min(-np.sum(q[i, l] * np.log(q[i, l])) / np.log(4) for l in range(3)) for i in range(4)]
  assert got["window_max_over_mean"] == pytest.approx(np.median(worst), rel=1e-12)
  assert got["window_entropy"] == pytest.approx(np.median(lowest), rel=1e-12)
  per_step = [max(s[l, :4].max() / s[l, :4].mean() for l in range(3)) for s in loads]
  assert got["per_step_worst_median"] == pytest.approx(np.median(per_step), rel=1e-12)
  # A window longer than the steps gives no windowed figure; the table still renders.
  short = balance_report.summarize(str(tmp_path / "run"), first=1, last=37, entropy_steps=(1,),
                                   window_steps=64)
  assert short["window_max_over_mean"] is None and short["window_entropy"] is None
  assert "| run |" in balance_report.markdown_table([got, short], 1, 37)
  # A layer whose tokens all skip the experts counts as even, as in train.balance.load_stats.
  skipped = loads.copy()
  skipped[:, 2, :4] = 0
  mom, ent = balance_report.windowed(skipped, 8)
  blocks2 = skipped[:32, :2, :4].reshape(4, 8, 2, 4).sum(1)
  assert mom == pytest.approx(np.median([max(b[l].max() / b[l].mean() for l in range(2))
                                         for b in blocks2]), rel=1e-12)
  assert 0.5 < ent <= 1.0
  with pytest.raises(ValueError, match="one window"):
    balance_report.windowed(loads[:3], 4)
  # One expert (a dense model): even by definition, entropy 1 rather than 0/0.
  dense = np.concatenate([loads[:, :, :1], loads[:, :, 4:]], -1)  # [steps, L, 1 expert + skip]
  with np.errstate(all="raise"):
    assert balance_report.windowed(dense, 8) == (1.0, 1.0)


def test_errors_name_the_flag_and_the_fix(tmp_path):
  """A missing run names launch.balance_report's own flag (--workdirs, not launch.plot's
  --workdir); a window the run did not log says how to pick one it did."""
  with pytest.raises(FileNotFoundError, match=r"^--workdirs='.*nope' has no metrics.jsonl"):
    balance_report.summarize(str(tmp_path / "nope"), first=1, last=2, entropy_steps=(),
                             window_steps=1)
  write_run(tmp_path / "run", np.ones((5, 2, 3)))
  with pytest.raises(ValueError, match=r"steps 200-400; .* or give --first/--last inside"):
    balance_report.summarize(str(tmp_path / "run"), first=200, last=400, entropy_steps=(),
                             window_steps=1)
