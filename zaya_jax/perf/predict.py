# Shape letters: none of the model legend (HLO buffers are read as bytes); n = devices of a
# collective's group, g = of them inside one node, m = nodes it spans.
"""A predicted training step on a cluster: the compiled step's collectives, priced and scaled.

`predict_step` compiles the real training step (`zaya_jax.perf.mesh_sweep.compile_train_step`,
abstract inputs: nothing is allocated) on a mesh of fake CPU devices, lists every collective
of the compiled HLO with its bytes per device and its executions per step (ops inside the layer
scan and other `while` loops times their trip counts, `zaya_jax.perf.hlo`), finds which mesh
axes each one runs over (`group_axes`, from its replica groups), scales its buffer to the
target mesh (`scaled_bytes`) and prices it there (`collective_time`) with a link model
(`Network`), then sets the sum beside the roofline compute time of the same step
(`zaya_jax.perf.roofline.estimate`) for a predicted step time, MFU and tokens/s per device.

Scaling a buffer from the compile mesh to the target mesh (the tokens per device are the
same on both: the compile batch is the target's per-device batch times the compile devices):
- inside the MoE's `shard_map` (the token exchange): the per-device input is the same on both
  meshes, so an all-gather's result and a reduce-scatter's operand grow with the group
  (x n_target / n_compile); all-to-all, all-reduce and permute buffers stay;
- outside it (parameters, gradients, metrics): a buffer is a whole tensor along its group's
  axes and, when `fsdp` is not among them, an `fsdp` shard (parameters shard D over fsdp;
  activations are not exchanged outside the MoE), so it scales by fsdp_compile / fsdp_target
  exactly then. Expert weights shard over `expert`: the compile mesh should have the target's
  expert size (`predict_step` warns otherwise).
Pricing (bandwidth-optimal ring / pairwise algorithms, hierarchical over nodes; devices are
numbered with `expert` innermost, then fsdp, then data, `devices_per_node` to a node):
  all-gather, reduce-scatter  bytes (g-1)/g over the scale-up link + (m-1)/m over the g NICs
                              of each node; (g-1) intra + min(m-1, 2 ceil(log2 m)) inter
                              latencies (ring, or a tree across many nodes)
  all-reduce                  twice that (reduce-scatter + all-gather), i.e. 2(n-1)/n
  all-to-all (ragged too)     (g-1)/n of the buffer intra-node, (n-g)/n through the NIC;
                              (g-1) intra + (m-1) inter latencies
  collective-permute          the buffer over one link, one latency
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import time
from typing import Any, Callable

import jax
import numpy as np

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.mesh import CONTEXT, MESH_AXES, MeshConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.accelerators import AcceleratorProfile
from zaya_jax.parallel.mesh import FSDP, make_mesh, use_mesh
from zaya_jax.perf import hlo, roofline
from zaya_jax.perf.report import text_table
from zaya_jax.perf.benchmark import parse_balance_variant
from zaya_jax.perf.mesh_sweep import compile_train_step

GIGA = 1e9
# What the paper's cluster is reported to reach (arXiv 2511.17127's cluster; figure quoted by
# AMD's announcement of it, 2025-11-22): "over 750 PFLOPs of Max Achievable FLOPS" on 128
# nodes x 8 MI300X. A hardware figure (a GEMM benchmark), not ZAYA1's model throughput; the
# paper's tokens/s per GPU was not available to this code's authors.
PAPER_CLUSTER = {"devices": 1024, "max_achievable_flops": 750e15,
                 "source": "AMD, 'Zyphra demonstrates large scale training on AMD with ZAYA1' "
                           "(2025-11-22), on the arXiv 2511.17127 cluster: >750 PFLOP/s max "
                           "achievable FLOPS, 1,024 MI300X"}


@dataclasses.dataclass(frozen=True)
class Network:
  """Per-device link figures the collectives are priced with.

  Attributes:
    intra_bandwidth: bytes/s per device per direction inside a node (xGMI / NVLink).
    inter_bandwidth: bytes/s per device per direction between nodes (one NIC per device).
    intra_latency: seconds per algorithm step inside a node.
    inter_latency: seconds per algorithm step between nodes.
    devices_per_node: devices on one scale-up fabric.
    source: where the figures come from (printed with the prediction).
  """

  intra_bandwidth: float
  inter_bandwidth: float
  intra_latency: float = 10e-6
  inter_latency: float = 25e-6
  devices_per_node: int = 8
  source: str = ""

  def __post_init__(self):
    for name in ("intra_bandwidth", "inter_bandwidth", "devices_per_node"):
      if not getattr(self, name) > 0:
        raise ValueError(f"Network.{name}={getattr(self, name)} must be > 0")
    for name in ("intra_latency", "inter_latency"):
      if getattr(self, name) < 0:
        raise ValueError(f"Network.{name}={getattr(self, name)} must be >= 0 seconds")


def network_from_profile(profile: AcceleratorProfile, *, intra_latency: float = 10e-6,
                         inter_latency: float = 25e-6) -> Network:
  """`Network` from an accelerator profile's peak per-direction link figures
  (`zaya_jax.parallel.accelerators`: MI300X 448 GB/s xGMI, 50 GB/s per 400 Gb/s NIC)."""
  return Network(profile.scale_up_bandwidth, profile.scale_out_bandwidth, intra_latency,
                 inter_latency, profile.devices_per_node,
                 f"{profile.name} profile peaks: {profile.scale_up_bandwidth / GIGA:.0f} GB/s "
                 f"intra-node, {profile.scale_out_bandwidth / GIGA:.0f} GB/s inter-node per device "
                 f"and direction; latency {intra_latency * 1e6:.0f} / {inter_latency * 1e6:.0f} us "
                 "per step (assumed)")


# --------------------------------------------------------------------------------------------
# Which mesh axes a collective runs over.
# --------------------------------------------------------------------------------------------


def _replica_groups(attrs: str, num_devices: int) -> np.ndarray | None:
  """[groups, size] device ids of `replica_groups=` (explicit, iota or `{}`), or None."""
  m = re.search(r"replica_groups=\{\}", attrs)
  if m:
    return np.arange(num_devices)[None]
  m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", attrs)
  if m:
    rows = [[int(v) for v in g.split(",") if v.strip()] for g in re.findall(r"\{([^}]*)\}", m.group(1))]
    return np.array(rows)
  m = re.search(r"replica_groups=\[([\d,]+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
  if m:
    return _iota(m.group(2), num_devices).reshape([int(v) for v in m.group(1).split(",")])
  return None


def group_axes(attrs: str, mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """Mesh axes (in `MESH_AXES` order) along which the devices of one group differ.

  Device id p of the HLO (partition id) is position p of the mesh's device array, row-major
  over `mesh_shape`'s axes. Reads `replica_groups=` in XLA's spellings (explicit lists, iota
  `[G,S]<=[dims]T(perm)`, `mesh[...] {axes}`, `{}` = all devices) and, for
  collective-permute, `source_target_pairs=`.

  Raises:
    ValueError: if the attributes name no groups (the op's text is quoted).
  """
  names = [a for a in MESH_AXES if a in mesh_shape]
  dims = [mesh_shape[a] for a in names]
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}",
                attrs)
  if m:  # mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}: groups vary along the named axes
    sizes = [(kv.split("=")[0].strip("' "), int(kv.split("=")[1])) for kv in m.group(1).split(",")]
    ids = _iota(m.group(2), math.prod(dims)) if m.group(2) else np.arange(math.prod(dims))
    grid = ids.reshape([n for _, n in sizes])
    named = {a.strip("' ") for a in m.group(3).split(",") if a.strip()}
    first = grid[tuple(slice(None) if a in named else 0 for a, _ in sizes)].reshape(-1)
    return _varying(first, names, dims)
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if m:
    pairs = np.array([[int(v) for v in p.split(",")] for p in re.findall(r"\{?(\d+,\d+)\}?", m.group(1) + "}")])
    coords = np.stack(np.unravel_index(pairs.reshape(-1), dims), -1).reshape(len(pairs), 2, -1)
    varying = (coords[:, 0] != coords[:, 1]).any(0)
    return tuple(a for a, v in zip(names, varying) if v)
  groups = _replica_groups(attrs, math.prod(dims))
  if groups is None:
    raise ValueError(f"no replica groups in collective attributes {attrs[:160]!r}")
  return _varying(groups[0], names, dims)


def _varying(group: np.ndarray, names: list[str], dims: list[int]) -> tuple[str, ...]:
  """Axes of `names` (sizes `dims`, row-major device ids) along which `group`'s ids differ."""
  coords = np.stack(np.unravel_index(np.asarray(group), dims), -1)  # [size, axes]
  return tuple(a for i, a in enumerate(names) if len(set(coords[:, i])) > 1)


def _iota(text: str, total: int) -> np.ndarray:
  """Device ids of `[dims]T(perm)` (an iota reshaped and transposed) or of `0,2,1,...`."""
  m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
  if not m:
    return np.array([int(v) for v in text.split(",") if v.strip()])
  ids = np.arange(total).reshape([int(v) for v in m.group(1).split(",")])
  if m.group(2):
    ids = ids.transpose([int(v) for v in m.group(2).split(",")])
  return ids.reshape(-1)


# --------------------------------------------------------------------------------------------
# Scaling and pricing one collective.
# --------------------------------------------------------------------------------------------


def scaled_bytes(kind: str, nbytes: float, axes: tuple[str, ...], in_shard_map: bool,
                 compile_mesh: dict[str, int], target_mesh: dict[str, int]) -> float:
  """Bytes per device per execution on `target_mesh` of a buffer of `nbytes` on
  `compile_mesh` (module docstring: the MoE exchange's per-device input is fixed; outside
  the shard_map a buffer is an fsdp shard exactly when fsdp is not among its axes)."""
  if in_shard_map:
    if kind in ("all-gather", "reduce-scatter"):
      grow = math.prod(target_mesh[a] for a in axes) / math.prod(compile_mesh[a] for a in axes)
      return nbytes * grow
    return nbytes
  if FSDP not in axes:
    return nbytes * compile_mesh[FSDP] / target_mesh[FSDP]
  return nbytes


def node_split(axes: tuple[str, ...], mesh: dict[str, int], devices_per_node: int) -> tuple[int, int]:
  """`(g, m)`: devices of one group inside one node and nodes the group spans (g m = n).

  Devices are numbered row-major over `MESH_AXES` (the last axis innermost); a node holds
  `devices_per_node` consecutive ones. An axis only partly inside a node (its inner factor)
  contributes that factor to g. An axis missing from `mesh` has size 1.
  """
  room, inside = devices_per_node, 1
  for a in reversed(MESH_AXES):
    size = mesh.get(a, 1)
    local = math.gcd(size, room)  # the part of this axis that fits in the node
    room //= local
    if a in axes:
      inside *= local
  n = math.prod(mesh.get(a, 1) for a in axes)
  return inside, n // inside


def collective_time(kind: str, nbytes: float, n: int, g: int, net: Network) -> float:
  """Seconds of one execution of a collective over `n` devices, `g` of them per node, with
  per-device buffer `nbytes` (the gathered result / scattered operand / reduced or sent
  buffer, as `zaya_jax.perf.hlo.collective_ops` counts it); module docstring."""
  if n <= 1 or nbytes <= 0:
    return 0.0
  m = n // g
  if kind == "collective-permute":
    inter = g < n
    return (net.inter_latency if inter else net.intra_latency) + nbytes / (
        net.inter_bandwidth if inter else net.intra_bandwidth)
  if kind in ("all-to-all", "ragged-all-to-all"):
    return ((g - 1) * net.intra_latency + (m - 1) * net.inter_latency
            + nbytes * (g - 1) / n / net.intra_bandwidth + nbytes * (n - g) / n / net.inter_bandwidth)
  # Across nodes NCCL/RCCL pick a tree for small messages: the fewer of the ring's m - 1 and a
  # tree's 2 ceil(log2 m) latency steps.
  inter_steps = min(m - 1, 2 * math.ceil(math.log2(m))) if m > 1 else 0
  one = ((g - 1) * net.intra_latency + inter_steps * net.inter_latency
         + nbytes * (g - 1) / g / net.intra_bandwidth
         + (nbytes * (m - 1) / m / (g * net.inter_bandwidth) if m > 1 else 0.0))
  return 2 * one if kind == "all-reduce" else one


@dataclasses.dataclass(frozen=True)
class PricedOp:
  """One collective of the compiled step, on the compile mesh and priced on the target.

  Attributes:
    kind, name, executions, op_name: as `hlo.CollectiveOp` (executions per step).
    axes: mesh axes of its groups. in_shard_map: part of the MoE token exchange.
    compile_bytes: bytes per device per execution on the compile mesh.
    target_bytes: the same on the target mesh (`scaled_bytes`).
    n, g: devices of a group on the target and of them per node.
    seconds: per step on the target (executions x `collective_time`).
  """

  kind: str
  name: str
  axes: tuple[str, ...]
  in_shard_map: bool
  executions: int
  compile_bytes: int
  target_bytes: float
  n: int
  g: int
  seconds: float
  op_name: str = ""


def price_ops(hlo_text: str | hlo.HloModule, compile_mesh: dict[str, int],
              target_mesh: dict[str, int], net: Network) -> list[PricedOp]:
  """Every collective of `hlo_text` (compiled on `compile_mesh`) priced on `target_mesh`.

  Raises:
    ValueError: an axis name missing from either mesh, or a collective without groups.
  """
  module = hlo_text if isinstance(hlo_text, hlo.HloModule) else hlo.parse_hlo(hlo_text)
  # A mesh written without `context` (the axis added last) has context 1.
  compile_mesh = {CONTEXT: 1, **compile_mesh}
  target_mesh = {CONTEXT: 1, **target_mesh}
  for mesh in (compile_mesh, target_mesh):
    if set(mesh) != set(MESH_AXES):
      raise ValueError(f"mesh {mesh} must name exactly the axes {MESH_AXES}")
  attrs = {name: a for instrs in module.instructions.values() for name, _, _, _, a in instrs}
  out = []
  for op in hlo.collective_ops(module):
    axes = group_axes(attrs[op.name], compile_mesh)
    in_map = "shard_map" in op.op_name
    nbytes = scaled_bytes(op.kind, op.bytes, axes, in_map, compile_mesh, target_mesh)
    n = math.prod(target_mesh[a] for a in axes)
    g, _ = node_split(axes, target_mesh, net.devices_per_node)
    secs = op.executions * collective_time(op.kind, nbytes, n, g, net)
    out.append(PricedOp(op.kind, op.name, axes, in_map, op.executions, op.bytes, nbytes, n, g,
                        secs, op.op_name))
  return out


def summarise(ops: list[PricedOp]) -> list[dict[str, Any]]:
  """Ops grouped by (kind, axes, in shard_map): instructions, executions per step, bytes per
  device per step on both meshes and seconds per step on the target, largest time first."""
  groups: dict[tuple, dict[str, Any]] = {}
  for o in ops:
    key = (o.kind, o.axes, o.in_shard_map)
    row = groups.setdefault(key, {"kind": o.kind, "axes": o.axes, "moe": o.in_shard_map,
                                  "instructions": 0, "executions": 0, "compile_bytes": 0,
                                  "target_bytes": 0.0, "seconds": 0.0, "n": o.n, "g": o.g})
    row["instructions"] += 1
    row["executions"] += o.executions
    row["compile_bytes"] += o.compile_bytes * o.executions
    row["target_bytes"] += o.target_bytes * o.executions
    row["seconds"] += o.seconds
  return sorted(groups.values(), key=lambda r: -r["seconds"])


# --------------------------------------------------------------------------------------------
# The prediction.
# --------------------------------------------------------------------------------------------


def _compiled_text(model_cfg, train_cfg, mesh, batch, seq_len, balance, hlo_dir, log) -> str:
  """`compile_train_step(...).as_text()`, read from / written to `hlo_dir` when given."""
  key = hashlib.sha256(repr((model_cfg, train_cfg, balance, dict(mesh.shape), batch, seq_len,
                             jax.__version__)).encode()).hexdigest()[:16]
  path = os.path.join(hlo_dir, f"train_step_{key}.hlo") if hlo_dir else None
  if path and os.path.exists(path):
    log(f"reading the compiled step from {path}")
    with open(path, encoding="utf-8") as f:
      return f.read()
  log(f"compiling the train step on {dict(mesh.shape)} with balancing {balance.mode if balance.enabled else 'none'} ...")
  start = time.perf_counter()
  text = compile_train_step(model_cfg, train_cfg, mesh, batch, seq_len, balance).as_text()
  log(f"  compiled in {time.perf_counter() - start:.0f} s")
  if path:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
  return text


def predict_step(model_cfg: ModelConfig, train_cfg: TrainConfig, profile: AcceleratorProfile,
                 net: Network, *, compile_mesh: MeshConfig, target_mesh: MeshConfig,
                 target_devices: int, seqs_per_device: int, seq_len: int, variants: list[str],
                 hlo_dir: str | None = None, balance: BalanceConfig | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
  """Compiles the step once per balancing variant on `compile_mesh` and predicts it on the
  target (module docstring).

  Args:
    model_cfg, train_cfg: the run (its `dtype`, `moe_dispatch` and `remat` are compiled).
    profile: the target accelerator (roofline compute and peak).
    net: link figures of the target cluster.
    compile_mesh: a mesh of the local (fake CPU) devices, sizes per axis.
    target_mesh, target_devices: the cluster's mesh and device count.
    seqs_per_device: sequences per device per step (both meshes), seq_len: tokens each.
    variants: balancing variants (`parse_balance_variant`: "none", "quantile:next", ...),
      built on `balance` (the run config's balance group; None = the defaults).
    hlo_dir: a folder caching each compiled module's text under a hash of everything
      compiled (configs, mesh, batch); None = always compile.

  Returns:
    `{"compile_mesh", "target_mesh", "compute_s", "flops_per_token", "tokens_per_device",
    "variants": {variant: {"ops": [PricedOp], "summary": summarise(...), "comm_s",
    "step_overlapped_s", "step_serial_s", "mfu_overlapped", "mfu_serial",
    "tokens_per_s_per_device"}}, "warnings": [...]}`.

  Raises:
    ValueError: an unknown variant, or a mesh that does not divide the model or batch.
  """
  mesh = make_mesh(compile_mesh)
  small = dict(mesh.shape)
  target = target_mesh.shape(target_devices)
  warnings = []
  if small["expert"] != target["expert"]:
    warnings.append(f"compile mesh expert={small['expert']} != target expert={target['expert']}: "
                    "expert-weight gathers are priced at the compile mesh's expert shards")
  tokens = seqs_per_device * seq_len
  remat = "full" if model_cfg.remat else "none"
  est = roofline.estimate(model_cfg, profile, num_devices=target_devices,
                          batch_size=seqs_per_device * target_devices, seq_len=seq_len,
                          dtype=model_cfg.dtype, remat=remat, mesh=target_mesh)
  peak = profile.peak_flops(model_cfg.dtype)
  result: dict[str, Any] = {"compile_mesh": small, "target_mesh": target, "variants": {},
                            "compute_s": est.compute_seconds, "flops_per_token": est.flops_per_token,
                            "tokens_per_device": tokens, "peak_flops": peak, "warnings": warnings,
                            "network": net.source, "profile": profile.name}
  balances = {v: parse_balance_variant(v, "variants", balance)  # all before compiling
              for v in variants}
  with use_mesh(mesh):
    for v in variants:
      balance = balances[v]
      text = _compiled_text(model_cfg, train_cfg, mesh, seqs_per_device * mesh.size, seq_len,
                            balance, hlo_dir, log)
      sweeps = balance.quantile_sweeps if v == "quantile:current" else 1
      ops = price_ops(hlo.parse_hlo(text, unknown_trip_count=sweeps), small, target, net)
      comm = sum(o.seconds for o in ops)
      row = {"ops": ops, "summary": summarise(ops), "comm_s": comm,
             "step_overlapped_s": max(est.compute_seconds, comm),
             "step_serial_s": est.compute_seconds + comm}
      for mode in ("overlapped", "serial"):
        step = row[f"step_{mode}_s"]
        row[f"mfu_{mode}"] = est.flops_per_token * tokens / (step * peak)
        row[f"tokens_per_s_per_device_{mode}"] = tokens / step
      result["variants"][v] = row
  return result


def _axes(axes: tuple[str, ...]) -> str:
  return "+".join(axes) or "-"


def balancing_delta(result: dict[str, Any], variant: str, reference: str = "none") -> list[dict]:
  """Rows of `summarise` by (kind, axes, moe) where `variant` differs from `reference`:
  executions, target bytes and seconds per step, variant minus reference."""
  ref = {(r["kind"], r["axes"], r["moe"]): r for r in result["variants"][reference]["summary"]}
  own = {(r["kind"], r["axes"], r["moe"]): r for r in result["variants"][variant]["summary"]}
  zero = {"executions": 0, "target_bytes": 0.0, "seconds": 0.0}
  rows = []
  for key in sorted(set(ref) | set(own), key=str):
    a, b = own.get(key, zero), ref.get(key, zero)
    d = {f: a[f] - b[f] for f in ("executions", "target_bytes", "seconds")}
    if d["executions"] or abs(d["target_bytes"]) > 0:
      rows.append({"kind": key[0], "axes": key[1], "moe": key[2], **d})
  return rows


def format_prediction(result: dict[str, Any], *, title: str) -> str:
  """The prediction as text: the variants' step times, each variant's collectives by kind
  and axes, balancing's own collectives against "none", and the paper's reference figure."""
  t, c = result["target_mesh"], result["compile_mesh"]
  n_target = math.prod(t.values())
  mib, ms = 2.0**20, 1e3
  out = [f"{title}; target mesh " + " ".join(f"{k}={v}" for k, v in t.items())
         + f" ({n_target} x {result['profile']}); compiled on fake CPU devices "
         + " ".join(f"{k}={v}" for k, v in c.items()) + f"; {result['tokens_per_device']} tokens "
         f"per device per step", f"network: {result['network']}",
         f"compute (roofline, zaya_jax.perf.roofline): {result['compute_s'] * ms:.1f} ms per step; "
         f"{result['flops_per_token'] / 1e9:.3f} GFLOP/token; peak {result['peak_flops'] / 1e12:.1f} "
         "TFLOP/s", *[f"WARNING: {w}" for w in result["warnings"]]]
  lines = []
  for v, r in result["variants"].items():
    lines.append((v, str(sum(o.executions for o in r["ops"])),
                  f"{sum(o.target_bytes * o.executions for o in r['ops']) / mib:,.1f}",
                  f"{r['comm_s'] * ms:.1f}", f"{r['step_overlapped_s'] * ms:.1f}",
                  f"{100 * r['mfu_overlapped']:.1f}%", f"{r['tokens_per_s_per_device_overlapped']:,.0f}",
                  f"{r['step_serial_s'] * ms:.1f}", f"{100 * r['mfu_serial']:.1f}%",
                  f"{r['tokens_per_s_per_device_serial']:,.0f}"))
  out += ["", "Predicted step (overlapped = max(compute, comm); serial = compute + comm):",
          text_table(("balancing", "collectives", "MiB/dev", "comm ms", "step ms", "MFU",
                      "tok/s/GPU", "serial ms", "MFU", "tok/s/GPU"), lines, left=(0,))]
  for v, r in result["variants"].items():
    lines = [(row["kind"], _axes(row["axes"]), "yes" if row["moe"] else "", str(row["instructions"]),
              str(row["executions"]), f"{row['compile_bytes'] / mib:,.2f}",
              f"{row['target_bytes'] / mib:,.2f}", str(row["n"]), str(row["g"]),
              f"{row['seconds'] * ms:.2f}") for row in r["summary"]]
    out += ["", f"Collectives per step, balancing {v} (bytes per device per step, all executions):",
            text_table(("kind", "axes", "MoE", "ops", "runs/step", "compile MiB", "target MiB",
                        "n", "per node", "ms"), lines, left=(0, 1, 2))]
  if "none" in result["variants"]:
    for v in result["variants"]:
      if v == "none":
        continue
      rows = balancing_delta(result, v)
      lines = [(row["kind"], _axes(row["axes"]), "yes" if row["moe"] else "",
                f"{row['executions']:+d}", f"{row['target_bytes'] / mib:+,.3f}",
                f"{row['seconds'] * ms:+.3f}") for row in rows]
      out += ["", f"Balancing {v}'s own collectives (minus none's):",
              text_table(("kind", "axes", "MoE", "runs/step", "target MiB", "ms"), lines,
                         left=(0, 1, 2)) if lines else "  none"]
  p = PAPER_CLUSTER
  per_dev = p["max_achievable_flops"] / p["devices"]
  first = next(iter(result["variants"].values()))
  model_flops = result["flops_per_token"] * first["tokens_per_s_per_device_overlapped"]
  out += ["", f"Reference: {p['source']} = {per_dev / 1e12:.0f} TFLOP/s per GPU "
          f"({100 * per_dev / result['peak_flops']:.0f}% of peak; a hardware figure, not ZAYA1's "
          f"throughput). Predicted model FLOP/s per GPU ({next(iter(result['variants']))}, "
          f"overlapped): {model_flops / 1e12:.0f} TFLOP/s = {model_flops / per_dev:.2f}x it."]
  return "\n".join(out)
