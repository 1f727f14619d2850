"""Kept trajectories: the episodes of probe, evaluate and RL as columnar Parquet shards with a manifest.

Layout of `<unit dir>/trajectories/` (docs/analysis.md):
    <shard>.parquet   one row per episode, the columns of `SCHEMA` (probe: one shard; evaluate: one
                      per checkpoint; RL: one per update, `step_NNNNNN`)
    README.md         the dataset card, rewritten atomically after each shard: its YAML header holds
                      the `configs` that Hugging Face `datasets` reads and the manifest (`snowcat:`
                      every shard with its rows, the episodes it was sampled from, checkpoint and
                      step); the manifest is there and not in a JSON file beside the shards
                      because `datasets` takes every other file of the directory for data. The card
                      is hashed with the unit's outputs, so it holds nothing volatile (no timings:
                      a stage reports those as metrics named with a time unit, pipeline/volatile.py),
                      and a reproduction writes it byte for byte again
Every shard has the same schema, so the directory is one dataset:
    datasets.load_dataset(dir, split="train")                              # the card's configs
    datasets.load_dataset("parquet", data_dir=dir, split="train")          # the card is skipped
    pyarrow.dataset.dataset(sorted(Path(dir).glob("*.parquet")), format="parquet")

Rows hold the exact token ids, mask and rollout logprobs, and their readings: each model turn's
text, the tool call it made (parsed as its environment parses it) and the tool result that
followed, so trace analytics (`pipeline/reports/traces.py`) need no tokenizer. A shard rewritten under the
same name (an RL update replayed after a resume) replaces the old one.
"""

from __future__ import annotations

import io
import json
import re
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from snowcat.pipeline.fsio import atomic_write_bytes
from snowcat.stages.agent.detectors import TOOL_CALL
from snowcat.stages.agent.envs import CalcError, _strip_stop, calculate
from snowcat.stages.agent.repo_env import ToolCallError, parse_tool_call
from snowcat.stages.agent.trajectory import FIELDS, Trajectory, pack, unpack
from snowcat.stages.taskgen.repo import RepoSpec, patched_paths

DIRNAME = "trajectories"
CARD = "README.md"
FORMAT = 2  # 1: manifest.json beside the shards (which `load_dataset("parquet", data_dir=...)` read as data)

_strings = pa.list_(pa.string())
SCHEMA = pa.schema(
    [
        ("id", pa.string()),  # "<shard>/<index in the sampled batch>": how reports cite an episode
        ("stage", pa.string()),
        ("checkpoint", pa.string()),  # the checkpoint reference that sampled it ("" in RL: see step)
        ("step", pa.int64()),  # RL update whose batch it was; -1 elsewhere
        ("env", pa.string()),
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("group_id", pa.int64()),
        ("attempt", pa.int64()),
        ("policy_version", pa.int64()),
        ("source", pa.string()),  # who sampled it: "policy", or "teacher" (RL's teacher rollouts)
        ("reward", pa.float64()),
        ("status", pa.string()),
        ("passed", pa.int8()),  # 1 passed, 0 not, -1 not scored (infra_error): the scorer's verdict
        ("detail", pa.string()),
        ("prompt_len", pa.int64()),
        ("response_tokens", pa.int64()),  # tokens the model sampled (loss mask 1)
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("turn_starts", pa.list_(pa.int64())),
        ("turn_ends", pa.list_(pa.int64())),
        ("turn_action_tokens", pa.list_(pa.int64())),  # per turn: its tokens that spell a tool call
        ("text", pa.string()),  # the whole episode rendered (special tokens shown)
        ("prompt", pa.string()),
        ("turns", _strings),  # each model turn's text (stop id stripped)
        ("tool_names", _strings),  # per turn: the tool called ("" none)
        ("tool_args", _strings),  # per turn: its arguments as JSON ("" none)
        ("tool_errors", _strings),  # per turn: why the call is invalid ("" valid or no call)
        ("tool_results", _strings),  # per turn: the context appended after it (tool result, note)
        ("answer_key", pa.string()),  # the task's expected answer (null where unknown)
        ("test_paths", _strings),  # repository tasks: the files the verifier restores (tests)
    ]
)


def tool_call(env: str, text: str) -> tuple[str, str, str]:
    """(tool name, arguments as JSON, error) of one model turn, read as environment `env` reads it."""
    if env == "repo":
        try:
            name, args = parse_tool_call(text)
        except ToolCallError as e:
            return "", "", str(e)
        return name, json.dumps(args, sort_keys=True), ""
    if env == "calculator" and "<tool_call>" in text:
        m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
        if m is None:
            return "calculator", "", "no </tool_call>"
        expr = m.group(1)
        try:
            calculate(expr)
        except CalcError as e:
            return "calculator", json.dumps({"expression": expr}), str(e)
        return "calculator", json.dumps({"expression": expr}), ""
    return "", "", ""


