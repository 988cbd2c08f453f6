"""Conversion to and from the Hugging Face `transformers` ZAYA1 format.

  hf_table.py   HF_TABLE: our parameter path <-> HF key, and the layout transforms
  hf_config.py  config.json: read, write, compare with a run config (ConvertError)
  import_hf.py  load_pretrained: a save_pretrained directory -> our model
  export_hf.py  to_hf_state_dict / save_pretrained / skip_can_win: our model -> HF
  runs.py       a training run's checkpoint <-> HF directory (the two launch.convert_* CLIs)
"""

from zaya_jax.convert.export_hf import save_pretrained, skip_can_win, to_hf_state_dict
from zaya_jax.convert.hf_config import ConvertError
from zaya_jax.convert.import_hf import load_pretrained

__all__ = ["ConvertError", "load_pretrained", "save_pretrained", "skip_can_win",
           "to_hf_state_dict"]
