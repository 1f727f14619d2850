"""Audit: an untouched real run passes; a changed output byte, a deleted checkpoint shard or a
truncated metrics history fails it (exit 1), naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from snowcat.pipeline.history import History
from tinyrun import module, shared_run

# the shared run (built by the first test that needs it) takes minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return shared_run(tmp_path_factory)


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def test_untouched_run_passes(run_dir, tmp_path):
    copy = _copy(run_dir, tmp_path)
    proc = module("audit", copy, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"]
    kinds = {c["check"] for c in report["checks"]}
    assert kinds == {"outputs", "provenance", "history", "export", "secrets"}
    table = module("audit", copy)
    assert table.returncode == 0 and "audit passed" in table.stdout


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_history(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-3]))


CASES = {
    "tampered export byte": ("stages/export/model/model-00002-of-00004.safetensors", _flip_byte),
    "deleted export shard": ("stages/export/model/model-00001-of-00004.safetensors", Path.unlink),
    "tampered task file byte": ("stages/tasks/val.parquet", _flip_byte),
    "deleted checkpoint shard": ("stages/sft/checkpoints/final/model.safetensors", Path.unlink),
    "truncated metrics history": ("stages/sft/metrics_history.jsonl", _truncate_history),
}


@pytest.mark.parametrize("case", list(CASES))
def test_changes_fail_the_audit_naming_the_file(run_dir, tmp_path, case):
    rel, change = CASES[case]
    copy = _copy(run_dir, tmp_path)
    change(copy / rel)
    proc = module("audit", copy, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    problems = [p for c in report["checks"] for p in c["problems"]]
    assert any(str(copy / rel) in p for p in problems), problems
    if case == "truncated metrics history":  # caught twice: by hash and by the step count it must reach
        assert any("expected step 20 (truncated)" in p for p in problems)
    table = module("audit", copy)
    assert table.returncode == 1 and "FAIL" in table.stdout and Path(rel).name in table.stdout


def test_truncated_history_h5_fails_the_audit(run_dir, tmp_path):
    import h5py

    copy = _copy(run_dir, tmp_path)
    hist = History(copy)
    for step in range(1, 21):
        hist.append("sft", step, {"loss": 1.0 / step})
    assert module("audit", copy).returncode == 0
    with h5py.File(hist.path, "a") as f:  # drop the last five committed rows
        f["sft"].attrs["rows"] = 15
    proc = module("audit", copy, "--json")
    assert proc.returncode == 1
    problems = [p for c in json.loads(proc.stdout)["checks"] for p in c["problems"]]
    assert any(str(hist.path) in p and "expected step 20" in p for p in problems), problems


def test_not_a_run_dir_is_a_user_error(tmp_path):
    proc = module("audit", tmp_path)
    assert proc.returncode == 2 and "not a snowcat run directory" in proc.stderr
