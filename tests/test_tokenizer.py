"""The chat BPE tokenizer: local training, real merges (the TITO hazard), chat masks, save/load."""

from __future__ import annotations

import pytest

from snowcat.stages.tokenizer import ChatTokenizer, train_tokenizer

CORPUS = ['{"a": [1, {"b": 22}]}', '[[{"c": "dd"}]]', "hello world, hello there", "123+45=", "168"] * 40


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=320)


def test_training_is_deterministic(tok):
    assert train_tokenizer(CORPUS, vocab_size=320).fingerprint() == tok.fingerprint()


def test_digits_and_brackets_are_single_tokens(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5 and tok.decode(ids) == "12345"
    assert len(tok.encode("]}]]")) == 4


def test_decode_then_encode_can_change_ids(tok):
    """Sampled ids need not be the canonical encoding of their text: 'hel'+'lo' -> 'hello'."""
    changed = []
    for text in ["hello", '"a"', "world", '":']:
        merged = tok.encode(text)
        pieces = [i for ch in text for i in tok.encode(ch)]  # a legal sampled sequence for the same text
        assert tok.decode(pieces) == text
        if pieces != merged:
            changed.append(text)
            assert tok.encode(tok.decode(pieces)) == merged != pieces
    assert changed, "no merges learned: the TITO hazard is not exercised"


def test_chat_mask_covers_assistant_content_and_end_of_turn_only(tok):
    msgs = [{"role": "user", "content": "123+45="}, {"role": "assistant", "content": "168"}]
    ids, mask = tok.encode_chat(msgs)
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == tok.encode("168") + [tok.end_of_turn_id]
    prompt = tok.render_prompt(msgs[:1])
    assert ids[: len(prompt)] == prompt and prompt[-1] == tok.role_ids["assistant"]


def test_relay_student_tokens_are_context(tok):
    msgs = [
        {"role": "user", "content": "123+45="},
        {"role": "assistant", "content": "178", "train": False},
        {"role": "user", "content": "Try again."},
        {"role": "assistant", "student_prefix": "1", "content": "68"},
    ]
    ids, mask = tok.encode_chat(msgs)
    assert [i for i, m in zip(ids, mask) if m] == tok.encode("68") + [tok.end_of_turn_id]
    assert tok.decode(ids).count("<|end|>") == 4


def test_special_token_ids_and_save_load(tok, tmp_path):
    specials = {
        tok.pad_id,
        tok.end_of_turn_id,
        tok.tool_call_start_id,
        tok.tool_call_end_id,
        tok.tool_result_start_id,
        tok.tool_result_end_id,
        *tok.role_ids.values(),
    }
    assert len(specials) == 10 and max(specials) < tok.vocab_size
    assert tok.encode("<tool_call>") == [tok.tool_call_start_id]
    tok.save(tmp_path)
    again = ChatTokenizer.load(tmp_path)
    assert again.encode("hello world") == tok.encode("hello world") and again.vocab_size == tok.vocab_size
