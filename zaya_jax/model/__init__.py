"""The ZAYA1 model in Flax NNX (spec: ../shared/spec/zaya1_architecture.md)."""

from zaya_jax.config.model import ModelConfig
from zaya_jax.model.router import BalancingBias
from zaya_jax.model.transformer import ZayaForCausalLM, ZayaLayer, create_model, init_rngs

__all__ = ["ModelConfig", "BalancingBias", "ZayaForCausalLM", "ZayaLayer", "create_model", "init_rngs"]
