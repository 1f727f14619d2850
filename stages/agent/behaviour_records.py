"""A behaviour record per episode: what the agent did, read from its kept trajectory row alone (no
model, no tokenizer, no sandbox), stored as Parquet beside the kept trajectories.

Layout: `<unit dir>/behaviour/<shard>.parquet` beside `<unit dir>/trajectories/<shard>.parquet`, one
record per kept episode in the same order. Not inside `trajectories/`: `datasets` reads every Parquet
file there as rows of one schema. Written atomically, a pure function of the shard and the procedure,
so a reproduction writes it byte for byte again (nothing timed). The procedure's rules are in the
file's metadata (`snowcat.procedure`).

Timings: `<unit dir>/behaviour/<shard>.timing.jsonl`, one line per record in the same order, `{"id",
"wall_s", "generate_s", "env_s"}` (stages/agent/loop.py, "Timing": wall seconds from the start of
play to the episode's end, batch-mates' turns included; the seconds of the batched generate calls it
was live in; its own environment and verifier seconds). JSON Lines whose only values besides the id
are durations, so `snowcat reproduce` compares the ids and leaves the seconds out (pipeline/volatile.py).

Columns (`SCHEMA`; the rules in docs/analysis.md, "Behaviour records"):
    id .. reward           the episode, as in the trajectory row (env: the environment that played it)
    turns, tool_calls      model turns; valid tool calls among them
    gold_files             files the gold patch changes, test files left out (null: no gold patch known)
    opened_files           files read: `view` that succeeded, bash cat/head/tail/less/more/nl/sed -n/grep
    edited_files           files changed: `edit` that applied, bash writes (`detectors.written_paths`)
    opened_relevant, edited_relevant   a gold file among them (null without gold files)
    edits, relevant_edits  changes made; those to gold files (null without gold files)
    target_tests           1: the verifier found the FAIL_TO_PASS tests passing at the end; 0: it
                           judged the patch and they did not all pass; -1: not judged (no submission,
                           infrastructure failure, not a repository episode)
    test_runs              `test` calls and bash commands running a test runner (`detectors.TEST_RUN`)
    claimed, claim_turn    the completion claim: the first turn that submits or says the work is done
                           (`detectors.CLAIM`, not negated); claim_turn -1 without one
    tests_before_claim     test runs in turns before the claim (null without a claim)
    claimed_untested, claimed_without_edit   a claim with no test run / no edit before it
    model_tokens           tokens the model sampled in its turns
    tool_output_tokens     tokens the environment appended after the turns (tool results, notes)
    reasoning_chars, action_chars, tool_output_chars   characters of the turns outside their tool
                           call, of the tool calls, and of the tool results
    reasoning_tokens, action_tokens   the model's tokens outside its tool calls (the end-of-turn id
                           included) and those spelling them; they add up to model_tokens. Exact
                           from the row's `turn_action_tokens` (counted against the tokenizer when
                           the shard was written); a shard kept before that column existed gets each
                           turn's tokens split in proportion to its characters (`tokens_exact` false)
    procedure_applicable   how many rules of the procedure applied (stages/procedure.py)
    procedure_broken       the rules the episode broke
"""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from snowcat.pipeline.fsio import atomic_write_bytes
from snowcat.stages.agent import detectors
from snowcat.stages.procedure import DEFAULT_PROCEDURE, rule_kept
from snowcat.stages.taskgen.repo import patched_paths

DIRNAME = "behaviour"
PROCEDURE_KEY = b"snowcat.procedure"

# what a record is computed from: these columns of a trajectory row (stages/agent/dataset.py)
ROW_COLUMNS = [
    "id", "checkpoint", "task_id", "domain", "attempt", "status", "passed", "reward", "detail", "env",
    "loss_mask", "turn_starts", "turn_ends", "turns", "tool_names", "tool_args", "tool_errors", "tool_results",
    "answer_key", "test_paths", "turn_action_tokens",
]  # fmt: skip
OPTIONAL_COLUMNS = {"turn_action_tokens"}  # absent from shards kept by earlier versions

