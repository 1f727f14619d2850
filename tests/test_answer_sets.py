"""Prompt-and-answer task sets (`format: answers`, `format: ifeval`): each answer kind's verifier on
fixture rows in the published schemas (tests/fixtures/answer_sets/README.md says whose), with the
attempts to fool each kept as cases; bad input named by file, row and field (exit 2 from a stage);
an imported set run through the tasks stage and evaluate, its source's sha256 in the task manifest
(`sources.json`) and the card."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snowcat.pipeline import card
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit
from snowcat.stages.config import AnswerFields, TaskImport, TasksConfig
from snowcat.stages.taskgen import demonstration, load_tasks, verify
from snowcat.stages.taskgen.answer_sets import import_answers, import_ifeval
from snowcat.stages.taskgen.ifeval import followed, parse_instructions
from snowcat.stages.taskgen.rows import SOURCES, TaskImportError

FIXTURES = Path(__file__).parent / "fixtures" / "answer_sets"
needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="code cases run in LocalSandbox as root"
)


def imported(name: str, domain: str = "qa", **fields) -> list:
    return import_answers(FIXTURES / name, AnswerFields(**fields), domain=domain)


def verdicts(task, completions: list[str]) -> list[bool]:
    return [verify(task, c).passed for c in completions]


def rows_of(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


# ---------------------------------------------------------------- the kinds


def test_gsm8k_numeric_answers_and_attempts_to_fool_them():
    tasks = imported("gsm8k.jsonl", "gsm8k", kind="numeric")
    assert [t.answer for t in tasks] == ["6", "112", "900"]
    first = tasks[0]
    assert first.prompt == rows_of("gsm8k.jsonl")[0]["question"] and first.verifier == "answer"
    assert demonstration(first) == rows_of("gsm8k.jsonl")[0]["answer"]  # the worked solution is what SFT learns
    assert all(verify(t, demonstration(t)).passed for t in tasks)
    assert verdicts(first, ["#### 6", "The answer is 6.", "\\boxed{6}", "$6", "6.0", "so 6 loaves"]) == [True] * 6
    # fooling: several candidates, a wrong one, working without a final answer, words
    # and numbers too large to parse in time, which would make an attempt an infrastructure failure
    fooled = ["6 or 7", "#### 6 7", "#### 7", "21 - 15 = 6", "six", "", "#### 6e999999999", "#### " + "6" * 5000]
    assert verdicts(first, fooled) == [False] * len(fooled)
    assert verify(first, "6 or 7").detail == "2 numbers in the final answer '6 or 7' (one expected)"
    assert verdicts(tasks[2], ["#### 900", "#### 900.00", "The farm keeps 900 chickens."]) == [True] * 3
    # tolerance, relative or absolute: 113 is within 1% of 112, not within 0.5
    loose = imported("gsm8k.jsonl", "gsm8k", kind="numeric", rel_tol=0.01)[1]
    assert verdicts(loose, ["#### 113", "#### 114"]) == [True, False]
    assert verdicts(imported("gsm8k.jsonl", "gsm8k", kind="numeric", abs_tol=0.5)[1], ["#### 112.4", "#### 113"]) == [True, False]


def test_math_exact_answers_normalised_and_attempts_to_fool_them():
    fraction, city = imported("math.jsonl", "math", kind="exact", prompt="problem", answer="solution")
    assert fraction.answer == "\\frac{5}{6}" and city.answer == "\\text{Paris}"  # the solution's \boxed{}
    assert verify(fraction, demonstration(fraction)).passed and verify(city, demonstration(city)).passed
    same = ["\\boxed{\\frac{5}{6}}", "The answer is $\\frac{5}{6}$.", "5/6", "\\dfrac{5}{6}"]
    assert verdicts(fraction, same) == [True] * len(same)
    assert verdicts(city, ["**Paris**.", "paris", "\\boxed{\\text{Paris}}", "Answer: PARIS!"]) == [True] * 4
    # fooling: a second candidate (only the last \boxed counts), a hedge, a near miss
    assert verdicts(fraction, ["\\boxed{\\frac{5}{6}} or \\boxed{1}", "5/6 or 1/2", "\\frac{5}{7}"]) == [False] * 3
    assert verdicts(city, ["Paris or Lyon", "Paris, France", "Pari"]) == [False] * 3


def test_a_list_of_answers_is_accepted_aliases(tmp_path):
    rows = [{"question": "Name the largest planet.", "answer": ["Jupiter", "planet Jupiter"]}]
    (task,) = import_answers(_rows(tmp_path / "trivia.jsonl", rows), AnswerFields(kind="exact"), domain="trivia")
    assert verdicts(task, ["Jupiter", "The answer is planet Jupiter.", "Saturn"]) == [True, True, False]


def test_mmlu_choice_from_parquet_and_attempts_to_fool_it(tmp_path):
    rows = rows_of("mmlu.jsonl")
    parquet = tmp_path / "mmlu.parquet"  # cais/mmlu is published as parquet: answer an int64 index
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    gas, product = import_answers(parquet, AnswerFields(kind="choice"), domain="mmlu")
    assert gas.answer == "B" and product.answer == "B"
    assert gas.prompt == (
        "Which gas do plants take in for photosynthesis?\n\nA. Oxygen\nB. Carbon dioxide\nC. Nitrogen\nD. Helium"
    )
    right = ["B", "(B)", "b", "**B**", "The answer is B.", "Answer: (B)", "B. Carbon dioxide", "Carbon dioxide", "option B"]
    assert verdicts(gas, right) == [True] * len(right)
    # fooling: every letter, two letters, a letter with another choice's text, out of range, nothing
    fooled = ["A B C D", "B or C", "The answer is A, B, C or D", "B. Oxygen", "E", "", "AB"]
    assert verdicts(gas, fooled) == [False] * len(fooled)
    assert verify(gas, "A B C D").detail == "no single choice in 'A B C D'"
    assert verdicts(product, ["42", "B) 42", "The answer is 42."]) == [True] * 3  # a choice's text names it


def test_reasoning_gym_checkers_and_attempts_to_fool_them():
    countdown, words = imported("reasoning_gym.jsonl", "rg", kind="checker")  # each row's metadata.source_dataset
    assert countdown.meta["answer"]["checker"] == "countdown" and words.meta["answer"]["checker"] == "word_sorting"
    assert countdown.meta["answer"]["entry"] == {
        k: rows_of("reasoning_gym.jsonl")[0][k] for k in ("question", "answer", "metadata")
    }
    assert demonstration(countdown) == "<answer>25*4 + 3</answer>"  # Reasoning Gym's answer tags
    assert verify(countdown, demonstration(countdown)).passed and verify(words, demonstration(words)).passed
    assert verdicts(countdown, ["<answer>3 + 4*25</answer>", "25*4+3"]) == [True, True]
    # fooling: a number used twice (Reasoning Gym's own scorer accepts it), numbers not given, a value
    # that only truncates to the target (Reasoning Gym's int() does), code instead of arithmetic
    fooled = ["25*4 + 7 - 4", "206/2", "25*4+7/2", "(25*4*7 + 21)/7", "__import__('os').system('touch /tmp/x')"]
    assert verdicts(countdown, fooled) == [False] * len(fooled)
    assert verify(countdown, "25*4 + 7 - 4").reward == 0.05 and verify(countdown, "__import__('os')").reward == 0.01
    sorted_wrong = verify(words, "fig, Apple, pear")  # the right words in the wrong order: 0.2, not a pass
    assert (sorted_wrong.reward, sorted_wrong.passed) == (0.2, False)
    # the import's checker overrides the rows': Reasoning Gym's default scorer, partial credit for containing it
    (oracle, _) = imported("reasoning_gym.jsonl", "rg", kind="checker", checker="oracle")
    hedge = verify(oracle, "<answer>25*4 + 3 or 25*4 + 7</answer>")
    assert not hedge.passed and 0 < hedge.reward < 1


@needs_sandbox
def test_apps_code_runs_against_hidden_cases_and_attempts_to_fool_it(tmp_path):
    add, sort = imported("apps.jsonl", "apps", kind="code", id="problem_id", time_limit_s=1)
    assert add.task_id == "apps-4001" and "input_output" not in add.prompt and "2000000000" not in add.prompt
    assert add.meta["answer"]["tests"]["outputs"] == ["5\n", "3\n", "2000000000\n"]
    assert verify(add, demonstration(add)).passed and verify(sort, demonstration(sort)).passed
    fenced = "Read both, add:\n```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```\n"
    assert verify(add, fenced).detail == "3 cases passed"
    # fooling: the example's output hard-coded, a crash, a hang past the time limit
    assert verify(add, "print(5)").detail == "case 2 of 3: wrong answer"
    assert verify(add, "raise SystemExit(3)").detail == "case 1 of 3: exit 3: "
    assert verify(add, "while True:\n    pass").detail == "case 1 of 3: time limit 1s exceeded"
    # ... and reading the expected outputs from wherever the tests are: it finds them when they are
    # reachable (a directory holding the set), not in the sandbox, which holds only program and input
    cheat = (
        "import json, os, sys\n"
        "given = sys.stdin.read()\n"
        "for top in ('.', '/tmp', '/workspace', '/work', '/root', '/home', os.environ.get('HOME', '.')):\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        dirs[:] = [d for d in dirs if d not in ('.venv', '.pyenv', 'site-packages', '.git')]\n"
        "        for name in files:\n"
        "            try:\n"
        "                text = open(os.path.join(root, name), errors='ignore').read()\n"
        "            except OSError:\n"
        "                continue\n"
        "            for line in text.splitlines():\n"
        "                try:\n"
        "                    tests = json.loads(json.loads(line)['input_output'])\n"
        "                except Exception:\n"
        "                    continue\n"
        "                if given in tests['inputs']:\n"
        "                    print(tests['outputs'][tests['inputs'].index(given)], end='')\n"
        "                    sys.exit(0)\n"
    )
    shutil.copy(FIXTURES / "apps.jsonl", tmp_path / "apps.jsonl")
    outside = subprocess.run([sys.executable, "-c", cheat], input="-7 10\n", cwd=tmp_path, capture_output=True, text=True)
    assert outside.stdout == "3\n"  # the cheat works where the cases can be read
    (patient,) = [
        t for t in imported("apps.jsonl", "apps", kind="code", id="problem_id", time_limit_s=20) if t.task_id == add.task_id
    ]
    assert verify(patient, cheat).detail == "case 1 of 3: wrong answer"  # found nothing: no time-out, no output


def test_ifeval_instructions_as_ifeval_checks_them():
    note, tips, rainbow = import_ifeval(FIXTURES / "ifeval.jsonl")
    assert note.task_id == "ifeval-1001" and note.verifier == "ifeval" and note.answer == ""
    assert verify(note, "Our grey cat is missing since Monday. Please call me if you see her.").passed
    commas = verify(note, "Our cat, a grey one, is missing.")
    assert (commas.reward, commas.passed, commas.detail) == (0.5, False, "not followed: punctuation:no_comma")
    assert not verify(note, "word " * 40).passed  # 40 words is not less than 40
    good_tips = "* Focus on one thing\n* Take a break every hour\n* Silence your phone\nIs there anything else I can help with?"
    assert verify(tips, good_tips).passed
    assert not verify(tips, good_tips.replace("* Silence your phone\n", "")).passed  # two bullets, three asked
    assert not verify(tips, good_tips + " Bye.").passed  # words after the end phrase
    assert verify(rainbow, '```json\n{"colours": 7}\n```').passed and not verify(rainbow, "A rainbow has seven colours.").passed
    empty = verify(tips, "  ")  # IFEval's strict test: an empty response follows nothing
    assert (empty.reward, empty.passed) == (0.0, False)


IFEVAL_CASES = [  # (instruction id, kwargs, a response that follows it, one that does not), as IFEval judges
    ("keywords:forbidden_words", {"forbidden_words": ["cat"]}, "A dog and a catalogue.", "The Cat sat."),
    ("keywords:frequency", {"keyword": "sun", "frequency": 2, "relation": "at least"}, "Sun, sun.", "One sun."),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "less than"}, "Zoo.", "Zzz."),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One.\n***\nTwo.", "One.\n***\n***\nTwo."),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "then"},
        "First.\n\nThen, second.",
        "First.\n\nNext, second.",
    ),
    ("detectable_format:title", {}, "<<Ode to Joy>>\nText.", "<< >>\nText."),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", "*one* and ** **"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\na\nSection 2\nb",
        "Section 1\na",
    ),
    ("detectable_format:constrained_response", {}, "My answer is no.", "No."),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "At [address] on [date].", "At [address]."),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. bye", "Hi. PS bye"),
    ("startend:quotation", {}, '"Quoted."', '"Half quoted.'),
    ("combination:two_responses", {}, "First.\n******\nSecond.", "Same.\n******\nSame."),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say hi."}, "say hi. Hi!", "Hi! Say hi."),
]


def test_each_ifeval_instruction_as_ifeval_checks_it():
    for iid, kwargs, good, bad in IFEVAL_CASES:
        (instruction,) = parse_instructions([iid], [kwargs])
        assert followed(good, [instruction]) == [True], iid
        assert followed(bad, [instruction]) == [False], iid


def test_ifeval_parquet_form_with_null_arguments(tmp_path):
    """The parquet form of google/IFEval gives every kwargs map every argument, null where unused."""
    keys = ["num_words", "relation", "num_bullets", "keywords", "end_phrase"]
    rows = [
        r | {"kwargs": [{k: (kw.get(k)) for k in keys} for kw in r["kwargs"]]}
        for r in rows_of("ifeval.jsonl")
        if "detectable_format:json_format" not in r["instruction_id_list"]
    ]
    parquet = tmp_path / "ifeval.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    note, tips = import_ifeval(parquet)
    assert note.meta["ifeval"]["instructions"][1] == {
        "id": "length_constraints:number_words",
        "kwargs": {"num_words": 40, "relation": "less than"},
    }
    assert tips.meta["ifeval"]["instructions"][0]["kwargs"] == {"num_bullets": 3}


# ---------------------------------------------------------------- bad input


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_input_names_file_row_and_field(tmp_path):
    ok = {"question": "1+1?", "answer": "2", "answer_kind": "numeric"}
    cases = [
        ([ok, {"question": "2+2?", "answer": "4", "answer_kind": "guess"}], {}, r":2: answer_kind 'guess' is not an answer kind"),
        ([ok, {"question": "2+2?", "answer_kind": "numeric"}], {}, r":2: missing answer$"),
        ([ok, {"question": "2+2?", "answer": None, "answer_kind": "numeric"}], {}, r":2: missing answer$"),
        ([{"question": "2+2?", "answer": "4"}], {}, r":1: missing answer_kind \(the import names no answers.kind"),
        ([ok, ok], {}, r":2: question: the same prompt as .*:1"),
        (
            [ok | {"n": 1}, {"question": "3+3?", "answer": "6", "n": 1}],
            {"kind": "numeric", "id": "n"},
            r":2: n: 1 is also the id of",
        ),
        (
            [{"question": "?", "answer": "about four"}],
            {"kind": "numeric"},
            r":1: answer: 'about four' does not end in one number",
        ),
        (
            [{"question": "?", "answer": 7, "choices": ["a", "b"]}],
            {"kind": "choice"},
            r":1: answer: 7 names none of the 2 choices",
        ),
        (
            [{"question": "?", "answer": "x", "metadata": {"source_dataset": "sudoku"}}],
            {"kind": "checker"},
            r":1: checker 'sudoku'",
        ),
        (
            [{"question": "?", "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [1]})}],
            {"kind": "code"},
            r":1: input_output: call-based tests \(fn_name\) are not supported",
        ),
        ([{"question": "?", "input_output": json.dumps({"inputs": ["1"], "outputs": []})}], {"kind": "code"}, "equal length"),
        ([{"question": "?"}], {"kind": "code"}, r":1: missing input_output$"),
    ]
    for i, (rows, fields, error) in enumerate(cases):
        path = _rows(tmp_path / f"bad{i}.jsonl", rows)
        with pytest.raises(TaskImportError, match=rf"^{path}{error}" if error.startswith(":") else error):
            import_answers(path, AnswerFields(**fields))
    base = {"key": 1, "prompt": "Write.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    bad_ifeval = [
        ({"instruction_id_list": ["keywords:rhyme"]}, r":1: unknown instruction id 'keywords:rhyme'"),
        ({"instruction_id_list": ["language:response_language"], "kwargs": [{"language": "de"}]}, "not supported here"),
        (
            {"instruction_id_list": ["keywords:existence"], "kwargs": [{"keywords": ["(unclosed"]}]},
            "not a valid regular expression",
        ),
        ({"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5}]}, "kwargs lack 'relation'"),
        (
            {"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5, "relation": "about"}]},
            "relation 'about' is not one of less than, at least",
        ),
        ({"kwargs": [{}, {}]}, "kwargs: expected a list of 1 argument maps"),
        ({"prompt": None}, r":1: missing prompt$"),
    ]
    for i, (change, error) in enumerate(bad_ifeval):
        path = _rows(tmp_path / f"ifeval{i}.jsonl", [base | change])
        with pytest.raises(TaskImportError, match=rf"^{path}{error}" if error.startswith(":") else error):
            import_ifeval(path)


def test_config_checks(tmp_path):
    problems = dict(
        TasksConfig(
            imports=[
                TaskImport(format="answers", path="/d/qa.csv", domain="qa"),
                TaskImport(format="answers", path="/d/qa.jsonl", domain="qa", answers=AnswerFields(checker="nope")),
                TaskImport(format="ifeval", path="/d/if.jsonl"),
                TaskImport(format="answers", path="/d/qa.jsonl", domain="qa", repos_dir="/r"),
                TaskImport(format="swebench", path="/d/s.jsonl", repos_dir="/r", answers=AnswerFields(kind="numeric")),
                TaskImport(format="answers", path="/d/ok.parquet", domain="qa", answers=AnswerFields(kind="numeric")),
            ]
        ).problems()
    )
    assert problems == {
        "imports[0].path": "answers reads a .jsonl, .json or .parquet file",
        "imports[1].answers.checker": "unknown checker 'nope' (known: countdown, oracle, word_sorting)",
        "imports[2].domain": "name the domain of the ifeval set (e.g. gsm8k, ifeval)",
        "imports[3].repos_dir": "answers tasks are not repositories: no repos_dir",
        "imports[4].answers": "only format answers reads answers",
    }
    bad_kind = tmp_path / "bad.yaml"
    bad_kind.write_text(
        "name: t\nstages:\n  tasks:\n    kind: tasks\n    imports:\n"
        "      - {format: answers, path: /d/q.jsonl, domain: q, answers: {kind: guess}}\n"
    )
    with pytest.raises(UserError, match=r"stages\.tasks\.imports.*kind.*guess"):
        config_mod.load(bad_kind)


# ---------------------------------------------------------------- through the stages

CONFIG = """\
name: qa
seed: 5
executor: {{kind: local, max_parallel: 1}}
stages:
  tasks:
    kind: tasks
    imports:
      - {{format: answers, path: {f}/gsm8k.jsonl, domain: gsm8k, val_count: 1, answers: {{kind: numeric}}}}
      - {{format: answers, path: {mmlu}, domain: mmlu, val_count: 1, answers: {{kind: choice}}}}
      - {{format: ifeval, path: {f}/ifeval.jsonl, domain: ifeval, val_count: 3}}
  sft:
    kind: sft
    needs: [tasks]
    model: test-micro
    tokenizer_vocab_size: 300
    seq_len: 96
    batch_rows: 2
    steps: 1
    warmup_steps: 0
    save_every: 1
    threads: 1
    eval_tasks: 1
    eval_max_new_tokens: 2
  eval:
    kind: evaluate
    needs: [tasks, sft]
    checkpoints: ["sft:final"]
    attempts: 1
    pass_k: [1]
    max_tokens: 4
    bootstrap_samples: 10
