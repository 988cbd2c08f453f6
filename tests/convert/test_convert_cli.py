"""Conversion as a user meets it: `convert_from_hf` with only `--hf_dir`, the model config
and tokenizer taken from the HF directory, and `convert_to_hf` writing what
`transformers.AutoTokenizer` loads.

The HF directory is written with `zaya_jax.hf.save_pretrained` from a tiny random model whose
config differs from configs/base.py in many fields (sizes, layer types, rope base, biases,
special ids pad 3 / bos 1 / eos 2), plus a WordLevel tokenizer.json built here with
`tokenizers` (<unk> 0, <bos> 1, <eos> 2, <pad> 3). One module-scoped fixture runs, in
subprocesses: `convert_from_hf --hf_dir --workdir` (no --config), `launch.train
--config=DIR/config.py` for 2 steps, `launch.generate --workdir`, `convert_to_hf`. The unit
tests (not slow) cover the config merge, the config file's round trip, the byte-level
tokenizer.json and the progress bar in-process.
"""

import dataclasses
import json
import os
import stat

import numpy as np
import pytest
import tokenizers
import transformers

from configs import base, zaya1_tiny
from tests.convert.common import cli, read_export
from tests.helpers import random_model, tiny_model_config
from zaya_jax.config import resolve
from zaya_jax.convert import ConvertError
from zaya_jax.convert.runs import training_settings
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from zaya_jax.hf import save_pretrained, to_hf_state_dict
from zaya_jax.hf.hf_tokenizer import byte_tokenizer_json, write_tokenizer_files
from zaya_jax.hf.run_config import ARCHITECTURE_FIELDS, apply_hf_model, render_config_py
from zaya_jax.model import ModelConfig

WORDS = "the of and to a in is it that was for on as with his he be at by".split()
SPECIALS = ["<unk>", "<bos>", "<eos>", "<pad>"]
TRAIN = ["--config.train.seq_len=32", "--config.train.batch_size=2", "--config.train.num_steps=2",
         "--config.train.warmup_steps=1", "--config.train.log_every=1",
         "--config.train.eval_batches=0"]


def hf_model_config() -> ModelConfig:
  """The tiny test model with ids and fields that configs/base.py does not have."""
  return dataclasses.replace(tiny_model_config(), vocab_size=64, pad_token_id=3, bos_token_id=1,
                             eos_token_id=2, attention_bias=True, skip_mode="zero",
                             rope_theta=20_000.0)


def write_hf_dir(path, progress=None) -> None:
  """save_pretrained of a random `hf_model_config()` model + a WordLevel tokenizer.json."""
  save_pretrained(random_model(hf_model_config(), seed=3), str(path), progress=progress)
  vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(SPECIALS)
  tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory, compile_cache_dir):
  """Runs import -> train 2 steps -> generate -> export once; returns the paths and outputs."""
  root = tmp_path_factory.mktemp("convert_cli")
  hf, run, out = (root / k for k in ("hf", "run", "export"))
  cache = compile_cache_dir  # the session's (tests/conftest.py)
  write_hf_dir(hf)
  _, import_out = cli("launch.convert_from_hf", f"--hf_dir={hf}", f"--workdir={run}", cache_dir=cache)
  from zaya_jax.checkpoint import find_run_checkpoint  # after the subprocess wrote step 0
  _, _, saved0 = find_run_checkpoint(str(run), 0)
  _, train_out = cli("launch.train", f"--config={run / 'config.py'}", f"--workdir={run}", *TRAIN,
                     cache_dir=cache)
  _, gen_out = cli("launch.generate", f"--workdir={run}", "--prompt=the of and",
                   "--max_new_tokens=3", cache_dir=cache)
  _, export_out = cli("launch.convert_to_hf", f"--workdir={run}", f"--out={out}", "--step=0",
                      "--dtype=float32", cache_dir=cache)
  return dict(hf=hf, run=run, out=out, cache=cache, saved0=saved0, import_out=import_out,
              train_out=train_out, gen_out=gen_out, export_out=export_out)


