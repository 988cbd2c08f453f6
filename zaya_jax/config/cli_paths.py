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

import ml_collections
from absl import flags
from ml_collections import config_flags

# `define_config_file` defines the flag for its caller: the entry point's module keeps it as
# a key flag (listed by --help), as with ml_collections' own DEFINE_config_file.
flags.disclaim_key_flags()


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


def flagfile_problem(argv: Sequence[str], depth: int = 0) -> str | None:
  """Why a `--flagfile=FILE` in `argv` (or in a flag file it names) cannot be read, as one
  line (`--flagfile=/x: cannot read it: No such file or directory`), or None. absl reads
  flag files while parsing, and ml_collections' `DEFINE_config_file` already at import (so
  `parse_flags` cannot catch its error: a 33-line traceback); `define_config_file` and
  `parse_flags` check first."""
  args = list(argv[1:]) if depth == 0 else list(argv)
  for path in _flagfile_paths(args):
    if path is None:
      return "--flagfile needs a value, e.g. --flagfile=FLAGS.txt"
    try:
      lines = _read_flagfile(path)
    except (OSError, UnicodeDecodeError) as e:
      why = getattr(e, "strerror", None) or str(e)
      return f"--flagfile={path}: cannot read it: {why}; give a readable file of flags"
    if depth < _FLAGFILE_DEPTH:
      nested = flagfile_problem(lines, depth + 1)
      if nested:
        return nested
  return None


_FLAGFILE_DEPTH = 8  # flag files named inside flag files are read this many levels deep


def _flagfile_paths(args: Sequence[str]):
  """The FILE of each `--flagfile=FILE` or `--flagfile FILE` in `args`, in order; None for a
  last `--flagfile` with no value."""
  for i, arg in enumerate(args):
    name, eq, value = arg.partition("=")
    if name in ("--flagfile", "-flagfile"):
      yield value if eq else (args[i + 1] if i + 1 < len(args) else None)


def _read_flagfile(path: str) -> list[str]:
  """The flags in flag file `path`: its lines stripped, without blank lines and `#` comments.

  Raises:
    OSError, UnicodeDecodeError: the file cannot be read as UTF-8 text.
  """
  with open(path, encoding="utf-8") as f:
    return [s for s in (line.strip() for line in f) if s and not s.startswith("#")]


def define_config_file(name: str, default: str | None, help_string: str, **kwargs):
  """`ml_collections.config_flags.DEFINE_config_file`, after `flagfile_problem` on
  `sys.argv`: an unreadable --flagfile exits with one line (status 1) instead of the
  traceback ml_collections raises while defining the flag."""
  problem = flagfile_problem(sys.argv)
  if problem:
    sys.exit(f"invalid flags: {problem}")
  return config_flags.DEFINE_config_file(name, default, help_string, **kwargs)


# Kernel file systems where os.access says "writable" to root but nothing can be created.
_PSEUDO_FILE_SYSTEMS = ("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs",
                        "tracefs", "configfs", "pstore", "bpf", "efivarfs")


def _pseudo_file_system(directory: str) -> str | None:
  """The type of the kernel file system (`_PSEUDO_FILE_SYSTEMS`) holding `directory`, from
  /proc/self/mounts (the longest mount point above it); None elsewhere or if unreadable."""
  try:
    with open("/proc/self/mounts", encoding="utf-8") as f:
      mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
  except OSError:
    return None
  real = os.path.realpath(directory)
  best = ("", None)
  for point, fs_type in mounts:
    point = point.replace("\\040", " ")
    if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
      best = (point, fs_type)
  return best[1] if best[1] in _PSEUDO_FILE_SYSTEMS else None


