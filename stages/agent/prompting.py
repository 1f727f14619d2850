"""Prompted rollouts, unprompted updates (docs/recipes.md): an instruction in the context the policy
samples in, removed token-exactly from the context its update is computed on.

`PromptedEnv` wraps an environment so that each episode opens with a system message holding the
prompt (after a template declaration, before the task). `prompt_span` finds, for one task, where
the prompt's tokens sit in that opening: the prompted opening must be the unprompted one with one
contiguous run of ids inserted, else the prompt cannot be removed exactly (a chat template that
rewrites the rest of the conversation around a system message) and `PromptError` says so.
`strip_prompt` removes that run from a trajectory: every later id, mask entry, logprob, kept
support, route and turn boundary moves left by its length, nothing else changes, and the ids it
removes must be the prompt's (checked, never assumed).

The prompt may be chosen by a prompt-selection stage (stages/prompts.py): `rl.rollout_prompt:
"prompts:<stage>"` names it, and `resolve_rollout_prompt` reads that stage's choice.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from snowcat.pipeline.errors import UserError
from snowcat.stages.agent.trajectory import Trajectory
from snowcat.stages.config import prompt_stage
from snowcat.stages.tokenizer import TEMPLATE_ROLE

CHOICE = "prompts.json"  # a prompt-selection stage's report; its "chosen" entry holds the prompt


class PromptError(ValueError):
    """The prompt cannot be removed token-exactly from this opening or trajectory."""


def with_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """`messages` with a system message holding `prompt` first (after a template declaration)."""
    head = 1 if messages and messages[0].get("role") == TEMPLATE_ROLE else 0
    return [*messages[:head], {"role": "system", "content": prompt}, *messages[head:]]


def opening_messages(env, task) -> list[dict]:
    """The messages an environment's prompt renders (RepoEnv: its template declaration and problem)."""
    opening = getattr(env, "opening", None)
    return opening(task) if opening is not None else task.messages(with_answer=False)


class PromptedEnv:
    """`env` with `prompt` in every episode's opening; everything else is `env`'s own."""

    def __init__(self, env, prompt: str):
        if prompt_stage(prompt) is not None:  # "prompts:<stage>" is a name, not the text to sample with
            raise PromptError(
                f"rollout prompt {prompt!r} names a prompt-selection stage: resolve_rollout_prompt reads its choice"
            )
        self.env, self.rollout_prompt = env, prompt

    def __getattr__(self, name):
        return getattr(self.env, name)

    def opening(self, task) -> list[dict]:
        return with_prompt(opening_messages(self.env, task), self.rollout_prompt)

    def prompt(self, task) -> list[int]:
        return self.env.tok.render_prompt(self.opening(task))


def prompt_span(env, task, prompt: str) -> tuple[int, list[int]]:
    """(where the prompt's ids start, the ids) in the prompted opening of `task` under `env`: the
    prompted opening is the unprompted one with exactly these ids inserted there."""
    plain = list(env.prompt(task))
    prompted = list(PromptedEnv(env, prompt).prompt(task))
    n = len(prompted) - len(plain)
    common = 0
    while common < len(plain) and plain[common] == prompted[common]:
        common += 1
    # the insertion starts at the first difference, or earlier where the run begins as the rest does
    start = next((s for s in range(common, -1, -1) if n > 0 and prompted[:s] + prompted[s + n :] == plain), None)
    if start is None:
        raise PromptError(
            f"task {task.task_id}: with the prompt, the chat template renders the opening as more than one run of ids "
            "inserted into the opening without it, so the prompt cannot be removed token-exactly"
        )
    return start, prompted[start : start + n]


def strip_prompt(t: Trajectory, start: int, prompt_ids: list[int]) -> Trajectory:
    """`t` with the prompt's ids (at `start`) removed: the update's context. Refused (PromptError)
    unless those ids are there, in the opening, and untrained."""
    n, end = len(prompt_ids), start + len(prompt_ids)
    if end > t.prompt_len or not np.array_equal(t.token_ids[start:end], np.asarray(prompt_ids, np.int32)):
        raise PromptError(
            f"trajectory {t.task_id}/{t.attempt}: the rollout prompt's ids are not at {start}..{end} of its opening"
        )
    if t.loss_mask[start:end].any():
        raise PromptError(f"trajectory {t.task_id}/{t.attempt}: trained ids inside the rollout prompt")

    def cut(a):
        return None if a is None else np.concatenate([a[:start], a[end:]])

    lengths = t.support_lengths.astype(np.int64)
    first = int(lengths[:start].sum())
    return Trajectory(
        task_id=t.task_id,
        group_id=t.group_id,
        attempt=t.attempt,
        policy_version=t.policy_version,
        token_ids=cut(t.token_ids),
        loss_mask=cut(t.loss_mask),
        rollout_logprobs=cut(t.rollout_logprobs),
        reward=t.reward,
        status=t.status,
        turn_boundaries=[(s - n, e - n) for s, e in t.turn_boundaries],
        domain=t.domain,
        prompt_len=t.prompt_len - n,
        detail=t.detail,
        support_lengths=cut(t.support_lengths),
        support_ids=np.concatenate([t.support_ids[:first], t.support_ids[first + int(lengths[start:end].sum()) :]]),
        routes=cut(t.routes),
        segment=t.segment,
        segment_kind=t.segment_kind,
        earlier=tuple(strip_prompt(r, start, prompt_ids) for r in t.earlier),  # each context opens with the prompt
    )


class PromptStripper:
    """Per task (memoised): where the prompt sits, for stripping the trajectories of a batch."""

    def __init__(self, env, prompt: str, tasks: dict):
        self.env, self.prompt, self.tasks = env, prompt, tasks
        self.spans: dict[str, tuple[int, list[int]]] = {}

    def span(self, task_id: str) -> tuple[int, list[int]]:
        if task_id not in self.spans:
            self.spans[task_id] = prompt_span(self.env, self.tasks[task_id], self.prompt)
        return self.spans[task_id]

    def __call__(self, trajs: list[Trajectory]) -> list[Trajectory]:
        return [strip_prompt(t, *self.span(t.task_id)) for t in trajs]


def chosen_prompt(stage_dir: Path) -> str:
    """The prompt a finished prompt-selection stage chose ("" when it chose no prompt)."""
    return json.loads((Path(stage_dir) / CHOICE).read_text())["chosen"]["prompt"]


def resolve_rollout_prompt(value: str, inputs, key: str) -> str:
    """A `rollout_prompt` value as the text to sample with: itself, or, for "prompts:<stage>", the
    prompt that needed prompt-selection stage chose (UserError naming `key` when it cannot be read)."""
    stage = prompt_stage(value)
    if stage is None:
        return value
    if stage not in inputs:
        raise UserError(f"{key}: {value!r} names stage {stage!r}, which is not in needs")
    try:
        return chosen_prompt(inputs[stage])
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{key}: {value!r}: no choice in {Path(inputs[stage]) / CHOICE} ({e})") from None
