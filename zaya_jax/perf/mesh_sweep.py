# Shape letters: B T D L (see zaya_jax/__init__.py); n = size of the `expert` axis.
"""Mesh-shape experiments: compile the real training step on a mesh and read what XLA reports.

For one `(mesh, dispatch)` pair, `sweep_row` builds the training step exactly as
`zaya_jax.train.loop.run` does (`zaya_jax.train.setup.setup_training`), lowers it on
*abstract* inputs (`jax.ShapeDtypeStruct`s carrying their `NamedSharding`s, so an
8.3B-parameter state never materialises) and compiles it. It reports,
per device:

- memory from `compiled.memory_analysis()`: arguments, outputs, temporaries, generated code,
  and `total` = arguments + outputs - aliased (donated) bytes + temporaries;
- FLOPs and bytes accessed from `compiled.cost_analysis()` (see `_cost`: XLA counts a while
  loop's body once, so these are *not* multiplied by the layer count), and `dot_flops`, the
  matmul FLOPs read from the HLO with every layer counted;
- bytes handed to each collective, read from the compiled HLO (`collective_ops`);
- optionally, the measured step time (median of a few steps after one warm-up step, real
  arrays, synthetic tokens) and tokens/s.

On a host with fake CPU devices (`--xla_force_host_platform_device_count`) every figure
describes XLA:CPU's program for those devices, not a GPU's.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import statistics
import textwrap
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.dispatch import resolve_dispatch
from zaya_jax.parallel.mesh import (EXPERT, MeshConfig, abstract_with_shardings, batch_sharding,
                                    check_divisibility, make_mesh, use_mesh)
from zaya_jax.train.optim import make_optimizer
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import abstract_model, init_train_state

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
               "ragged-all-to-all")
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")

# --------------------------------------------------------------------------------------------
# Configs: the model and optimizer groups only (the sweep feeds synthetic tokens).
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Compile on abstract inputs.
# --------------------------------------------------------------------------------------------


def abstract_batch(batch_size: int, seq_len: int, mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """`jax.ShapeDtypeStruct`s of one `[B, T]` training batch in `batch_sharding(mesh)`."""
  sharding = batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len),
                                  jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
          for k in BATCH_KEYS}


def lower_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh,
                     batch_size: int, seq_len: int,
                     balance: BalanceConfig | None = None) -> jax.stages.Lowered:
  """The jitted `train_step` of `zaya_jax.train.loop.run`, lowered on abstract inputs.

  Must run inside `use_mesh(mesh)`. Nothing is allocated: the TrainState and the batch are
  `jax.ShapeDtypeStruct`s with the shardings the training loop gives them. `balance`: the
  balancing-bias controller config (None = off), as training passes it.

  Raises:
    ValueError: if the mesh does not divide the experts, the hidden size or the batch.
  """
  check_divisibility(mesh, num_experts=model_cfg.num_experts, hidden_size=model_cfg.hidden_size,
                     batch_size=batch_size, grad_accum_steps=train_cfg.grad_accum_steps)
  built = setup_training(model_cfg, train_cfg, mesh, balance)
  return built.step.lower(abstract_with_shardings(built.abstract_state, built.state_sharding),
                          abstract_batch(batch_size, seq_len, mesh))


def compile_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: jax.sharding.Mesh,
                       batch_size: int, seq_len: int,
                       balance: BalanceConfig | None = None) -> jax.stages.Compiled:
  """`lower_train_step(...).compile()`: the XLA executable of one training step on `mesh`.

  Callable as `compiled(state, batch)` with real arrays in the training shardings (the
  state's buffers are donated). Must run inside `use_mesh(mesh)`.
  """
  return lower_train_step(model_cfg, train_cfg, mesh, batch_size, seq_len, balance).compile()


# --------------------------------------------------------------------------------------------
# Collectives in HLO text.
# --------------------------------------------------------------------------------------------

_DTYPE_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
               "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
               "c64": 64, "c128": 128}
_ARRAY_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z0-9]*)?)\[([^\]]*)\]")
_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # `%` only after optimisation
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_RE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                        r"=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PARTITIONS_RE = re.compile(r"num_partitions=(\d+)")
_INT_CONSTANT_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+"
                              r"constant\((\d+)\)")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of an HLO module.

  Attributes:
    kind: one of `COLLECTIVES` (an async `-start` counts as its op; `-done` is not counted).
    name: the HLO instruction name.
    bytes: bytes per device per execution (see `collective_ops` for which buffer).
    group_size: devices in each replica group (None for collective-permute).
    executions: times the op runs per step (product of enclosing while-loop trip counts).
    op_name: the JAX op path from the instruction's metadata ("" when absent); ops of the
      MoE's token exchange contain "shard_map".
  """

  kind: str
  name: str
  bytes: int
  group_size: int | None
  executions: int
  op_name: str = ""

  @property
  def total_bytes(self) -> int:
    return self.bytes * self.executions

  @property
  def off_shard_bytes(self) -> float:
    """Of `total_bytes`, the part that leaves the device: (g-1)/g of it for the group ops (an
    all-reduce is counted once, not as a ring's 2(g-1)/g), all of it for collective-permute."""
    if self.group_size is None:
      return float(self.total_bytes)
    return self.total_bytes * (self.group_size - 1) / self.group_size


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: `f32[40,128]{1,0}`, or a tuple `(f32[2], s32[])` summed."""
  total = 0
  for dtype, dims in _ARRAY_RE.findall(shape):
    bits = _DTYPE_BITS.get(dtype, 8 if dtype.startswith("f8") else None)
    if bits is None:  # token[], opaque: no data
      continue
    n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    total += -(-n * bits // 8)
  return total


def _split_top(text: str, sep: str = ",") -> list[str]:
  """Splits `text` at `sep` outside (), [], {}."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _closing(text: str, open_at: int) -> int:
  """Index of the bracket closing the one at `open_at`."""
  depth = 0
  for i in range(open_at, len(text)):
    if text[i] in "([{":
      depth += 1
    elif text[i] in ")]}":
      depth -= 1
      if depth == 0:
        return i
  raise ValueError(f"unbalanced brackets in HLO line: {text[:200]!r}")


def _parse_instruction(rest: str) -> tuple[str, str, list[str], str]:
  """`(shape, opcode, operand names, attributes)` of the text after `%name = `."""
  rest = re.sub(r"/\*.*?\*/", "", rest)
  if rest.startswith("("):
    end = _closing(rest, 0) + 1
  else:
    end = rest.index(" ")
  shape, tail = rest[:end], rest[end:].lstrip()
  m = re.match(r"([\w\-]+)\(", tail)
  if not m:
    return shape, "", [], tail
  close = _closing(tail, m.end() - 1)
  operands = [o.split()[-1].lstrip("%") for o in _split_top(tail[m.end():close])]
  return shape, m.group(1), operands, tail[close + 1:]


def _group_size(attrs: str, num_partitions: int) -> int | None:
  """Devices per replica group from `replica_groups=` in any of XLA's three spellings."""
  m = re.search(r"replica_groups=(\{\{[^=]*?\}\}|\{\})", attrs)
  if m:
    if m.group(1) == "{}":
      return num_partitions
    return len(m.group(1)[2:].split("}")[0].split(","))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)  # iota: [groups, size]<=[...]
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)  # mesh['a'=8,...] {'a'}
  if m:
    sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
    return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
  return None


