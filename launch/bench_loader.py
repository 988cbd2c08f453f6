"""Loader throughput against the training step's need:
`python -m launch.bench_loader --data=DIR [--seq_len=4096 --batch_size=32 --num_workers=0,1,2 --steps=20]`,
or the index at scale: `python -m launch.bench_loader --synthetic_documents=10000000000`.

Builds the training iterator exactly as launch.train does (`zaya_jax.data.make_train_iterator`
on `data.source=--data`: a prepared directory or raw .txt/.jsonl/.json globs, or "stdlib")
and prints tokens/s of one process for each worker count, against the tokens/s one process
must deliver at the scale of `--config` (default ZAYA1-base: train.batch_size x seq_len /
--num_devices per device per step, over the roofline step time on --profile, x
--devices_per_process), and the ratio loader/required (`zaya_jax.perf.loader`).
The default --batch_size is the per-process share of that global batch.

With --synthetic_documents=N (instead of --data) it measures the prepared-data index on N
synthetic documents (`zaya_jax.perf.loader_scale`: a manifest from lengths alone, written to
--synthetic_dir): open time, first batch, resume near the end of epoch 1, rows/s (and x the
rows/s one process must deliver) and resident memory of this process.
"""

import sys

from absl import app, flags

from zaya_jax.config import ConfigError, synthetic_configs
from zaya_jax.data import DataConfig
from zaya_jax.perf import loader, loader_scale
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", "configs/zaya1_base.py", "Config whose model/train set the required rate.",
    lock_config=True)
_DATA = flags.DEFINE_string("data", None, "data.source: a prepared directory, raw globs or stdlib.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "data.tokenizer for a raw source.")
_SEQ = flags.DEFINE_integer("seq_len", None, "Tokens per row; default config.train.seq_len.",
                            lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", None, "Rows per batch on this process; default the "
                              "per-process share of the global batch at --num_devices.",
                              lower_bound=1)
_WORKERS = flags.DEFINE_list("num_workers", ["0", "1", "2"], "Loader worker counts to time.")
_STEPS = flags.DEFINE_integer("steps", 20, "Batches timed per worker count (after the first).",
                              lower_bound=1)
_PROFILE = flags.DEFINE_string("profile", "mi300x", "Accelerator profile of the step time.")
_DEVICES = flags.DEFINE_integer("num_devices", 64, "Devices of the training mesh.", lower_bound=1)
_PER_PROCESS = flags.DEFINE_integer("devices_per_process", 8, "Devices one process feeds.",
                                    lower_bound=1)
_SHUFFLE = flags.DEFINE_bool("shuffle_rows", True, "data.shuffle_rows: the row shuffle on or off.")
_SYNTHETIC = flags.DEFINE_integer("synthetic_documents", None, "Measure the index on this many "
                                  "synthetic documents instead of reading --data.")
_SYNTHETIC_DIR = flags.DEFINE_string("synthetic_dir", "/tmp/zaya_synthetic_corpus",
                                     "Where the synthetic manifest.json is written.")
_DOCS_PER_SHARD = flags.DEFINE_integer("docs_per_shard", 1 << 16, "Synthetic documents per shard.")
_MEAN_TOKENS = flags.DEFINE_integer("mean_tokens", 1400, "Synthetic tokens per document, mean.")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.02, "data.eval_fraction (synthetic).")
_PACKING = flags.DEFINE_enum("packing", "concat", ["concat", "best_fit"], "data.packing (synthetic).")
_WALK = flags.DEFINE_bool("walk", True, "Synthetic: find the true resume anchor by walking "
                          "epoch 1 (O(N)); --nowalk estimates it (for N where that is too slow).")


def main(argv):
  try:
    try:
      workers = [int(w) for w in _WORKERS.value]
    except ValueError:
      raise ValueError(f"--num_workers={','.join(_WORKERS.value)}: give comma-separated "
                       "integers >= 0, e.g. 0,1,2") from None
    model_cfg, train_cfg, _, _ = synthetic_configs(_CONFIG.value)
    need = loader.required_rate(model_cfg, train_cfg, profile=_PROFILE.value,
                                num_devices=_DEVICES.value,
                                devices_per_process=_PER_PROCESS.value, seq_len=_SEQ.value)
    batch = _BATCH.value or need.batch_size * need.devices_per_process // need.num_devices
    if _SYNTHETIC.value is not None:
      for name, flag in (("synthetic_documents", _SYNTHETIC), ("docs_per_shard", _DOCS_PER_SHARD),
                         ("mean_tokens", _MEAN_TOKENS)):
        if flag.value < 1:
          raise ValueError(f"--{name}={flag.value} must be >= 1")
      if problem := cli_paths.unwritable_dir_problem(_SYNTHETIC_DIR.value, "--synthetic_dir"):
        raise ValueError(problem)
      result = loader_scale.measure_scale(
          _SYNTHETIC.value, _SYNTHETIC_DIR.value, seq_len=need.seq_len, batch_size=batch,
          steps=_STEPS.value, docs_per_shard=_DOCS_PER_SHARD.value,
          mean_tokens=_MEAN_TOKENS.value, eval_fraction=_EVAL_FRACTION.value,
          packing=_PACKING.value, walk=_WALK.value)
      print(f"required: {need.per_process / need.seq_len:,.1f} rows/s of {need.seq_len} tokens "
            "per process (ZAYA1-base step, see --data mode)")
      print(loader_scale.format_scale([result], need.per_process / need.seq_len))
      return
    if _DATA.value is None:
      raise ValueError("give --data=DIR (a prepared directory, raw globs or stdlib) or "
                       "--synthetic_documents=N")
    data = DataConfig(source=_DATA.value, tokenizer=_TOKENIZER.value, shuffle_rows=_SHUFFLE.value)
    rates = [loader.measure_loader(data, seq_len=need.seq_len, batch_size=batch, num_workers=w,
                                   steps=_STEPS.value) for w in workers]
  except (ConfigError, ValueError, OSError) as e:
    sys.exit(f"launch.bench_loader: {e}")
  print(loader.format_report(rates, need))


def run_main():
  """Console script `zaya-bench-loader` (pyproject.toml): the same as `python -m launch.bench_loader`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
