"""Byte-level BPE tokenizer trained locally (HF `tokenizers`), with a chat template.

Nothing is fetched from a hub: `train_tokenizer(texts, vocab_size)` learns merges from the task
corpus. Digits are split one per token before BPE (as Llama/Qwen do) so arithmetic sees aligned
digits, and brackets are single tokens too (a run of closers is emitted one bracket at a time
instead of as one of hundreds of merged combinations). Everything else is merged, so decode ->
encode of sampled ids can give different ids ("hel" + "lo" -> "hello"): trainers must keep
sampled ids as they are (token-in, token-out).

Chat layout (each piece encoded separately, so a rendered prompt is a prefix of the full chat):

    <|user|> content <|end|> <|assistant|> content <|end|> ...

An assistant message may carry OpenAI-style `tool_calls` (rendered `<tool_call>{json}</tool_call>`
after its content); a `tool` message's content is wrapped in `<tool_result>` ... `</tool_result>`.
The loss mask is 1 on assistant content tokens and their <|end|>; everything else is context.
An assistant message may carry `"train": False` (a whole turn kept as context, e.g. a student's
attempt in Relay SFT) or `"student_prefix": text` (the start of this turn written by someone else,
kept as context; `content` continues it and is trained).

A conversation may open with a template declaration, `{"role": "template", "tools": [...], ...}`:
not a turn, but the keyword arguments of the chat template (`split_template`). A checkpoint's
template renders them (Qwen3: the tool schemas in its system turn, `enable_thinking`); this
template has no tools section and ignores them, so its ids are those of the turns alone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from snowcat.pipeline.fsio import atomic_write_text

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_result>",
    "</tool_result>",
]
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
FILE = "tokenizer.json"
TEMPLATE_ROLE = "template"


def split_template(messages: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat template's keyword arguments, the turns) of a conversation that may open with
    `{"role": "template", **kwargs}` (e.g. tools=[OpenAI function schemas], enable_thinking=False)."""
    kwargs: dict = {}
    if messages and messages[0].get("role") == TEMPLATE_ROLE:
        kwargs = {k: v for k, v in messages[0].items() if k != "role"}
        messages = messages[1:]
    if any(m.get("role") == TEMPLATE_ROLE for m in messages):
        raise ValueError("a template declaration must be a conversation's first message")
    return kwargs, list(messages)


def render_tool_call(call: dict) -> str:
    """An OpenAI-style tool call ({"function": {"name", "arguments"}}) in the Hermes/Qwen form
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (compact JSON)."""
    fn = call.get("function", call)
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}, separators=(",", ":")) + "</tool_call>"


def message_text(msg: dict) -> str:
    """A message's text as snowcat's template renders it: an assistant's `tool_calls` after its
    content, a tool result inside <tool_result> ... </tool_result>. (HFChatTokenizer leaves both
    to the checkpoint's own template.)"""
    text = msg.get("content") or ""
    if msg["role"] == "assistant":
        text += "".join(render_tool_call(c) for c in msg.get("tool_calls") or [])
    elif msg["role"] == "tool":
        text = f"<tool_result>{text}</tool_result>"
    return text


def train_bpe(texts, vocab_size: int, special_tokens: list[str], min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE learned over `texts` with snowcat's pre-tokenizer (digits one per token,
    brackets alone); deterministic for the same input."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\[\]{}()]"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def train_tokenizer(texts, vocab_size: int = 512, min_frequency: int = 2) -> ChatTokenizer:
    """snowcat's chat tokenizer: a BPE over `texts` with its special tokens."""
    return ChatTokenizer(train_bpe(texts, vocab_size, SPECIAL_TOKENS, min_frequency))


class ChatTokenizer:
    def __init__(self, tok):
        self._tok = tok
        ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.special_ids = ids
        self.pad_id = ids["<|pad|>"]
        self.eos_id = ids["<|endoftext|>"]
        self.end_of_turn_id = ids["<|end|>"]
        self.tool_call_start_id = ids["<tool_call>"]
        self.tool_call_end_id = ids["</tool_call>"]
        self.tool_result_start_id = ids["<tool_result>"]
        self.tool_result_end_id = ids["</tool_result>"]
        self.role_ids = {role: ids[t] for role, t in ROLE_TOKENS.items()}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        return self._tok.id_to_token(i)

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) for a whole conversation; mask 1 on trained assistant tokens + <|end|>.
        A template declaration is left out (no tools section here)."""
        ids: list[int] = []
        mask: list[int] = []
        for msg in split_template(messages)[1]:
            role = msg["role"]
            if role not in self.role_ids:
                raise ValueError(f"unknown chat role {role!r}")
            train = role == "assistant" and msg.get("train", True)
            ids.append(self.role_ids[role])
            mask.append(0)
            prefix = self.encode(msg.get("student_prefix", "")) if role == "assistant" else []
            body = self.encode(message_text(msg)) + [self.end_of_turn_id]
            ids += prefix + body
            mask += [0] * len(prefix) + [int(train)] * len(body)
        return ids, mask

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """Ids of `messages` followed by the assistant header: generation continues from here."""
        ids, _ = self.encode_chat(messages)
        return ids + [self.role_ids["assistant"]]

    def observation_ids(self, role: str, content: str, template: dict | None = None) -> list[int]:
        """Ids to append after an assistant turn that ended with <|end|> (as sampled): a `role`
        message, then the next assistant header (exactly what `encode_chat` gives for them).
        `template` (the conversation's template keyword arguments) changes nothing here."""
        ids, _ = self.encode_chat([{"role": role, "content": content}])
        return ids + [self.role_ids["assistant"]]

    def save(self, dir) -> Path:
        path = Path(dir) / FILE
        atomic_write_text(path, self._tok.to_str(pretty=False))
        return path

    @classmethod
    def load(cls, dir) -> ChatTokenizer:
        path = Path(dir)
        path = path / FILE if path.is_dir() else path
        return cls(Tokenizer.from_str(path.read_text()))

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(json.loads(self._tok.to_str()), sort_keys=True).encode()).hexdigest()[:16]


def load_tokenizer(dir):
    """A model directory's tokenizer: the checkpoint's own (tokenizer_config.json with a chat
    template: `HFChatTokenizer`) or snowcat's locally trained one (tokenizer.json alone); None if neither."""
    path = Path(dir)
    if (path / "tokenizer_config.json").is_file():
        from snowcat.stages.hf_tokenizer import HFChatTokenizer  # noqa: PLC0415 (transformers takes seconds to import)

        return HFChatTokenizer.load(path)
    if (path / FILE).is_file():
        return ChatTokenizer.load(path)
    return None
