"""Helpers shared by the kernels: interpret-mode choice and the Triton lowering check."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"  # the custom call Pallas' Triton lowering emits
GPU_PLATFORMS = ("rocm", "cuda")


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret` as given, or (None) True exactly when JAX's default backend is the CPU.

  Pallas' Triton backend compiles only for GPUs; on CPU the same kernel body runs in
  interpret mode (slow, for tests).
  """
  return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def lowered_text(fn: Callable[..., Any], args: Sequence[Any], platform: str) -> str:
  """StableHLO text of `jax.jit(fn)(*args)` lowered for `platform` ("rocm" or "cuda").

  Works without a GPU: lowering stops before compilation. `args` may be arrays or
  `jax.ShapeDtypeStruct`s.
  """
  return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def triton_calls(fn: Callable[..., Any], args: Sequence[Any], platform: str) -> int:
  """Number of Triton custom calls in `fn` lowered for `platform` (0 = no Pallas kernel)."""
  return lowered_text(fn, args, platform).count(TRITON_CUSTOM_CALL)


def out_struct(shape: tuple[int, ...], dtype: Any, *inputs: Any) -> jax.ShapeDtypeStruct:
  """`jax.ShapeDtypeStruct` for a `pallas_call` output.

  Inside `jax.shard_map` (with its default `check_vma=True`) a `pallas_call` output must
  say over which manual mesh axes it varies: here, every axis over which any of `inputs`
  varies (the kernel reads them all). Outside `shard_map` the set is empty.
  """
  varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in inputs))
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


