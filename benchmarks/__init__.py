"""snowcat: benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter (`python -c code args...`) and return the JSON object on the
    last line of its output: each measurement starts from a clean process. A failing child ends the
    benchmark with the end of its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def revision(measured: tuple[str, ...] = ()) -> dict:
    """The commit measured, and which of the `measured` files (the code a benchmark judges,
    relative to the checkout) differ from it: a result taken from an edited tree says so."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("diff", "--name-only", "HEAD", "--", *measured) if measured else ""
    return {"commit": git("rev-parse", "HEAD") or None, "uncommitted": changed.split()}
