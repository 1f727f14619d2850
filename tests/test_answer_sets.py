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

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.reports import card
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit
from snowcat.stages.config import AnswerFields, TaskImport, TasksConfig
from snowcat.stages.evaluate import summarize
from snowcat.stages.sandbox import SandboxResult
from snowcat.stages.scoring import Attempt
from snowcat.stages.taskgen import Task, demonstration, load_tasks, verify
from snowcat.stages.taskgen.answer_sets import import_answers, import_ifeval
from snowcat.stages.taskgen.call_harness import encode
from snowcat.stages.taskgen.code_cases import Opaque, decode, judge_calls, read_outcomes, same_return
from snowcat.stages.taskgen.ifeval import followed, loose_variants, parse_instructions
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


# ---------------------------------------------------------------- call-based code cases (fn_name)

# Cheats on the call-based harness, each with what it tries. The program runs in the harness's own
# process, so each can rewrite the harness; none may pass: the expected values never enter the
# sandbox and are compared outside it, on plain data read back from the harness's channel.
CALL_CHEATS = {  # what it tries: (the program, how it fails)
    "a value equal to everything": (
        "class Any:\n    def __eq__(self, other):\n        return True\ndef min_max(n):\n    return Any()\n",
        "case 1 of 3: wrong answer",
    ),
    "a list equal to everything": (
        "class L(list):\n    def __eq__(self, other):\n        return True\ndef min_max(n):\n    return L()\n",
        "case 1 of 3: wrong answer",
    ),
    "builtins patched": (
        "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.len = lambda *a: 0\ndef min_max(n):\n    return None\n",
        "case 1 of 3: the program ended the harness (exit 0) TypeError",
    ),
    "a verdict printed": (
        'print(\'3 cases passed\')\nprint(\'{"case": 0, "value": {"list": [1, 9]}}\')\n'
        "def min_max(n):\n    print('PASS')\n    return None\n",
        "case 1 of 3: wrong answer",
    ),
    # the harness's own encoder replaced: every case claims the value of the question's example
    "the harness patched": (
        "import __main__\n__main__.encode = lambda value: {'list': [1, 9]}\ndef min_max(n):\n    return None\n",
        "case 2 of 3: wrong answer",
    ),
    "outcomes written to the harness's channel, then exit": (
        "import os\nfor fd in range(3, 10):\n    try:\n"
        '        os.write(fd, b\'\'.join(b\'{"case": %d, "value": {"other": "Any"}}\\n\' % i for i in range(3)))\n'
        "    except OSError:\n        pass\nos._exit(0)\n",
        "case 1 of 3: wrong answer",
    ),
    "an outcome nested past the verifier's stack": (
        "import os\nfor fd in range(3, 10):\n    try:\n"
        "        os.write(fd, b'{\"case\": 0, \"value\": ' + b'{\"list\": [' * 100000 + b']}' * 100000 + b'}\\n')\n"
        "    except OSError:\n        pass\ndef min_max(n):\n    return [1, 9]\n",
        "unreadable outcomes",
    ),
    "an outcome the verifier cannot hold (a list as a dict key)": (
        "import os\nfor fd in range(3, 10):\n    try:\n"
        '        os.write(fd, b\'{"case": 0, "value": {"dict": [[{"list": []}, 1]]}}\\n\')\n'
        "    except OSError:\n        pass\nos._exit(0)\n",
        "unreadable outcomes",
    ),
    "os._exit before any call": ("import os\nos._exit(0)\n", "case 1 of 3: the program ended the harness (exit 0)"),
    "sys.exit in the call": ("import sys\ndef min_max(n):\n    sys.exit(0)\n", "case 1 of 3: raised SystemExit: 0"),
    "the time-out swallowed": (
        "import signal\nfor s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):\n    signal.signal(s, signal.SIG_IGN)\n"
        "def min_max(n):\n    while True:\n        try:\n            while True:\n                pass\n"
        "        except BaseException:\n            pass\n",
        "case 1 of 3: time limit 0.4s exceeded",
    ),
    "the watcher killed": (
        "import os, signal\ndef min_max(n):\n    os.kill(os.getppid(), signal.SIGKILL)\n    while True:\n        pass\n",
        "case 1 of 3: the program ended the harness",
    ),
    # the one signal the watcher cannot ignore: the sandbox's wall time ends the run, (cases + 1) limits
    "the watcher stopped": (
        "import os, signal\ndef min_max(n):\n    os.kill(os.getppid(), signal.SIGSTOP)\n    while True:\n        pass\n",
        "case 1 of 3: time limit 0.4s exceeded",
    ),
}

