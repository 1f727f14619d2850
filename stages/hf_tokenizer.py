"""A checkpoint's own tokenizer and chat template, behind the interface of `stages.tokenizer.ChatTokenizer`.

Prompts are rendered by the model's Jinja chat template (`tokenizer_config.json` /
`chat_template.jinja`), so a pretrained model sees its own format, tool-call blocks included.

Token-in-token-out: a conversation's ids are the ones an agent loop would hold, turn by turn. An
assistant turn is what the template renders for it as the conversation's last message, after the
generation prompt, through the end-of-turn token (for Qwen3 that includes the empty
`<think>\n\n</think>\n\n` it puts before an answer: what the model emits in thinking mode). What
comes between turns (user and tool messages, the next assistant header) is the template's text after
that end-of-turn token in the next rendering; `observation_ids` gives the same fragment to the agent
loop, which appends it after the ids the model sampled, never re-rendering them. Templates re-render
earlier turns (Qwen3 drops the empty think block, and the reasoning of turns before the last user
query): what the template itself put before an earlier turn's content may change, but the text the
conversation supplied (content, its rendered tool calls, up to the end of turn) must survive, or the
conversation is refused naming the message (its ids could not be both the template's rendering and
what the model generated).

Loss mask (as ChatTokenizer): 1 on the assistant turn (what the template puts before the content,
the content, its tool calls, the end-of-turn token); 0 on a `student_prefix`, on `train: False`
turns and everything else (the template's tail after end-of-turn, e.g. a newline, is context:
generation stops at end-of-turn, so the model never samples it).

Template keyword arguments: a conversation that opens with `{"role": "template", "tools": [...],
"enable_thinking": ...}` (`stages.tokenizer.split_template`) is rendered with them, every rendering
of it alike (`tools=` OpenAI function schemas, which Qwen3 lists in its system turn; any other key,
e.g. `enable_thinking`, goes to the template as a variable). `observation_ids(..., template=...)`
renders the same way, so the agent loop's ids stay the template's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

from transformers import PreTrainedTokenizerFast

from snowcat.pipeline.errors import UserError
from snowcat.stages.tokenizer import TEMPLATE_ROLE, split_template

_PROBE = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
_MARK = "\x00snowcat-content\x00"  # stands in for an assistant message's content (no template writes it)


class _Turn(NamedTuple):
    """An assistant turn as rendered last: `head` (everything before it, generation prompt
    included), then lead + prefix + content + tail (through the end of turn, `eots` of them so far)."""

    index: int
    head: str
    lead: str
    prefix: str
    content: str
    tail: str
    eots: int


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
        self._eot = tok.convert_ids_to_tokens(self.end_of_turn_id)
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
        return self._encode(messages, generation=True)[0]

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a conversation; assistant messages may carry `train: False` and
        `student_prefix` (context at the start of the turn), as ChatTokenizer's do."""
        return self._encode(messages)

    def observation_ids(self, role: str, content: str, template: dict | None = None) -> list[int]:
        """Ids to append after an assistant turn that ended with the end-of-turn id (as sampled):
        the rest of the template's turn ending, a `role` message, and the next assistant header,
        rendered with the conversation's `template` keyword arguments (e.g. enable_thinking)."""
        probe = [{"role": TEMPLATE_ROLE, **template}, *_PROBE] if template else _PROBE
        turn = self._turn(probe, len(probe) - 1)
        text = self._render([*probe, {"role": role, "content": content}], generation=True)
        cut = self._end_of(turn, text)
        if cut is None:
            raise UserError(f"{self.where}: the chat template rewrites an assistant turn's text when a {role} message follows")
        return self.encode(text[cut:])

    def _encode(self, messages: list[dict], generation: bool = False) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        last: _Turn | None = None
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            turn = self._turn(messages, i)
            context = self.encode(self._after(last, turn.head, messages, i))
            train = int(msg.get("train", True))
            lead, prefix, content, tail = (self.encode(x) for x in (turn.lead, turn.prefix, turn.content, turn.tail))
            ids += context + lead + prefix + content + tail
            mask += [0] * len(context) + [train] * len(lead) + [0] * len(prefix) + [train] * (len(content) + len(tail))
            last = turn
        rest = self.encode(self._after(last, self._render(_template_messages(messages), generation), messages, len(messages)))
        return ids + rest, mask + [0] * len(rest)

    def _turn(self, messages: list[dict], i: int) -> _Turn:
        """Assistant message i as the template renders it when it is the last message."""
        history = _template_messages(messages[: i + 1])
        head = self._render(history[:-1], generation=True)
        full = self._render(history)
        if not full.startswith(head):
            raise UserError(
                f"{self.where}: the chat template's rendering up to assistant message {i} does not begin with its "
                "generation prompt (it rewrites earlier messages or the assistant header); token ids could not be exact"
            )
        body = full[len(head) :]
        prefix, content = messages[i].get("student_prefix", ""), messages[i]["content"]
        # What the template puts before the content (Qwen3: an empty think block), seen with a stand-in
        # content; none when the content itself supplies it (e.g. its own reasoning block).
        marked = self._render([*history[:-1], dict(history[-1], content=_MARK)])
        lead = marked[len(head) : marked.find(_MARK)] if marked.startswith(head) and _MARK in marked else ""
        if not body.startswith(lead + prefix + content):
            lead = ""
            if not body.startswith(prefix + content):
                raise UserError(
                    f"{self.where}: the chat template changes assistant message {i}'s content; token ids could not be exact"
                )
        rest = body[len(lead + prefix + content) :]
        if self._eot not in rest:
            raise UserError(f"{self.where}: the chat template ends assistant message {i} with no {self._eot}")
        tail = rest[: rest.index(self._eot) + len(self._eot)]
        return _Turn(
            i, head, lead, prefix, content, tail, head.count(self._eot) + (lead + prefix + content + tail).count(self._eot)
        )

    def _after(self, turn: _Turn | None, text: str, messages: list[dict], upto: int) -> str:
        """`text` (a rendering of messages[:upto], maybe with the generation prompt) after assistant
        `turn`'s end of turn; all of it when there is no earlier turn."""
        if turn is None:
            return text
        cut = self._end_of(turn, text)
        if cut is None:
            k = next(
                (
                    k
                    for k in range(turn.index + 1, upto)
                    if self._end_of(turn, self._render(_template_messages(messages[: k + 1]))) is None
                ),
                None,
            )
            when = (
                f"message {k} is added"
                if k is not None
                else f"assistant message {upto} begins"
                if upto < len(messages)
                else "the generation prompt is added"
            )
            raise UserError(
                f"{self.where}: the chat template drops or rewrites assistant message {turn.index}'s text once {when} "
                "(as templates that drop earlier reasoning do), so its ids could not be both the template's rendering "
                "and what the model generated: remove that text from earlier turns or split the conversation"
            )
        return text[cut:]

    def _end_of(self, turn: _Turn, text: str) -> int | None:
        """Where `turn` ends in a later rendering `text`: after as many end-of-turn tokens as it closed
        with; None unless the conversation's own text of the turn (all but the lead) ends there."""
        cut = _after_nth(text, self._eot, turn.eots)
        own = turn.prefix + turn.content + turn.tail
        return cut if cut is not None and text[:cut].endswith(own) else None

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
        # every rendering is of a prefix of one conversation, so each carries its template declaration
        kwargs, turns = split_template(messages)
        tools = kwargs.pop("tools", None)
        return self._tok.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=generation, **kwargs)


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


def _after_nth(text: str, needle: str, n: int) -> int | None:
    """The position just after the n-th occurrence of `needle` in `text` (None if fewer)."""
    at = 0
    for _ in range(n):
        found = text.find(needle, at)
        if found < 0:
            return None
        at = found + len(needle)
    return at
