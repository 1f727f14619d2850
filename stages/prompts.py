"""`prompts` stage: prompt selection (docs/recipes.md, "Prompt selection").

K candidate prompts (`candidates`; "" is no prompt) are scored on held-out development tasks with one
checkpoint: each candidate's `attempts` episodes per task are played in the agent loop with the
prompt as a system message in the opening (`stages.agent.prompting.PromptedEnv`, as RL's
`rollout_prompt` puts it), every one verified. Episode (task, attempt) draws the same random
numbers under every candidate (common random numbers), so the comparison is paired per task.

The choice uses the evaluate stage's statistics (stages/evalstats.py): per candidate pass@1 ± SE
over the tasks it scored; against the `baseline` candidate the paired difference over the tasks
both scored, its SE, a bootstrap interval over tasks, the paired-t p-value, and Holm's adjustment
over the K - 1 comparisons; a permutation test of "all candidates alike". `rule: significant`
chooses the candidate with the highest pass@1 among those whose gain over the baseline survives
Holm at `alpha`, else the baseline; `rule: best` the highest pass@1 whatever the statistics.
Infrastructure failures (engine, verifier) are retried, then left out of every denominator.

RL samples with the choice through `rl.rollout_prompt: "prompts:<this stage>"`
(`stages.agent.prompting.resolve_rollout_prompt`).

Resumable: each candidate's counts are kept in `partial/` once it is scored; a preempted unit
continues there and ends with the bytes of an uninterrupted one.

Outputs: `prompts.json` (the candidates' statistics, the comparisons, the choice and why, and
`per_task`: per candidate and task [scored attempts, passes, infrastructure failures], what every
number is computed from).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np

from snowcat.pipeline.context import Preempted
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, build_manifest, nan_to_null
from snowcat.stages import evalstats
from snowcat.stages.agent import Budget, make_env
from snowcat.stages.agent.prompting import CHOICE, PromptedEnv
from snowcat.stages.config import PromptsConfig as Config
from snowcat.stages.config import env_options
from snowcat.stages.model.io import load_model_config
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.scoring import play_attempts, serve_checkpoint
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.verifiers import TimedVerifier, load_verifier


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _key(cfg: Config, seed: int, checkpoint_digest: str, prompt: str, task_ids: list[str]) -> str:
    """What a candidate's saved counts depend on: counts saved under other settings are scored again."""
    what = [seed, cfg.checkpoint, checkpoint_digest, prompt, cfg.env, cfg.require_tool, cfg.temperature, cfg.top_p]
    what += [cfg.top_k, cfg.max_tokens, cfg.max_turns, cfg.max_context, cfg.attempts, cfg.infra_retries, cfg.verifier]
    what += [cfg.sandbox.options(), task_ids]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()


def score(engine, tok, tasks: list, prompt: str, cfg: Config, seed: int, verifier, progress) -> dict[str, list[int]]:
    """task id -> [scored attempts, passes, infrastructure failures] of one candidate prompt."""
    env = make_env(cfg.env, tok, **env_options(cfg.env, cfg))
    env = PromptedEnv(env, prompt) if prompt else env
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (tok.end_of_turn_id,))
    budget = Budget(cfg.max_context, cfg.max_tokens, cfg.max_turns)
    records, _ = play_attempts(
        engine,
        tok,
        tasks,
        env,
        params,
        budget,
        attempts=cfg.attempts,
        seed=seed,  # the same for every candidate: common random numbers, a paired comparison
        verifier=verifier,
        retries=cfg.infra_retries,
        batch_size=cfg.batch_size,
        progress=progress,
    )
    out = {t.task_id: [0, 0, 0] for t in tasks}
    for r in records:
        row = out[r.task.task_id]
        if r.scored:
            row[0] += 1
            row[1] += int(r.passed == 1)
        else:
            row[2] += 1
    return out