# reads the expected values wherever a set with its tests can be read: it finds them when they are
# reachable (a directory holding the set), not in the sandbox, which holds only the arguments
READ_EXPECTED = """\
import json, os
def min_max(numbers):
    for top in ('.', '/tmp', '/workspace', '/work', '/root', '/home'):
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d not in ('.venv', '.pyenv', 'site-packages', '.git')]
            for name in files:
                try:
                    lines = open(os.path.join(root, name), errors='ignore').read().splitlines()
                except OSError:
                    continue
                for line in lines:
                    try:
                        row = json.loads(line)
                        tests = json.loads(row['input_output']) if 'input_output' in row else row
                        return tests['outputs'][tests['inputs'].index([numbers])][0]
                    except Exception:
                        continue
"""


def call_tasks(time_limit_s: float = 1.0) -> list:
    return imported("apps_call.jsonl", "apps", kind="code", id="problem_id", time_limit_s=time_limit_s)


@needs_sandbox
def test_call_based_code_passes_as_apps_and_taco_grade_it():
    min_max, pairs, lengths = call_tasks()
    tests = rows_of("apps_call.jsonl")[0]["input_output"]
    assert min_max.meta["answer"]["tests"] == json.loads(tests)  # fn_name, inputs (argument lists), outputs
    assert "Define the function" not in min_max.prompt  # the starter code names it
    assert lengths.prompt.endswith("Define the function `count_lengths`: the tests call it and check what it returns.")
    assert [verify(t, demonstration(t)).detail for t in (min_max, pairs, lengths)] == ["3 cases passed"] * 2 + ["2 cases passed"]


@needs_sandbox
def test_call_based_code_takes_what_apps_and_taco_take():
    """A tuple is a list, a list of tuples a list of lists; the expected dict's keys are ints again;
    the program's prints do not matter."""
    min_max, pairs, lengths = call_tasks()
    as_tuple = "def min_max(n):\n    print('debugging', n)\n    return min(n), max(n)\n"
    tuples = (
        "class Solution:\n    def pairSums(self, nums, target):\n"
        "        return [(i, j) for i in range(len(nums)) for j in range(i + 1, len(nums)) if nums[i] + nums[j] == target]\n"
    )
    assert verify(min_max, as_tuple).passed and verify(pairs, tuples).passed
    assert not verify(lengths, "def count_lengths(words):\n    return {str(k): v for k, v in {3: 2, 5: 1}.items()}\n").passed


CALL_FAILURES = {  # a program: how its verdict names its failure
    "def min_max(n):\n    return [1, 9]\n": "case 2 of 3: wrong answer",  # the question's example hard-coded
    "def min_max(n):\n    return {1, 9}\n": "case 1 of 3: wrong answer",  # a set is no list
    "def min_max(n):\n    return 1 / 0\n": "case 1 of 3: raised ZeroDivisionError: division by zero",
    "def min_max(n):\n    while True:\n        pass\n": "case 1 of 3: time limit 0.4s exceeded",
    "def min_max(n):\n    n.append(n)\n    return n\n": "case 1 of 3: returned a value that cannot be written: RecursionError",
    "x = = 1": "the program did not load: SyntaxError: invalid syntax (solution.py, line 1)",
    "def max_min(n):\n    pass\n": "the program did not load: LookupError: no function 'min_max' in the program",
    "input()": "the program did not load: EOFError: EOF when reading a line",
    "": "no program in the completion",
}


@needs_sandbox
@pytest.mark.parametrize("program", list(CALL_FAILURES), ids=range(len(CALL_FAILURES)))
def test_call_based_code_failures_named_per_case(program):
    (min_max, *_) = call_tasks(time_limit_s=0.4)
    assert verify(min_max, program).detail[: len(CALL_FAILURES[program])] == CALL_FAILURES[program]


@needs_sandbox
@pytest.mark.parametrize("cheat", sorted(CALL_CHEATS))
def test_call_based_code_cannot_be_forged(cheat):
    (min_max, *_) = call_tasks(time_limit_s=0.4)
    program, failure = CALL_CHEATS[cheat]
    v = verify(min_max, program)
    assert (v.reward, v.passed, v.detail[: len(failure)]) == (0.0, False, failure)


@needs_sandbox
def test_call_based_code_cannot_read_the_expected_values(tmp_path):
    shutil.copy(FIXTURES / "apps_call.jsonl", tmp_path / "apps_call.jsonl")
    outside = subprocess.run(
        [sys.executable, "-c", READ_EXPECTED + "print(min_max([3, 1, 9]))"], cwd=tmp_path, capture_output=True, text=True
    )
    assert outside.stdout == "[1, 9]\n"  # the cheat works where the set can be read
    (min_max, *_) = call_tasks(time_limit_s=20)
    assert verify(min_max, READ_EXPECTED).detail == "case 1 of 3: wrong answer"  # found nothing: None


