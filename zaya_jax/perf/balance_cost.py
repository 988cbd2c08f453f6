"""What each load-balancing mode costs in collectives per training step, read from the HLO.

For every variant (`zaya_jax.perf.benchmark.parse_balance_variant`: "none", "pid", "sign",
"adamw", "quantile:next", "quantile:reroute", "quantile:current") the real training step is
compiled on a mesh from abstract inputs (`zaya_jax.perf.mesh_sweep.compile_train_step`:
nothing is allocated, so ZAYA1-base compiles on fake CPU devices) and every collective of the
compiled module is counted with its executions per step (ops inside the layer scan and other
`while` loops times their trip counts, `zaya_jax.perf.hlo.collective_ops`). "none" (balancing off) still computes
the load metrics; a mode's *own* cost is its count minus none's.

A `while` whose trip count is data-dependent (the in-batch solve of "quantile:current" stops
once balanced, after at most `balance.quantile_sweeps` sweeps) has no known trip count in the
HLO; for that variant such loops are counted `quantile_sweeps` times (`parse_hlo`'s
`unknown_trip_count`), the worst case, and the result says so (`bounded_by_sweeps`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from zaya_jax.config import BalanceConfig, TrainConfig
from zaya_jax.config.model import ModelConfig
from zaya_jax.parallel.mesh import MeshConfig, make_mesh, use_mesh
from zaya_jax.perf import hlo
from zaya_jax.perf.benchmark import parse_balance_variant
from zaya_jax.perf.mesh_sweep import compile_train_step

def count_collectives(module: hlo.HloModule) -> dict[str, Any]:
  """Collectives of one compiled step: `{"count": executions per step, "bytes": bytes per
  device per step, "by_kind": {kind: executions}, "ops": instructions}` (loops' trip counts
  applied, `zaya_jax.perf.hlo.collective_ops`)."""
  ops = hlo.collective_ops(module)
  by_kind = collections.Counter()
  for op in ops:
    by_kind[op.kind] += op.executions
  return {"count": sum(op.executions for op in ops),
          "bytes": sum(op.total_bytes for op in ops), "by_kind": dict(by_kind),
          "ops": len(ops)}


def balance_collectives(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh_cfg: MeshConfig,
                        variants: list[str], *, batch_size: int, seq_len: int,
                        balance: BalanceConfig | None = None,
                        log: Callable[[str], None] = print) -> dict[str, Any]:
  """Collectives per training step of each balancing variant on `mesh_cfg` (module doc).

  Args:
    model_cfg, train_cfg: the run's model and train groups (`train.grad_accum_steps` counts).
    mesh_cfg: the mesh (its device count must be available, e.g. fake CPU devices).
    variants: balancing variants; "none" is added first if missing (the reference).
    batch_size, seq_len: the global batch compiled (counts do not depend on it; bytes do).
    balance: the run config's balance group, the base of every variant
      (`parse_balance_variant`); None = the defaults.

  Returns:
    `{"mesh": {axis: size}, "variants": [...], "result": {variant: count_collectives(...) +
    "extra_count" / "extra_bytes" (minus none's), "bounded_by_sweeps": bool}}`.

  Raises:
    ValueError: an unknown variant or a mesh that does not divide the config.
  """
  variants = ["none"] + [v for v in variants if v != "none"]
  balances = {v: parse_balance_variant(v, "variants", balance)  # all before compiling
              for v in variants}
  mesh = make_mesh(mesh_cfg)
  result: dict[str, Any] = {}
  with use_mesh(mesh):
    for v in variants:
      balance = balances[v]
      log(f"compiling the train step with balancing {v} ...")
      text = compile_train_step(model_cfg, train_cfg, mesh, batch_size, seq_len,
                                balance).as_text()
      sweeps = balance.quantile_sweeps if v == "quantile:current" else 1
      module = hlo.parse_hlo(text, unknown_trip_count=sweeps)
      counted = count_collectives(module)
      counted["bounded_by_sweeps"] = bool(module.unknown_trip_whiles and sweeps > 1)
      result[v] = counted
  for v in variants:
    result[v]["extra_count"] = result[v]["count"] - result["none"]["count"]
    result[v]["extra_bytes"] = result[v]["bytes"] - result["none"]["bytes"]
  return {"mesh": dict(mesh.shape), "variants": variants, "result": result}


def format_table(r: dict[str, Any], num_layers: int) -> str:
  """One line per variant: collectives per step (total, by kind), bytes, and the mode's own."""
  lines = [f"mesh {r['mesh']}, {num_layers} layers; collectives per training step (ops in loops "
           "x trip counts)"]
  for v in r["variants"]:
    x = r["result"][v]
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(x["by_kind"].items()))
    bound = " (while loops at the sweep bound)" if x["bounded_by_sweeps"] else ""
    lines.append(f"{v:>17}: {x['count']:7d} collectives ({kinds}); {x['bytes'] / 2**20:9.2f} "
                 f"MiB/device; balancing's own: {x['extra_count']:+d} collectives, "
                 f"{x['extra_bytes'] / 2**20:+.3f} MiB{bound}")
  return "\n".join(lines)