@dataclasses.dataclass(frozen=True)
class HloModule:
  """An HLO module's instructions, grouped by computation, with executions per step.

  Attributes:
    instructions: computation name -> `(name, shape, opcode, operand names, attributes)`.
    shapes: instruction name -> its shape string (names are unique in a module).
    runs: computation name -> times it runs per step (0 if unreachable from ENTRY).
    num_partitions: SPMD partitions of the module (devices of the mesh).
  """

  instructions: dict[str, list[tuple[str, str, str, list[str], str]]]
  shapes: dict[str, str]
  runs: dict[str, int]
  num_partitions: int


def parse_hlo(hlo_text: str) -> HloModule:
  """Parses HLO text and counts how often each computation runs per step.

  The layer scan is an HLO `while`; its body runs once per layer. A computation's count is
  the product of the trip counts of the while loops around it, summed over its call sites:
  the compiled module carries `backend_config={"known_trip_count":{"n":"L"}}` on each
  `while`; when that is missing (pre-optimisation HLO from `Lowered.as_text(dialect="hlo")`)
  the trip count is the one scalar integer constant of the loop condition when it compares
  with `direction=LT`, else 1. Each branch of a `conditional` counts once (an upper bound).

  Raises:
    ValueError: if the text has no ENTRY computation.
  """
  partitions = _PARTITIONS_RE.search(hlo_text)
  num_partitions = int(partitions.group(1)) if partitions else 1
  comps: dict[str, list[tuple[str, str, str, list[str], str]]] = {}
  shapes: dict[str, str] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMP_RE.match(line)
    if m and "=" not in line.split("(")[0]:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    m = _INSTR_RE.match(line)
    if m and current is not None:
      shape, opcode, operands, attrs = _parse_instruction(m.group(2))
      shapes[m.group(1)] = shape
      comps[current].append((m.group(1), shape, opcode, operands, attrs))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")

  lines = map(_INT_CONSTANT_RE.match, hlo_text.splitlines())
  constants = {m.group(1): int(m.group(2)) for m in lines if m}

  def trip(attrs: str) -> int:
    m = _TRIP_RE.search(attrs)
    if m:
      return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", attrs)
    if cond and cond.group(1) in comps:
      body = comps[cond.group(1)]
      values = [constants[name] for name, *_ in body if name in constants]
      compares_lt = any(op == "compare" and "direction=LT" in a for _, _, op, _, a in body)
      if len(values) == 1 and compares_lt:
        return values[0]
    return 1

  # Executions per step of each computation, from ENTRY down the call graph (a DAG).
  callees: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
  for c, instrs in comps.items():
    for _, _, op, _, attrs in instrs:
      n = trip(attrs) if op == "while" else 1
      for key, callee in _CALLEE_RE.findall(attrs):
        callees[c].append((callee, n if key == "body" else 1))
      for group in _BRANCHES_RE.findall(attrs):
        callees[c] += [(b.strip().lstrip("%"), 1) for b in group.split(",") if b.strip()]
  order, seen = [], set()

  def visit(c):
    if c in seen or c not in comps:
      return
    seen.add(c)
    for callee, _ in callees[c]:
      visit(callee)
    order.append(c)

  visit(entry)
  runs = {c: 0 for c in comps}
  runs[entry] = 1
  for c in reversed(order):  # callers before callees
    for callee, n in callees[c]:
      if callee in runs:
        runs[callee] += runs[c] * n

  return HloModule(comps, shapes, runs, num_partitions)


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
  """Every collective of an HLO module, with its bytes per device and executions per step.

  Which buffer is counted, per device and per execution (shapes of the instruction and of
  its operands, read from their definitions in the module):
    all-gather          the result (the gathered buffer; for `-start`, result minus operands)
    reduce-scatter      the operand (the full buffer each device contributes)
    all-reduce          the operand(s)
    all-to-all          the operand(s) (the whole send buffer, the chunk kept locally included)
    collective-permute  operand 0
    ragged-all-to-all   the smaller of operand 0 (send buffer) and operand 1 (receive
                        buffer). The rows actually sent are runtime `send_sizes`; the buffers
                        are sized for the worst case (n x M rows on the receiving side of
                        dispatch, the sending side of combine), so the smaller one, M rows,
                        is what an average device moves when every token is routed
  Tuple operands/results are summed. An op whose replica groups have one device moves
  nothing and is left out (SPMD emits such all-reduces for size-1 mesh axes).

  Loops: ops inside the scanned layer body (an HLO `while`) run once per layer; each op's
  `executions` is its computation's run count from `parse_hlo` (the product of the enclosing
  loops' trip counts, read from `known_trip_count` in the compiled module's backend_config).

  Args:
    hlo_text: `Compiled.as_text()` (post-optimisation) or pre-optimisation HLO text.

  Returns:
    One `CollectiveOp` per collective instruction, in module order.
  """
  module = parse_hlo(hlo_text)
  ops = []
  for c, instrs in module.instructions.items():
    runs = module.runs[c]
    for name, shape, op, operands, attrs in instrs:
      if op.endswith("-done"):
        continue
      kind = op[:-len("-start")] if op.endswith("-start") else op
      if kind not in COLLECTIVES or runs == 0:
        continue
      operand_bytes = [shape_bytes(module.shapes.get(o, "")) for o in operands]
      if kind == "all-gather":
        size = shape_bytes(shape) - (sum(operand_bytes) if op.endswith("-start") else 0)
      elif kind == "ragged-all-to-all":
        size = min(operand_bytes[:2]) if len(operand_bytes) >= 2 else 0
      elif kind == "collective-permute":
        size = operand_bytes[0] if operand_bytes else 0
      else:
        size = sum(operand_bytes)
      group = None if kind == "collective-permute" else _group_size(attrs, module.num_partitions)
      if group == 1:
        continue
      op_name = re.search(r'op_name="([^"]*)"', attrs)
      ops.append(CollectiveOp(kind, name, size, group, runs, op_name.group(1) if op_name else ""))
  return ops


