"""The test observer: runs a task's tests inside the verification sandbox and reports what it saw.

This file is copied into the sandbox and run as a script, `python -I observer.py ...` (standard
library only; snowcat itself imports it only for `STARTED`). It is the one part of a verification that runs
in the same process as the code under test, so it trusts nothing that code can reach:

  * it starts in isolated mode (-I: no current directory or script directory on sys.path, no
    PYTHON* variables, no user site), imports the test runner (pytest or unittest) and everything
    it needs itself, and only then puts the repository on sys.path, so no file of the repository
    can shadow them;
  * it reads the verification's nonce from a file and deletes it before any code of the
    repository runs; the report is valid only with that nonce, and it is written with functions
    bound before the repository ran (`os.open(O_EXCL)`, then `os._exit`: no atexit handler or
    finalizer of the code under test runs after it);
  * a start line with a second secret on stderr, written and read by the parent (it waits until
    the pipe is empty) before any repository code runs, so that code can neither take it back nor
    learn the nonce from it, tells a harness that never started (infrastructure) from a process the
    code under test ended or emptied (the model's failure);
  * the runner's own classes and functions (unittest.TestCase, TestResult, pytest's runner,
    reports and hooks, builtins) are recorded by identity before the tests and checked after every
    test and at the end: a replaced assertion, result or report function is reported as tampering;
  * every outcome is recorded per test id; skipped, expected-failure and unexpected-success
    outcomes are not passes, and a test the report does not name did not pass.

Arguments: --harness pytest|unittest, --dir DIR (holds `nonce`: the report's nonce and the start
line's token; gets `report.json`), --root REPO, then the test ids.
"""

import argparse
import builtins
import fcntl
import importlib
import json
import os
import struct
import sys
import termios
import time
import unittest
import unittest.case
import unittest.loader
import unittest.result
import unittest.suite

# Bound now, before any code of the repository runs: it may replace the module attributes later.
_open, _write, _close, _exit, _dumps = os.open, os.write, os.close, os._exit, json.dumps
_vars, _sorted, _set, _len, _modules = vars, sorted, set, len, sys.modules
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
STARTED = "snowcat-observer-started"


