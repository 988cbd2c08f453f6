"""One log filter for every entry point: third-party INFO noise off, our lines and real warnings on.

`quiet_third_party()` installs `ThirdPartyFilter` on absl's handler (the one `app.run` puts
on the root logger, so it sees Python `logging` records of JAX, Orbax and Grain as well as
absl records). It drops
- INFO/DEBUG records logged from the source files of JAX, jaxlib, Orbax, Grain and optax
  (JAX's "Unable to initialize backend 'tpu'" platform probe, Orbax's ~40 lines per restore or
  save, optax's "A polynomial schedule was set with a non-positive `transition_steps` value");
- the few known-harmless warnings in `HARMLESS_WARNINGS` (Orbax's "Given directory is read
  only" when we open a checkpoint read-only on purpose).
Everything else passes: our own INFO lines (with absl's `I1201 15:54:08.46 ... file.py:12]`
prefix) and every other third-party WARNING or ERROR.

This module imports nothing of ours and no third-party package except absl (it locates the
noisy packages with `importlib.util.find_spec`, which does not import them), so it can be
called first thing, before JAX initialises its backends.
"""

from __future__ import annotations

import importlib.util
import logging as std_logging
import os

from absl import logging

# Top-level packages whose INFO/DEBUG records are dropped.
NOISY_PACKAGES = ("jax", "jaxlib", "orbax", "grain", "optax")
# Substrings of WARNING messages that are dropped although their level is WARNING.
HARMLESS_WARNINGS = ("Given directory is read only",)


def _package_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
  """The source directories of the installed top-level packages `names` (each ending in the
  path separator); a package that is not installed is skipped."""
  dirs = []
  for name in names:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    for location in (spec.submodule_search_locations or []) if spec else []:
      dirs.append(os.path.join(os.path.realpath(location), ""))
  return tuple(dirs)


class ThirdPartyFilter(std_logging.Filter):
  """A `logging.Filter`: False (drop) for a record below WARNING whose source file lies in
  one of `dirs`, and for a WARNING whose message contains one of `HARMLESS_WARNINGS`."""

  def __init__(self, dirs: tuple[str, ...] | None = None):
    super().__init__()
    self.dirs = _package_dirs(NOISY_PACKAGES) if dirs is None else dirs

  def _third_party(self, record: std_logging.LogRecord) -> bool:
    path = os.path.realpath(record.pathname) if record.pathname else ""
    return any(path.startswith(d) for d in self.dirs)

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.WARNING:
      return not self._third_party(record)
    if record.levelno == std_logging.WARNING and self._third_party(record):
      message = record.getMessage()
      return not any(s in message for s in HARMLESS_WARNINGS)
    return True


def quiet_third_party() -> ThirdPartyFilter:
  """Installs one `ThirdPartyFilter` on absl's handler (idempotent) and returns it.

  Call it at import time of an entry point (before `app.run`, hence before JAX picks its
  backends): the filter sits on the handler object, which `app.run` later attaches to the
  root logger. Also lowers JAX's platform-probe logger to WARNING, for a program that
  logs through Python's own handlers instead of absl's.
  """
  handler = logging.get_absl_handler()
  for f in handler.filters:
    if isinstance(f, ThirdPartyFilter):
      return f
  f = ThirdPartyFilter()
  handler.addFilter(f)
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  return f
