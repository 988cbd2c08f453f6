# Shape letters: L E (see zaya_jax/__init__.py).
"""Inspect a checkpoint (`summarize`) and rewrite it smaller (`reshape`), for launch.reshape_checkpoint.

`reshape` writes a new checkpoint directory at the same step: optionally without the optimizer
state (about 2/3 of a training checkpoint) and with the parameters cast to another dtype, with
fresh checksums, the source's config (plus a "reshape" record) and data iterator files. Such a
checkpoint is for evaluation and export (`launch.convert_to_hf` reads only the model item; Orbax
casts bfloat16 back to float32 exactly). `launch.train` refuses to resume one without an
optimizer state (zaya_jax.checkpoint.Checkpointer.restore).

Memory: arrays are restored onto one CPU device, once; the cast goes leaf by leaf and frees
each original as soon as its cast exists, so at most one copy plus one tensor is held. The
source is opened read-only and never modified.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from zaya_jax.checkpoint import integrity
from zaya_jax.checkpoint.compat import saved_model_config
from zaya_jax.checkpoint.manager import (CHECKSUMMED_ITEMS, ITEMS, failure_reason, open_manager,
                                         saved_items, verify_items)
from zaya_jax.checkpoint.steps import select_step
from zaya_jax.model import ModelConfig, ZayaForCausalLM, init_rngs

DTYPES = ("bfloat16", "float32")


class _IteratorFilesHandler(grain.checkpoint.CheckpointHandler):
  """grain's handler for `data_iter`, but `save` copies another checkpoint's position files
  (all processes' `process_<i>-of-<n>.json`) instead of asking a live iterator. The files
  are grain's format: `Checkpointer` restores them with grain's handler."""

  def save(self, directory, item=None, args=None):
    source = (item or args).source_dir
    for name in sorted(os.listdir(source)):
      if name.endswith(".json"):
        shutil.copyfile(os.path.join(source, name), os.path.join(str(directory), name))


@dataclasses.dataclass
class _CopyIteratorFiles(ocp.args.CheckpointArgs):
  """Save args of `_IteratorFilesHandler` (added to the writer's handler registry only)."""

  source_dir: str  # the source step's data_iter/ directory


def resolve_source(src: str, step: int | None) -> tuple[str, int]:
  """`(checkpoints directory, step)` from a workdir, a checkpoints directory or a step directory.

  Raises:
    ValueError: if `src` holds no checkpoint, `step` is not in it, or a step directory and
      a different `step` are both given.
  """
  src = os.path.abspath(src)
  base = os.path.basename(src.rstrip(os.sep))
  if os.path.isdir(os.path.join(src, "checkpoints")):
    directory = os.path.join(src, "checkpoints")
  elif base.isdigit() and os.path.isdir(os.path.join(src, "model")):  # a step directory
    if step is not None and step != int(base):
      raise ValueError(f"--src={src} is step {base} but --step={step}; pass one of them")
    directory, step = os.path.dirname(src.rstrip(os.sep)), int(base)
  else:
    directory = src
  if not os.path.isdir(directory):
    raise ValueError(f"--src={src}: no such directory; pass a training workdir or its "
                     "checkpoints/ directory")
  chosen, steps = select_step(directory, step)
  if not steps:
    raise ValueError(f"--src={src}: {directory} holds no checkpoint")
  if chosen is None:
    raise ValueError(f"--step={step} is not in {directory}; it holds steps {steps}")
  return directory, chosen


def _abstract_model_state(model_cfg: ModelConfig) -> nnx.State:
  """Every variable of the model (`nnx.Param`s and balancing biases), shapes only."""
  return nnx.state(nnx.eval_shape(lambda: ZayaForCausalLM(model_cfg, rngs=init_rngs(0))))


def _cpu() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def _target_from_metadata(tree_metadata: Any) -> Any:
  """Restore targets on one CPU device shaped and typed as saved."""
  cpu = _cpu()
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
                      tree_metadata)


def describe_sharding(m: Any) -> str:
  """A short text for Orbax's saved sharding metadata of one array.

  `NamedShardingMetadata` -> `mesh {data:1,fsdp:2,expert:4} P(None,'expert')` (the mesh axes
  and sizes, then the partition spec); `SingleDeviceShardingMetadata` -> `device 0`; None
  (no sharding saved) -> `none`; anything else -> its `str`.
  """
  if m is None:
    return "none"
  names, spec = getattr(m, "axis_names", None), getattr(m, "partition_spec", None)
  if names is not None and spec is not None:
    sizes = np.asarray(m.shape).reshape(-1).tolist()
    mesh = ",".join(f"{n}:{s}" for n, s in zip(names, sizes))
    parts = ",".join(repr(p) if not isinstance(p, (list, tuple)) else
                     "(" + ",".join(repr(q) for q in p) + ")" for p in spec)
    return f"mesh {{{mesh}}} P({parts})"
  device = getattr(m, "device_str", None)
  if device is not None:
    return f"device {device}"
  return str(m)


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _disk_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
             for f in files)


