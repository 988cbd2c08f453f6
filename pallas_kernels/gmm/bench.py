"""Times `gmm` (Pallas, Triton) against `jax.lax.ragged_dot` (XLA), forward and forward+backward.

  python -m pallas_kernels.gmm.bench [--tokens 4096 --d_model 2048 --expert_width 2048
      --experts 16 --dtype bfloat16 --repeats 20 --block_m 64 ...]

Prints the median time per call after warm-up, the ratio kernel / XLA, achieved TFLOP/s
(`2*m*k*n` per product; forward+backward counts three products) and GB/s (each product reads
`lhs` and all of `rhs` and writes its output once). On CPU (`--tiny`, the default there) it
runs tiny shapes in interpret mode: the figures then only prove that it runs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.timing import median_seconds
from pallas_kernels.gmm.ops import GmmBlockSizes, gmm

TINY = dict(tokens=64, d_model=32, expert_width=48, experts=4)


def balanced_group_sizes(tokens: int, experts: int, key: jax.Array) -> jax.Array:
  """int32 `[experts]` summing to `tokens`: a random top-1 routing of every token."""
  choice_M = jax.random.randint(key, (tokens,), 0, experts)
  return jnp.bincount(choice_M, length=experts).astype(jnp.int32)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096, help="rows m")
  parser.add_argument("--d_model", type=int, default=2048, help="contraction k")
  parser.add_argument("--expert_width", type=int, default=2048, help="output columns n")
  parser.add_argument("--experts", type=int, default=16, help="groups E")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                      help="tiny shapes in interpret mode (default: exactly on CPU)")
  defaults = GmmBlockSizes()
  for name in ("block_m", "block_k", "block_n", "num_warps", "num_stages"):
    parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
  args = parser.parse_args(argv)

  on_cpu = jax.default_backend() == "cpu"
  tiny = on_cpu if args.tiny is None else args.tiny
  if tiny:
    for name, value in TINY.items():
      setattr(args, name, value)
    args.repeats = min(args.repeats, 3)
  block = GmmBlockSizes(args.block_m, args.block_k, args.block_n, args.num_warps,
                        args.num_stages)
  interpret = on_cpu
  m, k, n, e = args.tokens, args.d_model, args.expert_width, args.experts
  dtype = jnp.dtype(args.dtype)
  keys = jax.random.split(jax.random.key(0), 4)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / k**0.5).astype(dtype)
  ct = jax.random.normal(keys[2], (m, n), jnp.float32).astype(dtype)
  gs = balanced_group_sizes(m, e, keys[3])

  impls = {
      "pallas": lambda a, b, g: gmm(a, b, g, block=block, interpret=interpret),
      "ragged_dot": jax.lax.ragged_dot,
  }
  flops = 2 * m * k * n
  bytes_moved = (m * k + e * k * n + m * n) * dtype.itemsize
  print(f"backend={jax.default_backend()} interpret={interpret} m={m} k={k} n={n} E={e} "
        f"dtype={dtype.name} {block} repeats={args.repeats}")
  if tiny:
    print("tiny shapes in interpret mode: these figures only prove that the kernel runs")
  results = {}
  for mode, products in (("forward", 1), ("fwd+bwd", 3)):
    for name, fn in impls.items():
      if mode == "forward":
        timed = jax.jit(fn)
      else:
        timed = jax.jit(lambda a, b, g, c, fn=fn: jax.vjp(lambda a, b: fn(a, b, g), a, b)[1](c))
      call_args = (lhs, rhs, gs) if mode == "forward" else (lhs, rhs, gs, ct)
      seconds = median_seconds(timed, call_args, args.repeats, warmup=1)
      results[mode, name] = seconds
      print(f"{mode:8s} {name:10s} {seconds * 1e3:9.3f} ms  "
            f"{products * flops / seconds / 1e12:8.2f} TFLOP/s  "
            f"{products * bytes_moved / seconds / 1e9:8.1f} GB/s")
    ratio = results[mode, "pallas"] / results[mode, "ragged_dot"]
    print(f"{mode:8s} pallas / ragged_dot time ratio: {ratio:.2f}")


if __name__ == "__main__":
  main()
