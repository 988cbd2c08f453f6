"""Accelerator profiles: the vendor peak figures that roofline estimates and MFU divide by.

Kept as data (one frozen dataclass per accelerator, `PROFILES` by name). Figures are the
vendors' published *dense* peaks (no structured sparsity) for the SXM/OAM parts:

| name    | bf16 TFLOP/s | fp32 TFLOP/s | HBM TB/s | HBM GB | scale-up GB/s/dir | scale-out GB/s/dir |
|---------|--------------|--------------|----------|--------|-------------------|--------------------|
| mi300x  | 1307.4       | 163.4        | 5.3      | 192    | 448 (7 xGMI links) | 50 (400 Gb/s NIC)  |
| mi325x  | 1307.4       | 163.4        | 6.0      | 256    | 448               | 50                 |
| h100    | 989.4        | 66.9         | 3.35     | 80     | 450 (NVLink 4)    | 50 (NDR 400 Gb/s)  |
| h200    | 989.4        | 66.9         | 4.8      | 141    | 450               | 50                 |

Sources: AMD Instinct MI300X / MI325X data sheets (matrix FP32 163.4 TFLOP/s, BF16 1307.4
TFLOP/s dense); NVIDIA H100 / H200 SXM data sheets (BF16 tensor core 989.4 TFLOP/s dense, FP32
non-tensor 66.9 TFLOP/s). The paper (arXiv 2511.17127 §3) trains on MI300X nodes of 8 GPUs
joined by Infinity Fabric, one 400 Gb/s Pollara NIC per GPU.

A CPU has no profile: its peak is measured (a large matmul timed in the same run).
"""

from __future__ import annotations

import dataclasses
import resource
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import timing

TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class AcceleratorProfile:
  """Peak figures of one accelerator (one device: a GPU, or one OAM module).

  Attributes:
    name: key in `PROFILES`.
    bf16_flops: dense bfloat16 matmul peak, FLOP/s.
    fp32_flops: dense float32 matmul peak without reduced-precision tricks (no TF32), FLOP/s.
    hbm_bandwidth: device memory bandwidth, bytes/s.
    hbm_bytes: device memory capacity, bytes.
    scale_up_bandwidth: per-device, per-direction bandwidth to the other devices of its node
      (xGMI / NVLink), bytes/s.
    scale_out_bandwidth: per-device, per-direction network bandwidth between nodes, bytes/s.
    devices_per_node: devices sharing the scale-up fabric.
    device_kinds: substrings of `jax.Device.device_kind` that identify this accelerator.
  """

  name: str
  bf16_flops: float
  fp32_flops: float
  hbm_bandwidth: float
  hbm_bytes: float
  scale_up_bandwidth: float
  scale_out_bandwidth: float
  devices_per_node: int = 8
  device_kinds: tuple[str, ...] = ()

  def peak_flops(self, dtype: str) -> float:
    """Dense matmul peak in FLOP/s for `dtype` ("bfloat16" | "float32").

    Raises:
      ValueError: for another dtype.
    """
    if dtype in ("bfloat16", "bf16"):
      return self.bf16_flops
    if dtype in ("float32", "fp32"):
      return self.fp32_flops
    raise ValueError(f"dtype {dtype!r}: profiles hold peaks for 'bfloat16' and 'float32' only")


PROFILES: dict[str, AcceleratorProfile] = {
    p.name: p for p in (
        AcceleratorProfile("mi300x", 1307.4 * TERA, 163.4 * TERA, 5.3 * TERA, 192 * GIGA,
                           448 * GIGA, 50 * GIGA, device_kinds=("MI300X", "gfx942")),
        AcceleratorProfile("mi325x", 1307.4 * TERA, 163.4 * TERA, 6.0 * TERA, 256 * GIGA,
                           448 * GIGA, 50 * GIGA, device_kinds=("MI325X",)),
        AcceleratorProfile("h100", 989.4 * TERA, 66.9 * TERA, 3.35 * TERA, 80 * GIGA,
                           450 * GIGA, 50 * GIGA, device_kinds=("H100",)),
        AcceleratorProfile("h200", 989.4 * TERA, 66.9 * TERA, 4.8 * TERA, 141 * GIGA,
                           450 * GIGA, 50 * GIGA, device_kinds=("H200",)),
    )
}


def get_profile(name: str) -> AcceleratorProfile:
  """The profile called `name` (case-insensitive).

  Raises:
    ValueError: naming the known profiles, for an unknown name.
  """
  key = name.lower()
  if key not in PROFILES:
    raise ValueError(f"unknown accelerator profile {name!r}; choose one of {sorted(PROFILES)}")
  return PROFILES[key]


def detect_profile(device: jax.Device | None = None) -> AcceleratorProfile | None:
  """The profile whose `device_kinds` match `device.device_kind` (default: the first JAX
  device), or None (a CPU, or an accelerator without a profile)."""
  device = device or jax.devices()[0]
  kind = device.device_kind
  for profile in PROFILES.values():
    if any(k.lower() in kind.lower() for k in profile.device_kinds):
      return profile
  return None


def resolve_profile(name: str | None) -> AcceleratorProfile | None:
  """`get_profile(name)` when a name is given, else `detect_profile()` (None on a CPU).

  Raises:
    ValueError: for an unknown name (from `get_profile`).
  """
  return get_profile(name) if name else detect_profile()


def measure_matmul_peak(size: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
  """FLOP/s of a jitted `[size, size] @ [size, size]` matmul (2 size^3 FLOPs), median time.

  Raises:
    ValueError: if `size` < 1 or `repeats` < 1.
  """
  if size < 1:
    raise ValueError(f"matmul size must be >= 1, got {size}")
  a = jax.random.normal(jax.random.key(0), (size, size), dtype)
  b = jax.random.normal(jax.random.key(1), (size, size), dtype)
  seconds = timing.median_seconds(jax.jit(jnp.matmul), (a, b), repeats)
  return 2.0 * size**3 / seconds


def peak_memory_bytes() -> tuple[int, str]:
  """`(bytes, source)`: the first device's peak bytes in use, or on CPU the process's peak
  resident set size (ru_maxrss: KiB on Linux, bytes on macOS)."""
  device = jax.devices()[0]
  if device.platform != "cpu":
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use"
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(rss if sys.platform == "darwin" else rss * 1024), "process peak RSS"
