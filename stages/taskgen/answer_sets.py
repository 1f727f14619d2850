"""Prompt-and-answer task sets from local row files: `format: answers` and `format: ifeval` imports.

`import_answers` reads rows whose columns the import names (`answers:` in the config,
stages.config.AnswerFields) and makes one task per row, judged by its answer kind
(stages/taskgen/answer_kinds.py). The published schemas it is tested on, field by field
(tests/fixtures/answer_sets/):

    GSM8K               question, answer ("...worked solution... #### 72")          kind numeric
    MATH (Hendrycks)    problem, level, type, solution (final answer in \\boxed{})   kind exact
    MMLU (cais/mmlu)    question, subject, choices, answer (index 0-3)              kind choice
    Reasoning Gym       question, answer, metadata (metadata.source_dataset)        kind checker
    APPS / TACO         problem_id, question, solutions, input_output, difficulty,  kind code
                        url, starter_code (input_output's fn_name: call-based cases)
    IFEval (google)     key, prompt, instruction_id_list, kwargs                    `import_ifeval`

A task keeps what judging it needs in `meta["answer"]` (its kind and the kind's parameters: the
choices, the tolerance, the checker and its entry, the hidden test cases); the prompt is all the
model sees. A worked solution the set publishes (GSM8K's, MATH's, a coding set's first solution)
is kept as `meta["solution"]`, the demonstration SFT trains on. Every error names the file, the
row and the field; a set is imported whole or not at all. Two rows with the same prompt are refused:
the held-out split is drawn by prompt, and one prompt with two answers has no single judge.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import Task
from .answer_kinds import KINDS, choice_letter, numbers, render_choices
from .checkers import CHECKERS
from .code_cases import TIME_LIMIT_S
from .final_answer import final_answer, normalise
from .ifeval import parse_instructions
from .rows import TaskImportError, read_rows, require

IFEVAL_COLUMNS = ("key", "prompt", "instruction_id_list", "kwargs")


def import_answers(path: str | Path, fields, *, domain: str = "qa") -> list[Task]:
    """One task per row of a prompt-and-answer file; `fields`: the import's `answers:` section."""
    tasks, seen, ids = [], {}, {}
    for where, row in read_rows(path):
        kind = fields.kind or _row_kind(row, fields.kind_field, where)
        require(row, (fields.prompt,), where)
        question = _string(row[fields.prompt], f"{where}: {fields.prompt}")
        reference, spec, prompt, solution = BUILDERS[kind](row, fields, question, where)
        if fields.instruction:
            prompt = f"{prompt.rstrip()}\n\n{fields.instruction}"
        if prompt in seen:
            raise TaskImportError(f"{where}: {fields.prompt}: the same prompt as {seen[prompt]}")
        seen[prompt] = where
        meta = {"answer": {"kind": kind, **spec}, "source": {"format": "answers", "file": str(path), "row": where}}
        if solution and solution != reference:
            meta["solution"] = solution
        task_id = _task_id(domain, row, fields.id, prompt, where)
        if task_id in ids:
            raise TaskImportError(f"{where}: {fields.id}: {row[fields.id]!r} is also the id of {ids[task_id]}")
        ids[task_id] = where
        tasks.append(Task(task_id, domain, 1, prompt, reference, "answer", meta))
    return tasks


def import_ifeval(path: str | Path, *, domain: str = "ifeval") -> list[Task]:
    """One task per IFEval row: the prompt, no reference answer, the instructions to check."""
    tasks = []
    for where, row in read_rows(path):
        require(row, IFEVAL_COLUMNS, where)
        try:
            instructions = parse_instructions(row["instruction_id_list"], row["kwargs"])
        except ValueError as e:
            raise TaskImportError(f"{where}: {e}") from None
        prompt = _string(row["prompt"], f"{where}: prompt")
        meta = {"ifeval": {"key": row["key"], "instructions": instructions}, "source": {"format": "ifeval", "file": str(path)}}
        tasks.append(Task(f"{domain}-{row['key']}", domain, 1, prompt, "", "ifeval", meta))
    return tasks


# ---------------------------------------------------------------- per kind: (reference, spec, prompt, solution)


def _exact(row: dict, fields, question: str, where: str):
    given = _answer(row, fields, where)
    values = given if isinstance(given, list) else [given]
    finals = [final_answer(_string(v, f"{where}: {fields.answer}")) for v in values]
    if not all(normalise(f) for f in finals):
        raise TaskImportError(f"{where}: {fields.answer}: no final answer in {str(values[0])[:64]!r}")
    spec = {"aliases": finals[1:]} if len(finals) > 1 else {}
    return finals[0], spec, question, str(values[0])


def _numeric(row: dict, fields, question: str, where: str):
    given = str(_answer(row, fields, where))
    found = numbers(final_answer(given))
    if len(found) != 1:
        raise TaskImportError(f"{where}: {fields.answer}: {given[-64:]!r} does not end in one number")
    spec = {"value": str(found[0]), "rel_tol": fields.rel_tol, "abs_tol": fields.abs_tol}
    return final_answer(given), spec, question, given