"""


def test_imported_sets_run_through_tasks_and_evaluate_with_their_sources_recorded(tmp_path):
    mmlu = tmp_path / "mmlu.parquet"
    pq.write_table(pa.Table.from_pylist(rows_of("mmlu.jsonl")), mmlu)
    (tmp_path / "run.yaml").write_text(CONFIG.format(f=FIXTURES, mmlu=mmlu))
    run = RunDir.create(config_mod.load(tmp_path / "run.yaml"), tmp_path / "run")
    for stage in ("tasks", "sft", "eval"):
        assert run_unit(run.path, stage) == 0, stage
    tasks_dir = run.stage_dir("tasks")
    val = load_tasks(tasks_dir, "val")
    assert sorted(t.domain for t in val) == ["gsm8k", "ifeval", "ifeval", "ifeval", "mmlu"]
    # the task manifest: each source's sha256 as read, hashed in turn with the unit's outputs
    sources = json.loads((tasks_dir / SOURCES).read_text())["imports"]
    digest = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()  # noqa: E731
    assert [(s["format"], s["domain"], s["sha256"], s["train"], s["val"]) for s in sources] == [
        ("answers", "gsm8k", digest(FIXTURES / "gsm8k.jsonl"), 2, 1),
        ("answers", "mmlu", digest(mmlu), 1, 1),
        ("ifeval", "ifeval", digest(FIXTURES / "ifeval.jsonl"), 0, 3),
    ]
    assert SOURCES in json.loads((tasks_dir / "manifest.json").read_text())["files"]
    # evaluate scored every imported domain with the default verifier (in its worker process)
    results = json.loads((run.stage_dir("eval") / "results.json").read_text())
    groups = results["checkpoints"]["sft:final"]["groups"]
    assert {"gsm8k", "mmlu", "ifeval"} <= set(groups) and groups["all"]["infra_failures"] == 0
    # the card's data section names each source with its sha256
    lines = card._task_sources(card.Facts(RunDir.open(run.path)))
    assert lines[0].startswith("- Imported task set (`tasks`, `answers`, domain gsm8k): ")
    assert all(s["sha256"] in line for s, line in zip(sources, lines, strict=True))
    assert run.is_done(Unit("eval"))


def test_a_bad_row_stops_the_tasks_stage_with_one_line_and_exit_2(tmp_path):
    bad = _rows(tmp_path / "qa.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}])
    (tmp_path / "run.yaml").write_text(
        "name: bad\nstages:\n  tasks:\n    kind: tasks\n    imports:\n"
        f"      - {{format: answers, path: {bad}, domain: qa, answers: {{kind: numeric}}}}\n"
    )
    run = RunDir.create(config_mod.load(tmp_path / "run.yaml"), tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "snowcat.stages", str(run.path), "tasks"], capture_output=True, text=True)
    line = f"error: stages.tasks.imports[0]: {bad}:2: missing answer"
    # the stage's streams are its log (scrubbed of credentials): the error is its last line, no traceback
    assert proc.returncode == 2 and proc.stdout.strip().splitlines()[-1] == line and "Traceback" not in proc.stdout
    assert RunDir.open(run.path).record("tasks")["error"] == line.replace("error: ", "UserError: ", 1)


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is \\boxed{42}. Wait, \\boxed{43}",
        "#### 42\n#### 43",
        "Final answer: 42 (not 41)",
        "<answer>42</answer><answer>43</answer>",
    ],
)
def test_two_final_answers_earn_nothing_numeric(completion):
    from snowcat.stages.taskgen.answer_kinds import _numeric  # noqa: PLC0415

    assert _numeric("42", {"value": "42"}, completion)[:2] == (0.0, False)
    assert _numeric("42", {"value": "42"}, "Final answer: 42")[:2] == (1.0, True)


@pytest.mark.parametrize("completion", ["Answer: B\nAnswer: C", "Answer: Berlin, Rome", "Answer: B) Berlin C) Rome"])
def test_two_choices_earn_nothing(completion):
    from snowcat.stages.taskgen.answer_kinds import _choice  # noqa: PLC0415

    choices = {"choices": ["Paris", "Berlin", "Rome", "Oslo"]}
    assert _choice("B", choices, completion)[:2] == (0.0, False)
    assert _choice("B", choices, "Answer: B")[:2] == (1.0, True)
