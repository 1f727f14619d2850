"""Provenance records: complete, reproducible (the patch re-applies), verifiable, and free of secrets."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from snowcat.pipeline import provenance
from snowcat.pipeline.fsio import atomic_write_text, sha256_file, write_manifest
from snowcat.pipeline.provenance import REQUIRED_FIELDS, capture, check_complete, code_state, container_state, record_unit, write
from snowcat.pipeline.reports import card
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.scrub import scan_tree

HF = "hf_planted123AbCdEfGhIjKlMnOpQrStUvWx"
DAYTONA = "dtn_7f3c9a0e5b2d4c1f8a6e9b3d7c5a1f0e"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false"]


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("DAYTONA_API_KEY", DAYTONA)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "770")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "booster")
    monkeypatch.setenv("SLURM_HET_SIZE", "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("UNRELATED_VAR", "not recorded")
    for k in ("SNOWCAT_IMAGE", "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    atomic_write_text(run / "config.yaml", "name: demo\nseed: 1\n")
    for i in range(2):  # a fan-out input stage: one manifest per element
        atomic_write_text(run / "stages" / "probe" / f"{i:04d}" / "result.json", f'{{"i": {i}}}')
        write_manifest(run / "stages" / "probe" / f"{i:04d}")
    atomic_write_text(run / "stages" / "tasks" / "tasks.jsonl", "{}\n")
    write_manifest(run / "stages" / "tasks")
    atomic_write_text(run / "stages" / "select" / "selected.json", "[1, 2]")
    return run


def test_capture_is_complete_verifiable_and_secret_free(run_dir, secret_env):
    out = run_dir / "stages" / "select"
    inputs = {"probe": run_dir / "stages" / "probe", "tasks": run_dir / "stages" / "tasks"}
    rec = capture(
        "select",
        run_dir,
        inputs,
        out,
        {"cmd": f"train --token {HF}", "note": f"key={DAYTONA}"},
        started="2026-11-29T00:00:00+00:00",
        stage_config={"k": 3},
        probe_gpu=False,
    )
    path = write(rec, run_dir)
    assert path == run_dir / "provenance" / "select.json"
    text = path.read_text()
    assert HF not in text and DAYTONA not in text and "planted" not in text
    assert check_complete(rec, run_dir) == []
    assert scan_tree(run_dir) == []  # the audit's scan finds nothing in what provenance wrote

    head = subprocess.run(
        ["git", "-C", str(provenance.source_root()), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert rec["code"]["revision"] == head
    assert sha256_file(run_dir / rec["code"]["patch"]) == rec["code"]["patch_sha256"]
    assert rec["config"]["sha256"] == sha256_file(run_dir / "config.yaml")
    assert set(rec["inputs"]["probe"]["manifests"]) == {"0000/manifest.json", "0001/manifest.json"}
    assert rec["inputs"]["tasks"]["manifests"] == {"manifest.json": sha256_file(run_dir / "stages/tasks/manifest.json")}
    assert (
        rec["slurm"]["job_id"] == "777"
        and rec["slurm"]["array_task_id"] == "7"
        and rec["slurm"]["het"] == {"SLURM_HET_SIZE": "2"}
    )
    assert rec["env"]["HF_TOKEN"] == "<redacted>" and rec["env"]["OMP_NUM_THREADS"] == "4"
    assert "UNRELATED_VAR" not in rec["env"] and "DAYTONA_API_KEY" not in rec["env"]  # not whitelisted at all
    assert rec["packages"]["numpy"] and rec["python"]["version"] and rec["host"]["cpu_count"] >= 1
    assert rec["container"] is None

    # the runner then writes metrics + manifest: the recorded output hashes still verify ...
    atomic_write_text(out / "metrics.json", '{"n": 2}')
    write_manifest(out, exclude=("DONE",))
    assert check_complete(rec, run_dir) == []
    # ... until an output is changed behind the record's back
    atomic_write_text(out / "selected.json", "[1, 2, 3]")
    write_manifest(out, exclude=("DONE",))
    assert any("outputs" in p and "differ" in p for p in check_complete(rec, run_dir))


def test_missing_fields_inputs_and_unredacted_env_are_reported(run_dir):
    problems = check_complete({"stage": "rl"})
    assert all(any(f in p for p in problems) for f in REQUIRED_FIELDS if f != "stage")
    rec = capture("select", run_dir, {"ghost": run_dir / "stages" / "ghost"}, run_dir / "stages" / "select", probe_gpu=False)
    rec["env"]["HF_TOKEN"] = HF
    problems = check_complete(rec, run_dir)
    assert any("input ghost" in p for p in problems) and any("env HF_TOKEN" in p for p in problems)
    (run_dir / "config.yaml").write_text("name: edited\n")
    assert any("config.yaml" in p for p in check_complete(rec, run_dir))


def _git(repo, *args):
    subprocess.run(GIT + ["-C", str(repo), *args], check=True, capture_output=True)


def test_code_patch_reproduces_the_tree_and_is_scrubbed(tmp_path, monkeypatch):
    repo = tmp_path / "src"
    (repo / "pipeline").mkdir(parents=True)
    (repo / "pipeline" / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("logs/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "pipeline" / "a.py").write_text("x = 2\n")  # uncommitted change
    (repo / "pipeline" / "new.py").write_text("y = 3\n")  # untracked file
    (repo / "logs").mkdir()
    (repo / "logs" / "big.log").write_text("ignored\n")
    run = tmp_path / "run"
    rec = code_state(run, root=repo)
    assert rec["dirty"] and not rec["patch_scrubbed"] and [u["path"] for u in rec["untracked"]] == ["pipeline/new.py"]
    patch = run / rec["patch"]
    assert sha256_file(patch) == rec["patch_sha256"] and rec["patch"].startswith("provenance/code-")
    # a clean checkout of the revision plus the patch is the tree that ran
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    _git(clone, "checkout", "-q", rec["revision"])
    _git(clone, "apply", str(patch))
    assert (clone / "pipeline" / "a.py").read_text() == "x = 2\n" and (clone / "pipeline" / "new.py").read_text() == "y = 3\n"

    monkeypatch.setenv("HF_TOKEN", HF)
    (repo / "pipeline" / "new.py").write_text(f"TOKEN = '{HF}'\n")  # someone left a token in the tree
    rec2 = code_state(run, root=repo)
    assert rec2["patch_scrubbed"] and HF.encode() not in (run / rec2["patch"]).read_bytes()
    assert rec2["patch"] != rec["patch"] and patch.exists()  # content-addressed: the first one is kept

    outside = code_state(run, root=tmp_path / "run")
    assert outside["revision"] is None and "no git revision" in outside["error"]


def test_container_digest_cached_and_labels(tmp_path):
    sif = tmp_path / "trainer_test_double.sif"  # a stand-in file: apptainer cannot run here
    sif.write_bytes(b"not really a SIF")
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"org.snowcat.revision": "abc"}))
    run = tmp_path / "run"
    rec = container_state(run, {"APPTAINER_CONTAINER": str(sif)}, labels_json=labels)
    assert (
        rec["sha256"] == sha256_file(sif) and rec["labels"] == {"org.snowcat.revision": "abc"} and rec["runtime"] == "apptainer"
    )
    assert len(list((run / "provenance" / "images").glob("*.json"))) == 1
    given = container_state(run, {"SNOWCAT_IMAGE": "/elsewhere/x.sif", "SNOWCAT_IMAGE_SHA256": "f" * 64}, labels_json=labels)
    assert given["sha256"] == "f" * 64
    missing = container_state(run, {"SNOWCAT_IMAGE": "/elsewhere/x.sif"}, labels_json=labels)
    assert missing["sha256"] is None and "SNOWCAT_IMAGE_SHA256" in missing["sha256_error"]
    assert container_state(run, {}) is None


def test_record_unit_hook_writes_item_record(run_dir, secret_env):
    run = SimpleNamespace(
        path=run_dir, state=lambda: {"stages": {"probe[1]": {"started": "2026-11-29T01:00:00+00:00", "attempts": 2}}}
    )
    unit = SimpleNamespace(stage="probe", index=1, key="probe[1]")
    ctx = SimpleNamespace(
        inputs={"tasks": run_dir / "stages" / "tasks"},
        out_dir=run_dir / "stages" / "probe" / "0001",
        kind="probe",
        rank=0,
        world_size=1,
        role=None,
        seed=5,
        config={"n": 8},
    )
    path = record_unit(run, unit, ctx)
    rec = json.loads(path.read_text())
    assert path.name == "probe.1.json" and rec["item"] == 1 and rec["extra"]["attempts"] == 2
    assert rec["times"]["started"] == "2026-11-29T01:00:00+00:00" and check_complete(rec, run_dir) == []
    assert rec["host"]["gpus"] == [] or all(g["name"] for g in rec["host"]["gpus"])  # torch probed lazily


@pytest.mark.slow
def test_every_rank_of_a_multi_role_stage_records_what_it_ran_on(snowcat, tmp_path):
    cfg = tmp_path / "fabric.yaml"
    cfg.write_text(
        "name: fabric\nstages:\n  fabric:\n    kind: mpi_check\n    resources:\n      components:\n"
        "        trainer: {nodes: 1, tasks_per_node: 1}\n        rollout: {nodes: 1, tasks_per_node: 2}\n"
    )
    snowcat("run", cfg, "--run-dir", tmp_path / "run", check=True)
    ranks = sorted((tmp_path / "run" / "provenance" / "ranks").iterdir())
    assert [p.name for p in ranks] == ["fabric.rank1.json", "fabric.rank2.json"]  # rank 0 writes the unit's record
    records = [json.loads(p.read_text()) for p in ranks]
    assert {(r["rank"], r["role"], r["world_size"]) for r in records} == {(1, "rollout", 3), (2, "rollout", 3)}
    assert all(r["host"]["hostname"] == os.uname().nodename and r["host"]["gpus"] == [] for r in records)
    facts = card.facts.Facts(RunDir.open(tmp_path / "run"))
    assert (
        card.hardware.role_hardware(facts, facts.dag["fabric"], "rollout")
        == f"fabric: 2 rollout rank(s) on {os.uname().nodename}; GPUs: none"
    )


@pytest.mark.skipif(provenance._accelerator_devices(), reason="a host with accelerator device nodes probes them through torch")
def test_a_unit_that_never_loaded_torch_records_no_gpu_without_importing_it():
    # tasks, select, card...: the record says no GPU and no torch kernels, and loading torch just to
    # say so (a second a job) is not done
    code = "import sys; from snowcat.pipeline import provenance; h = provenance.host_state(); print(h['gpus'], h['cpu_capability'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "None", "False"], out
    # a unit that has torch loaded records the kernels torch dispatches to
    code = "import sys, torch; from snowcat.pipeline import provenance; print(provenance.host_state()['cpu_capability'])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() not in (
        "",
        "None",
    )


def test_the_card_names_a_cpu_by_the_units_that_loaded_torch():
    light = {"host": {"cpu_model": "EPYC", "cpu_capability": None}}
    heavy = {"host": {"cpu_model": "EPYC", "cpu_capability": "AVX512"}}
    other = {"host": {"cpu_model": "Grace", "cpu_capability": None}}  # only light units ran there
    assert card.hardware.cpu_line([light, heavy, light]) == "EPYC (torch kernels: AVX512)"
    assert card.hardware.cpu_line([light, heavy, other]) == "EPYC (torch kernels: AVX512); Grace (torch kernels: not recorded)"
