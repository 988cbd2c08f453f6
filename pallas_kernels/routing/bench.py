# Shape letters: M X (see zaya_jax/__init__.py).
"""Time `route` (Pallas) against `route_reference` (XLA: argsort + bincount).

    python -m pallas_kernels.routing.bench [--tokens 8192 --classes 17 --repeats 50]

Prints the median time per call after a warm-up, the ratio reference / kernel, and the
effective bandwidth over the bytes the op must move (logits and biases in; class, gate, order,
inverse and the two [X] tables out). On CPU the kernels run in interpret mode on a tiny shape
(`--tiny`, the default there): those figures only prove the op runs, not its speed.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_interpret
from pallas_kernels.timing import median_seconds
from pallas_kernels.routing.ops import RoutingBlockSizes, route
from pallas_kernels.routing.reference import route_reference


def main(argv=None) -> None:
  on_cpu = jax.default_backend() == "cpu"
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=8192, help="M, tokens routed per call")
  p.add_argument("--classes", type=int, default=17, help="X = experts + 1 (skip)")
  p.add_argument("--repeats", type=int, default=None, help="timed calls (default 50; 3 on CPU)")
  p.add_argument("--block-m", type=int, default=RoutingBlockSizes.block_m, help="tokens/program")
  p.add_argument("--num-warps", type=int, default=RoutingBlockSizes.num_warps)
  p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=on_cpu,
                 help="M=256 (default on CPU, where the kernels are interpreted)")
  a = p.parse_args(argv)
  m, x = (256 if a.tiny else a.tokens), a.classes
  repeats = a.repeats or (3 if on_cpu else 50)
  interpret = resolve_interpret(None)
  block = RoutingBlockSizes(block_m=a.block_m, num_warps=a.num_warps)

  logits_MX = jax.random.normal(jax.random.key(0), (m, x), jnp.float32)
  biases_X = jnp.zeros((x,), jnp.float32).at[-1].set(-1.0)
  kernel_fn = jax.jit(lambda l, b: route(l, b, block=block, interpret=interpret))
  reference_fn = jax.jit(route_reference)
  t_kernel = median_seconds(kernel_fn, (logits_MX, biases_X), repeats)
  t_ref = median_seconds(reference_fn, (logits_MX, biases_X), repeats)
  nbytes = m * x * 4 + x * 4 + m * 4 * 4 + 2 * x * 4

  print(f"routing M={m} X={x} block_m={block.block_m} num_warps={block.num_warps} "
        f"backend={jax.default_backend()} interpret={interpret} repeats={repeats}")
  for name, t in (("pallas", t_kernel), ("reference (XLA)", t_ref)):
    print(f"  {name:16s} {t * 1e6:10.1f} us/call  {nbytes / t / 1e9:8.2f} GB/s")
  print(f"  ratio reference / pallas: {t_ref / t_kernel:.2f}x")
  if interpret:
    print("  note: interpret mode on CPU; these figures only prove the kernels run.")


if __name__ == "__main__":
  main()