def unwritable_dir_problem(path: str, flag: str, subdirs: Sequence[str] = ()) -> str | None:
  """Why directory `path` cannot be created or written, as one line naming `flag`; None if
  it can. Creates nothing.

  Checks the nearest existing directory of `path` (itself, or the ancestor it would be
  created in) and, when `path` exists, its existing `subdirs` (e.g. "checkpoints"): each must
  allow writing (`os.access`, which reports a read-only mount for root too), and none may lie
  on a kernel file system such as /proc or /sys, which `os.access` calls writable for root
  (`_pseudo_file_system`).
  """
  target = os.path.abspath(path)
  probe = target
  while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    if probe == target:
      return f"{flag}={path} exists and is not a directory; pass a directory path"
    return (f"{flag}={path}: {probe} is not a directory, so {target} cannot be created there; "
            "pass a directory path")
  if fs_type := _pseudo_file_system(probe):
    return (f"{flag}={path}: {probe} is on the kernel's {fs_type} file system, where nothing "
            "can be created; pass a directory you can write to")
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


def unwritable_file_problem(path: str, flag: str) -> str | None:
  """Why file `path` cannot be written, as one line naming `flag`; None if it can. Creates
  nothing: `path` must not be a directory, and its directory must exist, be a folder, lie off
  the kernel file systems and be writable (an output file's folder is not created;
  `unwritable_dir_problem` for folders)."""
  target = os.path.abspath(path)
  if os.path.isdir(target):
    return (f"{flag}={path} is a directory; pass a file path, e.g. "
            f"{flag}={os.path.join(path, 'out.json')}")
  parent = os.path.dirname(target)
  if os.path.lexists(parent) and not os.path.isdir(parent):
    return f"{flag}={path}: {parent} is not a folder; pass a path in a folder"
  if not os.path.isdir(parent):
    return f"{flag}={path}: the folder {parent} does not exist; create it or pass another path"
  if fs_type := _pseudo_file_system(parent):
    return (f"{flag}={path}: {parent} is on the kernel's {fs_type} file system, where nothing "
            "can be created; pass another path")
  if os.path.exists(target) and not os.access(target, os.W_OK):
    return f"{flag}={path}: the file is not writable by this user; pass another path"
  if not os.access(parent, os.W_OK | os.X_OK):
    return f"{flag}={path}: {parent} is not writable by this user; pass another path"
  return None


_HELP_FLAGS = ("--help", "-help", "--helpshort", "-helpshort", "--helpfull", "-helpfull",
               "--helpxml", "-helpxml", "-?", "--?")


def _example(values: flags.FlagValues | None, name: str, fallback: str) -> str:
  """A value to show after `e.g. --name=`: the flag's default when it has one, else
  `fallback` (a `--config.*` field, or a flag without a default)."""
  try:
    default = values[name].default if values is not None else None
  except KeyError:
    default = None
  if default is None or isinstance(default, bool) or default == "":
    return fallback
  if isinstance(default, (list, tuple)):
    return ",".join(map(str, default)) or fallback
  return str(default)


def _first_field(values: flags.FlagValues | None, name: str) -> str:
  """The first field of the config group `name` in the group's key order (`config.train`:
  "b1"), read from the parsed config in `values`; "FIELD" when it cannot be read."""
  root, *path = name.split(".")
  try:
    group = values[root].value
    for part in path:
      group = group[part]
    return next(iter(group.keys()))
  except Exception:  # noqa: BLE001 - only an example in an error message
    return "FIELD"


