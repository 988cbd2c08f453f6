"""Export a training run's checkpoint as a Hugging Face `ZayaForCausalLM` directory.

  python -m launch.convert_to_hf --workdir=/tmp/zaya_tiny --out=/tmp/zaya_tiny_hf \
      [--step=N] [--dtype=bfloat16|float32] [--max_shard_size=5GB]

Reads the run config saved with the checkpoint, restores only the `model` item onto one CPU
device, and writes config.json, generation_config.json and safetensors (mode 0644 under umask
022; a progress bar on a terminal or above 2 GB) via `zaya_jax.convert.runs.export_run`, and
the tokenizer files `transformers.AutoTokenizer.from_pretrained(out)` loads: tokenizer.json
(the run's, or for data.tokenizer="byte" an equivalent byte-level one), tokenizer_config.json
(PreTrainedTokenizerFast, the special tokens at the model's ids) and special_tokens_map.json.
Load the model with `transformers.ZayaForCausalLM.from_pretrained(out)`. Caveats (warned about):
transformers zeroes skipped tokens (skip_mode "zero"), and transformers 5.23 resets each
router's skip balancing bias to -1 on load. A missing --workdir or --step, or an unreadable
checkpoint, exits non-zero with one line naming it (and the steps that exist).
"""

import sys

from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.convert import ConvertError, runs
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (holds checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Output directory for the Hugging Face files.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Storage dtype.")
_MAX_SHARD = flags.DEFINE_string("max_shard_size", "5GB", "Largest safetensors shard, e.g. 5GB, 500MB.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  if problem := cli_paths.unwritable_dir_problem(_OUT.value, "--out"):
    sys.exit(f"invalid flags: {problem}")
  try:
    max_shard = runs.parse_size(_MAX_SHARD.value)
  except ValueError as e:
    sys.exit(f"launch.convert_to_hf: {e}")
  try:
    export = runs.export_run(_WORKDIR.value, _OUT.value, _STEP.value, _DTYPE.value, max_shard)
  except ConvertError as e:
    sys.exit(str(e))
  tokenizer = "no tokenizer" if export.tokenizer is None else "tokenizer files"
  print(f"wrote {_OUT.value} from step {export.step} ({len(export.paths)} safetensors file(s), "
        f"{tokenizer})")


def run_main():
  """Console script `zaya-convert-to-hf` (pyproject.toml): the same as `python -m launch.convert_to_hf`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
