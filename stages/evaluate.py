"""`evaluate` stage: sample n attempts per held-out task per checkpoint, verify, report with honest SEs.

Per checkpoint and per group (overall, domain, domain x difficulty): pass@1 and unbiased pass@k,
mean outcome reward, SEs over task means, infrastructure failure rate; with several checkpoints,
the paired difference of each against the first (SE and paired-bootstrap interval).

Infrastructure failures -- verifier crash or time-out (verifiers run in a worker process under a
time limit), engine error -- are recorded with their cause, retried up to `infra_retries`, then
excluded from every denominator: never counted as model failures. See docs/evaluation.md.

Outputs in the stage dir: `traces.h5` (one row per attempt), `results.json`, `pass_at_k.png`, and
the episodes kept as a dataset in `trajectories/`, a shard per checkpoint (`keep_trajectories`;
stages/agent/dataset.py), with each kept episode's behaviour record in `behaviour/` (files opened and
edited against the gold patch's, test runs before the completion claim, tokens by kind, the
configured `procedure`: stages/agent/behaviour_records.py) and its seconds beside it (`.timing.jsonl`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import math
import time
from pathlib import Path
from typing import Any

import h5py
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_bytes, atomic_write_figure, atomic_write_json, nan_to_null
from snowcat.stages import evalstats
from snowcat.stages.agent import Budget, Trajectory, behaviour, make_env
from snowcat.stages.agent.behaviour_records import write_records, write_timings
from snowcat.stages.agent.context import context_behaviour, is_failure, with_context
from snowcat.stages.agent.dataset import DIRNAME, TrajectoryWriter
from snowcat.stages.agent.summariser import context_policy
from snowcat.stages.config import env_options, keep_trajectories
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.scoring import Attempt, play_attempts, sample_attempts, serve_checkpoint, task_prompt
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.verifiers import TimedVerifier

# ---------------------------------------------------------------- which tasks


def sample_tasks(tasks: list, n: int, seed: int) -> tuple[list, dict | None]:
    """(a random `n` of the split's tasks, the record of how they were drawn); every task and None
    when n is 0 or not less than the split.

    Stratified by domain (a split file is grouped by domain: its first n tasks would be one or two
    domains): each domain gets its share of n in proportion to its size, by largest remainder (ties
    to the larger domain, then by name). Within a domain, the first k of a permutation drawn by a
    generator seeded with (`seed`, the domain's name): the same tasks in every run with the same task
    set and seed, whatever the run seed, so runs are compared on the same tasks; and a larger n keeps
    the tasks of a smaller one. Returned in the split's order."""
    if n <= 0 or n >= len(tasks):
        return tasks, None
    by_domain: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        by_domain.setdefault(t.domain, []).append(i)
    total = len(tasks)
    quota = {d: n * len(ix) / total for d, ix in by_domain.items()}
    counts = {d: math.floor(q) for d, q in quota.items()}
    for d in sorted(by_domain, key=lambda d: (-(quota[d] - counts[d]), -len(by_domain[d]), d))[: n - sum(counts.values())]:
        counts[d] += 1
    chosen: list[int] = []
    for d, ix in by_domain.items():
        digest = int.from_bytes(hashlib.sha256(d.encode()).digest()[:8], "little")
        order = np.random.default_rng([seed, digest]).permutation(len(ix))
        chosen += [ix[j] for j in order[: counts[d]]]
    picked = [tasks[i] for i in sorted(chosen)]
    record = {
        "limit": n,
        "of": total,
        "seed": seed,
        "method": "stratified by domain, proportional (largest remainder); per domain a seeded permutation's first k",
        "per_domain": {d: [counts[d], len(ix)] for d, ix in sorted(by_domain.items())},
        "task_ids_sha256": hashlib.sha256("\n".join(t.task_id for t in picked).encode()).hexdigest(),
    }
    return picked, record


# ---------------------------------------------------------------- sampling + verification


def sample_and_verify(
    cfg, ctx: StageContext, ref: str, tasks, verifier: TimedVerifier, writer: TrajectoryWriter, context=None
) -> tuple[list[Attempt], dict | None, float]:
    """`cfg.attempts` verified answers per task from checkpoint `ref`, (multi-turn envs) what the
    agent did (`stages.agent.behaviour`), and the seconds sampling and verifying took; the episodes go
    to `writer` as shard `ref`. `context`: the episodes' context policy (stages/agent/context.py; a
    failed summary is an infra failure). The seconds are returned, not written beside the episodes:
    the shard's card is hashed, and a timing there made every reproduction differ."""

    engine, tok, _ = serve_checkpoint(ctx, ref, "checkpoints", cfg.batch_size)
    t0 = time.perf_counter()

    def keep(trajectories: list[Trajectory], tokenizer, passed: list[int] | None = None) -> None:
        """The shard, then the behaviour records read from it (none when nothing is kept)."""
        by_id = {t.task_id: t for t in tasks}
        shard = writer.write(ref, trajectories, tokenizer, checkpoint=ref, tasks=by_id, passed=passed)
        if shard is not None:
            write_records(shard, cfg.procedure)
            write_timings(shard, trajectories)  # the loop's episodes only (single-turn ones are not timed)

    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (tok.end_of_turn_id,))
    common = dict(
        attempts=cfg.attempts,
        seed=ctx.seed,
        verifier=verifier,
        retries=cfg.infra_retries,
        batch_size=cfg.batch_size,
        progress=functools.partial(ctx.progress, unit="episodes", phase=ref),
    )
    if cfg.env == "single":
        records = sample_attempts(engine, tok, tasks, params, **common)
        seconds = time.perf_counter() - t0
        keep(
            [single_turn_trajectory(r, task_prompt(tok, r.task), i // cfg.attempts) for i, r in enumerate(records)],
            tok,
            passed=[r.passed for r in records],
        )
        return records, None, seconds
    env = with_context(make_env(cfg.env, tok, **env_options(cfg.env, cfg)), context)
    budget = Budget(cfg.max_context, cfg.max_tokens, cfg.max_turns)
    records, trajectories = play_attempts(engine, tok, tasks, env, params, budget, **common)
    seconds = time.perf_counter() - t0
    keep([t for t in trajectories if t is not None], tok)
    agent = behaviour([t for t in trajectories if t is not None and t.status != "infra_error"], tok)
    return records, agent | (context_behaviour(trajectories) if context is not None else {}), seconds


def single_turn_trajectory(r: Attempt, prompt: list[int], group_id: int) -> Trajectory:
    """A single-turn attempt as the trajectory record the agent loop would have made of it."""
    n = len(r.token_ids)
    return Trajectory(
        task_id=r.task.task_id,
        group_id=group_id,
        attempt=r.attempt,
        policy_version=0,
        token_ids=[*prompt, *r.token_ids],
        loss_mask=[0] * len(prompt) + [1] * n,
        rollout_logprobs=[0.0] * len(prompt) + list(r.logprobs),
        reward=r.reward,
        status=r.status,
        turn_boundaries=[(len(prompt), len(prompt) + n)] if n else [],
        domain=r.task.domain,
        prompt_len=len(prompt),
        detail="; ".join(r.infra_causes),
    )


# ---------------------------------------------------------------- statistics


def _groups(records: list[Attempt]) -> dict[str, list[Attempt]]:
    groups: dict[str, list[Attempt]] = {"all": records}
    for r in records:
        groups.setdefault(r.task.domain, []).append(r)
        groups.setdefault(f"{r.task.domain}/d{int(r.task.difficulty)}", []).append(r)
    return groups


def per_task(records: list[Attempt], pass_k: list[int]) -> dict[str, dict]:
    """task id -> n (scored attempts), c (passed), reward (mean over scored), pass@k (None if n < k),
    score (each further score the verifier gave, its mean over the scored attempts that have it)."""
    out: dict[str, dict] = {}
    for r in records:
        t = out.setdefault(r.task.task_id, {"n": 0, "c": 0, "rewards": [], "attempts": 0, "infra": 0, "scores": {}})
        t["attempts"] += 1
        if not r.scored:
            t["infra"] += 1
            continue
        t["n"] += 1
        t["c"] += int(r.passed == 1)
        t["rewards"].append(r.reward)
        for name, x in r.scores.items():
            t["scores"].setdefault(name, []).append(x)
    for t in out.values():
        t["reward"] = float(np.mean(t["rewards"])) if t["rewards"] else None
        t["score"] = {name: float(np.mean(xs)) for name, xs in t["scores"].items()}
        t["pass"] = {k: (evalstats.pass_at_k(t["n"], t["c"], k) if t["n"] >= k else None) for k in pass_k}
    return out


def summarize(records: list[Attempt], pass_k: list[int], common: bool = False) -> dict[str, Any]:
    """Per-group statistics. pass@k averages the tasks with at least k scored attempts, so each k may
    cover another task set (`pass@k_tasks` says how many); `common` averages every k over the tasks
    with at least max(pass_k) scored attempts, so the curve compares like with like."""
    tasks = per_task(records, pass_k)
    attempts = sum(t["attempts"] for t in tasks.values())
    infra = sum(t["infra"] for t in tasks.values())
    out: dict[str, Any] = {
        "tasks": len(tasks),
        "tasks_scored": sum(t["n"] > 0 for t in tasks.values()),
        "attempts": attempts,
        "infra_failures": infra,
        "infra_rate": infra / attempts if attempts else math.nan,
        # of those, attempts whose transcript summary could not be written (context policy summarise)
        "summary_failures": sum(not r.scored and bool(r.infra_causes) and is_failure(r.infra_causes[-1]) for r in records),
        "truncated_rate": _rate([r.status == "truncated" for r in records if r.scored]),
    }
    need = max(pass_k) if common else None
    for k in pass_k:
        vals = [t["pass"][k] for t in tasks.values() if t["pass"][k] is not None and t["n"] >= (need or k)]
        mean, se = evalstats.mean_se(vals)
        out[f"pass@{k}"], out[f"pass@{k}_se"], out[f"pass@{k}_tasks"] = mean, se, len(vals)
    out["reward"], out["reward_se"] = evalstats.mean_se([t["reward"] for t in tasks.values() if t["reward"] is not None])
    # the model card's convention: unscored tasks count 0 in a fixed denominator (a lower bound)
    out["reward_fixed_denominator"] = evalstats.mean_outcome_reward([t["reward"] for t in tasks.values()])
    if scores := further_scores(tasks):
        out["scores"] = scores
    return out


def further_scores(tasks: dict[str, dict]) -> dict[str, float]:
    """The verifier's further scores (IFEval's loose accuracy), each as the reward is: the mean over
    tasks of its per-task mean, with the SE over tasks (`<name>_se`) and how many tasks had it."""
    out: dict[str, float] = {}
    for name in sorted({name for t in tasks.values() for name in t["score"]}):
        values = [t["score"][name] for t in tasks.values() if name in t["score"]]
        out[name], out[f"{name}_se"] = evalstats.mean_se(values)
        out[f"{name}_tasks"] = len(values)
    return out


def _rate(flags: list[bool]) -> float:
    return float(np.mean(flags)) if flags else math.nan


def compare(base: list[Attempt], other: list[Attempt], seed: int, n_boot: int) -> dict[str, Any]:
    """Paired pass@1 and reward difference (other - base) over tasks scored under both."""
    a, b = per_task(base, [1]), per_task(other, [1])
    common = sorted(t for t in a if t in b and a[t]["n"] and b[t]["n"])
    out: dict[str, Any] = {"tasks": len(common)}
    for metric, get in (("pass@1", lambda t: t["pass"][1]), ("reward", lambda t: t["reward"])):
        x, y = [get(a[t]) for t in common], [get(b[t]) for t in common]
        diff, se = evalstats.paired_difference(x, y)
        lo, hi = evalstats.paired_bootstrap_ci(x, y, seed=seed, n_boot=n_boot)
        out[metric] = {"diff": diff, "se": se, "ci95": [lo, hi]}
    return out


# ---------------------------------------------------------------- outputs


def write_traces(path: Path, records: dict[str, list[Attempt]]) -> None:
    rows = [(ref, r) for ref, rs in records.items() for r in rs]
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        text = h5py.string_dtype()
        f.create_dataset("token_ids", data=_vlen([r.token_ids for _, r in rows], np.int32), dtype=h5py.vlen_dtype(np.int32))
        f.create_dataset("logprobs", data=_vlen([r.logprobs for _, r in rows], np.float32), dtype=h5py.vlen_dtype(np.float32))
        columns = {
            "checkpoint": [ref for ref, _ in rows],
            "task_id": [r.task.task_id for _, r in rows],
            "domain": [r.task.domain for _, r in rows],
            "status": [r.status for _, r in rows],
            "finish_reason": [r.finish_reason for _, r in rows],
            # HDF5 strings cannot hold NUL; the text is a readable rendering, token_ids are exact
            "text": [r.text.replace("\x00", "\ufffd") for _, r in rows],
            "infra_cause": ["; ".join(r.infra_causes) for _, r in rows],
        }
        for name, values in columns.items():
            f.create_dataset(name, data=values, dtype=text)
        numbers = {
            "infra_retries": (np.int32, [len(r.infra_causes) for _, r in rows]),
            "difficulty": (np.int32, [int(r.task.difficulty) for _, r in rows]),
            "attempt": (np.int32, [r.attempt for _, r in rows]),
            "reward": (np.float32, [r.reward for _, r in rows]),
            "passed": (np.int8, [r.passed for _, r in rows]),
        }
        for name, (dt, values) in numbers.items():
            f.create_dataset(name, data=np.array(values, dtype=dt))
        f.attrs["passed_meaning"] = "1 passed, 0 failed, -1 not scored (infra_error)"
    atomic_write_bytes(path, buf.getvalue())


def _vlen(rows: list[list], dtype) -> np.ndarray:
    arr = np.empty(len(rows), dtype=object)
    arr[:] = [np.asarray(r, dtype=dtype) for r in rows]
    return arr


def plot_pass_at_k(path: Path, results: dict, pass_k: list[int]) -> None:
    matplotlib.use("Agg")

    refs = list(results)
    domains = sorted(g for g in results[refs[0]]["groups"] if g != "all" and "/" not in g) + ["all"]
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), squeeze=False, sharey=True)
    for ax, dom in zip(axes[0], domains):
        for ref in refs:
            g = results[ref]["groups"].get(dom)
            if g is None:
                continue
            ys = np.array([g[f"pass@{k}"] for k in pass_k])
            se = np.array([g[f"pass@{k}_se"] for k in pass_k])
            ax.errorbar(pass_k, ys, yerr=np.nan_to_num(se), marker="o", capsize=3, label=ref)
        ax.set_title(dom)
        ax.set_xlabel("k")
        ax.set_xticks(pass_k)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("pass@k (unbiased, ±1 SE over tasks)")
    axes[0][-1].legend(fontsize="small")
    atomic_write_figure(path, fig)


# ---------------------------------------------------------------- the stage


def run(ctx: StageContext) -> dict:
    cfg = ctx.config
    refs = [ctx.item["checkpoint"]] if ctx.item and "checkpoint" in ctx.item else list(cfg.checkpoints)
    pass_k = sorted(int(k) for k in cfg.pass_k)
    if cfg.tasks not in ctx.inputs:
        raise UserError(f"stages.{ctx.name}.tasks: stage {cfg.tasks!r} is not in needs")
    tasks, subset = sample_tasks(load_tasks(ctx.inputs[cfg.tasks], cfg.split), cfg.limit, cfg.limit_seed)

    context = context_policy(ctx, cfg, f"stages.{ctx.name}.context")  # its helper model served once
    verifier = TimedVerifier(cfg.verifier, cfg.verifier_timeout_s)
    keep = keep_trajectories(cfg.keep_trajectories)
    writer = TrajectoryWriter(ctx.out_dir / DIRNAME, stage=ctx.name, env=cfg.env, keep=keep, seed=ctx.seed)
    try:
        played = {ref: sample_and_verify(cfg, ctx, ref, tasks, verifier, writer, context) for ref in refs}
    finally:
        verifier.close()
    records = {ref: recs for ref, (recs, _, _) in played.items()}

    results = {
        ref: {
            "path": str(ctx.checkpoint(ref, "checkpoints")),
            "groups": {g: summarize(rs, pass_k, cfg.pass_k_tasks == "common") for g, rs in _groups(recs).items()},
        }
        | ({"behaviour": agent} if agent is not None else {})
        for ref, (recs, agent, _) in played.items()
    }
    comparisons = {}
    for ref in refs[1:]:
        base, other = _groups(records[refs[0]]), _groups(records[ref])
        comparisons[f"{ref} - {refs[0]}"] = {
            g: compare(base[g], other[g], ctx.seed, cfg.bootstrap_samples) for g in base if g in other
        }
    write_traces(ctx.out_dir / "traces.h5", records)
    atomic_write_json(
        ctx.out_dir / "results.json",
        nan_to_null(
            {
                "split": cfg.split,
                "tasks": len(tasks),
                "subset": subset,
                "attempts": cfg.attempts,
                "pass_k": pass_k,
                "pass_k_tasks": cfg.pass_k_tasks,
                "sampling": {
                    "temperature": cfg.temperature,
                    "top_k": cfg.top_k,
                    "top_p": cfg.top_p,
                    "max_tokens": cfg.max_tokens,
                }
                | ({"env": cfg.env, "max_turns": cfg.max_turns, "max_context": cfg.max_context} if cfg.env != "single" else {})
                | ({"context": dataclasses.asdict(cfg.context)} if cfg.context.policy != "keep" else {}),
                "checkpoints": results,
                "comparisons": comparisons,
            }
        ),
    )
    plot_pass_at_k(ctx.out_dir / "pass_at_k.png", results, pass_k)
    # timings only in the metrics, named by their unit (volatile: left out of `snowcat reproduce`)
    timings = {f"{ref}/sample_s": round(seconds, 3) for ref, (_, _, seconds) in played.items()}
    return nan_to_null(headline(results, comparisons, pass_k) | timings)


def headline(results: dict, comparisons: dict, pass_k: list[int]) -> dict[str, float]:
    """Flat metrics for the run summary: overall and per domain (difficulties stay in results.json)."""
    out: dict[str, float] = {}
    for ref, res in results.items():
        for g, s in res["groups"].items():
            if "/" in g:
                continue
            for k in pass_k:
                out[f"{ref}/{g}/pass@{k}"] = s[f"pass@{k}"]
            out[f"{ref}/{g}/reward"] = s["reward"]
            scores = s.get("scores", {})
            for name in [n for n in scores if not n.endswith(("_se", "_tasks"))]:
                if scores[f"{name}_tasks"] == s["tasks_scored"]:  # not "all" where only ifeval's tasks have it
                    out[f"{ref}/{g}/{name}"] = scores[name]
        out[f"{ref}/infra_rate"] = res["groups"]["all"]["infra_rate"]
        if "summaries_per_episode" in res.get("behaviour", {}):  # context policy summarise
            out[f"{ref}/summary_failures"] = res["groups"]["all"]["summary_failures"]
            out[f"{ref}/agent/summaries_per_episode"] = res["behaviour"]["summaries_per_episode"]
        for key in ("turns_mean", "invalid_actions_per_episode", "submitted_untested_frac", "claim_precision"):
            if key in res.get("behaviour", {}):
                out[f"{ref}/agent/{key}"] = res["behaviour"][key]
    for name, groups in comparisons.items():
        out[f"{name}/all/pass@1_diff"] = groups["all"]["pass@1"]["diff"]
        out[f"{name}/all/pass@1_diff_se"] = groups["all"]["pass@1"]["se"]
    return out
