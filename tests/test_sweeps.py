"""Sweeps vary what they say: a fan-out over a stage's own keys gives each unit that variant's config
and nothing else (not even another seed); keys nothing reads are refused at load; later stages name
one unit as `<stage>[key=value]:<checkpoint>`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from scipy import stats

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.pipeline.reports import compare as compare_mod
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import make_context
from tests.conftest import TINY, write_config

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo.yaml"
RL_SWEEP = ["stages.rl.fan_out={estimator: [grpo, rloo_n], tis_cap: [1.0, 2.0]}"]
# the demo's later stages name rl's checkpoints: with rl fanned out each must name one unit
NAME_ONE = [
    "stages.eval.checkpoints=['sft:final', 'rl[estimator=grpo,tis_cap=1.0]:final', 'rl[3]:final']",
    "stages.eval_greedy.checkpoints=['rl[estimator=rloo_n,tis_cap=2.0]:final']",
    "stages.export.checkpoint='rl[estimator=rloo_n,tis_cap=2.0]:best'",
]


def _fields(section) -> dict:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name != "fan_out"}


def test_each_unit_of_a_sweep_runs_its_variant_and_only_that_differs(tmp_path):
    cfg = config_mod.load(DEMO, RL_SWEEP + NAME_ONE)
    node = build(cfg)["rl"]
    assert len(node.units) == 4
    run = RunDir.create(cfg, tmp_path / "run")
    base = _fields(config_mod.typed(cfg).stages["rl"])
    contexts = [make_context(run, node, unit, cfg) for unit in node.units]
    for ctx, item in zip(contexts, node.items, strict=True):
        assert ctx.item == item
        variant = _fields(ctx.config)
        assert (variant["estimator"], variant["tis_cap"]) == (item["estimator"], item["tis_cap"])
        assert {k for k in base if base[k] != variant[k]} <= {"estimator", "tis_cap"}
    # the variants differ by nothing else, not even the seed (common random numbers)
    assert len({ctx.seed for ctx in contexts}) == 1
    assert {(c.config.estimator, c.config.tis_cap) for c in contexts} == {(e, c) for e in ("grpo", "rloo_n") for c in (1.0, 2.0)}


def test_replicas_differ_by_their_seed_only(tmp_path):
    cfg = config_mod.load(
        DEMO, ["stages.probe.fan_out={temperature: [0.5, 1.0], replica: [0, 1]}", "stages.select.probe='probe[0]'"]
    )
    node = build(cfg)["probe"]
    run = RunDir.create(cfg, tmp_path / "run")
    seeds = {(u.index, make_context(run, node, u, cfg).seed) for u in node.units}
    by_replica = {}
    for index, seed in seeds:
        by_replica.setdefault(node.items[index]["replica"], set()).add(seed)
    assert all(len(s) == 1 for s in by_replica.values())  # a replica's variants share the seed
    assert by_replica[0] != by_replica[1]


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["stages.rl.fan_out.part=[a,b]"], "stages.rl.fan_out.part", "not a key of a rl stage"),
        (["stages.rl.fan_out={resources.nodes: [1, 2]}"], "stages.rl.fan_out.resources.nodes", "shared by the whole fan-out"),
        (["stages.rl.fan_out.lr=[abc]"], "stages.rl.fan_out.lr", "abc"),
        (["stages.rl.fan_out.attempts=[1, 4]"], "stages.rl.fan_out", "the unit with attempts=1: attempts"),
        (RL_SWEEP, "stages.eval.checkpoints", "fans out into 4 units: name one, e.g. rl[estimator=grpo,tis_cap=1.0]"),
        (RL_SWEEP + ["stages.eval.checkpoints=['rl[estimator=grpo]:final']"], "stages.eval.checkpoints", "matches 2 units"),
        (RL_SWEEP + ["stages.eval.checkpoints=['rl[7]:final']"], "stages.eval.checkpoints", "units 0..3, not 7"),
        (["stages.eval.checkpoints=['sft[0]:final']"], "stages.eval.checkpoints", "does not fan out"),
        # stage inputs (keys naming a stage whose files are read) name one unit of a fanned-out stage
        (
            ["stages.probe.fan_out={temperature: [0.5, 1.0]}"],
            "stages.select.probe",
            "fans out into 2 units and a select stage reads one unit's files (only a fan-out over 'replica' alone "
            "is pooled here): name one, e.g. probe[temperature=0.5] or probe[0]",
        ),
        (["stages.tasks.fan_out={replica: [0, 1]}"], "stages.sft.tasks_input", "name one, e.g. tasks[replica=0]"),
        (["stages.select.probe='probe[1]'"], "stages.select.probe", "stage 'probe' does not fan out"),
        (
            ["stages.probe.fan_out={temperature: [0.5, 1.0]}", "stages.select.fan_out={probe: ['probe[0]', probe]}"],
            "stages.select.fan_out",
            "the unit with probe=probe: probe: stage 'probe' fans out into 2 units",
        ),
        (
            RL_SWEEP + NAME_ONE[:2] + ["stages.export.checkpoint=''"],
            "stages.export.checkpoint",
            "stage 'rl' fans out: name one unit's, e.g. rl[0]:final",
        ),
    ],
)
def test_bad_sweeps_and_unit_names_are_refused_at_load(overrides, key, says):
    with pytest.raises(UserError) as e:
        config_mod.load(DEMO, overrides)
    message = str(e.value)
    assert "\n" not in message
    assert key in message and says in message, message


def test_the_cli_refuses_a_key_nothing_reads_with_exit_2(snowcat):
    proc = snowcat("config", DEMO, "stages.rl.fan_out.part=[a,b]")
    assert proc.returncode == 2
    assert "stages.rl.fan_out.part" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


SWEEP_RUN = (
    TINY.replace("steps: 20", "steps: 6").replace("save_every: 10", "save_every: 0")
    + """\
    fan_out: {lr: [0.005, 0.001]}
  eval:
    kind: evaluate
    needs: [tasks, sft]
    checkpoints: ["sft[lr=0.005]:final", "sft[1]:final"]
    limit: 6
    attempts: 2
    pass_k: [1]
    max_tokens: 8
    bootstrap_samples: 50
