"""Import a Hugging Face `ZayaForCausalLM` directory as step 0 of a training run.

  python -m launch.convert_from_hf --hf_dir=HF_DIR --workdir=DIR --config=configs/zaya1_tiny.py
  python -m launch.train --workdir=DIR --config=configs/zaya1_tiny.py   # resumes from it

The `--config` (with the same `--config.*` overrides as launch.train) is the training config
to pair with: its model group must describe the same architecture as HF_DIR/config.json (an
error names the differing fields; compute-only fields and skip_mode are free). Writes a step-0
checkpoint in the training layout: the HF parameters and balancing biases, fresh optimizer
moments, the run's seed, a fresh data iterator, and the resolved config. Run it as a single
process, then resume with the same process count (the data iterator position is per process).

Memory: everything is built in host memory, one parameter at a time (`load_pretrained`), and
the all-zero optimizer moments share one zeros buffer per distinct shape (`fresh_opt_state`),
so about twice the float32 parameter bytes are held when the checkpoint write starts; the
write's own buffers (checksums, Orbax) come on top. The log reports the peak RSS after each
phase; tests/convert/measure_import_memory.py measures it on a 0.3 GB model. Bad input (no such --hf_dir, a
config.json or checkpoint that does not fit the config, a --workdir that already holds a
checkpoint) exits non-zero with one line naming the problem.
"""

import dataclasses
import json
import os
import resource
import sys

import jax
import jax.numpy as jnp
import optax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from zaya_jax.checkpoint import Checkpointer
from zaya_jax.config import ConfigError, RunConfig, resolve
from zaya_jax.data import make_train_iterator
from zaya_jax.convert.hf import _skip_can_win, load_pretrained
from zaya_jax.model import ModelConfig
from zaya_jax.train import TrainState, make_optimizer
from zaya_jax.train.balance import init_balance_state

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


def fresh_opt_state(tx: optax.GradientTransformation, params: nnx.State) -> optax.OptState:
  """`tx.init(params)`, with the all-zero leaves sharing one zeros array per (shape, dtype).

  AdamW's first and second moments start at zero; two separate buffers per parameter would
  double the memory of an import for nothing. A compiled check (whose zeros XLA folds away)
  confirms that every initial leaf is zero; if one is not (another optimizer), the ordinary
  `tx.init(params)` is returned.

  Args:
    tx: the run's optimizer (`zaya_jax.train.make_optimizer`).
    params: the `nnx.Param` state of the model (concrete arrays).
  Returns:
    The optimizer state, equal in value, structure and dtypes to `tx.init(params)`.
  """
  nonzero = jax.jit(lambda p: [jnp.any(x != 0) for x in jax.tree.leaves(tx.init(p))])(params)
  if any(bool(z) for z in nonzero):
    logging.info("the optimizer's initial state is not all zeros: materialising tx.init")
    return tx.init(params)
  zeros: dict[tuple, jax.Array] = {}

  def zero(leaf):
    key = (leaf.shape, leaf.dtype)
    if key not in zeros:
      zeros[key] = jnp.zeros(leaf.shape, leaf.dtype)
    return zeros[key]

  return jax.tree.map(zero, jax.eval_shape(tx.init, params))


def peak_rss_gb() -> float:
  """This process's peak resident memory so far, in GB (10^9 bytes; Linux ru_maxrss is kB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def read_hf_config(hf_dir: str) -> ModelConfig:
  """The ModelConfig of `hf_dir/config.json`; exits with one line if it is absent or not ZAYA1."""
  if not os.path.isdir(hf_dir):
    sys.exit(f"--hf_dir={hf_dir}: no such directory (a local transformers save_pretrained "
             "directory; nothing is downloaded)")
  path = os.path.join(hf_dir, "config.json")
  try:
    with open(path) as f:
      return ModelConfig.from_hf_dict(json.load(f))
  except FileNotFoundError:
    sys.exit(f"--hf_dir={hf_dir}: no config.json (not a transformers save_pretrained directory)")
  except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
    sys.exit(f"{path}: {e}")


def write_step0(cfg: RunConfig, ckpt: Checkpointer) -> None:
  """Loads --hf_dir in host memory and saves it with fresh optimizer state as step 0 of `ckpt`.

  Exits with one line if the checkpoint's tensors do not fit `cfg.model` (missing,
  unexpected or misshapen tensors are named).
  """
  with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerators exist
    overrides = dataclasses.asdict(cfg.model)
    dtype = overrides.pop("dtype")
    try:
      model = load_pretrained(_HF_DIR.value, dtype=dtype, **overrides)  # cfg == cfg.model exactly
    except (OSError, ValueError) as e:
      sys.exit(f"cannot import the HF checkpoint: {e}")
    skip_layers = _skip_can_win(model) if cfg.model.skip_mode != "zero" else []
    if skip_layers:
      logging.warning(
          "model.skip_mode=%r, but transformers (and so this checkpoint) zeroes the MoE output "
          "of skipped tokens, and the skip class can win routing in layers %s: the run starts "
          "from a different function than the HF model. Use --config.model.skip_mode=zero to "
          "continue it unchanged.", cfg.model.skip_mode, skip_layers)
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    del model
    param_gb = sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9
    logging.info("memory: loaded %.3f GB of parameters; peak RSS so far %.3f GB",
                 param_gb, peak_rss_gb())
    tx = make_optimizer(cfg.train, params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=model_state,
                       opt_state=fresh_opt_state(tx, params),
                       rng=jax.random.key_data(jax.random.key(cfg.train.seed)),
                       balance=init_balance_state(cfg.model.num_layers,
                                                  cfg.model.num_router_classes))
    logging.info("memory: optimizer state built; peak RSS so far %.3f GB", peak_rss_gb())
    data_iter = make_train_iterator(cfg.data, seq_len=cfg.train.seq_len,
                                    batch_size=cfg.train.batch_size, seed=cfg.train.seed)
    ckpt.save(state, data_iter, cfg)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = resolve(_CONFIG.value)
  except ConfigError as e:
    sys.exit(f"invalid config: {e}")
  hf_cfg = read_hf_config(_HF_DIR.value)
  diffs = architecture_differences(cfg.model, hf_cfg)
  if diffs:
    sys.exit("the config's model group does not match the HF checkpoint: " + "; ".join(diffs))
  if os.path.exists(_WORKDIR.value) and not os.path.isdir(_WORKDIR.value):
    sys.exit(f"--workdir={_WORKDIR.value} exists and is not a directory; pass a fresh --workdir")
  ckpt_dir = os.path.join(_WORKDIR.value, "checkpoints")
  try:
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
  except (OSError, ValueError) as e:
    sys.exit(f"cannot open {ckpt_dir}: {e}")
  try:  # closed on every exit: an open async manager's threads would die noisily at shutdown
    latest = ckpt.latest_step()
    if latest is not None:
      sys.exit(f"{ckpt_dir} already holds checkpoint step {latest}; pass a fresh --workdir")
    write_step0(cfg, ckpt)
  finally:
    ckpt.close()
  logging.info("wrote step-0 checkpoint of %s to %s; peak RSS %.3f GB", _HF_DIR.value,
               ckpt_dir, peak_rss_gb())
  print(f"wrote {ckpt_dir}/0; resume with: python -m launch.train --workdir={_WORKDIR.value} "
        "--config=<the same config and overrides>")


if __name__ == "__main__":
  app.run(main)
