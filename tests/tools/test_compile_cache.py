"""The suite's persistent compilation cache (tests/conftest.py) is on and hits on this jax.

The suite relies on it to compile each distinct program about once (issue 24); jax#38445
reports CPU cache entries rejected on reload in jax 0.9.1-0.10.1, so this checks that an entry
written by one compile is read back by the next compile of the same program, once JAX's
in-memory caches are cleared (what a new `jax.jit`, a new run or a subprocess sees).
"""

import os

import jax
import jax.numpy as jnp
import pytest
from jax import monitoring

_HITS = "/jax/compilation_cache/cache_hits"


@pytest.mark.skipif(os.environ.get("ZAYA_TEST_NO_COMPILE_CACHE") == "1",
                    reason="the session's compilation cache is off (ZAYA_TEST_NO_COMPILE_CACHE=1)")
def test_a_program_compiled_again_is_read_from_the_session_cache(compile_cache_dir):
  assert jax.config.jax_compilation_cache_dir == str(compile_cache_dir)
  assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(compile_cache_dir)  # for subprocesses
  events = []
  listener = lambda event, **kw: events.append(event)  # noqa: E731
  monitoring.register_event_listener(listener)

  def f(x):  # a program no other test compiles (its constant)
    return jnp.sin(x) * 1234.5678 + jnp.cumsum(x)

  x = jnp.arange(7.0)
  before = set(os.listdir(compile_cache_dir))
  want = jax.jit(f)(x)
  written = set(os.listdir(compile_cache_dir)) - before
  assert written, "the first compile wrote no cache entry"
  jax.clear_caches()
  hits = events.count(_HITS)
  got = jax.jit(f)(x)
  monitoring.unregister_event_listener(listener)
  assert events.count(_HITS) == hits + 1, "the second compile was not read from the cache"
  assert jnp.array_equal(got, want)
