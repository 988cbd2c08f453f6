"""The mesh's axis names and `MeshConfig`, its shape: data only, no JAX devices.

Axes (`MESH_AXES`, in this order): `data` (pure replicas), `fsdp` (FSDP / ZeRO-3), `expert`
(expert parallelism). The mesh itself, the logical-axis rules and shardings are
`zaya_jax.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import math

DATA, FSDP, EXPERT = "data", "fsdp", "expert"
MESH_AXES = (DATA, FSDP, EXPERT)
BATCH_AXES = (DATA, FSDP, EXPERT)  # every batch-like axis: the global batch splits over all


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape: devices along `data`, `fsdp`, `expert`. One of them may be -1 (inferred).

  Raises:
    ValueError: more than one -1, a size < 1, or a product that does not divide the device
      count (names the field and the numbers).
  """

  data: int = 1
  fsdp: int = -1
  expert: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    for k, v in sizes.items():
      if v != -1 and (not isinstance(v, int) or v < 1):
        raise ValueError(f"mesh.{k}={v!r} must be a positive integer or -1 (inferred)")

  def shape(self, num_devices: int) -> dict[str, int]:
    """Axis sizes for `num_devices`, with a -1 replaced by what the others leave."""
    sizes = dataclasses.asdict(self)
    known = math.prod(v for v in sizes.values() if v != -1)
    infer = [k for k, v in sizes.items() if v == -1]
    if num_devices % known:
      raise ValueError(f"mesh {sizes}: the product of the fixed axes ({known}) does not divide the "
                       f"{num_devices} devices; choose sizes whose product divides {num_devices}")
    if infer:
      sizes[infer[0]] = num_devices // known
    elif known != num_devices:
      raise ValueError(f"mesh {sizes} has {known} devices but {num_devices} are available; set one "
                       "axis to -1 or make the product equal the device count")
    return sizes


def parse_meshes(text: str) -> list[MeshConfig]:
  """`"1,1,8;2,1,4"` -> MeshConfigs (data, fsdp, expert).

  Raises:
    ValueError: for an entry that is not three comma-separated integers.
  """
  meshes = []
  for entry in filter(None, (e.strip() for e in text.split(";"))):
    sizes = [p.strip() for p in entry.split(",")]
    if len(sizes) != 3 or not all(p.lstrip("-").isdigit() for p in sizes):
      raise ValueError(f"--meshes entry {entry!r} must be three integers data,fsdp,expert")
    meshes.append(MeshConfig(*map(int, sizes)))
  return meshes
