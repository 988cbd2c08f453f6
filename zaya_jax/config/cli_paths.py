"""Paths given to the entry points: the `--config=FILE` flag and the directories they write.

ml_collections' `DEFINE_config_file` defers a load failure: the flag parses, and the first
use of the config (or a `--config.*` override) raises an OSError chained to the load error,
through ml_collections and absl (42 lines for `--config=configs/nope.py`). `parse_flags`
checks the path first and exits with one line naming the flag and the fix.

`unwritable_dir_problem` tells, before anything slow starts, why an output directory (e.g.
`--workdir`) cannot be written: a read-only mount, no permission, a file in the way. Without
it the first `os.makedirs` deep inside the run raised a 37-line traceback.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Sequence

from absl import flags


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


def unwritable_dir_problem(path: str, flag: str, subdirs: Sequence[str] = ()) -> str | None:
  """Why directory `path` cannot be created or written, as one line naming `flag`; None if
  it can. Creates nothing.

  Checks the nearest existing directory of `path` (itself, or the ancestor it would be
  created in) and, when `path` exists, its existing `subdirs` (e.g. "checkpoints"): each must
  allow writing (`os.access`, which reports a read-only mount for root too).
  """
  target = os.path.abspath(path)
  probe = target
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    return (f"{flag}={path}: {probe} is not a directory, so {target} cannot be created there; "
            "pass a directory path")
  checked = [probe] + [os.path.join(target, d) for d in subdirs
                       if probe == target and os.path.isdir(os.path.join(target, d))]
  for d in checked:
    if not os.access(d, os.W_OK | os.X_OK):
      try:
        read_only = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
      except OSError:
        read_only = False
      why = ("is on a read-only file system" if read_only else "is not writable by this user")
      where = (f"{flag}={path} cannot be created: {d} {why}" if d != target and d == probe
               else f"{flag}={path}: {d} {why}")
      return where + ("; pass a directory you can write to (or remount it read-write)"
                      if read_only else "; pass a directory you can write to")
  return None


def flag_error(error: Exception) -> str:
  """One line for a flag absl rejected: a `--flag=value` whose value does not parse says the
  type it needs (`--config.balance.quantile_reroute=maybe: the value must be True or False,
  e.g. ...=True`), a required flag left out says so (`--workdir is required, e.g.
  --workdir=...`); anything else is absl's message flattened, with `see --help`."""
  text = " ".join(str(error).split())
  missing = re.match(r"flag (--[\w.]+)=None: Flag --[\w.]+ must have a value other than None", text)
  if missing:
    flag = missing.group(1)
    return f"invalid flags: {flag} is required, e.g. {flag}=... (see --help)"
  m = re.match(r"flag (--[\w.]+)=(.*?): (.*)$", text)
  if m:
    flag, value, why = m.groups()
    for needle, kind, example in (("Non-boolean", "True or False", "True"),
                                  ("int()", "an integer", "100"),
                                  ("to float", "a number", "3e-4")):
      if needle in why:
        return f"invalid flags: {flag}={value}: the value must be {kind}, e.g. {flag}={example}"
  return f"invalid flags: {text} (see --help)"


def override_error(argv: Sequence[str], error: Exception) -> str:
  """One line for a `--config.*` override that ml_collections' config_flags rejected with
  `error` (a KeyError / AttributeError naming the field, or a TypeError / ValueError).

  A misspelt field (ml_collections' `'\\'lrr\\' Did you mean "lr" instead of "lrr"?'`)
  becomes `invalid config override --config.train.lrr: no field 'lrr' in train; did you mean
  'lr'?`; a field with no close match `... no field 'nope' in train (launch.train
  --config=FILE --print_config lists the fields)`; any other message is flattened onto one
  line after `invalid config override: `.
  """
  text = str(error.args[0] if error.args else error).replace("\\'", "'").replace("\\n", " ")
  text = " ".join(text.split())
  key = re.search(r"'(\w+)'", text)
  hint = re.search(r'Did you mean "(\w+)"', text)
  if key:
    for arg in argv[1:]:
      if not arg.startswith("--config."):
        continue
      path = arg[len("--config."):].split("=", 1)[0].split(".")
      if key.group(1) in path:
        parent = ".".join(path[:path.index(key.group(1))]) or "the config"
        where = (f"invalid config override --config.{'.'.join(path)}: no field "
                 f"'{key.group(1)}' in {parent}")
        if hint:
          return f"{where}; did you mean '{hint.group(1)}'?"
        return f"{where} (launch.train --config=FILE --print_config lists the fields)"
  return f"invalid config override: {text}"


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for an entry point: pass as `app.run(main, flags_parser=parse_flags)`.
  Exits with `invalid flags: ...` (one line, status 1) if the --config file cannot be loaded
  (`config_file_problem`), absl rejects a flag (`flag_error`: an unknown flag, a value of
  the wrong type, a missing required flag) or ml_collections a `--config.*` override
  (`override_error`: a field that does not exist), instead of absl's two-line `FATAL Flags
  parsing error` and usage hint or ml_collections' traceback."""
  problem = config_file_problem(argv)
  if problem:
    sys.exit(f"invalid flags: {problem}")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(flag_error(e))
  except (KeyError, AttributeError, TypeError, ValueError) as e:  # raised by config_flags
    sys.exit(override_error(argv, e))
