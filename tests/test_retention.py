"""Retention never loses the best, the latest or a pinned checkpoint, and every deletion is on record."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.retention import LEDGER, Retention, RetentionPolicy


def save(ckpt: Path, step: int) -> None:
    d = ckpt / f"step_{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w" * 10)


def on_disk(ckpt: Path) -> set[int]:
    return {int(p.name.split("_")[1]) for p in ckpt.iterdir() if p.name.startswith("step_")}


def test_keeps_best_last_and_pinned(tmp_path):
    r = Retention(tmp_path, RetentionPolicy(metric="acc", mode="max", keep_best=1, keep_last=2, pinned=[10]))
    deleted = []
    for step, acc in [(10, 0.1), (20, 0.9), (30, 0.2), (40, 0.3), (50, 0.4)]:
        save(tmp_path, step)
        deleted += r.register(step, {"acc": acc, "loss": 1.0})
    assert deleted == [30]  # 10 pinned, 20 best, 40 and 50 the last two
    assert on_disk(tmp_path) == {10, 20, 40, 50}
    assert r.best() == r.historical_best() == 20
    ledger = json.loads((tmp_path / LEDGER).read_text())
    assert [d["step"] for d in ledger["deleted"]] == [30] and "acc=0.2" in ledger["deleted"][0]["reason"]


def test_min_mode_missing_metric_and_ties(tmp_path):
    r = Retention(tmp_path, RetentionPolicy(metric="loss", mode="min", keep_best=1, keep_last=1))
    for step, m in [(1, {"loss": 2.0}), (2, {"loss": 1.0}), (3, {}), (4, {"loss": 1.0}), (5, {"loss": float("nan")})]:
        save(tmp_path, step)
        r.register(step, m)
    assert on_disk(tmp_path) == {2, 5}  # step 2 wins the tie with 4 (earlier); 5 is the latest
    assert r.best() == 2


def test_policy_validation_and_missing_dir(tmp_path):
    with pytest.raises(UserError, match="keep_best"):
        RetentionPolicy(keep_best=0)
    with pytest.raises(UserError, match="mode"):
        RetentionPolicy(mode="best")
    r = Retention(tmp_path, RetentionPolicy(metric="acc"))
    with pytest.raises(UserError, match="step_7"):
        r.register(7, {"acc": 1.0})


def test_crash_between_ledger_and_rmtree_is_finished_on_reopen(tmp_path, monkeypatch):
    policy = RetentionPolicy(metric="acc", keep_best=1, keep_last=2)
    r = Retention(tmp_path, policy)
    save(tmp_path, 1)
    r.register(1, {"acc": 0.5})
    save(tmp_path, 2)
    r.register(2, {"acc": 0.9})
    save(tmp_path, 3)

    def crash():
        raise KeyboardInterrupt("killed after the ledger write")

    monkeypatch.setattr(r, "_finish_deletions", crash)
    with pytest.raises(KeyboardInterrupt):
        r.register(3, {"acc": 0.1})
    assert on_disk(tmp_path) == {1, 2, 3}  # nothing removed yet, but the ledger says 1 goes
    assert [d["step"] for d in json.loads((tmp_path / LEDGER).read_text())["deleted"]] == [1]
    Retention(tmp_path, policy)
    assert on_disk(tmp_path) == {2, 3}


def test_reregistering_a_step_after_resume_updates_it(tmp_path):
    r = Retention(tmp_path, RetentionPolicy(metric="acc", keep_best=1, keep_last=1))
    save(tmp_path, 1)
    r.register(1, {"acc": 0.5})
    r.register(1, {"acc": 0.7})
    assert r.registered() == {1: 0.7} and on_disk(tmp_path) == {1}


def test_a_preemption_checkpoint_is_kept_only_until_the_next_one(tmp_path):
    """Saved on notice between save points, it is the latest for a while (resume needs it), then
    the next checkpoint supersedes it: the kept set equals an uninterrupted run's, and the ledger
    records it and why it went."""
    policy = RetentionPolicy(metric="acc", keep_best=1, keep_last=2)
    straight, preempted = tmp_path / "a", tmp_path / "b"
    for ckpt, steps in [
        (straight, [(4, {}), (8, {}), (12, {"acc": 0.5})]),
        (preempted, [(4, {}), (8, {}), (10, None), (12, {"acc": 0.5})]),
    ]:
        r = Retention(ckpt, policy)
        for step, m in steps:
            save(ckpt, step)
            r.register(step, m or {}, preemption=m is None)
            if m is None:
                assert on_disk(ckpt) == {4, 8, 10} and r.live() == [4, 8, 10]  # latest: kept, and not counted in keep_last
                r = Retention(ckpt, policy)  # the job ends; the resumed one reads the ledger back
    assert on_disk(straight) == on_disk(preempted) == {8, 12}
    a, b = (json.loads((d / LEDGER).read_text()) for d in (straight, preempted))
    assert [(d["step"], d["reason"]) for d in a["deleted"]] == [(4, "no metric value; not among the last 2; not pinned")]
    assert [(d["step"], d["reason"]) for d in b["deleted"]] == [
        (4, "no metric value; not among the last 2; not pinned"),
        (10, "preemption checkpoint, superseded by step 12"),
    ]
    assert b["checkpoints"]["10"]["preemption"] is True and "preemption" not in b["checkpoints"]["8"]
    assert Retention(preempted, policy).best() == 12


metric = st.one_of(st.none(), st.floats(-10, 10, allow_nan=False), st.sampled_from([0.0, 1.0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(metric, min_size=1, max_size=12),
    mode=st.sampled_from(["max", "min"]),
    keep_best=st.integers(1, 3),
    keep_last=st.integers(0, 3),
    pinned=st.lists(st.integers(0, 11), max_size=3),
    reopen_every=st.integers(1, 4),
    preempted=st.lists(st.booleans(), max_size=12),
)
def test_property_policy_invariants(values, mode, keep_best, keep_last, pinned, reopen_every, preempted):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        policy = RetentionPolicy(metric="m", mode=mode, keep_best=keep_best, keep_last=keep_last, pinned=pinned)
        r = Retention(ckpt, policy)
        off = {s for s, p in enumerate(preempted) if p}
        for step, v in enumerate(values):
            if step % reopen_every == 0:
                r = Retention(ckpt, policy)  # a resumed trainer reads the ledger back
            save(ckpt, step)
            r.register(step, {"m": v} if v is not None else {}, preemption=step in off)

            seen = {s: values[s] for s in range(step + 1)}
            scheduled = [s for s in seen if s not in off]
            scored = [s for s in scheduled if seen[s] is not None]
            # the reference policy, written independently of the implementation: preemption
            # checkpoints are kept only while latest (or pinned)
            sign = -1 if mode == "max" else 1
            ranked = sorted(scored, key=lambda s: (sign * seen[s], s))
            expected = set(ranked[:keep_best]) | set(scheduled[-keep_last:] if keep_last else []) | {step}
            expected |= {p for p in pinned if p <= step}
            assert on_disk(ckpt) == expected
            if ranked:
                best = ranked[0]
                assert best in on_disk(ckpt) and r.best() == r.historical_best() == best

        ledger = json.loads((ckpt / LEDGER).read_text())
        deleted = [d["step"] for d in ledger["deleted"]]
        assert sorted(deleted) == sorted(set(range(len(values))) - on_disk(ckpt))  # each deletion explained once
        for d in ledger["deleted"]:
            assert d["reason"] and d["metric"] == "m" and d["value"] == values[d["step"]] and d["time"] > 0
