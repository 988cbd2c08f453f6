"""CCA flash attention: document-masked causal GQA softmax attention, Pallas/Triton kernels."""

from pallas_kernels.cca_attention.ops import AttentionBlockSizes, cca_flash_attention
from pallas_kernels.cca_attention.reference import attention_reference

__all__ = ["AttentionBlockSizes", "attention_reference", "cca_flash_attention"]