def flag_error(error: Exception, values: flags.FlagValues | None = None) -> str:
  """One line for a flag absl rejected, naming the flag, what it takes and an example (the
  flag's default in `values` when it has one; for a `--config.*` field, the config file's
  value):
    a value that does not parse: `--batches=abc: the value must be an integer, e.g.
      --batches=64` (also True or False, a number);
    a value out of bounds or not a choice: `--window=0: the value must be a positive integer,
      e.g. --window=16`, `--mode=c: the value must be one of a, bb, e.g. --mode=a`;
    a flag left without its value: `--window needs a value, e.g. --window=16`;
    a value for a whole config group: `--config.train=5: --config.train is a group of
      settings, not one value; set its fields, e.g. --config.train.b1=...`;
    a required flag left out: `--workdir is required, e.g. --workdir=...`;
    a --flagfile that cannot be read: `--flagfile: cannot read it: [Errno 2] ...`;
    a registered validator's "must ..." message: `--min_size=0: the value must be >= 1, e.g.
      --min_size=64`; a multi-flag validator's: `--min_size=500, --max_size=128: --min_size
      must be <= --max_size`;
  anything else (an unknown flag) is absl's message flattened, with `see --help`. Every line
  starts with `invalid flags: `."""
  text = " ".join(str(error).split())
  missing = re.match(r"flag (--[\w.]+)=None: Flag --[\w.]+ must have a value other than None", text)
  if missing:
    flag = missing.group(1)
    return f"invalid flags: {flag} is required, e.g. {flag}=... (see --help)"
  no_value = re.match(r"Missing value for flag (--?)([\w.]+)$", text)
  if no_value:
    flag = "--" + no_value.group(2)
    return (f"invalid flags: {flag} needs a value, e.g. "
            f"{flag}={_example(values, no_value.group(2), '...')}")
  flagfile = re.match(r"ERROR::? ?Unable to open flagfile: (.*)$", text)
  if flagfile:
    return f"invalid flags: --flagfile: cannot read it: {flagfile.group(1)}"
  loading = re.match(r"flag (--[\w.]+)=(.*?): Error whilst parsing config file: (.*)$", text)
  if loading:  # ml_collections' traceback of the config file's get_config, flattened
    flag, value, trace = loading.groups()
    raised = list(re.finditer(r"\b(\w+(?:Error|Exception)): ", trace))
    why = trace[raised[-1].start():] if raised else trace
    hint = ("; give get_config the arguments it takes (the part after ':')" if ":" in value
            and "positional argument" in why else "")
    return f"invalid flags: {flag}={value}: the config file failed to load: {why}{hint}"
  m = re.match(r"flag (--([\w.]+))=(.*?): (.*)$", text)
  if m:
    flag, name, value, why = m.groups()
    for needle, kind, example in (("Non-boolean", "True or False", "True"),
                                  ("int()", "an integer", "100"),
                                  ("to float", "a number", "3e-4")):
      if needle in why:
        if kind != "True or False":
          example = _example(values, name, example)
        return f"invalid flags: {flag}={value}: the value must be {kind}, e.g. {flag}={example}"
    bound = re.match(r".* is not (an? )?(.*)$", why)
    if bound and bound.group(2).rstrip(".") in ("dict", "ConfigDict"):  # a whole group
      return (f"invalid flags: {flag}={value}: {flag} is a group of settings, not one value; "
              f"set its fields, e.g. {flag}.{_first_field(values, name)}=...")
    if bound:
      what = bound.group(2)
      article = bound.group(1) or ("an " if what[:1] in "aeiou" else "a ")
      fallback = {"positive integer": "1", "non-negative integer": "0"}.get(what, "...")
      return (f"invalid flags: {flag}={value}: the value must be {article}{what}, e.g. "
              f"{flag}={_example(values, name, fallback)}")
    choice = re.match(r"value should be one of <(.*)>$", why)
    if choice:
      options = choice.group(1).split("|")
      return (f"invalid flags: {flag}={value}: the value must be one of "
              f"{', '.join(options)}, e.g. {flag}={_example(values, name, options[0])}")
    if why.startswith("must "):  # an entry point's register_validator message
      if value.startswith("[") and value.endswith("]"):  # a list flag's value, as typed
        value = ",".join(re.findall(r"'([^']*)'", value))
      return (f"invalid flags: {flag}={value}: the value {why}, e.g. "
              f"{flag}={_example(values, name, '...')}")
  multi = re.match(r"flags ([\w.]+=.*?): (--.*)$", text)  # a multi-flag validator
  if multi:
    given = ", ".join("--" + part for part in multi.group(1).split(", "))
    return f"invalid flags: {given}: {multi.group(2)}"
  return f"invalid flags: {text} (see --help)"


