"""`snowcat plan` (pipeline/plan): memory formulas, refusals, site checks, summary, proposal,
search, compare, and the recorded validation. Torch-free and fast: nothing runs a model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from snowcat.benchmarks import plan_validation
from snowcat.pipeline import cli
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.plan import compare, core, report, sitecheck
from snowcat.pipeline.plan.memory import GIB, Layout, rank_params, trainer_memory
from snowcat.pipeline.plan.model import Arch
from snowcat.stages.model.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]
MINI = Arch("snowball-mini", PRESETS["snowball-mini"])

SITE = """\
base: local
planner:
  charge_unit: node-hours
  mfu: 0.3
  partitions:
    cpu: {charge_per_node_hour: 1, peak_tflops: 0.1, memory_gbps: 10}
    gpu: {charge_per_node_hour: 2, device_memory_gib: 16, peak_tflops: 100, memory_gbps: 1000, intra_node_gbps: 100, inter_node_gbps: 10}
"""

CONFIG = """\
name: plan-test
executor: {kind: slurm}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 200, val_count: 20, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: snowball-mini
    backend: fsdp
    seq_len: 512
    batch_rows: 16
    steps: 20
    resources: {partition: gpu, nodes: 1, tasks_per_node: 4, time_min: 60}
  rl:
    kind: rl
    needs: [tasks, sft]
    engine: torch
    tasks_per_update: 4
    attempts: 4
    updates: 5
    max_total_tokens: 256
    resources:
      partition: gpu
      time_min: 60
      components:
        trainer: {partition: gpu, nodes: 1, tasks_per_node: 2}
        rollout: {partition: gpu, nodes: 1, tasks_per_node: 2}
