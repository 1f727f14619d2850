"""A checkpoint's own tokenizer and chat template, behind the interface of `stages.tokenizer.ChatTokenizer`.

Prompts are rendered by the model's Jinja chat template (`tokenizer_config.json` /
`chat_template.jinja`), so a pretrained model sees its own format, tool-call blocks included.
Token-in-token-out holds as with the local tokenizer: a conversation is encoded message by message
from the template's renderings of growing prefixes, and the agent loop appends observations as
template fragments (`observation_ids`) after the ids the model sampled, never re-rendering them.
A template that rewrites earlier turns when a later one is added (so a rendering is not a prefix
of the next) is refused with the message it breaks at: such a template cannot give exact ids.

Loss mask (as ChatTokenizer): 1 on assistant content and the template's tokens after it up to and
including the end-of-turn token; everything else 0 (the template's tail after end-of-turn, e.g. a
newline, is context: generation stops at end-of-turn, so the model never samples it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from snowcat.pipeline.errors import UserError

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class HFChatTokenizer:
    def __init__(self, tok: PreTrainedTokenizerFast, where: str = "tokenizer"):
        if not tok.chat_template:
            raise UserError(
                f"{where}: the tokenizer has no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
            )
        self._tok, self.where = tok, where
        self.special_ids = {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
        vocab = tok.get_vocab()
        self.end_of_turn_id = self._end_of_turn_id()
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else self.end_of_turn_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.tool_call_start_id = vocab.get("<tool_call>")
        self.tool_call_end_id = vocab.get("</tool_call>")

    def _end_of_turn_id(self) -> int:
        """The first special token the template puts after an assistant turn's content."""
        text = self._render(_PROBE)
        after = text[text.rindex("a") + 1 :]
        ids = self.encode(after)
        specials = set(self._tok.all_special_ids)
        for i in ids:
            if i in specials:
                return i
        raise UserError(f"{self.where}: the chat template ends an assistant turn with no special token")

    # ---------------------------------------------------------------- ChatTokenizer's interface

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        return self._tok.convert_ids_to_tokens(int(i))

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """Ids of `messages` then the assistant header: generation continues from here."""
        ids, _, done = self._encode(messages)
        head = self._render(_template_messages(messages), generation=True)
        return ids + self.encode(self._suffix(done, head, len(messages)))

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a conversation; assistant messages may carry `train: False` and
        `student_prefix` (context at the start of the turn), as ChatTokenizer's do."""
        ids, mask, _ = self._encode(messages)
        return ids, mask

    def _encode(self, messages: list[dict]) -> tuple[list[int], list[int], str]:
        """encode_chat's (ids, mask) and the template's text of the whole conversation."""
        ids: list[int] = []
        mask: list[int] = []
        done = ""
        for i, msg in enumerate(messages):
            history = _template_messages(messages[: i + 1])
            if msg["role"] != "assistant":
                full = self._render(history)
                piece = self.encode(self._suffix(done, full, i))
                ids, mask, done = ids + piece, mask + [0] * len(piece), full
                continue
            head = self._render(history[:-1], generation=True)
            full = self._render(history)
            header = self.encode(self._suffix(done, head, i))
            body = self._suffix(head, full, i)
            prefix, content = msg.get("student_prefix", ""), msg["content"]
            if not body.startswith(prefix + content):
                raise UserError(
                    f"{self.where}: the chat template changes assistant message {i}'s content; token ids could not be exact"
                )
            train = int(msg.get("train", True))
            tail = self.encode(body[len(prefix + content) :])
            end = tail.index(self.end_of_turn_id) + 1 if self.end_of_turn_id in tail else len(tail)
            own = self.encode(prefix), self.encode(content)
            ids += header + own[0] + own[1] + tail
            mask += [0] * (len(header) + len(own[0])) + [train] * (len(own[1]) + end) + [0] * (len(tail) - end)
            done = full
        return ids, mask, done

    def observation_ids(self, role: str, content: str) -> list[int]:
        """Ids to append after an assistant turn that ended with the end-of-turn id (as sampled):
        the rest of the template's turn ending, a `role` message, and the next assistant header."""
        done = self._render(_PROBE)
        after = self._render([*_PROBE, {"role": role, "content": content}], generation=True)
        eot = self._tok.convert_ids_to_tokens(self.end_of_turn_id)
        cut = done.rindex(eot) + len(eot)
        if not after.startswith(done):
            raise UserError(f"{self.where}: the chat template rewrites earlier turns when a {role} message follows")
        return self.encode(after[cut:])

    def save(self, dir) -> Path:
        self._tok.save_pretrained(str(dir))
        return Path(dir) / "tokenizer.json"

    @classmethod
    def load(cls, dir) -> HFChatTokenizer:
        return cls(PreTrainedTokenizerFast.from_pretrained(str(dir), local_files_only=True), where=str(dir))

    def fingerprint(self) -> str:
        h = hashlib.sha256(self._tok.backend_tokenizer.to_str().encode())
        h.update(self._tok.chat_template.encode())
        return h.hexdigest()[:16]

    # ---------------------------------------------------------------- rendering

    def _render(self, messages: list[dict], generation: bool = False) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def _suffix(self, before: str, after: str, index: int) -> str:
        if not after.startswith(before):
            raise UserError(
                f"{self.where}: the chat template rewrites earlier turns when message {index} is added; token ids could not be exact"
            )
        return after[len(before) :]


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the template sees them: snowcat's keys (`train`, `student_prefix`) folded in,
    anything else (e.g. `tool_calls`) passed through."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if k not in ("train", "student_prefix")}
        if m["role"] == "assistant":
            msg["content"] = m.get("student_prefix", "") + m["content"]
        out.append(msg)
    return out
