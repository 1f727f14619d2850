"""`evaluate` stage: sample n attempts per held-out task per checkpoint, verify, report with honest SEs.

Per checkpoint and per group (overall, domain, domain x difficulty): pass@1 and unbiased pass@k,
mean outcome reward, SEs over task means, infrastructure failure rate; with several checkpoints,
the paired difference of each against the first (SE and paired-bootstrap interval).

Infrastructure failures -- verifier crash or time-out (verifiers run in a worker process under a
time limit), engine error -- are recorded with their cause, retried up to `infra_retries`, then
excluded from every denominator: never counted as model failures. See docs/evaluation.md.

Outputs in the stage dir: `traces.h5` (one row per attempt), `results.json`, `pass_at_k.png`.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import h5py
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_bytes, atomic_write_figure, atomic_write_json
from snowcat.stages import evalstats
from snowcat.stages.model import load_model_dir
from snowcat.stages.rollout import EngineError, SamplingParams, TorchEngine
from snowcat.stages.taskgen import VerifierError, load_tasks
from snowcat.stages.train.backend import local_device
from snowcat.stages.verifiers import TimedVerifier

# ---------------------------------------------------------------- sampling + verification


def _attempt_seed(run_seed: int, batch_index: int) -> int:
    # the same (task, attempt) gets the same seed for every checkpoint: common random numbers
    # make the paired comparison sharper
    return int(np.random.SeedSequence([run_seed, batch_index]).generate_state(1)[0])


def sample_and_verify(cfg, ctx: StageContext, ref: str, tasks, verifier: TimedVerifier) -> list[dict]:
    """One record per (task, attempt) for checkpoint `ref`."""

    device = local_device(ctx.local_rank)
    model, _, tok = load_model_dir(ctx.checkpoint(ref, "checkpoints"), device=device)
    if tok is None:
        raise UserError(f"{ref}: checkpoint has no tokenizer.json")
    engine = TorchEngine(model, max_batch=cfg.batch_size)
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (tok.end_of_turn_id,))
    requests = [(t, a) for t in tasks for a in range(cfg.attempts)]
    records = []
    for b, start in enumerate(range(0, len(requests), cfg.batch_size)):
        batch = requests[start : start + cfg.batch_size]
        prompts = [tok.render_prompt([{"role": "user", "content": t.prompt}]) for t, _ in batch]
        completions, causes = None, []
        for _ in range(cfg.infra_retries + 1):
            try:
                completions = engine.generate(prompts, params, seed=_attempt_seed(ctx.seed, b))
                break
            except EngineError as e:
                causes.append(f"engine: {e}")
        for i, (task, attempt) in enumerate(batch):
            rec = dict(
                checkpoint=ref,
                task_id=task.task_id,
                domain=task.domain,
                difficulty=int(task.difficulty),
                attempt=attempt,
                token_ids=[],
                logprobs=[],
                text="",
                reward=math.nan,
                passed=-1,
                finish_reason="",
                status="infra_error",
                infra_causes=list(causes),
            )
            records.append(rec)
            if completions is None:
                continue
            c = completions[i]
            ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids  # drop the end-of-turn id
            rec.update(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                text=tok.decode(ids, skip_special_tokens=True),
            )
            for _ in range(cfg.infra_retries + 1 - len(causes)):
                try:
                    v = verifier(task, rec["text"])
                except VerifierError as e:
                    rec["infra_causes"].append(f"verifier: {e}")
                    continue
                rec.update(reward=v.reward, passed=int(v.passed), status="truncated" if c.finish_reason == "length" else "ok")
                break
        scored = [r["passed"] for r in records if r["passed"] >= 0]
        ctx.progress(
            len(records),
            len(requests),
            unit="episodes",
            phase=ref,
            **({"pass_rate": sum(scored) / len(scored)} if scored else {}),
        )
    return records


# ---------------------------------------------------------------- statistics


def _groups(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {"all": records}
    for r in records:
        groups.setdefault(r["domain"], []).append(r)
        groups.setdefault(f"{r['domain']}/d{r['difficulty']}", []).append(r)
    return groups


def per_task(records: list[dict], pass_k: list[int]) -> dict[str, dict]:
    """task id -> n (scored attempts), c (passed), reward (mean over scored), pass@k (None if n < k)."""
    out: dict[str, dict] = {}
    for r in records:
        t = out.setdefault(r["task_id"], {"n": 0, "c": 0, "rewards": [], "attempts": 0, "infra": 0})
        t["attempts"] += 1
        if r["status"] == "infra_error":
            t["infra"] += 1
            continue
        t["n"] += 1
        t["c"] += int(r["passed"] == 1)
        t["rewards"].append(float(r["reward"]))
    for t in out.values():
        t["reward"] = float(np.mean(t["rewards"])) if t["rewards"] else None
        t["pass"] = {k: (evalstats.pass_at_k(t["n"], t["c"], k) if t["n"] >= k else None) for k in pass_k}
    return out


def summarize(records: list[dict], pass_k: list[int]) -> dict[str, Any]:
    tasks = per_task(records, pass_k)
    attempts = sum(t["attempts"] for t in tasks.values())
    infra = sum(t["infra"] for t in tasks.values())
    out: dict[str, Any] = {
        "tasks": len(tasks),
        "tasks_scored": sum(t["n"] > 0 for t in tasks.values()),
        "attempts": attempts,
        "infra_failures": infra,
        "infra_rate": infra / attempts if attempts else math.nan,
        "truncated_rate": _rate([r["status"] == "truncated" for r in records if r["status"] != "infra_error"]),
    }
    for k in pass_k:
        vals = [t["pass"][k] for t in tasks.values() if t["pass"][k] is not None]
        mean, se = evalstats.mean_se(vals)
        out[f"pass@{k}"], out[f"pass@{k}_se"], out[f"pass@{k}_tasks"] = mean, se, len(vals)
    out["reward"], out["reward_se"] = evalstats.mean_se([t["reward"] for t in tasks.values() if t["reward"] is not None])
    # the model card's convention: unscored tasks count 0 in a fixed denominator (a lower bound)
    out["reward_fixed_denominator"] = evalstats.mean_outcome_reward([t["reward"] for t in tasks.values()])
    return out


def _rate(flags: list[bool]) -> float:
    return float(np.mean(flags)) if flags else math.nan


def compare(base: list[dict], other: list[dict], seed: int, n_boot: int) -> dict[str, Any]:
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


def write_traces(path: Path, records: list[dict]) -> None:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        text = h5py.string_dtype()
        f.create_dataset("token_ids", data=_vlen([r["token_ids"] for r in records], np.int32), dtype=h5py.vlen_dtype(np.int32))
        f.create_dataset("logprobs", data=_vlen([r["logprobs"] for r in records], np.float32), dtype=h5py.vlen_dtype(np.float32))
        for name in ("checkpoint", "task_id", "domain", "status", "finish_reason"):
            f.create_dataset(name, data=[r[name] for r in records], dtype=text)
        # HDF5 strings cannot hold NUL; the text is a readable rendering, token_ids are exact
        f.create_dataset("text", data=[r["text"].replace("\x00", "\ufffd") for r in records], dtype=text)
        f.create_dataset("infra_cause", data=["; ".join(r["infra_causes"]) for r in records], dtype=text)
        f.create_dataset("infra_retries", data=[len(r["infra_causes"]) for r in records], dtype=np.int32)
        for name, dt in (("difficulty", np.int32), ("attempt", np.int32), ("reward", np.float32), ("passed", np.int8)):
            f.create_dataset(name, data=np.array([r[name] for r in records], dtype=dt))
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
    tasks = load_tasks(ctx.inputs[cfg.tasks], cfg.split)
    tasks = tasks[: cfg.limit] if cfg.limit > 0 else tasks

    verifier = TimedVerifier(cfg.verifier, cfg.verifier_timeout_s)
    try:
        records = {ref: sample_and_verify(cfg, ctx, ref, tasks, verifier) for ref in refs}
    finally:
        verifier.close()

    results = {
        ref: {
            "path": str(ctx.checkpoint(ref, "checkpoints")),
            "groups": {g: summarize(rs, pass_k) for g, rs in _groups(recs).items()},
        }
        for ref, recs in records.items()
    }
    comparisons = {}
    for ref in refs[1:]:
        base, other = _groups(records[refs[0]]), _groups(records[ref])
        comparisons[f"{ref} - {refs[0]}"] = {
            g: compare(base[g], other[g], ctx.seed, cfg.bootstrap_samples) for g in base if g in other
        }
    write_traces(ctx.out_dir / "traces.h5", [r for recs in records.values() for r in recs])
    atomic_write_json(
        ctx.out_dir / "results.json",
        _finite(
            {
                "split": cfg.split,
                "tasks": len(tasks),
                "attempts": cfg.attempts,
                "pass_k": pass_k,
                "sampling": {
                    "temperature": cfg.temperature,
                    "top_k": cfg.top_k,
                    "top_p": cfg.top_p,
                    "max_tokens": cfg.max_tokens,
                },
                "checkpoints": results,
                "comparisons": comparisons,
            }
        ),
    )
    plot_pass_at_k(ctx.out_dir / "pass_at_k.png", results, pass_k)
    return _finite(headline(results, comparisons, pass_k))


def _finite(obj):
    """NaN (e.g. the SE of a single task) -> None, so the JSON is strict."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


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
        out[f"{ref}/infra_rate"] = res["groups"]["all"]["infra_rate"]
    for name, groups in comparisons.items():
        out[f"{name}/all/pass@1_diff"] = groups["all"]["pass@1"]["diff"]
        out[f"{name}/all/pass@1_diff_se"] = groups["all"]["pass@1"]["se"]
    return out