def test_call_based_outcomes_compared_as_apps_and_taco_do():
    assert same_return([1, 9], [[1, 9]]) and same_return((1, 9), [[1, 9]]) and same_return([1, 9], [1, 9])
    assert same_return([(0, 3), (1, 2)], [[[0, 3], [1, 2]]]) and same_return(5, [5]) and same_return(5.0, [5])
    assert same_return({3: 2}, [{"3": 2}]) and same_return({3: 2}, {"3": 2}) and same_return(None, [None])
    assert same_return(True, [1])  # Python's == as theirs: True == 1
    assert not same_return({"3": 2}, [{"3": 2}])  # the expected keys read as ints: a str-keyed dict differs
    assert not same_return([1, 9], [[9, 1]]) and not same_return({1, 9}, [[1, 9]]) and not same_return([1], [[[1]]])
    assert not same_return(Opaque("Any"), [Opaque("Any")]) and not same_return(float("nan"), [float("nan")])


def test_call_based_outcomes_read_strictly():
    # what the harness writes keeps tuples, int keys and numbers apart; what is not data equals nothing
    value = [(1, "a"), {2: [3.5, None]}, True, 7, {4}]
    back = decode(json.loads(json.dumps(encode(value))))
    assert back[:4] == [(1, "a"), {2: [3.5, None]}, True, 7] and type(back[3]) is int and isinstance(back[4], Opaque)
    lines = lambda *outcomes: "".join(json.dumps(o) + "\n" for o in outcomes)  # noqa: E731
    read = read_outcomes(lines({"case": 0, "value": {"tuple": [1, {"dict": [[3, "x"]]}]}}, {"case": 1, "error": "raised E"}))
    assert read == [{"case": 0, "value": (1, {3: "x"})}, {"case": 1, "error": "raised E"}]
    assert read_outcomes(lines({"load": "SyntaxError"})) == [{"load": "SyntaxError"}]
    bad = [
        lines({"case": 1, "value": 1}),  # out of order
        lines({"case": 0, "value": 1}, {"case": 0, "value": 1}),  # a case twice
        lines({"case": 0, "timeout": True}, {"case": 1, "value": 1}),  # a case after a failed one
        lines({"case": 0, "value": 1}, {"load": "late"}),
        lines({"case": True, "value": 1}),
        lines({"case": 0, "value": 1, "passed": True}),  # a verdict is not an outcome
        lines({"case": 0, "value": [1, 9]}),  # an untagged list
        lines({"case": 0, "value": {"set": [1]}}),
        lines({"case": 0, "timeout": False}),
        "PASS\n",
    ]
    for text in bad:
        with pytest.raises((ValueError, TypeError)):
            read_outcomes(text)


def test_call_based_verdicts_from_the_harness_run():
    """What the sandbox's status says where the outcomes stop short (no sandbox needed)."""
    line = lambda o: json.dumps(o) + "\n"  # noqa: E731
    done = line({"case": 0, "value": {"list": [1, 9]}})

    def run(stdout: str, status: str = "ok", detail: str = "", code: int = 0, stderr: str = "") -> SandboxResult:
        return SandboxResult(status, code, stdout, stderr, detail=detail)

    assert judge_calls(run(done), [[[1, 9]]], 1.0) == (1.0, True, "1 cases passed")
    assert judge_calls(run(done, "timeout", "wall time 2s"), [[[1, 9]]], 1.0)[2] == "after the last case: wall time 2s"
    assert judge_calls(run(done + '{"case": 1, "va', "timeout"), [[[1, 9]], [[2, 3]]], 1.0)[2] == "time limit 1s exceeded"
    assert judge_calls(run(done, "limit", "memory for the call"), [[[1, 9]], [[2]]], 1.0)[2] == "case 2 of 2: memory for the call"
    assert judge_calls(run(done, code=3, stderr="boom\n"), [[[1, 9]], [[2]]], 1.0)[2] == (
        "case 2 of 2: the program ended the harness (exit 3) boom"
    )
    assert judge_calls(run(done + done.replace("0", "1")), [[[1, 9]]], 1.0)[2] == "unreadable outcomes: more than there are cases"


