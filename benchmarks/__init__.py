"""snowcat: benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys


def run_python(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter (`python -c code args...`) and return the JSON object on the
    last line of its output: each measurement starts from a clean process. A failing child ends the
    benchmark with the end of its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
