"""A checkpoint's tokenizer and chat template (HFChatTokenizer): exact ids, masks, tool turns, errors."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from snowcat.pipeline.errors import UserError
from snowcat.stages.hf_tokenizer import HFChatTokenizer
from snowcat.stages.model.tiny_hf import CHAT_TEMPLATE, hf_chat_tokenizer, hf_tokenizer_files
from snowcat.stages.tokenizer import load_tokenizer
from tests.conftest import masked_runs
from tests.qwen3_template import EMPTY_THINK, qwen3_tokenizer

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


@pytest.mark.parametrize(
    "rewrite,error",
    [
        (
            "{{ m.content if loop.last else 'earlier' }}",
            "'s rendering up to assistant message 1 does not begin with its generation prompt",
        ),
        (
            "{{ m.content if loop.last or m.role != 'assistant' else 'earlier' }}",
            " drops or rewrites assistant message 1's text once message 2 is added",
        ),
    ],
    ids=["every earlier message", "earlier assistant content"],
)
def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, rewrite, error):
    hf_tokenizer_files(TEXTS, tmp_path)
    fast = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    # like templates that drop earlier reasoning: an earlier message is rendered differently once it is not last
    fast.chat_template = CHAT_TEMPLATE.replace("{{ m.content }}", rewrite)
    msgs = [CONVERSATION[0], {"role": "assistant", "content": "41"}, {"role": "user", "content": "Try again."}]
    with pytest.raises(UserError, match=f"^t: the chat template{error}"):
        HFChatTokenizer(fast, where="t").encode_chat(msgs)


# ---------------------------------------------------------------- the real Qwen3 chat template

SECOND = {"type": "function", "function": {"name": "calculator", "arguments": {"expr": "42*2"}}}
TOOL_TURNS = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 12+30, doubled?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "Now double it.", "tool_calls": [SECOND]},
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "84"},
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_tokenizer(TEXTS + ["Now double it.", "You are a careful calculator."], tmp_path_factory.mktemp("qwen3"))


def render(tok, messages, generation=False) -> str:
    return tok._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def test_qwen3_multi_turn_tool_conversation_is_what_the_agent_loop_holds(qwen3):
    """Each assistant turn as Qwen3's template renders it last (after its generation prompt, through
    <|im_end|>), the tool results as the agent loop appends them: the conversation's ids equal
    prompt + turns + observation_ids, and differ from the template's rendering of the whole
    conversation only by the empty think block Qwen3 drops from earlier turns."""
    ids, mask = qwen3.encode_chat(TOOL_TURNS)
    loop = qwen3.render_prompt(TOOL_TURNS[:2])
    turns = [i for i, m in enumerate(TOOL_TURNS) if m["role"] == "assistant"]
    for i in turns:
        assert loop == qwen3.render_prompt(TOOL_TURNS[:i]) == ids[: len(loop)]  # the loop's prompt, exactly
        head, full = render(qwen3, TOOL_TURNS[:i], generation=True), render(qwen3, TOOL_TURNS[: i + 1])
        turn = full[len(head) : full.rindex("<|im_end|>") + len("<|im_end|>")]  # the template's own turn, as last
        sampled = ids[len(loop) : len(loop) + len(qwen3.encode(turn))]
        assert (
            qwen3.decode(sampled) == turn
            and sampled[-1] == qwen3.end_of_turn_id
            and all(mask[len(loop) : len(loop) + len(sampled)])
        )
        loop = loop + sampled
        if i + 1 < len(TOOL_TURNS):
            loop += qwen3.observation_ids("tool", TOOL_TURNS[i + 1]["content"])
    assert ids == loop + qwen3.encode("\n") and mask[len(loop) :] == [0]
    text, whole = qwen3.decode(ids), render(qwen3, TOOL_TURNS)
    assert text.count(EMPTY_THINK) == len(turns) and whole.count(EMPTY_THINK) == 1
    assert text.replace(EMPTY_THINK, "") == whole.replace(EMPTY_THINK, "")
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expr": "42*2"}}\n</tool_call>' in text
    assert qwen3.decode(qwen3.observation_ids("tool", "42")) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen3.tool_call_start_id == qwen3._tok.convert_tokens_to_ids("<tool_call>")
    trained = qwen3.decode([i for i, m in zip(ids, mask) if m])
    assert trained == (
        f'{EMPTY_THINK}<tool_call>\n{{"name": "calculator", "arguments": {{"expr": "12+30"}}}}\n</tool_call><|im_end|>'
        f'{EMPTY_THINK}Now double it.\n<tool_call>\n{{"name": "calculator", "arguments": {{"expr": "42*2"}}}}\n</tool_call><|im_end|>'
        f"{EMPTY_THINK}84<|im_end|>"
    )


def test_qwen3_keeps_reasoning_within_a_tool_chain_and_it_encodes_as_rendered(qwen3):
    # after the last user query Qwen3 keeps each turn's reasoning: the ids are the template's rendering
    msgs = [
        TOOL_TURNS[1],
        {"role": "assistant", "content": "<think>\nadd first\n</think>\n\n", "tool_calls": [CALL]},
        TOOL_TURNS[3],
    ]
    msgs += [{"role": "assistant", "content": "<think>\ndone\n</think>\n\n42"}]
    ids, mask = qwen3.encode_chat(msgs)
    assert qwen3.decode(ids) == render(qwen3, msgs)
    assert qwen3.decode([i for i, m in zip(ids, mask) if m]).startswith("<think>\nadd first\n</think>\n\n<tool_call>")


def test_qwen3_drops_earlier_reasoning_after_a_new_user_query_and_that_is_refused(qwen3):
    msgs = [
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n41"},
        {"role": "user", "content": "That is not right. Try again."},
        {"role": "assistant", "content": "42"},
    ]
    assert "add them" not in render(qwen3, msgs)  # the template's own behaviour
    with pytest.raises(UserError) as err:
        qwen3.encode_chat(msgs)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"{qwen3.where}: the chat template drops or rewrites assistant message 1's text once message 2 is added"
    )
    assert "remove that text from earlier turns or split the conversation" in message
    # without the reasoning the same conversation encodes
    msgs[1] = {"role": "assistant", "content": "41"}
    ids, _ = qwen3.encode_chat(msgs)
    assert qwen3.decode(ids).replace(EMPTY_THINK, "") == render(qwen3, msgs).replace(EMPTY_THINK, "")


def test_qwen3_student_prefix_and_untrained_turns(qwen3):
    msgs = [
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "41", "train": False},
        {"role": "user", "content": "That is not right. Try again."},
        {"role": "assistant", "student_prefix": "4", "content": "2"},
    ]
    ids, mask = qwen3.encode_chat(msgs)
    # the template's empty think block belongs to the turn (the model emits it); the teacher's prefix is context
    assert qwen3.decode([i for i, m in zip(ids, mask) if m]) == f"{EMPTY_THINK}2<|im_end|>"
    assert qwen3.decode(ids).endswith(f"<|im_start|>assistant\n{EMPTY_THINK}42<|im_end|>\n")


# ---------------------------------------------------------------- a template declaration (tools, enable_thinking)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


@pytest.mark.parametrize("enable_thinking", [None, False], ids=["template default", "thinking off"])
def test_qwen3_renders_a_template_declaration_and_the_agent_loop_holds_the_same_ids(qwen3, enable_thinking):
    """A conversation opening with {"role": "template", "tools": [...], "enable_thinking": ...}: every
    rendering gets those arguments, so the tool schemas sit in Qwen3's system turn (after the system
    message) and the ids are still prompt + sampled turns + observation_ids(..., template=the same)."""
    kwargs = {"tools": [CALCULATOR]} | ({} if enable_thinking is None else {"enable_thinking": enable_thinking})
    msgs = [{"role": "template", **kwargs}, *TOOL_TURNS]
    ids, mask = qwen3.encode_chat(msgs)
    text = qwen3.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a careful calculator.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(CALCULATOR)}\n</tools>" in text
    whole = qwen3._tok.apply_chat_template(TOOL_TURNS, tokenize=False, **kwargs)
    assert text.replace(EMPTY_THINK, "") == whole.replace(EMPTY_THINK, "")  # the template's own text, but earlier think blocks
    loop = qwen3.render_prompt(msgs[:3])
    assert ids[: len(loop)] == loop and not any(mask[: len(loop)])
    assert qwen3.decode(loop).endswith("<|im_start|>assistant\n" + (EMPTY_THINK if enable_thinking is False else ""))
    turns = [ids[a:b] for a, b in masked_runs(mask)]
    assert len(turns) == 3
    for turn, tool in zip(turns, [msgs[4], msgs[6]]):
        loop += turn + qwen3.observation_ids("tool", tool["content"], template=kwargs)
    assert ids == loop + turns[-1] + qwen3.encode("\n")
    # thinking off: the template writes the empty think block (context); by default the model writes it (trained)
    trained = qwen3.decode([i for i, m in zip(ids, mask) if m])
    assert trained.count(EMPTY_THINK) == (3 if enable_thinking is None else 0)
    assert (qwen3.observation_ids("tool", "42", template=kwargs) == qwen3.observation_ids("tool", "42")) == (
        enable_thinking is None
    )


def test_a_template_declaration_must_come_first(qwen3):
    with pytest.raises(ValueError, match="first message"):
        qwen3.encode_chat([TOOL_TURNS[1], {"role": "template", "tools": [CALCULATOR]}, TOOL_TURNS[2]])
