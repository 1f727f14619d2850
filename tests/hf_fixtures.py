"""Test helpers: the package's tiny Hugging Face checkpoint and tokenizer builders."""

from snowcat.stages.model.tiny_hf import CHAT_TEMPLATE, hf_chat_tokenizer, hf_tokenizer_files, tiny_checkpoint

__all__ = ["CHAT_TEMPLATE", "hf_chat_tokenizer", "hf_tokenizer_files", "tiny_checkpoint"]
