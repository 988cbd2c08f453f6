# Shape letters: none of the model legend (HLO and trace events are read as text).
"""Where a compiled step spends its time: the profiler's per-op durations by source line.

`op_profile(fn, args, steps, trace_dir)` runs a jitted function under `jax.profiler` (the
Perfetto trace), reads every HLO op's execution events (on XLA:CPU one event per thunk: a
fusion, a dot, a copy, a while loop's body ops each time they run) and attributes each op to
the innermost `zaya_jax` frame of its source stack in the compiled module's metadata
(`StackFrames` / `FileLocations`), e.g. `ops/cross_entropy.py:_linear_nll_sum_fwd`. The result
is the op time per source function (and per HLO op name), summed over the profiled steps and
divided by their count: a per-step breakdown that needs no TensorBoard. Op times are thread
time of the ops themselves; waiting and the Python around the step are not in them, so they
sum to less than the wall time when ops run in parallel or the host is idle.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable

import jax

_FILE_RE = re.compile(r'^(\d+) "(.*)"$')
_LOC_RE = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
_FRAME_RE = re.compile(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}")
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?"
                       r"metadata=\{op_name=\"([^\"]*)\"(?: stack_frame_id=(\d+))?")
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


@dataclasses.dataclass(frozen=True)
class OpSource:
  """Where an HLO op comes from: `source` "path/in/zaya_jax.py:function" (the innermost
  frame in the `zaya_jax` package; "other" when none) and the JAX `op_name` path."""

  source: str
  op_name: str


def hlo_op_sources(hlo_text: str, package: str = "zaya_jax") -> dict[str, OpSource]:
  """{HLO instruction name: its `OpSource`} from a compiled module's text
  (`Compiled.as_text()`, which carries the stack-frame tables and `stack_frame_id`s); the
  source is the innermost frame in a file under a `package` directory."""
  tables: dict[str, dict[int, Any]] = {s: {} for s in _SECTIONS}
  section = None
  sources: dict[str, OpSource] = {}
  raw: dict[str, tuple[str, int | None]] = {}
  for line in hlo_text.splitlines():
    if line in _SECTIONS:
      section = line
      continue
    if section is not None:
      if section in ("FileNames", "FunctionNames") and (m := _FILE_RE.match(line)):
        tables[section][int(m.group(1))] = m.group(2)
        continue
      if section == "FileLocations" and (m := _LOC_RE.match(line)):
        tables[section][int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        continue
      if section == "StackFrames" and (m := _FRAME_RE.match(line)):
        tables[section][int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        continue
      section = None
    if m := _INSTR_RE.match(line):
      raw[m.group(1)] = (m.group(2), int(m.group(3)) if m.group(3) else None)
  marker = os.sep + package + os.sep

  def source_of(frame: int | None) -> str:
    seen = set()
    while frame is not None and frame in tables["StackFrames"] and frame not in seen:
      seen.add(frame)
      location, parent = tables["StackFrames"][frame]
      file_id, function_id = tables["FileLocations"].get(location, (0, 0))
      path = tables["FileNames"].get(file_id, "")
      if marker in path:
        return f"{path.split(marker, 1)[1]}:{tables['FunctionNames'].get(function_id, '?')}"
      frame = parent
    return "other"

  for name, (op_name, frame) in raw.items():
    sources[name] = OpSource(source_of(frame), op_name)
  return sources


def trace_op_times(trace_dir: str) -> dict[str, tuple[float, int]]:
  """{op name: (total seconds, events)} of the newest Perfetto trace under `trace_dir`
  (`jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)`).

  Raises:
    ValueError: no `perfetto_trace.json.gz` under `trace_dir`.
  """
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not files:
    raise ValueError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(files[-1], "rt", encoding="utf-8") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      out[e["name"]][0] += e["dur"] * 1e-6  # microseconds
      out[e["name"]][1] += 1
  return {k: (v[0], v[1]) for k, v in out.items()}


def op_profile(fn: Callable[..., Any], args: tuple, *, steps: int,
               feed: Callable[[Any, tuple], tuple] | None = None,
               trace_dir: str | None = None, package: str = "zaya_jax") -> dict[str, Any]:
  """Profiles `steps` calls of the jitted `fn(*args)` (already compiled and warmed up).

  Args:
    fn: a `jax.jit` function; `fn.lower(*args).compile().as_text()` gives its module.
    args: its arguments for the first call.
    steps: calls to profile (>= 1).
    feed: `(output, args) -> next args` (e.g. the new train state with the same batch);
      None: the same `args` every call.
    trace_dir: where the trace goes (None: a temporary directory, removed after).
    package: the top-level package whose innermost frame names an op's source.

  Returns:
    {"steps", "op_seconds" (op time per step), "by_source": [(source, seconds per step,
    share of op time)], "by_op": [(HLO op, source, op_name, seconds per step, runs per step)]},
    both sorted by time, largest first.

  Raises:
    ValueError: steps < 1, or no HLO op of `fn` in the trace.
  """
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1")
  sources = hlo_op_sources(fn.lower(*args).compile().as_text(), package)
  with tempfile.TemporaryDirectory() as tmp:
    directory = trace_dir or tmp
    jax.profiler.start_trace(directory, create_perfetto_trace=True)
    try:
      out = None
      for _ in range(steps):
        out = fn(*args)
        if feed is not None:
          args = feed(out, args)
      jax.block_until_ready(out)
    finally:
      jax.profiler.stop_trace()
    times = trace_op_times(directory)
  ops = {name: t for name, t in times.items() if name in sources}
  if not ops:
    raise ValueError("the trace holds no op of the profiled function's HLO module")
  total = sum(t for t, _ in ops.values())
  by_source: dict[str, float] = collections.defaultdict(float)
  for name, (t, _) in ops.items():
    by_source[sources[name].source] += t
  return {
      "steps": steps,
      "op_seconds": total / steps,
      "by_source": sorted(((s, t / steps, t / total) for s, t in by_source.items()),
                          key=lambda r: -r[1]),
      "by_op": sorted(((n, sources[n].source, sources[n].op_name, t / steps, c / steps)
                       for n, (t, c) in ops.items()), key=lambda r: -r[3]),
  }


def format_profile(r: dict[str, Any], top: int = 20) -> str:
  """An `op_profile` result as two tables: op time per source function, then the top ops."""
  lines = [f"op time per step {1000 * r['op_seconds']:.1f} ms over {r['steps']} steps, "
           "by source (innermost zaya_jax frame):",
           f"{'ms/step':>9}  {'share':>6}  source"]
  lines += [f"{1000 * t:9.1f}  {100 * s:5.1f}%  {src}" for src, t, s in r["by_source"][:top]]
  lines += ["", f"top {top} ops:", f"{'ms/step':>9}  {'runs':>5}  op / source / op_name"]
  lines += [f"{1000 * t:9.1f}  {c:5.0f}  {n}  {src}  {op[-70:]}"
            for n, src, op, t, c in r["by_op"][:top]]
  return "\n".join(lines)
