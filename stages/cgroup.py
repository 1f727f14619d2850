"""One cgroup per sandboxed tool call: memory, process count and CPU time capped for the call as a
whole, not per process (setrlimit is per process: six children of a 256 MiB call held 1 GiB).

Both cgroup layouts are handled, because centres run both:
  * v2 (unified): a child of this process's own cgroup, which must have `memory` and `pids` in its
    `cgroup.subtree_control` (systemd delegation: `Delegate=yes`, or a Slurm job's cgroup);
  * v1 (legacy): a child of this process's cgroup in the `memory`, `pids` and `cpuacct` hierarchies.
`CallCgroup.open(...)` returns None where neither is writable (no root, no delegation); the
sandbox then keeps only its per-process rlimits and says so in `SandboxResult.caps`.

Limits: memory (RAM + swap where swap is accounted) is enforced by the kernel's OOM killer inside
the group; `pids.max` stops a fork bomb; CPU seconds are summed over the group and checked by the
caller while it waits (`cpu_seconds()`), since no cgroup knob caps total CPU time.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_paths() -> dict[str, str]:
    """{controller or "" for v2: this process's cgroup path} from /proc/self/cgroup."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _writable_dir(p: Path) -> bool:
    return p.is_dir() and os.access(p, os.W_OK)


class CallCgroup:
    """The group one tool call runs in; `attach()` is called in the child before exec."""

    def __init__(self, dirs: dict[str, Path], v2: bool):
        self.dirs, self.v2 = dirs, v2  # v2: {"": dir}; v1: {"memory": dir, "pids": dir, "cpuacct": dir}

    @classmethod
    def open(cls, memory_bytes: int, pids: int, root: Path = ROOT) -> CallCgroup | None:
        """A fresh group with the limits set, or None where this machine does not let us make one."""
        name = f"snowcat-call-{uuid.uuid4().hex[:12]}"
        own = _own_paths()
        try:
            unified = root / own.get("", "/").lstrip("/") if (root / "cgroup.controllers").exists() else None
            if unified is not None and {"memory", "pids"} <= set((unified / "cgroup.subtree_control").read_text().split()):
                group = cls({"": unified / name}, v2=True)
            elif all(_writable_dir(root / c) for c in ("memory", "pids", "cpuacct")):
                group = cls({c: root / c / own.get(c, "/").lstrip("/") / name for c in ("memory", "pids", "cpuacct")}, v2=False)
            else:
                return None
        except OSError:
            return None
        try:
            for d in group.dirs.values():
                d.mkdir()
            group._limit(memory_bytes, pids)
        except OSError:
            group.remove()  # what was made so far
            return None
        return group

    def _write(self, controller: str, knob: str, value: str) -> None:
        (self.dirs["" if self.v2 else controller] / knob).write_text(value)

    def _read(self, controller: str, knob: str) -> str:
        try:
            return (self.dirs["" if self.v2 else controller] / knob).read_text()
        except OSError:
            return ""

    def _limit(self, memory_bytes: int, pids: int) -> None:
        if self.v2:
            self._write("", "memory.max", str(memory_bytes))
            if (self.dirs[""] / "memory.swap.max").exists():
                self._write("", "memory.swap.max", "0")
            self._write("", "pids.max", str(pids))
            return
        self._write("memory", "memory.limit_in_bytes", str(memory_bytes))
        if (self.dirs["memory"] / "memory.memsw.limit_in_bytes").exists():
            self._write("memory", "memory.memsw.limit_in_bytes", str(memory_bytes))
        self._write("pids", "pids.max", str(pids))

    def attach(self) -> None:
        """Move the calling process into the group (async-signal-safe enough for preexec_fn)."""
        pid = str(os.getpid())
        for d in self.dirs.values():
            with open(d / "cgroup.procs", "w") as f:
                f.write(pid)

    def cpu_seconds(self) -> float:
        if self.v2:
            for line in self._read("", "cpu.stat").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        raw = self._read("cpuacct", "cpuacct.usage").strip()
        return int(raw) / 1e9 if raw else 0.0

    def _events(self, controller: str, knob: str) -> dict[str, int]:
        out = {}
        for line in self._read(controller, knob).splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def hit(self) -> str | None:
        """Which group limit stopped something: "memory" (OOM kill), "pids" (fork refused) or None."""
        if self.v2:
            if self._events("", "memory.events").get("oom_kill", 0):
                return "memory"
        else:
            oom = self._events("memory", "memory.oom_control")
            if oom.get("oom_kill", 0) or (not oom and int(self._read("memory", "memory.failcnt") or 0)):
                return "memory"
        if self._events("pids", "pids.events").get("max", 0):
            return "pids"
        return None

    def kill(self) -> None:
        """SIGKILL everything still in the group."""
        if self.v2 and (self.dirs[""] / "cgroup.kill").exists():
            self._write("", "cgroup.kill", "1")
            return
        for _ in range(50):
            pids = [int(p) for p in self._read("pids", "cgroup.procs").split()]
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs.values():
            for _ in range(100):  # a killed process leaves the group a moment after it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
