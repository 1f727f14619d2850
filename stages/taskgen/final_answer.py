"""The final answer a completion (or a published reference solution) gives, and its normal form.

A completion is free text with working before the answer. The answer is taken from the last of the
first of these markers found, in this order:

    <answer>...</answer>     Reasoning Gym's tags (`reasoning_gym.utils.extract_answer`)
    \\boxed{...}              MATH-style LaTeX (braces balanced, so `\\boxed{\\frac{1}{2}}` is whole)
    #### ...                 GSM8K's final-answer line
    answer is ... / answer: ...
    the last non-empty line  when there is no marker

Taking one span (never "any number anywhere") is what keeps a completion that lists several
candidates from matching one of them: the answer kinds judge that span alone, and refuse a span
with more than one candidate in it (stages/taskgen/answer_kinds.py).
"""

from __future__ import annotations

import re

_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.S)
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", re.I)
# wrappers a final answer comes in that do not change it
_LATEX_WRAPPERS = ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\boxed", "\\fbox")
_SURROUNDING = " \t\n.,;:!?\"'`*"
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer rather than a guess


def tagged(text: str) -> str | None:
    """Reasoning Gym's answer: the last `<answer>...</answer>`, stripped."""
    found = _TAG.findall(text)
    return found[-1].strip() if found else None


def final_answer(text: str) -> str:
    """The span of `text` that states its final answer (see the module docstring)."""
    for pick in (tagged, boxed):
        found = pick(text)
        if found is not None:
            return found.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def unwrap_latex(text: str) -> str:
    """`text` without `$...$`, `\\(...\\)`, `\\text{...}`-style wrappers and LaTeX spacing commands."""
    out = text.strip()
    for _ in range(4):  # nested wrappers: \boxed{\text{Paris}}
        before = out
        if len(out) > 1 and out.startswith("$") and out.endswith("$"):
            out = out.strip("$").strip()
        if out.startswith("\\(") and out.endswith("\\)"):
            out = out[2:-2].strip()
        for wrapper in _LATEX_WRAPPERS:
            if out.startswith(wrapper + "{") and out.endswith("}"):
                out = out[len(wrapper) + 1 : -1].strip()
        if out == before:
            break
    for spacing in ("\\!", "\\,", "\\;", "\\quad", "\\left", "\\right"):
        out = out.replace(spacing, "")
    return out


def fractions_as_slashes(text: str) -> str:
    """`\\frac{a}{b}` (and `\\dfrac`, `\\tfrac`) written as `a/b`."""
    return _FRAC.sub(r"\1/\2", text)


def normalise(text: str) -> str:
    """The form two answers are compared in by `exact`: surrounding punctuation, quotes and markdown
    emphasis stripped, LaTeX wrappers removed, fractions as `a/b`, case folded, whitespace collapsed."""
    out = unwrap_latex(text.strip(_SURROUNDING))
    out = fractions_as_slashes(out)
    out = " ".join(out.casefold().split())
    return out.strip(_SURROUNDING)
