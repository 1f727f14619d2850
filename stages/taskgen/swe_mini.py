"""swe-mini: small generated Python packages with one seeded bug each, unittest suites, gold patches.

A task is a package `<pkg>/` of one or two modules and a `tests/` suite run by
`python3 -m unittest -v` (the standard library only: it runs in any sandbox image). One function
carries a bug of one of five kinds; the tests that catch it are FAIL_TO_PASS, the others
PASS_TO_PASS, both computed here by running the functions (not claimed): the gold patch must make
every FAIL_TO_PASS test pass and the bug must make each of them fail.

Visible and hidden tests: each function's test calls are split in two. The visible ones live in the
repository's `tests/test_<mod>.py` (what the agent reads and its `test` tool runs); the hidden ones
are the same call templates on a fresh draw of inputs, plus calls on inputs no visible test uses
(`Function.hidden`), in `tests/test_hidden_<mod>.py`, which only the verifier's `test_patch` adds.
A hidden call whose text equals a visible one is dropped, and a task is kept only when a visible
test and a hidden test on an input no visible test uses both expose the bug: a patch that
special-cases the visible inputs passes what the agent can run and still fails the verifier. The
statement quotes visible calls only.

Difficulty:
  1  one module, the buggy function alone; the statement names the call, its result and the expected one
  2  one module of three functions; the statement names the function and what it gets wrong
  3  two modules of five functions; the statement only says which test file fails

Bug kinds: off_by_one, wrong_operator, missing_case, wrong_return, wrong_default. Everything is
drawn from the generator passed in, so a seed gives the same tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from snowcat.stages.taskgen.repo import RepoSpec, make_patch

BUG_KINDS = ("off_by_one", "wrong_operator", "missing_case", "wrong_return", "wrong_default")
TEST_COMMAND = "python3 -m unittest -v {tests}"
PACKAGES = ("abacus", "ledger", "quill", "sprout", "tally", "lumen", "cobble", "tarn", "briar", "fathom", "gable", "heron")
MODULES = ("core", "stats", "seqs", "text", "numbers", "util")


@dataclass(frozen=True)
class Function:
    name: str
    source: str  # the correct definition
    bugs: dict[str, tuple[str, str]]  # kind -> (correct snippet, buggy snippet), each unique in source
    calls: tuple[str, ...]  # test calls, `{}` filled with drawn values by `args`
    args: Callable  # rng -> tuple of values for the calls' placeholders
    hidden: tuple[str, ...] = ()  # hidden-only calls: inputs that no visible call uses

    def code(self, bug: str | None) -> str:
        if bug is None:
            return self.source
        good, bad = self.bugs[bug]
        assert self.source.count(good) == 1, (self.name, bug)
        return self.source.replace(good, bad)


def _ints(rng, n, lo=-9, hi=20):
    return [int(x) for x in rng.integers(lo, hi, size=n)]


FUNCTIONS = (
    Function(
        "total",
        "def total(xs):\n    result = 0\n    for x in xs:\n        result += x\n    return result\n",
        {"wrong_operator": ("result += x", "result -= x"), "wrong_return": ("return result", "return len(xs)")},
        ("total({})", "total({})", "total([])"),
        lambda rng: (_ints(rng, 4, 1), _ints(rng, 3, 1)),
    ),
    Function(
        "count_above",
        "def count_above(xs, limit):\n    n = 0\n    for x in xs:\n        if x > limit:\n            n += 1\n    return n\n",
        {"off_by_one": ("x > limit", "x >= limit"), "wrong_operator": ("n += 1", "n -= 1")},
        ("count_above({}, {})", "count_above({}, {})"),
        lambda rng: (lambda xs, ys: (xs, xs[1], ys, 100))(_ints(rng, 6, 0, 9), _ints(rng, 3)),
    ),
    Function(
        "mean",
        "def mean(xs):\n    if not xs:\n        return 0.0\n    return sum(xs) / len(xs)\n",
        {
            "missing_case": ("    if not xs:\n        return 0.0\n", ""),
            "wrong_operator": ("sum(xs) / len(xs)", "sum(xs) * len(xs)"),
        },
        ("mean({})", "mean([])"),
        lambda rng: (_ints(rng, 3, 1),),
        ("mean(())",),
    ),
    Function(
        "clamp",
        "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n    return x\n",
        {
            "wrong_return": ("        return high\n", "        return low\n"),
            "missing_case": ("    if x < low:\n        return low\n", ""),
        },
        ("clamp({}, 0, 10)", "clamp({}, 0, 10)", "clamp({}, 0, 10)", "clamp(10, 0, 10)"),
        lambda rng: (int(rng.integers(-20, -1)), int(rng.integers(11, 30)), int(rng.integers(1, 9))),
    ),
    Function(
        "repeat",
        "def repeat(text, times=2, sep='-'):\n    return sep.join([text] * times)\n",
        {"wrong_default": ("times=2", "times=3"), "wrong_return": ("return sep.join([text] * times)", "return sep.join([text])")},
        ("repeat({!r})", "repeat({!r}, 3)", "repeat({!r}, 1)"),
        lambda rng: tuple(str(rng.choice(["ab", "xyz", "hi", "moo", "tic"])) for _ in range(3)),
    ),
    Function(
        "last_n",
        "def last_n(xs, n=1):\n    if n <= 0:\n        return []\n    return xs[-n:]\n",
        {
            "off_by_one": ("return xs[-n:]", "return xs[-n + 1:]"),
            "missing_case": ("    if n <= 0:\n        return []\n", ""),
            "wrong_default": ("n=1", "n=2"),
        },
        ("last_n({}, {})", "last_n({}, 0)", "last_n({})"),
        lambda rng: (lambda xs: (xs, int(rng.integers(2, 5)), xs, xs))(_ints(rng, 6)),
    ),
    Function(
        "span",
        "def span(xs):\n    if not xs:\n        return 0\n    return max(xs) - min(xs)\n",
        {
            "wrong_operator": ("max(xs) - min(xs)", "max(xs) + min(xs)"),
            "missing_case": ("    if not xs:\n        return 0\n", ""),
        },
        ("span({})", "span([])", "span({})"),
        lambda rng: (_ints(rng, 4), [int(rng.integers(-5, 5))]),
        ("span(())",),
    ),
    Function(
        "first_index",
        "def first_index(xs, target):\n    for i, x in enumerate(xs):\n        if x == target:\n            return i\n    return -1\n",
        {"missing_case": ("    return -1\n", ""), "wrong_return": ("            return i\n", "            return x\n")},
        ("first_index({}, {})", "first_index({}, 99)"),
        lambda rng: (lambda xs: (xs, xs[int(rng.integers(1, 5))], xs))([int(x) for x in rng.permutation(50)[:5]]),
    ),
    Function(
        "factorial",
        "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result\n",
        {"off_by_one": ("range(2, n + 1)", "range(2, n)"), "wrong_operator": ("result *= k", "result += k")},
        ("factorial({})", "factorial(0)", "factorial(1)"),
        lambda rng: (int(rng.integers(4, 8)),),
    ),
    Function(
        "join_words",
        "def join_words(words, sep=' '):\n    return sep.join(w.strip() for w in words)\n",
        {
            "wrong_default": ("sep=' '", "sep=','"),
            "wrong_return": ("return sep.join(w.strip() for w in words)", "return sep.join(words)"),
        },
        ("join_words({})", "join_words({}, '+')"),
        lambda rng: tuple(
            [f" {w} " for w in rng.choice(["red", "fox", "sky", "owl", "sun"], size=3, replace=False).tolist()] for _ in range(2)
        ),
    ),
)
BY_NAME = {f.name: f for f in FUNCTIONS}


def _run(source: str, call: str):
    env: dict = {}
    exec(source, env)  # our own generated code, never a model's
    try:
        return ("value", eval(call, env))
    except Exception as e:  # noqa: BLE001 - the exception type is the observable behaviour
        return ("raises", type(e).__name__)


def _test_case(index: int, call: str, outcome) -> str:
    kind, value = outcome
    if kind == "raises":  # never expected of the correct code: outcomes come from it
        raise AssertionError(f"{call} raises {value} in the correct code")
    return f"    def test_{index}(self):\n        self.assertEqual(exact({call}), exact({value!r}))\n"


# Each test module compares plain data by exact type, so that an object whose __eq__ answers True to
# everything (or a subclass of int that claims to equal the answer) is not taken for the answer.
EXACT = """

