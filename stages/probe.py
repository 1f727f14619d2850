"""`probe` stage: how often does a checkpoint solve each *training* task? (input to `select`)

Samples `attempts` episodes per train task with the agent loop (same environment and budget as RL
will use) and records per task: n (scored attempts), passes (full-credit rewards), infra failures
(engine/environment/verifier crashes after retries; never counted as failures of the model).

Outputs in the stage dir: `probe.parquet` (task_id, domain, difficulty, n, passes, infra_failures,
mean_reward), `probe.json` (pass-count histograms, fraction of tasks in the useful band),
`probe_histogram.png`, `traces.h5` (one row per episode, token ids exactly as sampled), and the
episodes kept as a dataset in `trajectories/` (`keep_trajectories`; stages/agent/dataset.py).
Preemption-safe: finished batches are kept under `partial/` until the stage completes.
"""

from __future__ import annotations

import io
import json
import shutil
from itertools import zip_longest
from pathlib import Path

import h5py
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snowcat.pipeline.context import Preempted
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_bytes, atomic_write_figure, atomic_write_json
from snowcat.stages.agent import Budget, EpisodeJob, make_env, run_episodes
from snowcat.stages.agent.dataset import DIRNAME, TrajectoryWriter, load_played, save_played
from snowcat.stages.config import env_options, keep_trajectories
from snowcat.stages.model.io import load_model_config
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.scoring import serve_checkpoint
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.verifiers import TimedVerifier


def first_of_each_domain_in_turn(tasks: list, n: int) -> list:
    """`n` tasks taken from the domains in turn (the train table is grouped by domain), so that a
    limit probes every domain rather than only the first."""

    by_domain: dict[str, list] = {}
    for t in tasks:
        by_domain.setdefault(t.domain, []).append(t)
    return [t for turn in zip_longest(*by_domain.values()) for t in turn if t is not None][:n]


def probe(engine, tok, tasks, cfg, seed: int, verifier=None, partial_dir: Path | None = None, checkpoint_due=None, progress=None):
    """All episodes (`attempts` per task, group id = task index), infra errors retried.

    With `partial_dir`, each finished batch is saved there (packed trajectories) and reused on the
    next call, so a preempted probe continues where it stopped; episodes are seeded per (task,
    attempt, turn), so the result equals an uninterrupted run. `checkpoint_due()` true after a
    batch raises `Preempted`. `progress(done, total, ...)` hears of each batch (ctx.progress)."""

    env = make_env(cfg.env, tok, **env_options(cfg.env, cfg))
    params = sampling_params(cfg, tok)
    budget = Budget(cfg.max_context, cfg.max_turn_tokens, cfg.max_turns)
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(tasks) for a in range(cfg.attempts)]
    key = json.dumps(
        [
            seed,
            str(cfg.checkpoint),
            cfg.env,
            cfg.require_tool,
            repr(params),
            repr(budget),
            cfg.batch_size,
            [t.task_id for t in tasks],
            cfg.attempts,
        ]
    )
    trajs = []
    for b, start in enumerate(range(0, len(jobs), cfg.batch_size)):
        path = partial_dir / f"batch_{b:06d}.npz" if partial_dir is not None else None
        saved = load_played(path, key) if path is not None else None
        if saved is not None:
            trajs += saved
            continue
        batch = jobs[start : start + cfg.batch_size]
        out = run_episodes(engine, tok, batch, env, params, budget, seed, policy_version=0, verifier=verifier)
        for _ in range(cfg.infra_retries):  # same seeds: a retry samples what the first try would have
            failed = [i for i, tr in enumerate(out) if tr.status == "infra_error"]
            if not failed:
                break
            again = run_episodes(engine, tok, [batch[i] for i in failed], env, params, budget, seed, 0, verifier=verifier)
            for i, tr in zip(failed, again):
                out[i] = tr
        trajs += out
        if path is not None:
            save_played(path, key, out)
        if progress is not None:
            scored = [t.passed for t in trajs if t.trainable]
            progress(len(trajs), len(jobs), unit="episodes", **({"pass_rate": sum(scored) / len(scored)} if scored else {}))
        if checkpoint_due is not None and checkpoint_due() and start + cfg.batch_size < len(jobs):
            raise Preempted(f"probe: {b + 1} batches saved in {partial_dir}")
    return trajs


def sampling_params(cfg, tok):
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_turn_tokens, (tok.end_of_turn_id,))


def pass_counts(tasks, trajs) -> list[dict]:
    """One row per task: n scored attempts, passes (reward 1 = full credit), infra failures."""
    rows = {
        t.task_id: dict(
            task_id=t.task_id, domain=t.domain, difficulty=int(t.difficulty), n=0, passes=0, infra_failures=0, rewards=[]
        )
        for t in tasks
    }
    for tr in trajs:
        r = rows[tr.task_id]
        if tr.status == "infra_error":
            r["infra_failures"] += 1
            continue
        r["n"] += 1
        r["passes"] += int(tr.passed)
        r["rewards"].append(tr.reward)
    for r in rows.values():
        rewards = r.pop("rewards")
        r["mean_reward"] = float(np.mean(rewards)) if rewards else float("nan")
    return list(rows.values())


def summarize(rows: list[dict], attempts: int, lo: int, hi: int) -> dict:
    def stats(rs):
        hist = np.bincount([r["passes"] for r in rs], minlength=attempts + 1).tolist()
        in_band = [lo <= r["passes"] <= hi for r in rs]
        return {
            "tasks": len(rs),
            "histogram": hist,
            "band_fraction": float(np.mean(in_band)) if rs else None,
            "infra_failures": int(sum(r["infra_failures"] for r in rs)),
            "pass_rate": float(sum(r["passes"] for r in rs) / max(1, sum(r["n"] for r in rs))),
        }

    domains = sorted({r["domain"] for r in rows})
    return {
        "attempts": attempts,
        "band": [lo, hi],
        "all": stats(rows),
        "domains": {d: stats([r for r in rows if r["domain"] == d]) for d in domains},
    }