def tool_call_tokens(tok, ids: list[int], text: str, stop_tokens: int = 0) -> int:
    """How many of a turn's tokens spell its tool calls (`detectors.TOOL_CALL` in `text`, the turn
    `ids` decoded): a token counts when the characters it adds to the decoded prefix overlap a call;
    the turn's `stop_tokens` (its end-of-turn id, stripped from `ids`) count with a call that ends
    the turn. Exact for the ids as sampled (a prefix decoded at a time; turns are short)."""
    spans = [m.span() for m in TOOL_CALL.finditer(text)]
    if not spans:
        return 0
    count, before = 0, 0
    for k in range(1, len(ids) + 1):
        after = len(tok.decode(ids[:k]))
        count += any(start < after and before < end for start, end in spans)
        before = after
    return count + (stop_tokens if spans[-1][1] >= len(text.rstrip()) else 0)


def _task_fields(task) -> dict:
    if task is None:
        return {"answer_key": None, "test_paths": []}
    paths = []
    if task.verifier == "repo":  # the files the verifier puts back before testing
        spec = RepoSpec.from_task(task)
        paths = sorted(set(spec.test_paths) | set(patched_paths(spec.test_patch)))
    return {"answer_key": task.answer, "test_paths": paths}


def episode_row(
    t: Trajectory,
    tok,
    *,
    env: str,
    stage: str,
    shard: str,
    index: int,
    checkpoint: str,
    step: int,
    task=None,
    passed: int | None = None,
) -> dict:
    """One episode as a row of `SCHEMA`; `passed` defaults to full credit (`Trajectory.passed`)."""
    ids = [int(i) for i in t.token_ids]
    bounds = t.turn_boundaries
    turns, names, args, errors, results, action_tokens = [], [], [], [], [], []
    for j, (start, end) in enumerate(bounds):
        turn_ids = _strip_stop(tok, ids[start:end])
        text = tok.decode(turn_ids)
        action_tokens.append(tool_call_tokens(tok, turn_ids, text, end - start - len(turn_ids)))
        name, arg, error = tool_call(env, text)
        after = bounds[j + 1][0] if j + 1 < len(bounds) else len(ids)
        turns.append(text)
        names.append(name)
        args.append(arg)
        errors.append(error)
        results.append(tok.decode(ids[end:after], skip_special_tokens=True).strip())
    return {
        "id": f"{shard}/{index}",
        "stage": stage,
        "checkpoint": checkpoint,
        "step": step,
        "env": env,
        "task_id": t.task_id,
        "domain": t.domain,
        "group_id": t.group_id,
        "attempt": t.attempt,
        "policy_version": t.policy_version,
        "source": t.source,
        "reward": float(t.reward),
        "status": t.status,
        "passed": -1 if t.status == "infra_error" else int(t.passed if passed is None else passed),
        "detail": t.detail,
        "prompt_len": t.prompt_len,
        "response_tokens": int(t.loss_mask.sum()),
        "token_ids": t.token_ids,
        "loss_mask": t.loss_mask,
        "rollout_logprobs": t.rollout_logprobs,
        "turn_starts": [s for s, _ in bounds],
        "turn_ends": [e for _, e in bounds],
        "turn_action_tokens": action_tokens,
        "text": tok.decode(ids),
        "prompt": tok.decode(ids[: t.prompt_len]),
        "turns": turns,
        "tool_names": names,
        "tool_args": args,
        "tool_errors": errors,
        "tool_results": results,
        **_task_fields(task),
    }


