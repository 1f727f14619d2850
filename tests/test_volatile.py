"""Volatile values (timings, speeds, stamps) are recognised by their unit or namespace, not by a list
of names: a new timing metric needs no registration, and no result metric is mistaken for one."""

from __future__ import annotations

from snowcat.pipeline.volatile import strip_volatile, why_volatile


def test_timings_speeds_and_stamps_are_volatile_by_their_unit():
    for name in (
        "wait_seconds",  # rl metrics.json: not on any list before, named so by its unit
        "sampled_tokens_per_s",
        "throughput/sampled_tokens_per_s",
        "time/wait_batch_s",
        "duration_s",
        "train_seconds",
        "seconds",
        "engine/reload_s",
        "engine/rebuilds",  # a requeued rollout rank builds a fresh engine: more rebuilds, same results
        "memory/peak_rss_gib",  # the training loop's peak memory: the allocator's and the process's history
        "registered_at",
        "time",
    ):
        assert why_volatile(name), name
    assert "rate" in why_volatile("sampled_tokens_per_s") and "stamp" in why_volatile("registered_at")


def test_results_are_not_volatile():
    for name in (
        "final_loss",
        "final_reward_mean",
        "val/pass@1",
        "val_greedy_pass@1/arith",
        "steps",
        "updates",
        "tokens",
        "max_abs_dlogit",
        "status/timeout",
        "length/response_mean",
        "policy_lag/mean",
        "best_step",
        "mismatch/k3_kl",
        "status",
    ):
        assert why_volatile(name) is None, name


def test_strip_removes_volatile_keys_at_any_depth_and_says_why():
    record = {"step": 3, "loss": 0.5, "time/step_s": 0.2, "nested": [{"registered_at": 1.0, "value": 2}]}
    kept, removed = strip_volatile(record)
    assert kept == {"step": 3, "loss": 0.5, "nested": [{"value": 2}]}
    assert set(removed) == {"time/step_s", "registered_at"}


def test_reproduce_replaces_a_short_run_id_only_as_a_whole_name():
    from snowcat.pipeline.reproduce import _replace_paths  # noqa: PLC0415

    recorded = {"log": "/scratch/r/a/stages/rl: run a", "metric": "grad_norm", "ids": ["a", "a-1", "a.json"]}
    assert _replace_paths(recorded, ("/scratch/r/a", "a")) == {
        "log": "<run>/stages/rl: run <run>",
        "metric": "grad_norm",  # not gr<run>d_norm
        "ids": ["<run>", "a-1", "a.json"],
    }
