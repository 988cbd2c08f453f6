"""Generate text from a training run's checkpoint or a Hugging Face directory.

  python -m launch.generate --workdir=/tmp/zaya_tiny --prompt="def main(" \
      [--step=N] [--max_new_tokens=64] [--temperature=0.8 --top_p=0.95 --seed=0] [--num_samples=1]
  python -m launch.generate --hf_dir=HF_DIR --prompt="..." [--tokenizer=PATH|byte]

Decodes incrementally with a KV / CCA-convolution / delayed-value cache (zaya_jax.generate):
one compiled prefill for the prompt, one compiled decode step reused for every token.
--temperature=0 is greedy. Generation stops at the tokenizer's eos or after max_new_tokens.
Tokenizer: the run's `data.tokenizer` (byte or tokenizer.json), or HF_DIR/tokenizer.json
(else --tokenizer). The prompt gets the tokenizer's bos first when the run trained with
`data.add_bos` (--add_bos overrides; default True for --hf_dir). --num_samples rows of the same
prompt are decoded as one batch. Prints each continuation, then the prefill time and the
decode speed (tokens/s of all rows, after the first decode step, which compiles).
Pallas kernels are turned off for decoding (every op on its XLA impl); no device mesh is used.
A missing --workdir, checkpoint, --step or --hf_dir exits non-zero with one line naming it.
"""

import os
import sys

import jax
import numpy as np
from absl import app, flags

from zaya_jax.config import cli_paths
from zaya_jax.convert import ConvertError, load_pretrained, runs
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer
from zaya_jax.generate import generate
from zaya_jax.logs import quiet_third_party

quiet_third_party()  # first: JAX/Orbax INFO lines off before JAX picks its backends

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (holds checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Local transformers save_pretrained directory "
                              "(instead of --workdir).")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per sample.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Continuations of the prompt, one batch.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "'byte' or a tokenizer.json path (default: "
                                 "the run's data.tokenizer, or HF_DIR/tokenizer.json).")
_ADD_BOS = flags.DEFINE_bool("add_bos", None, "Prepend the tokenizer's bos to the prompt "
                             "(default: the run's data.add_bos; True for --hf_dir).")
flags.mark_flags_as_required(["prompt"])

# Decoding runs every op on its XLA impl (the kernels are written for training shapes).
_XLA_ONLY = dict(attention_impl="xla", routing_impl="xla", gmm_impl="auto")


def pick_tokenizer(saved: dict | None):
  """The tokenizer: --tokenizer, else the run's data.tokenizer, else HF_DIR/tokenizer.json."""
  name = _TOKENIZER.value
  if name is None and saved is not None:
    name = saved.get("data", {}).get("tokenizer", "byte")
  if name is None:
    name = os.path.join(_HF_DIR.value, "tokenizer.json")
    if not os.path.isfile(name):
      sys.exit(f"--hf_dir={_HF_DIR.value} has no tokenizer.json; pass --tokenizer=PATH (or "
               "--tokenizer=byte)")
  try:
    return ByteTokenizer() if name == "byte" else HFTokenizer(name)
  except ValueError as e:
    sys.exit(f"--tokenizer: {e}")


def main(argv):
  if (_WORKDIR.value is None) == (_HF_DIR.value is None):
    sys.exit("launch.generate: give exactly one of --workdir (a training run) or --hf_dir "
             "(a transformers directory)")
  if _NUM_SAMPLES.value < 1:
    sys.exit(f"launch.generate: --num_samples={_NUM_SAMPLES.value} must be >= 1")
  if _HF_DIR.value is not None:
    if not os.path.isdir(_HF_DIR.value):
      sys.exit(f"--hf_dir={_HF_DIR.value}: no such directory (a local transformers "
               "save_pretrained directory; nothing is downloaded)")
    try:
      model = load_pretrained(_HF_DIR.value, **_XLA_ONLY)
    except (OSError, ValueError) as e:
      sys.exit(f"cannot load --hf_dir={_HF_DIR.value}: {e}")
    saved, source = None, _HF_DIR.value
    add_bos = True if _ADD_BOS.value is None else _ADD_BOS.value
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
      model, saved, step = runs.load_run_model(_WORKDIR.value, _STEP.value, device, **_XLA_ONLY)
    except ConvertError as e:
      sys.exit(str(e))
    source = f"{_WORKDIR.value} step {step}"
    add_bos = saved.get("data", {}).get("add_bos", True) if _ADD_BOS.value is None else _ADD_BOS.value
  tok = pick_tokenizer(saved)
  ids = ([tok.bos_id] if add_bos else []) + tok.encode(_PROMPT.value)
  if not ids:
    sys.exit("launch.generate: --prompt is empty and --add_bos is off: nothing to continue")
  if max(ids) >= model.cfg.vocab_size:
    sys.exit(f"the tokenizer gives id {max(ids)} but the model's vocab_size is "
             f"{model.cfg.vocab_size}: pass the model's own tokenizer (--tokenizer)")
  prompt_BP = np.tile(np.asarray(ids, np.int64)[None], (_NUM_SAMPLES.value, 1))
  try:
    out = generate(model, prompt_BP, _MAX_NEW.value, temperature=_TEMPERATURE.value,
                   top_p=_TOP_P.value, seed=_SEED.value, eos_token_id=tok.eos_id,
                   pad_token_id=tok.pad_id)
  except ValueError as e:
    sys.exit(f"bad generation flag: {e}")
  p = prompt_BP.shape[1]
  for i, row in enumerate(out.tokens[:, p:]):
    row = row.tolist()
    if tok.eos_id in row:
      row = row[:row.index(tok.eos_id)]
    if _NUM_SAMPLES.value > 1:
      print(f"--- sample {i}")
    print(_PROMPT.value + tok.decode(row))
  n = out.tokens.shape[1] - p
  rows = prompt_BP.shape[0]
  speed = (f"{rows * out.steady_steps / out.decode_s:.1f} tokens/s" if out.steady_steps and out.decode_s > 0
           else "too few tokens to time")
  print(f"[{source}] prompt {p} tokens x {rows} row(s): prefill {out.prefill_s:.2f}s, {n} new "
        f"token(s) per row; decode {speed} (first step incl. compile {out.first_step_s:.2f}s)")


def run_main():
  """Console script `zaya-generate` (pyproject.toml): the same as `python -m launch.generate`."""
  app.run(main, flags_parser=cli_paths.parse_flags)


if __name__ == "__main__":
  run_main()
