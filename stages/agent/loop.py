"""The agent loop: many episodes advanced together, one batched `generate` per turn, token-in-token-out.

Each episode's sequence grows only by appending: the model's sampled ids exactly as sampled (mask
1, their rollout logprobs), and environment observations encoded by the environment (mask 0).
Nothing earlier is ever re-rendered or re-tokenised, so the trainer scores the very ids the
logprobs belong to (decode -> encode of sampled BPE ids can give different ids).

Budgets: a turn that would pass `max_context` is cut there and the episode ends `truncated`; a turn
cut by `max_turn_tokens` is either `truncated` or, with `recover_long_turns`, closed with an
untrained <|end|> and a tool-result note, and the episode goes on. Running out of `max_turns`
without an answer is `truncated`.

Failures: an unparseable tool call is `invalid_action` (the model's fault, reward 0); an engine,
environment or verifier crash is `infra_error` (never the model's fault: the trainer drops them).

Context policies (stages/agent/context.py): an environment made `with_context(env, Summarise(...))`
has older turns replaced by a summary once an episode's context reaches a threshold. The episode
then continues in a new context, and its record holds the earlier contexts in `earlier`: each is
trained only on what was sampled in it. A summary that cannot be written is `infra_error`.

Determinism: turn t of episode (group_id, attempt) samples from a generator seeded by
`episode_seed(seed, group_id, attempt, t)`, independent of which other episodes share the batch.

Timing: each trajectory's `timing` holds the episode's wall seconds from the start of play to its
end (batch-mates' turns included: episodes advance together), the seconds of the batched `generate`
calls of the turns it was live in, and its own environment and verifier seconds. Volatile by name
(pipeline/volatile.py) and outside every hashed record: the trainer and the kept shards never see it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from snowcat.stages.agent import context as ctxmod
from snowcat.stages.agent.prompting import opening_messages
from snowcat.stages.agent.trajectory import BatchBuffers, Trajectory, TrajectoryBatch
from snowcat.stages.taskgen import verify

TRUNCATION_NOTE = "turn cut at {n} tokens; answer briefly"


@dataclass(frozen=True)
class Budget:
    max_context: int = 512  # prompt + every turn + every observation, in tokens
    max_turn_tokens: int = 64  # per model turn
    max_turns: int = 4  # model turns per episode
    recover_long_turns: bool = True  # a turn cut at max_turn_tokens is closed (untrained) instead of ending the episode

    def __post_init__(self) -> None:
        if min(self.max_context, self.max_turn_tokens, self.max_turns) < 1:
            raise ValueError(f"budget values must be >= 1: {self}")


@dataclass(frozen=True)
class EpisodeJob:
    task: Any  # stages.taskgen.Task
    group_id: int  # episodes of one task in one batch share a group (GRPO/RLOO baselines)
    attempt: int
    source: str = "policy"  # who plays it (trajectory.SOURCES): run_batch gives "teacher" jobs to its teacher engine


def episode_seed(seed: int, group_id: int, attempt: int, turn: int) -> int:
    words = [int(x) & 0xFFFFFFFFFFFFFFFF for x in (seed, group_id, attempt, turn)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> np.uint64(1))


@dataclass
class _Episode:
    job: EpisodeJob
    ids: list[int]
    prompt_len: int
    state: dict
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    support: list[list[int]] = field(default_factory=list)  # the engine's kept ids per token ([] where not sampled or not known)
    routes: np.ndarray | None = None  # the experts of ids[: len(routes)], from the latest turn's generation
    turns: list[tuple[int, int]] = field(default_factory=list)
    status: str | None = None  # None while live
    reward: float = 0.0
    detail: str = ""
    # context policies: the finished records of this episode (earlier contexts, summaries written by
    # the policy), the turns copied into the current context from the one before, the latest summary
    done: list[dict] = field(default_factory=list)
    carried: list[tuple[int, int]] = field(default_factory=list)
    summary: str = ""
    # seconds (see the module docstring): play's start, when it ended, generate calls, own tool time
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    generate_s: float = 0.0
    env_s: float = 0.0

    def __post_init__(self) -> None:
        self.mask = [0] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)
        self.support = [[] for _ in self.ids]

    def append(self, ids: list[int], logprobs: list[float] | None = None, support: list[list[int]] | None = None) -> None:
        """Model ids with their logprobs (trained) and kept supports, or context ids without (not trained)."""
        self.ids += ids
        self.mask += [int(logprobs is not None)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.support += list(support) if support is not None else [[] for _ in ids]

    def end(self, status: str, reward: float = 0.0, detail: str = "") -> None:
        self.status, self.reward, self.detail = status, float(reward), detail
        self.ended = time.perf_counter()

    @property
    def timing(self) -> dict[str, float]:
        return {"wall_s": (self.ended or time.perf_counter()) - self.started, "generate_s": self.generate_s, "env_s": self.env_s}

    @property
    def context_turns(self) -> list[tuple[int, int]]:
        """The model turns in the current context: carried ones, then those sampled in it."""
        return self.carried + self.turns

    def restart(self, ids: list[int], carried: list[tuple[int, int]]) -> None:
        """Close the current context (kept as a record) and continue in `ids`, all context."""
        self.done.append(_record(self.ids, self.mask, self.logprobs, self.support, self.routes, self.turns, self.prompt_len))
        self.ids, self.prompt_len, self.carried, self.routes, self.turns = list(ids), len(ids), carried, None, []
        self.__post_init__()


def run_episodes(
    engine,
    tokenizer,
    jobs: list[EpisodeJob],
    env,
    params,
    budget: Budget,
    seed: int,
    policy_version: int,
    verifier: Callable | None = None,
) -> list[Trajectory]:
    """Play every job to the end; one `Trajectory` per job, in job order.

    `params` are the sampling parameters (its `max_tokens` is replaced by the budget; the
    end-of-turn id is always a stop id). `verifier(task, text) -> Verdict` defaults to
    `stages.taskgen.verify`; raising is an infrastructure failure."""
    return [_trajectory(e, policy_version) for e in _play(engine, tokenizer, jobs, env, params, budget, seed, verifier)]


def run_batch(
    batch_index: int,
    engine,
    tokenizer,
    jobs: list[EpisodeJob],
    env,
    params,
    budget: Budget,
    seed: int,
    policy_version: int,
    verifier: Callable | None = None,
    buffers: BatchBuffers | None = None,
    teacher=None,
) -> TrajectoryBatch:
    """`run_episodes` as batch `batch_index` of the RL transport: every record's token lists are
    converted straight into the batch's columns (the one conversion `run_episodes` makes into each
    record's own arrays), so the batch goes out as it is, with no pass over the records to send it.
    `buffers`: memory of the rollout's earlier batches, used again once they are gone.
    `teacher`: the engine that plays the jobs whose source is "teacher" (same tokenizer, env,
    budget and verifier; after the policy's jobs, each engine batching its own); records in job order."""
    episodes = _play_by_source(engine, teacher, tokenizer, jobs, env, params, budget, seed, verifier)
    return TrajectoryBatch.write(batch_index, [r for e in episodes for r in _records(e, policy_version)], buffers)


def _play_by_source(engine, teacher, tokenizer, jobs: list[EpisodeJob], env, params, budget: Budget, seed: int, verifier):
    """Every job's episode in job order, the policy's jobs played by `engine`, the teacher's by `teacher`."""
    theirs = [i for i, j in enumerate(jobs) if j.source == "teacher"]
    if not theirs:
        return _play(engine, tokenizer, jobs, env, params, budget, seed, verifier)
    if teacher is None:
        raise ValueError(f"{len(theirs)} teacher jobs and no teacher engine")
    ours = [i for i, j in enumerate(jobs) if j.source != "teacher"]
    out: list = [None] * len(jobs)
    for player, picked in ((engine, ours), (teacher, theirs)):
        for i, e in zip(picked, _play(player, tokenizer, [jobs[i] for i in picked], env, params, budget, seed, verifier)):
            out[i] = e
    return out


def _play(engine, tokenizer, jobs: list[EpisodeJob], env, params, budget: Budget, seed: int, verifier) -> list[_Episode]:
    """Every job's episode, played to the end (`run_episodes`)."""
    verifier = verifier or verify
    lock = threading.Lock()

    def locked(task, text):  # a verifier (e.g. one worker process) serves one call at a time
        with lock:
            return verifier(task, text)

    stop_ids = tuple(dict.fromkeys((*params.stop_ids, tokenizer.end_of_turn_id)))
    policy = getattr(env, "context_policy", None)  # stages/agent/context.py; None: keep everything
    episodes = []
    start = time.perf_counter()
    try:
        for job in jobs:
            prompt = env.prompt(job.task)
            episodes.append(e := _Episode(job, list(prompt), len(prompt), {}, started=start))
            t0 = time.perf_counter()
            try:
                e.state = env.reset(job.task)
            except Exception as exc:  # e.g. a sandbox that cannot be made: infrastructure
                e.end("infra_error", detail=f"environment reset: {exc!r}")
            e.env_s += time.perf_counter() - t0
        for turn in range(budget.max_turns):
            for e in episodes:
                if policy is not None and e.status is None and policy.due(len(e.ids), len(e.context_turns)):
                    policy_params = dataclasses.replace(params, stop_ids=stop_ids)
                    _summarise(e, turn, policy, env, engine, tokenizer, policy_params, budget.max_context, seed)
            for e in episodes:
                if e.status is None and len(e.ids) >= budget.max_context:
                    e.end("truncated", detail="context budget")
            live = [e for e in episodes if e.status is None]
            if not live:
                break
            room = max(budget.max_context - len(e.ids) for e in live)
            turn_params = dataclasses.replace(params, max_tokens=min(budget.max_turn_tokens, room), stop_ids=stop_ids)
            seeds = [episode_seed(seed, e.job.group_id, e.job.attempt, turn) for e in live]
            t0 = time.perf_counter()
            try:
                completions = engine.generate_seeded([e.ids for e in live], turn_params, seeds)
            except Exception as exc:  # any engine failure is infrastructure
                for e in live:
                    e.end("infra_error", detail=f"engine: {exc}")
                break
            finally:
                for e in live:
                    e.generate_s += time.perf_counter() - t0
            advance = functools.partial(_advance, turn=turn, env=env, tok=tokenizer, budget=budget, verifier=locked)
            workers = min(len(live), len(os.sched_getaffinity(0))) if env.parallel else 1
            if workers > 1:  # a parallel env's tool calls (sandboxed processes) of different episodes at once
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    list(pool.map(advance, live, completions))
            else:  # in this thread: a verifier may rely on being in the main thread (signals)
                list(map(advance, live, completions))
    finally:
        for e in episodes:
            env.finish(e.state)
    for e in episodes:
        if e.status is None:
            e.end("truncated", detail=f"no answer in {budget.max_turns} turns")
    return episodes


def _advance(e: _Episode, c, turn: int, env, tok, budget: Budget, verifier) -> None:
    t0 = time.perf_counter()
    try:
        _take_turn(e, c, turn, env, tok, budget, verifier)
    finally:
        e.env_s += time.perf_counter() - t0


def _take_turn(e: _Episode, c, turn: int, env, tok, budget: Budget, verifier) -> None:
    room = budget.max_context - len(e.ids)
    ids, logprobs = list(c.token_ids[:room]), list(c.logprobs[:room])
    start = len(e.ids)
    e.append(ids, logprobs, c.support[:room] if c.support is not None else None)
    if c.routes is not None:  # this turn's generation routed the whole prefix again: the latest is kept
        e.routes = c.routes[: len(e.ids)]
    e.turns.append((start, len(e.ids)))
    stopped = c.finish_reason == "stop" and len(ids) == len(c.token_ids)
    if not stopped:
        if len(e.ids) >= budget.max_context:
            return e.end("truncated", detail="context budget")
        if not budget.recover_long_turns or turn + 1 >= budget.max_turns:
            return e.end("truncated", detail="turn budget")
        # close the cut turn with an end-of-turn the model did not sample (not trained), then a note
        recovery = [tok.end_of_turn_id] + env.note(TRUNCATION_NOTE.format(n=len(ids)))
        if len(e.ids) + len(recovery) >= budget.max_context:
            return e.end("truncated", detail="context budget")
        return e.append(recovery)
    try:
        step = env.step(e.job.task, e.state, ids)
    except Exception as exc:  # an environment bug is infrastructure
        return e.end("infra_error", detail=f"environment: {exc!r}")
    if step.status == "invalid_action":
        return e.end("invalid_action", detail="unparseable tool call")
    if not step.done:
        if len(e.ids) + len(step.observation) >= budget.max_context:
            return e.end("truncated", detail="context budget")
        return e.append(list(step.observation))
    if step.reward is not None:
        return e.end("ok", step.reward, detail=step.detail or "reward set by the environment")
    try:
        verdict = verifier(e.job.task, step.answer)
    except Exception as exc:  # VerifierError, time-out, crash: infrastructure
        return e.end("infra_error", detail=f"verifier: {exc}")
    e.end("ok", verdict.reward, detail=verdict.detail)


def _summarise(e: _Episode, turn: int, policy, env, engine, tok, params, max_context: int, seed: int) -> None:
    """Replace the older turns of `e`'s context by a summary (stages/agent/context.py): the current
    context is closed as a record, and the episode continues in the opening, the summary message and
    the latest `keep_turns` turns copied id for id. A summary that cannot be written ends it infra."""
    opening = opening_messages(env, e.job.task)
    turns = e.context_turns
    kept = turns[len(turns) - policy.keep_turns :] if policy.keep_turns else []
    tail = kept[0][0] if kept else len(e.ids)
    w_engine, w_tok, w_params, room = ctxmod.writer(policy, engine, tok, params, max_context)
    try:
        entries = ctxmod.transcript(tok, e.ids, turns[: len(turns) - len(kept)], tail)
        request = ctxmod.summary_request(w_tok, opening, e.summary, entries, room, policy.request)
        seed_k = ctxmod.summary_seed(seed, e.job.group_id, e.job.attempt, turn)
        c = ctxmod.write_summary(w_engine, w_params, request, seed_k, policy.timeout_s)
    except ctxmod.SummaryError as exc:
        return e.end("infra_error", detail=f"{ctxmod.FAILURE_PREFIX}{exc}")
    text = ctxmod.summary_text(w_tok, c.token_ids)
    start = ctxmod.context_after(tok, opening, text)
    carried_ids = e.ids[tail:]
    e.restart(start + carried_ids, [(s - tail + len(start), t - tail + len(start)) for s, t in kept])
    e.summary = text
    if policy.helper is None:  # the policy wrote it: a record of its own, trained in the request's context
        ids = list(request) + list(c.token_ids)
        n = len(c.token_ids)
        support = [[] for _ in request] + (list(c.support) if c.support is not None else [[] for _ in range(n)])
        routes = c.routes[: len(ids)] if c.routes is not None else None
        mask, logprobs = [0] * len(request) + [1] * n, [0.0] * len(request) + list(c.logprobs)
        e.done.append(_record(ids, mask, logprobs, support, routes, [(len(request), len(ids))], len(request), "summary"))


def _record(ids, mask, logprobs, support, routes, turns, prompt_len, kind: str = "context") -> dict:
    """A finished stretch of an episode as the fields of its record, the per-token ones as lists: a
    Trajectory converts them into arrays of its own, a TrajectoryBatch into its columns."""
    return {
        "token_ids": ids,
        "loss_mask": mask,
        "rollout_logprobs": logprobs,
        "support_lengths": [len(k) for k in support],
        "support_ids": [i for k in support for i in k],
        "routes": _routes(routes, len(ids)),
        "turn_boundaries": list(turns),
        "prompt_len": int(prompt_len),
        "segment_kind": kind,
    }


def _routes(routes: np.ndarray | None, n: int) -> np.ndarray | None:
    if routes is None:
        return None
    out = np.full((n, routes.shape[1]), -1, np.int16)  # -1: not fed to the engine (routes itself)
    out[: len(routes)] = routes
    return out


def _records(e: _Episode, policy_version: int) -> list[dict]:
    """The fields of the episode's records, oldest first: those of its earlier contexts, then its
    current one; every record carries the episode's status, reward and detail."""
    common = dict(
        task_id=e.job.task.task_id,
        group_id=int(e.job.group_id),
        attempt=int(e.job.attempt),
        policy_version=int(policy_version),
        reward=e.reward,
        status=e.status,
        domain=e.job.task.domain,
        detail=e.detail,
        source=e.job.source,
    )
    last = _record(e.ids, e.mask, e.logprobs, e.support, e.routes, e.turns, e.prompt_len)
    return [{**common, **rec, "segment": i} for i, rec in enumerate([*e.done, last])]


def _trajectory(e: _Episode, policy_version: int) -> Trajectory:
    """The episode's record (its current context), holding the records of its earlier contexts."""
    *earlier, last = _records(e, policy_version)
    return Trajectory(**last, earlier=tuple(Trajectory(**r) for r in earlier), timing=e.timing)
