# Shape letters: none of the model legend (HLO shapes are read as text).
"""Collectives, matmul FLOPs and loop trip counts read from an HLO module's text.

`parse_hlo` splits a module into computations and instructions and counts how often each
computation runs per step (the scanned layers are an HLO `while`); `collective_ops` lists
every collective with the bytes each device hands it, `collective_bytes` sums them per kind,
`moe_exchange_bytes` keeps the MoE token exchange (the ops inside its `shard_map`),
`context_exchange_bytes` CCA's context-parallel exchange, and
`dot_flops` counts the matmul FLOPs with every layer counted. Used by `zaya_jax.perf.mesh_sweep`
on `Compiled.as_text()` (post-optimisation) or `Lowered.as_text(dialect="hlo")`.
"""

from __future__ import annotations

import dataclasses
import math
import re

from zaya_jax.parallel.context import CONTEXT_SCOPE

# The kinds CCA's context parallelism uses (`context_exchange_bytes`).
CONTEXT_KINDS = ("all-gather", "reduce-scatter", "collective-permute")
COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute",
               "ragged-all-to-all")

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
    unknown_trip_whiles: `while` loops whose trip count was neither known nor read from
      their condition (counted `unknown_trip_count` times, see `parse_hlo`).
  """

  instructions: dict[str, list[tuple[str, str, str, list[str], str]]]
  shapes: dict[str, str]
  runs: dict[str, int]
  num_partitions: int
  unknown_trip_whiles: int = 0


def parse_hlo(hlo_text: str, unknown_trip_count: int = 1) -> HloModule:
  """Parses HLO text and counts how often each computation runs per step.

  The layer scan is an HLO `while`; its body runs once per layer. A computation's count is
  the product of the trip counts of the while loops around it, summed over its call sites:
  the compiled module carries `backend_config={"known_trip_count":{"n":"L"}}` on each
  `while`; when that is missing (pre-optimisation HLO from `Lowered.as_text(dialect="hlo")`)
  the trip count is the one scalar integer constant of the loop condition when it compares
  with `direction=LT`, else `unknown_trip_count` (1 by default; a data-dependent loop's bound,
  e.g. the most sweeps of a solve, gives a worst case). Each branch of a `conditional` counts
  once (an upper bound).

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

  unknown = 0

  def trip(attrs: str) -> int:
    nonlocal unknown
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
    unknown += 1
    return unknown_trip_count

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

  return HloModule(comps, shapes, runs, num_partitions, unknown)


def collective_ops(hlo_text: str | HloModule) -> list[CollectiveOp]:
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
    hlo_text: `Compiled.as_text()` (post-optimisation) or pre-optimisation HLO text, or its
      `parse_hlo` (e.g. parsed with another `unknown_trip_count`).

  Returns:
    One `CollectiveOp` per collective instruction, in module order.
  """
  module = hlo_text if isinstance(hlo_text, HloModule) else parse_hlo(hlo_text)
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
  ops whose metadata places them in a `shard_map` other than CCA's context-parallel one
  (whose ops carry `zaya_jax.parallel.context.CONTEXT_SCOPE`, see `context_exchange_bytes`),
  so FSDP's parameter gathers and the K/V all-gathers are left out. Pre-optimisation HLO
  carries no metadata; there every collective comes from a shard_map (SPMD partitioning has
  not yet added its own), so all of these kinds count. All-reduces (expert-weight gradient
  sums) never count.
  """
  kinds = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter")
  has_metadata = any(o.op_name for o in ops)
  return sum(o.off_shard_bytes for o in ops
             if o.kind in kinds and (not has_metadata or (
                 "shard_map" in o.op_name and CONTEXT_SCOPE not in o.op_name)))


def context_exchange_bytes(ops: list[CollectiveOp]) -> dict[str, float]:
  """Bytes leaving one device per step for CCA's context parallelism, by kind.

  `off_shard_bytes` of the ops whose metadata carries `CONTEXT_SCOPE` (CCA's shard_map over
  `context`, zaya_jax/model/cca.py): `all-gather` (K/V and key segment ids), `reduce-scatter`
  (dK/dV) and `collective-permute` (the halo rows, both directions, forward and backward).
  Post-optimisation HLO only (pre-optimisation text has no metadata: all zeros).

  Returns:
    `{"all-gather": bytes, "reduce-scatter": bytes, "collective-permute": bytes}`.
  """
  out = dict.fromkeys(CONTEXT_KINDS, 0.0)
  for o in ops:
    if o.kind in out and CONTEXT_SCOPE in o.op_name:
      out[o.kind] += o.off_shard_bytes
  return out


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes per device per step handed to each collective kind (see `collective_ops`).

  Returns:
    `{kind: bytes}` for every kind of `COLLECTIVES` (0 when absent), loop trip counts applied.
  """
  out = dict.fromkeys(COLLECTIVES, 0)
  for op in collective_ops(hlo_text):
    out[op.kind] += op.total_bytes
  return out
