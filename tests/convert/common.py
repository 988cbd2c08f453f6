"""Helpers shared by the conversion tests (not a test module): the HF twin of the tiny
training architecture, the launch flags that pair with it, a CLI runner, and readers of an
export directory."""

import os
import subprocess
import sys

import torch

from tests.helpers import MODEL_OVERRIDES, cache_env
from zaya_jax.hf.import_hf import SafetensorsReader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The HF twin of tests/helpers.py (MODEL_OVERRIDES) (vocab 320 as configs/zaya1_tiny.py, byte-tokenizer ids).
HF_ARCH = dict(vocab_size=320, hidden_size=32, num_hidden_layers=2,
               layer_types=["hybrid", "hybrid_sliding"], sliding_window=8, num_attention_heads=2,
               num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
               router_hidden_size=16, attention_bias=True, lm_head_bias=True,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIG = ["--config=configs/zaya1_tiny.py", *MODEL_OVERRIDES, "--config.model.attention_bias=True",
          "--config.model.lm_head_bias=True", "--config.model.skip_mode=zero"]


def cli(module, *args, cache_dir, check=True):
  """Runs `python -m module args` from the repo root on CPU; returns (exit code, output)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **cache_env(cache_dir)}
  proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
  if check:
    assert proc.returncode == 0, proc.stdout[-4000:]
  return proc.returncode, proc.stdout


def reference_state(hf):
  """The HF state dict as float32 numpy, without the tied lm_head.weight."""
  return {k: v.detach().float().numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}


def read_export(path):
  """Every tensor of an export directory (single file or shards), as float32 numpy."""
  reader = SafetensorsReader(str(path))
  return {k: reader.get(k) for k in reader.keys()}


def restore_skip_biases(model, path):
  """Undoes transformers' reset of the skip balancing bias on load (transformers 5.23
  `from_pretrained` sets every router's `balancing_biases[-1]` to -1; see test_hf_roundtrip.py)."""
  saved = read_export(path)
  with torch.no_grad():
    for i, layer in enumerate(model.model.layers):
      layer.mlp.gate.balancing_biases.copy_(
          torch.from_numpy(saved[f"model.layers.{i}.mlp.gate.balancing_biases"]))
