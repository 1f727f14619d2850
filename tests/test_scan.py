"""Scan: a run started with credentials in its environment holds none of them in any file; a secret
that does reach the run directory fails the scan stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from snowcat.pipeline.context import StageContext
from snowcat.pipeline.dag import build
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import scan
from tinyrun import PLANTED, shared_run

# the shared run (built by the first test that needs it) takes minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return shared_run(tmp_path_factory)


def test_planted_credentials_reach_no_file_of_the_run(run_dir):
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


def test_a_leaked_secret_fails_the_scan(run_dir, tmp_path, monkeypatch):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    monkeypatch.setenv("DAYTONA_API_KEY", PLANTED["DAYTONA_API_KEY"])
    (copy / "logs" / "sft.log").write_text("debug: key=" + PLANTED["DAYTONA_API_KEY"] + "\n")
    cfg = RunDir.open(copy).config()
    node = build(cfg)["scan"]
    ctx = StageContext(name="scan", kind="scan", config=node.config, run_config=cfg, run_dir=copy,
                       out_dir=tmp_path / "scan-out", inputs={}, seed=0)
    with pytest.raises(RuntimeError, match=r"logs/sft.log:1 known:DAYTONA_API_KEY"):
        scan.run(ctx)
    report = (tmp_path / "scan-out" / "scan.json").read_text()
    assert PLANTED["DAYTONA_API_KEY"] not in report


def test_scan_refuses_to_run_before_other_stages(run_dir, tmp_path):
    from snowcat.pipeline.errors import UserError

    cfg = RunDir.open(run_dir).config()
    cfg = OmegaConf.merge(cfg, {"stages": {"scan": {"needs": ["tasks"]}}})
    node = build(cfg)["scan"]
    ctx = StageContext(name="scan", kind="scan", config=node.config, run_config=cfg, run_dir=run_dir,
                       out_dir=tmp_path / "o", inputs={}, seed=0)
    with pytest.raises(UserError, match=r"stages\.scan\.needs: add .*card"):
        scan.run(ctx)
