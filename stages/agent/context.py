"""Context policies of the agent loop (docs/agents.md, "Context policies"): what an episode's context
holds once it grows long.

By default an episode keeps everything it was shown and the budget ends it at `max_context`.
`Summarise` (the ablation seed's harness: it summarises its transcript to stay within context)
rewrites the context instead: before a model turn, an episode whose context holds at least
`at_tokens` ids and more than `keep_turns` turns starts a new context made of

    the opening (as the environment renders it, a rollout prompt included)
    a user message: "Summary of the earlier turns ...", then the summary
    the latest `keep_turns` turns and what followed them, copied id for id

The summary is written by the policy itself (its engine, tokenizer and sampling parameters) or by a
helper model (`Helper`), from a request that holds the opening and, as text, the previous summary
and the turns it replaces (the oldest left out first when the request would not fit).

What is trained on is exactly what was sampled: an episode becomes several records (the
`Trajectory.earlier` chain): each context with the turns sampled in it (carried turns are context
there, mask 0), and, when the policy wrote the summary, the request with the summary as its one
sampled turn (`segment_kind` "summary"). A token is trained once, in the context it was drawn in.

A summary that cannot be written -- the engine raised, the call took longer than `timeout_s`, no
request fits -- ends the episode `infra_error` with detail "summary: ...": never the model's failure
(evaluate leaves it out of every denominator and counts it per checkpoint). A short or useless
summary written by the policy is the policy's own doing, and is kept.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from snowcat.stages.agent.envs import _strip_stop
from snowcat.stages.config import SUMMARY_REQUEST

SUMMARY_MESSAGE = "Summary of the earlier turns of this task:\n{summary}"
PREVIOUS = "[summary of the turns before]\n{summary}"
OMITTED = "[older turns left out]"
FAILURE_PREFIX = "summary: "  # the detail (and evaluate's infra cause) of a failed summary


class SummaryError(RuntimeError):
    """A summary could not be written: an infrastructure failure, not the model's."""


@dataclass(frozen=True)
class Helper:
    """A model other than the policy that writes the summaries."""

    engine: Any  # stages.rollout engine
    tokenizer: Any
    params: Any  # its SamplingParams (max_tokens and the stop id are set per call)
    max_context: int  # positions a request and its summary must fit in
    name: str = "helper"


@dataclass(frozen=True)
class Summarise:
    at_tokens: int  # summarise before a turn once the context holds this many ids...
    keep_turns: int = 1  # ...and more turns than this; the latest keep_turns turns stay verbatim
    max_tokens: int = 128  # of a summary
    timeout_s: float = 120.0  # a summary call that takes longer is a failure (infra)
    helper: Helper | None = None  # None: the policy writes the summaries
    request: str = SUMMARY_REQUEST

    def __post_init__(self) -> None:
        if self.at_tokens < 1 or self.keep_turns < 0 or self.max_tokens < 1 or not self.timeout_s > 0:
            raise ValueError(f"summarise: at_tokens, max_tokens >= 1, keep_turns >= 0, timeout_s > 0: {self}")

    def due(self, tokens: int, turns: int) -> bool:
        return tokens >= self.at_tokens and turns > self.keep_turns


class ContextEnv:
    """`env` with a context policy the agent loop applies (`context_policy`); everything else is `env`'s."""

    def __init__(self, env, policy):
        self.env, self.context_policy = env, policy

    def __getattr__(self, name):
        return getattr(self.env, name)


def with_context(env, policy):
    """`env` under context policy `policy` (None: keep everything, `env` itself)."""
    return env if policy is None else ContextEnv(env, policy)


def summary_seed(seed: int, group_id: int, attempt: int, turn: int) -> int:
    """The seed of the summary written before turn `turn` of an episode (its own stream: a turn's
    sampling does not depend on whether a summary was written before it)."""
    words = [int(x) & 0xFFFFFFFFFFFFFFFF for x in (seed, group_id, attempt, turn, 0x5E55)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> np.uint64(1))


