"""The run config of an imported Hugging Face checkpoint: the architecture from
`HF_DIR/config.json`, the training settings from a config file.

As in MaxText and torchtitan, the checkpoint's architecture wins: `apply_hf_model` writes
every architecture field of `HF_DIR/config.json` into the config's `model` group (and
skip_mode "zero", transformers' semantics, unless set on the command line), and returns the
fields where the config file said otherwise, for one log line. A `--config.model.*` override
given explicitly on the command line that disagrees with config.json is an error naming every
such field. Compute-only fields (`COMPUTE_ONLY_MODEL_FIELDS`: dtype, remat, impls, scan) and
`router_init` come from the config.

`hf_tokenizer_file` is `HF_DIR/tokenizer.json` when there is one; `render_config_py` writes
a ConfigDict as a config file that `launch.train --config=` reads back unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import pprint
from collections.abc import Collection

import ml_collections

from zaya_jax.config import COMPUTE_ONLY_MODEL_FIELDS
from zaya_jax.hf.hf_config import ConvertError, read_hf_config
from zaya_jax.model import ModelConfig

# ModelConfig fields that config.json determines (the rest: compute-only, skip_mode, router_init).
ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                            if f.name not in COMPUTE_ONLY_MODEL_FIELDS
                            and f.name not in ("skip_mode", "router_init"))


def _same(a, b) -> bool:
  norm = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731 (ConfigDict/JSON lists)
  return norm(a) == norm(b)


def _short(v) -> str:
  """repr, with a long run of one value written as `('hybrid',) * 40`."""
  if isinstance(v, (tuple, list)) and len(v) > 4 and len(set(v)) == 1:
    return f"({v[0]!r},) * {len(v)}"
  return repr(tuple(v) if isinstance(v, list) else v)


def apply_hf_model(config: ml_collections.ConfigDict, hf_dir: str,
                   explicit: Collection[str] = ()) -> list[str]:
  """Sets `config.model` (in place) to the architecture of `hf_dir/config.json`.

  Args:
    config: a run ConfigDict (configs/*.py after overrides); may be locked.
    hf_dir: a transformers save_pretrained directory.
    explicit: the `model.<field>` paths set explicitly on the command line
      (`config_flags.get_override_values`), which must agree with config.json.
  Returns:
    `field: config value -> config.json value` for every field that was replaced (empty when
    the config already described the checkpoint).
  Raises:
    ConvertError: no such `hf_dir` or config.json (see `read_hf_config`), or explicit model
      overrides that disagree with config.json (all named in one line).
  """
  hf = read_hf_config(hf_dir)
  model = config.model
  replaced = [(name, model.get(name), getattr(hf, name)) for name in ARCHITECTURE_FIELDS
              if not _same(model.get(name), getattr(hf, name))]
  conflicts = [f"--config.model.{n}={_short(have)} vs {_short(want)}" for n, have, want in replaced
               if f"model.{n}" in explicit]
  if conflicts:
    raise ConvertError(
        f"{len(conflicts)} explicit model override(s) disagree with {hf_dir}/config.json, "
        f"whose architecture the checkpoint's tensors fix: {'; '.join(conflicts)}; drop them "
        "(the model comes from config.json; compute-only fields such as dtype or remat may "
        "be set)")
  if "model.skip_mode" not in explicit and model.get("skip_mode") != hf.skip_mode:
    replaced.append(("skip_mode", model.get("skip_mode"), hf.skip_mode))
  with config.unlocked():
    for name, _, want in replaced:
      model[name] = want
  return [f"{n} {_short(have)} -> {_short(want)}" for n, have, want in replaced]


def hf_tokenizer_file(hf_dir: str) -> str | None:
  """`hf_dir/tokenizer.json` if it exists, else None."""
  path = os.path.join(hf_dir, "tokenizer.json")
  return path if os.path.isfile(path) else None


def render_config_py(config: ml_collections.ConfigDict, header: str) -> str:
  """Python source of a config file whose `get_config()` returns `config` (group by group,
  one field a line; None fields keep their type as a FieldReference so that
  `--config.group.field=...` still parses). `header` becomes the module docstring."""
  lines = [f'"""{header}"""', "", "import ml_collections", "", "",
           "def get_config():", '  """The run config (see the module docstring)."""',
           "  config = ml_collections.ConfigDict()"]
  for group in config.keys():
    lines.append(f"  g = config.{group} = ml_collections.ConfigDict()")
    values = config[group]
    for name in values.keys():
      value = values[name]
      if value is None:
        kind = values.get_type(name)
        text = (f"ml_collections.FieldReference(None, field_type={kind.__name__})"
                if kind in (int, float, str, bool, tuple) else "None")
      elif isinstance(value, tuple) and values.get_type(name) is tuple and not value:
        text = "ml_collections.FieldReference((), field_type=tuple)"
      else:
        text = pprint.pformat(tuple(value) if isinstance(value, list) else value, width=90)
      lines.append(f"  g.{name} = {text}")
  lines.append("  return config")
  return "\n".join(lines) + "\n"