def _with_flagfile_lines(args: Sequence[str], depth: int = 0) -> list[str]:
  """`args` followed by the flags of the --flagfile=FILE among them (nested ones too; files
  that cannot be read are `flagfile_problem`'s business and add nothing)."""
  out = list(args)
  if depth >= _FLAGFILE_DEPTH:
    return out
  for path in _flagfile_paths(args):
    try:
      lines = _read_flagfile(path) if path is not None else []
    except (OSError, UnicodeDecodeError):
      continue
    out += _with_flagfile_lines(lines, depth + 1)
  return out


def override_error(argv: Sequence[str], error: Exception) -> str:
  """One line for a `--config.*` override that ml_collections' config_flags rejected with
  `error` (a KeyError / AttributeError naming the field, or a TypeError / ValueError).

  A misspelt field (ml_collections' `'\\'lrr\\' Did you mean "lr" instead of "lrr"?'`)
  becomes `invalid config override --config.train.lrr: no field 'lrr' in train; did you mean
  'lr'?`; a field with no close match `... no field 'nope' in train (launch.train
  --config=FILE --print_config lists the fields)`; any other message is flattened onto one
  line after `invalid config override: `. Overrides in a --flagfile are named as well.
  """
  text = str(error.args[0] if error.args else error).replace("\\'", "'").replace("\\n", " ")
  text = " ".join(text.split())
  key = re.search(r"'(\w+)'", text)
  hint = re.search(r'Did you mean "(\w+)"', text)
  if key:
    for arg in _with_flagfile_lines(argv[1:]):
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


def _known_flag(token: str, values: flags.FlagValues) -> bool:
  """Whether `token` is `--name[=value]` / `-name` of a flag in `values` (`--noname` too, and a
  config field override `--config.group.field=value`)."""
  if not token.startswith("-") or token in ("-", "--"):
    return False
  name = token.lstrip("-").split("=", 1)[0]
  return (name in values or (name.startswith("no") and name[2:] in values)
          or name.split(".", 1)[0] in values)


def flag_taken_as_value(argv: Sequence[str], values: flags.FlagValues) -> str | None:
  """One line when a flag given without `=` would take the next flag as its value (absl's
  `--name VALUE` form: `--out --steps=3` sets out to "--steps=3" and drops --steps), else
  None. A next token that is no known flag (`--lr -1`, `--prompt "-x"`) is a value."""
  args = list(argv[1:])
  for arg, nxt in zip(args, args[1:]):
    if arg == "--":
      break
    if "=" in arg or not arg.startswith("-") or not _known_flag(arg, values):
      continue
    name = arg.lstrip("-")
    if name not in values or values[name].boolean:  # --noname or a bool: takes no value
      continue
    if _known_flag(nxt, values):
      return (f"{arg} has no value (absl would take {nxt} as it); give one, e.g. "
              f"--{name}={_example(values, name, '...')}")
  return None


def _one_line(error: BaseException) -> str:
  """`Type: message` of `error` on one line (a SyntaxError with its file and line)."""
  text = " ".join(str(error).split())
  if isinstance(error, SyntaxError) and error.filename:
    text = f"{error.msg} ({error.filename}, line {error.lineno})"
  return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _raised_in_config_file(error: BaseException, path: str) -> bool:
  """Whether `error` was raised while running the file `path` (a frame of its traceback is
  in it, or it is a SyntaxError in it)."""
  target = os.path.realpath(path)
  if isinstance(error, SyntaxError) and error.filename:
    return os.path.realpath(error.filename) == target
  tb = error.__traceback__
  while tb is not None:
    if os.path.realpath(tb.tb_frame.f_code.co_filename) == target:
      return True
    tb = tb.tb_next
  return False


