"""The suite's time budget: every test of the slow tier (marked `slow` or `cluster`) declares what it
costs in tests/durations.json, and their sum must fit the tier's budget, so a new slow test has to
pay for itself (made faster, made smaller, or moved to a benchmark).

    pytest --budget            check: every slow-tier test that ran has an entry, the entries fit
                               the budget; measured overruns are listed (CI passes it)
    pytest --update-durations  write the measured seconds of the slow-tier tests that ran

A test's seconds are its setup, call and teardown as measured in CI's two-worker run (a session
fixture's build counts to the first test that uses it). Nothing here decides whether a behaviour
passes: the budget is on the suite, not on the product.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parent / "durations.json"
TIERS = ("cluster", "slow")  # a test marked both counts as cluster
OVERRUN = 2.0  # measured past this factor of its entry (and by 30 s): listed, to be re-measured


def tier(keywords) -> str:
    return next((t for t in TIERS if t in keywords), "unit")


def load(path: Path = DURATIONS) -> dict:
    data = json.loads(path.read_text())
    if not isinstance(data.get("budget_s"), int | float) or not isinstance(data.get("tests"), dict):
        raise pytest.UsageError(f"{path}: needs budget_s (seconds) and tests ({{nodeid: seconds}})")
    return data


def pytest_addoption(parser):
    group = parser.getgroup("budget", "the slow tier's time budget (tests/durations.json)")
    group.addoption("--budget", action="store_true", help="fail when the slow tier's declared seconds exceed its budget")
    group.addoption("--update-durations", action="store_true", help="record the measured seconds of the slow-tier tests run")
    group.addoption(
        "--timings", metavar="FILE", help="write {nodeid: [tier, seconds]} of every test run (.ci/report.py reads it)"
    )


def gone(declared: dict[str, float], root: Path = DURATIONS.parent.parent) -> list[str]:
    """Entries whose test function is no longer in its file (read, not imported: cheap)."""
    out, sources = [], {}
    for nodeid in declared:
        path, _, name = nodeid.partition("::")
        function = name.split("[")[0].split("::")[-1]
        if path not in sources:
            sources[path] = (root / path).read_text() if (root / path).is_file() else ""
        if not re.search(rf"\bdef {re.escape(function)}\(", sources[path]):
            out.append(nodeid)
    return out


class Budget:
    """Collects each test's seconds on the controller (xdist's reports come back to it)."""

    def __init__(self, config):
        self.config = config
        self.seconds: dict[str, float] = {}
        self.tiers: dict[str, str] = {}
        self.problems: list[str] = []
        self.notes: list[str] = []

    def pytest_runtest_logreport(self, report):
        nodeid = re.sub(r"@[\w-]+$", "", report.nodeid)  # xdist's --dist loadgroup appends "@<group>"
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration
        self.tiers[nodeid] = tier(report.keywords)

    def slow(self) -> dict[str, float]:
        return {n: s for n, s in self.seconds.items() if self.tiers[n] != "unit"}

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if hasattr(self.config, "workerinput"):  # an xdist worker: the controller judges
            return
        if self.config.getoption("timings"):
            timings = {n: [self.tiers[n], round(s, 2)] for n, s in self.seconds.items()}
            Path(self.config.getoption("timings")).write_text(json.dumps(timings, indent=0) + "\n")
        if self.config.getoption("update_durations"):
            self.update()
        if self.config.getoption("budget"):
            self.check()
            if self.problems and session.exitstatus == 0:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def update(self) -> None:
        data = load()
        data["tests"].update({n: round(s, 1) for n, s in self.slow().items()})
        data["tests"] = dict(sorted(data["tests"].items()))
        tmp = DURATIONS.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, DURATIONS)
        self.notes.append(f"{DURATIONS.name}: {len(self.slow())} slow-tier durations recorded")

    def check(self) -> None:
        data = load()
        declared, budget = data["tests"], data["budget_s"]
        undeclared = sorted(set(self.slow()) - set(declared))
        for nodeid in undeclared:
            self.problems.append(f"{nodeid} is in the slow tier but has no entry in tests/durations.json (--update-durations)")
        for nodeid in sorted(gone(declared)):  # a renamed or deleted test would count against the budget forever
            self.problems.append(f"tests/durations.json names {nodeid}, which no longer exists: remove its entry")
        total = sum(declared.values())
        if total > budget:
            self.problems.append(
                f"the slow tier declares {total:.0f} s, over its budget of {budget:.0f} s (tests/durations.json): "
                "make a test faster or smaller, or move it to a benchmark"
            )
        for nodeid, s in sorted(self.slow().items()):
            expected = declared.get(nodeid)
            if expected is not None and s > OVERRUN * expected and s > expected + 30:
                self.notes.append(f"{nodeid} took {s:.0f} s, declared {expected:.0f} s")
        measured = sum(self.slow().values())
        self.notes.append(f"slow tier: {measured:.0f} s measured, {total:.0f} s declared, budget {budget:.0f} s")

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.notes or self.problems):
            return
        terminalreporter.section("time budget")
        for line in self.notes:
            terminalreporter.write_line(line)
        for line in self.problems:
            terminalreporter.write_line(f"BUDGET: {line}", red=True)


def longest_first(items: list) -> list:
    """Under xdist: a tier's blocks (an xdist group, else a test file), longest declared first
    (a unit-tier file declares nothing and keeps its place), each kept whole and in its order. Two
    workers take blocks as they come free, so a long one started last ran alone at the end (a core
    idle for its minutes); started first, the short ones fill in beside it."""
    declared = load()["tests"]
    blocks: dict[str, list] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")  # the unit xdist's loadgroup hands out whole
        blocks.setdefault(group.args[0] if group else str(item.path), []).append(item)

    def seconds(block: list) -> float:
        return sum(declared.get(re.sub(r"@[\w-]+$", "", i.nodeid), 0.0) for i in block)

    return [item for block in sorted(blocks.values(), key=seconds, reverse=True) for item in block]


def pytest_configure(config):
    if any(config.getoption(o) for o in ("budget", "update_durations", "timings")):
        config.pluginmanager.register(Budget(config), "snowcat-budget")
