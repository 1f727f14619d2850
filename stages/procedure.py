"""A working procedure for coding agents as a few ordering rules ("run the tests before submitting"),
and whether an episode kept each one.

A rule is `"<step> before <step>"` or `"<step> after <step>"`, steps one of `STEPS`:

    view    the agent read a file (`view`, or a bash command that prints one: cat, head, ...)
    edit    the agent changed a file (an `edit` that applied, or a bash command that writes one)
    test    the agent ran tests (`test`, or a bash command that runs a test runner)
    submit  the agent submitted

    "A before B"  kept when some A comes before the first B
    "A after B"   kept when some A comes after the last B
    either rule applies only to an episode that does B (else: not applicable); steps in one turn
    (a bash command that edits and tests) count as simultaneous, neither before the other

Evaluate's `procedure` key lists the rules (`DEFAULT_PROCEDURE` unless set); the behaviour record
of each episode names the rules it broke (stages/agent/behaviour_records.py). Kept apart from those
records so that the config (torch-free, read on login nodes) can check the rules without importing
the agent package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

STEPS = ("view", "edit", "test", "submit")
RELATIONS = ("before", "after")
DEFAULT_PROCEDURE = ("test before submit", "test after edit")


def parse_rule(rule: str) -> tuple[str, str, str]:
    """(step, relation, step) of one rule; ValueError saying what is wrong."""
    words = rule.split()
    if len(words) != 3 or words[1] not in RELATIONS or words[0] not in STEPS or words[2] not in STEPS:
        raise ValueError(f"rule {rule!r}: expected '<step> before|after <step>', steps {', '.join(STEPS)}")
    if words[0] == words[2]:
        raise ValueError(f"rule {rule!r}: a step cannot come before or after itself")
    return words[0], words[1], words[2]


def rule_kept(rule: str, steps: Sequence[Iterable[str]]) -> bool | None:
    """Whether an episode kept `rule`; None when it does not apply. `steps[j]`: the steps of turn j
    (a bash command may be several at once: it can run the tests and write a file)."""
    first, relation, then = parse_rule(rule)
    at = [j for j, turn in enumerate(steps) if then in turn]
    if not at:
        return None
    done = [j for j, turn in enumerate(steps) if first in turn]
    if relation == "before":
        return any(j < at[0] for j in done)
    return any(j > at[-1] for j in done)
