# Shape letters: L E (see zaya_jax/__init__.py).
"""Checksums of checkpointed arrays that do not depend on sharding, per tensor and per expert.

A checksum is a wrapping uint32 sum over the elements of `word * weight`, where
  word    the element's bits widened to uint32: float32/int32/uint32 bitcast; bfloat16, float16
          and other 2-byte types bitcast to uint16, then widened; 1-byte types and bool widened;
          8-byte types bitcast to two uint32 words;
  weight  an odd uint32 hashed from the element's flat position (murmur3's 32-bit finaliser),
          so that moving a value, not only changing it, changes the sum.
Integer addition modulo 2**32 is associative and commutative, so XLA may split the sum over
devices and shards in any order: the result is the same for every mesh and sharding, and a
checkpoint saved on one layout verifies on another. Because the weights are odd, changing any
single word by any amount (e.g. one flipped bit) always changes the sum.

Expert tensors (a path component named `experts`, e.g. `layers.mlp.experts.w_gate.value`,
[L, E, ...]) also get one checksum per (layer, expert): [L, E], summed over the trailing axes
with weights from the position inside the expert's slice, so a mismatch names the layer and
the expert whose weights differ.

`checksum_tree` runs jitted on the arrays where they live (any sharding, several processes)
and returns a JSON-ready record; `verify_tree` recomputes and compares, raising
`ChecksumMismatchError` that names every tensor and (layer, expert) that differs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

FORMAT_VERSION = 1
ALGORITHM = "zaya-wsum32: sum(word_u32 * (fmix32(flat_index) | 1)) mod 2**32"
EXPERTS_KEY = "experts"  # a path component that marks a [L, E, ...] expert tensor
MAX_LISTED = 16  # mismatching experts listed per tensor in an error message


class ChecksumMismatchError(ValueError):
  """Restored arrays differ from the checksums saved with them (names tensors and experts)."""


def _key_name(key: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def tensor_name(keypath: tuple[Any, ...]) -> str:
  """Dotted name of a pytree leaf, e.g. `layers.mlp.experts.w_gate.value`, `1.0.mu.norm.weight.value`.

  These are the names Orbax gives the arrays on disk, so a tree restored from Orbax metadata
  (plain dicts and lists) and the nnx.State / optax tree it was saved from name each leaf
  alike.
  """
  return ".".join(_key_name(k) for k in keypath)


def is_expert_tensor(name: str, shape: tuple[int, ...]) -> bool:
  """True for [L, E, ...] expert tensors: a path component `experts` and rank >= 2."""
  return EXPERTS_KEY in name.split(".") and len(shape) >= 2


def _fmix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser (a bijection on uint32 that mixes every input bit)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _position_weights(shape: tuple[int, ...]) -> jax.Array:
  """uint32 `shape`: an odd hash of each element's row-major flat index (mod 2**32)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride = (stride * shape[axis]) % 2**32
  return _fmix32(index) | jnp.uint32(1)


