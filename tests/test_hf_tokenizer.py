"""A checkpoint's tokenizer and chat template (HFChatTokenizer): exact ids, masks, tool turns, errors."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from snowcat.pipeline.errors import UserError
from snowcat.stages.hf_tokenizer import HFChatTokenizer
from snowcat.stages.model.tiny_hf import CHAT_TEMPLATE, hf_chat_tokenizer, hf_tokenizer_files
from snowcat.stages.tokenizer import load_tokenizer

TEXTS = ["What is 12+30?", "42", "call the calculator", "<tool_call>12+30</tool_call>", "That is not right. Try again."]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expr": "12+30"}}}
CONVERSATION = [
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "42"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return hf_chat_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"))


def test_ids_are_the_templates_own_rendering_and_the_mask_covers_assistant_turns(tok):
    ids, mask = tok.encode_chat(CONVERSATION)
    assert tok.decode(ids) == tok._tok.apply_chat_template(CONVERSATION, tokenize=False)  # the model's own format
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expr": "12+30"}}\n</tool_call>' in tok.decode(ids)
    trained = [i for i, m in zip(ids, mask) if m]
    # the tool-call turn and the answer, each with its <|im_end|>; not the newline after it
    assert (
        tok.decode(trained)
        == '<tool_call>\n{"name": "calculator", "arguments": {"expr": "12+30"}}\n</tool_call><|im_end|>42<|im_end|>'
    )
    assert tok.end_of_turn_id == tok._tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.render_prompt(CONVERSATION[:3])
    assert prompt == ids[: len(prompt)] and tok.decode(prompt).endswith("<|im_start|>assistant\n")


def test_student_prefix_and_untrained_turns_are_context(tok):
    msgs = [
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "41", "train": False},
        {"role": "user", "content": "That is not right. Try again."},
        {"role": "assistant", "student_prefix": "4", "content": "2"},
    ]
    ids, mask = tok.encode_chat(msgs)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "2<|im_end|>"


def test_observations_follow_a_sampled_turn_exactly_as_the_template_continues(tok):
    base = CONVERSATION[:1] + [{"role": "assistant", "content": "<tool_call>12+30</tool_call>"}]
    ids, _ = tok.encode_chat(base)
    sampled = ids[: ids.index(tok.end_of_turn_id, len(tok.render_prompt(base[:1]))) + 1]  # generation stops at <|im_end|>
    tool = {"role": "tool", "content": "42"}
    assert sampled + tok.observation_ids("tool", "42") == tok.render_prompt([*base, tool])


def test_load_tokenizer_tells_the_two_kinds_apart(tok, tmp_path):
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, HFChatTokenizer) and again.fingerprint() == tok.fingerprint()
    assert load_tokenizer(tmp_path / "nothing") is None


def test_a_tokenizer_without_chat_template_is_refused(tmp_path):
    hf_tokenizer_files(TEXTS, tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"^{tmp_path}: the tokenizer has no chat template"):
        HFChatTokenizer.load(tmp_path)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    hf_tokenizer_files(TEXTS, tmp_path)
    fast = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    # like templates that drop earlier reasoning: the last assistant turn is rendered differently
    fast.chat_template = CHAT_TEMPLATE.replace("{{ m.content }}", "{{ m.content if loop.last else 'earlier' }}")
    with pytest.raises(UserError, match="rewrites earlier turns when message 1 is added"):
        HFChatTokenizer(fast, where="t").encode_chat(CONVERSATION)