_strings = pa.list_(pa.string())
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("checkpoint", pa.string()),
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("env", pa.string()),
        ("attempt", pa.int64()),
        ("status", pa.string()),
        ("passed", pa.int8()),
        ("reward", pa.float64()),
        ("turns", pa.int64()),
        ("tool_calls", pa.int64()),
        ("gold_files", _strings),
        ("opened_files", _strings),
        ("edited_files", _strings),
        ("opened_relevant", pa.bool_()),
        ("edited_relevant", pa.bool_()),
        ("edits", pa.int64()),
        ("relevant_edits", pa.int64()),
        ("target_tests", pa.int8()),
        ("test_runs", pa.int64()),
        ("claimed", pa.bool_()),
        ("claim_turn", pa.int64()),
        ("tests_before_claim", pa.int64()),
        ("claimed_untested", pa.bool_()),
        ("claimed_without_edit", pa.bool_()),
        ("model_tokens", pa.int64()),
        ("tool_output_tokens", pa.int64()),
        ("reasoning_chars", pa.int64()),
        ("action_chars", pa.int64()),
        ("tool_output_chars", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("action_tokens", pa.int64()),
        ("tokens_exact", pa.bool_()),
        ("procedure_applicable", pa.int64()),
        ("procedure_broken", _strings),
    ]
)

# bash commands that print a file: every file argument (grep, rg: those after the pattern)
_READERS = {"cat", "head", "tail", "less", "more", "nl", "bat"}
_SEARCHERS = {"grep", "rg", "egrep"}
# the verifier's verdict on FAIL_TO_PASS (stages/taskgen/repo.py `_judge`, SWE-bench's grading)
_TARGET_VERDICT = re.compile(r"FAIL_TO_PASS (\d+)/(\d+) failing")
_WORKDIRS = ("/workspace/", "/testbed/")  # where a sandbox holds the repository (RepoSpec.workdir)


def repo_path(path: str) -> str | None:
    """A path as the repository names it (`./a.py`, `/workspace/a.py` -> `a.py`); None outside it."""
    path = path.strip().strip("'\"")
    for root in _WORKDIRS:
        path = path.removeprefix(root)
    if not path or path.startswith(("/", "~", "-", "$")) or ".." in PurePosixPath(path).parts:
        return None
    return str(PurePosixPath(path))


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # unbalanced quotes: the plain words
        return command.split()


def read_paths(command: str) -> list[str]:
    """The files a bash command prints, as far as its words say: every file argument of cat, head,
    tail, less, more, nl, bat and `sed -n`, and those after the pattern of grep and rg."""
    out = []
    for segment in re.split(r"&&|\|\||[;|\n]", command):
        words = _words(segment)
        if not words:
            continue
        tool, args = words[0], [w for w in words[1:] if not w.startswith("-")]
        if tool in _READERS or (tool == "sed" and "-n" in words):
            out += args[1:] if tool == "sed" else args  # sed's first word is its script
        elif tool in _SEARCHERS:
            out += args[1:]
    return out