def test_call_based_rows_checked_at_import(tmp_path):
    cases = [
        ({"fn_name": "f-1", "inputs": [[1]], "outputs": [1]}, r":1: input_output: fn_name 'f-1' is not a Python name"),
        ({"fn_name": 3, "inputs": [[1]], "outputs": [1]}, r":1: input_output: fn_name 3 is not a Python name"),
        ({"fn_name": "f", "inputs": [1, 2], "outputs": [1, 2]}, r":1: input_output: call-based inputs must each be a list"),
    ]
    for i, (tests, error) in enumerate(cases):
        path = _rows(tmp_path / f"call{i}.jsonl", [{"question": "?", "input_output": json.dumps(tests)}])
        with pytest.raises(TaskImportError, match=rf"^{path}{error}"):
            import_answers(path, AnswerFields(kind="code"))


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
    assert empty.scores == {"loose_pass@1": 0.0, "loose_reward": 0.0}


def test_ifeval_loose_accuracy_beside_the_strict_reward():
    """IFEval's loose test forgives a first or last line and markdown asterisks; the reward stays strict."""
    note, tips, rainbow = import_ifeval(FIXTURES / "ifeval.jsonl")
    tips_text = "* Focus on one thing\n* Take a break every hour\n* Silence your phone\n"
    bold_end = verify(tips, tips_text + "**Is there anything else I can help with?**")  # asterisks
    assert (bold_end.reward, bold_end.passed) == (2 / 3, False)
    assert bold_end.scores == {"loose_pass@1": 1.0, "loose_reward": 1.0}
    preamble = verify(rainbow, 'Here is the JSON:\n```json\n{"colours": 7}\n```')  # a first line
    assert not preamble.passed and preamble.scores["loose_pass@1"] == 1.0
    signed = verify(tips, tips_text + "Is there anything else I can help with?\nCheers, your assistant")  # a last line
    assert not signed.passed and signed.scores["loose_pass@1"] == 1.0
    # loose is no free pass: one line removed at a time, and only at either end
    inside = verify(note, "Our cat is missing.\nShe is grey, and shy.\nPlease call.")
    assert not inside.passed and inside.scores == {"loose_pass@1": 0.0, "loose_reward": 0.5}
    assert verify(note, "Our cat is missing. Please call.").scores["loose_pass@1"] == 1.0  # strict implies loose
    assert loose_variants("a\n*b*\nc") == ["a\n*b*\nc", "a\nb\nc", "*b*\nc", "a\n*b*", "*b*", "b\nc", "a\nb", "b"]


def test_evaluate_averages_further_scores_as_it_does_the_reward():
    """Per task over its scored attempts, then over tasks: loose_pass@1 beside pass@1 (strict)."""
    one, two = (Task(f"ifeval-{i}", "ifeval", 1, f"prompt {i}", "", "ifeval") for i in (1, 2))
    attempts = [
        Attempt(one, 0, reward=1.0, passed=1, status="ok", scores={"loose_pass@1": 1.0}),
        Attempt(one, 1, reward=0.5, passed=0, status="ok", scores={"loose_pass@1": 1.0}),
        Attempt(two, 0, reward=0.0, passed=0, status="ok", scores={"loose_pass@1": 0.0}),
        Attempt(two, 1),  # an infrastructure failure: no scores, in no denominator
    ]
    s = summarize(attempts, [1])
    assert (s["pass@1"], s["scores"]["loose_pass@1"], s["scores"]["loose_pass@1_tasks"]) == (0.25, 0.5, 2)
    assert "scores" not in summarize([Attempt(one, 0, reward=1.0, passed=1, status="ok")], [1])


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
    # IFEval's loose accuracy beside the strict one (pass@1), only where the verifier gives it
    loose = groups["ifeval"]["scores"]
    assert set(loose) == {f"{n}{tail}" for n in ("loose_pass@1", "loose_reward") for tail in ("", "_se", "_tasks")}
    assert loose["loose_pass@1_tasks"] == 3 and loose["loose_pass@1"] >= groups["ifeval"]["pass@1"]
    assert "scores" not in groups["gsm8k"]
    metrics = json.loads((run.stage_dir("eval") / "metrics.json").read_text())
    assert metrics["sft:final/ifeval/loose_pass@1"] == loose["loose_pass@1"] and "sft:final/ifeval/loose_pass@1_se" not in metrics
    assert "sft:final/all/loose_pass@1" not in metrics  # "all" holds tasks without a loose score
    assert list(card.results._further_scores(groups["ifeval"])) == ["loose_pass@1", "loose_reward"]  # rows of the card's table
    assert card.results._further_scores(groups["all"]) == {}
    # the card's data section names each source with its sha256
    lines = card.training._task_sources(card.facts.Facts(RunDir.open(run.path)))
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