"""
)


@pytest.mark.slow
def test_a_swept_stage_runs_each_variant_and_evaluate_compares_them(snowcat, tmp_path):
    cfg = write_config(tmp_path / "sweep.yaml", SWEEP_RUN)
    run_dir = tmp_path / "run"
    snowcat("run", cfg, "--run-dir", run_dir, check=True)
    sft = run_dir / "stages" / "sft"
    peak = {}
    for index in (0, 1):
        rows = [json.loads(line) for line in (sft / f"{index:04d}" / "metrics_history.jsonl").read_text().splitlines()]
        peak[index] = max(r["lr"] for r in rows)
    assert peak[0] == pytest.approx(5 * peak[1])  # each unit trained with its own lr, same schedule
    results = read_json(run_dir / "stages" / "eval" / "results.json")
    scored = results["checkpoints"]
    assert Path(scored["sft[lr=0.005]:final"]["path"]).resolve() == (sft / "0000" / "checkpoints" / "final").resolve()
    assert Path(scored["sft[1]:final"]["path"]).resolve() == (sft / "0001" / "checkpoints" / "final").resolve()
    assert "sft[1]:final - sft[lr=0.005]:final" in results["comparisons"]  # paired, on the same tasks
    # the card: each unit's initializer, from the unit's own checkpoints/initial (the stage directory holds none)
    card = _card(snowcat, run_dir, tmp_path / "card.md")
    digests = {
        f"sft[lr={lr}]": sha256_file(sft / f"{i:04d}" / "checkpoints" / "initial" / "manifest.json")
        for i, lr in enumerate((0.005, 0.001))
    }
    assert yaml.safe_load(card.split("---\n")[1])["snowcat"]["initializer_manifest_sha256"] == digests
    for index, (label, digest) in enumerate(digests.items()):
        seed = read_json(sft / f"{index:04d}" / "checkpoints" / "initial" / "meta.json")["seed"]
        assert f"- Initializer of `{label}`: fresh initialization of the `demo-tiny` preset, seed {seed}\n" in card
        assert (
            f"- Initializer checkpoint of `{label}`: `run/stages/sft/{index:04d}/checkpoints/initial`, manifest sha256 `{digest}`"
            in card
        )
    assert "- `sft` (sft, 2 units): done, 2 attempt(s) (summed over its units)" in card


def test_an_unswept_stage_keeps_its_own_config_object(tmp_path):
    cfg = config_mod.load(DEMO)
    run = RunDir.create(cfg, tmp_path / "run")
    ctx = make_context(run, build(cfg)["rl"], Unit("rl"), cfg)
    assert ctx.config == ctx.run_config.stages["rl"]


RL_SWEEP_RUN = (
    TINY.replace("steps: 20", "steps: 80")  # enough to pass some closure tasks: rewards that differ
    .replace("save_every: 10", "save_every: 0")
    .replace("      arith: {count: 60, val_count: 12, difficulties: [2]}\n", "")
    + """\
  rl:
    kind: rl
    needs: [tasks, sft]
    updates: 3
    tasks_per_update: 4
    attempts: 4
    max_tokens: 8
    eval_every: 0
    save_every: 1          # each unit's retention deletes its own checkpoints: the card reads each ledger
    keep_last: 1
    threads: 1
    # lr decides here (Adam all but cancels the estimators' scale; the cap never binds without a mismatch)
    fan_out: {estimator: [rloo_n, grpo], lr: [0.001, 0.01]}
  eval:
    kind: evaluate
    needs: [tasks, sft, rl]
    checkpoints: ["sft:final", "rl[0]:final", "rl[1]:final", "rl[estimator=grpo,lr=0.001]:final", "rl[3]:final"]
    limit: 12
    attempts: 2
    pass_k: [1]
    max_tokens: 8
    bootstrap_samples: 50
  export:
    kind: export
    needs: [rl]
    checkpoint: "rl[estimator=grpo,lr=0.001]:final"
    probe_rows: 2
    probe_len: 16
    max_new_tokens: 8
  card:
    kind: card
    needs: [tasks, sft, rl, eval, export]
