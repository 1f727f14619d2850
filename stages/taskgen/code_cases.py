"""Competitive-coding verification: the completion's program against hidden test cases.

Cases are what competitive-coding sets publish (APPS, TACO: `input_output` = {"inputs": [...],
"outputs": [...]}), of two kinds:

  stdin/stdout  one string per case. Each case runs in a sandbox of its own (stages/sandbox.py: no
                network, a fresh work dir holding only the program and that case's input, hard
                limits), under the case's time limit; the program's stdout is compared with the
                expected output here, outside the sandbox, as APPS' harness does first:
                whitespace-separated tokens, so trailing spaces and newlines do not matter.
  call-based    `fn_name` set: each case is a list of arguments and the value the function returns.
                One sandbox runs every case: call_harness.py loads the program and calls the
                function per case in a worker process, which a watcher kills at the time limit
                (per call), and writes back what each call returned, raised or ran out of. The
                expected values never enter the sandbox; they are compared here as APPS' and
                TACO's graders compare them (`same_return`). The program shares the worker's
                process and may rewrite it, but all it can forge is the values it returned, and an
                unreadable outcome fails.

The first failing case ends the verification (reward 0); all passing is reward 1. A time-out, a
limit or a crash is the program's failure; a sandbox that could not run it is the verifier's
(`VerifierError`: an infrastructure failure, never counted against the model).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from snowcat.stages.sandbox import Limits, SandboxResult, open_sandbox

from . import call_harness
from .verdict import VerifierError

TIME_LIMIT_S = 4.0  # per case, where the set gives none
MEMORY_BYTES = 1 << 30
PROGRAM = "solution.py"
INPUT = "input.txt"
HARNESS = "call_harness.py"
WALL_SLACK_S = 1.0  # call-based: the sandbox's wall time past the harness's own limits
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)


def program_of(completion: str) -> str:
    """The program a completion gives: its last fenced code block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def same_output(got: str, want: str) -> bool:
    return got.split() == want.split()


def _text(value) -> str:
    """A case's input or output as one string (some sets publish a case as a list of lines)."""
    return "\n".join(map(str, value)) + "\n" if isinstance(value, list) else str(value)


def _python(image: str | None) -> str:
    return "python3" if image else sys.executable  # the host's interpreter is exposed to LocalSandbox


def _limits(seconds: float) -> Limits:
    return Limits(cpu_s=max(1, int(seconds) + 1), memory_bytes=MEMORY_BYTES, nproc=64, output_bytes=1 << 22)


def run_cases(program: str, tests: dict, time_limit_s: float, image: str | None = None) -> tuple[float, bool, str]:
    """(reward, passed, detail) of `program` on `tests` ({"inputs": [...], "outputs": [...]}, and
    `fn_name` where the cases are calls)."""
    if not program.strip():
        return 0.0, False, "no program in the completion"
    if tests.get("fn_name"):
        return run_calls(program, tests, time_limit_s, image)
    python, limits = _python(image), _limits(time_limit_s)
    cases = list(zip(tests["inputs"], tests["outputs"], strict=True))
    for i, (given, want) in enumerate(cases, 1):
        with open_sandbox(image=image, limits=limits) as box:
            # stdin from the case's file: the sandbox's own stdin is /dev/null
            r = box.run(
                f"{python} -I {PROGRAM} < {INPUT}",
                files={PROGRAM: program, INPUT: _text(given)},
                timeout_s=time_limit_s,
            )
        where = f"case {i} of {len(cases)}"
        if r.status == "infra_error":
            raise VerifierError(f"sandbox: {r.detail}")
        if r.status == "timeout":
            return 0.0, False, f"{where}: time limit {time_limit_s:g}s exceeded"
        if r.status == "limit":
            return 0.0, False, f"{where}: {r.detail}"
        if r.exit_code != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            return 0.0, False, f"{where}: exit {r.exit_code}: {last[:120]}"
        if not same_output(r.stdout, _text(want)):
            return 0.0, False, f"{where}: wrong answer"
    return 1.0, True, f"{len(cases)} cases passed"


# ---------------------------------------------------------------- call-based cases


def run_calls(program: str, tests: dict, time_limit_s: float, image: str | None = None) -> tuple[float, bool, str]:
    """(reward, passed, detail) of `program`'s function `tests["fn_name"]` on the cases' arguments,
    every case in one sandbox; the expected values stay here."""
    inputs, outputs = tests["inputs"], tests["outputs"]
    spec = {"fn_name": tests["fn_name"], "inputs": inputs, "time_limit_s": time_limit_s}
    # the harness's watcher ends loading and each call at the time limit; the sandbox's wall time
    # (a second more) holds where the program stopped the watcher
    wall = time_limit_s * (len(inputs) + 1) + WALL_SLACK_S
    files = {HARNESS: _harness_source(), call_harness.PROGRAM: program, call_harness.CASES: json.dumps(spec)}
    with open_sandbox(image=image, limits=_limits(wall)) as box:
        r = box.run(f"{_python(image)} -I {HARNESS}", files=files, timeout_s=wall)
    if r.status == "infra_error":
        raise VerifierError(f"sandbox: {r.detail}")
    return judge_calls(r, outputs, time_limit_s)


def _harness_source() -> str:
    return Path(call_harness.__file__).read_text()


