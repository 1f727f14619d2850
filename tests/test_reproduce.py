"""Reproduce: a tiny CPU run (tasks, SFT, RL, export) rerun from its archive gives identical checkpoints
and metrics, volatile fields (timings, speeds, stamps) excluded and named; every real difference is
reported; a run whose code cannot be restored is refused before anything runs."""

from __future__ import annotations

import json
import shutil

import pytest

from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.reproduce import compare_runs
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.volatile import strip_volatile
from tests.conftest import SHARED_RUN_TIMEOUT_S, snowcat_in_repo

# every test reads the shared tiny run, RL and export included (built by the first test that needs it)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)]


def excluded(report: dict, unit: str, file: str) -> set[str]:
    return {e["field"] for e in report["excluded_fields"] if e["unit"] == unit and e["file"] == file}


def test_reproduction_matches_the_original(tiny_run, tmp_path):
    original = tiny_run
    new = tmp_path / "again"
    proc = snowcat_in_repo("reproduce", original, "--run-dir", new, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"], {k: s["problems"] for k, s in report["stages"].items() if s["problems"]}
    assert set(report["stages"]) == {"tasks", "sft", "rl", "export"}
    assert json.loads((new / "run.json").read_text())["run_id"] == "again"
    assert (new / "config.yaml").read_text() == (original / "config.yaml").read_text()
    for ckpt in ("initial", "final", "step_000010"):
        a = read_json(original / "stages" / "sft" / "checkpoints" / ckpt / "manifest.json")["files"]
        b = read_json(new / "stages" / "sft" / "checkpoints" / ckpt / "manifest.json")["files"]
        assert {k: v["sha256"] for k, v in a.items() if k.endswith(".safetensors")} == {
            k: v["sha256"] for k, v in b.items() if k.endswith(".safetensors")
        }
    m1, m2 = (read_json(r / "stages" / "sft" / "metrics.json") for r in (original, new))
    assert strip_volatile(m1)[0] == strip_volatile(m2)[0]
    # what was left out is named, with the reason: the rl timings no list knew, by their unit
    assert {"duration_s", "tokens_per_s", "train_seconds"} <= excluded(report, "sft", "metrics.json")
    assert {"wait_seconds", "sampled_tokens_per_s"} <= excluded(report, "rl", "metrics.json")
    assert all(e["why"] for e in report["excluded_fields"])
    # export.json embeds the source checkpoint's manifest hash: equal bytes, nothing left out
    assert "export.json" not in report["stages"]["export"]["files_equal_narrowed"]
    assert not excluded(report, "export", "export.json")
    # only JSON files are compared narrowly (no RNG snapshot or optimizer state is let off)
    assert all(rel.endswith((".json", ".jsonl")) for s in report["stages"].values() for rel in s["files_equal_narrowed"])


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


def test_real_differences_in_rl_and_export_are_named(tiny_run, tmp_path):
    """Volatile fields are left out, nothing else: a changed result metric, a changed history value
    next to a changed timing, a changed RNG snapshot byte and a changed exported weight are each named."""

    copy = tmp_path / "copy"
    shutil.copytree(tiny_run, copy)
    rl = copy / "stages" / "rl"
    metrics = read_json(rl / "metrics.json")
    metrics["final_reward_mean"] = (metrics["final_reward_mean"] or 0) + 1
    metrics["wait_seconds"] += 100  # a timing: left out
    (rl / "metrics.json").write_text(json.dumps(metrics))
    rows = [json.loads(line) for line in (rl / "metrics_history.jsonl").read_text().splitlines()]
    rows[-1]["grad_norm"] += 1
    rows[-1]["time/step_s"] += 100
    (rl / "metrics_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step = read_json(rl / "checkpoints" / "retention.json")["checkpoints"]
    rng = rl / "checkpoints" / f"step_{int(max(step, key=int)):06d}" / "trainer_state" / "rng_rank00000.pt"
    weights = copy / "stages" / "export" / "model" / "model.safetensors"
    for path in (rng, weights):
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))

    report = compare_runs(RunDir.open(tiny_run), RunDir.open(copy))
    assert not report["ok"] and report["stages"]["sft"]["ok"]
    problems = report["stages"]["rl"]["problems"]
    assert any(p.startswith("metric final_reward_mean") for p in problems)
    assert any(p.startswith("metrics_history.jsonl: sha256") for p in problems)
    assert any(p.startswith(f"{rng.relative_to(rl)}: sha256") for p in problems)
    assert not any("wait_seconds" in p for p in problems)
    assert "wait_seconds" in excluded(report, "rl", "metrics.json")
    assert any(p.startswith("model/model.safetensors: sha256") for p in report["stages"]["export"]["problems"])


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
