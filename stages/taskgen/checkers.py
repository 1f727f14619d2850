"""Checker functions for prompt-and-answer rows whose answers are judged by code, Reasoning Gym style.

Reasoning Gym publishes rows `{question, answer, metadata}` and scores a model's answer with the
dataset's `score_answer(answer, entry)` -> float in [0, 1], where `entry` is the row. `CHECKERS`
maps a name (a row's `metadata.source_dataset`, or the import's `checker`) to such a function; a
task passes at score 1. Checkers run inside the verifier's worker process and must not evaluate
the answer as code: an expression is parsed by `_arithmetic`, never by `eval` (Reasoning Gym's
countdown uses sympy's `parse_expr`, which does).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

Checker = Callable[[str | None, dict[str, Any]], float]


def oracle(answer: str | None, entry: dict[str, Any]) -> float:
    """Reasoning Gym's default (`ProceduralDataset.score_answer`): 1 for the oracle answer, the
    oracle's share of the answer's length when the answer contains it (partial credit), else 0."""
    want = str(entry["answer"])
    if not isinstance(answer, str) or not answer:
        return 0.0
    if answer == want:
        return 1.0
    return len(want) / len(answer) if want in answer else 0.0


class _NotArithmetic(ValueError):
    pass


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _arithmetic(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of + - * / over integer literals (the literals appended to `used`)."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arithmetic(node.operand, used)
    if isinstance(node, ast.BinOp):
        left, right = _arithmetic(node.left, used), _arithmetic(node.right, used)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise _NotArithmetic("division by zero")
            return left / right
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](left, right)
    raise _NotArithmetic(f"not arithmetic: {ast.dump(node)[:60]}")


def countdown(answer: str | None, entry: dict[str, Any]) -> float:
    """Reasoning Gym's countdown: an expression over the given `metadata.numbers` (each at most as
    often as given, as the question says) with + - * / that equals `metadata.target` exactly.
    Scores as Reasoning Gym does: 1 solved, 0.05 an answer that does not solve it, 0.01 none or an
    unreadable one. Stricter than Reasoning Gym's own scorer, which accepts a number used twice and
    truncates a fractional value to an integer before comparing."""
    meta = entry["metadata"]
    if not isinstance(answer, str) or not answer.strip():
        return 0.01
    if len(answer) > 256:  # a countdown expression is short; a parse of megabytes is not the verifier's job
        return 0.01
    used: list[int] = []
    try:
        value = _arithmetic(ast.parse(answer.strip(), mode="eval"), used)
    except (SyntaxError, _NotArithmetic, ValueError, RecursionError):
        return 0.01
    allowed = Counter(int(n) for n in meta["numbers"])
    solved = value == Fraction(int(meta["target"])) and not Counter(used) - allowed
    return 1.0 if solved else 0.05


def word_sorting(answer: str | None, entry: dict[str, Any]) -> float:
    """Reasoning Gym's word_sorting: the comma-separated answer, each word stripped, against
    `metadata.sorted_words`: 1 in that order, 0.2 the same words in another order, else 0."""
    if not isinstance(answer, str) or not answer:
        return 0.0
    words = [w.strip() for w in re.split(r",\s*", answer)]
    want = list(entry["metadata"]["sorted_words"])
    if words == want:
        return 1.0
    return 0.2 if sorted(words) == want else 0.0


CHECKERS: dict[str, Checker] = {"oracle": oracle, "countdown": countdown, "word_sorting": word_sorting}
