"""Import a Hugging Face `ZayaForCausalLM` directory as step 0 of a training run.

  python -m launch.convert_from_hf --hf_dir=HF_DIR --workdir=DIR --config=configs/zaya1_tiny.py
  python -m launch.train --workdir=DIR --config=configs/zaya1_tiny.py   # resumes from it

The `--config` (with the same `--config.*` overrides as launch.train) is the training config
to pair with: its model group must describe the same architecture as HF_DIR/config.json (an
error names the differing fields; compute-only fields and skip_mode are free). Writes a step-0
checkpoint in the training layout: the HF parameters and balancing biases, fresh optimizer
moments, the run's seed, a fresh data iterator, and the resolved config. Run it as a single
process, then resume with the same process count (the data iterator position is per process).
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import ConfigError, resolve
from zaya_jax.data import make_train_iterator
from zaya_jax.hf import load_pretrained
from zaya_jax.model import ModelConfig
from zaya_jax.train import TrainState, make_optimizer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config to pair with, e.g. configs/zaya1_tiny.py.", lock_config=True)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Local transformers save_pretrained directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "New run directory (must hold no checkpoint).")
flags.mark_flags_as_required(["config", "hf_dir", "workdir"])

# Fields of to_hf_dict() that do not change the tensors or the function.
_FREE_HF_FIELDS = ("initializer_range",)


def architecture_differences(run: ModelConfig, hf: ModelConfig) -> list[str]:
  """`field: run -> hf` for every config.json field where the run config and HF differ."""
  a, b = run.to_hf_dict(), hf.to_hf_dict()
  return [f"{k}: config {a[k]!r} vs {_HF_DIR.value}/config.json {b.get(k)!r}"
          for k in a if k not in _FREE_HF_FIELDS and a[k] != b.get(k)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = resolve(_CONFIG.value)
  except ConfigError as e:
    sys.exit(f"invalid config: {e}")
  with open(os.path.join(_HF_DIR.value, "config.json")) as f:
    hf_cfg = ModelConfig.from_hf_dict(json.load(f))
  diffs = architecture_differences(cfg.model, hf_cfg)
  if diffs:
    sys.exit("the config's model group does not match the HF checkpoint: " + "; ".join(diffs))
  ckpt_dir = os.path.join(_WORKDIR.value, "checkpoints")
  ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
  if ckpt.latest_step() is not None:
    sys.exit(f"{ckpt_dir} already holds checkpoint step {ckpt.latest_step()}; pass a fresh --workdir")

  overrides = dataclasses.asdict(cfg.model)
  dtype = overrides.pop("dtype")
  model = load_pretrained(_HF_DIR.value, dtype=dtype, **overrides)  # cfg == cfg.model exactly
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  tx = make_optimizer(cfg.train, params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                     opt_state=tx.init(params),
                     rng=jax.random.key_data(jax.random.key(cfg.train.seed)))
  data_iter = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                                  batch_size=cfg.train.batch_size, seed=cfg.train.seed)
  ckpt.save(state, data_iter, cfg)
  ckpt.close()
  logging.info("wrote step-0 checkpoint of %s to %s", _HF_DIR.value, ckpt_dir)
  print(f"wrote {ckpt_dir}/0; resume with: python -m launch.train --workdir={_WORKDIR.value} "
        "--config=<the same config and overrides>")


if __name__ == "__main__":
  app.run(main)
