# Shape letters: L X (see zaya_jax/__init__.py).
"""Training metrics: `metrics.jsonl` (the record of truth) and TensorBoard event files.

`MetricsWriter` (process 0 only) appends every record to `workdir/metrics.jsonl`, one JSON
object per line, and mirrors it into TensorBoard event files in `workdir/tensorboard/`
(`tensorboard --logdir WORKDIR/tensorboard`). TensorBoard tags are `<kind>/<key>`:

  scalar (int, float, bool)    `train/loss`, `eval/loss`, `train/lr`, `train/skipped_steps`,
                               `train/moe/dropped_fraction`, ... at the record's `step`
  1-D list (one per layer)     one scalar per layer, `<kind>/<key>/layer_<i>`
  2-D list (e.g. `expert_load` [L][X], skip class last)
                               an image `<kind>/<key>`: rows = layers, columns = classes,
                               viridis colours from min(0, its min) to its max
  nested dict                  `<kind>/<key>/<sub key>`
  None, strings, ragged or >2-D lists
                               not written to TensorBoard (they stay in metrics.jsonl)

Records (written by zaya_jax/train/loop.py): "train" records' `loss` is the mean of the
finite step losses of the log window (the steps since the previous train record) and
`loss_last` the logged step's own batch loss; `step_time_s`, `tokens_per_s`,
`tokens_per_s_per_device`, `mfu` (a fraction), `peak_memory_bytes` and `eta_s` (seconds) are
measured over the window without the compile step, evaluations and checkpoint saves (None
when the window holds only the compile step). "eval" records add `eval_time_s`. One
"summary" record ends each run (`ended`, `steps_this_run`, `tokens_this_run`, `train_loss`,
`eval_loss`, `tokens_per_s`, `*_time_s`); readers select records by `kind`.

Eval records with a finite `loss` (nats per token) get `perplexity` = exp(loss) added,
in metrics.jsonl too, unless the record already has one.

Resume: `MetricsWriter(..., resume_step=S)` first drops the records after step `S` from
metrics.jsonl (`truncate_metrics`: they were written by a process that died after its last
checkpoint), and starts a new event file (every writer does: the name holds the start time,
host, process id and a counter) whose first event tells TensorBoard to hide the events of
steps > S from the older files (tensorboardX's `purge_step`), so the steps trained again
show once, with their new values. Event files are flushed every 10 s and on `close()`; a
killed process loses at most the last 10 s of TensorBoard events, never a metrics.jsonl
line (flushed per record). `launch.plot` reads metrics.jsonl, not the event files.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_TB_FLUSH_SECS = 10
_writer_ids = itertools.count()  # distinguishes event files opened within one second


def _tensorboardx():
  """The `tensorboardX` module, imported on first use (only process 0 writes events) and
  without importing torch: tensorboardX's writer imports torch at import time when it is
  installed, only so that it also accepts torch tensors (we pass numpy and floats), which
  costs every training run about 1 s of start-up (1.1 s measured on 2 cores) where torch is
  installed (the test environment, conversion checks). Where torch is already imported, it
  is used as usual. (While tensorboardX loads, `sys.modules["torch"]` is None: another
  thread importing torch in that moment would get ImportError; no thread of a training
  process imports torch.)
  """
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    import tensorboardX  # pylint: disable=import-outside-toplevel
    return tensorboardX
  sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
  try:
    import tensorboardX  # pylint: disable=import-outside-toplevel
  finally:
    del sys.modules["torch"]
  return tensorboardX


def truncate_metrics(path: str, step: int) -> None:
  """Drops records after `step` (written by a run that died after its last checkpoint), so a
  resumed run's `metrics.jsonl` has one record per (kind, step)."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()

  def before_resume(line: str) -> bool:
    try:
      return json.loads(line).get("step", 0) <= step
    except json.JSONDecodeError:  # a line cut short by a killed process
      return False

  keep = [l for l in lines if l.strip() and before_resume(l)]
  if len(keep) != len(lines):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(keep)
    os.replace(tmp, path)


def with_perplexity(record: dict[str, Any]) -> dict[str, Any]:
  """`record` plus `perplexity` = exp(loss) if it is an eval record with a finite `loss`."""
  loss = record.get("loss")
  if (record.get("kind") != "eval" or "perplexity" in record or not _is_number(loss)
      or not math.isfinite(loss) or loss > 700.0):  # exp(>709) overflows a float64
    return record
  return {**record, "perplexity": math.exp(loss)}


def _is_number(value: Any) -> bool:
  return isinstance(value, (bool, int, float, np.number)) and not isinstance(value, complex)