"""
)


def _holm_by_hand(p: list[float]) -> list[float]:
    """Holm's step-down adjustment written out: the i-th smallest p times (m - i), made monotone."""
    order = sorted((x, i) for i, x in enumerate(p) if not np.isnan(x))
    out, running = [float("nan")] * len(p), 0.0
    for rank, (x, i) in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * x))
        out[i] = running
    return out


@pytest.mark.slow
def test_a_four_variant_rl_sweep_is_evaluated_and_compared_from_its_kept_trajectories(snowcat, tmp_path):
    """The issue's must-show in small: 4 RL variants (estimator × lr), evaluated against the SFT
    model; `snowcat compare`'s numbers are recomputed here from the evaluation's kept trajectories
    (Parquet, not the traces.h5 compare reads), and the card carries the all-pairs table and reads
    every fact of the swept stage from each unit's own files."""
    cfg = write_config(tmp_path / "sweep.yaml", RL_SWEEP_RUN)
    run_dir = tmp_path / "run"
    snowcat("run", cfg, "--run-dir", run_dir, check=True)
    # four units, each with its own stage config (their recorded hashes differ) and its own weights
    records = [read_json(run_dir / "provenance" / f"rl.{index}.json") for index in range(4)]
    assert len({r["config"]["stage_sha256"] for r in records}) == 4
    scored = read_json(run_dir / "stages" / "eval" / "results.json")["checkpoints"]
    rl = run_dir / "stages" / "rl"
    assert (
        Path(scored["rl[estimator=grpo,lr=0.001]:final"]["path"]).resolve() == (rl / "0002" / "checkpoints" / "final").resolve()
    )
    assert len({sha256_file(rl / f"{i:04d}" / "checkpoints" / "final" / "model.safetensors") for i in range(4)}) == 4

    snowcat("compare", run_dir, "-o", tmp_path / "cmp", check=True)
    report = read_json(tmp_path / "cmp" / "compare.json")
    refs = ["sft:final", "rl[0]:final", "rl[1]:final", "rl[estimator=grpo,lr=0.001]:final", "rl[3]:final"]
    assert [v["label"] for v in report["variants"]] == refs

    # per checkpoint and task: passes over scored attempts, from the kept episodes
    table = pq.read_table(sorted((run_dir / "stages" / "eval" / "trajectories").glob("*.parquet"))).to_pylist()
    per_task: dict[str, dict[str, list[int]]] = {r: {} for r in refs}
    for row in table:
        if row["passed"] >= 0:
            per_task[row["checkpoint"]].setdefault(row["task_id"], []).append(row["passed"])
    pass1 = {r: {t: float(np.mean(v)) for t, v in per_task[r].items()} for r in refs}
    for v in report["variants"]:
        values = list(pass1[v["label"]].values())
        assert v["tasks"] == len(values)
        assert v["pass@1"] == pytest.approx(np.mean(values), abs=1e-12)
        assert v["pass@1_se"] == pytest.approx(np.std(values, ddof=1) / np.sqrt(len(values)), abs=1e-12)
    raw = []
    for pair in report["pairs"]:
        a, b = pass1[pair["a"]], pass1[pair["b"]]
        d = np.array([b[t] - a[t] for t in sorted(set(a) & set(b))])
        assert pair["tasks"] == len(d) and pair["diff"] == pytest.approx(d.mean(), abs=1e-12)
        t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d))) if d.std() > 0 else float("nan")
        raw.append(float(2 * stats.t.sf(abs(t), len(d) - 1)) if t == t else float("nan"))
    assert len(raw) == 10  # every pair of 5
    np.testing.assert_allclose([p["p"] if p["p"] is not None else np.nan for p in report["pairs"]], raw, rtol=1e-9)
    np.testing.assert_allclose(
        [p["p_holm"] if p["p_holm"] is not None else np.nan for p in report["pairs"]], _holm_by_hand(raw), rtol=1e-9
    )

    card = (run_dir / "stages" / "card" / "card.md").read_text()
    assert "All pairs of `eval`'s checkpoints" in card
    # the recipe is each unit's own, not the stage section's defaults
    recipe = card[card.index("## Recipe") : card.index("## Evaluation")]
    for index, (estimator, lr) in enumerate((e, lr) for e in ("rloo_n", "grpo") for lr in (0.001, 0.01)):
        block = recipe[recipe.index(f"- `rl[estimator={estimator},lr={lr}]` (rl, unit {index} of 4):") :]
        assert f"estimator: {estimator}," in block.split("layout:")[0] and f"lr {lr}, KL" in block.split("layout:")[0]
    for pair in report["pairs"]:
        holm = "n/a" if pair["p_holm"] is None else f"{pair['p_holm']:.4f}"
        assert f"| {pair['a']} | {pair['b']} | {pair['tasks']} |" in card and f"| {holm} |" in card
    _the_card_reads_each_unit(snowcat, run_dir, card, records, tmp_path)


