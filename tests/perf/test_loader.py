"""Loader benchmark: positive tokens/s on a small raw corpus (0 and 1 workers), the required
rate against a hand computation, the command line."""

import subprocess
import sys

import pytest
from absl import flags

from configs import zaya1_base
from zaya_jax.config import synthetic_configs
from zaya_jax.data import DataConfig
from zaya_jax.perf import loader, roofline
from zaya_jax.parallel.accelerators import get_profile

from tests.perf.cli import REPO


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  d = tmp_path_factory.mktemp("raw")
  for i in range(40):
    (d / f"doc{i:02d}.txt").write_text(f"document {i} " * (20 + 7 * i))
  return str(d / "*.txt")


def test_required_rate_by_hand():
  model, train, _, _ = synthetic_configs(zaya1_base.get_config())
  need = loader.required_rate(model, train, profile="mi300x", num_devices=64,
                              devices_per_process=8)
  assert (need.batch_size, need.seq_len) == (256, 4096)  # 256 is a multiple of 64
  assert need.tokens_per_device == 256 * 4096 // 64 == 16384
  step = roofline.estimate(model, get_profile("mi300x"), num_devices=64, batch_size=256,
                           seq_len=4096, remat="none").step_seconds
  assert need.step_seconds == step and 0.01 < step < 10
  assert need.per_device == pytest.approx(16384 / step)
  assert need.per_process == pytest.approx(8 * 16384 / step)
  odd = loader.required_rate(model, train, num_devices=24, devices_per_process=8, seq_len=1024)
  assert odd.batch_size == 264 and odd.tokens_per_device == 264 * 1024 // 24  # rounded up
  with pytest.raises(ValueError, match="devices_per_process"):
    loader.required_rate(model, train, num_devices=4, devices_per_process=8)


@pytest.mark.slow
def test_measure_loader_and_report(corpus):
  flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (absl.app.run does this)
  data = DataConfig(source=corpus, eval_fraction=0.1)
  rates = [loader.measure_loader(data, seq_len=64, batch_size=4, num_workers=w, steps=5)
           for w in (0, 1)]
  for w, r in zip((0, 1), rates):
    assert (r.num_workers, r.steps) == (w, 5)
    assert r.tokens_per_s == pytest.approx(4 * 64 * 5 / r.seconds) and r.tokens_per_s > 0
    assert 0.9 < r.target_fraction <= 1  # concat packing: only row ends lack a target
  need = loader.Required("mi300x", 64, 8, 256, 64, 256, 0.5, 512.0, 4096.0)
  text = loader.format_report(rates, need)
  assert "4,096 tokens/s per process" in text
  assert f"{rates[0].tokens_per_s / 4096:.3f}" in text
  with pytest.raises(ValueError, match="steps=0"):
    loader.measure_loader(data, seq_len=64, batch_size=4, num_workers=0, steps=0)


@pytest.mark.slow
def test_cli(corpus):
  out = subprocess.run(
      [sys.executable, "-m", "launch.bench_loader", f"--data={corpus}", "--seq_len=64",
       "--batch_size=2", "--num_workers=0", "--steps=2"], cwd=REPO, capture_output=True,
      text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "tokens/s per process" in out.stdout and "loader/required" in out.stdout
  bad = subprocess.run(
      [sys.executable, "-m", "launch.bench_loader", f"--data={corpus}", "--num_workers=a"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 1 and "Traceback" not in bad.stderr
  assert bad.stderr.strip().splitlines()[-1].startswith("launch.bench_loader: --num_workers=a")
  negative = subprocess.run(
      [sys.executable, "-m", "launch.bench_loader", "--synthetic_documents=-5"],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert negative.returncode == 1 and "Traceback" not in negative.stderr
  assert negative.stderr.strip().splitlines()[-1] == (
      "launch.bench_loader: --synthetic_documents=-5 must be >= 1")
