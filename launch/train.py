"""Train ZAYA1: `python -m launch.train --config=configs/zaya1_tiny.py --workdir=DIR`.

Override any config field from the command line (a misspelt field is an error):
  --config.train.lr=1e-3 --config.model.num_layers=2 \
  --config.model.layer_types="('hybrid','hybrid_sliding')"
Running the same command again resumes from the newest checkpoint in DIR/checkpoints.

Multi-host: under `srun` (SLURM) or `mpirun` (Open MPI) with several tasks the processes
find each other; elsewhere start one process per host with the same command plus
  --coordinator_address=HOST0:PORT --num_processes=N --process_id=I
(see zaya_jax/parallel/distributed.py and launch/slurm/). Every process needs the same --workdir on
a shared filesystem: all of them write checkpoints, process 0 alone writes metrics.jsonl.
Intentionally short: all logic lives in `zaya_jax.parallel.distributed` and `zaya_jax.train.run`.
"""

import sys

import configs.base
from absl import app, flags
from ml_collections import config_flags

from zaya_jax.parallel import distributed
from zaya_jax.checkpoint import CorruptCheckpointError
from zaya_jax.config import ConfigError, cli_paths
from zaya_jax.config.describe import describe, field_docs
from zaya_jax.train import run
from zaya_jax.train.loop import TrainingError
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Path to a config file, e.g. configs/zaya1_tiny.py. Override any field with "
    "--config.<group>.<field>=VALUE (e.g. --config.train.lr=1e-3); --print_config lists them "
    "all with their values and units.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints and metrics.jsonl; rerun to resume. Required "
    "unless --print_config.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print every config field (group.field = value  # unit and meaning, "
    "'(overridden)' for --config.* flags) and exit; needs no --workdir.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0, for a hand-started multi-process run.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's rank in [0, num_processes).")
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
    "local_device_ids", None, "Local devices this process uses, e.g. 0,1 (default: JAX's choice).")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "initialization_timeout", distributed.INITIALIZATION_TIMEOUT_S,
    "Seconds to wait for all processes to join before failing.", lower_bound=1)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", distributed.HEARTBEAT_TIMEOUT_S,
    "Seconds without a heartbeat after which a process counts as dead and the others exit.",
    lower_bound=1)
flags.mark_flags_as_required(["config"])
flags.register_validator("local_device_ids",
                         lambda v: v is None or all(i.strip().isdigit() for i in v),
                         "must be local device numbers (integers >= 0)")


def parse_flags(argv):
  """`cli_paths.parse_flags` (a missing --config file, a bad flag or a misspelt or mistyped
  `--config.*` override as one line), then a missing --workdir (without --print_config) is a
  usage error."""
  rest = cli_paths.parse_flags(argv)
  if _WORKDIR.value is None and not _PRINT_CONFIG.value:
    sys.exit("invalid flags: --workdir=DIR is required (or pass --print_config; see --help)")
  return rest


def print_config() -> None:
  """Prints `zaya_jax.config.describe` of the flag's config, comments from configs/base.py."""
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  print(describe(_CONFIG.value, field_docs(configs.base.__file__), _flatten(overrides)))


def _flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def main(argv):
  if _PRINT_CONFIG.value:
    print_config()
    return
  try:  # Before any JAX computation: the backend must not exist yet.
    method = distributed.maybe_initialize(
        _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
        local_device_ids=[int(i) for i in _LOCAL_DEVICE_IDS.value] if _LOCAL_DEVICE_IDS.value else None,
        initialization_timeout=_INIT_TIMEOUT.value, heartbeat_timeout_seconds=_HEARTBEAT_TIMEOUT.value)
  except ValueError as e:  # Inconsistent multi-process flags: one line, no traceback.
    sys.exit(f"invalid flags: {e}")
  try:
    distributed.check_backend()
  except ValueError as e:  # e.g. JAX_PLATFORMS=rocm with the CPU-only jaxlib
    sys.exit(str(e))
  try:
    run(_CONFIG.value, _WORKDIR.value, distributed_method=method)
  except ConfigError as e:  # A user error: print the field and the fix, no traceback.
    sys.exit(f"invalid config: {e}")
  except CorruptCheckpointError as e:  # No checkpoint in --workdir reads back intact.
    sys.exit(f"cannot resume: {e}")
  except TrainingError as e:  # e.g. a bad record mid-run, after a checkpoint of the last step
    sys.exit(f"training stopped: {e}")


def run_main():
  """Console script `zaya-train` (pyproject.toml): the same as `python -m launch.train`."""
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run_main()