def transcript(tok, ids: list[int], turns: list[tuple[int, int]], end: int) -> list[str]:
    """The turns `turns` of a context, and what followed each up to the next one (or `end`), as text
    entries for a summary request."""
    out = []
    for k, (s, e) in enumerate(turns):
        out.append("[assistant]\n" + tok.decode(ids[s:e], skip_special_tokens=True).strip())
        after = tok.decode(ids[e : turns[k + 1][0] if k + 1 < len(turns) else end], skip_special_tokens=True).strip()
        if after:
            out.append("[result]\n" + after)
    return out


def summary_request(tok, opening: list[dict], previous: str, entries: list[str], limit: int, request: str) -> list[int]:
    """The request's ids (the opening, then one user message: the instruction, the previous summary,
    the entries), at most `limit` long; the oldest entries are left out until it fits."""
    for drop in range(len(entries) + 1):
        parts = [request] + ([PREVIOUS.format(summary=previous)] if previous else [])
        parts += ([OMITTED] if drop else []) + entries[drop:]
        ids = tok.render_prompt([*opening, {"role": "user", "content": "\n\n".join(parts)}])
        if len(ids) <= limit:
            return ids
    raise SummaryError(f"the request does not fit in {limit} tokens even without the turns it summarises")


def write_summary(engine, params, request: list[int], seed: int, timeout_s: float):
    """One completion of `request` (SummaryError when the engine raises or the call takes longer than
    `timeout_s`: the summary is then not used)."""
    t0 = time.perf_counter()
    try:
        c = engine.generate_seeded([request], params, [seed])[0]
    except Exception as exc:  # noqa: BLE001 - any engine failure is infrastructure
        raise SummaryError(f"engine: {exc}") from exc
    took = time.perf_counter() - t0
    if took > timeout_s:
        raise SummaryError(f"took {took:.3g} s, over timeout_s {timeout_s:g}")
    return c


def summary_text(tok, ids: list[int]) -> str:
    return tok.decode(_strip_stop(tok, ids), skip_special_tokens=True).strip()


def context_after(tok, opening: list[dict], summary: str) -> list[int]:
    """The new context's first ids: the opening and the summary message, then the assistant header
    (the kept turns follow id for id)."""
    return tok.render_prompt([*opening, {"role": "user", "content": SUMMARY_MESSAGE.format(summary=summary)}])


def writer(policy: Summarise, engine, tok, params, max_context: int) -> tuple[Any, Any, Any, int]:
    """(engine, tokenizer, sampling parameters, room for the request) of whoever writes the summaries."""
    if policy.helper is None:
        h_engine, h_tok, h_params, limit = engine, tok, params, max_context
    else:
        h = policy.helper
        h_engine, h_tok, h_params, limit = h.engine, h.tokenizer, h.params, h.max_context
    stops = tuple(dict.fromkeys((*h_params.stop_ids, h_tok.end_of_turn_id)))
    return h_engine, h_tok, dataclasses.replace(h_params, max_tokens=policy.max_tokens, stop_ids=stops), limit - policy.max_tokens


def is_failure(detail: str) -> bool:
    return detail.startswith(FAILURE_PREFIX)


def context_behaviour(trajectories) -> dict:
    """What the policy did to the episodes that were scored: summaries per episode, the share of
    episodes summarised at least once, and model turns per episode over all its contexts (an
    episode's last record alone holds only the turns sampled after its last summary)."""
    done = [t for t in trajectories if t is not None and t.status != "infra_error"]
    counts = [sum(r.segment_kind == "context" for r in t.earlier) for t in done]
    turns = [sum(len(r.turn_boundaries) for r in (*t.earlier, t) if r.segment_kind == "context") for t in done]

    def mean(xs) -> float:
        return float(np.mean(xs)) if xs else float("nan")

    return {
        "summaries_per_episode": mean(counts),
        "summarised_frac": mean([c > 0 for c in counts]),
        "turns_per_episode": mean(turns),
    }
