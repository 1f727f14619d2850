"""Small integer arithmetic with an exact-answer verifier. Difficulty = number of digits.

The teacher's demonstration works column by column from the right, writing each carry or borrow,
then gives the answer after `;`:

    347+285=   7+5=12,4+8+1=13,3+2+1=6;632
    347-285=   7-5=2,14-8=6,3-2-1=0;62          (14: the 4 borrowed ten from the next column)

Each column is then a look-up on two digits the model has just copied, where the answer written
straight out needs every carry at once. The verifier checks only what follows the last `;` (or
the whole completion when there is none) against the exact result.
"""

from __future__ import annotations

import re

import numpy as np

_PROMPT = re.compile(r"^(\d+)([+-])(\d+)=$")


def generate(rng: np.random.Generator, digits: int) -> tuple[str, str, dict]:
    lo, hi = 10 ** (digits - 1), 10**digits
    a, b = (int(x) for x in rng.integers(lo, hi, size=2))
    op = "+" if rng.random() < 0.5 else "-"
    if op == "-" and b > a:
        a, b = b, a  # keep results non-negative: the demo model learns digits, not signs
    result = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(result), {"a": a, "b": b, "op": op}


def worked_solution(prompt: str, answer: str) -> str:
    """The column-by-column demonstration of `prompt` (see the module docstring)."""
    m = _PROMPT.match(prompt.strip())
    if m is None:
        return answer
    a, op, b = m.group(1), m.group(2), m.group(3)
    width = max(len(a), len(b))
    xs, ys = [int(d) for d in a.zfill(width)[::-1]], [int(d) for d in b.zfill(width)[::-1]]
    columns, carry = [], 0
    for x, y in zip(xs, ys):
        if op == "+":
            total = x + y + carry
            columns.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
            carry = total // 10
        else:
            borrow = int(x - carry < y)
            top = x + 10 * borrow
            columns.append(f"{top}-{y}" + ("-1" if carry else "") + f"={top - y - carry}")
            carry = borrow
    return ",".join(columns) + ";" + answer


def final_answer(completion: str) -> str:
    return completion.strip().rsplit(";", 1)[-1].strip()


def verify(prompt: str, answer: str, completion: str) -> tuple[float, bool, str]:
    got = final_answer(completion)
    ok = got == answer
    return float(ok), ok, "exact" if ok else f"expected {answer}, got {got[:32]!r}"
