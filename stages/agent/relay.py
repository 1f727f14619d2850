"""Relay: a student starts each episode, a teacher takes over at the first take-over point and plays
it to the end (the seed's Relay SFT; docs/recipes.md, "Relay SFT with a real student").

`RelayEngine` is the engine the agent loop samples from for one batch of episodes: per episode it
asks the student for each turn until a take-over point, then the teacher, so the teacher continues
the same environment state and the same transcript (token for token: both share the loop's
tokenizer, or the teacher reads it as text, `TextTeacher`). The loop, environment, budget and
verification are the ones every episode has. The take-over points (`TAKEOVER_POINTS`):

- `invalid_action`: a student turn the environment cannot parse as an action (`env.turn_kind`), or
  one cut by the turn budget (no whole action). Where the environment answers it (RepoEnv: an
  error message, the episode goes on, as in deployment) the turn and that answer stay in the
  transcript and the teacher plays the next turn, fixing it; where it would end the episode
  (calculator) the turn is not played and the teacher plays that turn instead.
- `context_margin`: before a student turn, the context holds `max_context - margin` tokens or more;
  the teacher plays that turn and the rest.
- `completion_claim`: the student answers or submits; the claim is not acted on (no verdict is
  asked for it) and the teacher plays that turn instead: it may check the work first, or fix it.

A student turn that reaches none of them is played as the student sampled it. An episode the
teacher never played in (the student finished alone, or an invalid action it made on the last
turn) has no take-over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from snowcat.stages.agent.demos import transcript_messages
from snowcat.stages.agent.envs import ANSWER, INVALID, _strip_stop
from snowcat.stages.agent.loop import Budget, EpisodeJob, episode_seed
from snowcat.stages.config import TAKEOVER_POINTS

POINT_OF_KIND = {INVALID: "invalid_action", ANSWER: "completion_claim"}


@dataclass(frozen=True)
class Takeover:
    point: str  # one of TAKEOVER_POINTS
    turn: int  # the teacher's first turn: the student's turns before it are the demonstration's context


class RelayEngine:
    """`generate_seeded` for `run_episodes` over `jobs`: each episode's turns come from `student`
    until its first take-over point among `points`, then from `teacher` (an engine sharing the
    loop's tokenizer, or a `TextTeacher`).

    The loop seeds turn t of episode (group, attempt) with `episode_seed(seed, group, attempt, t)`;
    that seed is how a request is placed (episode, turn), whatever else shares the call."""

    def __init__(
        self,
        student,
        teacher,
        *,
        env,
        jobs: Sequence[EpisodeJob],
        seed: int,
        budget: Budget,
        points: Sequence[str],
        margin: int,
    ):
        unknown = set(points) - set(TAKEOVER_POINTS)
        if unknown:
            raise ValueError(f"unknown take-over points {sorted(unknown)}; expected some of {TAKEOVER_POINTS}")
        self.student, self.teacher, self.env, self.budget = student, teacher, env, budget
        self.points, self.margin = frozenset(points), margin
        self.tasks = [j.task for j in jobs]
        self.place = {
            episode_seed(seed, j.group_id, j.attempt, t): (k, t) for k, j in enumerate(jobs) for t in range(budget.max_turns)
        }
        if len(self.place) != len(jobs) * budget.max_turns:
            raise ValueError("two episodes share a group and attempt: their turns cannot be told apart")
        self.handed: list[Takeover | None] = [None] * len(jobs)
        self.teacher_turns = [0] * len(jobs)
        self.turns: list[list[tuple[int, int]]] = [[] for _ in jobs]  # each episode's turns so far, in its ids

    def takeovers(self) -> list[Takeover | None]:
        """Per job, where the teacher took over; None where it never played a turn."""
        return [h if n else None for h, n in zip(self.handed, self.teacher_turns)]

    def generate_seeded(self, prompts, params, seeds) -> list:
        placed = [self.place[int(s)] for s in seeds]
        for (k, t), prompt in zip(placed, prompts):
            room = self.budget.max_context - len(prompt)
            if self.handed[k] is None and "context_margin" in self.points and room <= self.margin:
                self.handed[k] = Takeover("context_margin", t)
        out: list = [None] * len(prompts)
        students = [i for i, (k, _) in enumerate(placed) if self.handed[k] is None]
        for i, c in zip(students, _generate(self.student, prompts, params, seeds, students)):
            k, t = placed[i]
            point = self._point(self.tasks[k], c)
            if point is None:
                out[i] = c
            elif point == "invalid_action" and c.finish_reason == "stop" and self.env.answers_invalid_actions:
                out[i] = c  # the environment answers it; the teacher fixes it next turn
                self.handed[k] = Takeover(point, t + 1)
            else:  # not played: the teacher plays this turn instead
                self.handed[k] = Takeover(point, t)
        teachers = [i for i in range(len(prompts)) if out[i] is None]
        if isinstance(self.teacher, TextTeacher):
            transcripts = [(self.tasks[placed[i][0]], prompts[i], self.turns[placed[i][0]]) for i in teachers]
            done = self.teacher.generate_seeded(transcripts, params, [seeds[i] for i in teachers])
        else:
            done = _generate(self.teacher, prompts, params, seeds, teachers)
        for i, c in zip(teachers, done):
            out[i] = c
            self.teacher_turns[placed[i][0]] += 1
        for (k, _), prompt, c in zip(placed, prompts, out):
            self.turns[k].append((len(prompt), len(prompt) + len(c.token_ids)))
        return out

    def _point(self, task, c) -> str | None:
        """The take-over point a student completion reaches, if it is one of ours."""
        kind = self.env.turn_kind(task, c.token_ids) if c.finish_reason == "stop" else INVALID  # cut: no whole action
        point = POINT_OF_KIND.get(kind)
        return point if point in self.points else None


def _generate(engine, prompts, params, seeds, which: list[int]) -> list:
    if not which:
        return []
    return engine.generate_seeded([prompts[i] for i in which], params, [seeds[i] for i in which])


def relay_messages(messages: list[dict], student_turns: int) -> list[dict]:
    """An episode's chat messages with its first `student_turns` assistant turns (the student's)
    kept as context: `train: False`, so SFT masks their tokens and trains on the teacher's."""
    out, seen = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if seen < student_turns:
                m = {**m, "train": False}
            seen += 1
        out.append(m)
    return out


