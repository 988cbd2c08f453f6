"""The one convention of the kernel parity tests (gmm, routing, cca_attention).

A kernel's value-and-gradient tests live in a mixin class deriving `KernelParityTest` that
reads `self.interpret`; the test module then declares two classes from it:

    class TestGmmInterpret(InterpretTest, _GmmTests): ...   # Pallas interpret mode, CPU (CI)
    class TestGmmCompiled(CompiledTest, _GmmTests): ...     # the Triton kernels; GPU only

Both compare against the kernel's `reference.py` (gradients through `jax.vjp` of it) with
`tests.helpers.assert_close` and the tolerances each test states.
"""

from __future__ import annotations

import jax
import pytest

ON_GPU = jax.default_backend() in ("gpu", "cuda", "rocm")


class KernelParityTest:
  """Base of a kernel's parity tests; `interpret` is the kernels' `interpret=` argument."""

  interpret: bool


class InterpretTest(KernelParityTest):
  """Runs the kernels in the Pallas interpreter (any backend; CPU in CI)."""

  interpret = True


class CompiledTest(KernelParityTest):
  """Runs the compiled Triton kernels; skipped unless a GPU backend is present."""

  interpret = False

  @pytest.fixture(autouse=True)
  def _needs_gpu(self):
    if not ON_GPU:
      pytest.skip("compiled Triton kernels need a GPU (the Interpret class runs on CPU)")