def dot_flops(hlo_text: str) -> int:
  """FLOPs per device per step of every `dot` in the module, loop trip counts applied.

  2 x (result elements) x (product of the lhs contracting dimensions) per dot, times its
  computation's run count (`parse_hlo`). XLA's `cost_analysis()` counts a while body once;
  this counts the scanned layers L times, but only matmuls (no elementwise work, no
  custom-call matmuls).
  """
  module = parse_hlo(hlo_text)
  total = 0
  for c, instrs in module.instructions.items():
    for _, shape, op, operands, attrs in instrs:
      if op != "dot" or not module.runs[c] or not operands:
        continue
      lhs = _ARRAY_RE.search(module.shapes.get(operands[0], ""))
      out = _ARRAY_RE.search(shape)
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
      if not (lhs and out and contracting):
        continue
      lhs_dims = [int(d) for d in lhs.group(2).split(",") if d]
      k = math.prod(lhs_dims[int(i)] for i in contracting.group(1).split(",") if i)
      n_out = math.prod(int(d) for d in out.group(2).split(",") if d)
      total += 2 * n_out * k * module.runs[c]
  return total


def moe_exchange_bytes(ops: list[CollectiveOp]) -> float:
  """Bytes leaving one device per step to move MoE tokens to their experts and back.

  Sums `off_shard_bytes` of the all-to-all, ragged-all-to-all, all-gather and reduce-scatter
  ops whose metadata places them in a `shard_map` (the MoE block is the model's only
  shard_map, so FSDP's parameter gathers are left out). Pre-optimisation HLO carries no
  metadata; there every collective comes from the shard_map (SPMD partitioning has not yet
  added its own), so all of these kinds count. All-reduces (expert-weight gradient sums)
  never count.
  """
  kinds = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter")
  has_metadata = any(o.op_name for o in ops)
  return sum(o.off_shard_bytes for o in ops
             if o.kind in kinds and (not has_metadata or "shard_map" in o.op_name))


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes per device per step handed to each collective kind (see `collective_ops`).

  Returns:
    `{kind: bytes}` for every kind of `COLLECTIVES` (0 when absent), loop trip counts applied.
  """
  out = dict.fromkeys(COLLECTIVES, 0)
  for op in collective_ops(hlo_text):
    out[op.kind] += op.total_bytes
  return out


def analytic_all_to_all_bytes(tokens_per_shard: int, d_model: int, bytes_per_elem: int,
                              expert_axis_size: int) -> float:
  """Least bytes one device sends for one MoE dispatch + combine with top-1 routing.

  = tokens x d_model x bytes x 2 directions x (n - 1) / n: each token's activation goes to its
  expert's shard and comes back, and with balanced routing (n-1)/n of them live elsewhere.

  Args:
    tokens_per_shard: M, tokens on one device entering the MoE.
    d_model: D, hidden size.
    bytes_per_elem: bytes of one activation element (4 for float32, 2 for bfloat16).
    expert_axis_size: n, devices on the `expert` mesh axis.

  Returns:
    Bytes per device for one layer's forward pass (a training step moves this
    num_layers x 2 times: forward and the cotangents in the backward pass; x 3 with remat).
  """
  n = expert_axis_size
  return tokens_per_shard * d_model * bytes_per_elem * 2 * (n - 1) / n


# --------------------------------------------------------------------------------------------
# One row of the sweep.
# --------------------------------------------------------------------------------------------


def _cost(compiled: jax.stages.Compiled) -> dict[str, float]:
  """FLOPs and bytes accessed per device from XLA's cost analysis.

  XLA's HloCostAnalysis counts the body of a while loop once, so for a scanned model these
  cover one layer's forward and backward plus everything outside the scan.
  """
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  cost = cost or {}
  return {"flops": float(cost.get("flops", 0.0)),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def _memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  """Per-device bytes from `compiled.memory_analysis()` and their total."""
  mem = compiled.memory_analysis()
  out = {"arg_bytes": int(mem.argument_size_in_bytes),
         "out_bytes": int(mem.output_size_in_bytes),
         "alias_bytes": int(mem.alias_size_in_bytes),
         "temp_bytes": int(mem.temp_size_in_bytes),
         "code_bytes": int(mem.generated_code_size_in_bytes)}
  out["total_bytes"] = out["arg_bytes"] + out["out_bytes"] - out["alias_bytes"] + out["temp_bytes"]
  return out


def synthetic_batch(model_cfg: ModelConfig, batch_size: int, seq_len: int,
                    mesh: jax.sharding.Mesh, seed: int = 0) -> dict[str, jax.Array]:
  """One `[B, T]` batch of random token ids (one packed document per row) in the training
  sharding; no data pipeline or tokenizer involved."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, model_cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  host = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "segment_ids": np.ones((batch_size, seq_len), np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)),
          "loss_mask": np.ones((batch_size, seq_len), np.float32)}
  return jax.device_put(host, batch_sharding(mesh))


