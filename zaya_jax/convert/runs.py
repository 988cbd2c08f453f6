"""A training run's checkpoint <-> a Hugging Face directory (`launch.convert_{from,to}_hf`).

`import_to_run(cfg, hf_dir, workdir)` writes step 0 of a run in the training layout: the HF
parameters and balancing biases, fresh optimizer moments, the run's seed, a fresh data
iterator and the resolved config. Everything is built in host memory, one parameter at a
time (`load_pretrained`), and the all-zero optimizer moments share one zeros buffer per
distinct shape (`fresh_opt_state`), so about twice the float32 parameter bytes are held when
the checkpoint write starts; the write's own buffers (checksums, Orbax) come on top. The log
reports the peak RSS after each phase (tests/convert/measure_import_memory.py measures it).

`load_run_model(workdir, step, sharding)` reads the run config saved with a checkpoint and
restores only its `model` item; `export_run(workdir, out_dir, ...)` does so onto one CPU device
and writes it with `save_pretrained` (plus tokenizer.json when the run's data.tokenizer is a
file).

Bad input raises `ConvertError` with one line naming it (and the fix, or the steps that exist).
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx

from zaya_jax.checkpoint import (Checkpointer, find_run_checkpoint, restore_model_state,
                                 saved_model_config)
from zaya_jax.config import RunConfig
from zaya_jax.hf.export_hf import save_pretrained, skip_can_win
from zaya_jax.hf.hf_config import ConvertError, architecture_differences, read_hf_config
from zaya_jax.hf.import_hf import load_pretrained
from zaya_jax.data import make_train_iterator
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.parallel.mesh import abstract_with_shardings
from zaya_jax.train import TrainState, make_optimizer
from zaya_jax.train.balance import init_balance_state

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


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


def _write_step0(cfg: RunConfig, hf_dir: str, ckpt: Checkpointer) -> None:
  """Loads `hf_dir` in host memory and saves it with fresh optimizer state as step 0 of `ckpt`.

  Raises:
    ConvertError: the checkpoint's tensors do not fit `cfg.model` (missing, unexpected or
      misshapen tensors are named) or a file cannot be read.
  """
  with jax.default_device(jax.devices("cpu")[0]):  # host memory, whatever accelerators exist
    overrides = dataclasses.asdict(cfg.model)
    dtype = overrides.pop("dtype")
    try:
      model = load_pretrained(hf_dir, dtype=dtype, **overrides)  # cfg == cfg.model exactly
    except (OSError, ValueError) as e:
      raise ConvertError(f"cannot import the HF checkpoint: {e}") from e
    skip_layers = skip_can_win(model) if cfg.model.skip_mode != "zero" else []
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


def import_to_run(cfg: RunConfig, hf_dir: str, workdir: str) -> str:
  """Writes `hf_dir` (a transformers save_pretrained directory) as step 0 of a run in `workdir`.

  `cfg` is the training config to pair with: its model group must describe the same
  architecture as `hf_dir/config.json` (compute-only fields and skip_mode are free). Run it
  as a single process, then resume with the same process count (the data iterator position
  is per process).

  Returns:
    The checkpoint directory, `workdir/checkpoints` (holding step 0).
  Raises:
    ConvertError: no such `hf_dir` or no config.json there; an architecture field that
      differs (all are named); a `workdir` that is a file or already holds a checkpoint; a
      checkpoint whose tensors do not fit. Nothing is written before the checks pass.
  """
  hf_cfg = read_hf_config(hf_dir)
  diffs = architecture_differences(cfg.model, hf_cfg, hf_dir)
  if diffs:
    raise ConvertError("the config's model group does not match the HF checkpoint: "
                       + "; ".join(diffs))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConvertError(f"--workdir={workdir} exists and is not a directory; pass a fresh --workdir")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  try:
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
  except (OSError, ValueError) as e:
    raise ConvertError(f"cannot open {ckpt_dir}: {e}") from e
  try:  # closed on every exit: an open async manager's threads would die noisily at shutdown
    latest = ckpt.latest_step()
    if latest is not None:
      raise ConvertError(f"{ckpt_dir} already holds checkpoint step {latest}; pass a fresh --workdir")
    _write_step0(cfg, hf_dir, ckpt)
  finally:
    ckpt.close()
  logging.info("wrote step-0 checkpoint of %s to %s; peak RSS %.3f GB", hf_dir, ckpt_dir,
               peak_rss_gb())
  return ckpt_dir


def load_run_model(workdir: str, step: int | None, sharding: jax.sharding.Sharding,
                   **config_overrides) -> tuple[ZayaForCausalLM, dict, int]:
  """The model of checkpoint `step` (default: the latest) of the run in `workdir`, restored
  with every array in `sharding` (one device: no mesh).

  Args:
    workdir: the run directory (holds checkpoints/).
    step: the checkpoint step, or None for the latest.
    sharding: where the parameters go, e.g. `SingleDeviceSharding(jax.devices("cpu")[0])`.
    **config_overrides: compute-only ModelConfig fields to replace in the saved config.
  Returns:
    `(model, saved, step)`: the model, the run config saved with the checkpoint (a dict, as
    written), and the step restored.
  Raises:
    ConvertError: no such `workdir` or `step` (the steps that exist are named), a checkpoint
      with no usable model config, or arrays that cannot be restored.
  """
  try:
    ckpt_dir, step, saved = find_run_checkpoint(workdir, step)
  except ValueError as e:
    raise ConvertError(str(e)) from e
  try:
    cfg = saved_model_config(saved).replace(**config_overrides)
  except (KeyError, TypeError, ValueError) as e:
    raise ConvertError(f"checkpoint {ckpt_dir}/{step} holds no usable model config ({e!r}); is "
                       "it a zaya_jax checkpoint?") from e
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
  try:
    state = restore_model_state(ckpt_dir, abstract_with_shardings(abstract, sharding), step)
  except Exception as e:  # corrupt or incompatible arrays; the message names the item
    raise ConvertError(f"cannot restore the model of checkpoint {ckpt_dir}/{step}: {e}") from e
  return nnx.merge(graphdef, state), saved, step


def parse_size(text: str) -> int:
  """'5GB' -> 5_000_000_000 (decimal units, as transformers; KiB/MiB/GiB binary).

  Raises:
    ValueError: naming `--max_shard_size`, for text that is not a number with a unit.
  """
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
  if not m or m.group(2).upper() not in _UNITS:
    raise ValueError(f"--max_shard_size={text!r}; use e.g. 5GB, 500MB or a byte count")
  return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclasses.dataclass(frozen=True)
class Export:
  """What `export_run` wrote: the checkpoint `step`, the safetensors `paths`, and the
  `tokenizer_file` copied alongside (None when the run's tokenizer is not a file)."""

  step: int
  paths: list[str]
  tokenizer_file: str | None


def export_run(workdir: str, out_dir: str, step: int | None = None, dtype: str = "bfloat16",
               max_shard_size_bytes: int | None = None) -> Export:
  """Writes checkpoint `step` (default: the latest) of the run in `workdir` to `out_dir` as a
  transformers `ZayaForCausalLM.from_pretrained` directory (`save_pretrained`, storage
  `dtype` "bfloat16" | "float32", shards of at most `max_shard_size_bytes`).

  Raises:
    ConvertError: no such `workdir` or `step` (the steps that exist are named), a checkpoint
      with no usable model config or unreadable arrays, or an `out_dir` that cannot be written.
  """
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  model, saved, step = load_run_model(workdir, step, cpu)

  tokenizer = saved.get("data", {}).get("tokenizer")
  tokenizer_file = tokenizer if tokenizer and os.path.isfile(tokenizer) else None
  try:
    paths = save_pretrained(model, out_dir, dtype=dtype, max_shard_size_bytes=max_shard_size_bytes,
                            tokenizer_file=tokenizer_file)
  except OSError as e:
    raise ConvertError(f"cannot write --out={out_dir}: {e}") from e
  logging.info("exported step %d of %s to %s (%d safetensors file(s)%s)", step, workdir, out_dir,
               len(paths), ", tokenizer.json" if tokenizer_file else "")
  return Export(step, paths, tokenizer_file)
