"""Evaluation only: `python -m launch.evaluate --workdir=DIR [--step=N]` or `--hf_dir=HF_DIR
--config=configs/zaya1_tiny.py`.

Reads a run's checkpoint (its model item only, so `reshape_checkpoint --drop_optimizer`
copies work) with the run's saved config, or an HF directory (its config.json is the model;
`--config` gives data and tokenizer), evaluates the eval split of `data` the way the training
loop does (`train.eval_batches` batches of `train.batch_size` x `train.seq_len`), prints
loss, perplexity, tokens and the per-layer expert load on stderr, and writes one JSON record
`{"kind": "eval", ...}` to stdout or `--out`. `--config` with `--workdir` replaces every group
but `model`. metrics.jsonl is left alone unless `--append_metrics`.
"""

import dataclasses
import json
import os
import sys

from absl import app, flags

from zaya_jax.checkpoint import find_run_checkpoint
from zaya_jax.config import ConfigError, resolve
from zaya_jax.hf.hf_config import ConvertError, read_hf_config
from zaya_jax.config import cli_paths
from zaya_jax.logs import quiet_third_party
from zaya_jax.train.evaluate import evaluate_saved, run_config_of, with_eval_data

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_CONFIG = cli_paths.define_config_file(
    "config", None, "Config file for data/tokenizer/eval settings (needed with --hf_dir).",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's directory (holding checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to evaluate; default the latest.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "A Hugging Face directory (config.json + *.safetensors).")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", None, "Batches to evaluate; default "
                                     "train.eval_batches.", lower_bound=1)
_DATA_SOURCE = flags.DEFINE_string("data_source", None, "Evaluate the eval split of this data.source.")
_OUT = flags.DEFINE_string("out", None, "Write the JSON record to this file instead of stdout.")
_APPEND = flags.DEFINE_bool("append_metrics", False, "Also append the record to WORKDIR/metrics.jsonl.")


def _config():
  """(RunConfig, checkpoints dir or None, step or None) from the flags."""
  override = _CONFIG.value
  if _HF_DIR.value:
    if _WORKDIR.value:
      raise ConfigError("pass one of --workdir and --hf_dir")
    if _APPEND.value:
      raise ConfigError("--append_metrics appends to a run's metrics.jsonl and --hf_dir has none; "
                        "drop it (or use --out=FILE)")
    if override is None:
      raise ConfigError("--hf_dir needs --config=... for the data and tokenizer "
                        "(e.g. --config=configs/zaya1_tiny.py)")
    try:
      model = read_hf_config(_HF_DIR.value)
    except ConvertError as e:
      raise ConfigError(str(e)) from e
    base = resolve(override)
    return dataclasses.replace(base, model=model), None, None
  if not _WORKDIR.value:
    raise ConfigError("pass --workdir=DIR (a training run) or --hf_dir=HF_DIR")
  ckpt_dir, step, saved = find_run_checkpoint(_WORKDIR.value, _STEP.value)
  if override is not None:
    saved = {**resolve(override).to_dict(), "model": saved["model"]}
  return run_config_of(saved), ckpt_dir, step


def main(argv):
  if _OUT.value and (problem := cli_paths.unwritable_file_problem(_OUT.value, "--out")):
    sys.exit(f"launch.evaluate: {problem}")
  try:
    cfg, ckpt_dir, step = _config()
    cfg = with_eval_data(cfg, eval_batches=_EVAL_BATCHES.value, data_source=_DATA_SOURCE.value)
    record = evaluate_saved(cfg, ckpt_dir=ckpt_dir, step=step, hf_dir=_HF_DIR.value)
  except (ConfigError, ValueError) as e:
    sys.exit(f"launch.evaluate: {str(e).splitlines()[0]}")
  source = _HF_DIR.value or f"{ckpt_dir}/{step}"
  print(f"eval {source}: loss {record['loss']:.4f} | perplexity {record['perplexity']:.2f} | "
        f"{record['tokens']:.0f} tokens in {record['batches']} batches", file=sys.stderr)
  for i, (ratio, skip) in enumerate(zip(record["max_over_mean"], record["skip_fraction"])):
    print(f"  layer {i}: max/mean expert load {ratio:.2f} | skip fraction {skip:.3f}",
          file=sys.stderr)
  text = json.dumps({**record, "source": source})
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(text + "\n")
  else:
    print(text)
  if _APPEND.value:
    with open(os.path.join(_WORKDIR.value, "metrics.jsonl"), "a") as f:
      f.write(text + "\n")


def run_main():
  """Console script `zaya-evaluate` (pyproject.toml): the same as `python -m launch.evaluate`."""
  app.run(main, flags_parser=cli_paths.parse_flags)  # a missing --config: one line


if __name__ == "__main__":
  run_main()
