"""Analytic sizing of a model config on an accelerator: parameters, FLOPs, memory, GEMMs, roofline.

  python -m launch.sizing --config=configs/zaya1_base.py --num_devices=64 --profile=mi300x
  python -m launch.sizing --config=configs/zaya1_base.py --num_devices=1024 --mesh=1,128,8 \
      --batch_size=1024 --seq_len=4096 --dtype=bfloat16 --remat=full

Nothing runs on a device: the figures are arithmetic on the config (zaya_jax.model.sizing,
zaya_jax.perf.roofline). `--mesh` is data,fsdp,expert[,context] (one may be -1; context
default 1); default FSDP over all devices. With context C > 1 (context parallelism) each
sequence is split over C devices: the memory table adds the gathered K/V and the step adds
the K/V all-gather / reduce-scatter, the halo exchange and the gradient all-reduce over
`context` (README "Context parallelism"). The global batch defaults to
config.train.batch_size, rounded up to a multiple of the batch shards (devices / context).

  python -m launch.sizing --config=configs/zaya1_base_32k.py --num_devices=64 --mesh=1,-1,8,2

`--gemm_table=bench_gemm.csv` (from `python -m launch.bench_gemm --config=... --out=DIR`,
run on the user's own accelerator) replaces the roofline time of every GEMM by the measured
one (exact shape, or interpolated from the nearest measured shapes: zaya_jax.perf.gemm_table
.GemmTable); attention, convolutions and communication stay on the roofline of `--profile`,
which should name the same accelerator (MFU is against its peak).

`--predict_step` compiles the real training step on fake CPU devices instead
(`--compile_mesh`, default 2,2,8: 32 devices, the target's expert size), once per balancing
variant (`--balance_variants`, default none and the config's mode), lists every collective
with its bytes and runs per step, scales and prices each one on the target mesh (`--mesh`,
`--num_devices`) with `--intra_GBps` / `--inter_GBps` and per-step latencies, and sets it
beside the roofline compute time: predicted step time, MFU and tokens/s per device
(zaya_jax.perf.predict):

  python -m launch.sizing --config=configs/zaya1_base.py --predict_step --num_devices=1024 \
      --mesh=16,8,8 --compile_mesh=2,2,8 --seqs_per_device=1 --seq_len=4096
"""

import dataclasses
import sys

from absl import app, flags

from zaya_jax.config import ConfigError, synthetic_configs
from zaya_jax.config.mesh import MeshConfig
from zaya_jax.perf import predict, roofline
from zaya_jax.perf.benchmark import balance_variant_name, parse_balance_variant
from zaya_jax.parallel.mesh import use_cpu_devices
from zaya_jax.parallel.accelerators import get_profile
from zaya_jax.perf.gemm_table import GemmTable
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Path to a config file, e.g. configs/zaya1_base.py.", lock_config=True)
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the mesh.", lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", "mi300x", "Accelerator profile: mi300x, mi325x, h100, h200.")
_MESH = flags.DEFINE_string("mesh", None, "data,fsdp,expert[,context] sizes (one may be -1); "
                            "default 1,-1,1,1.")
_BATCH = flags.DEFINE_integer("batch_size", None, "Global sequences per step; default "
                              "config.train.batch_size rounded up to a multiple of the batch shards "
                              "(num_devices / context).", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq_len", None, "Tokens per sequence; default config.train.seq_len.",
                            lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(roofline.DTYPE_BYTES), "GEMM compute dtype.")
_REMAT = flags.DEFINE_enum("remat", None, list(roofline.REMATS),
                           "Rematerialisation; default from config.model.remat.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 1, "Sequences per decode step (one device).",
                                     lower_bound=1)
_GEMM_TABLE = flags.DEFINE_string("gemm_table", None, "CSV from launch.bench_gemm: measured GEMM "
                                  "times replace the roofline's (default: roofline only).")
_PREDICT = flags.DEFINE_bool("predict_step", False, "Compile the train step on fake CPU devices "
                             "and price its collectives on --mesh (zaya_jax.perf.predict).")
_COMPILE_MESH = flags.DEFINE_string("compile_mesh", "2,2,8", "--predict_step: data,fsdp,expert of "
                                    "the fake-CPU mesh compiled (its product = fake devices).")
_SEQS = flags.DEFINE_integer("seqs_per_device", 1, "--predict_step: sequences per device per step.",
                             lower_bound=1)
_VARIANTS = flags.DEFINE_list("balance_variants", None, "--predict_step: balancing variants "
                              "(none, quantile:next, quantile:reroute, quantile:current, adamw, "
                              "pid, sign); default "
                              "none and the config's.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", None, "--predict_step: cache of the compiled steps' HLO "
                               "text (keyed by a hash of what is compiled); default none.")
_INTRA = flags.DEFINE_float("intra_GBps", None, "--predict_step: per-device intra-node GB/s per "
                            "direction; default the profile's scale-up peak.")
_INTER = flags.DEFINE_float("inter_GBps", None, "--predict_step: per-device inter-node GB/s per "
                            "direction; default the profile's NIC peak.")
_INTRA_LAT = flags.DEFINE_float("intra_latency_us", 10.0, "--predict_step: seconds x 1e-6 per "
                                "intra-node algorithm step.")
_INTER_LAT = flags.DEFINE_float("inter_latency_us", 25.0, "--predict_step: seconds x 1e-6 per "
                                "inter-node algorithm step.")
flags.mark_flags_as_required(["config"])
for _name in ("intra_GBps", "inter_GBps"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           "must be > 0 (GB/s; leave the flag out for the profile's peak)")
for _name in ("intra_latency_us", "inter_latency_us"):
  flags.register_validator(_name, lambda v: v >= 0, "must be >= 0 (microseconds)")


