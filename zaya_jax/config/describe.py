"""Every config field with its value and its description, for `launch.train --print_config`.

The descriptions are the comments of the config source file (configs/base.py: "Every field
carries a comment with its unit"), read with `ast` and `tokenize`, so they are written once:
- a comment after the assignment, on its line(s): `m.hidden_size = 2048  # D, width of ...`;
- else the block of comment lines directly above it (`# Tokens a "hybrid_sliding" query ...`),
  section rulers (`# --- model: ...`) excluded.
Fields are recognised as `<alias>.<field> = ...` where `<alias> = config.<group> = ...` (or
`config.<group>.<field> = ...`).
"""

from __future__ import annotations

import ast
import io
import tokenize
from typing import Any

import ml_collections


def field_docs(source_path: str) -> dict[str, str]:
  """`{"group.field": description}` of the config file at `source_path` (module docstring).

  Raises:
    OSError: the file cannot be read. SyntaxError: it is not Python.
  """
  with open(source_path, encoding="utf-8") as f:
    source = f.read()
  comments: dict[int, str] = {}  # line -> comment text (without '#')
  code_lines: set[int] = set()  # lines that hold code
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      code_lines.update(range(tok.start[0], tok.end[0] + 1))
  aliases: dict[str, str] = {}  # local name -> group
  docs: dict[str, str] = {}
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Assign):
      continue
    names = [_dotted(t) for t in node.targets]
    for name in names:  # m = config.model = ConfigDict()
      if name and name.count(".") == 1 and name.startswith("config."):
        for other in names:
          if other and "." not in other:
            aliases[other] = name.split(".")[1]
    for name in names:
      key = _field_key(name, aliases)
      if key is None:
        continue
      trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
      if trailing:
        docs[key] = " ".join(trailing)
        continue
      above, line = [], node.lineno - 1
      while line in comments and line not in code_lines and not comments[line].startswith("---"):
        above.insert(0, comments[line])
        line -= 1
      if above:
        docs[key] = " ".join(above)
  return docs


def _dotted(node: ast.AST) -> str | None:
  """`a.b.c` for a Name/Attribute chain, else None."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.insert(0, node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    return ".".join([node.id, *parts])
  return None


def _field_key(name: str | None, aliases: dict[str, str]) -> str | None:
  if name is None:
    return None
  parts = name.split(".")
  if len(parts) == 2 and parts[0] in aliases:
    return f"{aliases[parts[0]]}.{parts[1]}"
  if len(parts) == 3 and parts[0] == "config":
    return f"{parts[1]}.{parts[2]}"
  return None


def format_value(value: Any) -> str:
  """`repr` of a config value; a tuple of more than 3 equal items as `('hybrid',) * 40`."""
  if isinstance(value, tuple) and len(value) > 3 and len(set(map(repr, value))) == 1:
    return f"({value[0]!r},) * {len(value)}"
  return repr(value)


def describe(config: ml_collections.ConfigDict, docs: dict[str, str],
             overrides: dict[str, Any] | None = None) -> str:
  """The listing: one `[group]` header per top-level group, then one line per field,
  `  group.field = value  # description`, with `(overridden)` after the value of each dotted
  name in `overrides` (the command line's `--config.*` flags). Fields without a comment get
  `# (no description)`. Groups and fields sorted by name; top-level non-group fields
  under `[top level]`.
  """
  flat = config.to_dict()
  overrides = overrides or {}
  lines: list[str] = []
  top = {k: v for k, v in flat.items() if not isinstance(v, dict)}
  groups = [(k, v) for k, v in flat.items() if isinstance(v, dict)]
  if top:
    groups.insert(0, ("", top))
  for group, fields in groups:
    lines.append(f"[{group or 'top level'}]")
    for field, value in fields.items():
      key = f"{group}.{field}" if group else field
      text = f"  {key} = {format_value(value)}"
      if key in overrides:
        text += "  (overridden)"
      lines.append(f"{text}  # {docs.get(key, '(no description)')}")
  return "\n".join(lines)
