"""Does the data loader keep up? Loader tokens/s per process against a training step's need.

`measure_loader` builds the training iterator exactly as training does
(`zaya_jax.data.make_train_iterator`: a prepared directory or raw text, whatever
`data.source` names) and times `steps` batches after the first (the first pays the listing,
worker start-up and the first tokenization, reported apart as `first_batch_s`).

`required_rate` is the consumption of the training step at a given scale: the global batch
(config.train.batch_size rounded up to a multiple of the devices, as launch.sizing does)
x seq_len / devices = tokens per device per step, divided by the roofline step time
(`zaya_jax.perf.roofline.estimate` on an accelerator profile), times the devices one process
feeds. `ratio = loader tokens/s / required tokens/s`: >= 1 keeps up (a margin is wise: the
roofline step is an optimistic, i.e. short, estimate, so the real need is lower).
"""

from __future__ import annotations

import dataclasses
import time

from zaya_jax.config import ModelConfig, TrainConfig
from zaya_jax.data import DataConfig, make_train_iterator
from zaya_jax.parallel.accelerators import get_profile
from zaya_jax.perf import roofline


@dataclasses.dataclass(frozen=True)
class Required:
  """Tokens/s a process must deliver so the step never waits for data.

  Attributes:
    profile, num_devices, devices_per_process: the scale assumed.
    batch_size: global sequences per step; seq_len: tokens per sequence.
    tokens_per_device: batch_size * seq_len / num_devices, per step.
    step_seconds: roofline step time (seconds).
    per_device, per_process: tokens/s (per_process = per_device * devices_per_process).
  """

  profile: str
  num_devices: int
  devices_per_process: int
  batch_size: int
  seq_len: int
  tokens_per_device: int
  step_seconds: float
  per_device: float
  per_process: float


@dataclasses.dataclass(frozen=True)
class LoaderRate:
  """One measurement: `steps` batches of [batch_size, seq_len] with `num_workers` workers.

  Attributes:
    tokens_per_s: batch_size * seq_len * steps / seconds (padding included: rows delivered).
    first_batch_s: seconds to build the iterator and get its first batch (not in the rate).
    target_fraction: share of positions with loss_mask 1 (1 - padding and row ends).
  """

  num_workers: int
  batch_size: int
  seq_len: int
  steps: int
  seconds: float
  tokens_per_s: float
  first_batch_s: float
  target_fraction: float


def required_rate(model: ModelConfig, train: TrainConfig, *, profile: str = "mi300x",
                  num_devices: int = 64, devices_per_process: int = 8,
                  seq_len: int | None = None, dtype: str = "bfloat16") -> Required:
  """The loader throughput the training step needs (module docstring).

  Raises:
    ValueError: num_devices or devices_per_process < 1, or devices_per_process > num_devices;
      an unknown profile (from get_profile).
  """
  if num_devices < 1 or not 1 <= devices_per_process <= num_devices:
    raise ValueError(f"num_devices={num_devices}, devices_per_process={devices_per_process}: "
                     "need 1 <= devices_per_process <= num_devices")
  seq_len = seq_len or train.seq_len
  batch = -(-train.batch_size // num_devices) * num_devices
  est = roofline.estimate(model, get_profile(profile), num_devices=num_devices, batch_size=batch,
                          seq_len=seq_len, dtype=dtype, remat="full" if model.remat else "none")
  per_device = est.tokens_per_device / est.step_seconds
  return Required(profile=profile, num_devices=num_devices,
                  devices_per_process=devices_per_process, batch_size=batch, seq_len=seq_len,
                  tokens_per_device=est.tokens_per_device, step_seconds=est.step_seconds,
                  per_device=per_device, per_process=per_device * devices_per_process)


def measure_loader(data: DataConfig, *, seq_len: int, batch_size: int, num_workers: int,
                   steps: int, seed: int = 0) -> LoaderRate:
  """Times the training iterator of `data` with `num_workers` workers (module docstring).

  Args:
    data: the data config (its num_workers is replaced).
    seq_len, batch_size: T and the rows per batch on this process.
    steps: batches timed after the first, >= 1.

  Raises:
    ValueError: from the iterator (bad data.*), or steps < 1.
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  cfg = dataclasses.replace(data, num_workers=num_workers)
  t0 = time.perf_counter()
  it = make_train_iterator(cfg, seq_len=seq_len, batch_size=batch_size, seed=seed)
  next(it)
  t1 = time.perf_counter()
  real = 0.0
  for _ in range(steps):
    batch = next(it)
    real += float(batch["loss_mask"].sum())
  seconds = time.perf_counter() - t1
  if batch["inputs"].shape != (batch_size, seq_len):
    raise AssertionError(f"loader gave {batch['inputs'].shape}, asked [{batch_size}, {seq_len}]")
  close = getattr(it, "close", None)
  if close is not None:
    close()
  return LoaderRate(num_workers=num_workers, batch_size=batch_size, seq_len=seq_len, steps=steps,
                    seconds=seconds, tokens_per_s=batch_size * seq_len * steps / seconds,
                    first_batch_s=t1 - t0, target_fraction=real / (batch_size * seq_len * steps))


def format_report(rates: list[LoaderRate], need: Required) -> str:
  """A table: workers, loader tokens/s, first batch, ratio to the required rate."""
  lines = [
      f"required: {need.per_process:,.0f} tokens/s per process = {need.tokens_per_device:,} "
      f"tokens/device/step (batch {need.batch_size} x seq_len {need.seq_len} / "
      f"{need.num_devices} devices) / {need.step_seconds * 1e3:.1f} ms roofline step "
      f"({need.profile}) x {need.devices_per_process} devices per process",
      f"{'workers':>7}  {'tokens/s':>12}  {'first batch s':>13}  {'targets':>7}  {'loader/required':>15}"]
  for r in rates:
    lines.append(f"{r.num_workers:>7}  {r.tokens_per_s:>12,.0f}  {r.first_batch_s:>13.2f}  "
                 f"{r.target_fraction:>7.3f}  "
                 f"{r.tokens_per_s / need.per_process:>15.3f}")
  return "\n".join(lines)
