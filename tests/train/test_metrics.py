"""MetricsWriter (metrics.jsonl + TensorBoard events) and the `launch.plot` CLI."""

import glob
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from tensorboardX.proto import event_pb2

from launch import plot as plot_cli
from zaya_jax.perf import run_plots as plot
from zaya_jax.train import metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_events(path: str) -> list[event_pb2.Event]:
  """The events of one TFRecord event file (length, length crc, payload, payload crc)."""
  events = []
  with open(path, "rb") as f:
    while header := f.read(12):
      (length,) = struct.unpack("<Q", header[:8])
      events.append(event_pb2.Event.FromString(f.read(length)))
      f.read(4)
  return events


def event_files(workdir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(workdir, metrics.TENSORBOARD_DIR, "events.out.tfevents.*")))


def scalars(events: list[event_pb2.Event]) -> dict[tuple[str, int], float]:
  return {(v.tag, e.step): v.simple_value for e in events for v in e.summary.value
          if v.WhichOneof("value") == "simple_value"}


def train_record(step: int, num_layers: int = 2, num_classes: int = 3) -> dict:
  load = np.full((num_layers, num_classes), 1.0 / num_classes) + 0.01 * step
  return {"kind": "train", "step": step, "loss": 3.0 - 0.1 * step, "lr": 1e-3 * step,
          "grad_norm": 1.5, "tokens": 64.0, "tokens_per_s": None, "skipped_steps": 0,
          "moe/dropped_fraction": 0.0, "expert_load": load.tolist()}


def test_writer_writes_jsonl_and_tensorboard_scalars(tmp_path):
  path = str(tmp_path / metrics.METRICS_FILE)
  writer = metrics.MetricsWriter(path, enabled=True)
  writer.write({**train_record(1), "balance/bias": [0.5, -0.25], "note": "text"})
  writer.write({"kind": "eval", "step": 1, "loss": 2.0, "tokens": 128.0, "expert_load": None})
  writer.close()
  writer.close()  # idempotent

  with open(path) as f:
    lines = [json.loads(l) for l in f]
  assert [(r["kind"], r["step"]) for r in lines] == [("train", 1), ("eval", 1)]
  assert lines[1]["perplexity"] == pytest.approx(math.exp(2.0))
  assert "perplexity" not in lines[0]

  files = event_files(str(tmp_path))
  assert len(files) == 1
  events = read_events(files[0])
  got = scalars(events)
  assert got[("train/loss", 1)] == pytest.approx(2.9)
  assert got[("train/lr", 1)] == pytest.approx(1e-3)
  assert got[("train/skipped_steps", 1)] == 0.0
  assert got[("train/moe/dropped_fraction", 1)] == 0.0
  assert got[("train/balance/bias/layer_0", 1)] == 0.5
  assert got[("train/balance/bias/layer_1", 1)] == -0.25
  assert got[("eval/loss", 1)] == 2.0
  assert got[("eval/perplexity", 1)] == pytest.approx(math.exp(2.0), rel=1e-6)
  tags = {tag for tag, _ in got}
  assert not {"train/tokens_per_s", "train/note", "train/step", "eval/expert_load"} & tags
  images = {(v.tag, e.step): v.image for e in events for v in e.summary.value
            if v.WhichOneof("value") == "image"}
  image = images[("train/expert_load", 1)]
  assert image.height > 2 * 2 and image.width > 3 * 2 and image.height * 3 == image.width * 2


def test_resume_truncates_jsonl_and_purges_tensorboard(tmp_path):
  path = str(tmp_path / metrics.METRICS_FILE)
  writer = metrics.MetricsWriter(path, enabled=True)
  for step in range(1, 5):
    writer.write(train_record(step))
  writer.close()
  resumed = metrics.MetricsWriter(path, enabled=True, resume_step=2)  # same second: new file
  resumed.write(train_record(3))
  resumed.close()

  with open(path) as f:
    assert [json.loads(l)["step"] for l in f] == [1, 2, 3]
  first, second = event_files(str(tmp_path))
  assert max(step for _, step in scalars(read_events(first))) == 4  # the old file is kept
  events = read_events(second)
  starts = [e.step for e in events if e.HasField("session_log")
            and e.session_log.status == event_pb2.SessionLog.START]
  assert starts == [3]  # TensorBoard hides steps >= 3 of the older files
  assert scalars(events)[("train/loss", 3)] == pytest.approx(2.7)