def config_load_error(argv: Sequence[str], error: BaseException, any_error: bool = False,
                      name: str = "config") -> str | None:
  """One line for an `error` raised while absl parsed argv and ml_collections ran the
  `--name` config file, or None when it is not the file's: e.g. `invalid flags:
  --config=my.py: the config file failed to load: RuntimeError: boom`, a SyntaxError with its
  line, an import the file makes that fails, or a file without `get_config` (`--config=my.py:
  the config file has no get_config(); define get_config() returning an
  ml_collections.ConfigDict`). With `any_error` an error not traced to the file is still
  named as the config's when a --config was given (nothing else user-written runs then)."""
  value = config_flag_value(argv, name)
  if value is None:
    return None
  path = value.split(":", 1)[0]
  if (isinstance(error, AttributeError) and "has no attribute 'get_config'" in str(error)):
    return (f"invalid flags: --{name}={value}: the config file has no get_config(); define "
            "get_config() returning an ml_collections.ConfigDict")
  if _raised_in_config_file(error, path) or any_error:
    return f"invalid flags: --{name}={value}: the config file failed to load: {_one_line(error)}"
  return None


def config_value_problem(argv: Sequence[str], values: flags.FlagValues | None = None,
                         name: str = "config") -> str | None:
  """Why the value the `--name` config file's get_config returned (in `values`, parsed;
  default absl's FLAGS) is no config, as one line (`--config=my.py: get_config() returned
  int, not an ml_collections.ConfigDict; return one`), or None (a ConfigDict, or no such
  flag given)."""
  values = flags.FLAGS if values is None else values
  if config_flag_value(argv, name) is None or name not in values:
    return None
  value = values[name].value
  if value is None or isinstance(value, (ml_collections.ConfigDict,
                                         ml_collections.FrozenConfigDict)):
    return None
  return (f"--{name}={config_flag_value(argv, name)}: get_config() returned "
          f"{type(value).__name__}, not an ml_collections.ConfigDict; return one")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for an entry point: pass as `app.run(main, flags_parser=parse_flags)`.
  Exits with one line, status 1, if the --config file cannot be loaded (`config_file_problem`;
  its own code raises, has no get_config or returns no ConfigDict: `config_load_error`,
  `config_value_problem`),
  absl rejects a flag (`flag_error`: an unknown flag, a value of the wrong type or out of
  bounds, a missing required flag, an unreadable --flagfile), ml_collections a `--config.*`
  override (`override_error`: a field that does not exist), a flag would take the next flag
  as its value (`flag_taken_as_value`) or a positional argument is left
  (the entry points take flags only), instead of absl's two-line `FATAL Flags parsing error`,
  its usage text or ml_collections' traceback. `--help` (absl prints the flags and exits 1)
  exits 0."""
  problem = (config_file_problem(argv) or flagfile_problem(argv)
             or flag_taken_as_value(argv, flags.FLAGS))
  if problem:
    sys.exit(f"invalid flags: {problem}")
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(flag_error(e, flags.FLAGS))
  except (KeyError, AttributeError, TypeError, ValueError) as e:  # raised by config_flags
    sys.exit(config_load_error(argv, e) or override_error(argv, e))
  except SystemExit as e:  # absl's help flags print the help, then exit 1
    if e.code == 1 and any(a.split("=", 1)[0] in _HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  except Exception as e:  # pylint: disable=broad-except
    # The config file's own code (import, get_config) is the only user code absl runs while
    # parsing; absl wraps only its ValueError / TypeError (`flag_error`'s "failed to load").
    sys.exit(config_load_error(argv, e, any_error=True) or f"invalid flags: {_one_line(e)}")
  if problem := config_value_problem(argv):
    sys.exit(f"invalid flags: {problem}")
  if len(rest) > 1:
    extra = " ".join(rest[1:])
    sys.exit(f"invalid arguments: {extra}: this command takes flags only, e.g. --name=value "
             "(see --help)")
  return rest
