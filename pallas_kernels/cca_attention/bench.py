"""Times `cca_flash_attention` against the XLA reference (materialised `[B, T, T]` mask).

  python -m pallas_kernels.cca_attention.bench [--seq 4096 --heads 8 --kv_heads 2 \
      --head_dim 128 --batch 1 --dtype bfloat16 --window none|N --docs 1]

Prints the median time per call (after warm-up) of the forward and of forward+backward
(`jax.vjp` with a fixed cotangent), the reference/kernel ratio, TFLOP/s and GB/s. FLOPs count
only the visible (causal, in-window) query/key pairs, ignoring documents: forward
`4 * B * N * H * pairs` (pairs = T(T+1)/2 without a window, the causal halving), backward 2.5x
the forward. GB/s counts the minimal HBM traffic (each input read once, each output written
once). On CPU (`--tiny`, the default there) the kernel runs in interpret mode on tiny shapes:
the figures only prove that it runs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.timing import median_seconds
from pallas_kernels.cca_attention.ops import cca_flash_attention
from pallas_kernels.cca_attention.reference import attention_reference


def _visible_pairs(seq: int, window: int | None) -> int:
  """Causal (and in-window) query/key pairs of one sequence."""
  w = seq if window is None else min(window, seq)
  return w * (w + 1) // 2 + (seq - w) * w


def main() -> None:
  on_cpu = jax.default_backend() == "cpu"
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv_heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=128)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  p.add_argument("--window", default="none", help="'none' or a positive int")
  p.add_argument("--docs", type=int, default=1, help="equal-length documents per row")
  p.add_argument("--iters", type=int, default=None, help="timed calls (default 20, CPU 3)")
  p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=on_cpu,
                 help="tiny shapes (T=64, N=4, K=2, H=32); default on CPU")
  a = p.parse_args()
  if a.tiny:
    a.seq, a.heads, a.kv_heads, a.head_dim, a.batch = 64, 4, 2, 32, 1
  window = None if a.window.lower() == "none" else int(a.window)
  iters = a.iters or (3 if on_cpu else 20)
  dtype = jnp.dtype(a.dtype)
  b, t, n, kh, h = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim

  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), dtype)
  k = jax.random.normal(keys[1], (b, t, kh, h), dtype)
  v = jax.random.normal(keys[2], (b, t, kh, h), dtype)
  ct = jax.random.normal(keys[3], (b, t, n, h), dtype)
  doc_len = -(-t // a.docs)
  seg = jnp.broadcast_to(1 + jnp.arange(t, dtype=jnp.int32) // doc_len, (b, t))
  scale = h ** -0.5

  fns = {
      "pallas": lambda q, k, v, s: cca_flash_attention(q, k, v, s, scale=scale, window=window),
      "xla": lambda q, k, v, s: attention_reference(q, k, v, s, scale=scale, window=window),
  }

  def fwd_bwd(fn):
    def run(q, k, v, s):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, s), q, k, v)
      return out, vjp(ct)
    return jax.jit(run)

  item = dtype.itemsize
  qo_bytes, kv_bytes = b * t * n * h * item, b * t * kh * h * item
  fwd_flops = 4 * b * n * h * _visible_pairs(t, window)
  fwd_bytes = 2 * qo_bytes + 2 * kv_bytes  # read q, k, v; write o
  bwd_bytes = fwd_bytes + 4 * qo_bytes + 4 * kv_bytes  # + read q,k,v,o,do; write dq,dk,dv
  cases = [("forward", lambda fn: jax.jit(fn), fwd_flops, fwd_bytes),
           ("fwd+bwd", fwd_bwd, 3.5 * fwd_flops, bwd_bytes)]

  print(f"backend={jax.default_backend()} B={b} T={t} N={n} K={kh} H={h} dtype={a.dtype} "
        f"window={window} docs={a.docs} iters={iters}")
  if on_cpu:
    print("CPU: interpret mode, tiny shapes -- these figures only prove that it runs.")
  for label, wrap, flops, nbytes in cases:
    secs = {name: median_seconds(wrap(fn), (q, k, v, seg), iters) for name, fn in fns.items()}
    for name, s in secs.items():
      print(f"{label:8s} {name:6s} {s * 1e3:10.3f} ms  {flops / s / 1e12:8.3f} TFLOP/s  "
            f"{nbytes / s / 1e9:8.2f} GB/s")
    print(f"{label:8s} xla/pallas time ratio: {secs['xla'] / secs['pallas']:.2f}x")


if __name__ == "__main__":
  main()
