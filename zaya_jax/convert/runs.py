"""A training run's checkpoint <-> a Hugging Face directory (`launch.convert_{from,to}_hf`).

`new_run_from_hf(config, hf_dir, workdir)` is `launch.convert_from_hf`: the model config from
`HF_DIR/config.json` (`zaya_jax.hf.run_config.apply_hf_model`), the tokenizer from
`HF_DIR/tokenizer.json` when there is one (copied into the workdir), the training settings
from `config`; it writes `workdir/config.py` for `launch.train --config=`. `import_to_run(cfg,
hf_dir, workdir)` writes step 0 of a run in the training layout: the HF parameters and
balancing biases, fresh optimizer moments, the run's seed, a fresh data iterator and the
resolved config. Everything is built in host memory, one parameter at a
time (`load_pretrained`), and the all-zero optimizer moments share one zeros buffer per
distinct shape (`fresh_opt_state`), so about twice the float32 parameter bytes are held when
the checkpoint write starts; the write's own buffers (checksums, Orbax) come on top. The log
reports the peak RSS after each phase (tests/convert/measure_import_memory.py measures it).

`load_run_model(workdir, step, sharding)` reads the run config saved with a checkpoint and
restores only its `model` item; `export_run(workdir, out_dir, ...)` does so onto one CPU device
and writes it with `save_pretrained`, plus the tokenizer files `AutoTokenizer` loads
(`zaya_jax.hf.hf_tokenizer`): the run's tokenizer.json, or its byte-level equivalent for
`data.tokenizer="byte"`.

Bad input raises `ConvertError` with one line naming it (and the fix, or the steps that exist).
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import shutil
import time
from collections.abc import Collection

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx

from zaya_jax.checkpoint import (Checkpointer, find_run_checkpoint, restore_model_state,
                                 saved_model_config)
from zaya_jax.config import ConfigError, RunConfig, cli_paths, resolve
from zaya_jax.hf.export_hf import save_pretrained, skip_can_win
from zaya_jax.hf.hf_config import ConvertError, architecture_differences, read_hf_config
from zaya_jax.hf.hf_tokenizer import byte_tokenizer_json, write_tokenizer_files
from zaya_jax.hf.import_hf import load_pretrained
from zaya_jax.hf.run_config import apply_hf_model, hf_tokenizer_file, render_config_py
from zaya_jax.data import make_train_iterator
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.model.sizing import count_params
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


def _remove_empty(dirs: list[str]) -> None:
  """Removes each of `dirs` (innermost last in the list) that exists and is empty."""
  for d in reversed(dirs):
    try:
      os.rmdir(d)
    except OSError:  # gone already, or holds something: left as it is
      pass


def import_to_run(cfg: RunConfig, hf_dir: str, workdir: str,
                  tokenizer_source: str | None = None) -> str:
  """Writes `hf_dir` (a transformers save_pretrained directory) as step 0 of a run in `workdir`.

  `cfg` is the training config to pair with: its model group must describe the same
  architecture as `hf_dir/config.json` (compute-only fields and skip_mode are free). Run it
  as a single process, then resume with the same process count (the data iterator position
  is per process).

  Args:
    cfg: the resolved run config (saved with the checkpoint).
    hf_dir: the HF directory.
    workdir: a new run directory.
    tokenizer_source: a tokenizer.json copied to `cfg.data.tokenizer` once the checks pass
      (before the data iterator reads it); None = `cfg.data.tokenizer` is used as it is.
  Returns:
    The checkpoint directory, `workdir/checkpoints` (holding step 0).
  Raises:
    ConvertError: no such `hf_dir` or no config.json there; an architecture field that
      differs (all are named); a `workdir` that is a file or already holds a checkpoint; a
      checkpoint whose tensors do not fit. Nothing is written before the checks pass, and
      a failed import removes the folders it created (while empty) and the tokenizer files
      it copied.
  """
  start = time.perf_counter()
  hf_cfg = read_hf_config(hf_dir)
  diffs = architecture_differences(cfg.model, hf_cfg, hf_dir)
  if diffs:
    raise ConvertError("the config's model group does not match the HF checkpoint: "
                       + "; ".join(diffs))
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConvertError(f"--workdir={workdir} exists and is not a directory; pass a fresh --workdir")
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if os.path.isdir(ckpt_dir) else []
  if steps:  # refused before an Orbax manager (and its threads) exists
    raise ConvertError(f"{ckpt_dir} already holds checkpoint step {steps[-1]}; pass a fresh --workdir")
  if problem := cli_paths.unwritable_dir_problem(workdir, "--workdir", subdirs=("checkpoints",)):
    raise ConvertError(problem)
  # What a failed import leaves is removed again: the folders it created while empty, the
  # tokenizer files it copied (nothing that was there before is touched).
  new_dirs = [d for d in (os.path.abspath(workdir), os.path.abspath(ckpt_dir))
              if not os.path.exists(d)]
  copies = []
  try:
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
  except (OSError, ValueError) as e:
    _remove_empty(new_dirs)
    raise ConvertError(f"cannot open {ckpt_dir}: {e}") from e
  try:  # closed on every exit: an open async manager's threads would die noisily at shutdown
    latest = ckpt.latest_step()
    if latest is not None:
      raise ConvertError(f"{ckpt_dir} already holds checkpoint step {latest}; pass a fresh --workdir")
    if tokenizer_source is not None:  # with its special-token names, if it has them
      named = os.path.join(os.path.dirname(tokenizer_source), "tokenizer_config.json")
      pairs = [(tokenizer_source, cfg.data.tokenizer)] + (
          [(named, os.path.join(os.path.dirname(cfg.data.tokenizer), "tokenizer_config.json"))]
          if os.path.isfile(named) else [])
      for src, dst in pairs:
        if not os.path.exists(dst):
          copies.append(dst)
        shutil.copyfile(src, dst)
    _write_step0(cfg, hf_dir, ckpt)
  except BaseException:
    ckpt.close()
    for path in copies:
      os.remove(path)
    _remove_empty(new_dirs)
    raise
  ckpt.close()
  logging.info("wrote the step-0 checkpoint to %s in %.1f s; peak RSS %.3f GB", ckpt_dir,
               time.perf_counter() - start, peak_rss_gb())
  return ckpt_dir


@dataclasses.dataclass(frozen=True)
class ImportedRun:
  """What `new_run_from_hf` wrote: the `checkpoint_dir` (holding step 0), the `config_file`
  to train with (`launch.train --config=config_file`), the run config, and the model fields
  that config.json replaced in the given config (`replaced`, "field old -> new")."""

  checkpoint_dir: str
  config_file: str
  config: RunConfig
  replaced: list[str]


def training_settings(cfg: RunConfig, config_file: str, source: str | None) -> str:
  """One line: the training settings `config_file` holds and how to change them.

  Args:
    cfg: the resolved run config written to `config_file`.
    source: the `--config` file they came from, or None for the default (configs/base.py:
      ZAYA1-base's pre-training settings, said so).
  """
  t = cfg.train
  where = (f"are configs/base.py's (no --config given: ZAYA1-base's pre-training settings)"
           if source is None else f"come from --config={source}")
  return (f"training settings in {config_file} {where}: {t.num_steps} steps of "
          f"{t.batch_size} x {t.seq_len} = {t.batch_size * t.seq_len:,} tokens, warm-up "
          f"{t.warmup_steps}, peak lr {t.lr:g} ({t.schedule}), eval every {t.eval_every}, "
          f"checkpoint every {cfg.checkpoint.every_steps} steps; change them with "
          "--config=FILE (e.g. configs/zaya1_tiny.py) or --config.train.<field>=VALUE on this "
          "command, or with --config.train.<field>=VALUE on launch.train")


def new_run_from_hf(config: ml_collections.ConfigDict, hf_dir: str, workdir: str,
                    explicit: Collection[str] = (),
                    config_source: str | None = None) -> ImportedRun:
  """Imports `hf_dir` as step 0 of a new run in `workdir`, its model config from config.json.

  The model group of `config` is replaced by `hf_dir/config.json`'s architecture
  (`apply_hf_model`: one log line lists the fields it changed; explicit command-line model
  overrides that disagree are an error). If `hf_dir/tokenizer.json` exists and
  `data.tokenizer` was not set on the command line, it is copied to `workdir/tokenizer.json`
  and becomes the run's `data.tokenizer`. Writes `workdir/config.py`, the full config, last.

  Args:
    config: the run ConfigDict (the training settings; modified in place).
    hf_dir: a transformers save_pretrained directory.
    workdir: a new run directory.
    explicit: the `group.field` paths set on the command line (`get_override_values`).
    config_source: the `--config` file `config` was read from; None = the default
      (configs/base.py), which the log line on the training settings then says.
  Raises:
    ConvertError: as `import_to_run` and `apply_hf_model`, or a config that does not resolve
      with the checkpoint's model (the field and the fix are named).
  """
  replaced = apply_hf_model(config, hf_dir, explicit)
  if replaced:
    logging.info("model config from %s/config.json (the checkpoint's architecture wins over "
                 "--config for %d field(s)): %s", hf_dir, len(replaced), "; ".join(replaced))
  source = hf_tokenizer_file(hf_dir) if "data.tokenizer" not in explicit else None
  if source is not None:
    config.data.tokenizer = source
  try:
    cfg = resolve(config)
  except ConfigError as e:
    if "_token_id=" in str(e) or "model.vocab_size" in str(e):  # the tokenizer does not fit
      where = source or config.data.tokenizer
      raise ConvertError(
          f"the tokenizer {where!r} does not fit {hf_dir}/config.json ({str(e).split('; set')[0]}); "
          "the model's vocabulary and special ids are config.json's: pass "
          "--config.data.tokenizer=PATH, a tokenizer.json whose <bos>/<eos>/<pad> tokens have "
          "those ids") from e
    raise ConvertError(f"invalid config with the model of {hf_dir}/config.json: {e}") from e
  if source is not None:
    copy = os.path.join(os.path.abspath(workdir), "tokenizer.json")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=copy))
    config.data.tokenizer = copy
  counts = count_params(cfg.model)
  m = cfg.model
  logging.info("importing %s: %.4gM parameters (%.4gM active), L=%d D=%d E=%d V=%d; tokenizer %s",
               hf_dir, counts.total / 1e6, counts.active / 1e6, m.num_layers, m.hidden_size,
               m.num_experts, m.vocab_size, source or cfg.data.tokenizer)
  ckpt_dir = import_to_run(cfg, hf_dir, workdir, tokenizer_source=source)
  config_file = os.path.join(workdir, "config.py")
  origin = (f"--config={config_source}" if config_source is not None
            else "configs/base.py (no --config given)")
  header = (f"Run config written by launch.convert_from_hf: the model from {hf_dir}/config.json, "
            f"the rest\nfrom {origin}. Train with\n  python -m launch.train "
            f"--config={config_file} --workdir={workdir}\n")
  with open(config_file, "w") as f:
    f.write(render_config_py(config, header))
  settings = training_settings(cfg, config_file, config_source)
  (logging.warning if config_source is None else logging.info)("%s", settings)
  return ImportedRun(ckpt_dir, config_file, cfg, replaced)


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
    ValueError: naming `--max_shard_size`, for text that is not a number with a unit, or a
      size below one byte.
  """
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
  if not m or m.group(2).upper() not in _UNITS:
    raise ValueError(f"--max_shard_size={text!r}; use e.g. 5GB, 500MB or a byte count")
  size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
  if size < 1:
    raise ValueError(f"--max_shard_size={text!r} must be at least one byte; use e.g. 5GB or 500MB")
  return size


@dataclasses.dataclass(frozen=True)
class Export:
  """What `export_run` wrote: the checkpoint `step`, the safetensors `paths`, the run's
  tokenizer (`tokenizer`: its tokenizer.json path, "byte", or None when it wrote none) and
  the tokenizer files written (`tokenizer_paths`)."""

  step: int
  paths: list[str]
  tokenizer: str | None
  tokenizer_paths: list[str]


def export_run(workdir: str, out_dir: str, step: int | None = None, dtype: str = "bfloat16",
               max_shard_size_bytes: int | None = None, progress: bool | None = None) -> Export:
  """Writes checkpoint `step` (default: the latest) of the run in `workdir` to `out_dir` as a
  transformers `ZayaForCausalLM.from_pretrained` directory (`save_pretrained`, storage
  `dtype` "bfloat16" | "float32", shards of at most `max_shard_size_bytes`, a progress bar
  per `progress`, see `save_pretrained`), with the tokenizer files `AutoTokenizer` loads:
  the run's tokenizer.json, or for `data.tokenizer="byte"` its byte-level equivalent
  (`byte_tokenizer_json`). A tokenizer file that no longer exists is skipped with a warning.

  Raises:
    ConvertError: no such `workdir` or `step` (the steps that exist are named), a checkpoint
      with no usable model config or unreadable arrays, an `out_dir` that cannot be written
      or that is the run's own directory or inside its checkpoints (checked before reading),
      or a tokenizer whose vocabulary lacks the model's special ids.
  """
  out, run = os.path.realpath(out_dir), os.path.realpath(workdir)
  if out == run or (out + os.sep).startswith(os.path.join(run, "checkpoints") + os.sep):
    raise ConvertError(f"invalid flags: --out={out_dir} is the run's own directory "
                       f"{'' if out == run else '(its checkpoints) '}and the export would "
                       "overwrite its files; pass a new directory, e.g. --out=/tmp/hf_export")
  start = time.perf_counter()
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  model, saved, step = load_run_model(workdir, step, cpu)
  tokenizer = saved.get("data", {}).get("tokenizer")
  seq_len = saved.get("train", {}).get("seq_len", 4096)
  try:
    paths = save_pretrained(model, out_dir, dtype=dtype, max_shard_size_bytes=max_shard_size_bytes,
                            progress=progress)
    if tokenizer == "byte":
      byte_tokenizer_json(os.path.join(out_dir, "tokenizer.json"))
      tok_paths = write_tokenizer_files(os.path.join(out_dir, "tokenizer.json"), out_dir,
                                        model.cfg, seq_len)
    elif tokenizer and os.path.isfile(tokenizer):
      tok_paths = write_tokenizer_files(tokenizer, out_dir, model.cfg, seq_len)
    else:
      logging.warning("the run's data.tokenizer=%r is not a file here: no tokenizer files "
                      "written (AutoTokenizer cannot load %s)", tokenizer, out_dir)
      tokenizer, tok_paths = None, []
  except OSError as e:
    raise ConvertError(f"cannot write --out={out_dir}: {e}") from e
  size_mb = sum(os.path.getsize(p) for p in paths) / 1e6
  logging.info("exported step %d of %s to %s in %.1f s: %.4gM parameters, %.1f MB %s in %d "
               "safetensors file(s); tokenizer: %s", step, workdir, out_dir,
               time.perf_counter() - start, count_params(model.cfg).total / 1e6, size_mb, dtype,
               len(paths), "byte-level tokenizer.json" if tokenizer == "byte" else
               (tokenizer or "none"))
  return Export(step, paths, tokenizer, tok_paths)
