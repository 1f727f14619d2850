"""The real Qwen3 chat template (tests/fixtures/qwen3_chat_template.json: Qwen/Qwen3-0.6B's, Apache-2.0)
as the template of a tokenizer over snowcat's tiny BPE: the checks of HFChatTokenizer and TITO run
against the format a Qwen3 checkpoint brings, not only tiny_hf's imitation of it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from snowcat.stages.hf_tokenizer import HFChatTokenizer
from snowcat.stages.model.tiny_hf import hf_tokenizer_files

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "qwen3_chat_template.json").read_text())
QWEN3_TEMPLATE = FIXTURE["chat_template"]
assert hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest() == FIXTURE["source"]["sha256"], "the fixture was edited"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the template puts before an answer that carries no reasoning


def qwen3_tokenizer(texts: list[str], out_dir, vocab_size: int = 400) -> HFChatTokenizer:
    """tiny_hf's BPE and special tokens, Qwen3's <think> tokens (added, not special, as in Qwen3's
    tokenizer) and Qwen3's chat template, saved to `out_dir` and loaded as a checkpoint's tokenizer."""
    hf_tokenizer_files(texts, out_dir, vocab_size)
    fast = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = QWEN3_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return HFChatTokenizer.load(out_dir)
