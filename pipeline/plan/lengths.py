"""How many tokens a sampling stage's episodes hold, and where the planner got the numbers.

A plan of a config (nothing run yet) counts every episode at its limits: the prompt filling the
context the response leaves, the response at max tokens x turns. That is an upper bound and the
stage's record says so. A plan of a run that has started (`snowcat plan --compare RUN`) gives
stage X only what X's inputs recorded (`Inputs`: its transitive `needs`, every one finished before X
could start), never X's own outputs or a later stage's:

- probe: the tasks it will sample (the tasks stage's split) rendered by the checkpoint's tokenizer,
  responses as long as the demonstrations the checkpoint's SFT stage trained it to write;
- rl: the probe's episodes (prompt, response, total per episode, as sampled) on the tasks select kept;
- evaluate: the split's tasks rendered by the checkpoint's tokenizer, responses as the probe (else
  RL) sampled them in each domain; a checkpoint that is a fresh initialisation writes to the limit.

Where an input is missing (not run, fanned out, another env than `single`), the upper bound stays
and the note says why. A trajectories file without the columns read here is refused naming it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from snowcat.pipeline import fsio
from snowcat.pipeline.errors import UserError

from .timing import Waves

# what `stages/agent/dataset.py` writes per episode (docs/analysis.md) and the planner reads
TRAJECTORY_COLUMNS = ("task_id", "domain", "prompt_len", "response_tokens", "token_ids", "turn_starts")


@dataclass(frozen=True)
class TaskLengths:
    """One task's episodes: its prompt, and the tokens each attempt sampled (responses) and held in
    all (totals: prompt, turns and what the environment appended), as seen or as expected."""

    domain: str
    prompt: int
    responses: tuple[int, ...]
    totals: tuple[int, ...]
    task_id: str = ""


@dataclass(frozen=True)
class Lengths:
    """The tasks a stage samples, in the order it samples them, with where their lengths came from."""

    tasks: tuple[TaskLengths, ...]
    turns: float
    source: str
    upper_bound: bool = False
    counted: bool = True  # the stage's own tasks (False: n stand-ins at the limits)

    def describe(self) -> dict:
        episodes = [r for t in self.tasks for r in t.responses]
        prompts = [t.prompt for t in self.tasks]
        return {
            "source": self.source,
            "upper_bound": self.upper_bound,
            "tasks": len(self.tasks),
            "prompt_mean": round(sum(prompts) / len(prompts), 2) if prompts else None,
            "response_mean": round(sum(episodes) / len(episodes), 2) if episodes else None,
            "turns_mean": round(self.turns, 3),
        }


@dataclass(frozen=True)
class Inputs:
    """The stages a stage could read before it started: its transitive needs that are done, each
    with its directory. The planner reads a run only through this, so that stage X's prediction
    never sees X's own outputs or those of a stage after it."""

    stage: str
    dirs: Mapping[str, Path]
    kinds: Mapping[str, str]

    def get(self, name: str) -> Path | None:
        return self.dirs.get(name)

    def of_kind(self, kind: str) -> list[str]:
        return [n for n in self.dirs if self.kinds[n] == kind]


def upstream(run, name: str) -> list[str]:
    """Stage `name`'s transitive needs, nearest first."""
    seen: list[str] = []
    todo = list(run.stages[name].needs)
    while todo:
        need = todo.pop(0)
        if need not in seen and need in run.stages:
            seen.append(need)
            todo += list(run.stages[need].needs)
    return seen


def inputs_of(run, name: str, done_dir: Callable[[str], Path | None]) -> Inputs:
    """The Inputs of stage `name`: `done_dir(stage)` is the directory of a finished stage (None: not
    done, or fanned out into several units)."""
    dirs = {n: d for n in upstream(run, name) if (d := done_dir(n)) is not None}
    return Inputs(name, dirs, {n: run.stages[n].kind for n in dirs})


# ------------------------------------------------------------------------------ the upper bound


