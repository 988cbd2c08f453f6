# Shape letters: M N K of one matmul C[M, N] = A[M, K] @ B[K, N] (not the model legend's).
"""GEMM throughput as a function of the matrix dimensions, and a table of measurements.

The paper sizes ZAYA1's attention and MLP blocks from micro-benchmarks of GEMM throughput
against M, N, K (arXiv 2511.17127 §3, "MI300X-aware sizing"): dimensions that are multiples
of 64 (better 128, 256) and GEMMs large enough to leave the latency-bound regime. This module
measures the same thing on the machine it runs on:

- `sweep_shapes`: shapes over powers of two and their neighbours (`offsets`, default +-64):
  `square` M = N = K = s; `m`, `n`, `k` vary one dimension with the other two at `base`;
  `grid` M x N over powers of two at K = `base` (the heat map). `model_shapes` adds a config's
  own GEMMs (`zaya_jax.model.sizing.model_gemms`: attention, router, expert, LM head).
- `run_sweep`: times each distinct (M, N, K, dtype) once with `median_seconds` on a jitted
  `A @ B` (layout NN; float32 at `Precision.HIGHEST`, i.e. no TF32, to compare with the
  profiles' fp32 peak; bfloat16 in, float32 accumulation, bfloat16 out) and reports TFLOP/s,
  the fraction of the peak (the profile's, or on a host without one the best square matmul
  of the same run, which the rows say) and of the sweep's best, and marks shapes below
  `low_fraction` of the best as out of the high-utilisation regime.
- `write_csv` / `format_table` / `plot`: the results (`zaya_jax.perf.report` writes them); the
  CSV is read back by `zaya_jax.perf.gemm_table.GemmTable` as the sizing estimate's
  `gemm_seconds` hook.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from zaya_jax.config.model import ModelConfig
from zaya_jax.perf import report
from zaya_jax.parallel.accelerators import AcceleratorProfile
from zaya_jax.model.sizing import model_gemms
from pallas_kernels.timing import median_seconds

DTYPES = ("bfloat16", "float32")
SWEEPS = ("square", "m", "n", "k", "grid")
_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}


def canonical_dtype(dtype: str) -> str:
  """`"bf16"` -> `"bfloat16"`, `"fp32"`/`"f32"` -> `"float32"`; other names unchanged."""
  return _ALIASES.get(dtype, dtype)


def gemm_flops(m: int, n: int, k: int) -> int:
  """FLOPs of one [M, K] @ [K, N] product: 2 M N K (one multiply and one add per term)."""
  return 2 * m * n * k


@dataclasses.dataclass(frozen=True)
class GemmShape:
  """One shape to time: `kind` in SWEEPS or "model"; `name` labels it; `count` is how many
  times the model runs it (1 for sweep shapes)."""

  kind: str
  name: str
  m: int
  n: int
  k: int
  count: int = 1


@dataclasses.dataclass(frozen=True)
class GemmResult:
  """One timed shape in one dtype.

  Attributes:
    shape: the GemmShape.
    dtype: "bfloat16" | "float32".
    seconds: median wall time of one product, seconds.
    tflops: achieved TFLOP/s = 2 M N K / seconds / 1e12.
    peak_tflops: the peak divided by, TFLOP/s.
    peak_source: the profile's name, or "measured: ..." (best square matmul of this run).
    frac_of_peak: tflops / peak_tflops.
    frac_of_best: tflops / the best tflops of this dtype in the sweep.
    low_utilisation: frac_of_best < the sweep's `low_fraction`.
  """

  shape: GemmShape
  dtype: str
  seconds: float
  tflops: float
  peak_tflops: float
  peak_source: str
  frac_of_peak: float
  frac_of_best: float
  low_utilisation: bool


# --------------------------------------------------------------------------------------------
# Shapes.
# --------------------------------------------------------------------------------------------


def parse_dtypes(names: Iterable[str]) -> tuple[str, ...]:
  """Canonical dtype names, in order, without repeats.

  Raises:
    ValueError: naming `dtypes`, for a name outside DTYPES (after aliases) or an empty list.
  """
  out = []
  for name in names:
    d = canonical_dtype(name.strip())
    if d not in DTYPES:
      raise ValueError(f"dtypes: {name!r} is not one of {DTYPES} (aliases {sorted(_ALIASES)})")
    if d not in out:
      out.append(d)
  if not out:
    raise ValueError(f"dtypes: give at least one of {DTYPES}")
  return tuple(out)


def powers_of_two(min_size: int, max_size: int) -> list[int]:
  """Powers of two p with min_size <= p <= max_size.

  Raises:
    ValueError: naming `min_size`/`max_size`, if min_size < 1 or min_size > max_size.
  """
  if min_size < 1:
    raise ValueError(f"min_size={min_size} must be >= 1")
  if min_size > max_size:
    raise ValueError(f"min_size={min_size} > max_size={max_size}")
  p = 1 << max(0, math.ceil(math.log2(min_size)))
  out = []
  while p <= max_size:
    out.append(p)
    p *= 2
  return out


def sweep_sizes(min_size: int, max_size: int, offsets: Sequence[int] = (-64, 64)) -> list[int]:
  """Powers of two in [min_size, max_size] and their neighbours p + o for o in `offsets`
  (kept when inside the range), sorted. E.g. (64, 512) -> 64 128 192 256 320 448 512.

  Raises:
    ValueError: as `powers_of_two`.
  """
  powers = powers_of_two(min_size, max_size)
  sizes = set(powers)
  for p in powers:
    sizes.update(p + o for o in offsets if min_size <= p + o <= max_size)
  return sorted(sizes)


def sweep_shapes(sweeps: Sequence[str], sizes: Sequence[int], grid_sizes: Sequence[int],
                 base: int) -> list[GemmShape]:
  """The sweep's shapes: for `square`, (s, s, s) per s in `sizes`; for `m`, (s, base, base),
  likewise `n`, `k`; for `grid`, (m, n, base) for m, n in `grid_sizes`.

  Raises:
    ValueError: naming `sweeps`, for a kind outside SWEEPS.
  """
  shapes = []
  for kind in sweeps:
    if kind not in SWEEPS:
      raise ValueError(f"sweeps: {kind!r} is not one of {SWEEPS}")
    if kind == "grid":
      shapes += [GemmShape("grid", f"grid {m}x{n}", m, n, base) for m in grid_sizes
                 for n in grid_sizes]
      continue
    for s in sizes:
      m, n, k = {"square": (s, s, s), "m": (s, base, base), "n": (base, s, base),
                 "k": (base, base, s)}[kind]
      shapes.append(GemmShape(kind, f"{kind} {s}", m, n, k))
  return shapes


def model_shapes(cfg: ModelConfig, tokens: int, expert_parallel: int = 1,
                 backward: bool = True) -> list[GemmShape]:
  """The model's own GEMMs at `tokens` tokens per device (`sizing.model_gemms`), kind "model",
  with their backward GEMMs (`Gemm.backward`: `.dgrad`, `.wgrad`) when `backward`.

  Raises:
    ValueError: from `model_gemms`, for tokens < 1 or an `expert_parallel` not dividing E.
  """
  gemms = model_gemms(cfg, tokens, expert_parallel)
  if backward:
    gemms = [x for g in gemms for x in (g, *g.backward())]
  return [GemmShape("model", g.name, g.m, g.n, g.k, g.count) for g in gemms]


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _matmul(dtype: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """Jitted [M, K] @ [K, N] in `dtype`: float32 at Precision.HIGHEST (true fp32, no TF32);
  bfloat16 with float32 accumulation, the result cast back to bfloat16."""
  precision = jax.lax.Precision.HIGHEST if dtype == "float32" else None
  out_dtype = jnp.dtype(dtype)

  @jax.jit
  def matmul(a_MK, b_KN):
    return jnp.matmul(a_MK, b_KN, precision=precision,
                      preferred_element_type=jnp.float32).astype(out_dtype)
  return matmul


def time_gemm(m: int, n: int, k: int, dtype: str, repeats: int, warmup: int = 2) -> float:
  """Median seconds of one [M, K] @ [K, N] product in `dtype` on the default device (inputs
  standard normal, drawn by NumPy: a jax.random draw would compile once per shape)."""
  rng = np.random.default_rng(0)
  a_MK, b_KN = (jax.device_put(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))
                for shape in ((m, k), (k, n)))
  return median_seconds(_matmul(dtype), (a_MK, b_KN), repeats, warmup)


def run_sweep(shapes: Sequence[GemmShape], dtypes: Sequence[str], *, repeats: int, warmup: int = 2,
              profile: AcceleratorProfile | None = None, low_fraction: float = 0.5,
              log: Callable[[str], Any] = print) -> list[GemmResult]:
  """Times every shape in every dtype (each distinct (M, N, K, dtype) once) and rates it.

  Args:
    shapes: from `sweep_shapes` / `model_shapes`.
    dtypes: from `parse_dtypes`.
    repeats, warmup: passed to `median_seconds`.
    profile: peaks to divide by; None = measured peak (best `square` row of the dtype, or the
      best row when the sweep has no square shapes).
    low_fraction: rows below this fraction of the dtype's best TFLOP/s are `low_utilisation`.
    log: called with one progress line per timed shape.

  Returns:
    One GemmResult per (dtype, shape), dtype-major, in `shapes` order.

  Raises:
    ValueError: if `low_fraction` is not in (0, 1].
  """
  if not 0 < low_fraction <= 1:
    raise ValueError(f"low_fraction={low_fraction} must be in (0, 1]")
  results = []
  for dtype in parse_dtypes(dtypes):
    timed: dict[tuple[int, int, int], float] = {}
    for s in shapes:
      if (s.m, s.n, s.k) not in timed:
        timed[s.m, s.n, s.k] = time_gemm(s.m, s.n, s.k, dtype, repeats, warmup)
        t = timed[s.m, s.n, s.k]
        log(f"  {dtype} {s.m}x{s.n}x{s.k}: {t * 1e3:.3f} ms, "
            f"{gemm_flops(s.m, s.n, s.k) / t / 1e12:.4g} TFLOP/s")
    tflops = [gemm_flops(s.m, s.n, s.k) / timed[s.m, s.n, s.k] / 1e12 for s in shapes]
    best = max(tflops)
    if profile is not None:
      peak, source = profile.peak_flops(dtype) / 1e12, profile.name
    else:
      square = [(t, s) for t, s in zip(tflops, shapes) if s.kind == "square"] or list(
          zip(tflops, shapes))
      peak, s = max(square, key=lambda ts: ts[0])
      source = f"measured: best matmul of this run ({s.m}x{s.n}x{s.k})"
    for s, tf in zip(shapes, tflops):
      results.append(GemmResult(s, dtype, timed[s.m, s.n, s.k], tf, peak, source, tf / peak,
                                tf / best, tf / best < low_fraction))
  return results


# --------------------------------------------------------------------------------------------
# CSV, text table.
# --------------------------------------------------------------------------------------------

CSV_COLUMNS = ("kind", "name", "dtype", "m", "n", "k", "count", "flops", "seconds", "tflops",
               "peak_tflops", "peak_source", "frac_of_peak", "frac_of_best", "low_utilisation")


def write_csv(results: Sequence[GemmResult], path: str) -> None:
  """One line per result, columns CSV_COLUMNS (seconds in s, *_tflops in TFLOP/s)."""
  report.write_csv(path, CSV_COLUMNS, (dict(zip(CSV_COLUMNS, (
      r.shape.kind, r.shape.name, r.dtype, r.shape.m, r.shape.n, r.shape.k, r.shape.count,
      gemm_flops(r.shape.m, r.shape.n, r.shape.k), f"{r.seconds:.6e}", f"{r.tflops:.6g}",
      f"{r.peak_tflops:.6g}", r.peak_source, f"{r.frac_of_peak:.4f}", f"{r.frac_of_best:.4f}",
      int(r.low_utilisation)))) for r in results))


def format_table(results: Sequence[GemmResult]) -> str:
  """Fixed-width table; `*` marks rows out of the high-utilisation regime."""
  head = ("kind", "name", "dtype", "M", "N", "K", "GFLOP", "ms", "TFLOP/s", "% peak", "% best", "")
  lines = [(r.shape.kind, r.shape.name, r.dtype, r.shape.m, r.shape.n, r.shape.k,
            f"{gemm_flops(r.shape.m, r.shape.n, r.shape.k) / 1e9:.3g}", f"{r.seconds * 1e3:.3f}",
            f"{r.tflops:.4g}", f"{100 * r.frac_of_peak:.1f}", f"{100 * r.frac_of_best:.1f}",
            "*" if r.low_utilisation else "") for r in results]
  return report.text_table(head, lines)


# --------------------------------------------------------------------------------------------
# Plot.
# --------------------------------------------------------------------------------------------

_VARYING = {"square": 0, "m": 0, "n": 1, "k": 2}  # which of (M, N, K) a line sweeps


def plot(results: Sequence[GemmResult], path: str, title: str) -> Figure:
  """PNG: left, TFLOP/s vs size (one line per sweep kind and dtype; model GEMMs as points at
  (M N K)^(1/3); profile peaks dashed); right, one heat map of TFLOP/s over M x N at the
  grid's K per dtype (when the sweep has a `grid`). Returns the
  Figure (written to `path`)."""
  dtypes = list(dict.fromkeys(r.dtype for r in results))
  grid_dtypes = [d for d in dtypes if any(r.dtype == d and r.shape.kind == "grid" for r in results)]
  width = 7.0 + 5.5 * len(grid_dtypes)  # inches
  fig = report.new_figure(width, 6.0)
  axes = fig.subplots(1, 1 + len(grid_dtypes), squeeze=False)[0]
  ax = axes[0]
  for dtype, style in zip(dtypes, ("-", "--", ":")):
    for kind, marker in zip(_VARYING, "osv^"):
      rows = sorted((r for r in results if r.dtype == dtype and r.shape.kind == kind),
                    key=lambda r: (r.shape.m, r.shape.n, r.shape.k))
      if not rows:
        continue
      base = "" if kind == "square" else f" ({'MNK'.replace(kind.upper(), '')}={_fixed(rows[0], kind)})"
      label = f"{dtype} {'M=N=K' if kind == 'square' else kind.upper()}{base}"
      ax.plot([(r.shape.m, r.shape.n, r.shape.k)[_VARYING[kind]] for r in rows],
              [r.tflops for r in rows], style, marker=marker, ms=4, label=label)
    for bwd, marker in ((False, "*"), (True, "x")):
      model = [r for r in results if r.dtype == dtype and r.shape.kind == "model"
               and r.shape.name.endswith((".dgrad", ".wgrad")) == bwd]
      if not model:
        continue
      xs = [(r.shape.m * r.shape.n * r.shape.k) ** (1 / 3) for r in model]
      ax.scatter(xs, [r.tflops for r in model], marker=marker, s=50 if marker == "*" else 25,
                 zorder=3, label=f"{dtype} model {'backward' if bwd else 'forward'} GEMMs at "
                 "(MNK)^(1/3)")
      for x, r in zip(xs, model if not bwd else ()):  # name the forward ones only
        ax.annotate(r.shape.name, (x, r.tflops), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    peak = next(r for r in results if r.dtype == dtype)
    if not peak.peak_source.startswith("measured"):
      ax.axhline(peak.peak_tflops, ls="--", lw=0.8, color="grey")
      ax.annotate(f"{peak.peak_source} {dtype} peak", (0.01, peak.peak_tflops), fontsize=7,
                  xycoords=("axes fraction", "data"), va="bottom")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("swept dimension")
  ax.set_ylabel("TFLOP/s")
  ax.set_title("GEMM throughput vs size")
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  for ax, dtype in zip(axes[1:], grid_dtypes):
    rows = [r for r in results if r.dtype == dtype and r.shape.kind == "grid"]
    ms = sorted({r.shape.m for r in rows})
    ns = sorted({r.shape.n for r in rows})
    heat = np.full((len(ms), len(ns)), np.nan)
    for r in rows:
      heat[ms.index(r.shape.m), ns.index(r.shape.n)] = r.tflops
    image = ax.imshow(heat, origin="lower", cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label="TFLOP/s")
    if heat.size <= 144:
      mid = (np.nanmin(heat) + np.nanmax(heat)) / 2
      for (i, j), v in np.ndenumerate(heat):
        ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7,
                color="black" if v > mid else "white")
    ax.set_xticks(range(len(ns)), [str(n) for n in ns], fontsize=7)
    ax.set_yticks(range(len(ms)), [str(m) for m in ms], fontsize=7)
    ax.set_xlabel("N")
    ax.set_ylabel("M")
    ax.set_title(f"{dtype} TFLOP/s, K = {rows[0].shape.k}")
  report.save_figure(fig, path, title, wrap=int(16 * width))  # ~16 characters per inch
  return fig


def write_report(results: Sequence[GemmResult], out_dir: str, note: str,
                 low_fraction: float) -> None:
  """Writes `out_dir`/bench_gemm.csv and bench_gemm.png (`note` as the plot title) and prints
  the table, each dtype's peak and the paths (`low_fraction`: the threshold the `*` marks)."""
  os.makedirs(out_dir, exist_ok=True)
  csv_path = os.path.join(out_dir, "bench_gemm.csv")
  write_csv(results, csv_path)
  plot(results, os.path.join(out_dir, "bench_gemm.png"), note)
  print(f"\n{format_table(results)}")
  for dtype in dict.fromkeys(r.dtype for r in results):
    r = next(r for r in results if r.dtype == dtype)
    print(f"{dtype} peak {r.peak_tflops:.4g} TFLOP/s ({r.peak_source})")
  print(f"* = below {low_fraction:.0%} of the dtype's best TFLOP/s in this sweep. {note}")
  print(f"wrote {csv_path} and bench_gemm.png")


def _fixed(r: GemmResult, kind: str) -> int:
  """The size the two fixed dimensions of an `m`/`n`/`k` line are held at."""
  return (r.shape.k if kind == "m" else r.shape.m)