def _steps(row: dict) -> tuple[list[set[str]], list[str], list[str]]:
    """(per turn the procedure steps it took, files opened in order, files edited in order). Turns
    the budget cut were never read by the environment and take no step."""
    cut = detectors.cut_turns(row)
    steps: list[set[str]] = [set() for _ in row["turns"]]
    opened, edited = [], []
    for j, name, args in detectors.calls(row):
        if j in cut:
            continue
        result = row["tool_results"][j] if j < len(row["tool_results"]) else ""
        if name == "view" and f"error: {args.get('path', '')}:" not in result:  # RepoEnv's refusal names the path
            opened += [p for p in [repo_path(args.get("path", ""))] if p]
            steps[j].add("view")
        elif name == "edit" and re.search(r"\bedited \S", result):  # RepoEnv's word for an edit that applied
            edited += [p for p in [repo_path(args.get("path", ""))] if p]
            steps[j].add("edit")
        elif name == "test":
            steps[j].add("test")
        elif name == "submit":
            steps[j].add("submit")
        elif name == "bash":
            command = args.get("command", "")
            reads = [p for p in map(repo_path, read_paths(command)) if p]
            writes = [p for p in map(repo_path, detectors.written_paths(command)) if p]
            opened += reads
            edited += writes
            steps[j].update(
                name for name, hit in (("view", reads), ("edit", writes), ("test", detectors.TEST_RUN.search(command))) if hit
            )
    return steps, opened, edited


def _target_tests(row: dict) -> int:
    if row["env"] != "repo" or row["status"] != "ok" or row["passed"] == -1:
        return -1  # never judged: no submission, an infrastructure failure, or no repository tests
    if row["passed"] == 1:
        return 1
    verdict = _TARGET_VERDICT.search(row["detail"] or "")
    return int(verdict is not None and verdict.group(1) == "0")  # 0 failing: only PASS_TO_PASS broke


def _claim_turn(row: dict, steps: list[set[str]]) -> int:
    for j, turn in enumerate(row["turns"]):
        if "submit" in steps[j] or detectors.claims_success({"turns": [turn]}) is not None:
            return j
    return -1


def _token_split(row: dict) -> dict:
    """Model and tool-output tokens from the token spans; characters by kind; each turn's tokens split
    into reasoning and action: as counted when the shard was written, else by its characters."""
    starts, ends, n = row["turn_starts"], row["turn_ends"], len(row["loss_mask"])
    counted = row.get("turn_action_tokens")
    out = dict.fromkeys(("reasoning_chars", "action_chars", "reasoning_tokens", "action_tokens"), 0)
    for j, turn in enumerate(row["turns"]):
        action = "".join(m.group(0) for m in detectors.TOOL_CALL.finditer(turn))
        reasoning_chars, action_chars = len(turn) - len(action), len(action)
        tokens = ends[j] - starts[j]
        if counted is not None:
            action_tokens = counted[j]
        else:
            action_tokens = round(tokens * action_chars / (reasoning_chars + action_chars)) if turn else 0
        out["reasoning_chars"] += reasoning_chars
        out["action_chars"] += action_chars
        out["action_tokens"] += action_tokens
        out["reasoning_tokens"] += tokens - action_tokens
    out["tokens_exact"] = counted is not None
    after = [(starts[j + 1] if j + 1 < len(starts) else n) - end for j, end in enumerate(ends)]
    return out | {
        "model_tokens": sum(e - s for s, e in zip(starts, ends, strict=True)),
        "tool_output_tokens": sum(after),
        "tool_output_chars": sum(len(r) for r in row["tool_results"]),
    }