def _tell(line: str) -> None:
    """Write `line` to stderr and wait (10 s at most) until the parent has read it: while no code of
    the repository runs, nothing but the parent can take it out of the pipe (opening
    /proc/self/fd/2 for reading gives a pipe's read end)."""
    _write(2, line.encode())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            unread = struct.unpack("i", fcntl.ioctl(2, termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:  # not a pipe: a file or terminal keeps what was written
            return
        if unread == 0:
            return
        time.sleep(0.001)


def _emit(path: str, record: dict) -> bool:
    """Write `record` as JSON to a new file; False when the file exists already (someone else's)."""
    try:
        fd = _open(path, _FLAGS, 0o600)
    except OSError:
        return False
    try:
        _write(fd, _dumps(record).encode())
    finally:
        _close(fd)
    return True


class Watch:
    """Identity of every attribute of the runner's own objects, taken before the tests run."""

    def __init__(self, owners: dict) -> None:
        self.owners = owners
        self.saved = {name: dict(_vars(obj)) for name, obj in owners.items()}
        self.modules = {name: _modules.get(name) for name in ("unittest", "unittest.case", "unittest.result", *PYTEST_MODULES)}
        self.found: list[str] = []

    def check(self, when: str) -> None:
        for name, obj in self.owners.items():
            now, then = _vars(obj), self.saved[name]
            changed = [k for k in then if now.get(k, _MISSING) is not then[k]]
            # builtins may gain names (gettext.install); the runner's classes may not, but for the
            # markers pytest sets on its own classes as it goes (`_pytest_*`)
            if name != "builtins":
                changed += [k for k in now if k not in then and not k.startswith("_pytest")]
            for key in _sorted(_set(changed)):
                note = f"{name}.{key} replaced ({when})"
                if note not in self.found and _len(self.found) < 20:
                    self.found.append(note)
        for name, module in self.modules.items():
            if _modules.get(name) is not module:
                note = f"sys.modules[{name!r}] replaced ({when})"
                if note not in self.found:
                    self.found.append(note)


_MISSING = object()


def _unittest_owners() -> dict:
    return {
        "builtins": builtins,
        "unittest.TestCase": unittest.case.TestCase,
        "unittest.TestResult": unittest.result.TestResult,
        "unittest.TestSuite": unittest.suite.TestSuite,
        "unittest.TestLoader": unittest.loader.TestLoader,
        "unittest.case._Outcome": unittest.case._Outcome,
        "unittest.case": unittest.case,
    }


PYTEST_MODULES = ("pytest", "pluggy", "_pytest.main", "_pytest.python", "_pytest.reports", "_pytest.runner")


def run_unittest(ids: list[str], results: dict, watch_box: list) -> None:
    watch = Watch(_unittest_owners())
    watch_box.append(watch)

    class Recorder(unittest.TestResult):
        def _set(self, test, outcome: str) -> None:
            key = test.id()
            if results.get(key) not in ("failed", "error"):  # a failed subtest stays failed
                results[key] = outcome

        def addSuccess(self, test):
            self._set(test, "passed")

        def addFailure(self, test, err):
            self._set(test, "failed")

        def addError(self, test, err):
            self._set(test, "error")

        def addSkip(self, test, reason):
            self._set(test, "skipped")

        def addExpectedFailure(self, test, err):
            self._set(test, "xfailed")

        def addUnexpectedSuccess(self, test):
            self._set(test, "xpassed")

        def addSubTest(self, test, subtest, err):
            if err is not None:
                results[test.id()] = "failed"

        def stopTest(self, test):
            watch.check(f"after {test.id()}")

    recorder = Recorder()
    loader = unittest.TestLoader()
    for name in ids:  # one by one: a name that does not load fails alone
        try:
            suite = loader.loadTestsFromName(name)
        except BaseException:  # noqa: BLE001 - anything at import is the repository's doing
            results.setdefault(name, "error")
            continue
        suite.run(recorder)


def run_pytest(ids: list[str], root: str, results: dict, watch_box: list) -> int:
    m = {name: _modules[name] for name in PYTEST_MODULES}  # imported by main() before the repository was reachable
    pytest = m["pytest"]
    owners = {
        "builtins": builtins,
        "_pytest.runner": m["_pytest.runner"],
        "_pytest.reports.TestReport": m["_pytest.reports"].TestReport,
        "_pytest.reports.BaseReport": m["_pytest.reports"].BaseReport,
        "_pytest.python": m["_pytest.python"],
        "_pytest.python.Function": m["_pytest.python"].Function,
        "pluggy.HookCaller": m["pluggy"].HookCaller,
        "pytest": pytest,
    }
    watch = Watch(owners)
    watch_box.append(watch)

    class Observer:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_logreport(self, report):
            key = report.nodeid
            if report.when == "call":
                if getattr(report, "wasxfail", None) is not None:
                    outcome = "xpassed" if report.passed else "xfailed"
                else:
                    outcome = report.outcome
                if results.get(key) not in ("failed", "error"):
                    results[key] = outcome
            elif report.failed:
                results[key] = "error"
            elif report.skipped and key not in results:
                results[key] = "skipped"

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            yield
            watch.check(f"after {item.nodeid}")

    args = ["--rootdir", root, "-p", "no:cacheprovider", "-q", *ids]
    return int(pytest.main(args, plugins=[Observer()]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--harness", choices=("pytest", "unittest"), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("tests", nargs="+")
    a = parser.parse_args()
    a.dir, a.root = os.path.abspath(a.dir), os.path.abspath(a.root)
    nonce_file = os.path.join(a.dir, "nonce")
    with open(nonce_file) as f:
        nonce, start = f.read().split()  # the report's, and the start line's (told on stderr)
    os.unlink(nonce_file)
    record = {"nonce": nonce, "harness": a.harness}
    results: dict[str, str] = {}
    watch_box: list = []
    try:  # the harness itself: a failure to import it is the machinery's, not the model's
        for name in PYTEST_MODULES if a.harness == "pytest" else ():
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001
        _emit(os.path.join(a.dir, "report.json"), {**record, "harness_error": f"cannot import the {a.harness} runner: {e!r}"})
        _exit(3)
    # Told on stderr and read by the verifier before any code of the repository runs: that code
    # can neither take it back nor write it (the start token), and learns nothing of the nonce.
    _tell(f"\n{STARTED} {start}\n")
    os.chdir(a.root)
    sys.path.insert(0, a.root)  # as `python -m pytest|unittest` run from the repository root would
    code = None
    try:
        if a.harness == "pytest":
            code = run_pytest(a.tests, a.root, results, watch_box)
        else:
            run_unittest(a.tests, results, watch_box)
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt from the code under test
        record["aborted"] = repr(e)[:300]
    if watch_box:
        watch_box[0].check("at the end")
    record.update(results=results, tampered=watch_box[0].found if watch_box else [], exit_code=code)
    _exit(0 if _emit(os.path.join(a.dir, "report.json"), record) else 3)


if __name__ == "__main__":
    main()