def _section(card: str, title: str) -> str:
    start = card.index(f"## {title}\n")
    end = card.find("\n## ", start + 1)
    return card[start : end if end >= 0 else len(card)]


def _exposure_of(unit_dir: Path, through: int | None = None) -> str:
    """A unit's `exposure/<domain>` summed over its history rows (through a step), as the card words it."""
    totals, last = {}, None
    for row in map(json.loads, (unit_dir / "metrics_history.jsonl").read_text().splitlines()):
        counts = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("exposure/")}
        if counts and (through is None or row["step"] <= through):
            totals = {d: totals.get(d, 0) + counts.get(d, 0) for d in {*totals, *counts}}
            last = row["step"]
    return ", ".join(f"{d} {n}" for d, n in sorted(totals.items())) + f" trajectories in the loss through step {last}"


def _card(snowcat, run_dir: Path, out: Path) -> str:
    snowcat("card", run_dir, "-o", out, check=True)
    return out.read_text()


def _the_card_reads_each_unit(snowcat, run_dir: Path, card: str, records: list[dict], tmp_path: Path) -> None:
    """The card of a 4-unit RL sweep: retention ledger, data-order seed, exposure, layout and stage
    state of each unit, each from that unit's own directory and records (a fanned-out stage's
    directory holds no unit's files), labelled as references name them; the exported unit's
    exposure and its score beside its initializer's; nothing "not recorded" that a unit recorded."""
    rl = run_dir / "stages" / "rl"
    labels = [f"rl[estimator={e},lr={lr}]" for e in ("rloo_n", "grpo") for lr in (0.001, 0.01)]
    retention, stages, recipe = (
        _section(card, "Deleted checkpoints (retention)"),
        _section(card, "Stages"),
        _section(card, "Recipe"),
    )
    state = RunDir(run_dir).state()["stages"]
    for index, label in enumerate(labels):
        unit_dir = rl / f"{index:04d}"
        ledger = read_json(unit_dir / "checkpoints" / "retention.json")
        assert ledger["deleted"]  # save_every 1, keep_last 1: each unit deleted its own checkpoints
        block = f"- `{label}`: policy {json.dumps(ledger['policy'])}; {len(ledger['deleted'])} checkpoint(s) deleted:\n"
        assert block + "".join(f"  - step {d['step']}: {d['reason']}\n" for d in ledger["deleted"]) in retention
        assert f"  - `{label}`: seed {records[index]['extra']['seed']}; exposure {_exposure_of(unit_dir)}\n" in card
        meta = read_json(sorted(unit_dir.glob("checkpoints/step_*/meta.json"))[-1])  # the trainer's ranks: step checkpoints
        unit_recipe = recipe[recipe.index(f"- `{label}` (rl, unit {index} of 4):") :].split("\n- ")[0]
        assert (
            f"layout: {meta['world_size']} data-parallel trainer rank(s) (checkpoint meta) in a world of "
            f"{records[index]['extra']['world_size']} rank(s) (recorded by rank 0)"
        ) in unit_recipe
        jobs = state[f"rl[{index}]"]["job_ids"]
        assert f"  - `{label}`: done, 1 attempt(s), job(s) {', '.join(jobs)}, wall-clock " in stages
    assert "- `rl` (rl, 4 units): done, 4 attempt(s) (summed over its units), 4 job(s)/process(es)" in stages
    for line in card.splitlines():
        if "rl[" in line or "`rl`" in line:
            assert "not recorded" not in line, line
    # the exported unit (rl[2]): its history gives the exposure through the exported step, and the
    # evaluation's score of what it started from (sft:final) stands beside its own
    rows = {
        c[1].strip(): c[2].strip() for line in _section(card, "Record checklist").splitlines() if len(c := line.split("|")) == 4
    }
    step = read_json(rl / "0002" / "checkpoints" / "final" / "meta.json")["step"]
    assert rows["per-cohort exposure through the exported step"] == _exposure_of(rl / "0002", through=step)
    scored = read_json(run_dir / "stages" / "eval" / "results.json")["checkpoints"]
    # the table's columns are sft:final and the exported unit; the line under it names the other three
    also = next(
        line for line in card.splitlines() if line.startswith("Also scored by `eval`, compared in the paired tables below: ")
    )
    for r in ("rl[0]:final", "rl[1]:final", "rl[3]:final"):
        assert f"`{r}` {100 * scored[r]['groups']['all']['pass@1']:.1f} ± " in also
    exported, initial = (scored[r]["groups"]["all"]["pass@1"] for r in ("rl[estimator=grpo,lr=0.001]:final", "sft:final"))
    assert rows["initializer vs exported score"].startswith(
        f"eval: exported `rl[estimator=grpo,lr=0.001]:final` pass@1 {100 * exported:.1f}%, initializer `sft:final` "
        f"{100 * initial:.1f}% (paired Δ "
    )
    # the card regenerates byte for byte; a resubmission of the whole stage (the Slurm executor records
    # it under the stage's name) is read there and makes the stage one that was retried
    first, again = (_card(snowcat, run_dir, tmp_path / f"card{i}.md") for i in (1, 2))
    assert first == again
    RunDir(run_dir).update_stage("rl", attempts=2, job_ids=["41", "42"])
    card = _card(snowcat, run_dir, tmp_path / "card3.md")
    assert "- `rl` (rl, 4 units): done, 2 attempt(s) (submissions of the whole stage), 6 job(s)/process(es)" in card
    assert "; retried: rl" in card