def upper_bound(n: int, prompt: int, response: int, turns: int, why: str) -> Lengths:
    """`n` tasks whose episodes sit at the limits."""
    one = TaskLengths("*", prompt, (response,), (prompt + response,))
    return Lengths((one,) * max(1, n), float(turns), f"upper bound: {why}", upper_bound=True, counted=False)


# ------------------------------------------------------------------------------ readers


def read_trajectories(directory: Path) -> tuple[list[TaskLengths], float]:
    """Per task (first seen first), the episodes kept in `directory/*.parquet` (stages/agent/dataset.py),
    and the mean model turns per episode."""
    import pyarrow.compute as pc  # noqa: PLC0415 (pyarrow only where a run is read)
    import pyarrow.parquet as pq  # noqa: PLC0415

    by_task: dict[str, list] = {}
    for path in sorted(Path(directory).glob("*.parquet")):
        names = set(pq.read_schema(path).names)
        missing = [c for c in TRAJECTORY_COLUMNS if c not in names]
        if missing:
            raise UserError(
                f"{path}: no column(s) {', '.join(missing)}; snowcat plan reads episode lengths from them "
                "(docs/analysis.md, 'columns')"
            )
        table = pq.read_table(path, columns=list(TRAJECTORY_COLUMNS))
        totals = pc.list_value_length(table["token_ids"]).to_pylist()
        turns = pc.list_value_length(table["turn_starts"]).to_pylist()
        rows = zip(*(table[c].to_pylist() for c in ("task_id", "domain", "prompt_len", "response_tokens")), totals, turns)
        for task_id, domain, prompt, response, total, turn in rows:
            by_task.setdefault(task_id, [domain, int(prompt), [], [], []])
            entry = by_task[task_id]
            entry[2].append(int(response))
            entry[3].append(int(total))
            entry[4].append(int(turn))
    tasks = [TaskLengths(d, p, tuple(r), tuple(t), task_id) for task_id, (d, p, r, t, _) in by_task.items()]
    return tasks, _mean([x for e in by_task.values() for x in e[4]])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def checkpoint_dir(inputs: Inputs, ref: str) -> Path | None:
    """The directory of checkpoint "<stage>:<name>" of a finished input (None: not one)."""
    stage, sep, name = str(ref).partition(":")
    base = inputs.get(stage) if sep and "[" not in stage else None
    if base is None:
        return None
    try:
        return fsio.checkpoint_dir(base, name)
    except UserError:  # not written (yet): the caller falls back to the upper bound
        return None


def load_tasks(inputs: Inputs, tasks_stage: str, split: str) -> list | None:
    from snowcat.stages.taskgen import load_tasks as load  # noqa: PLC0415 (pyarrow: only where a run is read)

    base = inputs.get(tasks_stage)
    if base is None or not (base / f"{split}.parquet").is_file():
        return None
    return load(base, split)


def tokenizer(path: Path | None):
    from snowcat.stages.tokenizer import load_tokenizer  # noqa: PLC0415

    return load_tokenizer(path) if path is not None else None


def in_domain_turns(tasks: list, n: int) -> list:
    """The first `n` tasks taken from the domains in turn, as the probe takes them
    (stages/probe.py `first_of_each_domain_in_turn`)."""
    by_domain: dict[str, list] = {}
    for t in tasks:
        by_domain.setdefault(t.domain, []).append(t)
    return [t for turn in zip_longest(*by_domain.values()) for t in turn if t is not None][:n]


# ------------------------------------------------------------------------------ expectations


def expected_max(groups: Sequence[tuple[Sequence[int], int]]) -> float:
    """E[max] over independent draws: `n` from each group's values (equally likely each)."""
    groups = [(sorted(v), n) for v, n in groups if n > 0 and v]
    if not groups:
        return 0.0
    out, below = 0.0, 0.0
    for x in sorted({v for values, _ in groups for v in values}):
        at_most = math.prod((bisect.bisect_right(values, x) / len(values)) ** n for values, n in groups)
        out += x * (at_most - below)
        below = at_most
    return out


