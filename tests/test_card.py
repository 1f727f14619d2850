"""The provenance card of a real run holds the recorded hashes; a fact that is missing is said to be."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import build
from snowcat.pipeline.fsio import sha256_file
from snowcat.pipeline.reports import card as card_mod
from snowcat.pipeline.reports.card.checklist import CHECKLIST
from snowcat.pipeline.rundir import RunDir
from tests.conftest import DEMO, SHARED_RUN_TIMEOUT_S, Snowcat, runner_context, snowcat_in_repo

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


# --- the card tells the whole truth (issue 20) ------------------------------------------------------


def _card_of(copy, tmp_path) -> str:
    proc = snowcat_in_repo("card", copy, "-o", tmp_path / "card.md")
    assert proc.returncode == 0, proc.stderr
    return (tmp_path / "card.md").read_text()


def _checklist(card: str) -> dict[str, str]:
    table = card.split("## Record checklist")[1]
    rows = [cells for line in table.splitlines() if len(cells := line.split("|")) == 4]
    return {cells[1].strip(): cells[2].strip() for cells in rows[2:]}  # past the header and its rule


def test_every_field_of_the_snowball_card_has_a_value_or_says_not_recorded(full_run):
    card = (full_run / "stages" / "card" / "card.md").read_text()
    rows = _checklist(card)
    assert list(rows) == list(CHECKLIST)  # every field, in order
    for field in CHECKLIST:
        assert rows[field], field
    assert rows["license"] == "not recorded" and rows["per-cohort exposure through the exported step"] == "not recorded"
    assert rows["external benchmarks"].startswith("none run")
    results = json.loads((full_run / "stages" / "eval" / "results.json").read_text())
    final, initial = (results["checkpoints"][r]["groups"]["all"]["pass@1"] for r in ("sft:final", "sft:initial"))
    d = results["comparisons"]["sft:final - sft:initial"]["all"]["pass@1"]
    assert rows["initializer vs exported score"] == (  # the exported SFT weights beside the checkpoint SFT started from
        f"eval: exported `sft:final` pass@1 {100 * final:.1f}%, initializer `sft:initial` {100 * initial:.1f}% "
        f"(paired Δ {100 * d['diff']:+.1f} ± {100 * d['se']:.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}] points)"
    )
    assert "## Stages" in card and "- `sft` (sft): done, 1 attempt(s)" in card
    assert "Also scored" not in card  # eval scored two checkpoints: both are columns of its table


def test_an_initializer_no_evaluation_scored_is_said_to_be_not_recorded(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    path = copy / "stages" / "eval" / "results.json"
    results = json.loads(path.read_text())
    del results["checkpoints"]["sft:initial"]
    results["comparisons"] = {}
    path.write_text(json.dumps(results))
    rows = _checklist(_card_of(copy, tmp_path))
    final = results["checkpoints"]["sft:final"]["groups"]["all"]["pass@1"]
    assert rows["initializer vs exported score"] == (
        f"eval: exported `sft:final` pass@1 {100 * final:.1f}%, initializer not recorded (`eval` did not score `sft:initial`)"
    )


def test_model_index_holds_only_the_exported_weights(full_run):
    meta = _front_matter((full_run / "stages" / "card" / "card.md").read_text())
    names = {m["name"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
    assert names == {"pass@1 sft:final"}  # sft:initial was evaluated too, but is not what is published
    assert meta["model-index"][0]["name"] == "run (sft:final)"


def test_export_format_counts_weight_shards_and_tags_come_from_the_run(full_run):
    card = (full_run / "stages" / "card" / "card.md").read_text()
    files = json.loads((full_run / "stages" / "export" / "model" / "manifest.json").read_text())["files"]
    shards = sum(rel.endswith(".safetensors") for rel in files)
    assert shards > 1 and f"{shards} weight shard(s) ({len(files)} files with config and tokenizer" in card
    config = json.loads((full_run / "stages" / "export" / "model" / "config.json").read_text())
    tags = _front_matter(card)["tags"]
    assert config["model_type"] in tags and "coding-agent" not in tags  # the full run trains on closure/arith only


def test_a_reference_that_resolves_to_the_exported_weights_counts_as_evaluated(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    (copy / "stages" / "sft" / "checkpoints" / "best").write_text("final\n")  # `sft:best` names the exported dir
    path = copy / "stages" / "eval" / "results.json"
    results = json.loads(path.read_text())
    results["checkpoints"]["sft:best"] = results["checkpoints"].pop("sft:final")
    path.write_text(json.dumps(results))
    card = _card_of(copy, tmp_path)
    assert "sft:best (exported)" in card and "did not evaluate the exported checkpoint" not in card


def test_packages_differing_across_stages_and_absent_ones_are_shown(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    record_file = copy / "provenance" / "export.json"
    record = json.loads(record_file.read_text())
    torch = record["packages"]["torch"]
    record["packages"]["torch"] = "9.9.9"
    record["packages"]["vllm"] = None
    record_file.write_text(json.dumps(record))
    card = _card_of(copy, tmp_path)
    assert f"torch {torch} (" in card and " / 9.9.9 (export)" in card
    assert "vllm absent" in card or "vllm absent (export)" in card


@pytest.mark.parametrize("metric, flagged", [("val/pass@1", True), ("dev/pass@1", False)])
def test_selection_on_the_scoring_split_is_flagged(full_run, tmp_path, metric, flagged):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    path = copy / "stages" / "export" / "export.json"
    record = json.loads(path.read_text())
    record["source"] |= {"metric": metric, "value": 0.5, "reason": f"best retained checkpoint by {metric} (max)"}
    path.write_text(json.dumps(record))
    card = _card_of(copy, tmp_path)
    assert ("SELECTION ON THE SCORING SPLIT" in card) is flagged
    if flagged:
        assert "val/pass@1 = 0.5000 (SE not recorded) on the `val` split, the split `eval` scores it on" in card
        record["source"]["step"] = 20  # the trainer's history row at the chosen step holds the SE
        path.write_text(json.dumps(record))
        history = copy / "stages" / "sft" / "metrics_history.jsonl"
        rows = [json.loads(line) for line in history.read_text().splitlines()]
        rows = [r | {"val/pass@1_se": 0.07, "val/tasks": 30} if r["step"] == 20 else r for r in rows]
        history.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert "val/pass@1 = 0.5000 ± 0.0700 (SE over 30 tasks) on the `val` split" in _card_of(copy, tmp_path)


def test_license_and_intended_use_come_from_the_config(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    config = copy / "config.yaml"
    text = config.read_text()
    assert "license: ''" in text and "intended_use: ''" in text  # frozen with every key
    config.write_text(text.replace("license: ''", "license: apache-2.0").replace("intended_use: ''", "intended_use: research"))
    info = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps(info | {"config_sha256": sha256_file(config)}))  # a run made so
    rows = _checklist(_card_of(copy, tmp_path))
    assert rows["license"] == "apache-2.0" and rows["intended use"] == "research"


def test_rl_layout_and_backend_are_the_recorded_ones(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  rl:\n    kind: rl\n    needs: [tasks, sft]\n    init_from: sft:final\n"
        "    resources: {components: {trainer: {tasks_per_node: 2}, rollout: {tasks_per_node: 3}}}\n"
    )
    node = build(config_mod.load(cfg_file))["rl"]
    layout = card_mod.training._layout(node, 5, {"world_size": 2, "backend": "torch"})
    assert layout == (
        "2 data-parallel trainer rank(s) (checkpoint meta); ranks per role trainer 2, rollout 3 (config); "
        "one world of 5 rank(s) (recorded by rank 0)"
    )
    assert "not recorded data-parallel trainer rank(s)" in card_mod.training._layout(node, None, {})
    # each component's tasks, not only its nodes (a 2-rank trainer read "trainer: 1×0 GPU")
    assert card_mod.training._shapes(node.config.resources) == (
        "trainer: 1 node(s) × 2 task(s) × 0 GPU, rollout: 1 node(s) × 3 task(s) × 0 GPU"
    )


def test_paired_comparisons_of_the_evaluation_are_on_the_card(full_run):
    card = (full_run / "stages" / "card" / "card.md").read_text()
    comparisons = json.loads((full_run / "stages" / "eval" / "results.json").read_text())["comparisons"]
    assert comparisons
    for pair, by_group in comparisons.items():
        c = by_group["all"]["pass@1"]
        assert f"| {pair} | all | {by_group['all']['tasks']} | {100 * c['diff']:+.1f} ± {100 * c['se']:.1f}" in card


def test_per_cohort_exposure_sums_the_history_up_to_the_exported_step(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    history = copy / "stages" / "sft" / "metrics_history.jsonl"
    rows = [json.loads(line) | {"exposure/arith": 2, "exposure/closure": 1} for line in history.read_text().splitlines()]
    history.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = copy / "stages" / "export" / "export.json"
    record = json.loads(path.read_text())
    record["source"]["step"] = 10
    path.write_text(json.dumps(record))
    rows = _checklist(_card_of(copy, tmp_path))
    assert (
        rows["per-cohort exposure through the exported step"] == "arith 20, closure 10 trajectories in the loss through step 10"
    )


def test_stage_lines_say_attempts_and_continuations_as_recorded(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    run = RunDir(copy)
    run.update_stage("sft", attempts=3, continuations_used=2, job_ids=["101", "102", "103"])  # added to its own
    jobs = len(run.record("sft")["job_ids"])
    card = _card_of(copy, tmp_path)
    assert f"- `sft` (sft): done, 3 attempt(s), {jobs} job(s)/process(es), continued 2 time(s) after a walltime" in card
    assert _checklist(card)["resume and requeue history"].endswith("retried: sft")


def test_initializer_parents_are_named_as_its_model_card_names_them(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    meta_file = copy / "stages" / "sft" / "checkpoints" / "initial" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["lineage"] = {"source": "hf:org/merged", "hub_id": "org/merged", "revision": "a" * 40, "license": "apache-2.0",
                       "files": {}, "parents": ["org/base-a", "org/specialist-b"], "parents_relation": "merge"}  # fmt: skip
    meta_file.write_text(json.dumps(meta))
    rows = _checklist(_card_of(copy, tmp_path))
    assert rows["initializer"] == "hf:org/merged" and rows["initializer revision"] == "a" * 40
    assert rows["initializer parents (merge lineage)"].startswith("org/base-a, org/specialist-b (merge; as its model card")


# --- the scan verdict, external benchmarks, GPU-hours, selection on dev (issue 20, second part) -------

TOKEN = "ghp_" + "planted" + "Q7xZ" * 8  # credential-shaped (a GitHub token), put together here so no file holds one


def test_a_clean_run_card_states_the_card_stages_scan(full_run):
    report = json.loads((full_run / "stages" / "card" / "scan.json").read_text())
    assert report["excluded"] == ["stages/card", "stages/scan"] and report["findings"] == [] and report["files"] > 50
    card = (full_run / "stages" / "card" / "card.md").read_text()
    assert (
        f"- Before the card (`card` stage, `stages/card/scan.json`): clean: no credential found in {report['files']} file(s)"
        in card
    )
    assert "- After the card (`scan` stage, which scans the card too): not recorded (stage pending)" in card
    rows = _checklist(card)
    assert rows["data screening for credentials"].startswith(
        f"card stage, before the card: clean: no credential found in {report['files']}"
    )


def test_a_credential_in_an_artefact_makes_the_card_say_so(full_run, tmp_path):
    from snowcat.stages import card as card_stage  # noqa: PLC0415 (the stage itself, as the runner calls it)
    from snowcat.stages import scan as scan_stage  # noqa: PLC0415

    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    with open(copy / "logs" / "sft.log", "a") as log:
        log.write(f"debug: token={TOKEN}\n")
    lines = (copy / "logs" / "sft.log").read_text().count("\n")
    (copy / "stages" / "card" / "notes.txt").write_text(TOKEN)  # in the card's own outputs: not its scan's business
    card_stage.run(runner_context(copy, "card"))
    report = json.loads((copy / "stages" / "card" / "scan.json").read_text())
    assert [(r["file"], r["line"], r["kind"]) for r in report["findings"]] == [("logs/sft.log", lines, "github_token")]
    card = (copy / "stages" / "card" / "card.md").read_text()
    assert TOKEN not in card
    assert f"1 CREDENTIAL FINDING(S) in {report['files']} file(s): `logs/sft.log`:{lines} github_token" in card
    assert "- CREDENTIALS IN THE RUN DIRECTORY: the `card` stage's scan found 1 CREDENTIAL FINDING(S)" in card
    # the scan stage, after the card, searches the card's directory too
    with pytest.raises(RuntimeError, match="2 credential finding"):
        scan_stage.run(runner_context(copy, "scan"))
    rows = _checklist(_card_of(copy, tmp_path))
    assert "scan stage, after the card: 2 CREDENTIAL FINDING(S)" in rows["data screening for credentials"]
    assert "`stages/card/notes.txt`:1 github_token" in rows["data screening for credentials"]


def test_a_card_without_a_recorded_scan_says_not_recorded(full_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    (copy / "stages" / "card" / "scan.json").unlink()
    rows = _checklist(_card_of(copy, tmp_path))
    assert rows["data screening for credentials"].startswith(
        "card stage, before the card: not recorded; scan stage, after the card: clean"
    )


def test_external_benchmarks_none_run_or_the_imported_tasks_scored(full_run, tmp_path):
    results = json.loads((full_run / "stages" / "eval" / "results.json").read_text())
    domains = sorted(g for g in results["checkpoints"]["sft:final"]["groups"] if "/" not in g and g != "all")
    rows = _checklist((full_run / "stages" / "card" / "card.md").read_text())
    assert (
        rows["external benchmarks"] == f"none run: eval ({', '.join(domains)} of the `val` split) scored tasks this run generated"
    )
    # a tasks stage that imported the scored domain from files: the evaluation is named as scoring it
    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    config = copy / "config.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["stages"]["tasks"]["imports"] = [{"format": "harbor", "path": "/data/harbor-tasks", "domain": domains[0], "val_count": 4}]
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    info = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps(info | {"config_sha256": sha256_file(config)}))
    rows = _checklist(_card_of(copy, tmp_path))
    assert rows["external benchmarks"].startswith(
        f"eval: imported `harbor` tasks from `/data/harbor-tasks` (domain {domains[0]}) on this run's `val` split"
    )
    assert "not by the benchmark's own harness" in rows["external benchmarks"]


def _plant_gpus(copy, unit: str, host: str, gpus: list[dict] | None, seconds: float | None = None) -> None:
    path = copy / "provenance" / f"{unit}.json"
    record = json.loads(path.read_text())
    record["host"] |= {"hostname": host, "gpus": gpus}
    if seconds is not None:
        record["times"] = {"started": "2026-01-01T00:00:00+00:00", "ended": f"2026-01-01T00:{int(seconds // 60):02d}:00+00:00"}
    path.write_text(json.dumps(record))


def _plant_rank(copy, unit: str, rank: int, host: str, gpus: list[dict] | None) -> None:
    ranks = copy / "provenance" / "ranks"
    ranks.mkdir(exist_ok=True)
    record = {"stage": unit, "item": None, "rank": rank, "role": None, "host": {"hostname": host, "gpus": gpus}}
    (ranks / f"{unit}.rank{rank}.json").write_text(json.dumps(record))


def test_gpu_hours_from_what_each_rank_recorded(full_run, tmp_path):
    rows = _checklist((full_run / "stages" / "card" / "card.md").read_text())
    assert rows["GPU-hours"] == "0 (CPU only: no rank of the 4 completed unit(s) recorded a GPU)"
    assert "- `sft` (sft): done, 1 attempt(s), 1 job(s)/process(es)" in (full_run / "stages" / "card" / "card.md").read_text()

    copy = tmp_path / "run"
    shutil.copytree(full_run, copy)
    h100 = "NVIDIA H100"
    # sft, 30 minutes: rank 0 on n1 with GPUs a, b; rank 1 on n1 sees the same two; rank 2 on n2 sees c, d -> 4 GPUs
    _plant_gpus(copy, "sft", "n1", [{"name": h100, "uuid": "GPU-a"}, {"name": h100, "uuid": "GPU-b"}], seconds=1800)
    _plant_rank(copy, "sft", 1, "n1", [{"name": h100, "uuid": "GPU-a"}, {"name": h100, "uuid": "GPU-b"}])
    _plant_rank(copy, "sft", 2, "n2", [{"name": h100, "uuid": "GPU-c"}, {"name": h100, "uuid": "GPU-d"}])
    # eval, 15 minutes: two ranks on one host that recorded no uuid, each seeing 2 GPUs -> counted once: 2
    _plant_gpus(copy, "eval", "n3", [{"name": "GH200"}, {"name": "GH200"}], seconds=900)
    _plant_rank(copy, "eval", 1, "n3", [{"name": "GH200"}, {"name": "GH200"}])
    card = _card_of(copy, tmp_path)
    assert "- `sft` (sft): done" in card and "4 GPU(s) (4× NVIDIA H100 on 2 host(s)), 2.00 GPU-hours" in card
    assert "2 GPU(s) (2× GH200 on 1 host(s)), 0.50 GPU-hours" in card
    assert "- `tasks` (tasks): done" in card and "0 GPUs (CPU only)" in card
    assert _checklist(card)["GPU-hours"].startswith("2.50 in total (sft 2.00, eval 0.50; GPUs each rank recorded")

    _plant_gpus(copy, "export", "n1", None)  # a unit whose GPU probe recorded nothing: not zero, not guessed
    rows = _checklist(_card_of(copy, tmp_path))
    assert rows["GPU-hours"].startswith("2.50 in total") and rows["GPU-hours"].endswith("; not recorded for export")


DEMO_LIKE = [  # configs/demo.yaml as it is (dev splits, export of the best retained, eval of rl:best), made small
    "stages.tasks.domains.closure={count: 60, val_count: 12, dev_count: 8, difficulties: [1, 2]}",
    "stages.tasks.domains.arith={count: 60, val_count: 12, dev_count: 8, difficulties: [2]}",
    *(
        f"stages.{kv}"
        for kv in (
            "sft.steps=20 sft.tokenizer_vocab_size=320 sft.seq_len=64 sft.batch_rows=4 sft.warmup_steps=2 sft.save_every=10 "
            "sft.threads=1 sft.eval_tasks=4 sft.eval_max_new_tokens=8 probe.limit=16 probe.attempts=2 probe.band_max_pass=2 "
            "select.min_pass=0 select.max_pass=2 rl.updates=4 rl.tasks_per_update=4 rl.attempts=4 rl.max_tokens=8 "
            "rl.eval_every=2 rl.eval_tasks=8 rl.eval_attempts=1 rl.save_every=2 rl.warmup_steps=1 eval.limit=8 "
            "eval.attempts=2 eval.pass_k=[1,2] eval.max_tokens=8 eval.bootstrap_samples=100 eval_greedy.limit=8 "
            "eval_greedy.max_tokens=8 eval_greedy.bootstrap_samples=100 export.probe_rows=2 export.probe_len=16 "
            "export.max_new_tokens=8"
        ).split()
    ),
]


@pytest.fixture(scope="module")
def demo_like_run(tmp_path_factory):
    """configs/demo.yaml with every stage made small: RL selects on the dev split, export takes the best retained."""
    root = tmp_path_factory.mktemp("demo-like")
    Snowcat(root)("run", DEMO, *DEMO_LIKE, "--run-dir", root / "run", timeout=SHARED_RUN_TIMEOUT_S, check=True)
    return root / "run"


def test_the_demo_selects_on_dev_and_the_card_names_the_exported_score_without_a_warning(demo_like_run):
    run_dir = demo_like_run
    source = json.loads((run_dir / "stages" / "export" / "export.json").read_text())["source"]
    assert source["metric"] == "dev/pass@1"  # chosen by RL's retention metric on dev.parquet
    best = (run_dir / "stages" / "rl" / "checkpoints" / "best").read_text().strip()
    assert source["ref"] == f"rl:{best}"
    card = (run_dir / "stages" / "card" / "card.md").read_text()
    assert "SELECTION ON THE SCORING SPLIT" not in card
    assert "rl:best (exported)" in card
    scored = json.loads((run_dir / "stages" / "eval" / "results.json").read_text())["checkpoints"]
    val = {r: scored[r]["groups"]["all"] for r in scored}
    rows = _checklist(card)
    # the exported rl:best beside what RL started from (its init_from, sft:final), both scored by eval
    assert rows["initializer vs exported score"].startswith(
        f"eval: exported `rl:best` pass@1 {100 * val['rl:best']['pass@1']:.1f}%, "
        f"initializer `sft:final` {100 * val['sft:final']['pass@1']:.1f}% (paired Δ "
    )
    # the table shows sft:final and rl:best; the line under it names the others eval scored, with pass@1 ± SE
    others = tuple(r for r in scored if r not in ("sft:final", "rl:best"))
    assert "rl:final" in others
    also = ", ".join(f"`{r}` {100 * val[r]['pass@1']:.1f} ± {100 * val[r]['pass@1_se']:.1f}" for r in others)
    assert f"Also scored by `eval`, compared in the paired tables below: {also} (pass@1 in %, all tasks)." in card
    assert "chosen by dev/pass@1 = " in rows["development vs independent evaluation"]
    assert "on the `dev` split, which no evaluation scores (they score `val`)" in rows["development vs independent evaluation"]
    dev = json.loads((run_dir / "stages" / "tasks" / "metrics.json").read_text())["dev"]
    assert f"| tasks | `dev.parquet` | {dev} |" in card
