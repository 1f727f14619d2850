"""Competitive-coding verification: the completion's program against hidden stdin/stdout cases.

Cases are what competitive-coding sets publish (APPS, TACO: `input_output` = {"inputs": [...],
"outputs": [...]}, one string per case). Each case runs in a sandbox of its own (stages/sandbox.py:
no network, a fresh work dir holding only the program and that case's input, hard limits), under
the case's time limit; the program's stdout is compared with the expected output here, outside the
sandbox, so nothing the program can read holds an expected output. Output is compared as APPS'
harness does first: whitespace-separated tokens, so trailing spaces and newlines do not matter.

The first failing case ends the verification (reward 0); all passing is reward 1. A time-out, a
limit or a crash is the program's failure; a sandbox that could not run it is the verifier's
(`VerifierError`: an infrastructure failure, never counted against the model).
"""

from __future__ import annotations

import re
import sys

from snowcat.stages.sandbox import Limits, open_sandbox

from .verdict import VerifierError

TIME_LIMIT_S = 4.0  # per case, where the set gives none
MEMORY_BYTES = 1 << 30
PROGRAM = "solution.py"
INPUT = "input.txt"
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


def run_cases(program: str, tests: dict, time_limit_s: float, image: str | None = None) -> tuple[float, bool, str]:
    """(reward, passed, detail) of `program` on `tests` ({"inputs": [...], "outputs": [...]})."""
    python = "python3" if image else sys.executable  # the host's interpreter is exposed to LocalSandbox
    limits = Limits(cpu_s=max(1, int(time_limit_s) + 1), memory_bytes=MEMORY_BYTES, nproc=64, output_bytes=1 << 22)
    cases = list(zip(tests["inputs"], tests["outputs"], strict=True))
    if not program.strip():
        return 0.0, False, "no program in the completion"
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