def test_a_stage_input_names_one_unit_of_a_fanned_out_stage(tmp_path):
    cfg = config_mod.load(
        DEMO, ["stages.probe.fan_out={temperature: [0.5, 1.0]}", "stages.select.probe='probe[temperature=1.0]'"]
    )
    run = RunDir.create(cfg, tmp_path / "run")
    ctx = make_context(run, build(cfg)["select"], Unit("select"), cfg)
    assert ctx.config.probe in ctx.inputs and ctx.inputs[ctx.config.probe] == run.stage_dir("probe") / "0001"
    assert ctx.inputs.unit_dirs("probe") == [run.stage_dir("probe") / "0000", run.stage_dir("probe") / "0001"]
    assert dict(ctx.inputs) == {"tasks": run.stage_dir("tasks"), "probe": run.stage_dir("probe")}  # what provenance records
    for absent in ("rl", "probe[7]", "tasks[0]"):  # not needed; no such unit; not fanned out
        assert absent not in ctx.inputs
        with pytest.raises(KeyError):
            ctx.inputs[absent]


PROBE_REPLICAS_RUN = (
    TINY.replace("steps: 20", "steps: 40").replace("save_every: 10", "save_every: 0")
    + """\
  probe:
    kind: probe
    needs: [tasks, sft]
    limit: 12
    attempts: 2
    band_max_pass: 2
    max_turn_tokens: 8
    fan_out: {replica: [0, 1]}
  select:
    kind: select
    needs: [tasks, probe]
    min_pass: 1
    max_pass: 3
"""
)