def _positive(name: str, value: int | None) -> None:
  if value is not None and value < 1:
    raise ValueError(f"--{name}={value} must be a positive integer")


def _mesh(flag: str, text: str) -> MeshConfig:
  values = text.split(",")
  if len(values) not in (3, 4):
    raise ValueError(f"--{flag}={text!r}: expected 3 or 4 comma-separated integers "
                     f"data,fsdp,expert[,context], got {len(values)}")
  try:
    return MeshConfig(*(int(v) for v in values))
  except (TypeError, ValueError) as e:
    raise ValueError(f"--{flag}={text!r}: expected data,fsdp,expert[,context] integers ({e})") from e


def _predict(model_cfg, train_cfg, balance, profile) -> None:
  """The --predict_step branch: compile on fake CPU devices, price on --mesh."""
  try:
    compile_mesh = _mesh("compile_mesh", _COMPILE_MESH.value)
    if -1 in (compile_mesh.data, compile_mesh.fsdp, compile_mesh.expert):
      raise ValueError(f"--compile_mesh={_COMPILE_MESH.value!r}: give every axis (no -1)")
    target = _mesh("mesh", _MESH.value) if _MESH.value else MeshConfig()
    target.shape(_NUM_DEVICES.value)  # raises for a mesh that does not fit --num_devices
    if compile_mesh.context != 1 or target.context != 1:
      raise ValueError("--predict_step prices meshes without context parallelism (context 1); "
                       "drop --predict_step for the analytic figures of the context axis")
    _positive("seqs_per_device", _SEQS.value)
    net = predict.network_from_profile(profile, intra_latency=_INTRA_LAT.value * 1e-6,
                                       inter_latency=_INTER_LAT.value * 1e-6)
    if _INTRA.value or _INTER.value:
      net = dataclasses.replace(
          net, intra_bandwidth=(_INTRA.value or net.intra_bandwidth / 1e9) * 1e9,
          inter_bandwidth=(_INTER.value or net.inter_bandwidth / 1e9) * 1e9,
          source=f"given: {_INTRA.value or net.intra_bandwidth / 1e9:g} GB/s intra-node, "
                 f"{_INTER.value or net.inter_bandwidth / 1e9:g} GB/s inter-node per device and "
                 f"direction; latency {_INTRA_LAT.value:g} / {_INTER_LAT.value:g} us per step")
    default = ["none"] + ([balance_variant_name(balance)] if balance.enabled else [])
    variants = _VARIANTS.value or default
    for v in variants:
      parse_balance_variant(v, "--balance_variants", balance)
  except ValueError as e:
    sys.exit(f"invalid arguments: {e}")
  use_cpu_devices(compile_mesh.data * compile_mesh.fsdp * compile_mesh.expert)
  seq = _SEQ.value or train_cfg.seq_len
  result = predict.predict_step(model_cfg, train_cfg, profile, net, compile_mesh=compile_mesh,
                                target_mesh=target, target_devices=_NUM_DEVICES.value,
                                seqs_per_device=_SEQS.value, seq_len=seq, variants=variants,
                                hlo_dir=_HLO_DIR.value, balance=balance)
  print(predict.format_prediction(
      result, title=f"{model_cfg.num_layers} layers, {model_cfg.dtype}, dispatch "
                    f"{model_cfg.moe_dispatch}, seq {seq}"))


def main(argv):
  if _PREDICT.value:
    try:
      model_cfg, train_cfg, _, balance = synthetic_configs(_CONFIG.value)
      profile = get_profile(_PROFILE.value)
    except (ConfigError, ValueError) as e:
      sys.exit(f"invalid arguments: {e}")
    _predict(model_cfg, train_cfg, balance, profile)
    return
  try:
    for name, flag in (("num_devices", _NUM_DEVICES), ("batch_size", _BATCH), ("seq_len", _SEQ),
                       ("decode_batch", _DECODE_BATCH)):
      _positive(name, flag.value)
    model_cfg, train_cfg, _, _ = synthetic_configs(_CONFIG.value)
    profile = get_profile(_PROFILE.value)
    mesh = _mesh("mesh", _MESH.value) if _MESH.value else None
    n = _NUM_DEVICES.value
    shards = n // (mesh or MeshConfig()).shape(n)["context"]  # batch shards
    batch = _BATCH.value or -(-train_cfg.batch_size // shards) * shards
    remat = _REMAT.value or ("full" if model_cfg.remat else "none")
    table = None
    if _GEMM_TABLE.value:
      try:
        table = GemmTable.from_csv(_GEMM_TABLE.value)
      except OSError as e:
        raise ValueError(f"--gemm_table={_GEMM_TABLE.value}: {e}") from e
    est = roofline.estimate(model_cfg, profile, num_devices=n, batch_size=batch,
                            seq_len=_SEQ.value or train_cfg.seq_len, dtype=_DTYPE.value, remat=remat,
                            mesh=mesh, decode_batch=_DECODE_BATCH.value,
                            gemm_seconds=table.seconds if table else None)
  except (ConfigError, ValueError) as e:
    sys.exit(f"invalid arguments: {e}")
  if table:
    print(f"GEMM times: measured, from --gemm_table={_GEMM_TABLE.value} (exact shapes or "
          f"interpolated from the nearest measured ones); the rest on the {profile.name} roofline, "
          f"MFU against its peak: the table should come from a {profile.name}.\n")
  violations = roofline.check(model_cfg, profile, est)
  print(roofline.format_report(model_cfg, profile, est, violations))


def run_main():
  """Console script `zaya-sizing` (pyproject.toml): the same as `python -m launch.sizing`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