def _verify_item(manager: ocp.CheckpointManager, step: int, item: str, tree_metadata: Any,
                 checksums: dict[str, Any], where: str) -> int:
  """Restores `item` onto the CPU as saved, verifies it, frees it; returns experts verified."""
  tree = manager.restore(step, args=ocp.args.Composite(
      **{item: ocp.args.StandardRestore(_target_from_metadata(tree_metadata))}))[item]
  return integrity.verify_tree(item, tree, checksums, where)


def summarize(src: str, step: int | None = None, verify: bool = True) -> str:
  """A readable description of one checkpoint step.

  Lists every tensor of the array items (path, shape, dtype, sharding as saved by Orbax in
  `describe_sharding`'s form,
  bytes), totals per item (logical and on disk), the train_meta values, the config's
  "runtime" and "reshape" records, the data iterator files, and whether the checksums verify
  (each checksummed item is restored onto the CPU, verified and freed in turn).

  Raises:
    ValueError: as `resolve_source`.
  """
  directory, step = resolve_source(src, step)
  where = os.path.join(directory, str(step))
  manager = open_manager(directory, read_only=True)
  lines = [f"checkpoint {where} (step {step})"]
  try:
    items = saved_items(manager, step)
    lines.append("items: " + ", ".join(name for name in ITEMS if name in items))
    json_args = {n: ocp.args.JsonRestore() for n in ("config", "integrity") if n in items}
    json_out = manager.restore(step, args=ocp.args.Composite(**json_args)) if json_args else {}
    record = json_out["integrity"] if "integrity" in items else None
    if "train_meta" in items:
      meta = manager.restore(step, args=ocp.args.Composite(train_meta=ocp.args.StandardRestore(
          _target_from_metadata(items["train_meta"].tree)))).train_meta
      small = {k: v for k, v in meta.items() if not isinstance(v, dict)}
      lines.append("train_meta: " + ", ".join(
          f"{k}={np.asarray(v).tolist()}" for k, v in sorted(small.items())))
      for k, v in sorted(meta.items()):  # e.g. the balancing controller's [L, X] state
        if isinstance(v, dict):
          leaves = jax.tree_util.tree_leaves_with_path(v)  # nested: the bias AdamW's state
          lines.append(f"train_meta.{k}: " + ", ".join(
              f"{jax.tree_util.keystr(n, simple=True, separator='.')} {np.asarray(a).dtype}"
              f"{list(np.shape(a))} max|.|={np.max(np.abs(np.asarray(a))):.4g}"
              for n, a in leaves))
    if "config" in items:
      config = json_out["config"]
      for key in ("runtime", "reshape"):
        if key in config:
          lines.append(f"config.{key}: {config[key]}")
    for item in ("model", "opt_state", "train_meta"):
      if item not in items:
        lines.append(f"[{item}] absent")
        continue
      leaves = [(integrity.tensor_name(p), m) for p, m in
                jax.tree_util.tree_leaves_with_path(items[item].tree)]
      lines.append(f"[{item}]")
      total = 0
      for name, m in leaves:
        n = _nbytes(m.shape, m.dtype)
        total += n
        lines.append(f"  {name}  shape={tuple(m.shape)}  dtype={np.dtype(m.dtype).name}  "
                     f"sharding={describe_sharding(m.sharding)}  bytes={n}")
      lines.append(f"  total {item}: {len(leaves)} tensors, {total} bytes "
                   f"({total / 2**20:.2f} MiB), {_disk_bytes(os.path.join(where, item))} bytes "
                   "on disk")
    if "data_iter" in items:
      files = sorted(os.listdir(os.path.join(where, "data_iter")))
      lines.append(f"data_iter: {[f for f in files if f.endswith('.json')]}")
    if verify and record is None:
      lines.append("checksums: absent (no integrity item); not verified")
    elif verify:
      for item in CHECKSUMMED_ITEMS:
        checksums = integrity.item_record(record, item, where)
        if item not in items or checksums is None:
          continue
        try:
          experts = _verify_item(manager, step, item, items[item].tree, checksums, where)
          lines.append(f"checksums {item}: verified ({len(checksums)} tensors, {experts} "
                       "(layer, expert) slices)")
        except integrity.ChecksumMismatchError as e:
          lines.append(f"checksums {item}: MISMATCH\n{e}")
        except Exception as e:  # Orbax / TensorStore read errors of damaged files
          lines.append(f"checksums {item}: UNREADABLE: {failure_reason(e)}")
  finally:
    manager.close()
  return "\n".join(lines)