@pytest.mark.slow
def test_select_pools_the_attempts_of_a_replicated_probe(snowcat, tmp_path):
    """A probe fanned out over `replica` alone is the same probe twice with other seeds: select reads
    both units and selects out of all 4 attempts per task, as summing the units' counts by hand gives."""
    run_dir = tmp_path / "run"
    snowcat("run", write_config(tmp_path / "probe.yaml", PROBE_REPLICAS_RUN), "--run-dir", run_dir, check=True)
    units = [pq.read_table(run_dir / "stages" / "probe" / f"{i:04d}" / "probe.parquet").to_pylist() for i in (0, 1)]
    assert [r["task_id"] for r in units[0]] == [r["task_id"] for r in units[1]]  # the same tasks, other draws
    pooled = {r["task_id"]: (r["n"] + s["n"], r["passes"] + s["passes"]) for r, s in zip(*units, strict=True)}
    expected = [t for t, (n, passes) in pooled.items() if n >= 4 and 1 <= passes <= 3]
    band = pq.read_table(run_dir / "stages" / "select" / "band.parquet").column("task_id").to_pylist()
    assert band and sorted(band) == sorted(expected)
    assert [r["passes"] for r in units[0]] != [r["passes"] for r in units[1]]  # the replicas drew differently
    summary = read_json(run_dir / "stages" / "select" / "select.json")
    assert summary["attempts"] == 4 and summary["probe_units"] == 2 and summary["probed"] == 12


RESULTS = REPO / "benchmarks" / "results"
DEMO_SWEEP = REPO / "configs" / "demo-sweep.yaml"


