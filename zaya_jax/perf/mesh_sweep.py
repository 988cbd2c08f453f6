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
- bytes handed to each collective, read from the compiled HLO (`zaya_jax.perf.hlo`);
- optionally, the measured step time (median of a few steps after one warm-up step, real
  arrays, synthetic tokens) and tokens/s.

On a host with fake CPU devices (`--xla_force_host_platform_device_count`) every figure
describes XLA:CPU's program for those devices, not a GPU's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import jax
import numpy as np
from matplotlib.figure import Figure

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.dispatch import resolve_dispatch
from zaya_jax.parallel.mesh import (CONTEXT, EXPERT, MeshConfig, abstract_with_shardings,
                                    check_divisibility, make_mesh, use_mesh)
from zaya_jax.perf import report
from zaya_jax.perf.hlo import (COLLECTIVES, CONTEXT_KINDS, collective_ops, context_exchange_bytes,
                               dot_flops, moe_exchange_bytes)
from zaya_jax.perf.roofline import context_halo_elements
from zaya_jax.perf.synthetic import abstract_batch, synthetic_batch
from zaya_jax.train.optim import make_optimizer
from zaya_jax.train.setup import setup_training
from zaya_jax.train.state import abstract_model, init_train_state

# --------------------------------------------------------------------------------------------
# Compile on abstract inputs (`zaya_jax.perf.synthetic.abstract_batch`).
# --------------------------------------------------------------------------------------------


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


def analytic_context_bytes(cfg: ModelConfig, seqs: int, seq_len: int, context: int,
                           bytes_per_elem: int) -> dict[str, float]:
  """Bytes one device exchanges per training step for CCA's context parallelism, by what
  the algorithm must move (zaya_jax/parallel/context.py), all layers.

  - K/V all-gather: every forward pass (2 with `cfg.remat`) receives `(C - 1)/C` of the
    sequence's keys and values, `seqs x T x 2 x K x H` elements per layer; plus the key
    segment ids, `seqs x T` int32, once per step (they do not change between layers);
  - dK/dV reduce-scatter: the same `(C - 1)/C x seqs x T x 2 x K x H` per layer, once;
  - halo: per layer and pass (forwards and backward) two sends of
    `seqs x (conv_rows x (N + K) x H + value_rows x K/2 x H)` elements (one to each zigzag
    neighbour; `ModelConfig.context_halo`), plus the halo's segment ids, `2 x seqs x
    max(conv_rows, value_rows)` int32 once per step.

  Args:
    cfg: the model (layers, heads, head dim, CCA kernel widths, remat).
    seqs: sequences per device (the global batch over data x fsdp x expert).
    seq_len: T, tokens per sequence.
    context: C, devices on the `context` axis (> 1).
    bytes_per_elem: bytes of one activation element (the compute dtype).
  Returns:
    `{"all-gather", "reduce-scatter", "collective-permute"}` -> bytes per device per step,
    comparable with `zaya_jax.perf.hlo.context_exchange_bytes`.
  """
  forwards = 2 if cfg.remat else 1
  c, layers = context, cfg.num_layers
  kv = (c - 1) / c * seqs * seq_len * 2 * cfg.num_kv_heads * cfg.head_dim * bytes_per_elem
  conv_rows, value_rows = cfg.context_halo
  send = seqs * context_halo_elements(cfg) * bytes_per_elem
  return {"all-gather": layers * forwards * kv + (c - 1) / c * seqs * seq_len * 4,
          "reduce-scatter": layers * kv,
          "collective-permute": (layers * (forwards + 1) * 2 * send
                                 + 2 * seqs * max(conv_rows, value_rows) * 4)}


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
    mesh_cfg: devices along data, fsdp, expert, context; the product must equal the device
      count. With context > 1 the all-gather column holds the CCA K/V all-gathers and the
      collective-permute column the CCA halo exchanges (README "Context parallelism").
    dispatch: a `zaya_jax.parallel.dispatch.DISPATCHES` name, or None for the config's.
    batch_size: B, global sequences per step.
    seq_len: T, tokens per sequence.
    steps: timed steps after one warm-up; 0 = compile only.
    balance: the balancing-bias controller config, as training passes it (None = off).
    devices: devices of the mesh (default: all).

  Returns:
    A flat dict: mesh sizes, the resolved dispatch, tokens per shard, memory (`_memory`), cost
    (`_cost`), `dot_flops` (matmul FLOPs per device, all layers), `<kind>_bytes` for each
    collective kind (`zaya_jax.perf.hlo.collective_bytes`, per device per step),
    `moe_exchange_bytes` (`moe_exchange_bytes`), `a2a_analytic_bytes` (the
    per-step minimum: `analytic_all_to_all_bytes` x layers x passes, 0 without EP), with
    context > 1 `cp_exchange_bytes` / `cp_analytic_bytes` and per kind `cp_<kind>_bytes` /
    `cp_<kind>_analytic_bytes` (`CP_KINDS`; `context_exchange_bytes` against
    `analytic_context_bytes`),
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
      "data": sizes["data"], "fsdp": sizes["fsdp"], "expert": sizes[EXPERT],
      "context": sizes[CONTEXT], "dispatch": resolved,
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
    if sizes[CONTEXT] > 1:
      measured = context_exchange_bytes(ops)
      analytic = analytic_context_bytes(model_cfg, batch_size // (mesh.size // sizes[CONTEXT]),
                                        seq_len, sizes[CONTEXT], act_bytes)
      row["cp_exchange_bytes"] = sum(measured.values())
      row["cp_analytic_bytes"] = sum(analytic.values())
      for kind in measured:
        key = kind.replace("-", "_")
        row[f"cp_{key}_bytes"], row[f"cp_{key}_analytic_bytes"] = measured[kind], analytic[kind]
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
               "context": mesh_cfg.context, "dispatch": dispatch or model_cfg.moe_dispatch,
               "batch": batch_size, "seq": seq_len, "note": f"failed: {str(e).splitlines()[0][:200]}"}
      log(f"  done in {row.get('compile_s', 0.0):.1f} s {row['note']}")
      rows.append(row)
  return rows