def longest_of(values: Sequence[int], draws: int) -> float:
    """The longest of `draws` attempts of one task, given the lengths its attempts had: the largest
    seen when as many were seen, else the expectation over draws from them."""
    if len(values) == draws:
        return float(max(values))
    return expected_max([(values, draws)])


# ------------------------------------------------------------------------------ waves and padding


def ordered_waves(lengths: Lengths, attempts: int, batch: int) -> Waves:
    """The waves of a stage that samples its tasks in order, `attempts` episodes each, task after
    task (probe, evaluate): each wave pads to its tasks' longest prompt and decodes until the
    longest of its episodes' responses ends (an expectation over the responses each task's
    episodes may have)."""
    waves: list[tuple[int, int, float, float]] = []  # (episodes, longest prompt, steps, sampled)
    groups: dict[int, list] = {}  # responses (by identity: a domain's shared tuple) -> [responses, episodes]
    fill, longest = 0, 0

    def close() -> None:
        nonlocal fill, longest
        if fill:
            steps = expected_max([(r, n) for r, n in groups.values()])
            waves.append((fill, longest, steps, sum(n * _mean(r) for r, n in groups.values())))
        groups.clear()
        fill, longest = 0, 0

    for task in lengths.tasks:
        left = attempts
        while left:
            take = min(left, batch - fill)
            groups.setdefault(id(task.responses), [task.responses, 0])[1] += take
            longest, fill, left = max(longest, task.prompt), fill + take, left - take
            if fill == batch:
                close()
    close()
    seqs = sum(w[0] for w in waves)
    sampled = sum(w[3] for w in waves)
    prompts = sum(t.prompt for t in lengths.tasks) * attempts
    return Waves(
        sequences=seqs,
        batch=min(batch, seqs) if seqs else batch,
        count=len(waves),
        prefill_tokens=sum(w[0] * w[1] for w in waves),
        steps=sum(w[2] for w in waves),
        sampled=sampled,
        context=(prompts + sampled / 2) / seqs if seqs else 0.0,
    )


def drawn_waves(lengths: Lengths, tasks: int, attempts: int, batch: int) -> Waves:
    """The waves of one RL batch: `tasks` tasks drawn from the pool, `attempts` episodes each, in
    waves of `batch` (the attempts of a task together): a wave's longest prompt and longest
    response are expectations over the tasks it may draw."""
    seqs = tasks * attempts
    batch = max(1, min(batch, seqs))
    count = math.ceil(seqs / batch)
    per_wave = min(tasks, math.ceil(batch / attempts))  # tasks whose attempts share a wave
    prompts = [t.prompt for t in lengths.tasks]
    longest = [longest_of(t.responses, attempts) for t in lengths.tasks]
    response = _mean([_mean(t.responses) for t in lengths.tasks])
    return Waves(
        sequences=seqs,
        batch=batch,
        count=count,
        prefill_tokens=seqs * expected_max([(prompts, per_wave)]),
        steps=count * expected_max([(longest, per_wave)]),
        sampled=seqs * response,
        context=_mean(prompts) + response / 2,
    )


def padded_length(lengths: Lengths, tasks: int, attempts: int) -> float:
    """Tokens per row of an RL batch: the trainer pads every row to the batch's longest episode
    (stages/rlcore/trainer.py `make_batch`), the longest of `tasks` drawn tasks' longest attempts."""
    return expected_max([([longest_of(t.totals, attempts) for t in lengths.tasks], tasks)])


# ------------------------------------------------------------------------------ per stage kind


def _fresh_init(run, ref: str) -> bool:
    """Whether checkpoint `ref` is a model no training has touched yet (an sft stage's `initial`
    when it initialised the model): it rarely ends a turn, so it samples to the limit."""
    stage, _, name = str(ref).partition(":")
    section = run.stages.get(stage)
    return name == "initial" and section is not None and section.kind == "sft" and not section.init_from


