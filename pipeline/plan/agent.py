"""Time of multi-turn (agent) episodes beyond decoding: what the environment does between turns.

The agent loop (stages/agent/loop.py) advances a wave of episodes together: each turn one batched
`generate`, then the live episodes' tool calls, `workers` at a time (its thread pool: the job's
CPUs), and the next turn starts when the last call has returned. So a wave costs its decode steps
(per turn the longest turn of its live episodes) plus, per turn, rounds of calls:

  turn t of a wave of b episodes: ceil(b x calls_t / workers) rounds x the mean call's seconds
                                  + b x in_process_t x tool_call_s / workers
  the wave's start:               b x sandbox_start_s (the episodes' sandboxes, one after another)

`calls_t`: sandboxed calls (test, bash: a process in the sandbox, `sandbox_call_s` each) and
verifications (a submitted patch judged in a clean sandbox, `verify_s`) per episode at turn t;
`in_process_t`: view, edit and turns without a parseable call. The site's seconds are one call's
wall as it runs beside the others of its round (so on a node with fewer cores than workers they
hold the sharing). SFT's scripted expert (stages/sft.py `teacher_demos`) runs whole episodes per
worker instead: ceil(tasks / workers) rounds of one episode's calls.

What an episode does (`Profile`) comes, nearest first, from episodes a finished input played in the
same environment (their tool names and turns), from the scripted expert's demonstrations the
checkpoint's SFT stage trained on (what a model trained on them imitates), or, before anything ran,
the upper bound: every turn a sandboxed call at max_turn_tokens, the last one verified.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline.errors import UserError

SANDBOXED = ("test", "bash")  # tools that run a process in the sandbox (stages/agent/repo_env.py)
PROFILE_COLUMNS = ("tool_names", "status", "turn_starts", "turn_ends")
EXPERT_CALLS = ("test", "view", "edit", "test", "submit")  # stages/agent/repo_env.py `teacher_episode`


@dataclass(frozen=True)
class Profile:
    """What an episode does, per turn index (the fraction of episodes making each kind of call at
    that turn), with the decode steps of a wave and the tokens an episode samples."""

    sandboxed: tuple[float, ...]
    verified: tuple[float, ...]
    in_process: tuple[float, ...]
    wave_steps: float
    response: float
    source: str
    upper_bound: bool = False

    @property
    def turns(self) -> int:
        return len(self.sandboxed)

    def describe(self) -> dict:
        return {
            "source": self.source,
            "upper_bound": self.upper_bound,
            "sandboxed_per_episode": round(sum(self.sandboxed), 3),
            "verified_per_episode": round(sum(self.verified), 3),
            "in_process_per_episode": round(sum(self.in_process), 3),
            "wave_decode_steps": round(self.wave_steps, 1),
            "response_mean": round(self.response, 2),
        }


def _per_turn(calls: Sequence[Sequence[str]], verified: Sequence[bool], turns: int) -> tuple[tuple, tuple, tuple]:
    """Per turn index, the fraction of episodes whose call there is sandboxed, a verified submit, or
    answered in-process (a verification is counted at the episode's last turn)."""
    n = max(1, len(calls))
    turns = min(turns, max((len(c) for c in calls), default=0))  # no turn past the longest episode's
    sandboxed, verify, inproc = [0.0] * turns, [0.0] * turns, [0.0] * turns
    for names, ok in zip(calls, verified):
        names = list(names)[:turns]
        for t, name in enumerate(names):
            if name in SANDBOXED:
                sandboxed[t] += 1 / n
            elif name != "submit":
                inproc[t] += 1 / n
        if ok and names:
            verify[len(names) - 1] += 1 / n
    return tuple(sandboxed), tuple(verify), tuple(inproc)


def _wave_steps(turn_lengths: Sequence[Sequence[int]], max_turn_tokens: int) -> float:
    """Decode steps of a wave of these episodes: per turn the longest turn of those still live."""
    longest = max((len(t) for t in turn_lengths), default=0)
    return float(sum(min(max_turn_tokens, max((t[i] for t in turn_lengths if len(t) > i), default=0)) for i in range(longest)))


def upper_bound(max_turns: int, max_turn_tokens: int, why: str) -> Profile:
    """Every turn a sandboxed call at max_turn_tokens, and every episode's last one verified."""
    calls = ["test"] * max_turns
    sandboxed, verify, inproc = _per_turn([calls], [True], max_turns)
    steps = float(max_turns * max_turn_tokens)
    return Profile(sandboxed, verify, inproc, steps, steps, f"upper bound: {why}", True)


def from_episodes(directory: Path, max_turns: int, max_turn_tokens: int) -> Profile | None:
    """The episodes kept in `directory/*.parquet` (stages/agent/dataset.py), cut to this stage's
    budget; None when there are none. A file without the columns read is refused naming it."""
    import pyarrow.parquet as pq  # noqa: PLC0415 (only where a run is read)

    episodes = []
    for path in sorted(Path(directory).glob("*.parquet")):
        names = set(pq.read_schema(path).names)
        if missing := [c for c in PROFILE_COLUMNS if c not in names]:
            raise UserError(f"{path}: no column(s) {', '.join(missing)}; snowcat plan reads agent episodes from them")
        episodes += pq.read_table(path, columns=list(PROFILE_COLUMNS)).to_pylist()
    if not episodes:
        return None
    turns = [[e - s for s, e in zip(ep["turn_starts"], ep["turn_ends"])][:max_turns] for ep in episodes]
    sandboxed, verify, inproc = _per_turn(
        [ep["tool_names"] or [] for ep in episodes], [ep["status"] == "ok" for ep in episodes], max_turns
    )
    return Profile(
        sandboxed,
        verify,
        inproc,
        wave_steps=_wave_steps(turns, max_turn_tokens),
        response=sum(min(x, max_turn_tokens) for t in turns for x in t) / len(episodes),
        source=f"{len(episodes)} episodes played in {directory}",
    )


def _call(c: dict) -> dict:
    return {"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})}


def from_demonstrations(path: Path, tokenizer, max_turns: int, max_turn_tokens: int) -> Profile | None:
    """The scripted expert's episodes an SFT stage trained on (`teacher_demos.json`: chat messages
    per task): its calls and, through the checkpoint's tokenizer, its turns' lengths (the call as
    the model writes it, + the end-of-turn token); None when the file is absent or holds none."""
    try:
        demos = json.loads(Path(path).read_text()).get("demos") or {}
    except (FileNotFoundError, ValueError):
        return None
    if not demos:
        return None
    calls, lengths = [], []
    for messages in demos.values():
        made = [_call(c) for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []][:max_turns]
        calls.append([c["name"] for c in made])
        if tokenizer is not None:
            text = [f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in made]
            lengths.append([min(len(tokenizer.encode(x)) + 1, max_turn_tokens) for x in text])
        else:
            lengths.append([max_turn_tokens] * len(made))
    sandboxed, verify, inproc = _per_turn(calls, ["submit" in c for c in calls], max_turns)
    return Profile(
        sandboxed,
        verify,
        inproc,
        wave_steps=_wave_steps(lengths, max_turn_tokens),
        response=sum(map(sum, lengths)) / len(lengths),
        source=f"the scripted expert's {len(calls)} demonstrations in {path} (a model trained on them imitates their calls)",
    )


def workers(site, partition: str | None) -> int:
    """Calls at once: the site's `tool_workers`, else the partition's CPUs (the loop's pool is the
    job's CPU count)."""
    if site.planner.tool_workers:
        return int(site.planner.tool_workers)
    part = site.partitions.get(partition or site.default_partition)
    return max(1, int(part.cpus_per_node)) if part is not None and part.cpus_per_node else 1


def _assumes(site, workers_: int) -> str:
    pl = site.planner
    return (
        f"sandbox call {pl.sandbox_call_s:g} s, verification {pl.verify_s:g} s, tool call {pl.tool_call_s:g} s, "
        f"sandbox start {pl.sandbox_start_s:g} s; {workers_} at a time (site {site.name})"
    )


def wave_env_seconds(site, profile: Profile, wave: int, workers_: int) -> float:
    """Seconds the environment adds to one wave of `wave` episodes."""
    pl = site.planner
    total = wave * pl.sandbox_start_s
    for s, v, i in zip(profile.sandboxed, profile.verified, profile.in_process):
        calls = wave * (s + v)
        if calls > 1e-9:
            mean = (s * pl.sandbox_call_s + v * pl.verify_s) / (s + v)
            total += math.ceil(calls / workers_ - 1e-9) * mean
        total += wave * i * pl.tool_call_s / workers_
    return total


def env_seconds(site, profile: Profile, *, episodes: int, wave: int, workers_: int) -> dict:
    """Seconds the environment adds to `episodes` episodes played in waves of at most `wave`."""
    wave = max(1, min(wave, episodes))
    full, rest = divmod(episodes, wave)
    seconds = full * wave_env_seconds(site, profile, wave, workers_) + (
        wave_env_seconds(site, profile, rest, workers_) if rest else 0.0
    )
    return {
        "episodes": episodes,
        "wave": wave,
        "workers": workers_,
        "env_s": seconds,
        "assumes": _assumes(site, workers_),
    }


def expert_seconds(site, tasks: int, workers_: int) -> dict:
    """SFT's scripted expert: each worker plays whole episodes (reset, test, view, edit, test, a
    verified submit), ceil(tasks / workers) rounds of one: the site's measured episode where it
    gives one, else the sum of the episode's calls."""
    pl = site.planner
    episode = pl.expert_episode_s or pl.sandbox_start_s + 2 * pl.sandbox_call_s + 2 * pl.tool_call_s + pl.verify_s
    rounds = math.ceil(tasks / max(1, workers_))
    return {
        "tasks": tasks,
        "workers": workers_,
        "rounds": rounds,
        "episode_s": episode,
        "env_s": rounds * episode,
        "assumes": f"expert episode {pl.expert_episode_s:g} s; {workers_} at a time (site {site.name})"
        if pl.expert_episode_s
        else _assumes(site, workers_),
    }


def known(site) -> bool:
    """Whether the site gives any of the environment's costs (else they count as nothing, said so)."""
    pl = site.planner
    return any((pl.sandbox_call_s, pl.tool_call_s, pl.verify_s, pl.sandbox_start_s))
