"""Grouped matmul for the MoE experts (Pallas, Triton lowering): `gmm`, `tgmm`, SwiGLU experts.

`reference.py` defines the ops in jnp, `kernel.py` holds the `pallas_call`s, `ops.py` the
public differentiable ops, `bench.py` times them against `jax.lax.ragged_dot`.
"""

from pallas_kernels.gmm.ops import GmmBlockSizes, gmm, swiglu_experts_gmm, tgmm

__all__ = ["GmmBlockSizes", "gmm", "swiglu_experts_gmm", "tgmm"]