def exact(value):
    kind = type(value)
    if kind in (list, tuple):
        return (kind.__name__, [exact(v) for v in value])
    if kind in (int, float, str, bool, type(None)):
        return (kind.__name__, value)
    return ("not plain data: " + kind.__name__, id(value))
"""


def generate(rng: np.random.Generator, difficulty: int) -> tuple[str, str, dict]:
    """(problem statement, gold patch, meta with the RepoSpec) for one task."""
    if difficulty not in (1, 2, 3):
        raise ValueError(f"swe_mini difficulty must be 1, 2 or 3, got {difficulty}")
    for _ in range(100):
        if (task := _draw(rng, difficulty)) is not None:
            return task
    raise RuntimeError("swe_mini: 100 draws in a row did not expose their bug")  # a template bug


def _fill(f: Function, rng: np.random.Generator) -> list[tuple[str, str]]:
    """(template, call) for each of `f`'s call templates, the placeholders filled with one draw."""
    values = iter(f.args(rng))
    return [(t, t.format(*[next(values) for _ in range(t.count("{"))])) for t in f.calls]


def _hidden_calls(f: Function, rng: np.random.Generator, visible: list[str]) -> list[str]:
    """The hidden calls of `f`: its templates with placeholders on a fresh draw, then `f.hidden`;
    none equal to a visible call (or to another hidden one)."""
    calls = [c for t, c in _fill(f, rng) if "{" in t] + list(f.hidden)
    return [c for c in dict.fromkeys(calls) if c not in visible]


