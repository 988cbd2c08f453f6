"""What `launch.train` prints (process 0), and the throughput figures it also records.

- `LogWindow`: the steps since the last log line: their losses (device scalars, fetched at
  the log step, so the host never waits on a step it just dispatched), and their wall time
  with evaluation and checkpoint time excluded (`with window.excluded(): ...`).
- `throughput`: step time, tokens/s (total and per device), MFU and ETA of one window.
- `header_lines`, `step_line`, `eval_line`, `saved_line`, `summary_lines`, `stop_warning`:
  the console text; `run_ended`: how the run ended (the summary's first line and record).
- `data_summary`: documents of each split and (byte tokenizer) tokens of the train split.
- `write_json_atomic`: WORKDIR/config.json, replaced in one rename.

MFU = `train_flops_per_token` (zaya_jax.model.sizing: 3 x forward, active experts only) x
tokens/s / peak FLOP/s of the run, where the peak is the detected accelerator profile's dense
peak for the model dtype x devices, or on a CPU a matmul peak measured once at start x
processes (a CPU's devices share the host's cores, so the measured peak is per host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Iterator

import numpy as np

from zaya_jax.data import prepared, sources


class LogWindow:
  """Losses and wall time of the steps since the last log line.

  Args:
    clock: seconds, monotonic (default `time.perf_counter`); tests inject a fake one.
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self._clock = clock
    self.reset()

  def reset(self) -> None:
    """Starts an empty window now (after a log line, the compile step or a rollback)."""
    self._start = self._clock()
    self._excluded = 0.0
    self._losses: list[Any] = []

  def add(self, loss: Any) -> None:
    """Adds one step: its loss, a scalar (a device array is kept unfetched)."""
    self._losses.append(loss)

  @property
  def steps(self) -> int:
    """Steps added since the last `reset`."""
    return len(self._losses)

  @contextlib.contextmanager
  def excluded(self) -> Iterator[None]:
    """The time spent inside (an evaluation, a checkpoint save) does not count."""
    start = self._clock()
    try:
      yield
    finally:
      self._excluded += self._clock() - start

  def elapsed(self) -> float:
    """Seconds since `reset`, less the excluded time."""
    return self._clock() - self._start - self._excluded

  def mean_loss(self) -> float:
    """Mean of the window's finite step losses (a skipped update's loss is NaN/inf and left
    out); NaN if there is none. Fetches the device scalars (blocks until those steps ran)."""
    import jax  # pylint: disable=import-outside-toplevel

    losses = np.asarray(jax.device_get(self._losses), np.float64).reshape(-1)
    finite = losses[np.isfinite(losses)]
    return float(finite.mean()) if finite.size else float("nan")


def throughput(steps: int, seconds: float, tokens_per_step: int, devices: int,
               flops_per_token: float, peak_flops: float | None,
               remaining_steps: int) -> dict[str, float | None]:
  """The metrics.jsonl throughput fields of a window of `steps` steps taking `seconds`.

  Args:
    steps: steps in the window (0: the compile step, every field None).
    seconds: their wall time, eval and checkpoint time excluded.
    tokens_per_step: global batch size x seq_len.
    devices: devices of the run.
    flops_per_token: training FLOPs per token.
    peak_flops: the run's total peak FLOP/s (all devices), or None (MFU None).
    remaining_steps: steps left in this run.

  Returns:
    {"step_time_s": s, "tokens_per_s": total, "tokens_per_s_per_device", "mfu": fraction in
    [0, 1], "eta_s": remaining_steps x step_time_s}.
  """
  if steps <= 0 or seconds <= 0:
    return dict.fromkeys(("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu",
                          "eta_s"))
  step_time = seconds / steps
  tok_s = tokens_per_step / step_time
  return {"step_time_s": step_time, "tokens_per_s": tok_s,
          "tokens_per_s_per_device": tok_s / devices,
          "mfu": flops_per_token * tok_s / peak_flops if peak_flops else None,
          "eta_s": remaining_steps * step_time}


def si(x: float | None, digits: int = 3) -> str:
  """1234567 -> '1.23M' (k, M, G, T); None -> '-'."""
  if x is None or not math.isfinite(x):
    return "-"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.{digits}g}{unit}"
  return f"{x:.{digits}g}"