def measure_step_time(compiled: jax.stages.Compiled, model_cfg: ModelConfig,
                      train_cfg: TrainConfig, mesh: jax.sharding.Mesh, batch_size: int,
                      seq_len: int, steps: int) -> float:
  """Median seconds per step of `compiled` over `steps` steps, after one warm-up step.

  The state is initialised for real (`init_train_state`, in its sharding); the batch is
  `synthetic_batch`. Must run inside `use_mesh(mesh)`.
  """
  tx = make_optimizer(train_cfg, abstract_model(model_cfg, train_cfg.seed)[1])
  state = init_train_state(model_cfg, tx, train_cfg.seed, mesh)
  batch = synthetic_batch(model_cfg, batch_size, seq_len, mesh)
  state, metrics = compiled(state, batch)  # warm-up
  jax.block_until_ready((state, metrics))
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def sweep_row(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh_cfg: MeshConfig, *,
              dispatch: str | None, batch_size: int, seq_len: int, steps: int = 0,
              devices=None, balance: BalanceConfig | None = None) -> dict[str, Any]:
  """Compiles (and, with `steps > 0`, times) the training step for one mesh and dispatch.

  Args:
    model_cfg: the model; `dispatch` (if given) replaces its `moe_dispatch`.
    train_cfg: the optimizer settings (its batch_size/seq_len are ignored).
    mesh_cfg: devices along data, fsdp, expert; the product must equal the device count.
    dispatch: a `zaya_jax.parallel.dispatch.DISPATCHES` name, or None for the config's.
    batch_size: B, global sequences per step.
    seq_len: T, tokens per sequence.
    steps: timed steps after one warm-up; 0 = compile only.
    balance: the balancing-bias controller config, as training passes it (None = off).
    devices: devices of the mesh (default: all).

  Returns:
    A flat dict: mesh sizes, the resolved dispatch, tokens per shard, memory (`_memory`), cost
    (`_cost`), `dot_flops` (matmul FLOPs per device, all layers), `<kind>_bytes` for each
    collective kind (`collective_bytes`, per device per step),
    `moe_exchange_bytes` (`moe_exchange_bytes`), `a2a_analytic_bytes` (the
    per-step minimum: `analytic_all_to_all_bytes` x layers x passes, 0 without EP),
    `compile_s`, `step_s`, `tokens_per_s` (None when not measured) and a `note`.
  """
  if dispatch is not None:
    model_cfg = model_cfg.replace(moe_dispatch=dispatch)
  mesh = make_mesh(mesh_cfg, devices)
  sizes = dict(mesh.shape)
  resolved = resolve_dispatch(model_cfg.moe_dispatch, sizes[EXPERT])
  tokens_per_shard = batch_size * seq_len // mesh.size
  passes = 3 if model_cfg.remat else 2  # forward + backward (+ the forward again under remat)
  act_bytes = 2 if model_cfg.dtype == "bfloat16" else 4
  row: dict[str, Any] = {
      "data": sizes["data"], "fsdp": sizes["fsdp"], "expert": sizes[EXPERT], "dispatch": resolved,
      "batch": batch_size, "seq": seq_len, "tokens_per_shard": tokens_per_shard,
      "a2a_analytic_bytes": (0.0 if sizes[EXPERT] == 1 else passes * model_cfg.num_layers *
                             analytic_all_to_all_bytes(tokens_per_shard, model_cfg.hidden_size,
                                                       act_bytes, sizes[EXPERT])),
      "note": ""}
  with use_mesh(mesh):
    start = time.perf_counter()
    lowered = lower_train_step(model_cfg, train_cfg, mesh, batch_size, seq_len, balance)
    compiled = None
    if resolved == "ragged_all_to_all" and jax.default_backend() == "cpu":
      hlo = lowered.as_text(dialect="hlo")
      row["note"] = ("lowered only: XLA:CPU cannot compile ragged-all-to-all; collectives from "
                     "pre-partitioning HLO (shard_map ops only), no memory/FLOPs")
    else:
      compiled = lowered.compile()
      hlo = compiled.as_text()
    row["compile_s"] = time.perf_counter() - start
    if compiled is not None:
      row.update(_memory(compiled))
      row.update(_cost(compiled))
    # Before SPMD partitioning, shapes outside the shard_map are global: no per-device FLOPs.
    row["dot_flops"] = dot_flops(hlo) if compiled is not None else None
    ops = collective_ops(hlo)
    for kind in COLLECTIVES:
      row[f"{kind.replace('-', '_')}_bytes"] = sum(o.total_bytes for o in ops if o.kind == kind)
    row["moe_exchange_bytes"] = moe_exchange_bytes(ops)
    row["step_s"] = row["tokens_per_s"] = None
    if steps and compiled is not None:
      step_s = measure_step_time(compiled, model_cfg, train_cfg, mesh, batch_size, seq_len, steps)
      row["step_s"], row["tokens_per_s"] = step_s, batch_size * seq_len / step_s
  return row


