"""Which process a record means: pid, kernel start time, boot and host.

A pid alone is recycled: once a run's process has exited, the same number soon belongs to
someone else's shell or job, and signalling it by number would hit that process. A record made by
`identify` matches only the very process it was made for.
"""

from __future__ import annotations

import os
from pathlib import Path


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a live pid, from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5), counted after the name


def identify(pid: int | None = None) -> dict | None:
    """The identity of a live process (default: this one); None if it is already gone."""
    pid = os.getpid() if pid is None else int(pid)
    stat = _stat(pid)
    if stat is None:
        return None
    return {"pid": pid, "start": stat[1], "boot": _boot_id(), "host": os.uname().nodename}


def alive(identity: dict | None) -> bool:
    """True only if the process `identity` was made for still runs (here; not a zombie).

    A record without a start time (or from another host) is never taken as alive: acting on a
    process that might not be ours is worse than leaving one of ours alone."""
    if not identity or "start" not in identity or identity.get("host") != os.uname().nodename:
        return False
    if identity.get("boot") != _boot_id():
        return False
    stat = _stat(int(identity["pid"]))
    return stat is not None and stat[0] != "Z" and stat[1] == identity["start"]
