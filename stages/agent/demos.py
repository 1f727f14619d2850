"""Demonstrations made by sampling a teacher (the `teacher` stage writes them, SFT reads them):
an episode read back as chat messages, their content id, and a teacher stage's `demos.jsonl` files.
Library code shared by those two stage kinds (stage kinds do not import each other)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from snowcat.stages.agent.envs import _strip_stop
from snowcat.stages.agent.prompting import opening_messages

DEMOS = "demos.jsonl"


def domains_in_turn(tasks: list, n: int) -> list:
    """`n` tasks taken from the domains in turn (as the probe stage takes them), so that a limit
    reaches every domain rather than only the first."""
    by_domain: dict[str, list] = {}
    for t in tasks:
        by_domain.setdefault(t.domain, []).append(t)
    lists = list(by_domain.values())
    out = [lst[i] for i in range(max((len(x) for x in lists), default=0)) for lst in lists if i < len(lst)]
    return out[:n]


class ObservationLog:
    """The tokenizer an environment is given, remembering what each observation's ids hold: the ids
    between two model turns are read back as the (role, content) the environment rendered."""

    def __init__(self, tok):
        self._tok = tok
        self.seen: dict[tuple[int, ...], dict] = {}

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def observation_ids(self, role: str, content: str, template: dict | None = None) -> list[int]:
        ids = self._tok.observation_ids(role, content, template=template)
        self.seen[tuple(ids)] = {"role": role, "content": content}
        return ids


def demo_messages(t, task, env, tok, observations: ObservationLog) -> list[dict] | None:
    """The episode as chat messages, or None when a stretch between two turns is not one observation
    the environment rendered (a turn cut by the budget, closed by the loop and followed by a note)."""
    messages = list(opening_messages(env, task))
    ids = t.token_ids.tolist()
    for k, (s, e) in enumerate(t.turn_boundaries):
        messages.append({"role": "assistant", "content": tok.decode(_strip_stop(tok, ids[s:e]))})
        if k + 1 < len(t.turn_boundaries):
            between = observations.seen.get(tuple(ids[e : t.turn_boundaries[k + 1][0]]))
            if between is None:
                return None
            messages.append(dict(between))
    return messages


def transcript_messages(task, ids: list[int], turns: list[tuple[int, int]], env, tok, observations: ObservationLog) -> list[dict]:
    """An episode in progress as chat messages: the opening, each turn's text and what followed it
    (an observation the environment rendered; after a turn cut by the budget, the note that
    follows the end-of-turn the loop closed it with). A stretch that is neither is a bug: raised."""
    messages = list(opening_messages(env, task))
    ids = list(ids)
    for k, (s, e) in enumerate(turns):
        messages.append({"role": "assistant", "content": tok.decode(_strip_stop(tok, ids[s:e]))})
        after = ids[e : turns[k + 1][0] if k + 1 < len(turns) else len(ids)]
        if after[:1] == [tok.end_of_turn_id]:  # the loop closed a cut turn
            after = after[1:]
        seen = observations.seen.get(tuple(after))
        if seen is None:
            raise ValueError(f"task {task.task_id}: the ids after turn {k} are not an observation the environment rendered")
        messages.append(dict(seen))
    return messages


def demo_id(messages: list[dict]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def read_demos(stage_dir: Path) -> list[dict]:
    """A teacher stage's demonstrations, every unit's (in unit order), deduplicated by content."""
    stage_dir = Path(stage_dir)
    files = [stage_dir / DEMOS] if (stage_dir / DEMOS).is_file() else sorted(stage_dir.glob(f"[0-9][0-9][0-9][0-9]/{DEMOS}"))
    if not files:
        raise FileNotFoundError(f"{stage_dir}: no {DEMOS} (is it a finished teacher stage?)")
    seen: set[str] = set()
    out = []
    for f in files:
        for line in f.read_text().splitlines():
            d = json.loads(line)
            if d["id"] not in seen:
                seen.add(d["id"])
                out.append(d)
    return out
