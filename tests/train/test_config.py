"""Config validation: every bad value fails at start with the field's name and a fix."""

import os
import subprocess
import sys

import pytest

from configs import base, zaya1_base, zaya1_tiny
from zaya_jax.config import ConfigError, TrainConfig, resolve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_resolves():
  cfg = resolve(zaya1_tiny.get_config())
  assert cfg.model.vocab_size == 320 and cfg.model.num_layers == 4
  assert cfg.model.layer_types.count("hybrid_sliding") == 1
  assert cfg.to_dict()["model"]["layer_types"] == list(cfg.model.layer_types)


def test_base_model_group_matches_model_config_defaults():
  from zaya_jax.model import ModelConfig
  import dataclasses
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  assert dict(base.get_config().model) == defaults


def test_zaya1_base_needs_a_tokenizer():
  with pytest.raises(ConfigError, match="data.tokenizer"):
    resolve(zaya1_base.get_config())


@pytest.mark.parametrize("group,field,value,message", [
    ("model", "num_heads", 3, "model.num_heads"),
    ("model", "layer_types", ("hybrid", "bogus", "hybrid", "hybrid"), "model.layer_types"),
    ("model", "vocab_size", 200, "model.vocab_size=200 < tokenizer vocab 259"),
    ("model", "bos_token_id", 7, "model.bos_token_id=7"),
    ("model", "eos_token_id", 106, "model.eos_token_id=106"),
    ("model", "pad_token_id", 3, "model.pad_token_id=3"),
    ("data", "tokenizer", "/nonexistent/tokenizer.json", "data.tokenizer"),
    ("data", "eval_fraction", 1.5, "data.eval_fraction"),
    ("train", "num_steps", 0, "train.num_steps"),
    ("train", "batch_size", -1, "train.batch_size"),
    ("train", "seq_len", 0, "train.seq_len"),
    ("train", "lr", 0.0, "train.lr"),
    ("train", "min_lr_ratio", 2.0, "train.min_lr_ratio"),
    ("train", "b2", 1.0, "train.b2"),
    ("train", "log_every", 0, "train.log_every"),
    ("checkpoint", "max_to_keep", 0, "checkpoint.max_to_keep"),
])
def test_bad_values_name_the_field(group, field, value, message):
  config = zaya1_tiny.get_config()
  config[group][field] = value
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
    resolve(config)


def test_warmup_longer_than_the_run_is_clamped_with_one_warning(caplog):
  """Issue 23: zaya1_tiny with num_steps=20 stopped on its 30 warm-up steps. resolve clamps
  the warm-up to the longest the schedule allows and says so; TrainConfig itself still
  refuses such a warm-up (the invariant the schedules rely on)."""
  config = zaya1_tiny.get_config()
  config.train.num_steps = 20
  with caplog.at_level("WARNING"):
    train = resolve(config).train
  assert train.warmup_steps == 19 and train.num_steps == 20
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warnings == ["train.warmup_steps=30 does not fit train.num_steps=20: warming up over "
                      "19 steps (the warm-up is clamped to the run); set train.warmup_steps to "
                      "choose"], warnings
  config.train.num_steps, config.train.warmup_steps = 300, 301
  assert resolve(config).train.warmup_steps == 299
  config.train.schedule, config.train.decay_fraction = "wsd", 0.2  # 60 decay steps
  assert resolve(config).train.warmup_steps == 240
  config.train.schedule, config.train.schedule_steps = "cosine", 100
  assert resolve(config).train.warmup_steps == 99
  config.train.schedule_steps, config.train.warmup_steps = 0, 30
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert resolve(config).train.warmup_steps == 30  # fits: untouched, nothing said
  assert not [r for r in caplog.records if "warmup" in r.getMessage()]
  with pytest.raises(ConfigError, match=r"train\.warmup_steps=301 must be < train\.num_steps=300"):
    TrainConfig(num_steps=300, warmup_steps=301)


def test_unknown_field_is_named():
  config = zaya1_tiny.get_config()
  config.train.lrr = 1.0
  with pytest.raises(ConfigError, match=r"train\.lrr is not a field"):
    resolve(config)


def test_eval_needs_held_out_documents():
  config = zaya1_tiny.get_config()
  config.data.eval_fraction = 0.0
  with pytest.raises(ConfigError, match="train.eval_batches"):
    resolve(config)


def test_batch_must_split_over_processes():
  with pytest.raises(ConfigError, match="train.batch_size=8 is not divisible by the 3"):
    resolve(zaya1_tiny.get_config(), process_count=3)


@pytest.mark.slow
@pytest.mark.parametrize("flag,message", [
    ("--config.train.lrr=1e-3", "lrr"),  # typo: rejected by the locked ConfigDict
    ("--config.model.vocab_size=200", "model.vocab_size=200 < tokenizer vocab 259"),
    ("--config.model.num_kv_heads=3", "model.num_heads"),
])
def test_cli_rejects_bad_overrides(tmp_path, flag, message):
  proc = subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=configs/zaya1_tiny.py",
       f"--workdir={tmp_path}", flag],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-2000:]
  assert not os.path.exists(tmp_path / "checkpoints")


def test_synthetic_configs_skip_the_data_group_but_check_the_rest():
  """The tools that feed synthetic tokens read zaya1_base (no tokenizer on this machine),
  and still get resolve's errors for the groups they use."""
  from configs import zaya1_base
  from zaya_jax.config import synthetic_configs
  model, train, mesh, balance = synthetic_configs(zaya1_base.get_config())
  assert (model.num_experts, train.grad_accum_steps, mesh.fsdp, balance.mode) == (16, 1, -1, "quantile")
  config = zaya1_base.get_config()
  config.train.grad_accum_steps = 3  # 256 sequences do not split into 3 micro-batches
  with pytest.raises(ConfigError, match="train.grad_accum_steps"):
    synthetic_configs(config)
  config = zaya1_base.get_config()
  config.model.router_init = "xavier"
  with pytest.raises(ConfigError, match="model.router_init"):
    synthetic_configs(config)
