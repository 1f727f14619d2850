"""Which recorded values describe how a run went (wall clock, speed) rather than what it produced.

By schema, not by a list of names: a metric or JSON field is volatile when its name states a unit of
time or speed, or lies in a timing namespace.

    unit      the last word of the name (after the last "/", words split at "_"):
              `s`, `seconds`   a duration (`duration_s`, `wait_seconds`); `per_s` a rate (`tokens_per_s`)
              `at`, `time`     a wall-clock stamp (`registered_at`, `time`)
    namespace the first component of a path-like name: `time/…`, `throughput/…`, `engine/…`
              (the rollout engines' load and rebuild counts: a process history, as a duration
              is: a rank restarted after a preemption builds a fresh engine, so a resumed run
              counts more of them than an uninterrupted one with the same results), and
              `memory/…` (a process's peak memory: it depends on the allocator and what else the
              process did, e.g. a resumed one loaded a checkpoint)

Stages name what they measure accordingly; everything else a run records must repeat exactly.
"""

from __future__ import annotations

from typing import Any

UNITS = {
    "s": "a duration in seconds",
    "seconds": "a duration in seconds",
    "at": "a wall-clock stamp",
    "time": "a wall-clock stamp",
}
NAMESPACES = {
    "time": "a timing",
    "throughput": "a speed",
    "engine": "the rollout engines' process history",
    "memory": "a process's memory use",
}
RULE = (
    "fields whose last word (after '/', split at '_') is a unit of time: s, seconds (durations), "
    "per_s (rates), at, time (wall-clock stamps); and fields under time/, throughput/, engine/ or memory/"
)


def why_volatile(name: str) -> str | None:
    """Why `name` is volatile (its unit or namespace), or None when it must repeat exactly."""
    head, sep, _ = name.partition("/")
    if sep and head in NAMESPACES:
        return f"{NAMESPACES[head]} (under {head}/)"
    words = name.rsplit("/", 1)[-1].split("_")
    if words[-2:] == ["per", "s"]:
        return "a rate per second (unit: per_s)"
    if words[-1] in UNITS:
        return f"{UNITS[words[-1]]} (unit: {words[-1]})"
    return None


def strip_volatile(obj: Any) -> tuple[Any, dict[str, str]]:
    """(obj without volatile keys at any depth, {removed key: why})."""
    removed: dict[str, str] = {}

    def strip(x):
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                why = why_volatile(k) if isinstance(k, str) else None
                if why is None:
                    out[k] = strip(v)
                else:
                    removed[k] = why
            return out
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(obj), removed
