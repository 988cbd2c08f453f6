"""ZAYA1-base (8.3B total / 760M active parameters) with the Gemma-3 tokenizer.

The model sizes are the base config's (= ModelConfig defaults). The tokenizer is not shipped:
supply it, e.g.
  python -m launch.train --config=configs/zaya1_base.py \
      --config.data.tokenizer=/path/to/gemma3/tokenizer.json --config.data.source=/path/to/data \
      --workdir=DIR
"""

from configs import base


def get_config():
  """Returns the ZAYA1-base ConfigDict; data.tokenizer must be set by the user."""
  config = base.get_config()
  config.data.tokenizer = ""  # REQUIRED: path to the Gemma-3 tokenizer (vocab 262144 <= 262272)
  return config
