"""Verifiers of prompt-and-answer tasks, one per answer kind (verifier id "answer").

A task's `meta["answer"]` says how its completion is judged:

    exact    the final answer (stages/taskgen/final_answer.py) equals the reference or one of its
             `aliases` once both are normalised (case, whitespace, surrounding punctuation, LaTeX
             wrappers such as \\boxed{} and \\text{})
    choice   the final answer names one choice: its letter ("B", "(B)", "B.", "option B"), the
             letter with that choice's text ("B. Paris"), or exactly one choice's text
    numeric  the final answer holds exactly one number (thousands separators, fractions, \\frac,
             scientific notation read), within `abs_tol` or `rel_tol` of the reference
    checker  a named checker function scores (answer, entry), Reasoning Gym style (checkers.py)
    code     the program in the completion passes hidden cases in the sandbox, stdin/stdout or calls of
             the function `fn_name` compared by what it returns (code_cases.py)

Each returns (reward, passed, detail) as the domain verifiers do. A final answer that holds several
candidates ("A B C D", "42 or 43") is wrong, never matched against any one of them.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction

from . import checkers, code_cases
from .final_answer import final_answer, fractions_as_slashes, normalise, tagged, unwrap_latex

LETTERS = string.ascii_uppercase
KINDS = ("exact", "choice", "numeric", "checker", "code")

# ---------------------------------------------------------------- numbers

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNSIGNED = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(rf"(?<![\w.])([-+]?{_UNSIGNED})(?:\s*/\s*({_UNSIGNED}))?")


MAX_EXPONENT = 400  # `1e999999999` would take the verifier past its time limit: an infra failure, not a wrong answer
MAX_DIGITS = 1000


def _as_fraction(text: str) -> Fraction | None:
    """`text` (a number as `_NUMBER` matched it) as a fraction; None for one too large to be an
    answer (an exponent or a digit string a completion could use to stall or crash the verifier)."""
    mantissa, _, exponent = text.lower().partition("e")
    if len(mantissa) > MAX_DIGITS or (exponent and abs(int(exponent)) > MAX_EXPONENT):
        return None
    return Fraction(text)


def numbers(text: str) -> list[Fraction]:
    """Every number `text` states, exactly: `1,234.5`, `-3`, `2.5e-3`, `3/4`, `\\frac{3}{4}`; a
    fraction counts as one number, an expression such as `6*7=42` as three. Numbers too large to
    be an answer, and `n/0`, state nothing."""
    text = unwrap_latex(text).replace("\u2212", "-")
    text = fractions_as_slashes(text)
    text = _THOUSANDS.sub("", text)
    out = []
    for whole, denominator in _NUMBER.findall(text):
        value = _as_fraction(whole)
        if value is not None and denominator:
            below = _as_fraction(denominator)
            value = None if not below else value / below
        if value is not None:
            out.append(value)
    return out


def within(got: Fraction, want: Fraction, rel_tol: float, abs_tol: float) -> bool:
    """|got - want| <= max(abs_tol, rel_tol * |want|), in exact arithmetic (no float overflow)."""
    return abs(got - want) <= max(Fraction(abs_tol), Fraction(rel_tol) * abs(want))


# ---------------------------------------------------------------- choices

_LETTER = re.compile(r"(?:option|choice)?\s*\(?([A-Za-z])\)?", re.I)
_LETTER_AND_TEXT = re.compile(r"\(?([A-Z])[.):]\s+(.+)", re.S)


def choice_letter(answer: str, choices: list[str]) -> str | None:
    """The letter `answer` names among `choices` (any letter A-Z where the choices are not listed),
    or None when it names none or more than one."""
    valid = LETTERS[: len(choices)] if choices else LETTERS
    text = unwrap_latex(answer).strip(" \t\n.,;:!?\"'`*[]")
    m = _LETTER.fullmatch(text)
    if m:
        letter = m.group(1).upper()
        return letter if letter in valid else None
    m = _LETTER_AND_TEXT.fullmatch(text)
    if m and choices:
        letter = m.group(1)
        if letter in valid and normalise(m.group(2)) == normalise(choices[valid.index(letter)]):
            return letter
        return None
    named = [letter for letter, choice in zip(valid, choices) if normalise(choice) == normalise(text)]
    return named[0] if len(named) == 1 else None


def render_choices(question: str, choices: list[str]) -> str:
    """The prompt of a multiple-choice row: the question, then one lettered line per choice."""
    lines = [f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)]
    return question.rstrip() + "\n\n" + "\n".join(lines)


# ---------------------------------------------------------------- the kinds


def _exact(answer: str, spec: dict, completion: str) -> tuple[float, bool, str]:
    got = normalise(final_answer(completion))
    accepted = {normalise(a) for a in [answer, *spec.get("aliases", [])]}
    ok = got in accepted
    return float(ok), ok, "exact" if ok else f"expected {answer[:64]!r}, got {got[:64]!r}"


def _choice(answer: str, spec: dict, completion: str) -> tuple[float, bool, str]:
    span = final_answer(completion)
    got = choice_letter(span, spec.get("choices") or [])
    ok = got == answer
    if got is None:
        return 0.0, False, f"no single choice in {span[:64]!r}"
    return float(ok), ok, "choice" if ok else f"expected {answer}, got {got}"


def _numeric(answer: str, spec: dict, completion: str) -> tuple[float, bool, str]:
    span = final_answer(completion)
    got = numbers(span)
    if len(got) != 1:
        return 0.0, False, f"{len(got)} numbers in the final answer {span[:64]!r} (one expected)"
    want = Fraction(spec["value"])  # the reference's number, exactly (answer is its text: "1,000")
    ok = within(got[0], want, spec.get("rel_tol", 0.0), spec.get("abs_tol", 0.0))
    return float(ok), ok, "numeric" if ok else f"expected {answer}, got {span[:64]!r}"


def _checker(answer: str, spec: dict, completion: str) -> tuple[float, bool, str]:
    # Reasoning Gym's scorers read the <answer> tags; a completion without them is judged by its
    # final answer as the other kinds are, so a model trained on bare answers is not scored 0
    span = tagged(completion)
    span = final_answer(completion) if span is None else span
    name = spec["checker"]
    score = float(checkers.CHECKERS[name](span, spec["entry"]))
    score = min(max(score, 0.0), 1.0)
    return score, score >= 1.0, f"checker {name}: {score:g}"


def _code(answer: str, spec: dict, completion: str, image: str | None = None) -> tuple[float, bool, str]:
    program = code_cases.program_of(completion)
    return code_cases.run_cases(program, spec["tests"], spec.get("time_limit_s", code_cases.TIME_LIMIT_S), image=image)


def verify(task, completion: str) -> tuple[float, bool, str]:
    """(reward, passed, detail) of `completion` for a prompt-and-answer task (its meta["answer"])."""
    spec = task.meta["answer"]
    kind = spec["kind"]
    if kind == "code":
        return _code(task.answer, spec, completion, image=task.meta.get("sandbox_image"))
    judge = {"exact": _exact, "choice": _choice, "numeric": _numeric, "checker": _checker}[kind]
    return judge(task.answer, spec, completion)
