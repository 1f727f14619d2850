"""Task validation: a repository task is used only if its own harness tells its gold from nothing.

Each task runs its gold solution and its empty solution `runs` times (twice by default, to catch
flaky tests) through the real verifier, in the task's own image when it has one:

    valid         every gold run passes and every empty run fails
    gold_fails    no gold run passes (a broken harness, a missing interpreter, a wrong test id)
    empty_passes  every empty run passes (the tests do not see the bug)
    flaky         the runs of one solution disagree
    no_gold       the task has neither a gold patch nor a gold script: nothing to check it with
    infra         the verifier itself failed (sandbox, time-out): retried on the next run, never cached

Only `valid` tasks are kept; each other one is excluded with its reason. Verdicts are cached by the
task's content hash (`task_hash`: statement, code source, tests, gold, image) as one JSON file per
task, written atomically as each finishes: a preempted or re-run validation continues where it
stopped, and tasks shared by several runs are checked once when they share a cache directory. The
tasks stage checks what the cache does not hold yet; a validate stage (stages/validate.py) fills
it beforehand as a job array.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from snowcat.pipeline.fsio import atomic_write_json

from . import Task
from .repo import verify_patch
from .verdict import VerifierError

STATUSES = ("valid", "gold_fails", "empty_passes", "flaky", "no_gold", "infra")


@dataclass(frozen=True)
class TaskCheck:
    task_id: str
    task_hash: str
    status: str  # one of STATUSES
    detail: str
    gold: list[bool]  # passed, per run
    empty: list[bool]
    seconds: float

    @property
    def valid(self) -> bool:
        return self.status == "valid"


def task_hash(task: Task) -> str:
    """What the verdict depends on: statement, repository spec (code source, tests, harness), gold
    patch and script, and the image the task runs in."""
    what = [task.prompt, task.answer, task.meta.get("repo"), task.meta.get("solution", ""), task.meta.get("sandbox_image")]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def check_task(task: Task, runs: int = 2, image: str | None = None) -> TaskCheck:
    """Run the task's gold and empty solutions `runs` times each and classify (see the module doc)."""
    start = time.monotonic()
    key = task_hash(task)
    solution = task.meta.get("solution", "")
    if not task.answer.strip() and not solution.strip():
        return TaskCheck(task.task_id, key, "no_gold", "no gold patch and no gold script", [], [], 0.0)
    gold, empty, details = [], [], {}
    try:
        for _ in range(runs):
            reward, passed, detail = verify_patch(task, task.answer, image=image, solution=solution)
            gold.append(passed and reward == 1.0)
            details.setdefault("gold", detail)
            _, passed, detail = verify_patch(task, "", image=image)
            empty.append(passed)
            details.setdefault("empty", detail)
    except VerifierError as e:
        return TaskCheck(task.task_id, key, "infra", str(e), gold, empty, time.monotonic() - start)
    if not any(gold):
        status, detail = "gold_fails", f"gold: {details['gold']}"
    elif all(empty):
        status, detail = "empty_passes", "the tests pass without any change"
    elif not all(gold) or any(empty):
        status, detail = "flaky", f"gold passed {sum(gold)}/{runs}, empty passed {sum(empty)}/{runs}"
    else:
        status, detail = "valid", f"gold passes {runs}/{runs}, empty fails {runs}/{runs}"
    return TaskCheck(task.task_id, key, status, detail, gold, empty, time.monotonic() - start)


def validate_tasks(
    tasks: list[Task],
    cache_dir: str | os.PathLike,
    *,
    runs: int = 2,
    workers: int = 1,
    image: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> dict[str, TaskCheck]:
    """The check of each task (by task id), from the cache where it holds the task's hash, else run
    (`workers` at a time: each check waits on sandboxed subprocesses) and cached. `stop()` true
    ends it early (preemption): the returned dict then lacks the tasks not yet checked."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, TaskCheck] = {}
    todo = []
    for task in tasks:
        path = cache / f"{task_hash(task)}.json"
        if path.is_file():
            found = TaskCheck(**json.loads(path.read_text()))
            out[task.task_id] = TaskCheck(**(asdict(found) | {"task_id": task.task_id}))
        else:
            todo.append(task)

    def one(task: Task) -> TaskCheck | None:
        if stop is not None and stop():
            return None
        check = check_task(task, runs, image)
        if check.status != "infra":  # the machinery's failure is tried again next time
            atomic_write_json(cache / f"{check.task_hash}.json", asdict(check))
        return check

    done = len(out)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for check in pool.map(one, todo):
            if check is not None:
                out[check.task_id] = check
                done += 1
                if progress is not None:
                    progress(done, len(tasks))
    return out


def validation_cache(cfg, run_dir: str | os.PathLike) -> Path:
    """Where a run's verdicts live (`tasks.validate.cache_dir`, else `<run>/cache/task-validation`):
    one place for the tasks stage and the validate stage's array elements."""
    return Path(cfg.cache_dir) if cfg.cache_dir else Path(run_dir) / "cache" / "task-validation"


def shard_of(task: Task, shards: int) -> int:
    """The array element (of `shards`) that checks `task`: by its content hash, so stable."""
    return int(task_hash(task)[:16], 16) % shards


def summary(checks: dict[str, TaskCheck]) -> dict[str, int]:
    """Counts per status (every status named, zeros included)."""
    counts = Counter(c.status for c in checks.values())
    return {s: counts.get(s, 0) for s in STATUSES}