def _trained_on_demonstrations(run, ref: str) -> str | None:
    """The sft stage that trained checkpoint `ref` on the tasks' demonstrations (None: not one)."""
    stage = str(ref).partition(":")[0]
    section = run.stages.get(stage)
    if section is None or section.kind != "sft" or (section.mix and not section.mix.get("tasks")):
        return None
    return stage


def probe_lengths(run, stage, inputs: Inputs | None, n: int) -> Lengths:
    """A probe's episodes: prompts as its checkpoint's tokenizer renders the tasks it will sample,
    responses as long as the demonstrations the checkpoint was trained to imitate."""
    generate = min(stage.max_turn_tokens * stage.max_turns, stage.max_context)

    def bound(why: str) -> Lengths:
        return upper_bound(n, max(1, stage.max_context - generate), generate, stage.max_turns, why)

    if inputs is None:
        return bound("a plan of the config (nothing has run): every episode at max_context")
    sft = _trained_on_demonstrations(run, stage.checkpoint)
    if stage.env != "single" or sft is None:
        why = (
            f"env {stage.env}"
            if stage.env != "single"
            else f"{stage.checkpoint} is not an sft stage's model trained on the tasks"
        )
        return bound(f"{why}: no demonstration to take its lengths from")
    tasks = load_tasks(inputs, stage.tasks, "train")
    tok = tokenizer(checkpoint_dir(inputs, stage.checkpoint))
    if not tasks or tok is None:
        return bound(f"stage {stage.tasks} or checkpoint {stage.checkpoint} is not among its finished inputs")
    from snowcat.stages.taskgen import demonstration  # noqa: PLC0415

    chosen = in_domain_turns(tasks, stage.limit) if stage.limit else tasks
    rows = []
    for t in chosen:
        prompt = len(tok.render_prompt(t.messages(with_answer=False)))
        response = min(len(tok.encode(demonstration(t))) + 1, stage.max_turn_tokens)  # + the end-of-turn id
        rows.append(TaskLengths(t.domain, prompt, (response,), (prompt + response,)))
    source = (
        f"prompts: {len(rows)} tasks of {stage.tasks}/train.parquet through {stage.checkpoint}'s tokenizer; "
        f"responses: the demonstrations {sft} trained {stage.checkpoint} to write (+ the end-of-turn token)"
    )
    return Lengths(tuple(rows), 1.0, source)


def _probe_for(run, stage, inputs: Inputs) -> tuple[str | None, set[str] | None]:
    """(probe stage, task ids kept by select or None) an RL stage's lengths come from."""
    select = stage.band_input if inputs.get(stage.band_input) is not None else None
    if select is not None and run.stages[select].kind == "select":
        probe = run.stages[select].probe
        band = inputs.get(select) / "band.parquet"
        if inputs.get(probe) is not None and band.is_file():
            import pyarrow.parquet as pq  # noqa: PLC0415

            return probe, set(pq.read_table(band, columns=["task_id"]).column("task_id").to_pylist())
    probes = inputs.of_kind("probe")
    return (probes[0], None) if probes else (None, None)


def rl_lengths(run, stage, inputs: Inputs | None) -> Lengths:
    """An RL stage's episodes: as the probe sampled them on the tasks select kept for it."""
    generate = min(stage.max_tokens * stage.max_turns, stage.max_total_tokens)

    def bound(why: str) -> Lengths:
        return upper_bound(stage.tasks_per_update, max(1, stage.max_total_tokens - generate), generate, stage.max_turns, why)

    if inputs is None:
        return bound(f"a plan of the config (nothing has run): every episode at max_total_tokens={stage.max_total_tokens}")
    probe, band = _probe_for(run, stage, inputs)
    if probe is None:
        return bound("no finished probe stage among its inputs")
    if run.stages[probe].env != stage.env:
        return bound(f"probe {probe} ran env {run.stages[probe].env}, this stage {stage.env}")
    where = inputs.get(probe) / "trajectories"
    tasks, turns = read_trajectories(where) if where.is_dir() else ([], 0.0)
    kept = [t for t in tasks if (band is None or t.task_id in band) and (not stage.domains or t.domain in stage.domains)]
    if not kept:
        return bound(f"{where}: no episode of the tasks this stage trains on")
    cut = [
        TaskLengths(
            t.domain,
            t.prompt,
            tuple(min(r, generate) for r in t.responses),
            tuple(min(x, stage.max_total_tokens) for x in t.totals),
            t.task_id,
        )
        for t in kept
    ]
    what = f"the {len(cut)} tasks select kept" if band is not None else f"{len(cut)} tasks"
    source = f"the episodes stage {probe} sampled ({run.stages[probe].checkpoint}) on {what}: {where}"
    if run.stages[probe].checkpoint != stage.init_from:
        source += f" (this stage starts from {stage.init_from})"
    return Lengths(tuple(cut), turns, source)


