"""Unit tests of issue 16's tool fixes: the log filter, the config listing, the sharding text,
the eval-split advice, the heat map's balancing target and the packaging metadata."""

import logging as std_logging
import os
import tomllib

import numpy as np
import pytest
from packaging.requirements import Requirement

from zaya_jax import logs
from zaya_jax.checkpoint.reshape import describe_sharding
from zaya_jax.config import describe
from zaya_jax.data import DataConfig
from zaya_jax.data.pipeline import empty_split_message
from zaya_jax.perf.run_plots import balance_target, balance_target_text

from tests.helpers import REPO

BASE = os.path.join(REPO, "configs", "base.py")


def _record(pathname: str, level: int, msg: str) -> std_logging.LogRecord:
  return std_logging.LogRecord("absl", level, pathname, 1, msg, None, None)


def test_filter_drops_third_party_info_and_known_warnings_only():
  f = logs.ThirdPartyFilter(dirs=("/site/jax/", "/site/orbax/"))
  assert not f.filter(_record("/site/jax/_src/xla_bridge.py", std_logging.INFO,
                              "Unable to initialize backend 'tpu'"))
  assert not f.filter(_record("/site/orbax/checkpoint/x.py", std_logging.INFO, "Created handler"))
  assert not f.filter(_record("/site/orbax/checkpoint/checkpoint_manager.py", std_logging.WARNING,
                              "Given directory is read only=/w/checkpoints"))
  # Warnings that may matter, errors, and our own lines pass.
  assert f.filter(_record("/site/orbax/checkpoint/x.py", std_logging.WARNING, "disk almost full"))
  assert f.filter(_record("/site/orbax/checkpoint/x.py", std_logging.ERROR,
                          "Given directory is read only"))
  assert f.filter(_record(os.path.join(REPO, "zaya_jax", "train", "loop.py"), std_logging.INFO,
                          "step 10/300"))


def test_filter_finds_the_installed_packages_and_installs_once():
  dirs = logs.ThirdPartyFilter().dirs
  assert any(d.rstrip(os.sep).endswith(os.sep + "jax") for d in dirs), dirs
  assert any(os.sep + "orbax" in d for d in dirs), dirs
  # Issue 23: optax's INFO line about a 0-step schedule piece passed on every benchmark run.
  optax_dir = [d for d in dirs if d.rstrip(os.sep).endswith(os.sep + "optax")]
  assert optax_dir, dirs
  assert not logs.ThirdPartyFilter().filter(_record(
      os.path.join(optax_dir[0], "schedules", "_schedule.py"), std_logging.INFO,
      "A polynomial schedule was set with a non-positive `transition_steps` value"))
  # Our own packages are never filtered (the venv may live inside the repository).
  for ours in ("zaya_jax", "launch", "pallas_kernels", "configs"):
    assert not any(os.path.join(REPO, ours, "").startswith(d) for d in dirs), (ours, dirs)
  first = logs.quiet_third_party()
  assert logs.quiet_third_party() is first
  from absl import logging  # pylint: disable=import-outside-toplevel
  assert sum(isinstance(x, logs.ThirdPartyFilter) for x in logging.get_absl_handler().filters) == 1


def test_field_docs_reads_trailing_and_leading_comments():
  docs = describe.field_docs(BASE)
  assert docs["train.lr"] == "peak learning rate, reached at the end of warmup"
  assert docs["model.num_experts"].startswith("E, routed experts")
  # Comment block above the field (no trailing comment), section ruler excluded:
  assert docs["model.sliding_window"].startswith('Tokens a "hybrid_sliding" query sees')
  assert docs["balance.mode"].startswith('"quantile": every class\'s bias moves to the quantile')
  assert "---" not in docs["model.vocab_size"]


