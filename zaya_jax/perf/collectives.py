"""Collective micro-benchmarks: time, algorithm and bus bandwidth of XLA collectives, checked.

The paper's systems half (arXiv 2511.17127 §3) characterises all-reduce, reduce-scatter,
all-gather and broadcast across message sizes and GPU counts; all-to-all is added for expert
parallelism. Each collective runs under `jax.shard_map` over one mesh axis or a tuple of
axes (a group of `n` devices; the mesh's other axes form independent groups that run the
same collective at the same time), jitted, on every message size, and reports:

  time     median wall seconds of one call over `repeats` calls, after `warmup` calls;
  algbw    size / time, in GB/s (1e9 bytes per second, as nccl-tests);
  busbw    algbw x the nccl-tests factor: all-reduce 2(n-1)/n; reduce-scatter, all-gather
           and all-to-all (n-1)/n; broadcast 1 (what each link carries, comparable across n);
  correct  the output equals numpy's computation of what the collective must produce from
           device-dependent inputs (every addressable shard, every process).

"size" follows nccl-tests per collective (`buffer_lengths`): all-reduce and broadcast, the
per-device buffer (input = output); reduce-scatter, the full per-device input (each device
keeps size/n); all-gather, the full per-device output (each device contributes size/n);
all-to-all, the per-device send buffer (= receive buffer; size/n goes to each peer).

Lowering (the CSV's `lowering` column is the collective op found in the compiled HLO):
psum -> all-reduce, psum_scatter -> reduce-scatter, all_gather -> all-gather, all_to_all ->
all-to-all. Broadcast from the group's rank 0 is `jax.lax.pbroadcast` where JAX lowers it
(GPU: the CollectiveBroadcast HLO, ncclBroadcast); elsewhere (XLA:CPU has no lowering) it is
pbroadcast's documented equivalent, a psum of the input masked to rank 0, i.e. an all-reduce,
so its busbw there is an all-reduce's time under broadcast's factor 1.

Inputs are small integers, `((m * 131 + i * 7) % (2B + 1)) - B` for device m (its index in
the mesh's device array) and element i, with B small enough that every partial sum is exact
in the dtype, so the check is exact equality.

Letters: L elements of one device's buffer; n devices in a group.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from matplotlib.figure import Figure

from zaya_jax.config.mesh import parse_meshes
from zaya_jax.parallel.mesh import EXPERT, MESH_AXES, MeshConfig, make_mesh
from zaya_jax.perf import report
from zaya_jax.perf.nccl import (COLLECTIVES, bandwidths, buffer_lengths, element_count,
                                expected_block, input_block, value_bound)
from pallas_kernels.timing import median_seconds

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "int32": jnp.int32}
HLO_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                   "collective-broadcast", "collective-permute")
CSV_COLUMNS = ("collective", "lowering", "mesh", "axes", "n", "num_devices", "processes", "dtype",
               "size_bytes", "count", "time_s", "algbw_GBps", "busbw_GBps", "correct",
               "max_abs_err")


@dataclasses.dataclass(frozen=True)
class Group:
  """Where a collective runs: `mesh`, over `axes` (in this order; ranks are row-major in it)."""

  mesh: Mesh
  axes: tuple[str, ...]

  @property
  def n(self) -> int:
    """Devices per group: the product of the sizes of `axes`."""
    return math.prod(self.mesh.shape[a] for a in self.axes)

  @property
  def mesh_label(self) -> str:
    """Mesh shape as "data,fsdp,expert" sizes, e.g. "1,2,4"."""
    return ",".join(str(self.mesh.shape[a]) for a in MESH_AXES)

  def members(self) -> np.ndarray:
    """[groups, n] int: mesh device indices (row-major in `mesh.devices`) by group and rank."""
    ids = np.arange(self.mesh.devices.size).reshape(self.mesh.devices.shape)
    names = list(self.mesh.axis_names)
    others = [i for i, a in enumerate(names) if a not in self.axes]
    order = others + [names.index(a) for a in self.axes]
    return ids.transpose(order).reshape(-1, self.n)


# --------------------------------------------------------------------------------------------
# The collectives and the programs that run them.
# --------------------------------------------------------------------------------------------


def has_pbroadcast(platform: str) -> bool:
  """True where JAX lowers `jax.lax.pbroadcast` (to CollectiveBroadcast): GPU backends only."""
  return platform in ("gpu", "cuda", "rocm")


def collective_op(collective: str, axes: tuple[str, ...], platform: str) -> Callable:
  """The per-device function `v_L -> y` of `collective` over `axes` (see `buffer_lengths`).

  Raises:
    ValueError: unknown collective.
  """
  if collective == "all_reduce":
    return lambda v: jax.lax.psum(v, axes)
  if collective == "reduce_scatter":
    return lambda v: jax.lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True)
  if collective == "all_gather":
    return lambda v: jax.lax.all_gather(v, axes, axis=0, tiled=True)
  if collective == "all_to_all":
    return lambda v: jax.lax.all_to_all(v, axes, 0, 0, tiled=True)
  if collective == "broadcast":
    if has_pbroadcast(platform):
      return lambda v: jax.lax.pbroadcast(v, axes, source=0)
    return lambda v: jax.lax.psum(
        jnp.where(jax.lax.axis_index(axes) == 0, v, jnp.zeros_like(v)), axes)
  raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")


def make_program(op: Callable, group: Group) -> Callable:
  """jit(shard_map) of `op` on arrays `[*mesh.shape, L]`, one `[L]` buffer per device."""
  spec = P(*group.mesh.axis_names, None)
  ones = (1,) * len(group.mesh.axis_names)

  def body(block):
    return op(block.reshape(-1)).reshape(*ones, -1)

  return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=spec, out_specs=spec))


def lowered_ops(hlo_text: str) -> str:
  """The collective ops in compiled HLO text, '+'-joined ("-start" async forms included)."""
  found = re.findall(r"\s(" + "|".join(HLO_COLLECTIVES) + r")(?:-start)?\(", hlo_text)
  return "+".join(sorted(set(found))) or "none"


# --------------------------------------------------------------------------------------------
# Inputs and the check against the numpy reference (`zaya_jax.perf.nccl`).
# --------------------------------------------------------------------------------------------


def make_input(group: Group, in_len: int, bound: int, dtype: str) -> jax.Array:
  """[*mesh.shape, L] in `dtype`, sharded one `[L]` block per device; each process builds
  only its own devices' blocks."""
  shape = (*group.mesh.devices.shape, in_len)
  sharding = NamedSharding(group.mesh, P(*group.mesh.axis_names, None))

  def block(index):
    coords = tuple(s.start or 0 for s in index[:-1])
    device = int(np.ravel_multi_index(coords, group.mesh.devices.shape))
    return input_block(device, in_len, bound).astype(DTYPES[dtype]).reshape(*(1,) * len(coords), -1)

  return jax.make_array_from_callback(shape, sharding, block)


