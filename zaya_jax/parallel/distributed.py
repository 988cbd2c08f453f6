"""Multi-controller JAX: `maybe_initialize` joins this process to a multi-process run.

One Python process runs per host (or per GPU); each sees its local devices, and after
`jax.distributed.initialize` all of them together form `jax.devices()`, over which the mesh
is built. Three ways to start one:

  * explicit: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` on every
    process (all three together; HOST:PORT is reachable on process 0);
  * SLURM: `srun python -m launch.train ...` with more than one task; JAX reads
    SLURM_PROCID / SLURM_NTASKS / SLURM_STEP_NODELIST and picks the coordinator itself
    (the first node). JAX then gives each task only local GPU SLURM_LOCALID (one task per
    GPU); with one task per node pass `local_device_ids` (all the node's GPUs);
  * Open MPI: `mpirun -np N python -m launch.train ...` (OMPI_COMM_WORLD_SIZE > 1).

Anything else is a single process and nothing is initialised.

Failure behaviour (so a broken job exits instead of hanging until the wall-clock limit):
  * A process that cannot reach the coordinator, or whose peers do not all arrive, fails in
    `jax.distributed.initialize` after `initialization_timeout` seconds.
  * When a process dies during training, its peers notice either at once (the collective
    they are blocked in loses its TCP connection: gloo on CPU, RCCL/NCCL sockets on GPU) or
    when the coordination service misses its heartbeats for `heartbeat_timeout_seconds`;
    the service then reports the error to every live process, which aborts (SIGABRT, exit
    status 134 in a shell). On CPU a peer blocked in a gloo collective does not notice the
    dead process by itself: the heartbeat is what ends it.
  * A process leaving (after an error or at the end) waits at most `shutdown_timeout_seconds`
    for the others in the shutdown barrier, then exits anyway.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

import jax

# JAX's own defaults are 300 s / 100 s / 300 s; shorter shutdown so a failed job frees its
# nodes quickly, the rest as JAX has them (a large job can take minutes to gather).
INITIALIZATION_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 100
SHUTDOWN_TIMEOUT_S = 60


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
  """"slurm" or "ompi" if this process is one of several launched by srun / mpirun, else None.

  SLURM: the variables JAX's SlurmCluster reads (set inside an `srun` step) with
  SLURM_NTASKS > 1; a bare `sbatch` script or a one-task step is a single process.
  Open MPI: OMPI_COMM_WORLD_SIZE > 1.
  """
  env = os.environ if environ is None else environ
  slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
  if all(v in env for v in slurm_vars) and int(env.get("SLURM_NTASKS", "1")) > 1:
    return "slurm"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "ompi"
  return None


def check_flags(coordinator_address: str | None, num_processes: int | None,
                process_id: int | None) -> bool:
  """True if the explicit flags ask for a multi-process run, False if none is given.

  Raises:
    ValueError: only some of the three are given, the address lacks a port,
      num_processes < 1, or process_id outside [0, num_processes).
  """
  given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
           "--process_id": process_id}
  if all(v is None for v in given.values()):
    return False
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"multi-process flags are all-or-nothing: missing {', '.join(missing)}; pass "
                     "--coordinator_address=HOST:PORT --num_processes=N --process_id=I on every "
                     "process (or none of them under SLURM / Open MPI)")
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"--coordinator_address={coordinator_address!r} must be HOST:PORT, e.g. "
                     "10.0.0.1:1234 (process 0's address)")
  if num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id} must be in [0, {num_processes}) "
                     f"(--num_processes={num_processes})")
  return True


def maybe_initialize(coordinator_address: str | None = None,
                     num_processes: int | None = None,
                     process_id: int | None = None,
                     local_device_ids: Sequence[int] | None = None,
                     initialization_timeout: int = INITIALIZATION_TIMEOUT_S,
                     heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_S,
                     shutdown_timeout_seconds: int = SHUTDOWN_TIMEOUT_S) -> str | None:
  """Calls `jax.distributed.initialize` if this is a multi-process run; call before any JAX work.

  Explicit flags win (cluster auto-detection is then switched off, so a SLURM allocation
  around a hand-started run does not interfere); otherwise SLURM and Open MPI are detected
  (`detect_cluster`) and JAX reads the rank, size and coordinator from their variables.

  Args:
    coordinator_address: "HOST:PORT" of process 0's coordination service.
    num_processes: N, the number of processes.
    process_id: this process's rank in [0, N).
    local_device_ids: restrict this process to these local devices (default: all, except
      that JAX gives one GPU per process when SLURM/Open MPI start one task per GPU).
    initialization_timeout: seconds to wait for every process to join before failing.
    heartbeat_timeout_seconds: seconds without a heartbeat after which a process is declared
      dead and every other process is terminated (non-zero exit).
    shutdown_timeout_seconds: seconds an exiting process waits for the others at shutdown.

  Returns:
    "explicit", "slurm" or "ompi" when initialised; None for a single process (no-op).

  Raises:
    ValueError: inconsistent flags (see `check_flags`).
    RuntimeError / jax.errors.JaxRuntimeError: from JAX, e.g. the initialisation timed out.
  """
  explicit = check_flags(coordinator_address, num_processes, process_id)
  method = "explicit" if explicit else detect_cluster()
  if method is None:
    return None
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id,
      local_device_ids=list(local_device_ids) if local_device_ids is not None else None,
      cluster_detection_method="deactivate" if explicit else None,
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
      shutdown_timeout_seconds=shutdown_timeout_seconds)
  return method


# What to install when JAX_PLATFORMS names a backend this jaxlib cannot start.
BACKEND_FIXES = {
    "rocm": "install the ROCm build of jaxlib: pip install -r launch/slurm/requirements-rocm.txt "
            "(README \"Multi-host and SLURM\")",
    "cuda": "install the CUDA build of jaxlib (pip install \"jax[cuda12]\" at the pinned version)",
}


def check_backend() -> None:
  """Starts JAX's backend (after `maybe_initialize`), turning JAX's traceback for a platform
  it cannot start (`JAX_PLATFORMS=rocm` with the CPU-only jaxlib) into one line.

  Raises:
    ValueError: naming the backend, JAX's reason and what to install (`BACKEND_FIXES`), or to
      check that the devices are visible.
  """
  try:
    jax.devices()
  except RuntimeError as e:
    m = re.search(r"Unable to initialize backend '([^']+)': (.*)", str(e))
    if m is None:
      raise
    backend, reason = m[1], m[2].split(" (set JAX_PLATFORMS=")[0].strip().rstrip(".")
    fix = BACKEND_FIXES.get(backend, f"install a jaxlib with the {backend} backend")
    raise ValueError(
        f"JAX cannot start its {backend!r} backend (JAX_PLATFORMS="
        f"{os.environ.get('JAX_PLATFORMS', '')!r}, jax {jax.__version__}): {reason}. If this "
        f"jaxlib lacks it, {fix}; if it has it, check that the devices are visible; or unset "
        "JAX_PLATFORMS to use what is there.") from e


def describe() -> str:
  """One line: process count and, per process, its devices (call after initialisation)."""
  per_process: dict[int, list[str]] = {}
  for d in jax.devices():
    per_process.setdefault(d.process_index, []).append(f"{d.platform}:{d.id}")
  parts = [f"process {p}: {len(ds)} devices [{', '.join(ds)}]" for p, ds in sorted(per_process.items())]
  return f"{jax.process_count()} processes, {jax.device_count()} devices; " + "; ".join(parts)
