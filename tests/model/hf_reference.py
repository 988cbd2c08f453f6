"""Builds randomised `transformers.ZayaForCausalLM` references for parity tests.

Every parameter and buffer is randomised (residual scales/biases, `temp`,
`router_states_scale`, convolution filters, balancing biases), and the balancing biases are
set from the observed router probabilities so that, in every layer, several experts and the
skip class win for some tokens (../shared/DESIGN.md "Testing trap").
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import ZayaConfig, ZayaForCausalLM

TINY = dict(
    vocab_size=397, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, moe_intermediate_size=32,
    router_hidden_size=16, cca_time0=2, cca_time1=2, max_position_embeddings=256,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def hf_config(**overrides) -> ZayaConfig:
  kw = dict(TINY)
  kw.update(overrides)
  return ZayaConfig(**kw)


@torch.no_grad()
def randomise(model: ZayaForCausalLM, seed: int) -> None:
  """Gives every tensor a random value of a realistic scale (in place, deterministic)."""
  g = torch.Generator().manual_seed(seed)

  def rand(t, mean=0.0, std=1.0):
    t.copy_(mean + std * torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))

  for name, p in model.named_parameters():
    leaf = name.split(".")[-1]
    if leaf in ("hidden_states_scale", "residual_scale", "input_hidden_states_scale") or name.endswith("norm.weight") or "layernorm" in name:
      rand(p, 1.0, 0.2)
    elif leaf == "router_states_scale":
      rand(p, 0.7, 0.3)
    elif leaf == "temp":
      rand(p, 2.0, 0.5)  # sharp, non-uniform attention
    elif "out_proj" in name:
      rand(p, 0.0, 1.5)  # token-dependent router logits
    elif leaf == "bias" or leaf.endswith("_bias"):
      rand(p, 0.0, 0.1)
    elif "embed_tokens" in name:
      rand(p, 0.0, 1.0)
    else:
      rand(p, 0.0, 1.0 / np.sqrt(p.shape[-1]) if p.ndim > 1 else 0.1)


@torch.no_grad()
def balance_biases(model: ZayaForCausalLM, input_ids: torch.Tensor, seed: int,
                   attention_mask: torch.Tensor | None = None) -> None:
  """Sets each layer's balancing biases so that every class (skip included) wins for some tokens.

  Layer by layer (routing in layer l changes the inputs of later layers): start from bias_c =
  minus a per-class quantile of p_c, then raise the bias of any class that wins no token.
  """
  g = np.random.default_rng(seed)
  for li, layer in enumerate(model.model.layers):
    out = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
    probs = torch.softmax(out.router_logits[li].float(), -1).numpy()
    q = g.uniform(0.6, 0.9, size=probs.shape[1])
    bias = -np.array([np.quantile(probs[:, c], q[c]) for c in range(probs.shape[1])])
    for _ in range(50):
      wins = np.bincount(np.argmax(probs + bias, -1), minlength=probs.shape[1])
      if wins.min() > 0:
        break
      bias[wins == 0] += 0.02
    layer.mlp.gate.balancing_biases.copy_(torch.tensor(bias, dtype=torch.float32))


@torch.no_grad()
def chosen_classes(model: ZayaForCausalLM, input_ids, attention_mask=None) -> np.ndarray:
  """int `[L, M]`: the class (E = skip) the reference router picks per layer and token."""
  out = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
  picks = []
  for li, layer in enumerate(model.model.layers):
    p = torch.softmax(out.router_logits[li].float(), -1)
    picks.append(torch.argmax(p + layer.mlp.gate.balancing_biases, -1).numpy())
  return np.stack(picks)


def build(seed: int = 0, batch: int = 2, seq: int = 24, **overrides):
  """Returns `(hf_model, input_ids [B, T] torch.long)` with randomised, balanced weights."""
  cfg = hf_config(**overrides)
  cfg._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = ZayaForCausalLM(cfg).eval()
  randomise(model, seed)
  g = torch.Generator().manual_seed(seed + 1)
  ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=g)
  balance_biases(model, ids, seed)
  return model, ids
