# Shape letters: M N K of one matmul C[M, N] = A[M, K] @ B[K, N] (not the model legend's).
"""Measured GEMM times (a `launch.bench_gemm` CSV) as the sizing estimate's `gemm_seconds` hook.

`GemmTable.from_csv(path)` reads the CSV `zaya_jax.perf.gemm.write_csv` writes;
`seconds(gemm, dtype)` returns a measured time, or one interpolated from the nearest measured
shapes (the rule is in the class docstring).
"""

from __future__ import annotations

import csv
import math
from typing import Any, Iterable

import numpy as np

from zaya_jax.perf.gemm import canonical_dtype, gemm_flops


class GemmTable:
  """Measured GEMM times, looked up by shape and dtype.

  `seconds(gemm, dtype)` is the time of ONE [M, K] @ [K, N] product (the caller multiplies by
  `gemm.count`):
  - a measured (M, N, K, dtype) returns its measured seconds (the least, if measured twice);
  - otherwise the achieved FLOP/s is interpolated from the `neighbours` (default 4) measured
    shapes of that dtype nearest in (log2 M, log2 N, log2 K), as their weighted geometric mean
    with inverse-square-distance weights (Shepard interpolation in log space), and
    seconds = 2 M N K / that rate. The rate therefore lies between the neighbours' rates: a
    shape beyond the measured range gets the rate of the nearest measured ones (no
    extrapolation of the latency-bound or the peak regime).

  Raises (from `seconds`):
    ValueError: naming the dtypes the table holds, for a dtype it has no row for.
  """

  def __init__(self, rows: Iterable[tuple[str, int, int, int, float]], neighbours: int = 4,
               source: str = "table"):
    """`rows`: (dtype, M, N, K, seconds) measurements; `source` names them in errors.

    Raises:
      ValueError: for a non-positive dimension or time, or neighbours < 1.
    """
    if neighbours < 1:
      raise ValueError(f"neighbours={neighbours} must be >= 1")
    self.neighbours, self.source = neighbours, source
    self._exact: dict[tuple[str, int, int, int], float] = {}
    for dtype, m, n, k, seconds in rows:
      if min(m, n, k) < 1 or not seconds > 0:
        raise ValueError(f"{source}: row {dtype} {m}x{n}x{k} {seconds} s: dimensions and "
                         "seconds must be positive")
      key = (canonical_dtype(dtype), int(m), int(n), int(k))
      self._exact[key] = min(seconds, self._exact.get(key, math.inf))
    self._by_dtype: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for dtype in sorted({key[0] for key in self._exact}):
      keys = [key for key in self._exact if key[0] == dtype]
      log_mnk = np.log2(np.array([key[1:] for key in keys], float))
      log_rate = np.log([gemm_flops(*key[1:]) / self._exact[key] for key in keys])
      self._by_dtype[dtype] = (log_mnk, log_rate)

  @classmethod
  def from_csv(cls, path: str, neighbours: int = 4) -> GemmTable:
    """The table in a `write_csv` file (columns dtype, m, n, k, seconds are read).

    Raises:
      ValueError: if the file lacks one of those columns or has no rows.
    """
    with open(path, newline="", encoding="utf-8") as f:
      reader = csv.DictReader(f)
      missing = {"dtype", "m", "n", "k", "seconds"} - set(reader.fieldnames or ())
      if missing:
        raise ValueError(f"{path}: not a bench_gemm CSV, missing columns {sorted(missing)}")
      rows = [(r["dtype"], int(r["m"]), int(r["n"]), int(r["k"]), float(r["seconds"]))
              for r in reader]
    if not rows:
      raise ValueError(f"{path}: no measurements")
    return cls(rows, neighbours, source=path)

  @property
  def dtypes(self) -> tuple[str, ...]:
    """The dtypes with measurements."""
    return tuple(self._by_dtype)

  def achieved_flops(self, m: int, n: int, k: int, dtype: str) -> float:
    """Measured or interpolated FLOP/s of an (M, N, K) product in `dtype` (rule: class doc)."""
    dtype = canonical_dtype(dtype)
    if dtype not in self._by_dtype:
      raise ValueError(f"{self.source} has no {dtype!r} measurements (it holds {self.dtypes}); "
                       f"rerun launch.bench_gemm with --dtypes={dtype}")
    if (dtype, m, n, k) in self._exact:
      return gemm_flops(m, n, k) / self._exact[dtype, m, n, k]
    log_mnk, log_rate = self._by_dtype[dtype]
    dist2 = np.sum((log_mnk - np.log2([m, n, k])) ** 2, axis=1)
    nearest = np.argsort(dist2, kind="stable")[:self.neighbours]
    weights = 1.0 / dist2[nearest]
    return float(np.exp(np.sum(weights * log_rate[nearest]) / np.sum(weights)))

  def seconds(self, gemm: Any, dtype: str) -> float:
    """Seconds of one product of `gemm` (anything with int `.m`, `.n`, `.k`, e.g.
    `sizing.Gemm`) in `dtype` ("bfloat16" | "float32" or an alias)."""
    m, n, k = int(gemm.m), int(gemm.n), int(gemm.k)
    dtype = canonical_dtype(dtype)
    if (dtype, m, n, k) in self._exact:
      return self._exact[dtype, m, n, k]
    return gemm_flops(m, n, k) / self.achieved_flops(m, n, k, dtype)