def tensorboard_items(record: dict[str, Any]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
  """Splits a metrics record into TensorBoard scalars and 2-D arrays (tag scheme: module doc).

  Args:
    record: a metrics.jsonl record: `kind`, `step` and any other keys.

  Returns:
    (scalars, arrays): tag -> float, and tag -> float64 [rows, columns] for 2-D lists.
  """
  scalars: dict[str, float] = {}
  arrays: dict[str, np.ndarray] = {}

  def add(tag: str, value: Any) -> None:
    if value is None or isinstance(value, str):
      return
    if isinstance(value, dict):
      for k, v in value.items():
        add(f"{tag}/{k}", v)
      return
    if _is_number(value):
      scalars[tag] = float(value)
      return
    try:
      array = np.asarray(value)
    except ValueError:  # ragged
      return
    if array.dtype.kind not in "biuf":  # holding None or strings
      return
    array = array.astype(np.float64)
    if array.ndim == 0:
      scalars[tag] = float(array)
    elif array.ndim == 1:
      for i, v in enumerate(array):
        scalars[f"{tag}/layer_{i}"] = float(v)
    elif array.ndim == 2 and array.size:
      arrays[tag] = array

  kind = record.get("kind", "metrics")
  for key, value in record.items():
    if key not in ("kind", "step"):
      add(f"{kind}/{key}", value)
  return scalars, arrays


def heatmap_image(array_RC: np.ndarray, max_pixels: int = 512) -> np.ndarray:
  """float [R, C] -> uint8 [H, W, 3] viridis image, each cell a square block of pixels.

  Colours span [min(0, array min), array max] (NaN -> black); blocks are 4-32 pixels, chosen so the
  longer side stays within `max_pixels` where it can.
  """
  from matplotlib import colormaps  # pylint: disable=import-outside-toplevel

  finite = np.where(np.isfinite(array_RC), array_RC, 0.0)
  low, high = min(float(np.min(finite)), 0.0), float(np.max(finite))
  scaled = (finite - low) / (high - low) if high > low else np.zeros_like(finite)
  rgb = (colormaps["viridis"](scaled)[..., :3] * 255).astype(np.uint8)
  rgb[~np.isfinite(array_RC)] = 0
  cell = int(np.clip(max_pixels // max(array_RC.shape), 4, 32))
  return np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)


class MetricsWriter:
  """Appends records to `metrics.jsonl` and TensorBoard (process 0 only; others write nothing).

  Args:
    path: the metrics.jsonl file; event files go to `tensorboard/` beside it.
    enabled: False on processes other than 0: every method does nothing.
    resume_step: the step training resumes from (a restored checkpoint's), or None for a
      fresh run: records after it are dropped from `path` and hidden in TensorBoard.
    tensorboard: False writes metrics.jsonl only.
  """

  def __init__(self, path: str, enabled: bool, resume_step: int | None = None,
               tensorboard: bool = True):
    self._file = None
    self._tb = None
    if not enabled:
      return
    if resume_step is not None:
      truncate_metrics(path, resume_step)
    self._file = open(path, "a", encoding="utf-8")
    if tensorboard:
      self._tb = _tensorboardx().SummaryWriter(
          os.path.join(os.path.dirname(os.path.abspath(path)), TENSORBOARD_DIR),
          purge_step=None if resume_step is None else resume_step + 1,
          flush_secs=_TB_FLUSH_SECS,
          filename_suffix=f".{os.getpid()}.{next(_writer_ids):04d}")

  @property
  def tensorboard_dir(self) -> str | None:
    """The event file directory, or None when TensorBoard output is off."""
    return None if self._tb is None else self._tb.logdir

  def write(self, record: dict[str, Any]) -> None:
    """Writes one record (`kind`, `step`, metrics); eval records gain `perplexity`."""
    if self._file is None:
      return
    record = with_perplexity(record)
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    step = record.get("step")
    if self._tb is None or not _is_number(step):
      return
    scalars, arrays = tensorboard_items(record)
    for tag, value in scalars.items():
      self._tb.add_scalar(tag, value, int(step))
    for tag, array in arrays.items():
      self._tb.add_image(tag, heatmap_image(array), int(step), dataformats="HWC")

  def close(self) -> None:
    """Flushes and closes both outputs (idempotent)."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def read_metrics(workdir: str, flag: str = "--workdir") -> list[dict[str, Any]]:
  """The records of `workdir/metrics.jsonl` in file order (a line cut short is skipped).
  `flag`: the command-line flag that gave `workdir`, named in the error.

  Raises:
    FileNotFoundError: no metrics.jsonl in `workdir`.
  """
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(
        f"{flag}={workdir!r} has no {METRICS_FILE}: pass the --workdir of a launch.train "
        "run (it writes metrics.jsonl there from its first log step).")
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line cut short by a killed process
        continue
      if isinstance(record, dict):
        records.append(record)
  return records


def train_records(records: list[dict[str, Any]], workdir: str = "") -> list[dict[str, Any]]:
  """The `kind == "train"` records; ValueError naming `workdir` if there are none."""
  train = [r for r in records if r.get("kind") == "train" and _is_number(r.get("step"))]
  if not train:
    raise ValueError(
        f"{os.path.join(workdir, METRICS_FILE)} has no train records yet: the first is written "
        "at step train.log_every; train longer or lower --config.train.log_every.")
  return train


def mean_expert_load(records: list[dict[str, Any]], window: int) -> tuple[np.ndarray, list[int]]:
  """Mean `expert_load` [L, X] over the last `window` train records that have one.

  Records whose load has another shape than the newest one (another model) are ignored.

  Args:
    records: metrics records in file order (any kinds).
    window: how many of the newest train records to average, >= 1.

  Returns:
    (float64 [L, X] mean fraction of each layer's tokens per class (skip class last), the
    steps of the averaged records).
  """
  if window < 1:
    raise ValueError(f"window={window} must be >= 1 (the number of train records averaged)")
  loads = [(r["step"], np.asarray(r["expert_load"], np.float64)) for r in records
           if r.get("kind") == "train" and r.get("expert_load") is not None]
  loads = [(s, a) for s, a in loads if a.ndim == 2 and a.size]
  if not loads:
    raise ValueError("no train record has an expert_load [layers][classes] list")
  shape = loads[-1][1].shape
  loads = [(s, a) for s, a in loads if a.shape == shape][-window:]
  return np.mean([a for _, a in loads], axis=0), [int(s) for s, _ in loads]


def series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) float64 arrays of `key` in the `kind` records that have it as a number."""
  pairs = [(r["step"], r[key]) for r in records if r.get("kind") == kind
           and _is_number(r.get("step")) and _is_number(r.get(key))]
  if not pairs:
    return np.zeros(0), np.zeros(0)
  steps, values = zip(*pairs)
  return np.asarray(steps, np.float64), np.asarray(values, np.float64)

