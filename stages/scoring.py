"""Sample, verify, count: the one way a model is scored on single-turn tasks.

`evaluate`, RL's held-out check and SFT's end-of-stage greedy check all call `sample_attempts`
and `pass_rates`. The prompt is the task's user turn through the tokenizer's chat template
(`task_prompt`), the same rendering SFT trains on and the agent loop's single-turn environment
starts from, so a score cannot drift from training by a hand-written prompt.

Infrastructure failures (an engine error, a verifier crash or time-out) are retried `retries`
times, recorded with their causes, and then left unscored: never counted as the model's failure.
Multi-turn episodes with tools (`play_attempts`) go through the agent loop (`stages.agent.run_episodes`)
and come back as the same Attempt records, so evaluation's statistics do not care which it was.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import Budget, EpisodeJob, run_episodes
from snowcat.stages.rollout import EngineError, SamplingParams, serve_model_dir
from snowcat.stages.train.backend import local_device

Status = Literal["ok", "truncated", "infra_error"]


def serve_checkpoint(ctx, ref: str, key: str, max_batch: int):
    """(engine, tokenizer, model config) on checkpoint `ref` ("<stage>:<name>" or "hf:...") of a
    sampling stage, with the engine its config names (`engine`, `vllm`)."""
    cfg = ctx.config
    engine, tok, model_cfg = serve_model_dir(
        ctx.checkpoint(ref, key),
        cfg.engine,
        vllm=cfg.vllm,
        max_batch=max_batch,
        device=local_device(ctx.local_rank),
        seed=ctx.seed,
    )
    if tok is None:
        raise UserError(f"stages.{ctx.name}.{key}: {ref!r} has no tokenizer.json")
    return engine, tok, model_cfg


@dataclass
class Attempt:
    """One sampled answer to one task, verified (or not, when infrastructure failed)."""

    task: Any  # stages.taskgen.Task
    attempt: int
    token_ids: list[int] = field(default_factory=list)  # as sampled, end-of-turn id included
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    text: str = ""  # the answer as the verifier saw it
    reward: float = math.nan
    passed: int = -1  # 1 passed, 0 failed, -1 not scored (infra_error)
    status: Status = "infra_error"  # truncated: cut at max_tokens (still verified)
    infra_causes: list[str] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)  # the verifier's further scores (Verdict.scores)

    @property
    def scored(self) -> bool:
        return self.status != "infra_error"


def task_prompt(tok, task) -> list[int]:
    return tok.render_prompt(task.messages(with_answer=False))


def batch_seed(seed: int, batch_index: int) -> int:
    """Batch b draws from the same seed whatever the checkpoint: common random numbers make the
    paired comparison of two checkpoints sharper."""
    return int(np.random.SeedSequence([seed, batch_index]).generate_state(1)[0])


def sample_attempts(
    engine,
    tok,
    tasks: list,
    params: SamplingParams,
    *,
    attempts: int,
    seed: int,
    verifier: Callable,
    retries: int = 0,
    batch_size: int = 64,
    progress: Callable | None = None,
) -> list[Attempt]:
    """`attempts` answers per task, task-major; `progress(done, total[, pass_rate=])` after each batch."""

    stop = tok.end_of_turn_id
    requests = [Attempt(t, a) for t in tasks for a in range(attempts)]
    for b, start in enumerate(range(0, len(requests), batch_size)):
        batch = requests[start : start + batch_size]
        prompts = [task_prompt(tok, r.task) for r in batch]
        completions = None
        for _ in range(retries + 1):
            try:
                completions = engine.generate(prompts, params, seed=batch_seed(seed, b))
                break
            except EngineError as e:
                for r in batch:
                    r.infra_causes.append(f"engine: {e}")
        for r, c in zip(batch, completions or []):
            ids = c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids[-1:] == [stop] else c.token_ids
            r.token_ids, r.logprobs, r.finish_reason = list(c.token_ids), list(c.logprobs), c.finish_reason
            r.text = tok.decode(ids, skip_special_tokens=True)
            _verify(r, verifier, retries + 1 - len(r.infra_causes))
        _report(progress, requests, start + len(batch))
    return requests


def _report(progress: Callable | None, requests: list[Attempt], done: int) -> None:
    if progress is not None:
        rates = pass_rates(requests[:done])
        progress(done, len(requests), **({"pass_rate": rates["all"]} if "all" in rates else {}))


def _verify(r: Attempt, verifier: Callable, tries: int) -> None:
    for _ in range(tries):
        try:
            v = verifier(r.task, r.text)
        except Exception as e:  # noqa: BLE001 - a verifier crash or time-out is infrastructure, not a model failure
            r.infra_causes.append(f"verifier: {e}")
            continue
        r.reward, r.passed = float(v.reward), int(v.passed)
        r.scores = dict(getattr(v, "scores", {}))
        r.status = "truncated" if r.finish_reason == "length" else "ok"
        return


def play_attempts(
    engine,
    tok,
    tasks: list,
    env,
    params: SamplingParams,
    budget: Budget,
    *,
    attempts: int,
    seed: int,
    verifier: Callable,
    retries: int = 0,
    batch_size: int = 64,
    progress: Callable | None = None,
) -> tuple[list[Attempt], list]:
    """`attempts` multi-turn episodes per task in `env` (task-major Attempts, and the trajectories of
    their last tries). An episode that ends in infra_error is played again up to `retries` times;
    an invalid action is the model's failure (reward 0)."""
    requests = [Attempt(t, a) for t in tasks for a in range(attempts)]
    trajectories: list = [None] * len(requests)
    for start in range(0, len(requests), batch_size):
        index = list(range(start, min(start + batch_size, len(requests))))
        for _ in range(retries + 1):
            jobs = [EpisodeJob(requests[i].task, i // attempts, requests[i].attempt) for i in index]
            # the same seed per (task, attempt) whatever the checkpoint: common random numbers
            for i, traj in zip(index, run_episodes(engine, tok, jobs, env, params, budget, seed, 0, verifier)):
                r, trajectories[i] = requests[i], traj
                if traj.status == "infra_error":
                    r.infra_causes.append(traj.detail)
                    continue
                body = [int(x) for x in traj.token_ids[traj.prompt_len :]]
                r.token_ids, r.logprobs = body, [float(x) for x in traj.rollout_logprobs[traj.prompt_len :]]
                r.finish_reason, r.text = traj.status, tok.decode(body)
                r.reward, r.passed = float(traj.reward), int(traj.reward >= 1.0)
                r.status = "truncated" if traj.status == "truncated" else "ok"
            index = [i for i in index if not requests[i].scored]
            if not index:
                break
        _report(progress, requests, min(start + batch_size, len(requests)))
    return requests, trajectories


def pass_rates(attempts: list[Attempt]) -> dict[str, float]:
    """Pass rate over scored attempts: "all" and per domain (a domain with none scored is absent)."""
    per: dict[str, list[int]] = defaultdict(list)
    for r in attempts:
        if r.scored:
            per[r.task.domain].append(r.passed)
    out = {d: float(np.mean(v)) for d, v in sorted(per.items())}
    if per:
        out["all"] = float(np.mean([x for v in per.values() for x in v]))
    return out