def choose(prompts: list[str], counts: list[dict[str, list[int]]], cfg: Config, seed: int) -> dict:
    """The statistics of every candidate and the choice (see the module docstring)."""

    def pass1(k: int) -> dict[str, float]:
        return {t: c[1] / c[0] for t, c in counts[k].items() if c[0]}

    rates = [pass1(k) for k in range(len(prompts))]
    candidates = []
    for k, prompt in enumerate(prompts):
        mean, se = evalstats.mean_se(list(rates[k].values()))
        attempts = sum(c[0] + c[2] for c in counts[k].values())
        infra = sum(c[2] for c in counts[k].values())
        candidates.append(
            {
                "index": k,
                "prompt": prompt,
                "sha256": digest(prompt),
                "tasks": len(rates[k]),
                "pass@1": mean,
                "pass@1_se": se,
                "attempts": attempts,
                "infra_failures": infra,
                "infra_rate": infra / attempts if attempts else float("nan"),
            }
        )
    b = cfg.baseline
    versus = []
    for k in range(len(prompts)):
        if k == b:
            continue
        shared = sorted(set(rates[b]) & set(rates[k]))
        x, y = [rates[b][t] for t in shared], [rates[k][t] for t in shared]
        diff, se = evalstats.paired_difference(x, y)
        lo, hi = evalstats.paired_bootstrap_ci(x, y, seed=seed, n_boot=cfg.bootstrap_samples)
        versus.append({"index": k, "tasks": len(shared), "diff": diff, "se": se, "ci95": [lo, hi]})
        versus[-1]["p"] = evalstats.paired_p_value(x, y)
    for v, adjusted in zip(versus, evalstats.holm([v["p"] for v in versus]), strict=True):
        v["p_holm"] = adjusted
        v["significant"] = bool(adjusted < cfg.alpha and v["diff"] > 0)  # NaN compares False
    common = sorted(set.intersection(*(set(r) for r in rates)))
    scores = np.array([[r[t] for r in rates] for t in common]).reshape(len(common), len(prompts))
    stat, p = evalstats.permutation_homogeneity(scores, seed=seed, n_perm=cfg.bootstrap_samples)

    def best(indices: list[int]) -> int:  # the highest pass@1, the lowest index among ties
        return max(indices, key=lambda k: (np.nan_to_num(candidates[k]["pass@1"], nan=-1.0), -k))

    if cfg.rule == "best":
        pick = best(list(range(len(prompts))))
        reason = "the highest pass@1 (rule best: the statistics do not decide)"
    else:
        winners = [v["index"] for v in versus if v["significant"]]
        pick = best(winners) if winners else b
        reason = (
            f"the highest pass@1 among the candidates whose gain over the baseline is significant (Holm, alpha {cfg.alpha})"
            if winners
            else f"the baseline: no candidate's gain over it is significant (Holm, alpha {cfg.alpha})"
        )
    return {
        "baseline": b,
        "rule": cfg.rule,
        "alpha": cfg.alpha,
        "candidates": candidates,
        "versus_baseline": versus,
        "homogeneity": {"tasks": len(common), "statistic": stat, "p": p, "permutations": cfg.bootstrap_samples},
        "chosen": {"index": pick, "prompt": prompts[pick], "sha256": digest(prompts[pick]), "reason": reason},
        "per_task": {str(k): counts[k] for k in range(len(prompts))},
    }


def run(ctx) -> dict:
    cfg: Config = ctx.config
    key = f"stages.{ctx.name}"
    if cfg.tasks not in ctx.inputs:
        raise UserError(f"{key}.tasks: stage {cfg.tasks!r} is not in needs")
    tasks_dir = Path(ctx.inputs[cfg.tasks])
    if not (tasks_dir / f"{cfg.split}.parquet").is_file():
        raise UserError(f"{key}.split: stage {cfg.tasks!r} wrote no {cfg.split} split (set dev_count on its domains, or use val)")
    tasks = load_tasks(tasks_dir, cfg.split)
    tasks = tasks[: cfg.limit] if cfg.limit > 0 else tasks
    path = ctx.checkpoint(cfg.checkpoint, "checkpoint")
    limit = load_model_config(path).max_position_embeddings
    if cfg.max_context + cfg.max_tokens > limit:
        raise UserError(
            f"{key}.max_context: max_context + max_tokens ({cfg.max_context + cfg.max_tokens}) "
            f"exceeds the checkpoint's max_position_embeddings ({limit})"
        )
    engine, tok, _ = serve_checkpoint(ctx, cfg.checkpoint, "checkpoint", cfg.batch_size)
    checkpoint_digest = digest(json.dumps(build_manifest(path), sort_keys=True))
    out = Path(ctx.out_dir)
    partial = out / "partial"
    partial.mkdir(exist_ok=True)
    task_ids = [t.task_id for t in tasks]
    if cfg.verifier_timeout_s:
        verifier = TimedVerifier(cfg.verifier, cfg.verifier_timeout_s)
    else:
        verifier = load_verifier(cfg.verifier, f"{key}.verifier")
    counts = []
    try:
        for k, prompt in enumerate(cfg.candidates):
            saved_path = partial / f"candidate_{k:03d}.json"
            want = _key(cfg, ctx.seed, checkpoint_digest, prompt, task_ids)
            saved = json.loads(saved_path.read_text()) if saved_path.is_file() else None
            if saved is not None and saved.get("key") == want:
                counts.append(saved["counts"])
                continue
            progress = lambda done, total, **kw: ctx.progress(done, total, unit="episodes", phase=f"prompt {k}", **kw)  # noqa: B023, E731
            counts.append(score(engine, tok, tasks, prompt, cfg, ctx.seed, verifier, progress))
            atomic_write_text(saved_path, json.dumps({"key": want, "counts": counts[-1]}))
            if ctx.checkpoint_due() and k + 1 < len(cfg.candidates):
                raise Preempted(f"prompts: {k + 1} of {len(cfg.candidates)} candidates scored, kept in {partial}")
    finally:
        getattr(verifier, "close", lambda: None)()
    report = choose(list(cfg.candidates), counts, cfg, ctx.seed)
    atomic_write_json(
        out / CHOICE,
        nan_to_null(
            {
                "checkpoint": cfg.checkpoint,
                "split": cfg.split,
                "tasks": len(tasks),
                "attempts": cfg.attempts,
                "sampling": {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p},
                "budget": {"max_tokens": cfg.max_tokens, "max_turns": cfg.max_turns, "max_context": cfg.max_context},
                "env": cfg.env,
                **report,
            }
        ),
    )
    shutil.rmtree(partial)  # everything it held is in prompts.json
    chosen = report["chosen"]["index"]
    metrics = {f"candidate_{c['index']}/pass@1": c["pass@1"] for c in report["candidates"]}
    metrics |= {"chosen": chosen, "chosen/pass@1": report["candidates"][chosen]["pass@1"]}
    for v in report["versus_baseline"]:
        metrics[f"candidate_{v['index']} - baseline/pass@1_diff"] = v["diff"]
    return nan_to_null(metrics)