# --------------------------------------------------------------------------------------------
# The sweep and its outputs.
# --------------------------------------------------------------------------------------------


def run_sweep(model_cfg: ModelConfig, train_cfg: TrainConfig, meshes: list[MeshConfig],
              dispatches: list[str | None], *, batch_size: int, seq_len: int, steps: int,
              log=print, balance: BalanceConfig | None = None) -> list[dict[str, Any]]:
  """`sweep_row` for every mesh x dispatch (with the controller config `balance`, as training
  runs it); a row that fails carries the error in `note`."""
  rows = []
  for mesh_cfg in meshes:
    for dispatch in dispatches:
      label = f"mesh {dataclasses.asdict(mesh_cfg)} dispatch {dispatch or model_cfg.moe_dispatch}"
      log(f"compiling {label} ...")
      try:
        row = sweep_row(model_cfg, train_cfg, mesh_cfg, dispatch=dispatch, batch_size=batch_size,
                        seq_len=seq_len, steps=steps, balance=balance)
      except (ValueError, RuntimeError) as e:  # a mesh that does not divide; XLA errors
        row = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "expert": mesh_cfg.expert,
               "dispatch": dispatch or model_cfg.moe_dispatch, "batch": batch_size,
               "seq": seq_len, "note": f"failed: {str(e).splitlines()[0][:200]}"}
      log(f"  done in {row.get('compile_s', 0.0):.1f} s {row['note']}")
      rows.append(row)
  return rows