"""


@pytest.fixture
def files(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(SITE)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    return cfg, site


def load(cfg, site, *overrides):
    return config_mod.typed(config_mod.load(cfg, list(overrides), site=str(site)))


def mem(lay: Layout, tokens: int = 4096, arch: Arch = MINI, micro: int = 1, gpu: bool = True) -> dict:
    return trainer_memory(arch, lay, tokens, micro, gpu)


# ------------------------------------------------------------------------------ the formulas


def test_activations_grow_with_tokens_and_shrink_with_checkpointing():
    lay = Layout(ranks=1, compute_bytes=2)
    short, long = mem(lay, 2048)["parts"]["activations"], mem(lay, 8192)["parts"]["activations"]
    assert long == pytest.approx(4 * short)  # linear in tokens: flash attention keeps no T^2 scores
    ckpt = mem(Layout(ranks=1, compute_bytes=2, activation_checkpointing=True), 8192)["parts"]["activations"]
    assert ckpt < long / 4


def test_zero_stages_shard_what_they_say():
    full = mem(Layout(ranks=8, backend="deepspeed", zero_stage=0))["parts"]
    z1 = mem(Layout(ranks=8, backend="deepspeed", zero_stage=1))["parts"]
    z2 = mem(Layout(ranks=8, backend="deepspeed", zero_stage=2))["parts"]
    z3 = mem(Layout(ranks=8, backend="deepspeed", zero_stage=3))["parts"]
    assert z1["optimizer"] == pytest.approx(full["optimizer"] / 8) and z1["gradients"] == full["gradients"]
    assert z2["gradients"] == pytest.approx(full["gradients"] / 8) and z2["weights"] == full["weights"]
    assert z3["weights"] == pytest.approx(full["weights"] / 8)
    fsdp = mem(Layout(ranks=8, backend="fsdp"))["parts"]
    assert fsdp["weights"] == pytest.approx(full["weights"] / 8)  # FSDP is ZeRO-3
    assert full["weights"] == pytest.approx(MINI.total * 4)  # float32 masters


def test_expert_and_tensor_parallel_split_their_parts():
    one = rank_params(MINI, Layout(ranks=4))
    ep = rank_params(MINI, Layout(ranks=4, ep=4))
    assert ep.dense == one.dense and ep.experts == pytest.approx(one.experts / 4)
    assert one.total == pytest.approx(MINI.total)
    tp = rank_params(MINI, Layout(ranks=4, backend="megatron", tp=2))
    assert tp.dense == pytest.approx(one.dense / 2) and tp.experts == one.experts
    pp = rank_params(MINI, Layout(ranks=4, backend="megatron", pp=2))
    assert pp.experts == pytest.approx(one.experts / 2)
    assert mem(Layout(ranks=4, ep=4))["peak"] < mem(Layout(ranks=4))["peak"]


def test_bf16_masters_halve_the_state():
    f32 = mem(Layout(ranks=1, compute_bytes=2))["parts"]
    b16 = mem(Layout(ranks=1, master_bytes=2, compute_bytes=2))["parts"]
    assert b16["weights"] == pytest.approx(f32["weights"] / 2)
    assert b16["optimizer"] == pytest.approx(f32["optimizer"] / 2)


# ------------------------------------------------------------------------------ plans and refusals


def test_plan_of_a_config(files):
    cfg, site = files
    plan = core.make_plan(load(cfg, site))
    by = {r["name"]: r for r in plan["stages"]}
    sft = by["sft"]
    assert sft["hours_basis"] == "model" and sft["roles"][0]["dp"] == 4
    assert sft["node_hours"] == pytest.approx(sft["hours"] * 1)
    assert sft["charge"] == pytest.approx(sft["node_hours"] * 2)  # the gpu partition's rate
    assert [r["role"] for r in by["rl"]["roles"]] == ["trainer", "rollout"]
    assert by["tasks"]["hours_basis"] == "walltime"
    assert plan["total"]["charge"] == pytest.approx(sum(r["charge"] for r in plan["stages"]))
    assert "MFU 30%" in report.text(plan) and "MFU 30%" in report.summary(plan)  # every figure names its assumptions
    assert plan["fits"], plan["problems"]


def test_memory_grows_with_seq_len_through_the_config(files):
    cfg, site = files
    small = core.make_plan(load(cfg, site, "stages.sft.seq_len=256"))["stages"][1]["roles"][0]["memory"]["peak_gib"]
    big = core.make_plan(load(cfg, site, "stages.sft.seq_len=2048"))["stages"][1]["roles"][0]["memory"]["peak_gib"]
    assert big > small


def test_cli_plan_json_and_exit_codes(files, capsys):
    cfg, site = files
    assert cli.main(["plan", str(cfg), "--site", str(site), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["charge_unit"] == "node-hours"
    # a GPU too small: the plan is computed (exit 1), and says which role needs what
    assert cli.main(["plan", str(cfg), "--site", str(site), "site.planner.partitions.gpu.device_memory_gib=0.5"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "stages.sft: the trainer needs" in out


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("stages.sft.expert_parallel=3", "stages.sft.expert_parallel"),  # 3 does not divide 32 experts
        ("stages.sft.backend=megatron stages.sft.tensor_parallel=3", "stages.sft.tensor_parallel"),
        ("stages.sft.backend=megatron stages.sft.pipeline_parallel=3", "stages.sft.pipeline_parallel"),
    ],
)
def test_a_layout_that_does_not_divide_is_refused_naming_the_key(files, capsys, override, key):
    cfg, site = files
    assert cli.main(["plan", str(cfg), "--site", str(site), *override.split()]) == 2
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1


def test_an_unknown_architecture_is_refused(files, tmp_path, capsys):
    cfg, site = files
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    assert cli.main(["plan", str(cfg), "--site", str(site), f"stages.sft.model=hf:{model}"]) == 2
    assert "model_type='llama' is not supported" in capsys.readouterr().err


def test_a_hub_model_not_here_names_the_key_and_model_config_supplies_it(files, tmp_path, capsys):
    cfg, site = files
    typed = load(cfg, site)
    typed.stages["sft"].model = "hf:Org/Model"  # as if staged by a prestage stage (not yet run)
    with pytest.raises(Exception, match=r"stages.sft.model: hf:Org/Model: its config.json is not here"):
        core.make_plan(typed)
    conf = tmp_path / "config.json"
    conf.write_text(json.dumps(plan_validation_qwen3()))
    plan = core.make_plan(typed, {"hf:Org/Model": str(conf)})
    assert plan["stages"][1]["model"]["params_total"] > 30e9  # Qwen3-30B-A3B's shape, as given


def plan_validation_qwen3() -> dict:
    c = plan_validation.QWEN3_30B_A3B["config"]
    return {
        "model_type": "qwen3_moe",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.experts_per_token,
        "moe_intermediate_size": c.moe_intermediate_size,
        "intermediate_size": 6144,
        "max_position_embeddings": c.max_position_embeddings,
    }


def test_a_site_without_the_planner_fields_is_refused_naming_the_key(files, capsys):
    cfg, _ = files
    assert cli.main(["plan", str(cfg), "--site", "tacc-frontera"]) == 2
    assert "planner.partitions." in capsys.readouterr().err


def test_walltime_gives_the_number_of_continuation_jobs():
    site = SimpleNamespace(partitions={"p": SimpleNamespace(max_time_min=120)}, default_partition="p")
    stage = SimpleNamespace(
        resources=SimpleNamespace(partition="p", time_min=120),
        resume=SimpleNamespace(signal_margin_s=120, max_continuations=3, strategy="requeue"),
    )
    j = sitecheck.jobs_for(stage, site, "sft", "sft", hours=5.0)
    assert j["jobs"] == math.ceil(5.0 / (118 / 60)) == 3 and j["continuations"] == 2 and j["problem"] is None
    j = sitecheck.jobs_for(stage, site, "sft", "sft", hours=9.0)  # 5 jobs, 4 allowed
    assert j["jobs"] == 5 and "max_continuations=3" in j["problem"]
    j = sitecheck.jobs_for(stage, site, "evaluate", "evaluate", hours=3.0)  # cannot resume
    assert "does not resume" in j["problem"]


def test_more_jobs_than_max_submit_is_refused(files, capsys):
    cfg, site = files
    over = ["site.max_submit_jobs=3", "stages.sft.fan_out={lr: [0.001, 0.002, 0.003, 0.004]}", "stages.rl.init_from=sft[0]:final"]
    plan = core.make_plan(load(cfg, site, *over))
    assert not plan["fits"]
    assert any("jobs queued on the site" in p and "limit 3" in p for p in plan["problems"])
    assert cli.main(["plan", str(cfg), "--site", str(site), *over]) == 1


def test_budget_is_checked_and_the_site_budget_is_a_named_stub(files):
    cfg, site = files
    plan = core.make_plan(load(cfg, site))
    stub = next(c for c in plan["checks"] if c["check"] == "allocation")
    assert "stub" in stub["detail"]
    poor = core.make_plan(load(cfg, site), budget=plan["total"]["charge"] / 2)
    assert not poor["fits"] and any("allocation" in p for p in poor["problems"])


def test_run_prints_the_summary_and_refuses_a_plan_that_cannot_fit(files, capsys):
    cfg, site = files
    code = cli.main(["run", str(cfg), "--site", str(site), "--dry-run", "site.planner.partitions.gpu.device_memory_gib=0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "the plan cannot fit" in err and "--skip-plan" in err


# ------------------------------------------------------------------------------ proposal, search, compare


def test_proposal_writes_the_justification(files, tmp_path, capsys):
    cfg, site = files
    out = tmp_path / "proposal.md"
    assert cli.main(["plan", str(cfg), "--site", str(site), "--proposal", str(out), "--runs", "3"]) == 0
    text = out.read_text()
    for part in ("### Resources requested", "### Scaling argument", "### Assumptions", "total (3 runs)", "MFU", "node-hours"):
        assert part in text
    assert (tmp_path / "proposal.png").stat().st_size > 0


def test_search_lists_layouts_that_fit_cheapest_first(files, capsys):
    cfg, site = files
    assert cli.main(["plan", str(cfg), "--site", str(site), "--search", "sft", "--max-nodes", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["fits"]
    assert rows and [r["node_hours"] for r in rows] == sorted(r["node_hours"] for r in rows)
    assert all(r["trainer_peak_gib"] <= r["usable_gib"] for r in rows)
    assert result["tried"] > len(rows) or result["refused"] == 0


def test_compare_puts_plan_and_measurement_side_by_side(files, tmp_path):
    cfg, site = files
    plan = core.make_plan(load(cfg, site))
    run = tmp_path / "run"
    (run / "provenance").mkdir(parents=True)
    (run / "provenance" / "sft.json").write_text(
        json.dumps({"times": {"started": "2026-01-01T00:00:00", "ended": "2026-01-01T00:30:00"}})
    )

    class Run:
        path, run_id = run, "r1"

        def is_done(self, unit):
            return unit.stage == "sft"

        def metrics(self, unit):
            return {"train_seconds": 40.0} if unit.stage == "sft" else {}

        def unit_dir(self, unit):
            return run / "stages" / unit.stage

    from snowcat.pipeline.dag import build  # noqa: PLC0415

    dag = build(config_mod.load(cfg, [], site=str(site)))
    result = compare.compare(Run(), dag, plan)
    sft = next(r for r in result["stages"] if r["stage"] == "sft")
    assert sft["step_s"]["measured"] == pytest.approx(2.0)  # 40 s over 20 steps
    assert sft["node_hours"]["measured"] == pytest.approx(0.5)
    compare.write(Run(), result)
    lines = compare.card_lines(run)
    assert any(line.startswith("| sft |") for line in lines) and "MFU" in lines[0]


# ------------------------------------------------------------------------------ validation record


def test_recorded_validation_is_what_the_planner_computes_and_within_15_percent():
    record = json.loads((ROOT / "benchmarks" / "results" / "plan-validation.json").read_text())
    assert record["cpu_memory"]
    for block in record["cpu_memory"]:
        for mode, row in block["modes"].items():
            planned = plan_validation.planned_mib(block["model"], block["step"], row)
            assert planned["peak"] == row["planned_mib"], mode  # the file matches the code
            assert row["within_15pct"] == (abs(row["planned_mib"] / row["measured_mib"] - 1) <= 0.15)
    default = next(b for b in record["cpu_memory"] if b["label"] == "default")  # the benchmark's small MoE as it ships
    assert default["all_claimed_within_15pct"], default["modes"]
    for peer in record["peers"]:
        assert peer["source"].startswith("https://") and peer["published"]["peak_memory_gib"] > 0
    assert record["snowball"]["published"]["source"]


def test_every_site_planner_partition_exists_and_facts_are_sourced():
    from snowcat.slurm.site import list_sites, load_site  # noqa: PLC0415

    for name in list_sites():
        site = load_site(name)
        if site.planner.partitions:
            assert site.planner.sources, name
            for key in site.planner.unverified:
                part, _, field = key.removeprefix("partitions.").partition(".")
                assert part in site.planner.partitions and hasattr(site.planner.partitions[part], field), (name, key)
    assert GIB == 2**30