def test_tensorboard_writer_does_not_import_torch(tmp_path):
  """A training process writes its events without importing torch (1.1 s of every run's
  start where torch is installed, as here); an image and scalars still reach the file."""
  code = (
      "import sys\n"
      "from zaya_jax.train import metrics\n"
      f"w = metrics.MetricsWriter({str(tmp_path / metrics.METRICS_FILE)!r}, enabled=True)\n"
      "w.write({'kind': 'train', 'step': 1, 'loss': 2.0, 'expert_load': [[0.5, 0.5], [1.0, 0.0]]})\n"
      "w.close()\n"
      "assert 'torch' not in sys.modules, 'torch imported'\n"
      "import torch\n"  # still importable afterwards
      "print('ok', torch.__name__)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0 and "ok torch" in proc.stdout, proc.stdout + proc.stderr
  [path] = event_files(str(tmp_path))
  events = read_events(path)
  assert scalars(events)[("train/loss", 1)] == 2.0
  assert any(v.tag == "train/expert_load" and v.WhichOneof("value") == "image"
             for e in events for v in e.summary.value)


def test_disabled_writer_writes_nothing(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path / metrics.METRICS_FILE), enabled=False)
  writer.write(train_record(1))
  writer.close()
  assert os.listdir(tmp_path) == []


def test_tensorboard_items_skips_non_numeric():
  scalars_, arrays = metrics.tensorboard_items(
      {"kind": "train", "step": 3, "a": True, "b": [1, None], "c": [[1, 2], [3]],
       "d": {"e": 2}, "f": np.float32(0.5), "g": [[[1.0]]], "h": "x"})
  assert scalars_ == {"train/a": 1.0, "train/d/e": 2.0, "train/f": 0.5}
  assert arrays == {}


def write_metrics(workdir, records):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, metrics.METRICS_FILE), "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    f.write('{"kind": "train", "step": 9')  # cut short by a kill: ignored


def test_mean_expert_load_is_mean_of_last_window():
  records = [train_record(s) for s in range(1, 8)]
  records.insert(3, {"kind": "eval", "step": 3, "loss": 1.0, "expert_load": [[9.0, 9.0, 9.0]] * 2})
  load, steps = metrics.mean_expert_load(records, window=3)
  assert steps == [5, 6, 7]
  np.testing.assert_allclose(load, np.mean([train_record(s)["expert_load"] for s in (5, 6, 7)], 0))
  load, steps = metrics.mean_expert_load(records, window=100)
  assert steps == list(range(1, 8))
  with pytest.raises(ValueError, match="window=0"):
    metrics.mean_expert_load(records, window=0)


def test_plot_writes_the_pngs(tmp_path):
  workdir = str(tmp_path / "run")
  records = [train_record(s, num_layers=3, num_classes=5) for s in range(10, 210, 10)]
  records[5]["skipped_steps"] = 1
  for i, r in enumerate(records):
    r["balance/max_over_mean"] = [1.0 + 0.1 * i, 2.0, 4.0]
    r["balance/load_entropy"] = [1.0 - 0.01 * i, 0.9, 0.5]
  records += [{"kind": "eval", "step": s, "loss": 2.5, "tokens": 100.0} for s in (100, 200)]
  write_metrics(workdir, records)
  paths = plot.make_plots(workdir, window=4)
  assert paths == [os.path.join(workdir, "plots", name)
                   for name in ("loss.png", "expert_load.png", "balance.png")]
  steps, values = plot.per_layer_series(records, "balance/load_entropy")
  np.testing.assert_array_equal(steps, np.arange(10, 210, 10))
  np.testing.assert_allclose(values[:, 0], 1.0 - 0.01 * np.arange(20))
  assert values.shape == (20, 3)
  for path in paths:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_plot_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
    plot.make_plots(str(tmp_path / "missing"))
  write_metrics(str(tmp_path), [{"kind": "eval", "step": 5, "loss": 2.0}])
  with pytest.raises(ValueError, match="no train records"):
    plot.make_plots(str(tmp_path))
  with pytest.raises(ValueError, match="--window=0"):
    plot.make_plots(str(tmp_path), window=0)


@pytest.mark.slow
def test_plot_cli(tmp_path):
  write_metrics(str(tmp_path), [train_record(s) for s in (1, 2)])
  out = tmp_path / "pngs"
  ok = subprocess.run([sys.executable, "-m", "launch.plot", "--workdir", str(tmp_path),
                       "--out", str(out), "--window", "1"], cwd=REPO, capture_output=True,
                      text=True, timeout=120, check=False)
  assert ok.returncode == 0, ok.stderr
  assert ok.stdout.split() == [str(out / "loss.png"), str(out / "expert_load.png")]


def test_plot_main_exits_with_the_error(tmp_path):
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(workdir=str(tmp_path / "nope")):
    with pytest.raises(SystemExit, match="launch.plot: --workdir=.*has no metrics.jsonl"):
      plot_cli.main(["plot"])