CP_KINDS = tuple(k.replace("-", "_") for k in CONTEXT_KINDS)  # CCA's context exchange
CSV_COLUMNS = ("data", "fsdp", "expert", "context", "dispatch", "batch", "seq", "tokens_per_shard",
               "compile_s", "arg_bytes", "out_bytes", "alias_bytes", "temp_bytes", "code_bytes",
               "total_bytes", "flops", "dot_flops", "bytes_accessed",
               *(f"{k.replace('-', '_')}_bytes" for k in COLLECTIVES), "moe_exchange_bytes",
               "a2a_analytic_bytes", "cp_exchange_bytes", "cp_analytic_bytes",
               *(f"cp_{k}{suffix}_bytes" for k in CP_KINDS for suffix in ("", "_analytic")),
               "step_s", "tokens_per_s", "note")


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
  """One line per row, columns `CSV_COLUMNS` (empty where a row has no value)."""
  report.write_csv(path, CSV_COLUMNS, rows)


def _columns(head: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
  """Right-aligned columns two spaces apart; the last one (free text) left-aligned."""
  return report.text_table(head, lines, left=(len(head) - 1,))


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
  return "-" if value is None else f"{value / scale:.{digits}f}"


def _mesh_label(row: dict[str, Any]) -> str:
  """`data,fsdp,expert,context` of a row (context 1 for rows written without it)."""
  return f"{row['data']},{row['fsdp']},{row['expert']},{row.get('context', 1)}"


def format_table(rows: list[dict[str, Any]]) -> str:
  """The sweep as a fixed-width text table (MiB and GFLOP per device)."""
  mib, g = 2.0**20, 1e9
  head = ("mesh d,f,e,c", "dispatch", "compile s", "args MiB", "out MiB", "temp MiB", "total MiB",
          "GFLOP xla", "GFLOP dot", "a2a MiB", "ag MiB", "rs MiB", "ar MiB", "perm MiB",
          "ragged MiB", "step s", "tok/s", "note")
  lines = []
  for r in rows:
    lines.append((_mesh_label(r), r["dispatch"], _fmt(r.get("compile_s")),
                  _fmt(r.get("arg_bytes"), mib), _fmt(r.get("out_bytes"), mib),
                  _fmt(r.get("temp_bytes"), mib), _fmt(r.get("total_bytes"), mib),
                  _fmt(r.get("flops"), g), _fmt(r.get("dot_flops"), g),
                  *(_fmt(r.get(f"{k.replace('-', '_')}_bytes"), mib, 2) for k in COLLECTIVES),
                  _fmt(r.get("step_s"), 1.0, 3), _fmt(r.get("tokens_per_s"), 1.0, 0), r["note"]))
  return _columns(head, lines)


def format_exchange_table(rows: list[dict[str, Any]]) -> str:
  """Per row with expert parallelism: MoE token-exchange bytes vs the analytic minimum."""
  head = ("mesh d,f,e,c", "dispatch", "tokens/shard", "exchanged MiB", "analytic MiB", "ratio")
  lines = []
  for r in rows:
    if r.get("expert", 1) > 1 and r.get("moe_exchange_bytes") is not None:
      analytic = r["a2a_analytic_bytes"]
      lines.append((_mesh_label(r), r["dispatch"],
                    str(r["tokens_per_shard"]), _fmt(r["moe_exchange_bytes"], 2.0**20, 3),
                    _fmt(analytic, 2.0**20, 3),
                    f"{r['moe_exchange_bytes'] / analytic:.2f}" if analytic else "-"))
  return _columns(head, lines)


def format_context_table(rows: list[dict[str, Any]]) -> str:
  """Per row with context parallelism: CCA's exchange per device per step (off-shard MiB,
  compiled HLO) against `analytic_context_bytes`, per kind and in all."""
  head = ("mesh d,f,e,c", "K/V all-gather MiB", "analytic", "dK/dV reduce-scatter MiB",
          "analytic", "halo permute MiB", "analytic", "ratio all")
  lines, mib = [], 2.0**20
  for r in rows:
    if r.get("context", 1) > 1 and r.get("cp_exchange_bytes") is not None:
      cells = []
      for kind in CP_KINDS:
        cells += [_fmt(r[f"cp_{kind}_bytes"], mib, 3), _fmt(r[f"cp_{kind}_analytic_bytes"], mib, 3)]
      analytic = r["cp_analytic_bytes"]
      lines.append((_mesh_label(r), *cells,
                    f"{r['cp_exchange_bytes'] / analytic:.3f}" if analytic else "-"))
  return _columns(head, lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> Figure:
  """PNG with two bar charts per mesh row: memory per device (arguments, outputs, temps) and
  bytes per device per step of each collective kind. Returns the
  Figure (written to `path`)."""
  rows = [r for r in rows if "compile_s" in r]
  labels = [_mesh_label(r) + f"\n{r['dispatch']}" for r in rows]
  x = np.arange(len(rows))
  fig = report.new_figure(max(8.0, 1.6 * len(rows)), 8.0)
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
  report.save_figure(fig, path, title, wrap=120)
  return fig


def host_note() -> str:
  """One line saying what the figures describe (fake CPU devices or real accelerators)."""
  devices = jax.devices()
  if devices[0].platform == "cpu":
    return (f"NOTE: figures characterise this host's {len(devices)} fake XLA:CPU devices "
            "(--xla_force_host_platform_device_count), not GPUs: memory and FLOPs are XLA:CPU's "
            "per-device program; step times share this host's cores.")
  return f"figures from {len(devices)} {devices[0].device_kind} devices"


def write_report(rows: list[dict[str, Any]], out_dir: str, *, num_layers: int, batch_size: int,
                 seq_len: int, note: str) -> None:
  """Writes `out_dir`/mesh_sweep.csv and mesh_sweep.png and prints the sweep table and the MoE
  token-exchange table (`note`: what the figures describe, `host_note()`)."""
  os.makedirs(out_dir, exist_ok=True)
  write_csv(rows, os.path.join(out_dir, "mesh_sweep.csv"))
  plot(rows, os.path.join(out_dir, "mesh_sweep.png"),
       f"{num_layers} layers, batch {batch_size} x seq {seq_len}. {note}")
  print(f"\nbatch {batch_size} x seq {seq_len}, per device; collectives per step, all layers. {note}")
  print(format_table(rows))
  if any(r.get("expert", 1) > 1 for r in rows):
    print("\nMoE token exchange per device per step (off-shard bytes) vs analytic minimum "
          "(tokens x D x bytes x 2 directions x (n-1)/n x layers x fwd+bwd):")
    print(format_exchange_table(rows))
  if any(r.get("context", 1) > 1 for r in rows):
    print("\nCCA context-parallel exchange per device per step (off-shard bytes, ops in "
          "CCA's shard_map) vs analytic (K/V all-gather per forward, dK/dV reduce-scatter, "
          "halo sends both ways per pass; zaya_jax.perf.mesh_sweep.analytic_context_bytes):")
    print(format_context_table(rows))
  print(f"\nwrote {out_dir}/mesh_sweep.csv and mesh_sweep.png")