def shard_name(label: str) -> str:
    """A file-name-safe shard name for a checkpoint reference or step ("sft:final" -> "sft_final")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "shard"


def sample_indices(n: int, keep: int | None, seed: int, shard: str) -> list[int]:
    """Which of a shard's `n` episodes are kept: all (keep None), or `keep` drawn with a generator
    seeded by (seed, shard), so a rerun keeps the same ones."""
    if keep is None or keep >= n:
        return list(range(n))
    rng = np.random.default_rng([seed, zlib.crc32(shard.encode())])
    return sorted(int(i) for i in rng.choice(n, size=keep, replace=False))


class TrajectoryWriter:
    """Appends shards to `<root>` (a unit's `trajectories/`); `keep` from `stages.config.keep_trajectories`
    (None all, 0 none: nothing is written, n a seeded sample per shard)."""

    def __init__(self, root: str | Path, *, stage: str, env: str, keep: int | None, seed: int):
        self.root, self.stage, self.env, self.keep, self.seed = Path(root), stage, env, keep, seed

    def write(
        self,
        label: str,
        trajs: list[Trajectory],
        tok,
        *,
        checkpoint: str = "",
        step: int = -1,
        tasks: dict | None = None,
        passed: list[int] | None = None,
    ) -> Path | None:
        """Shard `label` (a checkpoint or `step_N`) of these episodes, then the manifest; the shard's path.
        `passed`: the verifier's verdict per episode where the scorer has one (evaluate's single turn:
        partial credit can reach reward 1 without a pass)."""
        if self.keep == 0:
            return None
        shard = shard_name(label)
        kept = sample_indices(len(trajs), self.keep, self.seed, shard)
        rows = [
            episode_row(
                trajs[i],
                tok,
                env=self.env,
                stage=self.stage,
                shard=shard,
                index=i,
                checkpoint=checkpoint,
                step=step,
                task=(tasks or {}).get(trajs[i].task_id),
                passed=None if passed is None else passed[i],
            )
            for i in kept
        ]
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), buf, compression="zstd")
        path = self.root / f"{shard}.parquet"
        atomic_write_bytes(path, buf.getvalue())
        manifest = read_manifest(self.root) or {"format": FORMAT, "stage": self.stage, "env": self.env, "shards": {}}
        manifest["shards"][shard] = {
            "file": path.name,
            "rows": len(rows),
            "episodes": len(trajs),
            "checkpoint": checkpoint,
            "step": step,
        }
        manifest["keep"] = "all" if self.keep is None else f"sample:{self.keep}"
        atomic_write_bytes(self.root / CARD, dataset_card(manifest).encode())
        return path


def dataset_card(manifest: dict) -> str:
    """The directory's README.md: `datasets` configs and the manifest in its YAML header, a summary below."""
    header = {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "*.parquet"}]}],
        "snowcat": manifest,
    }
    shards = manifest["shards"].values()
    lines = [
        f"# Trajectories kept by stage `{manifest['stage']}` (env `{manifest['env']}`)",
        "",
        f"{sum(s['rows'] for s in shards)} episodes in {len(manifest['shards'])} Parquet shard(s), one row per "
        f"episode, kept: {manifest['keep']}. Written by snowcat (stages/agent/dataset.py; columns in docs/analysis.md).",
        "",
        "| shard | rows | episodes sampled | checkpoint | step |",
        "|---|---|---|---|---|",
        *(f"| {s['file']} | {s['rows']} | {s['episodes']} | {s['checkpoint'] or '-'} | {s['step']} |" for s in shards),
    ]
    return f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n" + "\n".join(lines) + "\n"


def read_manifest(root: str | Path) -> dict | None:
    """The manifest in the directory's dataset card (None: no card, nothing kept yet)."""
    try:
        text = (Path(root) / CARD).read_text()
    except FileNotFoundError:
        return None
    _, header, _ = text.split("---\n", 2)
    return yaml.safe_load(header)["snowcat"]


def read_rows(root: str | Path) -> list[dict]:
    """Every row of the shards the manifest lists (a shard it does not list is an unfinished write)."""
    manifest = read_manifest(root)
    if manifest is None:
        return []
    out = []
    for entry in manifest["shards"].values():
        out += pq.read_table(Path(root) / entry["file"]).to_pylist()
    return out


def trajectories(rows: list[dict]) -> list[Trajectory]:
    """The `Trajectory` records back from rows (kept fields; supports and routes are not kept)."""
    return [
        Trajectory(
            task_id=r["task_id"],
            group_id=r["group_id"],
            attempt=r["attempt"],
            policy_version=r["policy_version"],
            source=r.get("source") or "policy",  # shards written before the column: the policy's
            token_ids=np.asarray(r["token_ids"], np.int32),
            loss_mask=np.asarray(r["loss_mask"], np.uint8),
            rollout_logprobs=np.asarray(r["rollout_logprobs"], np.float32),
            reward=r["reward"],
            status=r["status"],
            turn_boundaries=list(zip(r["turn_starts"], r["turn_ends"])),
            domain=r["domain"],
            prompt_len=r["prompt_len"],
            detail=r["detail"],
        )
        for r in rows
    ]


def save_played(path: str | Path, key: str, trajs: list[Trajectory]) -> None:
    """A finished batch of episodes kept for a resumed stage (`partial/`), under `key`: what it depends on."""
    buf = io.BytesIO()
    np.savez(buf, key=np.frombuffer(key.encode(), np.uint8), **pack(trajs))
    atomic_write_bytes(path, buf.getvalue())


def load_played(path: str | Path, key: str) -> list[Trajectory] | None:
    """The batch `save_played` kept at `path`, or None when absent or kept under another key."""
    if not Path(path).is_file():
        return None
    with np.load(path) as z:
        if z["key"].tobytes().decode() != key:
            return None
        return unpack({name: z[name] for name in FIELDS})
