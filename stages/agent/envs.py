"""Tool environments for the agent loop, and the teacher demonstrations that teach their protocol.

An environment sees each model turn as the sampled token ids and answers with a `Step`: either the
episode is done (the turn is the final answer, to be verified) or it returns observation ids to
append as context (a tool result) before the next model turn. Observations are the only text the
loop ever tokenises; the model's ids are never decoded and re-encoded into the sequence.

Layout (the chat template of `stages.tokenizer`, so SFT on `teacher_messages` teaches it):

    <|user|> 37+45= <|end|> <|assistant|> <tool_call> 3 7 + 4 5 </tool_call> <|end|>
    <|tool|> <tool_result> 8 2 </tool_result> <|end|> <|assistant|> 8 2 <|end|>
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What a model turn is to its environment, read without acting on it (`turn_kind`; Relay's take-over
# points, stages/agent/relay.py): a final answer or submission (the episode ends on it: a completion
# claim), a tool call the environment would run, or a turn it cannot parse (an invalid action).
ANSWER, ACTION, INVALID = "answer", "action", "invalid"


@dataclass
class Step:
    done: bool
    observation: list[int] = field(default_factory=list)  # context ids appended before the next model turn
    answer: str | None = None  # when done: the final answer text, for the verifier
    status: str = "ok"  # "ok" | "invalid_action" (the model broke the protocol: ends the episode, reward 0)
    reward: float | None = None  # when done: a reward the env decides itself (None = ask the verifier)
    detail: str = ""  # with such a reward: why (e.g. the tests that failed)


class SingleTurnEnv:
    """Closure and plain tasks: the first assistant turn is the answer."""

    name = "single"
    parallel = False  # whether the loop may run step() of different episodes at once
    # whether an invalid action gets an error observation and the episode goes on (else it ends the episode)
    answers_invalid_actions = False

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def prompt(self, task) -> list[int]:
        return self.tok.render_prompt(task.messages(with_answer=False))

    def reset(self, task) -> dict:
        return {}

    def step(self, task, state: dict, turn_ids: list[int]) -> Step:
        return Step(done=True, answer=self.answer_text(turn_ids))

    def finish(self, state: dict) -> None:
        """Release what reset() acquired (the loop calls it once per episode, however it ended)."""

    def turn_kind(self, task, turn_ids: list[int]) -> str:
        """What step() would make of this turn (ANSWER, ACTION or INVALID), without doing it: every
        turn is the answer here."""
        return ANSWER

    def answer_text(self, turn_ids: list[int]) -> str:
        return self.tok.decode(_strip_stop(self.tok, turn_ids), skip_special_tokens=True)

    def note(self, text: str) -> list[int]:
        """A tool-result message from the environment (e.g. "your turn was cut"), then the assistant header."""
        return tool_message_ids(self.tok, text)


class CalculatorEnv(SingleTurnEnv):
    """Arithmetic with a calculator tool: the model calls `<tool_call>EXPR</tool_call>`, gets
    `<tool_result>VALUE</tool_result>`, then answers. In `tool_domains`, answering without having
    called the tool scores 0 when `require_tool`; other domains behave as in `SingleTurnEnv`."""

    name = "calculator"

    def __init__(self, tokenizer, require_tool: bool = True, tool_domains: tuple[str, ...] = ("arith",)):
        super().__init__(tokenizer)
        self.require_tool = require_tool
        self.tool_domains = tuple(tool_domains)

    def reset(self, task) -> dict:
        return {"calls": 0}

    def step(self, task, state: dict, turn_ids: list[int]) -> Step:
        tok = self.tok
        body = _strip_stop(tok, turn_ids)
        if tok.tool_call_start_id not in body:
            if self.require_tool and task.domain in self.tool_domains and state["calls"] == 0:
                return Step(done=True, answer=self.answer_text(turn_ids), reward=0.0)
            return Step(done=True, answer=self.answer_text(turn_ids))
        value = self._call_value(body)
        if value is None:
            return Step(done=True, status="invalid_action")
        state["calls"] += 1
        return Step(done=False, observation=tool_message_ids(tok, str(value)))

    def turn_kind(self, task, turn_ids: list[int]) -> str:
        body = _strip_stop(self.tok, turn_ids)
        if self.tok.tool_call_start_id not in body:
            return ANSWER
        return ACTION if self._call_value(body) is not None else INVALID

    def _call_value(self, body: list[int]) -> int | None:
        """The value of the turn's calculator call (`body` holds its start id); None when the call is
        malformed: no end, special ids inside, or not an expression the calculator takes."""
        tok = self.tok
        start = body.index(tok.tool_call_start_id) + 1
        try:
            end = body.index(tok.tool_call_end_id, start)
        except ValueError:
            return None
        expr_ids = body[start:end]
        if set(expr_ids) & set(tok.special_ids.values()):
            return None
        try:
            return calculate(tok.decode(expr_ids))
        except CalcError:
            return None


def tool_message_ids(tok, text: str) -> list[int]:
    """A tool message holding `text` and the next assistant header, as the tokenizer's chat template
    renders them after a finished assistant turn (snowcat's: `<tool_result>text</tool_result>`)."""
    return tok.observation_ids("tool", text)


def _strip_stop(tok, ids: list[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in (tok.end_of_turn_id, tok.eos_id):
        ids.pop()
    return ids


# ---------------------------------------------------------------- a calculator without eval


class CalcError(ValueError):
    """The expression is not integers with + - * and parentheses (or is too large)."""


MAX_EXPR_CHARS = 64
MAX_DIGITS = 40


def calculate(expr: str) -> int:
    """Evaluate integers with + - * ( ) and unary minus, by recursive descent (never `eval`)."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens = _lex(expr)
    value, pos = _sum(tokens, 0)
    if pos != len(tokens):
        raise CalcError(f"unexpected {tokens[pos]!r}")
    return value


def _lex(expr: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in "+-*()":
            out.append(c)
            i += 1
        elif c in "0123456789":
            j = i
            while j < len(expr) and expr[j] in "0123456789":
                j += 1
            out.append(expr[i:j])
            i = j
        else:
            raise CalcError(f"unexpected character {c!r}")
    if not out:
        raise CalcError("empty expression")
    return out


def _sum(t: list[str], i: int) -> tuple[int, int]:
    value, i = _product(t, i)
    while i < len(t) and t[i] in "+-":
        rhs, j = _product(t, i + 1)
        value, i = (value + rhs if t[i] == "+" else value - rhs), j
    return value, i


def _product(t: list[str], i: int) -> tuple[int, int]:
    value, i = _unary(t, i)
    while i < len(t) and t[i] == "*":
        rhs, i = _unary(t, i + 1)
        value *= rhs
        if len(str(abs(value))) > MAX_DIGITS:
            raise CalcError(f"result longer than {MAX_DIGITS} digits")
    return value, i


def _unary(t: list[str], i: int) -> tuple[int, int]:
    if i >= len(t):
        raise CalcError("expression ends early")
    if t[i] == "-":
        value, i = _unary(t, i + 1)
        return -value, i
    if t[i] == "(":
        value, i = _sum(t, i + 1)
        if i >= len(t) or t[i] != ")":
            raise CalcError("missing ')'")
        return value, i + 1
    if t[i].isdigit():
        if len(t[i]) > MAX_DIGITS:
            raise CalcError(f"number longer than {MAX_DIGITS} digits")
        return int(t[i]), i + 1
    raise CalcError(f"unexpected {t[i]!r}")
