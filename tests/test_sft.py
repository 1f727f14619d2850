"""SFT stage end to end at test size: outputs, Relay data, preemption + resume == uninterrupted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import snowcat.stages.sft as sft
from snowcat.pipeline.config import stage_config
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import sha256_file, verify_manifest
from snowcat.stages.taskgen import arith, demonstration, generate_domain, load_tasks, save_tasks, split_tasks, verify
from tests.conftest import TINY, write_config


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    train, val = [], []
    for domain, diffs in [("closure", [1, 2, 3]), ("arith", [2])]:
        tr, va = split_tasks(generate_domain(rng, domain, diffs, 40), 6, rng)
        train, val = train + tr, val + va
    save_tasks(out, "train", train)
    save_tasks(out, "val", val)
    return out


class Ctx(StageContext):
    """A StageContext whose scheduler 'announces the end of the job' before optimizer step `preempt_before`."""

    preempt_before: int | None = None
    _polls: int = 0

    def checkpoint_due(self) -> bool:
        self._polls += 1
        return self.preempt_before is not None and self._polls == self.preempt_before


def make_ctx(out: Path, tasks_dir: Path, preempt_before=None, **overrides) -> Ctx:
    ctx = Ctx.standalone(
        "sft",
        {
            "model": "test-micro",
            "tokenizer_vocab_size": 300,
            "seq_len": 96,
            "batch_rows": 4,
            "steps": 6,
            "save_every": 3,
            "warmup_steps": 2,
            "lr": 3e-3,
            "eval_tasks": 3,
            "eval_max_new_tokens": 6,
            "threads": 1,
            **overrides,
        },
        run_dir=out,
        inputs={"tasks": tasks_dir},
        seed=11,
    )
    ctx.preempt_before = preempt_before
    return ctx


def test_relay_conversations_mask_the_student(tasks_dir):
    tasks = load_tasks(tasks_dir, "train")
    convs = sft.build_conversations(tasks, relay_fraction=0.5, seed=0)
    assert len(convs) == len(tasks) + round(0.5 * len(tasks))
    by_prompt = {t.prompt: t for t in tasks}
    kinds = set()
    for msgs, _ in convs[len(tasks) :]:
        task = by_prompt[msgs[0]["content"]]
        teacher = demonstration(task)  # arith: the worked solution ending in ";answer"
        if "student_prefix" in msgs[1]:  # handoff: the teacher continues the student's turn
            kinds.add("handoff")
            assert msgs[1]["student_prefix"] + msgs[1]["content"] == teacher and msgs[1]["student_prefix"]
        else:  # fix: a wrong student answer (context), a retry request, the teacher's reply (trained)
            kinds.add("fix")
            assert msgs[1]["train"] is False and not verify(task, msgs[1]["content"]).passed
            assert msgs[-1] == {"role": "assistant", "content": teacher}
    assert kinds == {"handoff", "fix"}


def test_arith_demonstrations_work_column_by_column_and_verify():
    assert arith.worked_solution("347+285=", "632") == "7+5=12,4+8+1=13,3+2+1=6;632"
    assert arith.worked_solution("905-387=", "518") == "15-7=8,10-8-1=1,9-3-1=5;518"
    rng = np.random.default_rng(3)
    for task in generate_domain(rng, "arith", [2, 3], 400):
        worked = demonstration(task)
        columns = worked.split(";")[0].split(",")
        # the answer's digits are the columns' last digits, right to left, plus the last column's carry
        digits = columns[-1].split("=")[1] + "".join(c.split("=")[1][-1] for c in reversed(columns[:-1]))
        assert int(digits) == int(task.answer), worked
        assert verify(task, worked).passed and verify(task, task.answer).passed
        assert not verify(task, worked[:-1] + str((int(worked[-1]) + 1) % 10)).passed
        assert not verify(task, worked.split(";")[0]).passed  # the work alone is no answer


def test_sft_outputs_and_preempted_run_resumes_bit_identically(tmp_path, tasks_dir):
    straight = make_ctx(tmp_path / "a", tasks_dir)
    metrics = sft.run(straight)
    out = straight.out_dir
    assert metrics["steps"] == 6 and "val_greedy_pass@1/closure" in metrics and "val_greedy_pass@1/arith" in metrics
    for name in ["initial", "step_000003", "final"]:
        assert verify_manifest(out / "checkpoints" / name) == []
    assert (out / "checkpoints" / "best").read_text().strip() == "final"
    history = [json.loads(line) for line in (out / "metrics_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "tokens_per_s", "loss/closure", "loss/arith", "router/aux_loss", "grad_norm"} <= set(history[0])

    interrupted = make_ctx(tmp_path / "b", tasks_dir, preempt_before=5)
    with pytest.raises(Preempted):
        sft.run(interrupted)
    ckpts = interrupted.out_dir / "checkpoints"
    assert (ckpts / "step_000004").is_dir() and not (ckpts / "final").exists()
    resumed = make_ctx(tmp_path / "b", tasks_dir)
    sft.run(resumed)
    assert sha256_file(ckpts / "initial" / "model.safetensors") == sha256_file(
        out / "checkpoints" / "initial" / "model.safetensors"
    )
    assert sha256_file(ckpts / "final" / "model.safetensors") == sha256_file(out / "checkpoints" / "final" / "model.safetensors")
    resumed_history = [json.loads(line) for line in (resumed.out_dir / "metrics_history.jsonl").read_text().splitlines()]
    assert [h["loss"] for h in resumed_history] == [h["loss"] for h in history]


def test_checkpoint_retention_is_on_record_and_a_finished_stage_continues(tmp_path, tasks_dir):
    ctx = make_ctx(tmp_path, tasks_dir, save_every=2, keep_last=1, eval_tasks=0)
    sft.run(ctx)
    ckpts = ctx.out_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000006"]  # the last step is always resumable
    ledger = json.loads((ckpts / "retention.json").read_text())
    assert [d["step"] for d in ledger["deleted"]] == [2, 4]
    assert all("not among the last 1" in d["reason"] for d in ledger["deleted"])

    more = make_ctx(tmp_path, tasks_dir, save_every=2, keep_last=1, eval_tasks=0, steps=8)
    assert sft.run(more)["steps"] == 8
    history = [json.loads(line) for line in (ctx.out_dir / "metrics_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 9))
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000008"]


def test_config_validation_names_the_key():
    assert stage_config("sft").model == "demo-tiny"  # the defaults are valid
    stage_config("sft", {"batch_rows": 8, "micro_batches": 4})
    for change, error in [
        ({"model": "gpt-9"}, r"stages\.sft\.model: 'gpt-9' is not a preset"),
        ({"backend": "jax"}, r"stages\.sft\.backend: Invalid value 'jax'"),
        ({"batch_rows": 6, "micro_batches": 4}, r"stages\.sft\.batch_rows: 6 must be a multiple of micro_batches=4"),
        ({"lr": 0}, r"stages\.sft\.lr: must be > 0"),
        ({"keep_last": 0}, r"stages\.sft\.keep_last: must be >= 1"),
        ({"domain_repeats": {"arith": -1}}, r"stages\.sft\.domain_repeats\.arith: must be >= 0"),
    ]:
        with pytest.raises(UserError, match=f"^{error}"):
            stage_config("sft", change)


def test_a_checkpoint_slower_than_half_the_preemption_notice_is_reported_once(tmp_path, tasks_dir, capsys):
    """A save that outlasts half of resume.signal_margin_s would be cut off at the end of a real job."""
    sft.run(make_ctx(tmp_path / "a", tasks_dir, eval_tasks=0, resume={"signal_margin_s": 0}))
    err = capsys.readouterr().err
    assert err.count("resume.signal_margin_s=0 s before the end of a job: raise it to at least") == 1, err
    sft.run(make_ctx(tmp_path / "b", tasks_dir, eval_tasks=0))  # 120 s: a test model saves in far less
    assert "signal_margin_s" not in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_under_mpirun_meet_over_mpi_and_follow_one_rank(snowcat, tmp_path):
    """The local executor starts a 2-rank SFT under `mpirun` with no MASTER_ADDR: the ranks find
    each other through the MPI world (stages.train.rendezvous), train the global batch between them
    and follow the single rank's loss curve, router losses included (they balance the whole batch:
    balance_router_over; per-rank router losses left a 1.4% gap after 8 steps)."""
    cfg = write_config(tmp_path / "tiny.yaml", TINY.replace("steps: 20", "steps: 8").replace("eval_tasks: 4", "eval_tasks: 0"))
    curves = {}
    for ranks in (1, 2):
        run_dir = tmp_path / f"ranks{ranks}"
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        snowcat("run", cfg, f"stages.sft.resources.tasks_per_node={ranks}", "--run-dir", run_dir, env=env, check=True)
        sft_dir = run_dir / "stages" / "sft"
        curves[ranks] = [json.loads(line)["loss"] for line in (sft_dir / "metrics_history.jsonl").read_text().splitlines()]
        assert json.loads((sft_dir / "checkpoints" / "step_000008" / "meta.json").read_text())["world_size"] == ranks
    assert len(curves[2]) == 8 and curves[2] == pytest.approx(curves[1], rel=1e-5)
