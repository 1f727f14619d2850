"""The evaluate stage end to end on tiny random checkpoints: real engine, real verifier processes.

A random model fails every real task, so the effect of infrastructure failures on pass@1 is shown
with a verifier test double that grades by task (about half the tasks pass), run in the stage's
worker process under its real time limit; its slow variant sleeps past that limit on the first
attempt verified for chosen tasks. Heavy imports stay inside functions: the verifier worker
process imports this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from snowcat.pipeline.config import stage_config
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages import evaluate
from snowcat.stages.model import PRESETS, MoEForCausalLM, save_model_dir
from snowcat.stages.taskgen import Verdict, generate_domain, load_tasks, save_tasks
from snowcat.stages.tokenizer import train_tokenizer

MARKERS = "SNOWCAT_TEST_VERIFIER_MARKERS"
SLOW_TASKS = "SNOWCAT_TEST_SLOW_TASKS"


def oracle_passes(task_id: str) -> bool:
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % 2 == 0


def task_oracle_verifier_test_double(task, text):
    ok = oracle_passes(task.task_id)
    return Verdict(float(ok), ok, "graded by task id (test double)")


def slow_first_call_verifier_test_double(task, text):
    """Sleeps far past any time limit the first time it sees one of the chosen tasks."""
    marker = Path(os.environ[MARKERS]) / task.task_id
    if task.task_id in os.environ[SLOW_TASKS].split(",") and not marker.exists():
        marker.touch()
        time.sleep(600)
    return task_oracle_verifier_test_double(task, text)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tasks stage dir and an `sft` stage dir with two tiny random checkpoints."""

    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    val = generate_domain(rng, "closure", [1, 2], 6) + generate_domain(rng, "arith", [2], 4)
    save_tasks(root / "tasks", "val", val)
    save_tasks(root / "tasks", "train", generate_domain(rng, "arith", [3], 4))
    tok = train_tokenizer([t.prompt + t.answer for t in val] * 4, vocab_size=300)
    cfg = PRESETS["test-micro"]
    for seed, name in ((0, "initial"), (1, "final")):
        torch.manual_seed(seed)
        save_model_dir(root / "sft" / "checkpoints" / name, MoEForCausalLM(cfg), tok)
    (root / "sft" / "checkpoints" / "best").write_text("final")
    # a model whose context is too short for any prompt + max_tokens: every generation fails in the engine
    torch.manual_seed(2)
    short = dataclasses.replace(cfg, max_position_embeddings=8)
    save_model_dir(root / "sft" / "checkpoints" / "short", MoEForCausalLM(short), tok)
    return root


SMALL = dict(
    checkpoints=["sft:initial", "sft:final"],
    attempts=3,
    max_tokens=6,
    pass_k=[1, 2, 3],
    infra_retries=0,
    verifier_timeout_s=3.0,
    batch_size=16,
    bootstrap_samples=500,
    verifier=f"{__name__}:task_oracle_verifier_test_double",
)


def run_stage(workdir: Path, out: str, **overrides):
    assert not (workdir / out).exists()  # each call writes a stage directory of its own
    ctx = StageContext.standalone(
        "evaluate",
        SMALL | overrides,
        name="eval",
        run_dir=workdir,
        out_dir=workdir / out,
        inputs={"tasks": workdir / "tasks", "sft": workdir / "sft"},
        seed=7,
    )
    metrics = evaluate.run(ctx)
    return metrics, json.loads((ctx.out_dir / "results.json").read_text()), read_traces(ctx.out_dir / "traces.h5")


def read_traces(path: Path) -> list[dict]:
    with h5py.File(path) as f:
        cols = {k: f[k][()] for k in f}
    rows = []
    for i in range(len(cols["task_id"])):
        row = {k: v[i] for k, v in cols.items()}
        rows.append({k: (v.decode() if isinstance(v, bytes) else v) for k, v in row.items()})
    return rows


def pass1_counting_infra_as_failures(traces, checkpoint):
    by_task: dict[str, list[int]] = {}
    for r in traces:
        if r["checkpoint"] == checkpoint:
            by_task.setdefault(r["task_id"], []).append(int(r["passed"] == 1))
    return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)