def _words(x: jax.Array) -> jax.Array:
  """`x`'s bits as uint32 words: shape x.shape, or x.shape + (2,) for 8-byte dtypes."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size == 2:
    return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if size == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  if size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  raise TypeError(f"no checksum for dtype {x.dtype} ({size} bytes per element)")


def _checksum(x: jax.Array, keep_axes: int) -> jax.Array:
  """uint32 x.shape[:keep_axes]: the weighted word sum over the remaining axes."""
  words = _words(x)
  weights = _position_weights(words.shape[keep_axes:])
  return jnp.sum(words * weights, axis=tuple(range(keep_axes, words.ndim)), dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _checksum_jit(dtype: str | None, expert: bool,
                  x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
  """`(total uint32 [], per_expert uint32 [L, E] or None)` of one leaf, cast to `dtype` first.

  One leaf per compiled call (not the whole tree in one program): the temporaries (the uint32
  words and position weights) then exist for one tensor at a time, so a checksum pass costs
  a few copies of the largest tensor, not of the model.
  """
  if dtype is not None and jnp.dtype(dtype) != x.dtype:
    x = x.astype(dtype)
  return _checksum(x, 0), (_checksum(x, 2) if expert else None)


def _to_host(x: jax.Array | None) -> np.ndarray | None:
  if x is None:
    return None
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _leaves_with_names(tree: Any) -> list[tuple[str, Any]]:
  return [(tensor_name(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
          if hasattr(x, "shape") and hasattr(x, "dtype")]


def checksum_tree(tree: Any, cast_to: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
  """Checksums of every array leaf of `tree`, computed where the arrays live.

  Every process of a multi-process run must call this with its part of the same global arrays
  (it runs one jitted computation per leaf over them).

  Args:
    tree: a pytree of arrays (jax.Array with any sharding, or numpy), e.g. an nnx.State.
    cast_to: optional `{tensor name: dtype name}`: checksum those leaves after casting to that
      dtype (a bfloat16-saved tensor restored into a float32 target casts back exactly).

  Returns:
    `{tensor name: {"shape": [..], "dtype": str, "checksum": int}}`, plus
    `"per_expert": [[int] * E] * L` for expert tensors (`is_expert_tensor`). JSON-ready.
  """
  named = _leaves_with_names(tree)
  cast_to = cast_to or {}
  specs, leaves = [], []
  for name, x in named:
    dtype = cast_to.get(name)
    if dtype is not None and jnp.dtype(dtype) == x.dtype:
      dtype = None  # the same compiled program as at save time
    specs.append((dtype, is_expert_tensor(name, tuple(x.shape))))
    leaves.append(x)
  if not leaves:
    return {}
  results = []
  for (dtype, expert), x in zip(specs, leaves):
    total, per_expert = _checksum_jit(dtype, expert, x)
    results.append((_to_host(total), None if per_expert is None else _to_host(per_expert)))
  record = {}
  for (name, x), (dtype, expert), (total, per_expert) in zip(named, specs, results):
    entry = {"shape": [int(d) for d in x.shape], "dtype": str(jnp.dtype(dtype or x.dtype)),
             "checksum": int(total)}
    if expert:
      entry["per_expert"] = per_expert.astype(np.int64).tolist()
    record[name] = entry
  return record


def compare(saved: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]]) -> list[str]:
  """Differences between two `checksum_tree` records, one readable line per tensor.

  Lists tensors missing on either side, shape differences (e.g. a tensor saved with another
  number of experts), and checksum differences: for expert tensors the (layer, expert) pairs
  whose weights differ.
  """
  problems = []
  for name in sorted(set(saved) - set(actual)):
    problems.append(f"{name}: saved with shape {saved[name]['shape']} but missing from what "
                    "was restored")
  for name in sorted(set(actual) - set(saved)):
    problems.append(f"{name}: restored (shape {actual[name]['shape']}) but has no saved "
                    "checksum, so the checkpoint lacks it")
  for name in sorted(set(saved) & set(actual)):
    want, got = saved[name], actual[name]
    if list(want["shape"]) != list(got["shape"]):
      problems.append(f"{name}: saved with shape {list(want['shape'])} but restored as "
                      f"{list(got['shape'])} (a different number of layers or experts?)")
      continue
    if "per_expert" in want and "per_expert" in got:
      bad_LE = np.argwhere(np.asarray(want["per_expert"], np.int64)
                           != np.asarray(got["per_expert"], np.int64))
      if len(bad_LE):
        pairs = ", ".join(f"(layer {l}, expert {e})" for l, e in bad_LE[:MAX_LISTED])
        more = f" and {len(bad_LE) - MAX_LISTED} more" if len(bad_LE) > MAX_LISTED else ""
        problems.append(f"{name}: {len(bad_LE)} expert(s) differ: {pairs}{more}")
        continue
    if want["checksum"] != got["checksum"]:
      problems.append(f"{name}: checksum {got['checksum']} != saved {want['checksum']}")
  return problems


def verify_tree(item: str, tree: Any, saved: dict[str, dict[str, Any]], where: str) -> int:
  """Recomputes the checksums of `tree` and compares them with `saved` (from `checksum_tree`).

  Leaves whose dtype differs from the saved one are cast back to it first, so a checkpoint
  written in bfloat16 verifies after Orbax restored it into float32 (an exact cast); a lossy
  cast (float32 saved, bfloat16 restored) fails.

  Args:
    item: the checkpoint item, e.g. "model", for the message.
    tree: the restored arrays.
    saved: the record saved with them.
    where: the checkpoint directory, for the message.

  Returns:
    The number of (layer, expert) slices verified.

  Raises:
    ChecksumMismatchError: naming every tensor that is missing, extra, reshaped or different,
      and for expert tensors the (layer, expert) indices that differ.
  """
  cast_to = {name: entry["dtype"] for name, entry in saved.items()}
  actual = checksum_tree(tree, cast_to)
  problems = compare(saved, actual)
  if problems:
    raise ChecksumMismatchError(
        f"checkpoint {where}: the {item} item does not match the checksums saved with it "
        f"({len(problems)} tensor(s)); the files are corrupt or incomplete:\n  "
        + "\n  ".join(problems))
  return sum(len(e["per_expert"]) * len(e["per_expert"][0]) for e in saved.values()
             if e.get("per_expert"))


def make_record(items: dict[str, Any]) -> dict[str, Any]:
  """The JSON stored as the checkpoint's `integrity` item: `{item: checksum_tree(tree)}`."""
  return {"version": FORMAT_VERSION, "algorithm": ALGORITHM,
          "items": {name: checksum_tree(tree) for name, tree in items.items()}}


def item_record(record: dict[str, Any], item: str, where: str) -> dict[str, dict[str, Any]] | None:
  """The checksums of `item` in an `integrity` record; None if the record has none for it.

  Raises:
    ChecksumMismatchError: if the record is of an unknown version (written by newer code).
  """
  if record.get("version") != FORMAT_VERSION or record.get("algorithm") != ALGORITHM:
    raise ChecksumMismatchError(
        f"checkpoint {where}: integrity record version {record.get('version')!r} "
        f"({record.get('algorithm')!r}) is not the {FORMAT_VERSION} this code reads; "
        "use the code version that wrote it")
  return record.get("items", {}).get(item)
