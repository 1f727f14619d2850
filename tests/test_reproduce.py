"""Reproduce: a tiny CPU run rerun from its archive gives identical checkpoints and metrics (timings
excluded); a run whose code cannot be restored is refused before anything runs."""

from __future__ import annotations

import json
import shutil

import pytest

from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.reproduce import TIMING_METRICS, compare_runs
from snowcat.pipeline.rundir import RunDir
from tests.conftest import SHARED_RUN_TIMEOUT_S, snowcat_in_repo

# every test reads the shared tiny run (built by the first test that needs it: minutes on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)]


def test_reproduction_matches_the_original(tiny_run, tmp_path):
    original = tiny_run
    new = tmp_path / "again"
    proc = snowcat_in_repo("reproduce", original, "--run-dir", new, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and set(report["stages"]) == {"tasks", "sft"}
    assert json.loads((new / "run.json").read_text())["run_id"] == "again"
    assert (new / "config.yaml").read_text() == (original / "config.yaml").read_text()
    for ckpt in ("initial", "final", "step_000010"):
        a = read_json(original / "stages" / "sft" / "checkpoints" / ckpt / "manifest.json")["files"]
        b = read_json(new / "stages" / "sft" / "checkpoints" / ckpt / "manifest.json")["files"]
        assert {k: v["sha256"] for k, v in a.items() if k.endswith(".safetensors")} == {
            k: v["sha256"] for k, v in b.items() if k.endswith(".safetensors")
        }
    m1, m2 = (read_json(r / "stages" / "sft" / "metrics.json") for r in (original, new))
    assert {k: v for k, v in m1.items() if k not in TIMING_METRICS} == {k: v for k, v in m2.items() if k not in TIMING_METRICS}
    assert "duration_s" in report["excluded_metrics"] and "tokens_per_s" in report["excluded_metrics"]


def test_a_different_result_is_reported(tiny_run, tmp_path):
    """The comparison can fail: a reproduction whose SFT final weights differ is named."""

    original = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    weights = copy / "stages" / "sft" / "checkpoints" / "final" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    metrics = read_json(copy / "stages" / "sft" / "metrics.json")
    metrics["final_loss"] = (metrics["final_loss"] or 0) + 1
    (copy / "stages" / "sft" / "metrics.json").write_text(json.dumps(metrics))
    report = compare_runs(RunDir.open(original), RunDir.open(copy))
    assert not report["ok"] and report["stages"]["tasks"]["ok"]
    problems = report["stages"]["sft"]["problems"]
    assert any(p.startswith("checkpoints/final/model.safetensors: sha256") for p in problems)
    assert any(p.startswith("metric final_loss") for p in problems)


def test_unrestorable_code_is_refused(tiny_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run, copy)
    for path in (copy / "provenance").glob("*.json"):
        record = json.loads(path.read_text())
        record["code"]["revision"] = "0" * 40
        path.write_text(json.dumps(record))
    proc = snowcat_in_repo("reproduce", copy, "--run-dir", tmp_path / "never")
    assert proc.returncode == 2
    assert "revision 0000000000000000000000000000000000000000 is not in the git repository" in proc.stderr
    assert not (tmp_path / "never").exists()
