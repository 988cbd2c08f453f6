"""The op profile (zaya_jax/perf/op_profile.py): each HLO op of a compiled function is traced
and attributed to the function of this file that wrote it (a fusion to its root op's)."""

import jax
import jax.numpy as jnp
import pytest

from zaya_jax.perf import op_profile


def _small_product(x):
  return x @ x.T


def _large_product(y):
  return jnp.tanh(y @ y.T)


@jax.jit
def _two_products(x, y):
  return _small_product(x), _large_product(y)


def _args():
  return (jnp.ones((8, 16), jnp.float32), jnp.ones((256, 512), jnp.float32))


def test_ops_are_attributed_to_the_functions_that_wrote_them():
  sources = op_profile.hlo_op_sources(_two_products.lower(*_args()).compile().as_text(), "tests")
  by_source = {}
  for name, src in sources.items():
    by_source.setdefault(src.source, []).append(src.op_name)
  here = "perf/test_op_profile.py:"
  assert any("dot_general" in op for op in by_source[here + "_small_product"]), by_source
  assert any("dot_general" in op for op in by_source[here + "_large_product"]), by_source
  assert any("tanh" in op for op in by_source[here + "_large_product"]), by_source


def test_profile_sums_the_traced_op_times_per_source():
  args = _args()
  jax.block_until_ready(_two_products(*args))
  r = op_profile.op_profile(_two_products, args, steps=3, package="tests")
  assert r["steps"] == 3 and r["op_seconds"] > 0
  sources = {s for s, _, _ in r["by_source"]}
  assert "perf/test_op_profile.py:_large_product" in sources, r["by_source"]
  assert sum(share for _, _, share in r["by_source"]) == pytest.approx(1.0)
  assert sum(t for _, t, _ in r["by_source"]) == pytest.approx(r["op_seconds"])
  assert sum(t for *_, t, _ in r["by_op"]) == pytest.approx(r["op_seconds"])
  # Every profiled op ran a whole number of times per step.
  assert all(abs(runs * 3 - round(runs * 3)) < 1e-9 and runs > 0 for *_, runs in r["by_op"])
  text = op_profile.format_profile(r)
  assert "by source" in text and "_large_product" in text
  with pytest.raises(ValueError, match="steps=0"):
    op_profile.op_profile(_two_products, args, steps=0)
