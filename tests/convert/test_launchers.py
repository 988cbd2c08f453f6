"""The conversion CLIs end to end: HF -> `launch.convert_from_hf` -> `launch.train` ->
`launch.convert_to_hf` -> `transformers.AutoModelForCausalLM.from_pretrained`.

One module-scoped fixture runs the chain once in subprocesses, on a random transformers
model (every tensor randomised, balancing biases set so every expert and the skip class win
some tokens) of the architecture that tests/helpers.py (MODEL_OVERRIDES) trains, with attention and
LM-head biases so the optional tensors travel too:
  1. `convert_from_hf` writes step 0 of a run (skip_mode "zero", as transformers);
  2. `convert_to_hf --step=0 --max_shard_size=50KB` exports it again, in several shards;
  3. `launch.train` resumes from step 0 and trains 3 steps;
  4. `convert_to_hf` exports the latest step (3) as one float32 file.
`launch.generate` then runs on the workdir's step 0 and on the HF directory (the same text).
Then: the step-0 export equals the source tensors bit for bit (so the import checkpoint holds
exactly the HF parameters and biases), and transformers loads the trained export with no
missing or unexpected keys and gives the logits of the step-3 checkpoint (<= 1e-4, after
undoing transformers 5.23's reset of the skip bias on load, see test_hf_roundtrip.py). Bad
inputs exit non-zero with a message that names the problem.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import nnx

from tests.convert.common import (CONFIG, HF_ARCH, cli, read_export, reference_state,
                                  restore_skip_biases)
from tests.model import hf_reference
from zaya_jax.checkpoint import restore_model_state
from zaya_jax.model import ModelConfig, ZayaForCausalLM
from zaya_jax.parallel.mesh import abstract_with_shardings

STEPS = 3
GENERATE = ["--prompt=def f(", "--max_new_tokens=6"]
TRAIN = ["--config.train.seq_len=32", "--config.train.batch_size=2",
         f"--config.train.num_steps={STEPS}", "--config.train.warmup_steps=1",
         "--config.train.log_every=1", "--config.train.eval_batches=0"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, compile_cache_dir):
  """Runs the whole chain once; returns a dict of the paths, the HF source and its input ids."""
  root = tmp_path_factory.mktemp("launchers")
  paths = {k: root / k for k in ("hf", "run", "step0", "trained")}
  paths["cache"] = compile_cache_dir  # the session's (tests/conftest.py)
  hf, ids = hf_reference.build(seed=7, **HF_ARCH)
  hf.save_pretrained(paths["hf"])
  cache = paths["cache"]
  _, import_out = cli("launch.convert_from_hf", f"--hf_dir={paths['hf']}",
                      f"--workdir={paths['run']}", *CONFIG, cache_dir=cache)
  assert "wrote" in import_out and os.path.isdir(paths["run"] / "checkpoints" / "0"), import_out[-2000:]
  cli("launch.convert_to_hf", f"--workdir={paths['run']}", "--step=0", f"--out={paths['step0']}",
      "--dtype=float32", "--max_shard_size=50KB", cache_dir=cache)
  _, train_out = cli("launch.train", f"--workdir={paths['run']}", *CONFIG, *TRAIN, cache_dir=cache)
  _, export_out = cli("launch.convert_to_hf", f"--workdir={paths['run']}",
                      f"--out={paths['trained']}", "--dtype=float32", cache_dir=cache)
  return dict(paths, hf_model=hf, ids=ids, import_out=import_out, train_out=train_out,
              export_out=export_out)


@pytest.mark.slow
def test_import_checkpoint_holds_the_hf_tensors(chain):
  """Step 0 exported in shards is the source checkpoint, tensor for tensor, bit for bit."""
  out = chain["step0"]
  shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
  assert len(shards) > 1, shards
  assert not (out / "model.safetensors").exists()
  with open(out / "model.safetensors.index.json") as f:
    index = json.load(f)
  want = reference_state(chain["hf_model"])
  assert set(index["weight_map"]) == set(want)
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
  got = read_export(out)
  assert set(got) == set(want)
  for k, v in want.items():  # balancing biases included: the import keeps the HF values
    np.testing.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.slow
def test_trained_export_matches_checkpoint_in_transformers(chain):
  """transformers loads the step-3 export cleanly and computes the checkpoint's logits."""
  assert f"Resuming at step 0/{STEPS}" in chain["train_out"], chain["train_out"][-3000:]
  assert f"from step {STEPS}" in chain["export_out"], chain["export_out"][-2000:]
  out = chain["trained"]
  assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()

  # Training moved the parameters (else this would only retest the import).
  trained, start = read_export(out), read_export(chain["step0"])
  for k in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.gate_up_proj"):
    assert np.abs(trained[k] - start[k]).max() > 1e-4, k

  back, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(out), output_loading_info=True, attn_implementation="eager")
  for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
    assert not info.get(k), f"{k}: {info[k]}"
  assert type(back).__name__ == "ZayaForCausalLM"
  back.eval()
  restore_skip_biases(back, out)

  ckpt_dir = str(chain["run"] / "checkpoints")
  manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=False))
  saved = manager.restore(STEPS, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
  manager.close()
  names = {f.name for f in dataclasses.fields(ModelConfig)}  # (launch.* defines absl flags)
  cfg = ModelConfig(**{k: tuple(v) if k == "layer_types" else v
                       for k, v in saved["model"].items() if k in names})
  assert cfg.skip_mode == "zero"
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  ours = nnx.merge(graphdef, restore_model_state(ckpt_dir, abstract_with_shardings(abstract, cpu), STEPS))

  ids = chain["ids"]
  with torch.no_grad():
    want = back(ids).logits.numpy()
  got = np.asarray(nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(ids.numpy())))
  diff = np.abs(got - want).max()
  assert diff <= 1e-4, diff
  assert np.abs(want).max() > 1.0  # not a trivially small output