@pytest.mark.parametrize("name", ["demo-sweep-local", "demo-sweep-slurm"])
def test_a_committed_sweep_comparison_follows_from_its_own_per_task_rows(name):
    """The committed `snowcat compare` reports of configs/demo-sweep.yaml (benchmarks/results/README.md):
    every number recomputed here from the per-task counts the report carries, by hand (t tests with
    scipy, Holm written out); the Markdown shows the same pairs."""
    report = read_json(RESULTS / name / "compare.json")
    labels = config_mod.load(DEMO_SWEEP).stages.eval.checkpoints
    assert [v["label"] for v in report["variants"]] == list(labels) and set(report["per_task"]) == set(labels)
    rows = report["per_task"]
    pass1 = {c: {t: p / n for t, (n, p, _) in rows[c].items() if n} for c in labels}
    for v in report["variants"]:
        values = list(pass1[v["label"]].values())
        assert v["tasks"] == len(values) and len(rows[v["label"]]) == 440  # the demo's val split
        assert v["pass@1"] == pytest.approx(np.mean(values), abs=1e-12)
        assert v["pass@1_se"] == pytest.approx(np.std(values, ddof=1) / np.sqrt(len(values)), abs=1e-12)
        assert v["infra_failures"] == sum(i for _, _, i in rows[v["label"]].values())
        assert v["attempts"] == sum(n + i for n, _, i in rows[v["label"]].values())
    raw = []
    for pair in report["pairs"]:
        a, b = pass1[pair["a"]], pass1[pair["b"]]
        d = np.array([b[t] - a[t] for t in sorted(set(a) & set(b))])
        assert pair["tasks"] == len(d) and pair["diff"] == pytest.approx(d.mean(), abs=1e-12)
        assert pair["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), abs=1e-12)
        t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d))) if d.std() > 0 else float("nan")
        raw.append(float(2 * stats.t.sf(abs(t), len(d) - 1)) if t == t else float("nan"))
    assert len(raw) == 10  # every pair of 5
    got = [p["p"] if p["p"] is not None else np.nan for p in report["pairs"]]
    np.testing.assert_allclose(got, raw, rtol=1e-9)
    holm = [p["p_holm"] if p["p_holm"] is not None else np.nan for p in report["pairs"]]
    np.testing.assert_allclose(holm, _holm_by_hand(raw), rtol=1e-9)
    assert [p["significant"] for p in report["pairs"]] == [bool(h < 0.05) for h in holm]
    # the gain over sft:final: per task, the 4 variants' mean minus the base; mean and SE over tasks
    base, others = labels[0], labels[1:]
    shared = sorted(set(pass1[base]).intersection(*(set(pass1[o]) for o in others)))
    gains = np.array([np.mean([pass1[o][t] for o in others]) - pass1[base][t] for t in shared])
    g = report["gain_over_base"]
    assert g["variants"] == list(others) and g["tasks"] == len(shared)
    assert g["gain"] == pytest.approx(gains.mean(), abs=1e-12)
    assert g["se"] == pytest.approx(gains.std(ddof=1) / np.sqrt(len(gains)), abs=1e-12)
    # homogeneity: the statistic is the variance of the variants' means over the common tasks
    h = report["homogeneity"]
    common = sorted(set.intersection(*(set(pass1[c]) for c in labels)))
    assert h["tasks"] == len(common)
    assert h["statistic"] == pytest.approx(np.var([np.mean([pass1[c][t] for t in common]) for c in labels]), abs=1e-12)
    assert 1 / (1 + h["permutations"]) <= h["p"] <= 1
    md = (RESULTS / name / "compare.md").read_text()
    for line in compare_mod.pairs_table(report)[2:]:
        assert line in md


def test_the_committed_local_and_slurm_sweeps_agree():
    """The same config run locally and on the local Slurm cluster (RL as 4 hetjobs at once): the
    same report, and every weight, task table, probe result and kept trajectory sha256-equal; what
    differs is timings, timestamps and paths."""
    local, slurm = (read_json(RESULTS / f"demo-sweep-{where}" / "compare.json") for where in ("local", "slurm"))
    for report in (local, slurm):
        for v in report["variants"]:
            v.pop("source")  # names the run directory
    assert local == slurm
    units = read_json(RESULTS / "demo-sweep-slurm" / "equal-to-local.json")["units"]
    assert set(units) == {"tasks", "sft", "probe", "select", "eval", "card"} | {f"rl/{i:04d}" for i in range(4)}
    timing = ("duration_s", "seconds", "_at", "time", "tokens_per_s", "wait_", "step_s", "path", "files")
    for unit, found in units.items():
        for name, keys in found["different"].items():
            assert not name.endswith((".safetensors", ".parquet", ".h5", ".pt")), (unit, name)
            assert keys is None or all(any(t in k for t in timing) for k in keys), (unit, name, keys)