def _cast_params(model: nnx.State, dtype: str) -> nnx.State:
  """`model` with every floating `nnx.Param` cast to `dtype`, leaf by leaf, each original
  freed once its cast exists; other variables (balancing biases) are kept as they are."""
  params, rest = nnx.split_state(model, nnx.Param, ...)
  del model

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
      return x
    y = x.astype(dtype)
    y.block_until_ready()
    x.delete()
    return y

  return nnx.merge_state(jax.tree.map(cast, params), rest)


def reshape(src: str, dst: str, *, step: int | None = None, drop_optimizer: bool = False,
            dtype: str | None = None) -> list[str]:
  """Writes `dst/checkpoints/<step>`: the source step, optionally smaller, verified.

  Args:
    src: a training workdir, its checkpoints/ directory, or one step directory.
    dst: the new workdir; it must not hold checkpoints yet.
    step: the step to copy; None = the latest.
    drop_optimizer: leave out the optimizer state (the result cannot resume training).
    dtype: cast the parameters (`nnx.Param`s; balancing biases stay float32) to "bfloat16"
      or "float32"; None keeps the saved dtypes.

  Returns:
    Report lines: what was written and the verification result.

  Raises:
    ValueError: if `dst` already holds a checkpoint or is the source, `dtype` is unknown, the
      source fails its checksums (names tensors and experts), or the written copy does not
      equal the (cast) source.
  """
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"--dtype={dtype!r}: use one of {DTYPES}")
  directory, step = resolve_source(src, step)
  where = os.path.join(directory, str(step))
  dst_dir = os.path.join(os.path.abspath(dst), "checkpoints")
  source_dir = os.path.realpath(directory)
  if os.path.realpath(dst_dir) == source_dir:
    raise ValueError(f"--dst={dst} is the source; pass a new directory")
  if (os.path.realpath(dst) + os.sep).startswith(source_dir + os.sep):
    raise ValueError(f"--dst={dst} is inside the source's checkpoint directory {source_dir}; "
                     "pass a directory outside it")
  if os.path.isdir(dst_dir) and os.listdir(dst_dir):
    raise ValueError(f"--dst={dst}: {dst_dir} already holds {sorted(os.listdir(dst_dir))}; "
                     "refusing to overwrite, pass a new directory")
  report = []

  reader = open_manager(directory, read_only=True)
  try:
    items = saved_items(reader, step)
    for name in ("model", "train_meta", "config", "integrity"):
      if name not in items:
        raise ValueError(f"checkpoint {where} lacks its {name} item; is it a zaya_jax checkpoint?")
    json_out = reader.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), integrity=ocp.args.JsonRestore()))
    saved, record = json_out["config"], json_out["integrity"]

    def verify_source(item, tree):
      verify_items({item: tree}, record, (item,), where)
      report.append(f"source {where}: {item} checksums verified")

    # model: typed by the model code (to tell parameters from balancing biases), dtypes as saved
    saved_dtypes = {integrity.tensor_name(p): m.dtype for p, m in
                    jax.tree_util.tree_leaves_with_path(items["model"].tree)}

    def as_saved(path, x):
      name = integrity.tensor_name(path)
      if name not in saved_dtypes:
        raise ValueError(f"checkpoint {where} lacks the model tensor {name}")
      return jax.ShapeDtypeStruct(x.shape, saved_dtypes[name], sharding=_cpu())

    model_target = jax.tree_util.tree_map_with_path(
        as_saved, _abstract_model_state(saved_model_config(saved)))
    model = reader.restore(step, args=ocp.args.Composite(
        model=ocp.args.StandardRestore(model_target))).model
    verify_source("model", model)
    if dtype is not None:
      model = _cast_params(model, dtype)
    param_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(nnx.split_state(
        model, nnx.Param, ...)[0])})
    new_checksums = {"model": integrity.checksum_tree(model)}

    keep_optimizer = "opt_state" in items and not drop_optimizer
    args = {"model": ocp.args.StandardSave(model)}
    if keep_optimizer:
      opt_state = reader.restore(step, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(
          _target_from_metadata(items["opt_state"].tree)))).opt_state
      verify_source("opt_state", opt_state)
      new_checksums["opt_state"] = integrity.checksum_tree(opt_state)
      args["opt_state"] = ocp.args.StandardSave(opt_state)
    args["train_meta"] = ocp.args.StandardSave(reader.restore(step, args=ocp.args.Composite(
        train_meta=ocp.args.StandardRestore(_target_from_metadata(
            items["train_meta"].tree)))).train_meta)
    if "data_iter" in items:
      args["data_iter"] = _CopyIteratorFiles(os.path.join(where, "data_iter"))
    previous = saved.get("reshape")
    args["config"] = ocp.args.JsonSave({**saved, "reshape": {
        "source": where,
        "param_dtype": param_dtypes[0] if len(param_dtypes) == 1 else param_dtypes,
        "optimizer_dropped": not keep_optimizer,
        **({"previous": previous} if previous else {}),
    }})
    args["integrity"] = ocp.args.JsonSave({"version": integrity.FORMAT_VERSION,
                                           "algorithm": integrity.ALGORITHM,
                                           "items": new_checksums})
  except ValueError:
    raise
  except Exception as e:  # Orbax / TensorStore read errors of damaged files
    raise ValueError(f"cannot read checkpoint {where}: {failure_reason(e)}") from e
  finally:
    reader.close()

  writer = open_manager(dst_dir, read_only=False,
                        data_iter_save=(_CopyIteratorFiles, _IteratorFilesHandler()))
  try:
    writer.save(step, args=ocp.args.Composite(**args))
    writer.wait_until_finished()
  finally:
    writer.close()
  del args, model  # the written arrays; the check below restores them one item at a time
  if keep_optimizer:
    del opt_state
  out = os.path.join(dst_dir, str(step))
  report.append(f"wrote {out}: model{' cast to ' + dtype if dtype else ''}"
                f"{', opt_state' if keep_optimizer else ', no optimizer state'}, train_meta"
                f"{', data_iter' if 'data_iter' in items else ''}, config, integrity")

  check = open_manager(dst_dir, read_only=True)
  try:
    written = saved_items(check, step)
    for item, checksums in new_checksums.items():
      try:
        experts = _verify_item(check, step, item, written[item].tree, checksums, out)
      except integrity.ChecksumMismatchError as e:
        raise ValueError(f"the written copy {out} differs from the source: {e}") from e
      expert_tensors = sum(1 for e in checksums.values() if "per_expert" in e)
      report.append(f"verified {out} {item}: {len(checksums)} tensors equal the "
                    f"{'cast ' if item == 'model' and dtype else ''}source, including every "
                    f"expert ({experts} (layer, expert) slices of {expert_tensors} expert tensors)")
  finally:
    check.close()
  return report