CSV_COLUMNS = ("data", "fsdp", "expert", "dispatch", "batch", "seq", "tokens_per_shard",
               "compile_s", "arg_bytes", "out_bytes", "alias_bytes", "temp_bytes", "code_bytes",
               "total_bytes", "flops", "dot_flops", "bytes_accessed",
               *(f"{k.replace('-', '_')}_bytes" for k in COLLECTIVES), "moe_exchange_bytes",
               "a2a_analytic_bytes", "step_s", "tokens_per_s", "note")


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
  """One line per row, columns `CSV_COLUMNS` (empty where a row has no value)."""
  with open(path, "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS} for r in rows)


def _columns(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
  """Right-aligned columns two spaces apart; the last one (free text) left-aligned."""
  widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
  return "\n".join("  ".join([*(str(x).rjust(w) for x, w in zip(line[:-1], widths)), str(line[-1])])
                   .rstrip() for line in [head, *lines])


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
  return "-" if value is None else f"{value / scale:.{digits}f}"


def format_table(rows: list[dict[str, Any]]) -> str:
  """The sweep as a fixed-width text table (MiB and GFLOP per device)."""
  mib, g = 2.0**20, 1e9
  head = ("mesh d,f,e", "dispatch", "compile s", "args MiB", "out MiB", "temp MiB", "total MiB",
          "GFLOP xla", "GFLOP dot", "a2a MiB", "ag MiB", "rs MiB", "ar MiB", "perm MiB",
          "ragged MiB", "step s", "tok/s", "note")
  lines = []
  for r in rows:
    lines.append((f"{r['data']},{r['fsdp']},{r['expert']}", r["dispatch"], _fmt(r.get("compile_s")),
                  _fmt(r.get("arg_bytes"), mib), _fmt(r.get("out_bytes"), mib),
                  _fmt(r.get("temp_bytes"), mib), _fmt(r.get("total_bytes"), mib),
                  _fmt(r.get("flops"), g), _fmt(r.get("dot_flops"), g),
                  *(_fmt(r.get(f"{k.replace('-', '_')}_bytes"), mib, 2) for k in COLLECTIVES),
                  _fmt(r.get("step_s"), 1.0, 3), _fmt(r.get("tokens_per_s"), 1.0, 0), r["note"]))
  return _columns(head, lines)


def format_exchange_table(rows: list[dict[str, Any]]) -> str:
  """Per row with expert parallelism: MoE token-exchange bytes vs the analytic minimum."""
  head = ("mesh d,f,e", "dispatch", "tokens/shard", "exchanged MiB", "analytic MiB", "ratio")
  lines = []
  for r in rows:
    if r.get("expert", 1) > 1 and r.get("moe_exchange_bytes") is not None:
      analytic = r["a2a_analytic_bytes"]
      lines.append((f"{r['data']},{r['fsdp']},{r['expert']}", r["dispatch"],
                    str(r["tokens_per_shard"]), _fmt(r["moe_exchange_bytes"], 2.0**20, 3),
                    _fmt(analytic, 2.0**20, 3),
                    f"{r['moe_exchange_bytes'] / analytic:.2f}" if analytic else "-"))
  return _columns(head, lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
  """PNG with two bar charts per mesh row: memory per device (arguments, outputs, temps) and
  bytes per device per step of each collective kind."""
  rows = [r for r in rows if "compile_s" in r]
  labels = [f"{r['data']},{r['fsdp']},{r['expert']}\n{r['dispatch']}" for r in rows]
  x = np.arange(len(rows))
  fig = Figure(figsize=(max(8.0, 1.6 * len(rows)), 8.0))
  FigureCanvasAgg(fig)
  ax_mem, ax_col = fig.subplots(2, 1)
  bottom = np.zeros(len(rows))
  for key, name in (("arg_bytes", "arguments"), ("out_bytes", "outputs (minus aliased)"),
                    ("temp_bytes", "temporaries")):
    vals = np.array([(r.get(key) or 0) - (r.get("alias_bytes") or 0 if key == "out_bytes" else 0)
                     for r in rows], float) / 2**30
    ax_mem.bar(x, vals, 0.6, bottom=bottom, label=name)
    bottom += vals
  ax_mem.set_ylabel("GiB per device")
  ax_mem.set_title("memory per device (XLA memory analysis)")
  ax_mem.legend(fontsize=8)
  width = 0.8 / len(COLLECTIVES)
  for i, kind in enumerate(COLLECTIVES):
    vals = [(r.get(f"{kind.replace('-', '_')}_bytes") or 0) / 2**20 for r in rows]
    ax_col.bar(x - 0.4 + (i + 0.5) * width, vals, width, label=kind)
  ax_col.set_ylabel("MiB per device per step")
  ax_col.set_title("collective bytes (compiled HLO, loop trip counts applied)")
  ax_col.legend(fontsize=8, ncol=3)
  for ax in (ax_mem, ax_col):
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8)
  fig.suptitle(textwrap.fill(title, 120), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def host_note() -> str:
  """One line saying what the figures describe (fake CPU devices or real accelerators)."""
  devices = jax.devices()
  if devices[0].platform == "cpu":
    return (f"NOTE: figures characterise this host's {len(devices)} fake XLA:CPU devices "
            "(--xla_force_host_platform_device_count), not GPUs: memory and FLOPs are XLA:CPU's "
            "per-device program; step times share this host's cores.")
  return f"figures from {len(devices)} {devices[0].device_kind} devices"
