"""The provenance card of a real run holds the recorded hashes; a fact that is missing is said to be."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from snowcat.pipeline.fsio import sha256_file
from tests.conftest import SHARED_RUN_TIMEOUT_S, snowcat_in_repo

# every test reads the shared full run (built by the first test that needs it: minutes on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)]


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_card_holds_the_recorded_facts(full_run):
    run_dir = full_run
    card = (run_dir / "stages" / "card" / "card.md").read_text()
    meta = _front_matter(card)
    tasks = json.loads((run_dir / "stages" / "tasks" / "manifest.json").read_text())["files"]
    init = run_dir / "stages" / "sft" / "checkpoints" / "initial"
    export = json.loads((run_dir / "stages" / "export" / "export.json").read_text())
    prov = json.loads((run_dir / "provenance" / "sft.json").read_text())
    assert meta["library_name"] == "transformers" and meta["snowcat"]["run_id"] == "run"
    assert meta["snowcat"]["initializer_manifest_sha256"] == sha256_file(init / "manifest.json")
    assert meta["snowcat"]["model_manifest_sha256"] == export["model_manifest_sha256"]
    assert meta["snowcat"]["config_sha256"] == sha256_file(run_dir / "config.yaml")
    for fact in (
        tasks["train.parquet"]["sha256"],
        tasks["val.parquet"]["sha256"],
        sha256_file(init / "manifest.json"),
        export["source"]["manifest_sha256"],
        prov["code"]["patch_sha256"],
        "`train.parquet`",
    ):
        assert fact in card
    assert "| all | pass@1 |" in card and "sft:initial (initializer)" in card and "sft:final (exported)" in card
    ledger = json.loads((run_dir / "stages" / "sft" / "checkpoints" / "retention.json").read_text())
    assert f"- `sft`: policy {json.dumps(ledger['policy'])}; {len(ledger['deleted'])} checkpoint(s) deleted" in card
    assert f"snowcat reproduce {run_dir}" in card


def test_missing_facts_are_reported_as_missing(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    shutil.rmtree(copy / "provenance")
    (copy / "stages" / "eval" / "results.json").unlink()
    (copy / "stages" / "sft" / "checkpoints" / "initial" / "meta.json").unlink()
    (copy / "stages" / "sft" / "checkpoints" / "retention.json").unlink()
    proc = snowcat_in_repo("card", copy, "-o", tmp_path / "card.md")
    assert proc.returncode == 0, proc.stderr
    card = (tmp_path / "card.md").read_text()
    assert "Software: not recorded (no provenance records)" in card
    assert "results.json not recorded" in card and "its results are not recorded" in card
    assert "seed not recorded" in card
    assert "`sft`: no retention ledger; what intermediate checkpoints were deleted is not recorded" in card
    assert _front_matter(card)["snowcat"]["code_revision"] is None
    assert "model-index" not in _front_matter(card)


def test_a_stage_that_ran_in_a_container_names_its_image(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    record_file = copy / "provenance" / "sft.json"
    record = json.loads(record_file.read_text())
    record["container"] = {"image": "trainer.sif", "sha256": "ab" * 32}
    record_file.write_text(json.dumps(record))
    proc = snowcat_in_repo("card", copy, "-o", tmp_path / "card.md")
    assert proc.returncode == 0, proc.stderr
    card = (tmp_path / "card.md").read_text()
    assert f"- Container: `trainer.sif` sha256 `{'ab' * 32}`" in card and "- Container: none (stages ran on the host)" in card


def test_agent_behaviour_of_a_multi_turn_evaluation_is_on_the_card(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    path = copy / "stages" / "eval" / "results.json"
    results = json.loads(path.read_text())
    for i, r in enumerate(sorted(results["checkpoints"])):
        results["checkpoints"][r]["behaviour"] = {"turns_mean": 4.5 + i, "claim_precision": 0.25 * (i + 1), "calls/edit": 1.0}
    path.write_text(json.dumps(results))
    proc = snowcat_in_repo("card", copy, "-o", tmp_path / "card.md")
    assert proc.returncode == 0, proc.stderr
    card = (tmp_path / "card.md").read_text()
    rows = {line.split("|")[2].strip(): line for line in card.splitlines() if line.startswith("| agent |")}
    assert set(rows) == {"turns per episode", "edits per episode", "claim precision (passed / submitted)"}
    assert "4.50" in rows["turns per episode"] and "25.0" in rows["claim precision (passed / submitted)"]
