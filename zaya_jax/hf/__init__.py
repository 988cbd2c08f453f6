"""The Hugging Face `transformers` ZAYA1 format: weights and config.json, both directions.

  hf_table.py   HF_TABLE: our parameter path <-> HF key, and the layout transforms
  hf_config.py  config.json: read, write, compare with a run config (ConvertError)
  import_hf.py  load_pretrained: a save_pretrained directory -> our model
  export_hf.py  to_hf_state_dict / save_pretrained / skip_can_win: our model -> HF
  hf_tokenizer.py  tokenizer_config.json / special_tokens_map.json for AutoTokenizer, and
                the byte tokenizer as a tokenizer.json
  run_config.py the run config of an imported checkpoint: architecture from config.json,
                training settings from a config file; config.py rendering

Above the model, below checkpoints and training (so `train.init_from` can read an HF
directory); `zaya_jax.convert` joins these with training runs for the launch.convert_* CLIs.
"""

from zaya_jax.hf.export_hf import save_pretrained, skip_can_win, to_hf_state_dict
from zaya_jax.hf.hf_config import ConvertError
from zaya_jax.hf.import_hf import load_pretrained

__all__ = ["ConvertError", "load_pretrained", "save_pretrained", "skip_can_win",
           "to_hf_state_dict"]