@pytest.mark.slow
def test_import_takes_model_and_tokenizer_from_hf_dir(converted):
  """Only --hf_dir: the checkpoint's model config is config.json's, data.tokenizer is a copy
  of HF_DIR/tokenizer.json, and the output is a handful of lines (no Orbax INFO)."""
  hf, run, saved = converted["hf"], converted["run"], converted["saved0"]
  with open(hf / "config.json") as f:
    want = ModelConfig.from_hf_dict(json.load(f))
  for name in ARCHITECTURE_FIELDS:
    got = saved["model"][name]
    assert (tuple(got) if isinstance(got, list) else got) == getattr(want, name), name
  assert saved["model"]["skip_mode"] == "zero"  # transformers' semantics, over base.py's
  assert saved["data"]["tokenizer"] == str(run / "tokenizer.json")
  assert (run / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
  assert saved["train"]["batch_size"] == base.get_config().train.batch_size  # from --config
  out = converted["import_out"]
  assert "the checkpoint's architecture wins over --config for 16 field(s)" in out, out
  assert "hidden_size 2048 -> 32" in out and "layer_types ('hybrid',) * 40 -> " in out, out
  assert f"train with: python -m launch.train --config={run / 'config.py'}" in out, out
  # Issue 23: base.py's ZAYA1-base settings were written silently (1M tokens per step).
  assert (f"training settings in {run / 'config.py'} are configs/base.py's (no --config given: "
          "ZAYA1-base's pre-training settings): 100000 steps of 256 x 4096 = 1,048,576 tokens, "
          "warm-up 2000, peak lr 0.0003 (cosine)") in out, out
  assert '"""Run config written by launch.convert_from_hf' in (run / "config.py").read_text()
  assert "the rest\nfrom configs/base.py (no --config given)." in (run / "config.py").read_text()
  lines = out.strip().splitlines()
  assert len(lines) <= 7, out
  assert not any("orbax" in l or "checkpoint_manager" in l or "Closing" in l for l in lines), out


@pytest.mark.slow
def test_imported_parameters_are_the_hf_tensors(converted):
  """Step 0 holds exactly the HF tensors (balancing biases included)."""
  import jax  # pylint: disable=import-outside-toplevel
  from zaya_jax.convert import runs  # pylint: disable=import-outside-toplevel

  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  model, _, step = runs.load_run_model(str(converted["run"]), 0, cpu)
  assert step == 0
  got, want = to_hf_state_dict(model), read_export(converted["hf"])
  assert set(got) == set(want)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.slow
def test_imported_run_trains_and_generates(converted):
  """launch.train --config=DIR/config.py continues from step 0; launch.generate reads it
  without Orbax INFO lines."""
  train_out, gen_out = converted["train_out"], converted["gen_out"]
  assert "Resuming at step 0/2" in train_out and "step 2/2" in train_out, train_out[-3000:]
  assert f"[{converted['run']} step 2]" in gen_out, gen_out[-2000:]
  assert "Closing" not in gen_out and "checkpoint.py" not in gen_out, gen_out[-3000:]


@pytest.mark.slow
def test_export_loads_in_auto_tokenizer_with_the_runs_ids(converted):
  """AutoTokenizer on the export: the run's special tokens and ids, the same encoding; every
  file has the mode a new file gets under this umask (0644 under 022)."""
  out, run = converted["out"], converted["run"]
  assert "tokenizer files" in converted["export_out"], converted["export_out"][-2000:]
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  ours = HFTokenizer(str(run / "tokenizer.json"))
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == tuple(SPECIALS[1:] + SPECIALS[:1])
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 3)
  text = "the of and zebra to a"
  ids = ours.encode(text)
  assert ids == [4, 5, 6, 0, 7, 8]
  assert tok.encode(text, add_special_tokens=False) == ids
  assert tok.decode(ids, skip_special_tokens=True) == ours.decode(ids)
  umask = os.umask(0)
  os.umask(umask)
  names = sorted(os.listdir(out))
  assert "model.safetensors" in names and "tokenizer_config.json" in names, names
  for name in names:
    assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~umask, name


@pytest.mark.slow
def test_explicit_model_overrides_that_disagree_are_one_error(converted, tmp_path):
  """--config.model.* overrides against config.json: exit 1, one line naming each field
  (not the compute-only dtype), nothing written."""
  hf, work = converted["hf"], tmp_path / "w"
  code, out = cli("launch.convert_from_hf", f"--hf_dir={hf}", f"--workdir={work}",
                  "--config=configs/zaya1_tiny.py", "--config.model.hidden_size=64",
                  "--config.model.num_experts=8", "--config.model.dtype=bfloat16",
                  cache_dir=converted["cache"], check=False)
  assert code != 0
  lines = out.strip().splitlines()
  assert len(lines) == 1, out
  assert f"2 explicit model override(s) disagree with {hf}/config.json" in lines[0], out
  assert "--config.model.hidden_size=64 vs 32" in lines[0] and "num_experts=8 vs 4" in lines[0]
  assert "dtype" not in lines[0].split("drop them")[0]
  assert not work.exists()


@pytest.mark.slow
def test_import_with_no_warm_up_prints_no_optax_line(tmp_path, compile_cache_dir):
  """Issue 23: optax's INFO line "A polynomial schedule was set with a non-positive
  `transition_steps` value ..." (a 0-step warm-up piece, as in every benchmark run) passed the
  third-party log filter; convert_from_hf builds the optimizer too, in seconds."""
  write_hf_dir(tmp_path / "hf")
  _, out = cli("launch.convert_from_hf", f"--hf_dir={tmp_path / 'hf'}",
               f"--workdir={tmp_path / 'run'}", "--config=configs/zaya1_tiny.py",
               "--config.train.warmup_steps=0", cache_dir=compile_cache_dir)
  assert "transition_steps" not in out and "_schedule.py" not in out, out
  assert "warm-up 0," in out and len(out.strip().splitlines()) <= 7, out