def _domain_responses(run, inputs: Inputs, generate: int) -> tuple[dict[str, tuple[int, ...]], str] | None:
    """Responses per domain as a finished probe (else RL) stage sampled them, cut at `generate`."""
    for kind in ("probe", "rl"):
        for name in inputs.of_kind(kind):
            where = inputs.get(name) / "trajectories"
            tasks, _ = read_trajectories(where) if where.is_dir() else ([], 0.0)
            pooled: dict[str, list[int]] = {}
            for t in tasks:
                pooled.setdefault(t.domain, []).extend(min(r, generate) for r in t.responses)
            if pooled:
                return {d: tuple(v) for d, v in pooled.items()}, f"stage {name}'s episodes per domain ({where})"
    return None


def _stratified(tasks: list, limit: int) -> list:
    """About `limit` tasks, each domain's share in proportion (evaluate.sample_tasks draws them at
    random; the planner takes each domain's first ones)."""
    by_domain: dict[str, list] = {}
    for t in tasks:
        by_domain.setdefault(t.domain, []).append(t)
    return [t for ts in by_domain.values() for t in ts[: max(1, round(limit * len(ts) / len(tasks)))]]


def eval_lengths(run, stage, ref: str, inputs: Inputs | None, n: int, pick: Callable[[list], list] | None = None) -> Lengths:
    """An evaluate stage's episodes on checkpoint `ref`: its split's prompts through the
    checkpoint's tokenizer, responses as the probe (else RL) sampled them per domain. `pick`: which
    of the split's tasks it samples (default: all, or `limit` of them)."""
    generate = min(stage.max_tokens * stage.max_turns, stage.max_context)

    def bound(why: str) -> Lengths:
        return upper_bound(n, max(1, stage.max_context - generate), generate, stage.max_turns, why)

    if inputs is None:
        return bound("a plan of the config (nothing has run): every episode at max_context")
    if stage.env != "single":
        return bound(f"env {stage.env}: multi-turn lengths are not read")
    tasks = load_tasks(inputs, stage.tasks, stage.split)
    tok = tokenizer(checkpoint_dir(inputs, ref))
    if not tasks or tok is None:
        return bound(f"stage {stage.tasks} or checkpoint {ref} is not among its finished inputs")
    tasks = pick(tasks) if pick else (_stratified(tasks, stage.limit) if stage.limit else tasks)
    fresh = _fresh_init(run, ref)
    pooled = None if fresh else _domain_responses(run, inputs, generate)
    if fresh or pooled is None:
        responses, why = {}, (f"{ref} is a fresh initialisation" if fresh else "no finished probe or RL kept episodes")
        source = f"responses at max_tokens x max_turns ({generate}; {why})"
    else:
        responses, source = pooled[0], f"responses: {pooled[1]}"
    at_limit = (generate,)
    rows = tuple(
        TaskLengths(t.domain, len(tok.render_prompt(t.messages(with_answer=False))), responses.get(t.domain, at_limit), ())
        for t in tasks
    )
    source = f"prompts: {len(rows)} tasks of {stage.tasks}/{stage.split}.parquet through {ref}'s tokenizer; {source}"
    return Lengths(rows, 1.0, source, upper_bound=fresh or pooled is None)
