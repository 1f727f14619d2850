"""Small integer arithmetic with an exact-answer verifier. Difficulty = number of digits."""

from __future__ import annotations

import numpy as np


def generate(rng: np.random.Generator, digits: int) -> tuple[str, str, dict]:
    lo, hi = 10 ** (digits - 1), 10**digits
    a, b = (int(x) for x in rng.integers(lo, hi, size=2))
    op = "+" if rng.random() < 0.5 else "-"
    if op == "-" and b > a:
        a, b = b, a  # keep results non-negative: the demo model learns digits, not signs
    result = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(result), {"a": a, "b": b, "op": op}


def verify(prompt: str, answer: str, completion: str) -> tuple[float, bool, str]:
    got = completion.strip()
    ok = got == answer
    return float(ok), ok, "exact" if ok else f"expected {answer}, got {got[:32]!r}"