def max_abs_error(collective: str, group: Group, out: jax.Array, in_len: int, bound: int) -> float:
  """Largest |output - expected| over every device's block, all processes agreeing (inf for
  a block of the wrong shape)."""
  members = group.members()
  where = {int(d): (g, r) for g, row in enumerate(members) for r, d in enumerate(row)}
  err = 0.0
  for shard in out.addressable_shards:
    coords = tuple(s.start or 0 for s in shard.index[:-1])
    g, r = where[int(np.ravel_multi_index(coords, group.mesh.devices.shape))]
    want = expected_block(collective, members[g].tolist(), r, in_len, bound)
    got = np.asarray(shard.data, np.float64).reshape(-1)
    err = max(err, float(np.abs(got - want).max()) if got.shape == want.shape else math.inf)
  return float(np.max(multihost_utils.process_allgather(np.float64(err))))


# --------------------------------------------------------------------------------------------
# Meshes, measurement, the sweep.
# --------------------------------------------------------------------------------------------


def pick_devices(count: int, flag: str) -> list:
  """`count` devices, the same number from every process (the first of each), so a group
  spans all processes.

  Raises:
    ValueError: `count` < 1, does not divide the device count, or is not a multiple of the
      process count (names `flag`, the command-line flag that asked for it, and the numbers).
  """
  total, procs = jax.device_count(), jax.process_count()
  if count < 1 or total % count:
    raise ValueError(f"{flag}: {count} devices do not divide the {total} "
                     f"available; use a divisor of {total}")
  if count % procs:
    raise ValueError(f"{flag}: {count} devices cannot be spread evenly over "
                     f"{procs} processes; use a multiple of {procs}")
  per = count // procs
  return [d for p in range(procs) for d in [d for d in jax.devices() if d.process_index == p][:per]]


