"""Data pipeline: documents -> tokens -> packed [B, T] batches with segment ids (grain)."""

from zaya_jax.data.config import DataConfig
from zaya_jax.data.pipeline import (
    FinalizeBatch,
    TokenizeDocument,
    make_eval_batches,
    make_eval_sets,
    make_train_iterator,
)
from zaya_jax.data.sources import DocumentRef, DocumentSource, list_documents, split_documents
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DocumentRef",
    "DocumentSource",
    "FinalizeBatch",
    "HFTokenizer",
    "TokenizeDocument",
    "Tokenizer",
    "list_documents",
    "load_tokenizer",
    "make_eval_batches",
    "make_eval_sets",
    "make_train_iterator",
    "split_documents",
]
