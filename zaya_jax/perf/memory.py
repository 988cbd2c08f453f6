# Shape letters: n = elements per array (1-D arrays, no model letters).
"""Memory bandwidth in the STREAM sense (McCalpin): copy, scale, add, triad over array sizes.

| kernel | operation     | arrays counted | bytes per call       |
|--------|---------------|----------------|----------------------|
| copy   | b = a         | 2              | 2 n itemsize         |
| scale  | b = s a       | 2              | 2 n itemsize         |
| add    | c = a + b     | 3              | 3 n itemsize         |
| triad  | a = b + s c   | 3              | 3 n itemsize         |

STREAM's counting: each array read or written once; the write-allocate reads a CPU cache may add
are not counted. GB/s = bytes / seconds / 1e9. Each kernel is a jitted function of the three
arrays and `s` (a traced scalar, so XLA cannot fold it) that donates the array it writes
(`DEST`) and stores the result back in its place (`in_place`): one set of arrays is reused, as
STREAM's static arrays are. Without donation every call would write a fresh buffer, and on a
host each buffer above glibc's mmap threshold (32 MiB) is page-faulted anew, several times
slower (README, "Systems tools", gives the measured figures). Sizes are per array, powers of two
from KiB (cache-resident: on a host the small sizes measure caches and dispatch latency, a few
microseconds per call) to hundreds of MiB (device memory). Every result is checked against
NumPy once per size, outside the timing.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from zaya_jax.perf import report
from zaya_jax.parallel.accelerators import AcceleratorProfile
from pallas_kernels.timing import median_seconds

KERNELS = ("copy", "scale", "add", "triad")
ARRAYS_MOVED = {"copy": 2, "scale": 2, "add": 3, "triad": 3}  # STREAM counting
DEST = {"copy": 1, "scale": 1, "add": 2, "triad": 0}  # which of (a, b, c) a kernel writes
DTYPES = ("float32", "bfloat16")
SCALAR = 3.0  # STREAM's `scalar`


def stream_bytes(kernel: str, elements: int, itemsize: int) -> int:
  """Bytes one call of `kernel` moves by STREAM counting: arrays x elements x itemsize.

  Raises:
    ValueError: for a kernel outside KERNELS.
  """
  if kernel not in ARRAYS_MOVED:
    raise ValueError(f"kernels: {kernel!r} is not one of {KERNELS}")
  return ARRAYS_MOVED[kernel] * elements * itemsize


def array_sizes(min_bytes: int, max_bytes: int, itemsize: int) -> list[int]:
  """Bytes per array: powers of two in [min_bytes, max_bytes], at least one element each.

  Raises:
    ValueError: naming `min_bytes`/`max_bytes`, if min_bytes < itemsize or min > max.
  """
  if min_bytes < itemsize:
    raise ValueError(f"min_bytes={min_bytes} must be >= the itemsize {itemsize}")
  if min_bytes > max_bytes:
    raise ValueError(f"min_bytes={min_bytes} > max_bytes={max_bytes}")
  p = 1 << (min_bytes - 1).bit_length()
  out = []
  while p <= max_bytes:
    out.append(p)
    p *= 2
  return out


@functools.lru_cache(maxsize=None)
def kernel_fn(kernel: str) -> Callable[..., jax.Array]:
  """Jitted `kernel(a, b, c, s)` -> the array it writes (module table), with that array,
  `(a, b, c)[DEST[kernel]]`, donated: the result takes its buffer. `keep_unused`: the
  destination is not read, and jit would otherwise drop it (and the donation) as unused.

  Raises:
    ValueError: for a kernel outside KERNELS.
  """
  fns = {
      "copy": lambda a, b, c, s: jnp.copy(a),  # lowers to an HLO copy: a real copy
      "scale": lambda a, b, c, s: (s * a).astype(a.dtype),
      "add": lambda a, b, c, s: a + b,
      "triad": lambda a, b, c, s: (b + s * c).astype(b.dtype),
  }
  if kernel not in fns:
    raise ValueError(f"kernels: {kernel!r} is not one of {KERNELS}")
  return jax.jit(fns[kernel], donate_argnums=DEST[kernel], keep_unused=True)


def in_place(kernel: str, arrays: list[jax.Array], s: jax.Array) -> Callable[[], jax.Array]:
  """A call with no arguments that runs `kernel` on `arrays` = [a, b, c] (each [n]) and stores
  the result back as `arrays[DEST[kernel]]` (the donated buffer), returning it."""
  fn, dest = kernel_fn(kernel), DEST[kernel]

  def call() -> jax.Array:
    arrays[dest] = fn(*arrays, s)
    return arrays[dest]
  return call


def reference(kernel: str, a: Any, b: Any, c: Any, s: float) -> np.ndarray:
  """The kernel in NumPy float32 on arrays [n] (the result check; bfloat16 is upcast)."""
  f32 = functools.partial(np.asarray, dtype=np.float32)
  if kernel == "copy":
    return f32(a)
  if kernel == "scale":
    return np.float32(s) * f32(a)
  if kernel == "add":
    return f32(a) + f32(b)
  return f32(b) + np.float32(s) * f32(c)


@dataclasses.dataclass(frozen=True)
class StreamResult:
  """One kernel at one array size.

  Attributes:
    kernel: in KERNELS.
    dtype: element dtype.
    array_bytes: bytes of one array.
    elements: elements per array.
    bytes_moved: `stream_bytes` of one call.
    seconds: median wall time of one call, seconds.
    gb_per_s: bytes_moved / seconds / 1e9, GB/s.
    peak_gb_per_s: the profile's HBM bandwidth in GB/s, or None without a profile.
    correct: the result matched NumPy.
  """

  kernel: str
  dtype: str
  array_bytes: int
  elements: int
  bytes_moved: int
  seconds: float
  gb_per_s: float
  peak_gb_per_s: float | None
  correct: bool


def run_stream(kernels: Sequence[str], sizes: Sequence[int], dtype: str = "float32", *,
               repeats: int = 5, warmup: int = 2, profile: AcceleratorProfile | None = None,
               log: Callable[[str], Any] = print) -> list[StreamResult]:
  """Times every kernel at every array size (bytes per array) and checks its result.

  Returns:
    One StreamResult per (size, kernel), size-major.

  Raises:
    ValueError: for a kernel outside KERNELS or a dtype outside DTYPES.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype: {dtype!r} is not one of {DTYPES}")
  for kernel in kernels:
    stream_bytes(kernel, 1, 1)  # validates the name
  itemsize = jnp.dtype(dtype).itemsize
  tol = 1e-6 if dtype == "float32" else 1e-2
  peak = profile.hbm_bandwidth / 1e9 if profile is not None else None
  results = []
  for size in sizes:
    n = max(1, size // itemsize)
    rng = np.random.default_rng(size)  # NumPy: a jax.random draw compiles once per size
    arrays = [jax.device_put(rng.random(n, np.float32).astype(jnp.dtype(dtype)))
              for _ in range(3)]
    s = jnp.asarray(SCALAR, jnp.dtype(dtype))
    for kernel in kernels:
      seconds = median_seconds(in_place(kernel, arrays, s), (), repeats, warmup)
      # The kernel reads only arrays other than its destination: check the last result.
      got = np.asarray(arrays[DEST[kernel]], np.float32)
      correct = bool(np.allclose(got, reference(kernel, *arrays, SCALAR), rtol=tol, atol=tol))
      moved = stream_bytes(kernel, n, itemsize)
      results.append(StreamResult(kernel, dtype, n * itemsize, n, moved, seconds,
                                  moved / seconds / 1e9, peak, correct))
      log(f"  {kernel:5s} {_human(n * itemsize):>9s}/array: {moved / seconds / 1e9:8.2f} GB/s"
          f"{'' if correct else '  WRONG RESULT'}")
    del arrays
  return results


def _human(nbytes: float) -> str:
  """1536 -> '1.5 KiB'."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if nbytes < 1024 or unit == "GiB":
      return f"{nbytes:.4g} {unit}"
    nbytes /= 1024
  raise AssertionError("unreachable")


def host_caches() -> list[tuple[str, int]]:
  """(label, bytes) of this CPU's data/unified caches from /sys (Linux), e.g. ("L2", 524288);
  empty where /sys does not say."""
  caches = []
  for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
    try:
      with open(os.path.join(index, "type")) as f:
        kind = f.read().strip()
      with open(os.path.join(index, "level")) as f:
        level = f.read().strip()
      with open(os.path.join(index, "size")) as f:
        size = f.read().strip()
    except OSError:
      continue
    if kind == "Instruction":
      continue
    scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:], 1)
    caches.append((f"L{level}", int(size.rstrip("KMG")) * scale))
  return caches


CSV_COLUMNS = ("kernel", "dtype", "array_bytes", "elements", "bytes_moved", "seconds", "gb_per_s",
               "peak_gb_per_s", "frac_of_peak", "correct")


def write_csv(results: Sequence[StreamResult], path: str) -> None:
  """One line per result, columns CSV_COLUMNS (bytes, seconds, GB/s; peak empty without one)."""
  report.write_csv(path, CSV_COLUMNS, (dict(zip(CSV_COLUMNS, (
      r.kernel, r.dtype, r.array_bytes, r.elements, r.bytes_moved, f"{r.seconds:.6e}",
      f"{r.gb_per_s:.6g}", None if r.peak_gb_per_s is None else f"{r.peak_gb_per_s:.6g}",
      None if r.peak_gb_per_s is None else f"{r.gb_per_s / r.peak_gb_per_s:.4f}",
      int(r.correct)))) for r in results))


def format_table(results: Sequence[StreamResult]) -> str:
  """Array sizes down, kernels across, GB/s in the cells (`!` marks a wrong result)."""
  kernels = list(dict.fromkeys(r.kernel for r in results))
  sizes = list(dict.fromkeys(r.array_bytes for r in results))
  cell = {(r.array_bytes, r.kernel): f"{r.gb_per_s:.2f}{'' if r.correct else '!'}" for r in results}
  head = ("bytes/array", *(f"{k} GB/s" for k in kernels))
  lines = [(_human(s), *(cell.get((s, k), "-") for k in kernels)) for s in sizes]
  return report.text_table(head, lines)


def plot(results: Sequence[StreamResult], path: str, title: str) -> Figure:
  """PNG: GB/s vs bytes per array, one line per kernel; the profile's HBM bandwidth dashed
  where there is one; on a CPU the host's cache sizes as vertical lines. Returns the
  Figure (written to `path`)."""
  fig = report.new_figure(8.0, 5.5)
  ax = fig.subplots()
  for kernel, marker in zip(dict.fromkeys(r.kernel for r in results), "osv^"):
    rows = [r for r in results if r.kernel == kernel]
    ax.plot([r.array_bytes for r in rows], [r.gb_per_s for r in rows], marker=marker, ms=4,
            label=kernel)
  peak = results[0].peak_gb_per_s if results else None
  if peak is not None:
    ax.axhline(peak, ls="--", color="grey", lw=0.8, label=f"profile HBM {peak:.0f} GB/s")
  if jax.default_backend() == "cpu":
    for label, size in host_caches():
      ax.axvline(size, ls=":", color="grey", lw=0.8)
      ax.annotate(f"{label} {_human(size)}", (size, 0.98), xycoords=("data", "axes fraction"),
                  rotation=90, va="top", ha="right", fontsize=7)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("bytes per array")
  ax.set_ylabel("GB/s (STREAM counting)")
  ax.set_title(f"STREAM bandwidth, {results[0].dtype if results else ''}")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  report.save_figure(fig, path, title, wrap=110)
  return fig


def write_report(results: Sequence[StreamResult], out_dir: str, note: str,
                 profile: AcceleratorProfile | None) -> str | None:
  """Writes `out_dir`/bench_memory.csv and bench_memory.png (`note` as the plot title) and
  prints the table, the best bandwidth against the profile's HBM bandwidth, and the paths.

  Returns:
    None if every result is correct, else one line naming the wrong ones (kernel@bytes).
  """
  os.makedirs(out_dir, exist_ok=True)
  csv_path = os.path.join(out_dir, "bench_memory.csv")
  write_csv(results, csv_path)
  plot(results, os.path.join(out_dir, "bench_memory.png"), note)
  print(f"\n{format_table(results)}")
  if profile is not None:
    best = max(r.gb_per_s for r in results)
    print(f"best {best:.1f} GB/s = {best / (profile.hbm_bandwidth / 1e9):.1%} of {profile.name} "
          f"HBM {profile.hbm_bandwidth / 1e9:.0f} GB/s")
  else:
    print("no accelerator profile: no peak to compare with")
  print(f"GB/s by STREAM counting (copy/scale 2 arrays, add/triad 3). {note}")
  print(f"wrote {csv_path} and bench_memory.png")
  wrong = [f"{r.kernel}@{r.array_bytes}B" for r in results if not r.correct]
  return f"wrong results: {', '.join(wrong)}" if wrong else None