@pytest.mark.slow
def test_generate_cli_on_the_run_and_on_the_hf_dir(chain):
  """launch.generate on the workdir's step 0 (the import) and on the HF directory itself: the
  same greedy text and a speed line. (Its bad paths are in the next test.)"""
  run, hf, cache = chain["run"], chain["hf"], chain["cache"]
  assert (f"training settings in {run / 'config.py'} come from "
          "--config=configs/zaya1_tiny.py: 300 steps of 8 x 256") in chain["import_out"], \
      chain["import_out"]
  _, run_out = cli("launch.generate", f"--workdir={run}", "--step=0", *GENERATE, cache_dir=cache)
  _, hf_out = cli("launch.generate", f"--hf_dir={hf}", "--tokenizer=byte", *GENERATE,
                  cache_dir=cache)
  text = lambda out: [l for l in out.splitlines() if l.startswith("def f(")]
  assert text(run_out) and text(run_out) == text(hf_out), (run_out[-2000:], hf_out[-2000:])
  assert "tokens/s" in run_out and "step 0" in run_out


@pytest.mark.slow
def test_bad_inputs_exit_with_a_message(chain, tmp_path):
  """Each bad input: a non-zero exit and a one-line reason naming it (no traceback)."""
  run, cache = chain["run"], chain["cache"]
  cases = [
      (("launch.convert_to_hf", f"--workdir={tmp_path / 'nope'}", f"--out={tmp_path / 'o1'}"),
       f"--workdir={tmp_path / 'nope'}: no such directory"),
      (("launch.convert_to_hf", f"--workdir={run}", "--step=7", f"--out={tmp_path / 'o2'}"),
       f"--step=7: no such checkpoint in {run}/checkpoints; it holds steps [0, {STEPS}]"),
      (("launch.generate", f"--workdir={tmp_path / 'nowhere'}", *GENERATE), "no such directory"),
      (("launch.generate", f"--workdir={run}", "--step=9", *GENERATE), "--step=9"),
      (("launch.convert_from_hf", f"--hf_dir={chain['hf']}", f"--workdir={tmp_path / 'w1'}",
        *CONFIG, "--config.model.num_experts=8"),
       "--config.model.num_experts=8 vs 4"),
      (("launch.convert_from_hf", f"--hf_dir={tmp_path / 'no_hf'}", f"--workdir={tmp_path / 'w2'}",
        *CONFIG),
       f"--hf_dir={tmp_path / 'no_hf'}: no such directory"),
      (("launch.convert_from_hf", f"--hf_dir={chain['hf']}", f"--workdir={run}", *CONFIG),
       f"{run}/checkpoints already holds checkpoint step {STEPS}; pass a fresh --workdir"),
  ]
  truncated = tmp_path / "truncated_hf"  # a download cut short (issue 14: a raw SafetensorError)
  truncated.mkdir()
  (truncated / "config.json").write_bytes((chain["hf"] / "config.json").read_bytes())
  head = (chain["hf"] / "model.safetensors").read_bytes()[:4096]
  (truncated / "model.safetensors").write_bytes(head)
  cases.append((("launch.convert_from_hf", f"--hf_dir={truncated}", f"--workdir={tmp_path / 'w3'}",
                 *CONFIG),
                f"{truncated}/model.safetensors: not a readable safetensors file"))
  a_file = tmp_path / "a_file"  # a --workdir under a file was a raw errno
  a_file.write_text("x")
  cases.append((("launch.convert_from_hf", f"--hf_dir={chain['hf']}", f"--workdir={a_file}/w",
                 *CONFIG),
                f"--workdir={a_file}/w: {a_file} is not a directory, so {a_file}/w cannot be "
                "created there; pass a directory path"))
  for (module, *args), message in cases:
    code, out = cli(module, *args, cache_dir=cache, check=False)
    assert code != 0, (module, args, out[-2000:])
    assert message in out, (message, out[-2000:])
    assert "Traceback" not in out, (module, args[:2], out[-3000:])
  assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
  assert not (tmp_path / "w1").exists()  # refused before anything was written
  assert not (tmp_path / "w3").exists()  # a failed import removes the folders it made
