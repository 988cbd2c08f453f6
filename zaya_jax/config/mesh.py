"""The mesh's axis names and `MeshConfig`, its shape: data only, no JAX devices.

Axes (`MESH_AXES`, in this order): `data` (pure replicas), `fsdp` (FSDP / ZeRO-3), `expert`
(expert parallelism), `context` (context parallelism: the sequence dimension of activations,
zaya_jax/parallel/context.py). The mesh itself, the logical-axis rules and shardings are
`zaya_jax.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import math

DATA, FSDP, EXPERT, CONTEXT = "data", "fsdp", "expert", "context"
MESH_AXES = (DATA, FSDP, EXPERT, CONTEXT)  # context last: its neighbours are adjacent devices
BATCH_AXES = (DATA, FSDP, EXPERT)  # every batch-like axis: the global batch splits over all
# Axes that split the tokens M = B*T (B-major): the batch axes, then the sequence's `context`.
# A `[B, T]` array sharded P(BATCH_AXES, CONTEXT) flattens to `[M]` sharded P(TOKEN_AXES).
TOKEN_AXES = (DATA, FSDP, EXPERT, CONTEXT)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape: devices along `data`, `fsdp`, `expert`, `context`. One of them may be -1
  (inferred). `context` splits every sequence over that many devices (default 1), in zigzag
  order: 2 x context chunks, device r holds chunks r and 2C - 1 - r (parallel/context.py).

  Raises:
    ValueError: more than one -1, a size < 1, or a product that does not divide the device
      count (names the field and the numbers).
  """

  data: int = 1
  fsdp: int = -1
  expert: int = 1
  context: int = 1

  def __post_init__(self):
    sizes = dataclasses.asdict(self)
    if sum(v == -1 for v in sizes.values()) > 1:
      raise ValueError(f"at most one mesh axis may be -1 (inferred), got {sizes}; give the "
                       "others their sizes")
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
  """`"1,1,8;2,1,4"` -> MeshConfigs (data, fsdp, expert[, context]; context default 1).

  Raises:
    ValueError: for an entry that is not three or four comma-separated integers.
  """
  meshes = []
  for entry in filter(None, (e.strip() for e in text.split(";"))):
    sizes = [p.strip() for p in entry.split(",")]
    if len(sizes) not in (3, 4) or not all(p.lstrip("-").isdigit() for p in sizes):
      raise ValueError(f"--meshes entry {entry!r} must be three integers data,fsdp,expert "
                       "(or four: data,fsdp,expert,context)")
    meshes.append(MeshConfig(*map(int, sizes)))
  return meshes


def check_context(context: int, seq_len: int, halo: int, attention_impl: str) -> None:
  """Fails if `seq_len` cannot be split into the 2 x `context` zigzag chunks that CCA runs
  on (context parallelism, zaya_jax/parallel/context.py: shard r holds chunks r and
  2C - 1 - r). `context == -1` (inferred from the device count) is checked once the mesh is
  built. No padding is added.

  Args:
    context: `mesh.context`; seq_len: `train.seq_len`; halo: tokens before a chunk that
      CCA reads (`max(ModelConfig.context_halo)`); attention_impl: `model.attention_impl`.
  Raises:
    ValueError: one line naming the field and the fix: `train.seq_len` not divisible by
      2 x `mesh.context`, a chunk shorter than CCA's halo, or `model.attention_impl="pallas"`
      (the kernel has no zigzag query blocks yet).
  """
  if context in (1, -1):
    return
  if seq_len % (2 * context):
    raise ValueError(f"train.seq_len={seq_len} is not divisible by 2 x mesh.context = "
                     f"{2 * context} (context parallelism cuts a sequence into 2 x context "
                     f"zigzag chunks); use a sequence length that is a multiple of "
                     f"{2 * context}")
  if seq_len // (2 * context) < halo:
    raise ValueError(f"train.seq_len={seq_len} / (2 x mesh.context={context}) = "
                     f"{seq_len // (2 * context)} token(s) per chunk is shorter than CCA's halo "
                     f"of {halo} tokens (model.cca_time0 + model.cca_time1 - 2); use fewer "
                     f"context shards or a train.seq_len of at least {2 * context * halo}")
  if attention_impl == "pallas":
    raise ValueError("model.attention_impl='pallas' does not run under mesh.context > 1 yet "
                     "(the kernel has no zigzag query blocks); set model.attention_impl='xla'")