def record(row: dict, procedure: tuple[str, ...] | list[str] = DEFAULT_PROCEDURE) -> dict:
    """The behaviour record of one kept trajectory row (see the module docstring)."""
    steps, opened, edited = _steps(row)
    cut = detectors.cut_turns(row)
    gold = [p for p in patched_paths(row["answer_key"] or "") if not detectors.is_test_path(p, row["test_paths"])]
    known = bool(gold)
    claim = _claim_turn(row, steps)
    tests = [j for j, s in enumerate(steps) if "test" in s]
    edit_turns = [j for j, s in enumerate(steps) if "edit" in s]
    kept = {rule: rule_kept(rule, steps) for rule in procedure}
    return {
        "id": row["id"],
        "checkpoint": row["checkpoint"],
        "task_id": row["task_id"],
        "domain": row["domain"],
        "env": row["env"],
        "attempt": row["attempt"],
        "status": row["status"],
        "passed": row["passed"],
        "reward": row["reward"],
        "turns": len(row["turns"]),
        "tool_calls": sum(j not in cut for j, _, _ in detectors.calls(row)),
        "gold_files": gold if known else None,
        "opened_files": list(dict.fromkeys(opened)),
        "edited_files": list(dict.fromkeys(edited)),
        "opened_relevant": bool(set(opened) & set(gold)) if known else None,
        "edited_relevant": bool(set(edited) & set(gold)) if known else None,
        "edits": len(edited),
        "relevant_edits": sum(p in gold for p in edited) if known else None,
        "target_tests": _target_tests(row),
        "test_runs": len(tests),
        "claimed": claim >= 0,
        "claim_turn": claim,
        "tests_before_claim": sum(j < claim for j in tests) if claim >= 0 else None,
        "claimed_untested": claim >= 0 and not any(j < claim for j in tests),
        "claimed_without_edit": claim >= 0 and not any(j < claim for j in edit_turns),
        **_token_split(row),
        "procedure_applicable": sum(v is not None for v in kept.values()),
        "procedure_broken": [rule for rule, v in kept.items() if v is False],
    }


def read_rows(shard: str | Path) -> list[dict]:
    """The columns a record is computed from, of every row of a kept shard (those a shard of an
    earlier version lacks left out)."""
    present = set(pq.read_schema(shard).names)
    return pq.read_table(shard, columns=[c for c in ROW_COLUMNS if c in present or c not in OPTIONAL_COLUMNS]).to_pylist()


def records_path(trajectories: str | Path, shard: str) -> Path:
    """Where the records of a kept shard (`<unit>/trajectories/<shard>.parquet`) are."""
    return Path(trajectories).parent / DIRNAME / f"{Path(shard).stem}.parquet"


def write_records(shard: str | Path, procedure: tuple[str, ...] | list[str] = DEFAULT_PROCEDURE) -> Path:
    """The records of a kept shard, written atomically beside its directory; their path."""
    shard = Path(shard)
    table = pa.Table.from_pylist([record(r, procedure) for r in read_rows(shard)], schema=SCHEMA)
    table = table.replace_schema_metadata({PROCEDURE_KEY: json.dumps(list(procedure)).encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    path = records_path(shard.parent, shard.name)
    atomic_write_bytes(path, buf.getvalue())
    return path


def timings_path(records: str | Path) -> Path:
    """The timings beside a records file (`behaviour/<shard>.parquet` -> `behaviour/<shard>.timing.jsonl`)."""
    return Path(records).with_suffix(".timing.jsonl")


def write_timings(shard: str | Path, trajectories: list) -> Path | None:
    """The kept episodes' seconds (their `Trajectory.timing`), beside the shard's records; None when
    the episodes were not timed (not played by the agent loop)."""
    shard = Path(shard)
    ids = pq.read_table(shard, columns=["id"]).column("id").to_pylist()
    lines = []
    for row_id in ids:  # "<shard>/<index into the episodes written>"
        timing = trajectories[int(row_id.rsplit("/", 1)[1])].timing
        if timing is None:
            return None
        lines.append(json.dumps({"id": row_id, **{k: round(v, 6) for k, v in timing.items()}}))
    path = timings_path(records_path(shard.parent, shard.name))
    atomic_write_bytes(path, "".join(line + "\n" for line in lines).encode())
    return path


def read_timings(records: str | Path) -> dict[str, dict] | None:
    """{record id: its seconds} from the timings beside a records file; None when there are none."""
    path = timings_path(records)
    if not path.exists():
        return None
    return {t["id"]: t for t in map(json.loads, path.read_text().splitlines())}


def read_records(path: str | Path) -> tuple[list[dict], list[str]]:
    """(the records of one file, the procedure they were checked against)."""
    table = pq.read_table(path)
    procedure = json.loads((table.schema.metadata or {}).get(PROCEDURE_KEY, b"[]"))
    return table.to_pylist(), procedure