def line_group(n: int) -> Group:
  """`n` devices in a row: mesh data=1, fsdp=1, expert=n, collectives over `expert`."""
  devices = pick_devices(n, f"--num_devices={n}")
  return Group(make_mesh(MeshConfig(data=1, fsdp=1, expert=n), devices), (EXPERT,))


def mesh_group(cfg: MeshConfig, axes: tuple[str, ...]) -> Group:
  """`cfg` (no -1) over the first devices, collectives over `axes`.

  Raises:
    ValueError: -1 in `cfg`, an unknown axis, or a device count that does not fit.
  """
  sizes = [getattr(cfg, a) for a in MESH_AXES]
  if -1 in sizes:
    raise ValueError(f"--meshes entry {','.join(map(str, sizes))}: give every axis size (no -1)")
  unknown = [a for a in axes if a not in MESH_AXES]
  if unknown or not axes:
    raise ValueError(f"--axes={','.join(axes)}: name one or more of {', '.join(MESH_AXES)}")
  flag = f"--meshes entry {','.join(map(str, sizes))}"
  return Group(make_mesh(cfg, pick_devices(math.prod(sizes), flag)), tuple(axes))


def bench_groups(meshes: str | None, axes: Sequence[str], num_devices: Sequence[str] | None
                 ) -> list[Group]:
  """The groups the command line asks for: each mesh of `meshes` ("d,f,e;...") over `axes`,
  else a line of n devices for each of `num_devices`, else 2, 4, ... up to all devices.

  Raises:
    ValueError: naming the flag (--meshes with --num_devices, a count below 2, one device).
  """
  if meshes:
    if num_devices:
      raise ValueError("--num_devices and --meshes exclude each other; pass one of them")
    return [mesh_group(cfg, tuple(axes)) for cfg in parse_meshes(meshes)]
  if num_devices:
    bad = [v for v in num_devices if not v.strip().isdigit() or int(v) < 2]
    if bad:
      raise ValueError(f"--num_devices: {','.join(bad)} is not a device count >= 2; e.g. 2,4,8")
    counts = [int(v) for v in num_devices]
  else:
    counts = [2**k for k in range(1, jax.device_count().bit_length())]
    if not counts:
      raise ValueError(f"--num_devices: only {jax.device_count()} device; collectives need >= 2 "
                       "(on CPU set --num_cpu_devices, or XLA_FLAGS="
                       "--xla_force_host_platform_device_count=8)")
  return [line_group(n) for n in counts]