class TextTeacher:
    """A teacher with another tokenizer than the student's: it reads the episode as chat messages
    (the opening, each turn's text, each observation as the environment wrote it) rendered by its
    own chat template, and its turn comes back as text encoded by the student's tokenizer (what the
    loop's environment parses and the demonstration keeps). Nothing claims token identity across
    the two tokenizers; the turn's logprobs are not the teacher's (zeros: SFT does not read them)."""

    def __init__(self, engine, tok, *, student_tok, observations, env):
        self.engine, self.tok = engine, tok
        self.student_tok, self.observations, self.env = student_tok, observations, env

    def generate_seeded(self, transcripts, params, seeds) -> list:
        """One turn per (task, ids, turns) transcript in the student's ids."""
        if not transcripts:
            return []
        prompts = [
            self.tok.render_prompt(transcript_messages(task, ids, turns, self.env, self.student_tok, self.observations))
            for task, ids, turns in transcripts
        ]
        own = dataclasses.replace(params, stop_ids=(self.tok.end_of_turn_id,))
        out = []
        for c in self.engine.generate_seeded(prompts, own, seeds):
            text = self.tok.decode(_strip_stop(self.tok, c.token_ids))
            ids = self.student_tok.encode(text) + ([self.student_tok.end_of_turn_id] if c.finish_reason == "stop" else [])
            out.append(dataclasses.replace(c, token_ids=ids, logprobs=[0.0] * len(ids), support=None, routes=None))
        return out