def write_table(path: Path, rows: list[dict]) -> None:
    schema = pa.schema(
        [
            ("task_id", pa.string()),
            ("domain", pa.string()),
            ("difficulty", pa.int32()),
            ("n", pa.int32()),
            ("passes", pa.int32()),
            ("infra_failures", pa.int32()),
            ("mean_reward", pa.float64()),
        ]
    )
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, compression="zstd")
    atomic_write_bytes(path, buf.getvalue())


def write_traces(path: Path, trajs) -> None:
    def vlen(name, dtype):
        arr = np.empty(len(trajs), dtype=object)
        arr[:] = [np.asarray(getattr(t, name), dtype) for t in trajs]
        f.create_dataset(name, data=arr, dtype=h5py.vlen_dtype(dtype))

    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        vlen("token_ids", np.int32)
        vlen("loss_mask", np.uint8)
        vlen("rollout_logprobs", np.float32)
        turns = np.empty(len(trajs), dtype=object)
        turns[:] = [np.asarray(t.turn_boundaries, np.int32).reshape(-1) for t in trajs]
        f.create_dataset("turn_boundaries", data=turns, dtype=h5py.vlen_dtype(np.int32))
        text = h5py.string_dtype()
        for name in ("task_id", "domain", "status"):
            f.create_dataset(name, data=[getattr(t, name) for t in trajs], dtype=text)
        f.create_dataset("detail", data=[t.detail.replace("\x00", "\ufffd") for t in trajs], dtype=text)
        for name, dt in (("group_id", np.int64), ("attempt", np.int32), ("prompt_len", np.int32), ("reward", np.float32)):
            f.create_dataset(name, data=np.array([getattr(t, name) for t in trajs], dtype=dt))
        f.attrs["turn_boundaries"] = "flattened (start, end) pairs of the model's turns"
    atomic_write_bytes(path, buf.getvalue())


def plot_histogram(path: Path, summary: dict) -> None:
    matplotlib.use("Agg")

    groups = list(summary["domains"]) + ["all"]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3.2), squeeze=False, sharey=True)
    lo, hi = summary["band"]
    for ax, g in zip(axes[0], groups):
        s = summary["all"] if g == "all" else summary["domains"][g]
        ks = np.arange(len(s["histogram"]))
        ax.bar(ks, s["histogram"], color=["tab:blue" if lo <= k <= hi else "tab:gray" for k in ks])
        frac = s["band_fraction"]
        ax.set_title(f"{g}: {s['tasks']} tasks, {0 if frac is None else frac:.0%} in band")
        ax.set_xlabel(f"passes out of {summary['attempts']}")
        ax.set_xticks(ks)
    axes[0][0].set_ylabel("tasks")
    atomic_write_figure(path, fig)


def run(ctx) -> dict:
    cfg = ctx.config
    key = f"stages.{ctx.name}"
    if cfg.tasks not in ctx.inputs:
        raise UserError(f"{key}.tasks: stage {cfg.tasks!r} is not in needs")
    tasks = load_tasks(ctx.inputs[cfg.tasks], "train")  # never the held-out split
    tasks = first_of_each_domain_in_turn(tasks, cfg.limit) if cfg.limit > 0 else tasks
    # the budget check reads config.json alone: refused before an engine spends minutes starting
    limit = load_model_config(ctx.checkpoint(cfg.checkpoint, "checkpoint")).max_position_embeddings
    if cfg.max_context + cfg.max_turn_tokens > limit:
        raise UserError(
            f"{key}: max_context + max_turn_tokens ({cfg.max_context + cfg.max_turn_tokens}) "
            f"exceeds the model's max_position_embeddings ({limit})"
        )
    engine, tok, _ = serve_checkpoint(ctx, cfg.checkpoint, "checkpoint", cfg.batch_size)
    verifier = TimedVerifier(cfg.verifier, cfg.verifier_timeout_s)
    partial = Path(ctx.out_dir) / "partial"
    partial.mkdir(exist_ok=True)
    try:
        trajs = probe(engine, tok, tasks, cfg, ctx.seed, verifier, partial, ctx.checkpoint_due, ctx.progress)
    finally:
        verifier.close()

    rows = pass_counts(tasks, trajs)
    summary = summarize(rows, cfg.attempts, cfg.band_min_pass, cfg.band_max_pass)
    out = Path(ctx.out_dir)
    write_table(out / "probe.parquet", rows)
    write_traces(out / "traces.h5", trajs)
    writer = TrajectoryWriter(
        out / DIRNAME, stage=ctx.name, env=cfg.env, keep=keep_trajectories(cfg.keep_trajectories), seed=ctx.seed
    )
    writer.write(cfg.checkpoint, trajs, tok, checkpoint=cfg.checkpoint, tasks={t.task_id: t for t in tasks})
    atomic_write_json(out / "probe.json", {"checkpoint": cfg.checkpoint, "env": cfg.env, **summary})
    plot_histogram(out / "probe_histogram.png", summary)
    shutil.rmtree(partial)  # everything it held is in traces.h5 now
    metrics = {
        "tasks": len(rows),
        "band_fraction": summary["all"]["band_fraction"],
        "pass_rate": summary["all"]["pass_rate"],
        "infra_failures": summary["all"]["infra_failures"],
    }
    for d, s in summary["domains"].items():
        metrics[f"{d}/band_fraction"] = s["band_fraction"]
        metrics[f"{d}/pass_rate"] = s["pass_rate"]
    return metrics