def judge_calls(r: SandboxResult, outputs: list, time_limit_s: float) -> tuple[float, bool, str]:
    """The verdict on the harness's run `r`: each case's outcome against its expected value."""
    try:
        outcomes = read_outcomes(r.stdout)
    except (ValueError, TypeError, RecursionError):
        if r.status != "ok":  # killed at a limit mid-line (output cut at the cap, the wall time)
            return 0.0, False, _stopped(r, time_limit_s)
        return 0.0, False, "unreadable outcomes: something besides the harness wrote to its output"
    if outcomes and "load" in outcomes[0]:
        return 0.0, False, f"the program did not load: {_line(outcomes[0]['load'])}"
    if len(outcomes) > len(outputs):
        return 0.0, False, "unreadable outcomes: more than there are cases"
    for i, want in enumerate(outputs):
        where = f"case {i + 1} of {len(outputs)}"
        if i == len(outcomes):
            return 0.0, False, f"{where}: {_stopped(r, time_limit_s)}"
        outcome = outcomes[i]
        if "timeout" in outcome:
            return 0.0, False, f"{where}: time limit {time_limit_s:g}s exceeded"
        if "error" in outcome:
            return 0.0, False, f"{where}: {_line(outcome['error'])}"
        if not same_return(outcome["value"], want):
            return 0.0, False, f"{where}: wrong answer"
    if r.status != "ok":  # every call returned, then something ran on past a limit (a thread, an atexit hook)
        return 0.0, False, f"after the last case: {r.detail}"
    return 1.0, True, f"{len(outputs)} cases passed"


def _line(text: str) -> str:
    """The program's words (an exception's message) as one short line of a verdict's detail."""
    return " ".join(text.split())[:160]


def _stopped(r: SandboxResult, time_limit_s: float) -> str:
    """Why the harness wrote no outcome for a case: the program stopped the process, or outlasted
    the alarm (it may have disarmed it) until the sandbox's wall time."""
    if r.status == "timeout":
        return f"time limit {time_limit_s:g}s exceeded"
    if r.status == "limit":
        return r.detail
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return f"the program ended the harness (exit {r.exit_code}) {last[:120]}".rstrip()


def read_outcomes(stdout: str) -> list[dict]:
    """The harness's lines, checked: {"load": why} alone, or {"case": i, and one of value, error,
    timeout} for i = 0, 1, ... where only the last may be other than a value; values decoded.
    ValueError (or TypeError, RecursionError) for anything else: only the program writes otherwise."""
    out: list[dict] = []
    for line in stdout.splitlines():
        o = json.loads(line)
        ended = bool(out) and ("value" not in out[-1])
        if ended or not isinstance(o, dict) or len(o) != (1 if "load" in o else 2):
            raise ValueError("not a harness outcome")
        if "load" in o:
            if out or not isinstance(o["load"], str):
                raise ValueError("a load outcome after the cases")
        elif type(o.get("case")) is not int or o["case"] != len(out):
            raise ValueError("cases out of order")
        elif "value" in o:
            o["value"] = decode(o["value"])
        elif not (isinstance(o.get("error"), str) or o.get("timeout") is True):
            raise ValueError("not a harness outcome")
        out.append(o)
    return out


class Opaque:
    """A returned value the harness could not write as data (a set, an object): equal to nothing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __eq__(self, other) -> bool:
        return False

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self.kind}>"


def decode(tree):
    """A value from the harness's tagged JSON (call_harness.encode); ValueError for anything else."""
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, dict) and len(tree) == 1:
        ((tag, body),) = tree.items()
        if tag in ("list", "tuple") and isinstance(body, list):
            items = [decode(v) for v in body]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            return {decode(k): decode(v) for k, v in body}  # an unhashable key: TypeError
        if tag == "other" and isinstance(body, str):
            return Opaque(body)
    raise ValueError(f"not a returned value: {str(tree)[:60]}")


def _int_keys(want):
    """As APPS and TACO: an expected dict (or a list whose first item is one) whose keys all read as
    ints becomes [that dict keyed by int] (JSON made the keys strings)."""
    if isinstance(want, dict):
        target = want
    elif isinstance(want, list) and want and isinstance(want[0], dict):
        target = want[0]
    else:
        return want
    try:
        return [{int(k): v for k, v in target.items()}]
    except (TypeError, ValueError):
        return want


def same_return(got, want) -> bool:
    """Whether a call that returned `got` passes a case expecting `want`, as APPS' and TACO's graders
    decide: a returned tuple counts as a list; it passes when equal to `want`, or to `want[0]` where
    `want` is a non-empty list (the sets wrap most expected values in one); a returned sequence of
    tuples also when its items as lists equal `want[0]`. Plain `==` on plain data: ints equal
    floats of the same value (1 == 1.0), as there."""
    want = _int_keys(want)
    got = list(got) if isinstance(got, tuple) else got
    wrapped = isinstance(want, list) and len(want) > 0
    try:
        if got == want or (wrapped and got == want[0]):
            return True
        if wrapped and isinstance(got, list) and got and isinstance(got[0], tuple):
            return [list(x) for x in got] == want[0]
    except (TypeError, RecursionError):  # an item list() cannot take; a value nested past the stack
        return False
    return False