def _test_module(pkg: str, mod: str, cases: list[tuple[Function, list[str]]]) -> str:
    """A unittest module: a class per function with calls, a test per call (its outcome in the correct code)."""
    cases = [(f, calls) for f, calls in cases if calls]
    lines = [f"import unittest\n\nfrom {pkg}.{mod} import {', '.join(f.name for f, _ in cases)}\n", EXACT]
    for f, calls in cases:
        lines.append(f"\n\nclass {_class(f)}(unittest.TestCase):\n")
        lines += [_test_case(i, call, _run(f.source, call)) for i, call in enumerate(calls)]
    lines.append('\n\nif __name__ == "__main__":\n    unittest.main()\n')
    return "".join(lines)


def _class(f: Function) -> str:
    return "Test" + "".join(p.title() for p in f.name.split("_"))


def _draw(rng: np.random.Generator, difficulty: int) -> tuple[str, str, dict] | None:
    pkg = str(rng.choice(PACKAGES))
    n_funcs = {1: 1, 2: 3, 3: 5}[difficulty]
    chosen = [FUNCTIONS[i] for i in rng.choice(len(FUNCTIONS), size=n_funcs, replace=False)]
    buggy = chosen[0]
    kinds = sorted(buggy.bugs)
    bug = kinds[int(rng.integers(len(kinds)))]
    modules = [str(m) for m in rng.choice(MODULES, size=2 if difficulty == 3 else 1, replace=False)]
    home = {f.name: modules[i % len(modules)] for i, f in enumerate(chosen)}

    def exposes(f: Function, call: str) -> bool:
        return f is buggy and _run(f.code(bug), call) != _run(f.source, call)

    files: dict[str, str] = {f"{pkg}/__init__.py": "", "tests/__init__.py": ""}
    fixed_files: dict[str, str] = {}
    hidden_files: dict[str, str] = {}
    f2p, p2p, test_paths = [], [], []
    first = None  # the first visible call that shows the bug: (call, wrong outcome, right outcome)
    hidden_catch = False  # a hidden call on an input no visible test uses shows the bug
    for mod in modules:
        funcs = sorted((f for f in chosen if home[f.name] == mod), key=lambda f: f.name)
        good = "\n\n".join(f.source for f in funcs)
        bad = "\n\n".join(f.code(bug if f is buggy else None) for f in funcs)
        files[f"{pkg}/{mod}.py"], fixed_files[f"{pkg}/{mod}.py"] = bad, good
        visible, hidden = [], []
        for f in funcs:
            calls = [c for _, c in _fill(f, rng)]
            secret = _hidden_calls(f, rng, calls)
            for _ in range(20):  # the buggy function's hidden calls must catch a patch fitted to the visible ones
                if f is not buggy or any(exposes(f, c) for c in secret):
                    break
                secret = _hidden_calls(f, rng, calls)
            visible.append((f, calls))
            hidden.append((f, secret))
            for i, call in enumerate(calls):
                (f2p if exposes(f, call) else p2p).append(f"tests.test_{mod}.{_class(f)}.test_{i}")
                if exposes(f, call) and first is None:
                    first = (call, _run(f.code(bug), call), _run(f.source, call))
            for i, call in enumerate(secret):
                (f2p if exposes(f, call) else p2p).append(f"tests.test_hidden_{mod}.{_class(f)}.test_{i}")
                hidden_catch = hidden_catch or exposes(f, call)
        files[f"tests/test_{mod}.py"] = _test_module(pkg, mod, visible)
        if any(calls for _, calls in hidden):
            hidden_files[f"tests/test_hidden_{mod}.py"] = _test_module(pkg, mod, hidden)
        test_paths.append(f"tests/test_{mod}.py")
    if first is None or not hidden_catch:
        return None  # the drawn values do not expose the bug (visibly and hidden): draw again
    call, wrong, right = first
    got = f"raises {wrong[1]}" if wrong[0] == "raises" else f"returns {wrong[1]!r}"
    if difficulty == 1:
        statement = f"In the package `{pkg}`, `{call}` {got}; it should return {right[1]!r}. Fix the bug."
    elif difficulty == 2:
        statement = (
            f"`{pkg}.{home[buggy.name]}.{buggy.name}` gives wrong results (e.g. `{call}` {got}, expected {right[1]!r}). Fix it."
        )
    else:
        failing = sorted({t.rsplit(".", 2)[0].replace(".", "/") + ".py" for t in f2p} & set(test_paths))
        statement = f"Tests in {' and '.join(failing)} fail. Find the bug in `{pkg}` and fix it."
    before = {p: t.encode() for p, t in files.items()}
    gold = make_patch(before, before | {p: t.encode() for p, t in fixed_files.items()})
    spec = RepoSpec(
        source={"files": files},
        test_command=TEST_COMMAND,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        test_paths=test_paths,
        test_patch=make_patch({}, {p: t.encode() for p, t in hidden_files.items()}),
        timeout_s=30.0,
        memory_mb=512,
    )
    meta = {"repo": spec.to_meta(), "bug_kind": bug, "function": buggy.name, "module": f"{pkg}/{home[buggy.name]}.py"}
    return statement, gold, meta