def measure(collective: str, group: Group, size_bytes: int, dtype: str, repeats: int,
            warmup: int, op: Callable | None = None) -> dict[str, Any]:
  """One row: compile, check and time `collective` on `group` for a `size_bytes` message.

  Args:
    collective: one of `COLLECTIVES`.
    group: mesh and axes.
    size_bytes: nccl-tests size (see `buffer_lengths`), rounded down to whole elements that
      split evenly over the group.
    dtype: a key of `DTYPES`.
    repeats: timed calls (median taken); warmup: untimed calls before them.
    op: per-device function to run instead of the real collective (tests inject wrong ones).

  Returns:
    dict with the keys of `CSV_COLUMNS`: time_s in seconds, algbw/busbw in GB/s, correct
    True iff max_abs_err == 0.

  Raises:
    ValueError: a message too small to give every device an element.
  """
  n, itemsize = group.n, np.dtype(DTYPES[dtype]).itemsize
  count = element_count(size_bytes, itemsize, n)
  if count == 0:
    raise ValueError(f"--min_bytes={size_bytes}: too small for {n} devices of {dtype}; use at "
                     f"least {n * itemsize}")
  in_len, _ = buffer_lengths(collective, count, n)
  bound = value_bound(collective, dtype, n)
  platform = group.mesh.devices.flat[0].platform
  program = make_program(op or collective_op(collective, group.axes, platform), group)
  x = make_input(group, in_len, bound, dtype)
  compiled = program.lower(x).compile()
  err = max_abs_error(collective, group, compiled(x), in_len, bound)
  seconds = median_seconds(compiled, (x,), repeats, warmup)
  algbw, busbw = bandwidths(collective, n, count * itemsize, seconds)
  return dict(collective=collective, lowering=lowered_ops(compiled.as_text()),
              mesh=group.mesh_label, axes=",".join(group.axes), n=n,
              num_devices=group.mesh.devices.size, processes=jax.process_count(), dtype=dtype,
              size_bytes=count * itemsize, count=count, time_s=seconds, algbw_GBps=algbw,
              busbw_GBps=busbw, correct=err == 0, max_abs_err=err)


