"""The `--config=FILE` flag of the entry points: a file that cannot be loaded is one line.

ml_collections' `DEFINE_config_file` defers a load failure: the flag parses, and the first
use of the config (or a `--config.*` override) raises an OSError chained to the load error,
through ml_collections and absl (42 lines for `--config=configs/nope.py`). `parse_flags`
checks the path first and exits with one line naming the flag and the fix.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from absl import app


def config_flag_value(argv: Sequence[str], name: str = "config") -> str | None:
  """The value of `--name=VALUE` / `--name VALUE` (one or two dashes) in argv, the last one
  given (absl's rule), or None when absent."""
  value = None
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg == "--":
      break
    for dashes in ("--", "-"):
      if arg.startswith(f"{dashes}{name}="):
        value = arg[len(dashes) + len(name) + 1:]
      elif arg == f"{dashes}{name}" and i + 1 < len(args):
        value = args[i + 1]
  return value


def config_file_problem(argv: Sequence[str], name: str = "config") -> str | None:
  """Why the `--name` config file of argv cannot be loaded, as one line; None if it can (or
  the flag is absent: its default, or its being required, is absl's business).

  The file is the part before the first ':' (ml_collections passes the rest to
  `get_config`). Relative paths are resolved against the current directory.
  """
  value = config_flag_value(argv, name)
  if value is None:
    return None
  path = value.split(":", 1)[0]
  where = (f"relative paths start at the current directory, {os.getcwd()}"
           if not os.path.isabs(path) else "an absolute path")
  if not path:
    return f"--{name}= is empty; give a config file, e.g. --{name}=configs/zaya1_tiny.py"
  if os.path.isdir(path):
    return (f"--{name}={value}: {path} is a directory, not a config file; give a .py file "
            f"with get_config(), e.g. --{name}=configs/zaya1_tiny.py")
  if not os.path.isfile(path):
    return (f"--{name}={value}: no such file ({where}); give an existing config file, e.g. "
            f"--{name}=configs/zaya1_tiny.py")
  if not os.access(path, os.R_OK):
    return f"--{name}={value}: {path} is not readable; check its permissions"
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """`absl.app`'s default flag parsing (usage on a bad flag), after `config_file_problem`:
  pass as `app.run(main, flags_parser=parse_flags)`. Exits with `invalid flags: ...` (one
  line, status 1) if the --config file cannot be loaded."""
  problem = config_file_problem(argv)
  if problem:
    sys.exit(f"invalid flags: {problem}")
  return app.parse_flags_with_usage(argv)
