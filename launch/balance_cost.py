"""Collectives per training step of each load-balancing mode, counted in the compiled HLO.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m launch.balance_cost \
      --config=configs/zaya1_tiny.py --config.mesh.data=8 --config.mesh.fsdp=1
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m launch.balance_cost \
      --config=configs/zaya1_base.py --config.mesh.fsdp=8 --config.train.batch_size=8

The step is compiled from abstract inputs (nothing is allocated), so ZAYA1-base compiles on
fake CPU devices; batch size and sequence length default to the config's train.batch_size and
train.seq_len. Each variant is the config's balance group with the variant's mode, so
`--config.balance.*` settings hold in every variant. Ops inside loops are counted times their
trip counts. Logic:
`zaya_jax.perf.balance_cost`.
"""

import json
import sys

from absl import app, flags

from zaya_jax.config import ConfigError, cli_paths
from zaya_jax.logs import quiet_third_party
from zaya_jax.perf import balance_cost, benchmark

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Path to a config file, e.g. configs/zaya1_tiny.py.", lock_config=True)
_VARIANTS = flags.DEFINE_list(
    "variants", ["none", "quantile:next", "quantile:reroute", "adamw", "pid", "sign",
     "quantile:current"],
    "Balancing variants (none, pid, sign, adamw, quantile:next, quantile:reroute, "
    "quantile:current).")
_OUT = flags.DEFINE_string("out", None, "Write the counts to this JSON file.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if _OUT.value and (problem := cli_paths.unwritable_file_problem(_OUT.value, "--out")):
    sys.exit(f"invalid flags: {problem}")
  try:
    for v in _VARIANTS.value:
      benchmark.parse_balance_variant(v, "--variants")  # before the config's minutes of compiling
    cfgs = benchmark.bench_configs(_CONFIG.value)
    r = balance_cost.balance_collectives(
        cfgs.model, cfgs.train, cfgs.mesh, _VARIANTS.value, batch_size=cfgs.train.batch_size,
        seq_len=cfgs.train.seq_len, balance=cfgs.balance, log=lambda line: print(line, flush=True))
  except (ConfigError, ValueError) as e:
    sys.exit(f"invalid arguments: {e}")
  print(balance_cost.format_table(r, cfgs.model.num_layers))
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(r, f, indent=1)
    print(f"wrote {_OUT.value}")


def run_main():
  """Console script `zaya-balance-cost` (pyproject.toml): as `python -m launch.balance_cost`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