def run_sweep(collectives: Sequence[str], groups: Sequence[Group], sizes: Sequence[int],
              dtype: str, repeats: int, warmup: int,
              log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
  """`measure` for every group x collective x size, in that order; `log` gets one line each."""
  rows = []
  for group in groups:
    for collective in collectives:
      for size in sizes:
        rows.append(measure(collective, group, size, dtype, repeats, warmup))
        if log:
          log(format_table(rows[-1:], header=False))
  return rows


def validate(collectives: Sequence[str], min_bytes: int, max_bytes: int, repeats: int,
             warmup: int, dtype: str) -> None:
  """Flag checks that need no devices.

  Raises:
    ValueError: naming the flag and the fix.
  """
  unknown = [c for c in collectives if c not in COLLECTIVES]
  if unknown or not collectives:
    raise ValueError(f"--collectives: unknown {', '.join(unknown) or '(empty)'}; choose from "
                     f"{','.join(COLLECTIVES)}")
  if dtype not in DTYPES:
    raise ValueError(f"--dtype={dtype}: choose one of {', '.join(DTYPES)}")
  if min_bytes < 1:
    raise ValueError(f"--min_bytes={min_bytes} must be >= 1 (e.g. 4096)")
  if min_bytes > max_bytes:
    raise ValueError(f"--min_bytes={min_bytes} is larger than --max_bytes={max_bytes}; "
                     "make --max_bytes >= --min_bytes")
  if repeats < 1:
    raise ValueError(f"--repeats={repeats} must be >= 1")
  if warmup < 0:
    raise ValueError(f"--warmup={warmup} must be >= 0")


def check_min_bytes(groups: Sequence[Group], min_bytes: int, dtype: str) -> None:
  """Every group gets at least one element per device at the smallest size.

  Raises:
    ValueError: naming --min_bytes and the smallest size that works.
  """
  need = max(g.n for g in groups) * np.dtype(DTYPES[dtype]).itemsize
  if min_bytes < need:
    raise ValueError(f"--min_bytes={min_bytes} is too small for {max(g.n for g in groups)} "
                     f"devices of {dtype}; use at least {need}")


def wrong_results(rows: Sequence[dict[str, Any]]) -> str | None:
  """None if every row is correct, else one line naming the wrong ones (the first five)."""
  wrong = [r for r in rows if not r["correct"]]
  if not wrong:
    return None
  return (f"WRONG RESULTS in {len(wrong)} of {len(rows)} rows: "
          + "; ".join(f"{r['collective']} n={r['n']} mesh={r['mesh']} size={r['size_bytes']} "
                      f"max|err|={r['max_abs_err']}" for r in wrong[:5]))


# --------------------------------------------------------------------------------------------
# Output: CSV, table, plot.
# --------------------------------------------------------------------------------------------


def write_csv(rows: Sequence[dict[str, Any]], path: str) -> None:
  """One line per row, columns `CSV_COLUMNS`."""
  report.write_csv(path, CSV_COLUMNS, rows)


def write_report(rows: Sequence[dict[str, Any]], out_dir: str, title: str, note: str) -> None:
  """Writes `out_dir`/collectives.csv and collectives.png (under `title`) and prints where
  (`note`: what the figures describe). Call it on process 0 only."""
  os.makedirs(out_dir, exist_ok=True)
  write_csv(rows, os.path.join(out_dir, "collectives.csv"))
  plot(rows, os.path.join(out_dir, "collectives.png"), title)
  print(f"\n{note}\nwrote {out_dir}/collectives.csv and collectives.png")


def human_bytes(size: float) -> str:
  """4096 -> "4K", 16777216 -> "16M" (binary units)."""
  for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
    if size >= scale:
      return f"{size / scale:g}{unit}"
  return f"{size:g}"


def format_table(rows: Sequence[dict[str, Any]], header: bool = True) -> str:
  """nccl-tests-like fixed-width table: time in microseconds, bandwidths in GB/s."""
  widths = (14, 20, 5, 14, 3, 7, 10, 11, 9, 9, 5)
  head = ("collective", "lowering", "mesh", "axes", "n", "size", "count", "time us", "algbw",
          "busbw", "check")
  lines = []
  for r in rows:
    lines.append((r["collective"], r["lowering"], r["mesh"], r["axes"], r["n"],
                  human_bytes(r["size_bytes"]), r["count"], f"{r['time_s'] * 1e6:.1f}",
                  f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
                  "ok" if r["correct"] else "WRONG"))
  # Text columns left-aligned, numbers right-aligned.
  return report.text_table(head if header else None, lines, left=range(4), widths=widths, sep=" ")


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> Figure:
  """PNG: busbw (GB/s) vs size (bytes), log-log; one panel per (mesh, axes), one line per
  collective (wrong results marked with a red x). Returns the
  Figure (written to `path`)."""
  panels = list(dict.fromkeys((r["mesh"], r["axes"], r["n"]) for r in rows))
  cols = min(3, len(panels))
  nrows = -(-len(panels) // cols)
  fig = report.new_figure(5.0 * cols, 4.0 * nrows + 0.6)
  axs = np.atleast_1d(fig.subplots(nrows, cols, squeeze=False)).reshape(-1)
  for ax, (mesh, axes, n) in zip(axs, panels):
    for collective in dict.fromkeys(r["collective"] for r in rows):
      sel = [r for r in rows if (r["mesh"], r["axes"], r["collective"]) == (mesh, axes, collective)]
      if not sel:
        continue
      sizes = [r["size_bytes"] for r in sel]
      busbw = [max(r["busbw_GBps"], 1e-6) for r in sel]  # log axis: n = 1 gives 0
      ax.plot(sizes, busbw, marker="o", markersize=3, label=f"{collective} ({sel[0]['lowering']})")
      bad = [(s, b) for s, b, r in zip(sizes, busbw, sel) if not r["correct"]]
      if bad:
        ax.plot(*zip(*bad), "x", color="red", markersize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["size_bytes"] for r in rows if (r["mesh"], r["axes"]) == (mesh, axes)})
    ax.set_xticks(ticks[::max(1, len(ticks) // 6)])
    ax.set_xticklabels([human_bytes(t) for t in ticks[::max(1, len(ticks) // 6)]])
    ax.set_xlabel("size (bytes, nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"n={n}: mesh {mesh} (data,fsdp,expert), over {axes}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  for ax in axs[len(panels):]:
    ax.set_visible(False)
  report.save_figure(fig, path, title, wrap=140)
  return fig
