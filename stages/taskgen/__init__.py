"""Verifiable task sets: generators and verifiers, one module per domain.

Tasks are generated from a seed, stored as Parquet tables (`train.parquet`, `val.parquet`) by the
`tasks` stage, and verified by later stages (probe, evaluate, RL) through `verify`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snowcat.pipeline.fsio import atomic_write_bytes

from . import answer_kinds, arith, closure, ifeval, repo, swe_mini
from .verdict import Verdict, VerifierError

SPLITS = ("train", "dev", "val")  # dev: checkpoint selection; val: the held-out score


@dataclass(frozen=True)
class Task:
    task_id: str
    domain: str
    difficulty: int
    prompt: str
    answer: str
    verifier: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def messages(self, with_answer: bool = True) -> list[dict]:
        msgs = [{"role": "user", "content": self.prompt}]
        if with_answer:
            msgs.append({"role": "assistant", "content": demonstration(self)})
        return msgs


# verifier id -> (generator(rng, difficulty), verifier(prompt, answer, completion))
DOMAINS: dict[str, tuple[Callable, Callable]] = {
    "closure": (closure.generate, closure.verify),
    "arith": (arith.generate, arith.verify),
}
# domains whose tasks are repositories (verifier "repo": the completion is a patch judged by tests)
REPO_DOMAINS: dict[str, Callable] = {"swe_mini": swe_mini.generate}
# verifier id -> verifier(task, completion) -> (reward, passed, detail[, scores]) of imported sets, judged
# by what each task's meta holds (answer: its answer kind and reference, stages/taskgen/answer_sets.py;
# ifeval: its instructions, with IFEval's loose accuracy as scores)
TASK_VERIFIERS: dict[str, Callable] = {"answer": answer_kinds.verify, "ifeval": ifeval.verify}


# verifier id -> worked_solution(prompt, answer): what a teacher writes, where it is more than the answer
DEMONSTRATIONS: dict[str, Callable[[str, str], str]] = {"arith": arith.worked_solution}


def demonstration(task: Task) -> str:
    """The teacher's reply to `task` (SFT's target): its worked solution (generated, or the one an
    imported set publishes: meta["solution"]), or the bare answer."""
    if task.meta.get("solution") and task.verifier in TASK_VERIFIERS:
        return task.meta["solution"]
    show = DEMONSTRATIONS.get(task.verifier)
    return show(task.prompt, task.answer) if show else task.answer


def verify(task: Task, completion: str) -> Verdict:
    if task.verifier == "repo":  # repository tasks: the completion is the agent's patch, judged by the task's tests
        reward, passed, detail = repo.verify_patch(task, completion)
        return Verdict(reward, passed, detail)
    if task.verifier in TASK_VERIFIERS:
        check = functools.partial(TASK_VERIFIERS[task.verifier], task)
    elif task.verifier in DOMAINS:
        check = functools.partial(DOMAINS[task.verifier][1], task.prompt, task.answer)
    else:
        raise VerifierError(f"task {task.task_id}: unknown verifier {task.verifier!r}")
    try:
        reward, passed, detail, *scores = check(completion)  # a fourth item: further scores (ifeval's loose ones)
    except VerifierError:
        raise
    except Exception as e:  # a verifier bug is infrastructure, never the model's fault
        raise VerifierError(f"task {task.task_id}: verifier {task.verifier} crashed: {e!r}") from e
    return Verdict(float(reward), bool(passed), detail, {k: float(v) for k, v in (scores[0] if scores else {}).items()})


def content_key(prompt: str, answer: str, meta: dict) -> str:
    """What makes two tasks the same task: the prompt, and for a repository task also its code and
    gold patch (generated repository tasks may share a statement)."""
    if "repo" not in meta:
        return prompt
    return json.dumps([prompt, answer, meta["repo"]], sort_keys=True)


def task_key(task: Task) -> str:
    return content_key(task.prompt, task.answer, task.meta)


def _task_id(domain: str, difficulty: int, key: str) -> str:
    return f"{domain}-d{difficulty}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def generate_domain(rng: np.random.Generator, domain: str, difficulties: list[int], count: int) -> list[Task]:
    """`count` distinct tasks, spread evenly over `difficulties` (round robin), deduplicated by `content_key`."""
    gen, verifier = (REPO_DOMAINS[domain], "repo") if domain in REPO_DOMAINS else (DOMAINS[domain][0], domain)
    seen: dict[str, Task] = {}
    attempts = 0
    while len(seen) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"{domain}: cannot generate {count} distinct tasks at difficulties {difficulties}")
        difficulty = int(difficulties[len(seen) % len(difficulties)])
        prompt, answer, meta = gen(rng, difficulty)
        key = content_key(prompt, answer, meta)
        if key not in seen:
            seen[key] = Task(_task_id(domain, difficulty, key), domain, difficulty, prompt, answer, verifier, meta)
    return list(seen.values())


def split_tasks(tasks: list[Task], val_count: int, rng: np.random.Generator) -> tuple[list[Task], list[Task]]:
    order = rng.permutation(len(tasks))
    val = [tasks[i] for i in order[:val_count]]
    train = [tasks[i] for i in order[val_count:]]
    assert not {task_key(t) for t in val} & {task_key(t) for t in train}, "held-out tasks leaked into train"
    return train, val


def _table(tasks: list[Task]):
    rows = [asdict(t) | {"meta": json.dumps(t.meta, sort_keys=True)} for t in tasks]
    schema = pa.schema(
        [
            ("task_id", pa.string()),
            ("domain", pa.string()),
            ("difficulty", pa.int32()),
            ("prompt", pa.string()),
            ("answer", pa.string()),
            ("verifier", pa.string()),
            ("meta", pa.string()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def save_tasks(out_dir: Path, split: str, tasks: list[Task]) -> Path:
    buf = io.BytesIO()
    pq.write_table(_table(tasks), buf, compression="zstd")
    path = Path(out_dir) / f"{split}.parquet"
    atomic_write_bytes(path, buf.getvalue())
    return path


def selection_split(tasks_dir: Path) -> str:
    """The split a trainer selects checkpoints on: `dev` when the tasks stage held one out, else
    `val` (then the card warns that the exported checkpoint was chosen on the split that scores it)."""
    return "dev" if (Path(tasks_dir) / "dev.parquet").is_file() else "val"


def load_tasks(tasks_dir: Path, split: str) -> list[Task]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    # one file: ParquetFile, not read_table, whose dataset layer imports pyarrow.dataset and pandas
    # (0.16 s of CPU in every stage process that reads its tasks)
    rows = pq.ParquetFile(Path(tasks_dir) / f"{split}.parquet").read().to_pylist()
    return [Task(**(r | {"meta": json.loads(r["meta"])})) for r in rows]
