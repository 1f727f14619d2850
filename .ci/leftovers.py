"""What a test run left behind: processes, listening ports, entries in /tmp.

    python3 .ci/leftovers.py snapshot FILE   before the run (listening ports, /tmp's entries)
    python3 .ci/leftovers.py check FILE      after it (FILE may be - for stdin): lists what is new,
                                             exits 1 if anything is

A process belongs to the run when its environment carries the run's SNOWCAT_CI_NONCE (every process
the run starts inherits it: the cluster's daemons, Slurm's job steps, MPI ranks, stage processes).
Those still alive are listed and killed; a port listening now that was not before, and an entry of
/tmp that was not there before, are listed. Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

TMP = Path("/tmp")


def listening_ports() -> set[str]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(str(int(fields[1].rsplit(":", 1)[1], 16)))
    return ports


def run_processes(nonce: str) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose environment holds the nonce."""
    mark = f"SNOWCAT_CI_NONCE={nonce}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours to read
            continue
    return found


def snapshot(path: Path) -> None:
    state = {"ports": sorted(listening_ports()), "tmp": sorted(p.name for p in TMP.iterdir())}
    path.write_text(json.dumps(state))


def check(before: dict, nonce: str) -> list[str]:
    deadline = time.monotonic() + 15  # daemons told to stop a moment ago may still be exiting
    while (procs := run_processes(nonce)) and time.monotonic() < deadline:
        time.sleep(0.5)
    found = [f"process {pid}: {cmd[:200]}" for pid, cmd in sorted(procs.items())]
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    found += [f"port {port} listening" for port in sorted(listening_ports() - set(before["ports"]), key=int)]
    found += [f"{TMP / name} left" for name in sorted({p.name for p in TMP.iterdir()} - set(before["tmp"]))]
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("snapshot", "check"):
        print("usage: leftovers.py snapshot|check FILE", file=sys.stderr)
        return 2
    if argv[1] == "snapshot":
        snapshot(Path(argv[2]))
        return 0
    nonce = os.environ.get("SNOWCAT_CI_NONCE")
    if not nonce:
        print("leftovers.py: SNOWCAT_CI_NONCE is not set (the run's processes cannot be told apart)", file=sys.stderr)
        return 2
    before = sys.stdin.read() if argv[2] == "-" else Path(argv[2]).read_text()
    found = check(json.loads(before), nonce)
    for line in found:
        print(f"[leftover] {line}")
    if found:
        print(f"[leftover] the run left {len(found)} thing(s) behind (temp dir: {tempfile.gettempdir()})")
        return 1
    print("[leftover] none: no process, listening port or /tmp entry of the run remains")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