def test_describe_lists_every_field_with_value_override_and_doc():
  from configs import zaya1_tiny  # pylint: disable=import-outside-toplevel

  config = zaya1_tiny.get_config()
  config.train.lr = 0.5
  text = describe.describe(config, describe.field_docs(BASE), {"train.lr": 0.5})
  lines = text.splitlines()
  assert "  train.lr = 0.5  (overridden)  # peak learning rate, reached at the end of warmup" in lines
  assert "  model.num_experts = 8  # E, routed experts; the router has E+1 classes (last = skip)" in lines
  assert "[model]" in lines and "[balance]" in lines
  fields = [l for l in lines if l.startswith("  ")]
  flat = config.to_dict()
  assert len(fields) == sum(len(g) for g in flat.values())
  assert not [l for l in fields if "(no description)" in l]
  assert describe.format_value(("hybrid",) * 40) == "('hybrid',) * 40"
  assert describe.format_value(("a", "b")) == "('a', 'b')"


def test_describe_sharding_is_short():
  from orbax.checkpoint._src.metadata import sharding  # pylint: disable=import-outside-toplevel

  m = sharding.NamedShardingMetadata(shape=np.array([1, 2, 4]), axis_names=["data", "fsdp", "expert"],
                                     partition_spec=(None, "expert", ("data", "fsdp")))
  assert describe_sharding(m) == "mesh {data:1,fsdp:2,expert:4} P(None,'expert',('data','fsdp'))"
  assert describe_sharding(sharding.SingleDeviceShardingMetadata(device_str="cpu:0")) == "device cpu:0"
  assert describe_sharding(None) == "none"


def test_empty_eval_split_advice_depends_on_the_fraction():
  small = empty_split_message(DataConfig(source="a.jsonl", eval_fraction=0.02), "eval", 10)
  assert "set data.eval_fraction > 0" not in small
  assert "held out none of the 10 documents" in small and "expected about 0.2" in small
  assert "raise data.eval_fraction (e.g. 0.3)" in small and "train.eval_batches=0" in small
  zero = empty_split_message(DataConfig(source="a.jsonl", eval_fraction=0.0), "eval", 10)
  assert "set data.eval_fraction > 0" in zero and "train.eval_batches=0" in zero
  train = empty_split_message(DataConfig(source="a.jsonl", eval_fraction=0.9), "train", 3)
  assert "lower data.eval_fraction" in train


def test_heat_map_target_is_one_over_e_of_expert_routed_tokens():
  # 2 layers, 4 experts + skip; skip shares 0.2 and 0.0.
  load_LX = np.array([[0.2, 0.2, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25, 0.0]])
  assert balance_target(load_LX) == pytest.approx((0.8 / 4 + 1.0 / 4) / 2)
  text = balance_target_text(load_LX)
  assert text.startswith("target 1/E = 0.250 of expert-routed tokens") and "0.225 of all" in text


def test_pyproject_matches_the_requirements_files():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  assert project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == ["requirements.txt"]
  with open(os.path.join(REPO, "requirements.txt")) as f:
    runtime = [l.strip() for l in f if l.strip() and not l.strip().startswith("#")]
  names = {Requirement(l).name for l in runtime}  # every line parses (no inline comments)
  assert {"jax", "tensorboard", "tensorboardX"} <= names
  with open(os.path.join(REPO, "requirements-test.txt")) as f:
    test = [l.strip() for l in f if l.strip() and not l.strip().startswith(("#", "-r"))]
  assert project["project"]["optional-dependencies"]["test"] == test
  entry_points = sorted(n[:-3] for n in os.listdir(os.path.join(REPO, "launch"))
                        if n.endswith(".py") and n != "__init__.py")
  assert sorted(t.split(":")[0][len("launch."):] for t in project["project"]["scripts"].values()) \
      == entry_points
  for name, target in project["project"]["scripts"].items():
    module, func = target.split(":")
    assert func == "run_main" and os.path.isfile(os.path.join(REPO, *module.split(".")) + ".py"), name
    with open(os.path.join(REPO, *module.split(".")) + ".py") as f:
      source = f.read()
    assert "def run_main():" in source and "quiet_third_party()" in source, module