def duration(seconds: float | None) -> str:
  """4321.0 -> '1h12m', 75 -> '1m15s', 3.21 -> '3.2s'; None -> '-'."""
  if seconds is None or not math.isfinite(seconds):
    return "-"
  if seconds < 60:
    return f"{seconds:.1f}s"
  s = int(round(seconds))
  h, m = divmod(s // 60, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


def gib(n: int | None) -> str:
  """Bytes -> '1.23 GiB' / '456 MiB' / '12 KiB'; None -> '-'."""
  if n is None:
    return "-"
  if n >= 2**30:
    return f"{n / 2**30:.2f} GiB"
  return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def step_line(step: int, num_steps: int, m: dict[str, Any]) -> str:
  """One console line of a train record `m` (keys of the metrics.jsonl train record):
  'step 10/300 | loss 3.2500 lr 3.00e-04 gnorm 0.500 | 125 ms 16.4k tok/s (8.19k/dev) MFU
  1.2% ETA 1m30s | mem 1.50GiB | load max/mean 1.50 H 0.90 skip 0.10 router 1.20' (load:
  the worst layer's max/mean expert load and min normalised entropy; skip: skip-class rate;
  router: router entropy in nats; the per-device rate only with several devices)."""
  parts = [f"step {step}/{num_steps}",
           f"loss {m['loss']:.4f} lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f}"]
  if m.get("step_time_s") is None:
    parts.append("first step (compile)")
  else:
    mfu = m.get("mfu")
    per_device = ("" if m["tokens_per_s_per_device"] == m["tokens_per_s"] else  # 1 device
                  f" ({si(m['tokens_per_s_per_device'])}/dev)")
    parts.append(f"{m['step_time_s'] * 1e3:.0f} ms {si(m['tokens_per_s'])} tok/s{per_device} "
                 f"MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'} ETA {duration(m['eta_s'])}")
  parts.append(f"mem {gib(m.get('peak_memory_bytes')).replace(' ', '')}")
  if m.get("data/padding_fraction", 0.0) >= 0.0005:  # packing left padding (e.g. best_fit)
    parts[-1] += f" pad {100 * m['data/padding_fraction']:.1f}%"
  parts.append(f"load max/mean {m['balance/max_over_mean_max']:.2f} "
               f"H {m['balance/load_entropy_min']:.2f} skip {m['balance/skip_rate_mean']:.2f} "
               f"router {m['router/entropy_mean']:.2f}")
  if m.get("skipped_steps"):
    parts.append(f"{int(m['skipped_steps'])} skipped")
  return " | ".join(parts)


def eval_line(step: int, record: dict[str, Any], perplexity: float, seconds: float) -> str:
  """'eval step 100 | loss 3.2500 | ppl 25.79 | 8192 tokens | 1.5 s | wiki 3.1000 | ...' of an
  eval record (a mixture: one part per source's loss)."""
  return "eval step %d | loss %.4f | ppl %.2f | %d tokens | %.1f s%s" % (
      step, record["loss"], perplexity, record["tokens"], seconds,
      "".join(f" | {name} {r['loss']:.4f}" for name, r in record.get("sources", {}).items()))


def saved_line(step: int, seconds: float, async_save: bool) -> str:
  """'saved checkpoint 100 in 1.23 s' (+ that an async save goes on in the background)."""
  return "saved checkpoint %d in %.2f s%s" % (
      step, seconds, " (async: the call; writing goes on in the background)" if async_save
      else "")


def data_summary(data_cfg: Any, tokens_needed: int, corpora: list | None = None,
                 documents: list | None = None) -> str:
  """'stdlib: 1,234 train documents (~20.1M tokens, 0.03 epochs this run), 12 eval documents'.

  Counts come from listing the corpus (no tokenizing), or from `documents` (the listing the
  training iterator was built from, not listed again); train tokens are known only for the
  byte tokenizer (one token per UTF-8 byte, + BOS/EOS), from file sizes and .jsonl line
  lengths. `tokens_needed` = steps x tokens per step. Errors of the listing give '?'.
  Prepared corpora: counts from the manifests of `corpora` (the training iterator's opened
  sources, not opened again) or of opening them; the split's counts are expected values.
  """
  if prepared.uses_prepared(data_cfg):
    return _prepared_summary(data_cfg, tokens_needed, corpora)
  refs = documents
  if refs is None:
    try:
      refs = sources.list_documents(data_cfg)
    except (ValueError, OSError):
      return f"{data_cfg.source}: ?"
  train, held_out = sources.split_documents(refs, data_cfg.eval_fraction)
  text = f"{data_cfg.source}: {len(train):,} train documents"
  if data_cfg.tokenizer == "byte":
    tokens = _byte_sizes(train) + len(train) * (int(data_cfg.add_bos) + int(data_cfg.add_eos))
    if tokens:
      text += f" (~{si(tokens)} tokens, {tokens_needed / tokens:.2f} epochs this run)"
  return text + f", {len(held_out):,} eval documents"


def _prepared_summary(data_cfg: Any, tokens_needed: int, corpora: list | None) -> str:
  """data_summary of prepared corpora: counts from the manifests and lengths files, one
  'DIR: ...' part per source; '?' for a corpus that cannot be opened."""
  if corpora is None:
    try:
      corpora = prepared.open_sources(dataclasses.replace(data_cfg, verify_checksums=False))
    except (ValueError, OSError):
      return f"{data_cfg.mixture or data_cfg.source}: ?"
  total = sum(w for _, w in corpora)
  parts = []
  for corpus, weight in corpora:
    # From the manifest: the split is decided per document when a shard is read, so only
    # its expected share is known without reading every lengths file (issue 27).
    keep = 1.0 - data_cfg.eval_fraction
    tokens = corpus.tokens_total * keep
    share = tokens_needed * weight / total
    text = (f"{corpus.directory}: ~{si(len(corpus) * keep)} train documents (~{si(tokens)} "
            f"tokens, {share / max(tokens, 1):.2f} epochs this run)")
    if len(corpora) > 1:
      text += f" weight {weight / total:.2f}"
    parts.append(text + f", ~{si(len(corpus) * data_cfg.eval_fraction)} eval documents "
                 f"(of {len(corpus):,})")
  return "; ".join(parts)


def _byte_sizes(refs: list[Any]) -> int:
  """Total UTF-8 bytes of the documents `refs` (whole files: their size; .jsonl lines: the
  line length, JSON overhead included; .json elements: the text)."""
  total = 0
  by_path: dict[str, list[int]] = {}
  for r in refs:
    if r.text is not None:
      total += len(r.text.encode("utf-8"))
    elif r.offset < 0:
      total += os.path.getsize(r.path)
    else:
      by_path.setdefault(r.path, []).append(r.offset)
  for path, offsets in by_path.items():
    with open(path, "rb") as f:
      for off in offsets:
        f.seek(off)
        total += len(f.readline())
  return total


def header_lines(*, resuming: bool, step: int, num_steps: int, params_total: int,
                 params_active: int, layers: int, experts: int, devices: int, processes: int,
                 mesh_shape: dict[str, int], workdir: str, accelerator: str,
                 peak_flops: float | None, peak_measured: bool, batch_size: int, seq_len: int,
                 data: str) -> list[str]:
  """The console header (first line kept as tests and users grep it:
  'Starting|Resuming at step S/N: ...')."""
  tokens_per_step = batch_size * seq_len
  context = mesh_shape.get("context", 1)
  split = (f"; context parallelism: each sequence in {2 * context} zigzag chunks of "
           f"{seq_len // (2 * context):,} tokens over {context} devices" if context > 1 else "")
  peak = "no peak known: MFU not reported" if not peak_flops else (
      f"peak {si(peak_flops)}FLOP/s" + (" (cpu: measured matmul peak)" if peak_measured else
                                        f" ({accelerator} dense peak x {devices})"))
  return [
      f"{'Resuming' if resuming else 'Starting'} at step {step}/{num_steps}: "
      f"{params_total / 1e6:.2f}M parameters ({params_active / 1e6:.2f}M active), "
      f"{layers} layers x {experts} experts, {devices} devices ({processes} processes), "
      f"mesh {mesh_shape}, workdir {workdir}",
      f"  accelerator {accelerator}; {peak}",
      f"  global batch {batch_size} sequences x {seq_len} tokens = {tokens_per_step:,} tokens "
      f"per step; {num_steps} steps = {si(num_steps * tokens_per_step)} tokens{split}",
      f"  data {data}",
      f"  config: {os.path.join(workdir, 'config.json')}; optimizer parameter groups: "
      f"{os.path.join(workdir, 'optimizer.txt')}",
  ]


def mean_tokens_per_s(times: dict[str, float]) -> float | None:
  """The run's mean tokens/s: `times["train_tokens"]` (the steps after the compile step) /
  `times["train"]` (seconds); None when no step was timed (a run stopped in its first step)."""
  if not times.get("train") or not times.get("train_tokens"):
    return None
  return times["train_tokens"] / times["train"]


def summary_lines(*, ended: str, steps_this_run: int, times: dict[str, float],
                  tokens_this_run: int, train_loss: float | None, eval_record: dict | None,
                  checkpoint_step: int | None, checkpoint_dir: str, metrics_path: str,
                  tensorboard_dir: str | None) -> list[str]:
  """The end-of-run block. `times`: seconds of "total", "compile", "train", "eval",
  "checkpoint"; mean tok/s = times["train_tokens"] (the steps after the compile step) /
  times["train"], "-" when no step was timed (a run stopped during its first step);
  `checkpoint_step` None: "no checkpoint in DIR"."""
  tok_s = mean_tokens_per_s(times)
  lines = [
      f"run ended: {ended}; {steps_this_run} steps this run in {duration(times['total'])} "
      f"(compile {duration(times['compile'])}, train {duration(times['train'])}, eval "
      f"{duration(times['eval'])}, checkpoint {duration(times['checkpoint'])})",
      f"  {si(tokens_this_run)} tokens this run, {si(tok_s)} tok/s mean; final train loss "
      + ("-" if train_loss is None else f"{train_loss:.4f}") + " (log-window mean)"
      + ("" if not eval_record else f"; eval loss {eval_record['loss']:.4f}, ppl "
         f"{eval_record.get('perplexity', float('nan')):.2f} at step {eval_record['step']}"),
      (f"  checkpoint {checkpoint_step} in {checkpoint_dir}" if checkpoint_step is not None
       else f"  no checkpoint in {checkpoint_dir}"),
      f"  metrics {metrics_path}; tensorboard {tensorboard_dir or '-'}",
  ]
  return lines


def run_ended(*, stop_reason: str | None, step: int, num_steps: int, steps_this_run: int,
              max_steps_per_run: int) -> str:
  """How the run ended: 'stopped by SIGTERM' | 'finished' | 'nothing to train (num_steps
  reached)' | 'train.max_steps_per_run=N reached' (the summary record's `ended`)."""
  if stop_reason:
    return f"stopped by {stop_reason}"
  if step >= num_steps:
    return "finished" if steps_this_run else "nothing to train (num_steps reached)"
  return f"train.max_steps_per_run={max_steps_per_run} reached"


def stop_warning(*, stop_reason: str | None, first_step_stop: bool, step: int, num_steps: int,
                 checkpoint_step: int | None, checkpoint_dir: str, workdir: str) -> str | None:
  """After a stop signal: what was saved and how to resume; None if no signal stopped the
  run. `first_step_stop`: it came during this run's first step, so nothing was saved."""
  if first_step_stop:
    return "Stopped by %s during the first step of this run: nothing was saved; %s" % (
        stop_reason, f"checkpoint {checkpoint_step} in {checkpoint_dir} is unchanged. Rerun "
        "the same command to resume." if checkpoint_step is not None else
        f"{workdir} holds no checkpoint, so the next run starts over (with any config).")
  if stop_reason:
    return ("Stopped by %s at step %d/%d; checkpoint %d is in %s. Rerun the same command to "
            "resume." % (stop_reason, step, num_steps, checkpoint_step, checkpoint_dir))
  return None


def memory_analysis(compiled) -> str:
  """' (memory: arguments A, outputs O, temporaries T)' of an AOT-compiled program, or ''
  where the backend reports none."""
  try:
    mem = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return ""
  if mem is None:
    return ""
  return (f" (memory: arguments {gib(mem.argument_size_in_bytes)}, outputs "
          f"{gib(mem.output_size_in_bytes)}, temporaries "
          f"{gib(mem.temp_size_in_bytes)})")


def write_json_atomic(path: str, record: dict[str, Any]) -> None:
  """Writes `record` as indented JSON to `path` via a temporary file and one rename, so a
  reader never sees half a file."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
