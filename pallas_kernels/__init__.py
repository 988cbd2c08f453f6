"""Pallas kernels for ZAYA1's hot paths, written for the Triton lowering (ROCm and CUDA).

One directory per kernel, each with `reference.py` (pure jnp, defines the op), `kernel.py`
(the `pallas_call`s), `ops.py` (the public op: argument checks, `jax.custom_vjp`, block
sizes in one dataclass) and `bench.py` (`python -m pallas_kernels.<name>.bench`). On CPU the
kernels run with `interpret=True` (tests only); see `common.py`.
"""
