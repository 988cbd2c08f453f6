"""Time the jitted training step of a config: tokens/s, step time, FLOP/s, MFU, peak memory.

  python -m launch.benchmark --config=configs/bench_cpu.py
  python -m launch.benchmark --config=configs/bench_cpu.py --steps=10 --warmup=2 \
      --compare_transformers --out=/tmp/bench.json
  python -m launch.benchmark --config=configs/zaya1_tiny.py \
      --compare_balance=quantile:next,quantile:current,adamw,none   # step-time ratios
  python -m launch.benchmark --config=configs/bench_cpu.py --profile_steps=2   # op time by source

Batches are synthetic token ids (no data or tokenizer is read); batch and sequence length
default to the config's train.batch_size and train.seq_len (override with
--config.train.batch_size=...). On CPU the MFU divides by a float32 matmul timed in the same
run; on a GPU by the detected profile's peak. `--compare_transformers` also times
transformers' ZayaForCausalLM forward + backward + AdamW on the same config and batch, with
torch.set_num_threads equal to the cores XLA:CPU uses, and prints the tokens/s ratio.
`--profile_steps=N` profiles N more steps and prints the op time per step by source function
(the innermost zaya_jax frame of each HLO op) and the top ops (`zaya_jax.perf.op_profile`).
All logic lives in `zaya_jax.perf.benchmark`.
"""

import json
import sys

from absl import app, flags

from zaya_jax.config import ConfigError
from zaya_jax.perf import benchmark
from zaya_jax.perf.op_profile import format_profile
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Path to a config file, e.g. configs/bench_cpu.py.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed training steps (>= 1).", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps first (>= 1; the first compiles).",
                               lower_bound=1)
_COMPARE = flags.DEFINE_bool("compare_transformers", False,
                             "Also time transformers' ZayaForCausalLM and print the ratio.")
_MATMUL = flags.DEFINE_integer("matmul_size", 2048, "n of the CPU peak matmul [n,n]@[n,n].",
                               lower_bound=1)
_BALANCE = flags.DEFINE_list(
    "compare_balance", None, "Instead: time the step under these balancing variants in one "
    "process (none, pid, sign, adamw, quantile:current, quantile:next, quantile:reroute), "
    "ratios to the first.")
_PROFILE = flags.DEFINE_integer("profile_steps", 0, "Also profile this many steps: op time by "
                                "source function and the top ops.", lower_bound=0)
_OUT = flags.DEFINE_string("out", None, "Write the figures to this JSON file.")
flags.mark_flags_as_required(["config"])


def main(argv):
  if _OUT.value and (problem := cli_paths.unwritable_file_problem(_OUT.value, "--out")):
    sys.exit(f"invalid flags: {problem}")
  try:
    cfgs = benchmark.bench_configs(_CONFIG.value)
  except ConfigError as e:
    sys.exit(f"invalid config: {e}")
  if _BALANCE.value:
    try:
      r = benchmark.compare_balance(cfgs, _BALANCE.value, steps=_STEPS.value,
                                    warmup=_WARMUP.value, log=lambda line: print(line, flush=True))
    except ValueError as e:
      sys.exit(f"invalid arguments: {e}")
    print(benchmark.format_balance(r))
    return
  try:
    result = benchmark.run(cfgs, steps=_STEPS.value, warmup=_WARMUP.value,
                           compare=_COMPARE.value, matmul_size=_MATMUL.value,
                           profile_steps=_PROFILE.value, log=lambda line: print(line, flush=True))
  except ValueError as e:
    sys.exit(f"invalid arguments: {e}")
  print(benchmark.format_report(result), flush=True)
  if "profile" in result:
    print(format_profile(result["profile"]), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {_OUT.value}")


def run_main():
  """Console script `zaya-benchmark` (pyproject.toml): the same as `python -m launch.benchmark`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
