"""probe and select stages on a tiny real checkpoint that learned the calculator protocol for some tasks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_agent import overfit, teacher_messages, tiny_model, tiny_tasks, tiny_tokenizer

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.config import stage_config
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages import probe, rl, select
from snowcat.stages.model import load_model_dir, save_model_dir
from snowcat.stages.rollout import TorchEngine
from snowcat.stages.taskgen import load_tasks, save_tasks


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """tasks/ (train + held-out val) and sft/checkpoints/final: a micro model taught 3 of 8 train tasks."""

    root = tmp_path_factory.mktemp("probe")
    arith, closure = tiny_tasks()
    train, val = arith[:8], arith[8:12] + closure[:2]
    save_tasks(root / "tasks", "train", train)
    save_tasks(root / "tasks", "val", val)
    tok = tiny_tokenizer(arith + closure)
    model = overfit(tiny_model(tok), tok, [teacher_messages(t, "calculator") for t in train[:3]])
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)
    return root


def context(workdir: Path, kind: str, out: str, values: dict, inputs: dict) -> StageContext:
    """Stage `kind` writing into workdir/out, its inputs (stage name -> dir under workdir) as `needs`."""
    return StageContext.standalone(
        kind, values, run_dir=workdir, out_dir=workdir / out, inputs={k: workdir / v for k, v in inputs.items()}, seed=3
    )


def run_probe(workdir: Path, out: str, preempt: bool = False, **changes) -> tuple[dict, list[dict]]:
    settings = dict(
        checkpoint="sft:final",
        env="calculator",
        attempts=4,
        max_context=64,
        max_turn_tokens=12,
        max_turns=3,
        band_min_pass=1,
        band_max_pass=3,
        batch_size=12,
        verifier_timeout_s=20.0,
    )
    ctx = context(workdir, "probe", out, settings | changes, {"tasks": "tasks", "sft": "sft"})
    if preempt:
        ctx.signal.set()  # as SIGUSR2 from Slurm would: the stage saves after its batch and stops
    metrics = probe.run(ctx)
    return metrics, pq.read_table(ctx.out_dir / "probe.parquet").to_pylist()


def read_traces(path: Path) -> dict:
    with h5py.File(path) as f:
        return {k: f[k][()] for k in f}


@pytest.mark.slow
def test_probe_counts_passes_per_train_task(workdir):
    metrics, rows = run_probe(workdir, "probe_a")
    train = load_tasks(workdir / "tasks", "train")
    assert [r["task_id"] for r in rows] == [t.task_id for t in train]
    assert all(r["n"] + r["infra_failures"] == 4 for r in rows)
    learned = [r["passes"] for r in rows[:3]]
    assert sum(learned) >= 10, f"the taught tasks should mostly pass, got {learned}"
    # the table agrees with the traces, episode by episode
    tr = read_traces(workdir / "probe_a" / "traces.h5")
    ids = [x.decode() for x in tr["task_id"]]
    assert len(ids) == 4 * len(train)
    for r in rows:
        mine = [i for i, t in enumerate(ids) if t == r["task_id"]]
        assert sum(tr["reward"][i] >= 1.0 for i in mine) == r["passes"]
        assert sorted(tr["attempt"][i] for i in mine) == [0, 1, 2, 3]
    for i in range(len(ids)):
        mask = tr["loss_mask"][i].astype(bool)
        assert len(tr["token_ids"][i]) == len(mask) and np.all(tr["rollout_logprobs"][i][~mask] == 0)
    summary = json.loads((workdir / "probe_a" / "probe.json").read_text())
    in_band = np.mean([1 <= r["passes"] <= 3 for r in rows])
    assert summary["all"]["band_fraction"] == pytest.approx(in_band) == pytest.approx(metrics["band_fraction"])
    assert sum(summary["all"]["histogram"]) == len(rows)
    assert (workdir / "probe_a" / "probe_histogram.png").stat().st_size > 1000
    # deterministic: the same seed probes the same episodes
    _, again = run_probe(workdir, "probe_b")
    assert again == rows
    # preempted after its first batch, then continued: the same result as uninterrupted
    with pytest.raises(StageContext.Preempted):
        run_probe(workdir, "probe_d", preempt=True)
    assert [p.name for p in (workdir / "probe_d" / "partial").iterdir()] == ["batch_000000.npz"]
    _, resumed = run_probe(workdir, "probe_d")
    assert resumed == rows and not (workdir / "probe_d" / "partial").exists()
    # limit probes only the first N train tasks
    _, few = run_probe(workdir, "probe_c", limit=2)
    assert few == rows[:2]


def test_probe_config_errors_name_the_key(workdir):
    path = workdir / "bad_probe.yaml"
    path.write_text("stages:\n  tasks: {kind: tasks}\n  probe: {kind: probe, needs: [tasks], checkpoint: final}\n")
    with pytest.raises(UserError, match="stages.probe.checkpoint: 'final' is not"):
        config_mod.load(path)
    for bad, error in (
        (dict(attempts=4, band_max_pass=6), r"band_max_pass: need band_min_pass <= band_max_pass <= attempts \(4\)"),
        (dict(band_min_pass=3, band_max_pass=2), r"band_max_pass: need band_min_pass <= band_max_pass"),
        (dict(env="bogus"), r"env: Invalid value 'bogus', expected one of \['single', 'calculator', 'repo'\]"),
        (dict(tasks="mine"), r"needs: add 'mine' \(named in tasks\)"),
        (dict(top_p=0), r"top_p: must be > 0, got 0"),
    ):
        with pytest.raises(UserError, match=rf"^stages\.probe\.{error}"):
            stage_config("probe", {"needs": ["tasks", "sft"], **bad})
    with pytest.raises(UserError, match="max_position_embeddings"):
        run_probe(workdir, "probe_long", max_context=250, max_turn_tokens=12)


def write_probe_rows(dir: Path, rows: list[dict], attempts: int = 8) -> None:
    dir.mkdir()
    probe.write_table(dir / "probe.parquet", rows)
    (dir / "probe.json").write_text(json.dumps({"attempts": attempts}))


def row(task, passes, n=8, infra=0):
    return dict(
        task_id=task.task_id,
        domain=task.domain,
        difficulty=task.difficulty,
        n=n,
        passes=passes,
        infra_failures=infra,
        mean_reward=passes / max(n, 1),
    )


def test_select_keeps_the_band_and_never_a_held_out_task(workdir):
    train = load_tasks(workdir / "tasks", "train")
    val = load_tasks(workdir / "tasks", "val")
    passes = [0, 1, 3, 6, 7, 8, 2, 5]
    rows = [row(t, p) for t, p in zip(train, passes)]
    rows[7] = row(train[7], 5, n=7, infra=1)  # an infra failure: fewer scored attempts than asked
    write_probe_rows(workdir / "probe_rows", rows)
    ctx = context(
        workdir, "select", "select_a", dict(probe="probe", min_pass=1, max_pass=6), {"probe": "probe_rows", "tasks": "tasks"}
    )
    metrics = select.run(ctx)
    band = select.load_band(ctx.out_dir)
    expected = [t for t, p in zip(train, passes) if 1 <= p <= 6][:-1]  # the 7-of-8-scored task is dropped
    assert band == expected
    assert metrics["selected"] == len(expected) and metrics["probed"] == 8
    counts = json.loads((ctx.out_dir / "select.json").read_text())["domains"]
    assert counts == {"arith": {"probed": 8, "selected": len(expected)}}
    # accepting partly-scored tasks keeps it
    ctx = context(
        workdir, "select", "select_b", dict(min_pass=1, max_pass=6, min_scored=7), {"probe": "probe_rows", "tasks": "tasks"}
    )
    select.run(ctx)
    assert select.load_band(ctx.out_dir) == expected + [train[7]]

    # a held-out task in the probe results is a bug upstream: stop, never select it
    write_probe_rows(workdir / "probe_leak", rows + [row(val[0], 3)])
    ctx = context(workdir, "select", "select_c", {}, {"probe": "probe_leak", "tasks": "tasks"})
    with pytest.raises(AssertionError, match="held-out"):
        select.run(ctx)
    assert not (ctx.out_dir / "band.parquet").exists()


def test_select_config_errors():
    stage_config("select", {"needs": ["probe", "tasks"]})
    with pytest.raises(UserError, match=r"^stages\.select\.max_pass: need min_pass <= max_pass, got 5\.\.2"):
        stage_config("select", {"min_pass": 5, "max_pass": 2, "needs": ["probe", "tasks"]})
    with pytest.raises(UserError, match=r"^stages\.select\.needs: add 'probe' \(named in probe\)"):
        stage_config("select", {"needs": ["tasks"]})
    with pytest.raises(UserError, match=r"^stages\.select_b\.needs: add 'probe_b' \(named in probe\)"):
        stage_config("select", {"probe": "probe_b", "needs": ["probe", "tasks"]}, name="select_b")


def test_probe_reuses_saved_batches_only_under_the_same_settings(workdir, tmp_path):
    model, _, tok = load_model_dir(workdir / "sft" / "checkpoints" / "final")
    tasks = load_tasks(workdir / "tasks", "train")[:3]
    cfg = stage_config(
        "probe",
        dict(env="calculator", attempts=2, band_max_pass=2, max_context=64, max_turn_tokens=12, batch_size=4, needs=["tasks"]),
    )
    first = probe.probe(TorchEngine(model), tok, tasks, cfg, seed=3, partial_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    # every batch is on disk: no engine needed (one that cannot generate would make infra errors)
    assert probe.probe(None, tok, tasks, cfg, seed=3, partial_dir=tmp_path) == first
    # other settings never pick up stale batches
    redone = probe.probe(None, tok, tasks, cfg, seed=4, partial_dir=tmp_path)
    assert {t.status for t in redone} == {"infra_error"}


def test_probe_limit_takes_every_domain_in_turn():
    """The train table is grouped by domain: a limit must not probe only the first domain."""
    tasks = [SimpleNamespace(domain="closure", i=i) for i in range(5)] + [SimpleNamespace(domain="arith", i=i) for i in range(2)]
    picked = probe.first_of_each_domain_in_turn(tasks, 5)
    assert [(t.domain, t.i) for t in picked] == [("closure", 0), ("arith", 0), ("closure", 1), ("arith", 1), ("closure", 2)]
    assert probe.first_of_each_domain_in_turn(tasks, 100) == [*picked, tasks[3], tasks[4]]


def test_rl_refuses_an_empty_band_saying_what_select_kept_and_why(tmp_path):
    """A probe whose every task passed always or never leaves select an empty band; RL on it stops
    with one line naming the band and what select saw, not that its ids are missing from train."""
    arith, _ = tiny_tasks()
    save_tasks(tmp_path / "tasks", "train", arith[:8])
    save_tasks(tmp_path / "tasks", "val", arith[8:12])
    rows = [
        {
            "task_id": t.task_id,
            "domain": t.domain,
            "n": 4,
            "passes": 4 * (i % 2),
            "infra_failures": 0,
            "mean_reward": float(i % 2),
        }
        for i, t in enumerate(arith[:8])
    ]
    (tmp_path / "probe").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "probe" / "probe.parquet")
    (tmp_path / "probe" / "probe.json").write_text(json.dumps({"attempts": 4}))
    picked = select.run(
        context(tmp_path, "select", "select", {"min_pass": 1, "max_pass": 3}, {"tasks": "tasks", "probe": "probe"})
    )
    assert picked["selected"] == 0 and select.load_band(tmp_path / "select") == []

    ctx = context(tmp_path, "rl", "rl", {"tasks_per_update": 2}, {"tasks": "tasks", "select": "select"})
    with pytest.raises(UserError) as refused:
        rl.load_pool(ctx, ctx.config)
    assert str(refused.value) == (
        f"{tmp_path / 'select' / 'band.parquet'}: the band is empty (no task of the 8 probed passed 1 to 3 of 4 attempts;"
        " widen select's min_pass/max_pass or probe more tasks): RL has no task to learn from"
    )
    (tmp_path / "select" / "select.json").write_text("{")  # damaged: the band is still refused, saying so
    with pytest.raises(UserError, match=r"band.parquet: the band is empty \(select.json unreadable\): RL has no task"):
        rl.load_pool(ctx, ctx.config)