@pytest.fixture(scope="module")
def clean(workdir):
    return run_stage(workdir, "clean")


def test_outputs_and_statistics(workdir, clean):
    metrics, results, traces = clean
    assert (workdir / "clean" / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    assert len(traces) == 2 * 10 * 3  # checkpoints x tasks x attempts
    assert {r["status"] for r in traces} <= {"ok", "truncated"}
    for r in traces:
        assert 1 <= len(r["token_ids"]) <= 6 and len(r["logprobs"]) == len(r["token_ids"])
        assert all(lp <= 0 for lp in r["logprobs"])
    groups = results["checkpoints"]["sft:initial"]["groups"]
    assert {"all", "closure", "arith", "closure/d1", "closure/d2", "arith/d2"} <= set(groups)
    # pass@1 and pass@2 recomputed from the traces with the direct binomial formula
    for g, domain in (("all", None), ("closure", "closure")):
        rows = [r for r in traces if r["checkpoint"] == "sft:initial" and domain in (None, r["domain"])]
        tasks = sorted({r["task_id"] for r in rows})
        per_task = [[r["passed"] for r in rows if r["task_id"] == t] for t in tasks]
        p2 = [1 - math.comb(3 - sum(p), 2) / math.comb(3, 2) for p in per_task]
        assert groups[g]["pass@1"] == pytest.approx(sum(sum(p) / 3 for p in per_task) / len(tasks))
        assert groups[g]["pass@2"] == pytest.approx(sum(p2) / len(p2))
    # the oracle grades by task, so both checkpoints score the same and the paired difference is 0
    comp = results["comparisons"]["sft:final - sft:initial"]["all"]
    assert comp["pass@1"]["diff"] == pytest.approx(0.0) and comp["tasks"] == 10
    assert metrics["sft:final/closure/pass@1"] == results["checkpoints"]["sft:final"]["groups"]["closure"]["pass@1"]
    assert metrics["sft:initial/infra_rate"] == 0.0
    assert "sft:final - sft:initial/all/pass@1_diff" in metrics


@pytest.mark.slow
def test_verifier_timeouts_are_excluded_not_counted_as_failures(workdir, clean, tmp_path, monkeypatch):
    _, clean_results, _ = clean
    task_ids = sorted({r["task_id"] for r in clean[2]})
    slow = [t for t in task_ids if oracle_passes(t)][:2]
    assert len(slow) == 2
    monkeypatch.setenv(MARKERS, str(tmp_path))
    monkeypatch.setenv(SLOW_TASKS, ",".join(slow))

    _, results, traces = run_stage(workdir, "slow", verifier=f"{__name__}:slow_first_call_verifier_test_double")
    got = results["checkpoints"]["sft:initial"]["groups"]["all"]
    want = clean_results["checkpoints"]["sft:initial"]["groups"]["all"]
    failed = [r for r in traces if r["status"] == "infra_error"]
    assert len(failed) == 2 and {r["task_id"] for r in failed} == set(slow)
    assert all("timed out" in r["infra_cause"] for r in failed)
    assert got["infra_failures"] == 2 and got["infra_rate"] == pytest.approx(2 / 30)  # 2 of 30 attempts
    assert got["pass@1"] == pytest.approx(want["pass@1"], abs=1e-12)  # excluded: unchanged
    assert pass1_counting_infra_as_failures(traces, "sft:initial") < want["pass@1"] - 0.01  # counted: lowered


@pytest.mark.slow
def test_transient_timeouts_are_retried(workdir, clean, tmp_path, monkeypatch):
    task_ids = sorted({r["task_id"] for r in clean[2]})
    monkeypatch.setenv(MARKERS, str(tmp_path))
    monkeypatch.setenv(SLOW_TASKS, task_ids[0])
    _, results, traces = run_stage(
        workdir, "retried", checkpoints=["sft:best"], infra_retries=1, verifier=f"{__name__}:slow_first_call_verifier_test_double"
    )
    assert all(r["status"] != "infra_error" for r in traces)
    assert sum(r["infra_retries"] for r in traces) == 1
    assert results["checkpoints"]["sft:best"]["path"].endswith("final")  # the pointer file was followed
    assert (
        results["checkpoints"]["sft:best"]["groups"]["all"]["pass@1"]
        == clean[1]["checkpoints"]["sft:final"]["groups"]["all"]["pass@1"]
    )


def test_the_verifier_worker_outlives_the_schedulers_notice_and_a_dead_one_is_replaced():
    """Slurm's end-of-job notice (SIGUSR2) reaches every process of the job: the worker must not
    die of it (every later verdict was an infrastructure failure: a broken pipe); and a worker that
    died anyway (SIGKILL here) is replaced for the next call instead of failing it."""
    import signal  # noqa: PLC0415

    from snowcat.stages.verifiers import TimedVerifier  # noqa: PLC0415

    task = generate_domain(np.random.default_rng(0), "closure", [1], 1)[0]
    verifier = TimedVerifier(f"{__name__}:task_oracle_verifier_test_double", timeout_s=30.0)
    try:
        expected = verifier(task, "x").passed
        assert expected == oracle_passes(task.task_id)
        os.kill(verifier.proc.pid, signal.SIGUSR2)
        time.sleep(0.5)
        assert verifier.proc.is_alive() and verifier(task, "x").passed == expected
        os.kill(verifier.proc.pid, signal.SIGKILL)
        verifier.proc.join()
        assert verifier(task, "x").passed == expected and verifier.proc.is_alive()
    finally:
        verifier.close()


def test_engine_errors_are_infra_failures(workdir):
    metrics, results, traces = run_stage(workdir, "engine_error", checkpoints=["sft:short"], infra_retries=1, limit=2)
    assert len(traces) == 6 and all(r["status"] == "infra_error" for r in traces)
    assert all(r["infra_retries"] == 2 and r["infra_cause"].startswith("engine:") for r in traces)
    groups = results["checkpoints"]["sft:short"]["groups"]["all"]
    assert groups["infra_rate"] == 1.0 and groups["tasks_scored"] == 0
    assert groups["pass@1"] is None and groups["reward_fixed_denominator"] == 0.0  # nothing scored: no pass rate
    assert metrics["sft:short/infra_rate"] == 1.0


def test_real_verifier_and_bad_config(workdir):
    _, results, traces = run_stage(workdir, "real", checkpoints=["sft:final"], verifier="snowcat.stages.taskgen:verify", limit=4)
    assert len(traces) == 12 and all(r["status"] in ("ok", "truncated") for r in traces)
    # limit: a seeded random 4 of the val split's 6 closure then 4 arith tasks, by domain (not its first 4)
    subset, record = evaluate.sample_tasks(load_tasks(workdir / "tasks", "val"), 4, 0)
    assert results["subset"] == record and record["per_domain"] == {"arith": [2, 4], "closure": [2, 6]}
    assert [r["task_id"] for r in traces[::3]] == [t.task_id for t in subset]
    assert 0.0 <= results["checkpoints"]["sft:final"]["groups"]["all"]["reward"] <= 1.0
    good = {"attempts": 3, "pass_k": [1, 3], "needs": ["tasks", "sft"]}
    stage_config("evaluate", good, name="eval")
    for bad, error in (
        (dict(pass_k=[4]), r"stages\.eval\.pass_k: \[4\] outside 1\.\.attempts \(3\)"),
        (dict(split="test"), r"stages\.eval\.split: Invalid value 'test'"),
        (dict(top_p=0.0), r"stages\.eval\.top_p: must be > 0, got 0\.0"),
        (dict(tasks="mine"), r"stages\.eval\.needs: add 'mine' \(named in tasks\)"),
        (dict(verifier="no_colon"), r"stages\.eval\.verifier: 'no_colon' is not 'module:function'"),
        (dict(checkpoints=[]), r"stages\.eval\.checkpoints: name at least one checkpoint"),
    ):
        with pytest.raises(UserError, match=f"^{error}"):
            stage_config("evaluate", good | bad, name="eval")
    with pytest.raises(UserError, match="sft:nope"):
        run_stage(workdir, "missing", checkpoints=["sft:nope"])
