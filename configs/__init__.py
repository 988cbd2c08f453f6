"""Experiment configs: `get_config()` files for `--config=configs/<name>.py`."""
