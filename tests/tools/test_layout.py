"""README's Layout block names every package, module and entry point (issue 23 item 7: it had
gone stale: the HF modules under convert/, about 20 modules and 3 console scripts missing).

The block is parsed into entries: a line whose first word ends in "/" or ".py", indented 0
(a top-level directory) or 2 (a package or module of zaya_jax), with the more indented lines
under it. A module counts as named when its name is a word of its package's entry.
"""

from __future__ import annotations

import ast
import os
import re
import tomllib

from tests.helpers import REPO

TOP = ("configs", "launch", "zaya_jax", "pallas_kernels", "tests")


def _readme() -> str:
  with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
    return f.read()


def layout_entries(readme: str) -> dict[str, str]:
  """{"configs/": text, "zaya_jax/": text, "zaya_jax/data/": text, "zaya_jax/logs.py": ...}
  of the fenced block under "## Layout"; an entry's text includes its continuation lines."""
  block = readme.split("## Layout\n", 1)[1].split("```\n", 2)[1]
  entries: dict[str, str] = {}
  top, key = None, None
  for line in block.splitlines():
    m = re.match(r"^( {0,2})(\S+(?:/|\.py))(?:\s|$)", line)
    if m and (len(m.group(1)) == 0 or top == "zaya_jax/"):
      name = m.group(2)
      if not m.group(1):
        top = key = name
      else:
        key = top + name
      entries[key] = line[m.end():]
    elif key is not None:
      entries[key] += " " + line.strip()
  return entries


def _modules(directory: str) -> list[str]:
  return sorted(n[:-3] for n in os.listdir(os.path.join(REPO, directory))
                if n.endswith(".py") and n != "__init__.py")


def _packages(directory: str) -> list[str]:
  return sorted(n for n in os.listdir(os.path.join(REPO, directory))
                if os.path.isfile(os.path.join(REPO, directory, n, "__init__.py")))


def _named(word: str, text: str) -> bool:
  return re.search(rf"(?<![\w/]){re.escape(word)}(?:\.py)?(?![\w])", text) is not None


def test_layout_names_every_package_and_module():
  entries = layout_entries(_readme())
  missing = [f"{d}/" for d in TOP if f"{d}/" not in entries]
  for package in _packages("zaya_jax"):
    key = f"zaya_jax/{package}/"
    if key not in entries:
      missing.append(key)
      continue
    missing += [f"{key}{m}.py" for m in _modules(f"zaya_jax/{package}")
                if not _named(m, entries[key])]
  missing += [f"zaya_jax/{m}.py" for m in _modules("zaya_jax") if f"zaya_jax/{m}.py" not in entries]
  kernels = entries.get("pallas_kernels/", "")
  missing += [f"pallas_kernels/{p}/" for p in _packages("pallas_kernels")
              if not _named(p + "/", kernels) and not _named(p, kernels)]
  missing += [f"pallas_kernels/{p}/{m}.py" for p in _packages("pallas_kernels")
              for m in _modules(f"pallas_kernels/{p}") if not _named(m, kernels)]
  missing += [f"pallas_kernels/{m}.py" for m in _modules("pallas_kernels")
              if not _named(m, kernels)]
  missing += [f"configs/{m}.py" for m in _modules("configs")
              if not _named(m, entries.get("configs/", ""))]
  missing += [f"tests/{p}/" for p in sorted(os.listdir(os.path.join(REPO, "tests")))
              if os.path.isdir(os.path.join(REPO, "tests", p)) and not p.startswith("__")
              and not _named(p + "/", entries.get("tests/", "")) and not _named(p, entries.get("tests/", ""))]
  assert not missing, f"README's Layout block does not name: {missing}"
  # What it names exists (a stale entry is as wrong as a missing one).
  stale = [k for k in entries if not os.path.exists(os.path.join(REPO, k))]
  assert not stale, f"README's Layout block names what does not exist: {stale}"


def test_layout_names_every_entry_point_and_console_script():
  """Every launch module is named in the launch/ entry, which says each is the console script
  zaya-<name with "_" -> "-">: pyproject.toml's scripts are exactly those."""
  launch = layout_entries(_readme())["launch/"]
  modules = _modules("launch")
  assert [m for m in modules if not _named(m, launch)] == []
  assert "console script zaya-<name>" in launch
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    scripts = tomllib.load(f)["project"]["scripts"]
  assert scripts == {f"zaya-{m.replace('_', '-')}": f"launch.{m}:run_main" for m in modules}
  # The install section lists them all too.
  install = _readme().split("## Install as a package", 1)[1].split("\n## ", 1)[0]
  assert [s for s in scripts if f"`{s}`" not in install] == []


def test_readme_and_convert_from_hf_help_agree_on_the_import_memory():
  """README said 3.0x the float32 parameters, --help (the launcher's docstring, read without
  importing it: its absl flags would clash with other launchers') about 2x."""
  with open(os.path.join(REPO, "launch", "convert_from_hf.py"), encoding="utf-8") as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  pattern = r"peak is about (\d+(?:\.\d+)?)x the float32 parameter bytes"
  readme = re.findall(pattern, " ".join(_readme().split()))
  helped = re.findall(pattern, " ".join(doc.split()))
  assert readme and readme == helped, (readme, helped)
