"""train.schedule_extend: resuming with another train.num_steps never silently jumps the lr.

Unit tests of `extend_schedule` against `make_schedule` (the loop calls it with the saved
`train` group right after restoring; the rebuilt step uses the returned config)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil

import pytest
from absl import logging as absl_logging

from tests.train.inproc import tiny_run_config
from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import ConfigError, TrainConfig, resolve
from zaya_jax.train import run
from zaya_jax.train.metrics import read_metrics
from zaya_jax.train.optim import make_schedule
from zaya_jax.train.schedule_extend import extend_schedule


@contextlib.contextmanager
def absltest_log_capture():
  """The messages absl logs inside the block (every level), as a list filled on exit."""
  lines: list[str] = []

  class Handler(logging.Handler):
    def emit(self, record):
      lines.append(record.getMessage())

  handler = Handler(level=logging.DEBUG)
  logger = absl_logging.get_absl_logger()
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    yield lines
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def _train(**kw):
  return TrainConfig(**{"num_steps": 6, "warmup_steps": 1, "lr": 1e-3, "min_lr_ratio": 0.1, **kw})


def _saved(train: TrainConfig) -> dict:
  return dataclasses.asdict(train)


def _lrs(train, steps):
  sched = make_schedule(train)
  return [float(sched(s)) for s in steps]


def test_cosine_refuses_with_both_lrs():
  old = _train()
  final = _lrs(old, [6])[0]
  stretched = _lrs(_train(num_steps=12), [6])[0]
  with pytest.raises(ConfigError) as e:
    extend_schedule(_saved(old), _train(num_steps=12), 6)
  msg = str(e.value)
  assert "train.num_steps 6 -> 12" in msg and f"{final:.3e} -> {stretched:.3e}" in msg
  assert "schedule_extend=constant" in msg and "schedule_extend=stretch" in msg
  assert abs(final - 1e-4) < 1e-9 and stretched > 2 * final  # the jump that used to be silent


def test_constant_keeps_the_old_final_lr_and_survives_later_resumes():
  old = _train()
  new = extend_schedule(_saved(old), _train(num_steps=12, schedule_extend="constant"), 6)
  assert new.schedule_steps == 6 and new.num_steps == 12
  assert _lrs(new, range(6, 12)) == pytest.approx([1e-4] * 6, rel=1e-6)
  assert _lrs(new, range(6)) == _lrs(old, range(6))
  # A later resume of that run (same num_steps, default schedule_steps=0) keeps the horizon.
  later = extend_schedule(_saved(new), _train(num_steps=12), 9)
  assert later.schedule_steps == 6
  # Extending again with "constant" still keeps the first horizon.
  again = extend_schedule(_saved(new), _train(num_steps=20, schedule_extend="constant"), 12)
  assert again.schedule_steps == 6


def test_a_run_whose_warmup_was_clamped_resumes_longer():
  """zaya1_tiny's 30 warm-up steps in a 20-step run warm up over 19 (`clamp_warmup`); resumed
  with num_steps=30 (warm-up clamped to 29) the saved schedule is rebuilt with the warm-up it
  trained with. Before, rebuilding it with 29 warm-up steps over a 20-step horizon raised
  "warmup_steps=29 must be < schedule_steps=20" whatever schedule_extend was."""
  def resolved(num_steps, **kw):
    return resolve(tiny_run_config(num_steps=num_steps, warmup_steps=30, **kw)).train
  old = resolved(20)
  assert old.warmup_steps == 19
  with pytest.raises(ConfigError) as e:
    extend_schedule(_saved(old), resolved(30), 20)
  final, warming = _lrs(old, [20])[0], _lrs(resolved(30), [20])[0]
  assert "train.num_steps 20 -> 30" in str(e.value) and f"{final:.3e} -> {warming:.3e}" in str(e.value)
  kept = extend_schedule(_saved(old), resolved(30, schedule_extend="constant"), 20)
  assert (kept.warmup_steps, kept.schedule_steps, kept.num_steps) == (19, 20, 30)
  assert _lrs(kept, range(21)) == _lrs(old, range(21))
  stretched = extend_schedule(_saved(old), resolved(30, schedule_extend="stretch"), 20)
  assert (stretched.warmup_steps, stretched.schedule_steps) == (29, 0)


def test_stretch_recomputes():
  new = extend_schedule(_saved(_train()), _train(num_steps=12, schedule_extend="stretch"), 6)
  assert new.schedule_steps == 0
  assert _lrs(new, range(6, 12)) == _lrs(_train(num_steps=12), range(6, 12))


def test_wsd_in_stable_phase_extends_continuously():
  old = _train(schedule="wsd", num_steps=10, decay_fraction=0.2)  # decay over updates 9-10
  new = extend_schedule(_saved(old), _train(schedule="wsd", num_steps=20, decay_fraction=0.2), 5)
  assert new.num_steps == 20 and new.schedule_steps == 0
  assert _lrs(old, [5]) == _lrs(new, [5]) == pytest.approx([1e-3])
  assert _lrs(new, [15]) == pytest.approx([1e-3]) and _lrs(new, [19])[0] < 1e-3
  # "constant" asked for keeps the saved horizon even where the next lr agrees (it took the
  # new one, contrary to the flag, until a new-user trial, 2026-12-07)
  kept = extend_schedule(_saved(old), _train(schedule="wsd", num_steps=20, decay_fraction=0.2,
                                             schedule_extend="constant"), 5)
  assert kept.schedule_steps == 10 and _lrs(kept, range(21)) == _lrs(old, range(21))
  # In its decay phase the rate would change: refused.
  with pytest.raises(ConfigError, match="train.num_steps 10 -> 20"):
    extend_schedule(_saved(old), _train(schedule="wsd", num_steps=20, decay_fraction=0.2), 9)


def test_unchanged_or_nothing_to_train_or_only_the_new_fields():
  old = _train()
  assert extend_schedule(_saved(old), _train(schedule_extend="stretch"), 3) == _train(
      schedule_extend="stretch")
  assert extend_schedule(_saved(old), _train(num_steps=3), 6) == _train(num_steps=3)
  legacy = {k: v for k, v in _saved(old).items() if k not in ("schedule_steps", "schedule_extend")}
  assert extend_schedule(legacy, _train(), 3) == _train()


@pytest.mark.slow
def test_resumed_run_through_the_loop(tmp_path):
  """End to end through `run`: a finished 6-step cosine run resumed with num_steps=9 is
  refused (nothing written), then "constant" trains steps 7-9 at the old final lr and
  "stretch" (on a copy) at the schedule recomputed over 9 steps. The session's
  persistent compilation cache (tests/conftest.py): "constant" keeps the 6-step horizon, so
  its steps are the first run's programs, read back instead of compiled again."""

  work, copy = tmp_path / "a", tmp_path / "b"
  run(tiny_run_config(), str(work))
  shutil.copytree(work, copy)
  with pytest.raises(ConfigError, match=r"train.num_steps 6 -> 9 at step 6 .*schedule_extend=constant"):
    run(tiny_run_config(num_steps=9), str(work))
  assert sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())[-1] == 6

  def lrs(workdir):
    return {r["step"]: r["lr"] for r in read_metrics(str(workdir)) if r["kind"] == "train"}

  run(tiny_run_config(num_steps=9, schedule_extend="constant"), str(work))
  cfg = resolve(tiny_run_config()).train
  final = cfg.lr * cfg.min_lr_ratio
  got = lrs(work)
  assert got[6] == pytest.approx(final, rel=1e-6)
  assert [got[s] for s in (7, 8, 9)] == pytest.approx([final] * 3, rel=1e-6)
  # The horizon is saved: the checkpoint of step 9 keeps schedule_steps=6.
  ckpt = Checkpointer(str(work / "checkpoints"), resolve(tiny_run_config()).checkpoint)
  assert ckpt.saved_config(9)["train"]["schedule_steps"] == 6
  ckpt.close()
  # Resumed with nothing to train: no eval step is compiled (it was, 4.5 s on zaya1_tiny, for
  # nothing), no record but the summary is added, the checkpoint stays.
  before = read_metrics(str(work))
  with absltest_log_capture() as logs:
    run(tiny_run_config(num_steps=9, schedule_extend="constant"), str(work))
  assert not any("compiling the eval step" in line for line in logs), logs
  assert any("nothing to train" in line for line in logs), logs
  after = read_metrics(str(work))
  assert after[:len(before)] == before and [r["kind"] for r in after[len(before):]] == ["summary"]

  run(tiny_run_config(num_steps=9, schedule_extend="stretch"), str(copy))
  want = _lrs(dataclasses.replace(cfg, num_steps=9), [6, 7, 8])  # updates 7, 8, 9
  assert [lrs(copy)[s] for s in (7, 8, 9)] == pytest.approx(want, rel=1e-6)
  assert want[0] > 2 * final  # the jump "stretch" accepts
