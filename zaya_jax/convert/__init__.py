"""Conversion to and from the Hugging Face `transformers` ZAYA1 format."""
