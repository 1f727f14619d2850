"""The compiled batch check (stages/agent/_wire.c) built with AddressSanitizer and UndefinedBehavior-
Sanitizer reads damaged messages without one out-of-bounds read or overflow: extreme values in every
header word and checked column, random bytes, truncations, and the fuzzer of test_wire_check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import importlib.util, sys
    import numpy as np
    spec = importlib.util.spec_from_file_location("snowcat.stages.agent._wire", sys.argv[1])
    wire = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wire)
    from snowcat.stages.agent import FIELDS, TrajectoryBatch, trajectory
    trajectory._scan_compiled = wire.scan  # the fuzzer compares it with the Python checks
    from hypothesis import HealthCheck, given, settings, strategies as st
    import tests.test_wire_check as t

    head = 4 + len(FIELDS)
    extremes = (-(2**63), -(2**31) - 1, -1, 2**31, 2**62, 2**63 - 1)
    for base in t.BASES.values():
        batch = TrajectoryBatch.read(base)
        for i in range(head):
            for v in extremes:
                b = base.copy()
                b[: 8 * head].view(np.int64)[i] = v
                assert wire.scan(b) is None or i == 2  # (word 2, the batch index, may hold any value)
        for name in t.CHECKED:
            column = batch.column(name)
            info = np.iinfo(column.dtype)
            for j in {0, len(column) // 2, len(column) - 1} if len(column) else ():
                for v in {info.min, info.max, max(info.min, -1)}:
                    b = base.copy()
                    TrajectoryBatch.read(b).column(name)[j] = v
                    wire.scan(b)
        rng = np.random.default_rng(len(base))
        for _ in range(1000):
            b = base.copy()
            k = int(rng.integers(1, 20))
            b[rng.integers(0, len(b), k)] = rng.integers(0, 256, k)
            wire.scan(b)
            wire.scan(b[: int(rng.integers(0, len(b)))])
    f = t.test_the_compiled_check_accepts_exactly_what_the_python_checks_accept.hypothesis.inner_test
    given(data=st.data())(settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))(f))()
    print("SANITIZED-OK", flush=True)
""")


def _runtime(name: str) -> str | None:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the sanitizers' compiler and runtimes)")
def test_the_compiled_check_reads_any_damage_without_a_memory_or_overflow_error(tmp_path):
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("gcc's AddressSanitizer and UBSan runtimes are not installed")
    built = tmp_path / f"_wire{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
        + [
            "-fno-omit-frame-pointer",
            f"-I{sysconfig.get_paths()['include']}",
            str(REPO / "stages/agent/_wire.c"),
            "-o",
            str(built),
        ],
        check=True,
    )
    env = dict(os.environ, LD_PRELOAD=f"{asan}:{ubsan}", ASAN_OPTIONS="detect_leaks=0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(built)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "SANITIZED-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
