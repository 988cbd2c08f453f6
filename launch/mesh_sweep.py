"""Compile the training step on several mesh shapes and compare memory, FLOPs and collectives.

  python -m launch.mesh_sweep --config=configs/zaya1_tiny.py --meshes="1,1,8;2,1,4" \
      --dispatches=allgather,all_to_all --steps=3 --out=/tmp/sweep
  python -m launch.mesh_sweep --config=configs/zaya1_base.py --meshes="1,8,1;1,1,8;2,1,4" \
      --compile_only --batch_size=8 --seq_len=4096 --out=/tmp/sweep_base

Meshes are `data,fsdp,expert`, separated by `;`; their product must equal the device count.
On a CPU-only host run with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the tool
asks for `--num_cpu_devices` fake devices itself when XLA_FLAGS does not set them); the
figures then characterise those fake CPU devices, not GPUs. `--compile_only` lowers on
abstract inputs only, so configs far too large for this host (zaya1_base, 8.3B parameters)
still report memory, FLOPs and collectives. `ragged_all_to_all` cannot compile on XLA:CPU:
its rows are lowered only. Batches are synthetic tokens: no data or tokenizer is read.
Writes OUT/mesh_sweep.csv and OUT/mesh_sweep.png. All logic lives in
`zaya_jax.perf.mesh_sweep`.
"""

import sys

import jax
from absl import app, flags

from zaya_jax.config import ConfigError, synthetic_configs
from zaya_jax.perf import mesh_sweep
from zaya_jax.config.mesh import parse_meshes
from zaya_jax.parallel.dispatch import DISPATCHES
from zaya_jax.parallel.mesh import use_cpu_devices
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Path to a config file, e.g. configs/zaya1_tiny.py.", lock_config=True)
_MESHES = flags.DEFINE_string("meshes", "1,1,8;2,1,4;1,2,4",
                              "Mesh shapes data,fsdp,expert separated by ';'.")
_DISPATCHES = flags.DEFINE_list(
    "dispatches", None, "MoE dispatch paths to compare (allgather, all_to_all, "
    "ragged_all_to_all, ...); default: the config's model.moe_dispatch.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Compile and analyse only; no steps run.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per row (after one warm-up step).",
                              lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", None, "Global batch; default config.train.batch_size.",
                              lower_bound=1)
_SEQ = flags.DEFINE_integer("seq_len", None, "Tokens per sequence; default config.train.seq_len.",
                            lower_bound=1)
_NUM_CPU = flags.DEFINE_integer("num_cpu_devices", 8, "Fake CPU devices when XLA_FLAGS sets none.",
                                lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Output folder for mesh_sweep.csv and mesh_sweep.png.")
flags.mark_flags_as_required(["config", "out"])


def main(argv):
  bad = [d for d in _DISPATCHES.value or [] if d not in DISPATCHES]
  if bad:
    sys.exit(f"invalid flags: --dispatches={','.join(_DISPATCHES.value)}: {', '.join(bad)} is not "
             f"a dispatch path; use some of {', '.join(DISPATCHES)}")
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  use_cpu_devices(_NUM_CPU.value)
  try:
    model_cfg, train_cfg, _, balance = synthetic_configs(_CONFIG.value)
    meshes = parse_meshes(_MESHES.value)
  except (ConfigError, ValueError) as e:
    sys.exit(f"invalid arguments: {e}")
  if not meshes:
    sys.exit("invalid flags: --meshes is empty; e.g. --meshes='1,1,8;2,1,4'")
  for mesh_cfg in meshes:  # before any compile: a row for a mesh that cannot be built is no result
    try:
      mesh_cfg.shape(jax.device_count())
    except ValueError as e:
      sys.exit(f"invalid flags: --meshes: {e} (--num_cpu_devices or XLA_FLAGS sets the count)")
  batch = _BATCH.value or train_cfg.batch_size
  seq = _SEQ.value or train_cfg.seq_len
  note = mesh_sweep.host_note()
  print(note, flush=True)
  rows = mesh_sweep.run_sweep(model_cfg, train_cfg, meshes, _DISPATCHES.value or [None],
                              batch_size=batch, seq_len=seq,
                              steps=0 if _COMPILE_ONLY.value else _STEPS.value, balance=balance)
  mesh_sweep.write_report(rows, _OUT.value, num_layers=_CONFIG.value.model.num_layers,
                          batch_size=batch, seq_len=seq, note=note)
  failed = [row for row in rows if row["note"].startswith("failed")]
  if failed:
    sys.exit(f"launch.mesh_sweep: {len(failed)} of {len(rows)} rows failed (their `note` column "
             f"in {_OUT.value}/mesh_sweep.csv gives why), e.g. {failed[0]['note']}")


def run_main():
  """Console script `zaya-mesh-sweep` (pyproject.toml): the same as `python -m launch.mesh_sweep`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
