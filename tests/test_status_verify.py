"""`status` verifies a done run cheaply (issue 17, "Load"): it compares each file's size and mtime with
those the DONE marker recorded at completion and hashes nothing. Re-hashing is left to `audit` and to
`resume` (and the runner before it skips a done unit). So a byte overwritten in place with the mtime
set back is invisible to `status` and caught by `audit` and `resume`; a changed size or mtime is
reported by `status` as a failed verification always was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from snowcat.pipeline.cli import status_record
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.fsio import IO, read_json
from snowcat.pipeline.reports import audit as audit_mod
from snowcat.pipeline.rundir import RunDir
from tests.conftest import Snowcat, write_config
from tests.test_cli import SMALL


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("status-verify")
    run_dir = root / "run"
    Snowcat(root)("run", write_config(root / "small.yaml", SMALL), "--run-dir", run_dir, check=True)
    return run_dir


@pytest.fixture
def done_run(reference, tmp_path) -> Path:
    """A copy of the reference run; copytree keeps mtimes to the nanosecond (shutil.copystat)."""
    return Path(shutil.copytree(reference, tmp_path / "run"))


def _status(run_dir: Path) -> tuple[dict, dict]:
    """(status record, what it hashed)"""
    run = RunDir.open(run_dir)  # opening checks config.yaml's hash; the status itself is what is counted
    before = dict(IO)
    record = status_record(run)
    return record, {k: IO[k] - before.get(k, 0) for k in ("files_hashed", "bytes_hashed")}


def _outputs_problems(run_dir: Path) -> list[str]:
    return [p for c in audit_mod.audit(RunDir.open(run_dir), known_secrets=[]) if c.check == "outputs" for p in c.problems]


def test_status_hashes_nothing_and_the_done_marker_records_size_and_mtime(done_run):
    record, hashed = _status(done_run)
    assert {s["status"] for s in record["stages"].values()} == {"done"}
    assert hashed == {"files_hashed": 0, "bytes_hashed": 0}
    marker = read_json(done_run / "stages" / "tasks" / "DONE")
    manifest = read_json(done_run / "stages" / "tasks" / "manifest.json")["files"]
    assert set(marker["stat"]) == set(manifest) | {"manifest.json"}
    st = (done_run / "stages" / "tasks" / "train.parquet").stat()
    assert marker["stat"]["train.parquet"] == [st.st_size, st.st_mtime_ns]


def test_a_byte_flipped_in_place_with_mtime_restored_passes_status_and_fails_audit_and_resume(snowcat, done_run):
    target = done_run / "stages" / "tasks" / "train.parquet"
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

    record, hashed = _status(done_run)  # documented: status compares sizes and mtimes only
    assert record["stages"]["tasks"]["status"] == "done" and not record["stages"]["tasks"]["problems"]
    assert hashed["files_hashed"] == 0
    assert _outputs_problems(done_run) == [f"{target}: sha256 differs from manifest"]
    resumed = snowcat("resume", done_run)
    assert resumed.returncode == 2 and "outputs changed" in resumed.stderr, resumed.stderr


def test_a_changed_mtime_or_size_is_reported_by_status(done_run):
    target = done_run / "stages" / "more" / "val.parquet"
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))  # touched: same bytes
    record, hashed = _status(done_run)
    assert record["stages"]["more"]["status"] == "modified"
    assert record["stages"]["more"]["problems"] == [
        f"{target}: size or mtime changed since the unit completed (not re-hashed; `snowcat audit` re-hashes)"
    ]
    assert record["stages"]["tasks"]["status"] == "done" and hashed["files_hashed"] == 0

    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _status(done_run)[0]["stages"]["more"]["status"] == "done"
    with open(target, "ab") as f:
        f.write(b"x")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back: the size still tells
    assert _status(done_run)[0]["stages"]["more"]["status"] == "modified"

    (done_run / "stages" / "more" / "extra.txt").write_text("not in the manifest")
    problems = _status(done_run)[0]["stages"]["more"]["problems"]
    assert f"{done_run / 'stages' / 'more' / 'extra.txt'}: not in manifest" in problems


def test_mtimes_kept_to_the_second_only_still_verify(done_run):
    """Lustre's servers and tar's default format keep whole seconds: not a change."""
    for p in (done_run / "stages").rglob("*"):
        if p.is_file() and p.name != "DONE":
            st = p.stat()
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns // 10**9 * 10**9))
    record, _ = _status(done_run)
    assert {s["status"] for s in record["stages"].values()} == {"done"}


def test_a_changed_input_shows_its_consumer_stale_without_hashing(done_run):
    """Lineage in status: each manifest's hash comes from its DONE marker while the manifest's size
    and mtime are unchanged; a re-done input (new manifest, new marker) makes its consumer stale."""
    run = RunDir.open(done_run)
    marker = read_json(done_run / "stages" / "tasks" / "DONE")
    (done_run / "stages" / "tasks" / "note.txt").write_text("a re-run with another result")
    run.mark_done(Unit("tasks"), run.metrics(Unit("tasks")), marker["inputs"])
    record, hashed = _status(done_run)
    assert record["stages"]["tasks"]["status"] == "done"
    assert record["stages"]["more"]["status"] == "stale"
    assert hashed["files_hashed"] == 0