def _choice(row: dict, fields, question: str, where: str):
    choices = row.get(fields.choices) or []
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise TaskImportError(f"{where}: {fields.choices}: expected a list of choice texts")
    given = _answer(row, fields, where)
    if isinstance(given, int) and not isinstance(given, bool):  # MMLU: the index of the right choice
        letter = choice_letter(chr(ord("A") + given), choices) if 0 <= given < 26 else None
    else:
        letter = choice_letter(str(given), choices)
    if letter is None:
        raise TaskImportError(f"{where}: {fields.answer}: {given!r} names none of the {len(choices) or 'A-Z'} choices")
    prompt = render_choices(question, choices) if choices else question
    return letter, {"choices": choices}, prompt, letter


def _checker(row: dict, fields, question: str, where: str):
    given = _answer(row, fields, where)
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):  # some exports keep it as a JSON string
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as e:
            raise TaskImportError(f"{where}: metadata: not JSON: {e.msg}") from None
    if not isinstance(metadata, dict):
        raise TaskImportError(f"{where}: metadata: expected an object")
    name = fields.checker or metadata.get("source_dataset") or ""
    if name not in CHECKERS:
        said = f"checker {name!r}" if name else "no checker (set answers.checker or the row's metadata.source_dataset)"
        raise TaskImportError(f"{where}: {said}: known checkers are {', '.join(sorted(CHECKERS))}")
    entry = {"question": question, "answer": given, "metadata": metadata}
    return str(given), {"checker": name, "entry": entry}, question, f"<answer>{given}</answer>"


def _code(row: dict, fields, question: str, where: str):
    require(row, (fields.tests,), where)
    tests = _json_field(row[fields.tests], f"{where}: {fields.tests}")
    if not isinstance(tests, dict):
        raise TaskImportError(f"{where}: {fields.tests}: expected {{inputs, outputs}}")
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs or len(inputs) != len(outputs):
        raise TaskImportError(f"{where}: {fields.tests}: inputs and outputs must be non-empty lists of equal length")
    cases = {"inputs": inputs, "outputs": outputs} | _call_based(tests, f"{where}: {fields.tests}")
    solutions = _json_field(row.get(fields.solutions) or [], f"{where}: {fields.solutions}")
    gold = solutions[0] if isinstance(solutions, list) and solutions and isinstance(solutions[0], str) else ""
    prompt = question
    starter = row.get("starter_code") if isinstance(row.get("starter_code"), str) else ""
    if starter.strip():
        prompt = f"{question.rstrip()}\n\nStarter code:\n```python\n{starter.rstrip()}\n```"
    if "fn_name" in cases and cases["fn_name"] not in starter:  # the name the tests call, where nothing shows it
        prompt = f"{prompt.rstrip()}\n\nDefine the function `{cases['fn_name']}`: the tests call it and check what it returns."
    spec = {"tests": cases, "time_limit_s": fields.time_limit_s or TIME_LIMIT_S}
    return gold, spec, prompt, f"```python\n{gold.rstrip()}\n```" if gold else ""


def _call_based(tests: dict, where: str) -> dict:
    """{"fn_name": name} where the cases call a function (APPS, TACO: each input a list of
    arguments, each output the value returned), else {} (stdin/stdout cases)."""
    name = tests.get("fn_name")
    if name in (None, ""):
        return {}
    if not isinstance(name, str) or not name.isidentifier():
        raise TaskImportError(f"{where}: fn_name {name!r} is not a Python name")
    if not all(isinstance(args, list) for args in tests["inputs"]):
        raise TaskImportError(f"{where}: call-based inputs must each be a list of arguments (fn_name {name!r})")
    return {"fn_name": name}


BUILDERS = {"exact": _exact, "numeric": _numeric, "choice": _choice, "checker": _checker, "code": _code}
assert set(BUILDERS) == set(KINDS)


# ---------------------------------------------------------------- fields


def _row_kind(row: dict, field: str, where: str) -> str:
    kind = row.get(field)
    if kind in (None, ""):
        raise TaskImportError(f"{where}: missing {field} (the import names no answers.kind, so each row must)")
    if kind not in KINDS:
        raise TaskImportError(f"{where}: {field} {kind!r} is not an answer kind ({', '.join(KINDS)})")
    return kind


def _answer(row: dict, fields, where: str):
    require(row, (fields.answer,), where)  # a row without its answer: named, never imported as unanswerable
    return row[fields.answer]


def _string(value, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TaskImportError(f"{where}: expected text, got {type(value).__name__}")
    return str(value)


def _json_field(value, where: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise TaskImportError(f"{where}: not JSON: {e.msg}") from None


def _task_id(domain: str, row: dict, id_field: str, prompt: str, where: str) -> str:
    """`<domain>-<the row's id>` where the import names an id column, else from the prompt's hash
    (prompts are unique in a set, so ids are, and a reordered file keeps them)."""
    if id_field:
        require(row, (id_field,), where)
        return f"{domain}-{row[id_field]}"
    return f"{domain}-{hashlib.sha256(prompt.encode()).hexdigest()[:12]}"
