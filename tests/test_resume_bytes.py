"""Byte reproducibility of resume: a resumed or retried run leaves checkpoint files whose sha256 equals
an uninterrupted run's (trainer state included: optimizer, client state, RNG snapshots)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import snowcat.stages.rl as rl
import snowcat.stages.sft as sft
from snowcat.pipeline.context import Preempted
from snowcat.pipeline.fsio import sha256_file
from snowcat.pipeline.volatile import strip_volatile
from snowcat.stages.train import canonical
from snowcat.stages.train.optim import OptimConfig, build_optimizer
from tests.test_rl import _PreemptAt, baseline, inputs  # noqa: F401 (fixtures)
from tests.test_rl import make_ctx as rl_ctx
from tests.test_sft import Ctx, tasks_dir  # noqa: F401 (fixture)
from tests.test_sft import make_ctx as sft_ctx


def checkpoint_files(stage_dir: Path) -> dict[str, str]:
    """sha256 of every file under checkpoints/, but the retention ledger, which is compared apart."""
    root = stage_dir / "checkpoints"
    return {
        str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file() and p.name != "retention.json"
    }


def ledger(stage_dir: Path) -> dict:
    """The retention ledger without its wall-clock stamps (the one volatile field it holds)."""
    return strip_volatile(json.loads((stage_dir / "checkpoints" / "retention.json").read_text()))[0]


def assert_same_files(a: dict[str, str], b: dict[str, str], *, common_only: bool = False) -> None:
    if not common_only:
        assert sorted(a) == sorted(b)
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    assert differ == [], f"these checkpoint files differ in bytes: {differ}"


def test_a_loaded_optimizer_state_saves_to_the_same_bytes():
    """The cause in isolation: AdamW's state after a step, saved, loaded into a new optimizer and
    saved again, is equal in content; its bytes must be equal too."""

    def trained():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        opt, sched = build_optimizer(model, OptimConfig(warmup_steps=1, total_steps=4))
        return model, opt, sched

    def saved(opt, sched) -> bytes:
        buf = io.BytesIO()
        canonical.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": 1}, buf)
        return buf.getvalue()

    model, opt, sched = trained()
    model(torch.randn(2, 4)).sum().backward()
    opt.step(), sched.step()
    first = saved(opt, sched)
    state = torch.load(io.BytesIO(first), weights_only=False)
    _, opt2, sched2 = trained()
    opt2.load_state_dict(state["optimizer"]), sched2.load_state_dict(state["scheduler"])
    assert saved(opt2, sched2) == first


def test_resumed_sft_checkpoints_equal_an_uninterrupted_runs_byte_for_byte(tmp_path, tasks_dir):  # noqa: F811
    straight = sft_ctx(tmp_path / "a", tasks_dir, eval_tasks=0)
    sft.run(straight)
    interrupted = sft_ctx(tmp_path / "b", tasks_dir, preempt_before=5, eval_tasks=0)  # checkpoints step 4, not a save point
    with pytest.raises(Preempted):
        sft.run(interrupted)
    sft.run(sft_ctx(tmp_path / "b", tasks_dir, eval_tasks=0))

    a, b = checkpoint_files(straight.out_dir), checkpoint_files(interrupted.out_dir)
    # the preemption checkpoint (step 4) was kept only until step 6 superseded it: the same files remain
    assert {"step_000003/model.safetensors", "step_000006/trainer_state/rng_rank00000.pt"} <= set(a)
    assert_same_files(a, b)
    # the same ledger but for the preemption checkpoint's entry and its deletion
    la, lb = ledger(straight.out_dir), ledger(interrupted.out_dir)
    assert lb["checkpoints"].pop("4") == {"value": None, "deleted": True, "preemption": True}
    assert lb["deleted"].pop() == {
        "step": 4,
        "metric": "val/pass@1",
        "value": None,
        "reason": "preemption checkpoint, superseded by step 6",
    }
    assert la == lb


def test_a_checkpoint_saved_but_never_registered_is_registered_on_resume(tmp_path, tasks_dir, monkeypatch):  # noqa: F811
    """Killed between a checkpoint's save and its registration with retention (found by the Slurm
    fault campaign): the resumed run restores it, registers it, and keeps the uninterrupted run's
    checkpoints and ledger; before, it lay outside the ledger for good."""
    from snowcat.pipeline.retention import Retention  # noqa: PLC0415

    straight = sft_ctx(tmp_path / "a", tasks_dir, eval_tasks=0, steps=9, keep_last=1)
    sft.run(straight)

    class Killed(Exception):
        pass

    register = Retention.register

    def killed_at_step_6(self, step, *args, **kwargs):
        if step == 6:
            raise Killed
        return register(self, step, *args, **kwargs)

    dying = sft_ctx(tmp_path / "b", tasks_dir, eval_tasks=0, steps=9, keep_last=1)
    monkeypatch.setattr(Retention, "register", killed_at_step_6)
    with pytest.raises(Killed):
        sft.run(dying)
    assert (dying.out_dir / "checkpoints" / "step_000006").is_dir() and "6" not in ledger(dying.out_dir)["checkpoints"]
    monkeypatch.setattr(Retention, "register", register)
    sft.run(sft_ctx(tmp_path / "b", tasks_dir, eval_tasks=0, steps=9, keep_last=1))

    assert_same_files(checkpoint_files(straight.out_dir), checkpoint_files(dying.out_dir))
    assert ledger(straight.out_dir) == ledger(dying.out_dir)
    assert [d["step"] for d in ledger(dying.out_dir)["deleted"]] == [3, 6]


def test_an_sft_retry_from_initial_equals_a_fresh_start_byte_for_byte(tmp_path, tasks_dir):  # noqa: F811
    """A run that dies after writing `checkpoints/initial` but before its first step checkpoint is
    retried from `initial`: its RNG snapshots (and everything else) equal a fresh start's."""

    class Crash(Exception):
        pass

    class CrashAtStep2(Ctx):
        def progress(self, step, total, **kw):
            if step == 2:
                raise Crash

    fresh = sft_ctx(tmp_path / "a", tasks_dir, eval_tasks=0)
    sft.run(fresh)
    dying = sft_ctx(tmp_path / "b", tasks_dir, eval_tasks=0)
    dying.__class__ = CrashAtStep2
    with pytest.raises(Crash):
        sft.run(dying)
    assert sorted(p.name for p in (dying.out_dir / "checkpoints").iterdir()) == ["initial"]
    torch.manual_seed(12345)  # whatever this process drew before must not matter
    sft.run(sft_ctx(tmp_path / "b", tasks_dir, eval_tasks=0))

    assert_same_files(checkpoint_files(fresh.out_dir), checkpoint_files(dying.out_dir))
    assert ledger(fresh.out_dir) == ledger(dying.out_dir)


def test_resumed_rl_checkpoints_equal_an_uninterrupted_runs_byte_for_byte(inputs, baseline, tmp_path):  # noqa: F811
    class PreemptBeforeStep6(_PreemptAt):  # checkpoints step 5, between save points
        polls, at = 0, 6

    with pytest.raises(Preempted):
        rl.run(rl_ctx(inputs, tmp_path, cls=PreemptBeforeStep6))
    rl.run(rl_ctx(inputs, tmp_path))
    a, b = checkpoint_files(baseline / "rl"), checkpoint_files(tmp_path / "rl")
    assert "step_000006/trainer_state/client.pt" in a
    assert_same_files(a, b)