def test_apply_hf_model_merges_and_refuses(tmp_path):
  """Unit: the HF architecture replaces the config's; compute-only fields stay; an explicit
  disagreeing override is refused; one that agrees is accepted."""
  write_hf_dir(tmp_path)
  config = zaya1_tiny.get_config()
  config.model.remat = True
  replaced = apply_hf_model(config, str(tmp_path), explicit={"model.remat": True})
  assert "vocab_size 320 -> 64" in replaced and "pad_token_id 0 -> 3" in replaced, replaced
  assert config.model.remat is True and config.model.hidden_size == 32
  assert config.model.skip_mode == "zero"
  config = zaya1_tiny.get_config()
  config.model.num_layers = 3
  with pytest.raises(ConvertError, match=r"1 explicit .*--config.model.num_layers=3 vs 2"):
    apply_hf_model(config, str(tmp_path), explicit={"model.num_layers": 3})
  config.model.num_layers = 2
  apply_hf_model(config, str(tmp_path), explicit={"model.num_layers": 2,
                                                  "model.skip_mode": "scaled_identity"})
  assert config.model.skip_mode == "scaled_identity"  # explicit and not a config.json field


def test_training_settings_line_names_their_source():
  """Unit: the line convert_from_hf logs about the written config's training settings."""
  cfg = resolve(zaya1_tiny.get_config())
  given = training_settings(cfg, "/r/config.py", "configs/zaya1_tiny.py")
  assert given.startswith("training settings in /r/config.py come from "
                          "--config=configs/zaya1_tiny.py: 300 steps of 8 x 256 = 2,048 tokens, "
                          "warm-up 30, peak lr 0.003 (cosine), eval every 100, checkpoint every "
                          "100 steps; change them with --config=FILE"), given
  default = training_settings(cfg, "/r/config.py", None)
  assert "are configs/base.py's (no --config given" in default and "come from" not in default


def test_rendered_config_file_resolves_to_the_same_run():
  """Unit: config.py written from a ConfigDict gives it back, None fields keep their type."""
  config = zaya1_tiny.get_config()
  namespace = {}
  exec(render_config_py(config, "test"), namespace)  # pylint: disable=exec-used
  back = namespace["get_config"]()
  assert back.to_dict() == config.to_dict()
  assert back.balance.get_type("skip_target") is float  # --config.balance.skip_target=0.1 parses
  assert resolve(back) == resolve(config)


def test_byte_tokenizer_export_loads_in_auto_tokenizer(tmp_path):
  """Unit: a byte run's export gets a tokenizer.json that encodes and decodes as ByteTokenizer."""
  path = tmp_path / "tokenizer.json"
  byte_tokenizer_json(str(path))
  cfg = resolve(zaya1_tiny.get_config()).model
  write_tokenizer_files(str(path), str(tmp_path), cfg, model_max_length=256)
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  byte = ByteTokenizer()
  text = "def f(x):\n  return 'déjà vu' + \t日本\x00"
  assert tok.encode(text, add_special_tokens=False) == byte.encode(text)
  assert tok.decode(byte.encode(text)) == text
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
  assert tok.model_max_length == 256


def test_progress_bar_only_when_asked(tmp_path, capfd):
  """Unit: no progress output by default off a terminal (tests, logs), a bar when asked."""
  cfg = hf_model_config()
  save_pretrained(random_model(cfg, seed=1), str(tmp_path / "quiet"))
  assert capfd.readouterr().err == ""
  save_pretrained(random_model(cfg, seed=1), str(tmp_path / "bar"), progress=True)
  err = capfd.readouterr().err
  assert f"writing {tmp_path / 'bar'}" in err and "100%" in err, err


def test_tokenizer_that_does_not_fit_config_json_is_one_error(tmp_path):
  """Unit: HF_DIR/tokenizer.json whose eos id is not config.json's: a ConvertError that
  names the tokenizer and asks for another one (not for a model override it would refuse)."""
  from zaya_jax.convert import runs  # pylint: disable=import-outside-toplevel

  write_hf_dir(tmp_path / "hf")
  with open(tmp_path / "hf" / "config.json") as f:
    hf_config = json.load(f)
  hf_config["eos_token_id"] = 5
  with open(tmp_path / "hf" / "config.json", "w") as f:
    json.dump(hf_config, f)
  with pytest.raises(ConvertError, match=r"does not fit .*eos_token_id=5 but the tokenizer's "
                     r"eos_id is 2.*pass --config.data.tokenizer=PATH"):
    runs.new_run_from_hf(base.get_config(), str(tmp_path / "hf"), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()
