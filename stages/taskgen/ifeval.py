"""Instruction following with verifiable constraints, as IFEval judges it (verifier id "ifeval").

An IFEval row (google/IFEval: `key, prompt, instruction_id_list, kwargs`) asks for a response that
follows each listed instruction; `kwargs[i]` holds instruction i's arguments. Each instruction
here is checked as IFEval's `instructions.py` checks it (`check_following`), with its strict
evaluation (`evaluation_lib.test_instruction_following_strict`): an empty response follows none.
The verdict: reward = the share of the task's instructions followed (instruction level), passed =
all of them (prompt level, IFEval's headline "prompt-level strict accuracy"). IFEval's loose test
(`evaluation_lib.test_instruction_following_loose`: the response also without its first or last
line, and without asterisks) gives further scores, loose_pass@1 and loose_reward, that evaluate
reports beside them; the reward stays strict.

Instructions that need a language detector or NLTK (response language, all capitals or lowercase
in English, capital-word frequency, number of sentences) are not implemented: neither langdetect
nor NLTK is in the environment. A row with one is refused at import with its id (`UNSUPPORTED`),
rather than judged differently.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

RELATIONS = ("less than", "at least")


@dataclass(frozen=True)
class Instruction:
    args: dict[str, type]  # the kwargs it needs: int, str or list (of str)
    check: Callable[[str, dict], bool]  # (response, kwargs) -> followed


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _words(text: str) -> int:
    return len(re.findall(r"\w+", text))  # IFEval's count_words: nltk's RegexpTokenizer(r"\w+")


def _paragraphs(value: str, k: dict) -> bool:
    parts = re.split(r"\s?\*\*\*\s?", value)
    count = len(parts)
    for i, part in enumerate(parts):
        if not part.strip():
            if i in (0, len(parts) - 1):
                count -= 1
            else:
                return False  # an empty paragraph between two dividers
    return count == k["num_paragraphs"]


def _nth_paragraph_first_word(value: str, k: dict) -> bool:
    parts = re.split(r"\n\n", value)
    count = sum(1 for p in parts if p.strip())
    nth = k["nth_paragraph"]
    if nth > count:
        return False
    paragraph = parts[nth - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    first = ""
    for letter in word:
        if letter in {".", ",", "?", "!", "'", '"'}:
            break
        first += letter.lower()
    return count == k["num_paragraphs"] and first == k["first_word"].lower()


def _highlights(value: str, k: dict) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", value) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", value) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= k["num_highlights"]


def _json(value: str, k: dict) -> bool:
    body = value.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        body = body.removeprefix(fence)
    body = body.removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _postscript(value: str, k: dict) -> bool:
    marker = k["postscript_marker"].strip()
    pattern = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}.get(marker, r"\s*" + marker.lower() + r".*$")
    return bool(re.findall(pattern, value.lower(), flags=re.M))


def _two_responses(value: str, k: dict) -> bool:
    parts = value.split("******")
    kept = []
    for i, part in enumerate(parts):
        if part.strip():
            kept.append(part)
        elif i not in (0, len(parts) - 1):
            return False
    return len(kept) == 2 and kept[0].strip() != kept[1].strip()


CONSTRAINED = ("My answer is yes.", "My answer is no.", "My answer is maybe.")

INSTRUCTIONS: dict[str, Instruction] = {
    "punctuation:no_comma": Instruction({}, lambda v, k: not re.search(r"\,", v)),
    "length_constraints:number_words": Instruction(
        {"num_words": int, "relation": str}, lambda v, k: _compare(_words(v), k["relation"], k["num_words"])
    ),
    "length_constraints:number_paragraphs": Instruction({"num_paragraphs": int}, _paragraphs),
    "length_constraints:nth_paragraph_first_word": Instruction(
        {"num_paragraphs": int, "nth_paragraph": int, "first_word": str}, _nth_paragraph_first_word
    ),
    "keywords:existence": Instruction({"keywords": list}, lambda v, k: all(re.search(w, v, flags=re.I) for w in k["keywords"])),
    "keywords:forbidden_words": Instruction(
        {"forbidden_words": list}, lambda v, k: not any(re.search(rf"\b{w}\b", v, flags=re.I) for w in k["forbidden_words"])
    ),
    "keywords:frequency": Instruction(
        {"keyword": str, "frequency": int, "relation": str},
        lambda v, k: _compare(len(re.findall(k["keyword"].strip(), v, flags=re.I)), k["relation"], k["frequency"]),
    ),
    "keywords:letter_frequency": Instruction(
        {"letter": str, "let_frequency": int, "let_relation": str},
        lambda v, k: _compare(Counter(v.lower())[k["letter"].strip().lower()], k["let_relation"], k["let_frequency"]),
    ),
    "detectable_format:json_format": Instruction({}, _json),
    "detectable_format:number_bullet_lists": Instruction(
        {"num_bullets": int},
        lambda v, k: (
            len(re.findall(r"^\s*\*[^\*].*$", v, flags=re.M)) + len(re.findall(r"^\s*-.*$", v, flags=re.M)) == k["num_bullets"]
        ),
    ),
    "detectable_format:title": Instruction(
        {}, lambda v, k: any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", v))
    ),
    "detectable_format:number_highlighted_sections": Instruction({"num_highlights": int}, _highlights),
    "detectable_format:multiple_sections": Instruction(
        {"section_spliter": str, "num_sections": int},
        lambda v, k: len(re.split(r"\s?" + k["section_spliter"].strip() + r"\s?\d+\s?", v)) - 1 >= k["num_sections"],
    ),
    "detectable_format:constrained_response": Instruction({}, lambda v, k: any(c in v.strip() for c in CONSTRAINED)),
    "detectable_content:number_placeholders": Instruction(
        {"num_placeholders": int}, lambda v, k: len(re.findall(r"\[.*?\]", v)) >= k["num_placeholders"]
    ),
    "detectable_content:postscript": Instruction({"postscript_marker": str}, _postscript),
    "startend:end_checker": Instruction(
        {"end_phrase": str}, lambda v, k: v.strip().strip('"').lower().endswith(k["end_phrase"].strip().lower())
    ),
    "startend:quotation": Instruction({}, lambda v, k: len(v.strip()) > 1 and v.strip()[0] == '"' and v.strip()[-1] == '"'),
    "combination:two_responses": Instruction({}, _two_responses),
    "combination:repeat_prompt": Instruction(
        {"prompt_to_repeat": str}, lambda v, k: v.strip().lower().startswith(k["prompt_to_repeat"].strip().lower())
    ),
}

UNSUPPORTED = {
    "language:response_language": "needs a language detector (langdetect)",
    "change_case:english_capital": "needs a language detector (langdetect)",
    "change_case:english_lowercase": "needs a language detector (langdetect)",
    "change_case:capital_word_frequency": "needs NLTK's word tokenizer",
    "length_constraints:number_sentences": "needs NLTK's punkt sentence tokenizer",
}
_REGEX_ARGS = {"keywords", "forbidden_words", "keyword", "section_spliter"}  # IFEval uses them as patterns


def parse_instructions(ids, kwargs) -> list[dict]:
    """[{"id", "kwargs"}] of one row's `instruction_id_list` and `kwargs`; ValueError naming the
    instruction and argument at fault. None-valued arguments are dropped: the parquet form of
    IFEval gives every row every argument, null where it does not apply."""
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError("instruction_id_list: expected a non-empty list of instruction ids")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise ValueError(f"kwargs: expected a list of {len(ids)} argument maps, one per instruction")
    out = []
    for iid, given in zip(ids, kwargs, strict=True):
        if iid in UNSUPPORTED:
            raise ValueError(f"instruction {iid!r} is not supported here ({UNSUPPORTED[iid]})")
        if iid not in INSTRUCTIONS:
            raise ValueError(f"unknown instruction id {iid!r}")
        args = {k: v for k, v in (given or {}).items() if v is not None}
        out.append({"id": iid, "kwargs": _checked_args(iid, INSTRUCTIONS[iid].args, args)})
    return out


def _checked_args(iid: str, wanted: dict[str, type], args: dict) -> dict:
    out = {}
    for name, kind in wanted.items():
        if name not in args:
            raise ValueError(f"{iid}: kwargs lack {name!r}")
        value = args[name]
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        if (
            not isinstance(value, kind)
            or isinstance(value, bool)
            or (kind is list and not all(isinstance(v, str) for v in value))
        ):
            raise ValueError(f"{iid}: {name} {value!r} is not {'a list of strings' if kind is list else kind.__name__}")
        for pattern in (value if kind is list else [value]) if name in _REGEX_ARGS else []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{iid}: {name} {pattern!r} is not a valid regular expression: {e}") from None
        out[name] = value
    for name in ("relation", "let_relation"):
        if name in out and out[name] not in RELATIONS:
            raise ValueError(f"{iid}: {name} {out[name]!r} is not one of {', '.join(RELATIONS)}")
    return out


def followed(response: str, instructions: list[dict]) -> list[bool]:
    """Per instruction, whether `response` follows it (IFEval's strict test)."""
    if not response.strip():
        return [False] * len(instructions)
    return [INSTRUCTIONS[i["id"]].check(response, i["kwargs"]) for i in instructions]


def loose_variants(response: str) -> list[str]:
    """The responses IFEval's loose test tries (`test_instruction_following_loose`): the response,
    without its first line, its last line or both (those three stripped), and each of the four
    with every `*` removed (markdown emphasis), so a preamble, a sign-off or bold text is forgiven."""
    lines = response.split("\n")
    cut = ["\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [response, response.replace("*", ""), *cut, *(c.replace("*", "") for c in cut)]


def followed_loosely(response: str, instructions: list[dict]) -> list[bool]:
    """Per instruction, whether some loose variant of `response` follows it (IFEval's loose test)."""
    variants = [v for v in loose_variants(response) if v.strip()]  # an empty variant follows nothing
    return [any(INSTRUCTIONS[i["id"]].check(v, i["kwargs"]) for v in variants) for i in instructions]


def verify(task, completion: str) -> tuple[float, bool, str, dict[str, float]]:
    """Strict: the reward (the share of instructions followed) and passed (all of them); loose, as
    further scores evaluate reports beside them: loose_pass@1 (all followed loosely) and loose_reward."""
    instructions = task.meta["ifeval"]["instructions"]
    flags = followed(completion, instructions)
    loose = followed_loosely(completion, instructions)
    missed = [i["id"] for i, ok in zip(instructions, flags, strict=True) if not ok]
    detail = "all instructions followed" if not missed else f"not followed: {', '.join(missed)}"
    scores = {"loose_pass@1": float(all(loose)), "loose_reward": sum(loose) / len(loose)}
    return sum(flags) / len(flags), all(flags), detail, scores
