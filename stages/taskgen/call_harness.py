"""The harness of call-based code cases, run inside the sandbox: `python3 -I call_harness.py`.

Two processes. The worker (a fork) loads the candidate's program (`solution.py`) as APPS and TACO do
(a module with their header of imports; `Solution()`'s method where the program defines
`class Solution`, else the top-level function), calls `fn_name(*arguments)` once per case, and
writes each case's outcome to the watcher as one JSON line: the returned value as a tagged tree
(`encode`) or the exception it raised. The watcher never runs the program's code: it relays the
outcomes to stdout and SIGKILLs the worker when loading or a call outlasts the time limit, which
no `except:` and no signal handler in the program can stop; then it writes the time-out and exits,
and the sandbox's PID namespace takes whatever the program left running.

Nothing here decides whether a case passed: the expected outputs never enter the sandbox
(`cases.json` holds only `fn_name`, the arguments and the time limit), and the verifier compares
the values it reads back (stages/taskgen/code_cases.py). The worker runs the program in its own
process and the program can rewrite anything there, but all it can forge is what it returned,
which it could have returned. (It can also stop the watcher with SIGSTOP, the one signal the watcher
cannot ignore; then the sandbox's wall time ends the run, as a failure.)

Standard library only, and no syntax past Python 3.8: the sandbox image's interpreter runs it.
"""

import json
import numbers
import os
import select
import signal
import sys
import time

CASES = "cases.json"
PROGRAM = "solution.py"
# the imports APPS and TACO put before a call-based program (numpy aside: a program imports it
# itself), so a program written against their graders finds the same names; typing's whole
# namespace for LeetCode-style starter code (`List[int]`, `Optional[TreeNode]`)
HEADER = (
    "import sys, time, itertools, collections, math, fractions, random, heapq\n"
    "from itertools import accumulate, product, permutations, combinations\n"
    "from collections import Counter, OrderedDict, deque, defaultdict, ChainMap\n"
    "from functools import lru_cache\n"
    "from math import sqrt, sin, cos, tan, ceil, fabs, floor, gcd, exp, log, log2\n"
    "from typing import *\n"
    "from heapq import *\n"
)

_dumps = json.dumps  # taken before the program runs (it may patch json; then it only garbles its own values)


def encode(value):
    """`value` as JSON that keeps what APPS's comparison tells apart: tuples from lists, int from
    str keys; anything else (a set, an object) as {"other": its type's name}, equal to nothing."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):  # numpy's integers too, which APPS's == takes for ints
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return {"list": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    return {"other": type(value).__name__}


def _arguments(given):
    """A case's arguments; as APPS does, a first argument that is a dict of int-like keys gets int
    keys back (JSON made them strings). The others are kept (APPS drops them)."""
    first = given[0] if given else None
    if isinstance(first, dict):
        try:
            return [{int(k): v for k, v in first.items()}, *given[1:]]
        except (TypeError, ValueError):
            pass
    return given


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]  # a SyntaxError's message names its line: "invalid syntax (solution.py, line 1)"


def _function(fn_name: str):
    """The function the cases call, from the program loaded in a namespace of its own."""
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    with open(PROGRAM) as f:
        source = f.read()
    exec(HEADER, namespace)
    exec(compile(source, PROGRAM, "exec"), namespace)
    solution = namespace.get("Solution")
    owner = solution() if isinstance(solution, type) and hasattr(solution, fn_name) else None
    found = getattr(owner, fn_name, None) if owner is not None else namespace.get(fn_name)
    if not callable(found):
        raise LookupError(f"no function {fn_name!r} in the program")
    return found


def _call(function, arguments) -> dict:
    """One case's outcome: the value returned, written down, or what was raised on the way."""
    failed = "raised "
    try:
        value = function(*arguments)
        failed = "returned a value that cannot be written: "  # cyclic, too deep, an int too long to print
        tree = encode(value)
        _dumps(tree)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the program's failure
        return {"error": failed + _error(e)}
    return {"value": tree}


def _work(spec: dict, channel: int) -> None:
    """The worker: load, then call per case, each outcome a line on `channel` (the watcher's pipe)."""
    os.dup2(2, 1)  # the program's prints go to stderr: the worker holds no descriptor of the harness's stdout
    out = os.fdopen(channel, "w")

    def say(outcome: dict) -> None:
        out.write(_dumps(outcome) + "\n")
        out.flush()

    try:
        function = _function(spec["fn_name"])
    except BaseException as e:
        return say({"load": _error(e)})
    say(READY)
    for i, given in enumerate(spec["inputs"]):
        outcome = _call(function, _arguments(given))
        say({"case": i, **outcome})
        if "value" not in outcome:
            return  # a case that failed fails the task: the rest would only take time


READY = {"ready": True}  # the worker loaded the program: the first call's time starts
LINE_BYTES = 1 << 22  # a line longer than the sandbox lets stdout be is not an outcome


def _watch(worker: int, channel: int, cases: int, limit: float) -> None:
    """The watcher: relay the worker's lines to stdout, each within `limit` seconds of the one
    before (loading, then each call); past it, or after the last case, the worker is killed.
    It parses nothing the worker writes but the exact READY line."""
    ready, relayed, pending = False, 0, b""
    ready_line = _dumps(READY).encode()
    deadline = time.monotonic() + limit
    while relayed < cases and len(pending) <= LINE_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            late = {"case": relayed, "timeout": True} if ready else {"load": f"loading took more than {limit:g}s"}
            sys.stdout.buffer.write(_dumps(late).encode() + b"\n")
            break
        if not select.select([channel], [], [], left)[0]:
            continue
        chunk = os.read(channel, 1 << 16)
        if not chunk:
            break  # the worker is done, or the program closed or ended it
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not ready and line == ready_line:
                ready = True
            else:  # relayed as it came: the verifier reads it strictly
                sys.stdout.buffer.write(line + b"\n")
                relayed += 1
            deadline = time.monotonic() + limit
        sys.stdout.flush()
    sys.stdout.flush()
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)


def _last_words(e: BaseException) -> None:
    """What broke the worker, as stderr's last line (the verifier quotes it)."""
    try:
        os.write(2, ("\n" + _error(e) + "\n").encode(errors="replace"))
    except BaseException:
        pass


def main() -> None:
    with open(CASES) as f:
        spec = json.load(f)
    for stop in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):  # stops the worker could send
        signal.signal(stop, signal.SIG_IGN)
    read_end, write_end = os.pipe()
    worker = os.fork()
    if worker == 0:
        os.close(read_end)
        try:
            _work(spec, write_end)
        except BaseException as e:  # the program broke the worker itself (patched builtins, closed the pipe)
            _last_words(e)
        finally:
            os._exit(0)  # never back into the watcher's code; the program's atexit hooks do not run
    os.close(write_end)
    _watch(worker, read_end, len(spec["inputs"]), float(spec["time_limit_s"]))


if __name__ == "__main__":
    main()
