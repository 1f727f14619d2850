"""Batch k's episodes: `tasks_per_update` tasks x `attempts` (+ `teacher_rollouts` played by the
teacher), by `stages.agent.run_batch` straight into the columns of the batch the transport sends.
Under a context policy (`rl.context`: summarise) an episode may be several records, sent in order."""

from __future__ import annotations

import dataclasses

import torch

from snowcat.stages.agent import BatchBuffers, Budget, EpisodeJob, TrajectoryBatch, make_env, run_batch
from snowcat.stages.agent.context import with_context
from snowcat.stages.agent.prompting import PromptedEnv
from snowcat.stages.config import env_options
from snowcat.stages.verifiers import load_verifier


def reward_verifier(spec: str, reward: str):
    """The verifier, with its reward replaced by 1/0 for pass/fail when reward == "pass" (partial
    credit can be earned by answers that never pass, e.g. a correct prefix of closers)."""
    verify = load_verifier(spec, "rl.verifier")
    if reward == "score":
        return verify

    def passed(task, text):
        v = verify(task, text)
        return dataclasses.replace(v, reward=float(v.passed))

    return passed


def batch_jobs(tasks, attempts: int, teacher_rollouts: int) -> list[EpisodeJob]:
    """Each task's group: `attempts` policy episodes, then `teacher_rollouts` teacher episodes. group_id =
    the task's position in the batch; the teacher's attempts are numbered on after the policy's, so
    their seeds (`episode_seed(seed, group, attempt, turn)`) never collide with the policy's."""
    return [
        EpisodeJob(task, group_id=g, attempt=a, source="policy" if a < attempts else "teacher")
        for g, task in enumerate(tasks)
        for a in range(attempts + teacher_rollouts)
    ]


def generate_batch(
    engine,
    tok,
    tasks,
    cfg,
    params,
    seed: int,
    policy_version: int,
    batch_index: int,
    buffers: BatchBuffers | None = None,
    teacher=None,
    context=None,
) -> TrajectoryBatch:
    """Batch k's episodes; `context`: the context policy (`stages.agent.summariser.context_policy`,
    served once per rollout rank), None to keep everything."""
    env = make_env(cfg.env, tok, **env_options(cfg.env, cfg))
    if cfg.rollout_prompt:  # in the context sampled in; the trainer removes it from the update's (docs/recipes.md)
        env = PromptedEnv(env, cfg.rollout_prompt)
    env = with_context(env, context)
    budget = Budget(max_context=cfg.max_total_tokens, max_turn_tokens=cfg.max_tokens, max_turns=cfg.max_turns)
    jobs = batch_jobs(tasks, cfg.attempts, cfg.teacher_rollouts if teacher is not None else 0)
    with torch.no_grad():  # sampling needs no graph (and a kept graph grows memory every batch)
        verifier = reward_verifier(cfg.verifier, cfg.reward)
        return run_batch(batch_index, engine, tok, jobs, env, params, budget, seed, policy_version, verifier, buffers, teacher)
