"""Export a training run's checkpoint as a Hugging Face `ZayaForCausalLM` directory.

  python -m launch.convert_to_hf --workdir=/tmp/zaya_tiny --out=/tmp/zaya_tiny_hf \
      [--step=N] [--dtype=bfloat16|float32] [--max_shard_size=5GB]

Reads the run config saved with the checkpoint, restores only the `model` item onto one CPU
device, and writes config.json, generation_config.json and safetensors via
`zaya_jax.convert.hf.save_pretrained` (plus tokenizer.json when the run's data.tokenizer is a file).
Load it with `transformers.ZayaForCausalLM.from_pretrained(out)`. Caveats (warned about):
transformers zeroes skipped tokens (skip_mode "zero"), and transformers 5.23 resets each
router's skip balancing bias to -1 on load. A missing --workdir or --step, or an unreadable
checkpoint, exits non-zero with one line naming it (and the steps that exist).
"""

import os
import re
import sys

import jax
from absl import app, flags, logging
from flax import nnx

from zaya_jax.checkpoint import find_run_checkpoint, restore_model_state, saved_model_config
from zaya_jax.convert.hf import save_pretrained
from zaya_jax.model import ZayaForCausalLM
from zaya_jax.parallel.mesh import abstract_with_shardings

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (holds checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Output directory for the Hugging Face files.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Storage dtype.")
_MAX_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Largest safetensors shard, e.g. 5GB, 500MB.")
flags.mark_flags_as_required(["workdir", "out"])

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
  """'5GB' -> 5_000_000_000 (decimal units, as transformers; KiB/MiB/GiB binary)."""
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
  if not m or m.group(2).upper() not in _UNITS:
    raise app.UsageError(f"--max_shard_size={text!r}; use e.g. 5GB, 500MB or a byte count")
  return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  max_shard = parse_size(_MAX_SHARD.value)
  try:
    ckpt_dir, step, saved = find_run_checkpoint(_WORKDIR.value, _STEP.value)
  except ValueError as e:
    sys.exit(str(e))
  try:
    cfg = saved_model_config(saved)
  except (KeyError, TypeError, ValueError) as e:
    sys.exit(f"checkpoint {ckpt_dir}/{step} holds no usable model config ({e!r}); is it a "
             "zaya_jax checkpoint?")

  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: ZayaForCausalLM(cfg, rngs=nnx.Rngs(0))))
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  try:
    state = restore_model_state(ckpt_dir, abstract_with_shardings(abstract, cpu), step)
  except Exception as e:  # corrupt or incompatible arrays; the message names the item
    sys.exit(f"cannot restore the model of checkpoint {ckpt_dir}/{step}: {e}")
  model = nnx.merge(graphdef, state)

  tokenizer = saved.get("data", {}).get("tokenizer")
  tokenizer_file = tokenizer if tokenizer and os.path.isfile(tokenizer) else None
  try:
    paths = save_pretrained(model, _OUT.value, dtype=_DTYPE.value, max_shard_size_bytes=max_shard,
                            tokenizer_file=tokenizer_file)
  except OSError as e:
    sys.exit(f"cannot write --out={_OUT.value}: {e}")
  logging.info("exported step %d of %s to %s (%d safetensors file(s)%s)", step, _WORKDIR.value,
               _OUT.value, len(paths), ", tokenizer.json" if tokenizer_file else "")
  print(f"wrote {_OUT.value} from step {step} ({len(paths)} safetensors file(s))")


if __name__ == "__main__":
  app.run(main)
