"""ModelConfig: the frozen, validated description of one ZAYA1 model.

Field names follow Hugging Face `ZayaConfig` (transformers>=5.23) where one exists, so that
`to_hf_dict`/`from_hf_dict` are plain renames. Matches: spec "Sizes of the released model".
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zaya_jax.ops import attention, grouped_matmul, route

LAYER_TYPES = ("hybrid", "hybrid_sliding")  # full causal attention | sliding-window attention
SKIP_MODES = ("zero", "scaled_identity")  # transformers | Zyphra's original trainer (gate * x)
DTYPES = ("float32", "bfloat16")
ROUTER_INITS = ("fan_in", "normal")  # router MLP init: std 1/sqrt(fan_in) | initializer_range
# field -> the op's implementations (or, for attention_backward, its backward passes)
IMPLS = {"attention_impl": attention.IMPLS, "attention_backward": attention.BACKWARDS,
         "routing_impl": route.IMPLS, "gmm_impl": grouped_matmul.IMPLS}


def _compute_only(default: Any) -> Any:
  """A field that changes how the model computes, not its parameters (the last group below)."""
  return dataclasses.field(default=default, metadata={"compute_only": True})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and numerics of a ZAYA1 model. Defaults are ZAYA1-base (8.3B total, 760M active).

  Raises:
    ValueError: on construction, naming the offending field and the fix, e.g. heads not
      divisible by kv heads, an unknown layer type, or a missing sliding window.
  """

  vocab_size: int = 262272  # V, tokens (Gemma-3 tokenizer padded to a multiple of 64)
  hidden_size: int = 2048  # D
  num_layers: int = 40  # L; each layer = CCA attention block + MoE block
  num_heads: int = 8  # N query heads
  num_kv_heads: int = 2  # K key/value heads (GQA); must divide num_heads, even (current|delayed)
  head_dim: int = 128  # H
  num_experts: int = 16  # E routed experts; the router has E+1 classes (last = skip)
  moe_intermediate_size: int = 2048  # F, SwiGLU width of one expert
  router_hidden_size: int = 256  # R
  cca_time0: int = 2  # kernel width of CCA's depthwise conv over time
  cca_time1: int = 2  # kernel width of CCA's grouped (per-head) conv over time
  layer_types: tuple[str, ...] = ("hybrid",) * 40  # one of LAYER_TYPES per layer
  sliding_window: int | None = None  # tokens a `hybrid_sliding` query sees (itself included)
  rope_theta: float = 5_000_000.0  # RoPE base of `hybrid` layers
  rope_theta_sliding: float = 10_000.0  # RoPE base of `hybrid_sliding` layers
  partial_rotary_factor: float = 0.5  # RoPE on the first head_dim * factor dims
  rms_norm_eps: float = 1e-5
  attention_bias: bool = False  # biases on q/k/v/o projections
  lm_head_bias: bool = False  # bias on the tied LM head
  initializer_range: float = 0.02  # std of normal init for matrices
  skip_mode: str = "scaled_identity"  # one of SKIP_MODES; HF parity needs "zero"
  # Init of the router MLP (fc1, fc2, out_proj); one of ROUTER_INITS. "normal" (std
  # initializer_range, as HF `_init_weights`) shrinks each layer's output ~0.02*sqrt(R)x, so a
  # fresh router gives every token the same probabilities (spread ~1e-5) and the balancing
  # biases cannot split tokens between experts; "fan_in" keeps the logits' spread O(1).
  router_init: str = "fan_in"
  pad_token_id: int = 0
  bos_token_id: int = 2
  eos_token_id: int = 106

  # --- Compute only: how the model computes, not its parameters. These may differ between a
  # checkpoint and the run that resumes from it (zaya_jax.config.COMPUTE_ONLY_MODEL_FIELDS).
  dtype: str = _compute_only("float32")  # compute dtype of matmuls (params, residual, norms, softmax stay f32)
  scan_layers: bool = _compute_only(True)  # run layers with nnx.scan (compile time independent of depth)
  remat: bool = _compute_only(False)  # rematerialise each layer in the backward pass
  attention_impl: str = _compute_only("xla")  # CCA attention: zaya_jax.ops.attention.IMPLS
  attention_backward: str = _compute_only("autodiff")  # "xla" attention's backward: zaya_jax.ops.attention.BACKWARDS
  routing_impl: str = _compute_only("xla")  # top-1 routing: zaya_jax.ops.route.IMPLS
  gmm_impl: str = _compute_only("auto")  # experts' grouped matmul: zaya_jax.ops.grouped_matmul.IMPLS
  moe_dispatch: str = _compute_only("auto")  # EP token dispatch: zaya_jax.parallel.dispatch.DISPATCHES
  capacity_factor: float = _compute_only(1.25)  # "all_to_all" dispatch: slots per expert = factor * tokens / E
  force_balanced_routing: bool = _compute_only(False)  # debug: round-robin tokens over experts (throughput runs)

  def __post_init__(self):
    def fail(field, msg):
      raise ValueError(f"model.{field}: {msg}")

    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "num_experts", "moe_intermediate_size", "router_hidden_size", "cca_time0", "cca_time1"):
      v = getattr(self, f)
      if not isinstance(v, int) or v < 1:
        fail(f, f"must be a positive integer, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      fail("num_heads", f"{self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
           "choose num_heads as a multiple of num_kv_heads")
    if self.num_kv_heads % 2:
      fail("num_kv_heads", f"{self.num_kv_heads} must be even: CCA splits kv heads into current "
           "and delayed halves")
    if len(self.layer_types) != self.num_layers:
      fail("layer_types", f"has {len(self.layer_types)} entries but num_layers={self.num_layers}; "
           "give one type per layer")
    for i, t in enumerate(self.layer_types):
      if t not in LAYER_TYPES:
        fail("layer_types", f"entry {i} is {t!r}; must be one of {LAYER_TYPES}")
    if "hybrid_sliding" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
      fail("sliding_window", f"is {self.sliding_window!r} but layer_types contains 'hybrid_sliding'; "
           "set a positive window in tokens")
    rot = self.head_dim * self.partial_rotary_factor
    if not (0 < self.partial_rotary_factor <= 1) or rot != int(rot) or int(rot) % 2:
      fail("partial_rotary_factor", f"{self.partial_rotary_factor} * head_dim {self.head_dim} must "
           "be an even integer in (0, head_dim]")
    if self.skip_mode not in SKIP_MODES:
      fail("skip_mode", f"{self.skip_mode!r}; must be one of {SKIP_MODES}")
    if self.router_init not in ROUTER_INITS:
      fail("router_init", f"{self.router_init!r}; must be one of {ROUTER_INITS}")
    for f, allowed in IMPLS.items():
      if getattr(self, f) not in allowed:
        fail(f, f"{getattr(self, f)!r}; must be one of {allowed}")
    if self.moe_dispatch not in ("auto", "local", "allgather", "all_to_all", "ragged_all_to_all"):
      fail("moe_dispatch", f"{self.moe_dispatch!r}; must be one of ('auto', 'local', 'allgather', "
           "'all_to_all', 'ragged_all_to_all')")
    if not self.capacity_factor > 0:
      fail("capacity_factor", f"{self.capacity_factor} must be > 0")
    if self.dtype not in DTYPES:
      fail("dtype", f"{self.dtype!r}; must be one of {DTYPES}")

  @property
  def rotary_dim(self) -> int:
    """Dims of each head that RoPE rotates (the first `rotary_dim` of `head_dim`)."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def context_halo(self) -> tuple[int, int]:
    """`(conv_rows, value_rows)`: tokens before a sequence shard that CCA reads (context
    parallelism). The depthwise conv (width W0) then the grouped conv (width W1) read inputs
    back to `t - (W0 - 1) - (W1 - 1)`: W0 + W1 - 2 pre-convolution `[q0, k0]` rows; the
    delayed value reads token t - 1: 1 row."""
    return self.cca_time0 + self.cca_time1 - 2, 1

  @property
  def attention_window(self) -> int | None:
    """Tokens a `hybrid_sliding` query sees, or None when no layer is a sliding one."""
    return self.sliding_window if "hybrid_sliding" in self.layer_types else None

  @property
  def num_router_classes(self) -> int:
    """X = E + 1: the routed experts plus the skip class (index E)."""
    return self.num_experts + 1

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def xla_only(self) -> "ModelConfig":
    """This config with every op on its XLA impl (no Pallas kernel; e.g. for decoding)."""
    gmm = "auto" if self.gmm_impl == "pallas" else self.gmm_impl
    return self.replace(attention_impl="xla", routing_impl="xla", gmm_impl=gmm)

  # --- Hugging Face config.json -------------------------------------------------------------
  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` fields `transformers.ZayaConfig` reads (model_type "zaya")."""
    return {
        "model_type": "zaya",
        "architectures": ["ZayaForCausalLM"],
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "num_experts": self.num_experts,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": self.moe_intermediate_size,
        "router_hidden_size": self.router_hidden_size,
        "cca_time0": self.cca_time0,
        "cca_time1": self.cca_time1,
        "layer_types": list(self.layer_types),
        "sliding_window": self.sliding_window,
        "rope_parameters": {
            "hybrid": {"rope_type": "default", "rope_theta": self.rope_theta,
                       "partial_rotary_factor": self.partial_rotary_factor},
            "hybrid_sliding": {"rope_type": "default", "rope_theta": self.rope_theta_sliding,
                               "partial_rotary_factor": self.partial_rotary_factor},
        },
        "rms_norm_eps": self.rms_norm_eps,
        "attention_bias": self.attention_bias,
        "lm_head_bias": self.lm_head_bias,
        "initializer_range": self.initializer_range,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "pad_token_id": self.pad_token_id,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
    }

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """Builds a ModelConfig from a `config.json` dict. HF import defaults to skip_mode="zero".

    Raises:
      ValueError: if the config is not a ZAYA1 config (model_type, top-k, untied head).
    """
    if hf.get("model_type") != "zaya":
      raise ValueError(f"config.json model_type is {hf.get('model_type')!r}, expected 'zaya'")
    if hf.get("num_experts_per_tok", 1) != 1:
      raise ValueError("config.json num_experts_per_tok must be 1 (ZAYA1 is top-1)")
    if not hf.get("tie_word_embeddings", True):
      raise ValueError("config.json tie_word_embeddings=false is not supported (ZAYA1 ties the head)")
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
    n = hf.get("num_hidden_layers", 40)
    rope = hf.get("rope_parameters") or {}
    full = rope.get("hybrid") or {}
    slide = rope.get("hybrid_sliding") or {}
    eos = hf.get("eos_token_id", 106)
    kw = dict(
        vocab_size=hf.get("vocab_size", 262272),
        hidden_size=hf.get("hidden_size", 2048),
        num_layers=n,
        num_heads=hf.get("num_attention_heads", 8),
        num_kv_heads=hf.get("num_key_value_heads", 2),
        head_dim=hf.get("head_dim", 128),
        num_experts=hf.get("num_experts", 16),
        moe_intermediate_size=hf.get("moe_intermediate_size", 2048),
        router_hidden_size=hf.get("router_hidden_size", 256),
        cca_time0=hf.get("cca_time0", 2),
        cca_time1=hf.get("cca_time1", 2),
        layer_types=tuple(hf.get("layer_types") or ["hybrid"] * n),
        sliding_window=hf.get("sliding_window"),
        rope_theta=float(full.get("rope_theta", 5_000_000.0)),
        rope_theta_sliding=float(slide.get("rope_theta", 10_000.0)),
        partial_rotary_factor=float(full.get("partial_rotary_factor", 0.5)),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        attention_bias=hf.get("attention_bias", False),
        lm_head_bias=hf.get("lm_head_bias", False),
        initializer_range=hf.get("initializer_range", 0.02),
        skip_mode="zero",
        pad_token_id=hf.get("pad_token_id", 0) if hf.get("pad_token_id") is not None else 0,
        bos_token_id=hf.get("bos_token_id", 2) if hf.get("bos_token_id") is not None else 2,
        eos_token_id=eos[0] if isinstance(eos, list) else (eos if eos is not None else 106),
    )
    if slide and slide.get("partial_rotary_factor", kw["partial_rotary_factor"]) != kw["partial_rotary_factor"]:
      raise ValueError("config.json: hybrid and hybrid_sliding partial_rotary_factor differ; unsupported")
    kw.update(overrides)
    return cls(**kw)
