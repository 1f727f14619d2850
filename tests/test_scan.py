"""Scan: a run started with credentials in its environment holds none of them in any file; a secret
that does reach the run directory fails the scan stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import scan
from tests.conftest import PLANTED, SHARED_RUN_TIMEOUT_S, runner_context

# every test reads the shared full run (built by the first test that needs it: minutes on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)]


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def test_planted_credentials_reach_no_file_of_the_run(full_run):
    run_dir = full_run
    assert (run_dir / "stages" / "scan" / "DONE").is_file()
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.parent.name == "logs" for p in files) and any("provenance" in p.parts for p in files)
    for path in files:
        data = path.read_bytes()
        for name, value in PLANTED.items():
            assert value.encode() not in data, f"{name} leaked into {path}"
    # the environment was seen (and redacted), not absent
    record = json.loads((run_dir / "provenance" / "sft.json").read_text())
    assert record["env"].get("HF_TOKEN") == "<redacted>"


def test_a_leaked_secret_fails_the_scan(full_run, tmp_path, monkeypatch):
    copy = _copy(full_run, tmp_path)
    monkeypatch.setenv("DAYTONA_API_KEY", PLANTED["DAYTONA_API_KEY"])
    (copy / "logs" / "sft.log").write_text("debug: key=" + PLANTED["DAYTONA_API_KEY"] + "\n")
    (copy / "stages" / "scan" / "scan.json").unlink()  # the clean scan's report, to be written again
    ctx = runner_context(copy, "scan")  # scan reads the whole run's config: the runner's context
    with pytest.raises(RuntimeError, match=r"logs/sft.log:1 known:DAYTONA_API_KEY"):
        scan.run(ctx)
    report = (ctx.out_dir / "scan.json").read_text()
    assert "DAYTONA_API_KEY" in report and PLANTED["DAYTONA_API_KEY"] not in report


def test_scan_refuses_to_run_before_other_stages(full_run, tmp_path):
    copy = _copy(full_run, tmp_path)
    cfg = OmegaConf.merge(RunDir.open(copy).config(), {"stages": {"scan": {"needs": ["tasks"]}}})
    ctx = runner_context(copy, "scan", cfg)
    with pytest.raises(UserError, match=r"stages\.scan\.needs: add .*card"):
        scan.run(ctx)
