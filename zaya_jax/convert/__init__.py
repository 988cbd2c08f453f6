"""Training runs <-> Hugging Face directories (the launch.convert_* CLIs).

  runs.py       a training run's checkpoint <-> HF directory

The format itself (weights table, config.json, load/save) is `zaya_jax.hf`, one layer lower.
"""

from zaya_jax.hf import ConvertError, load_pretrained, save_pretrained

__all__ = ["ConvertError", "load_pretrained", "save_pretrained"]
