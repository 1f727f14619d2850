"""`snowcat scan-data RUN --grep PATTERN [--stage SFT] [--out FILE] [--json]`: a behaviour traced to the
training data: how many of each SFT unit's demonstrations show a pattern, by source, with examples.

SFT does not keep its demonstrations' text in the run directory, so they are read back from where
SFT read them (stages/sft.py, `_train`), per source of the unit's `mix` with a weight > 0:
    tasks            the tasks stage's train split: a repository task's demonstration is the scripted
                     expert's episode the SFT unit kept (`teacher_demos.json`; with `explore_fraction`,
                     a second one for some tasks), any other task's its worked solution (`Task.messages()`)
    traces           each file of the unit's `traces`, as it is now (SFT keeps no copy: a file changed
                     or moved since is read as it is, or reported missing)
    teacher:<stage>  the teacher stage's `demos.jsonl` (stages/agent/demos.py `read_demos`)
Scanned: the assistant turns (reasoning and tool calls, as snowcat's template renders them), the text
SFT trains on; not the prompts or tool results. Not covered, and said so in the report: Relay
variants (`relay_fraction`: a prefix or a one-character corruption of a task's own worked solution,
so they show what the plain demonstration shows), and how often each demonstration was repeated
(`mix` weights, `domain_repeats`: the counts are of distinct demonstrations; the weights are shown).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, nan_to_null
from snowcat.pipeline.rundir import RunDir
from snowcat.stages.agent.demos import read_demos
from snowcat.stages.agent.traces import TraceError, import_traces
from snowcat.stages.config import TEACHER_PREFIX
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.tokenizer import message_text

from .compare import compile_pattern

EXAMPLES = 3
# stages/sft.py `DEMOS_FILE` and `EXPLORING`, named here because the CLI may not import a stage kind (tested equal)
SFT_DEMOS_FILE = "teacher_demos.json"
SFT_EXPLORING = "#explore"


@dataclass
class Demonstration:
    source: str  # tasks | traces | teacher:<stage>
    ident: str  # the task id, trace file#n, or teacher demonstration id
    text: str  # its assistant turns


def trained_text(messages: list[dict]) -> str:
    """The assistant turns of a conversation as snowcat's template renders them (tool calls included)."""
    return "\n".join(message_text(m) for m in messages if m.get("role") == "assistant" and m.get("train", True))


def task_demonstrations(run: RunDir, unit_dir: Path, cfg) -> tuple[list[Demonstration], list[str]]:
    """The `tasks` source, and what of it could not be read."""
    try:
        tasks = load_tasks(run.stage_dir(cfg.tasks_input), "train")
    except FileNotFoundError:
        return [], [f"tasks: the tasks stage {cfg.tasks_input!r} has no train split in {run.path}"]
    expert_file = unit_dir / SFT_DEMOS_FILE
    expert = json.loads(expert_file.read_text())["demos"] if expert_file.is_file() else {}
    out, missing = [], 0
    for t in tasks:
        messages = expert.get(t.task_id) if t.verifier == "repo" else t.messages()
        if messages is None:
            missing += 1
            continue
        out.append(Demonstration("tasks", t.task_id, trained_text(messages)))
        if (second := t.task_id + SFT_EXPLORING) in expert:  # the task's exploring demonstration (explore_fraction)
            out.append(Demonstration("tasks", second, trained_text(expert[second])))
    notes = [f"tasks: {missing} repository task(s) without the expert's episode in {expert_file}"] if missing else []
    return out, notes


def trace_demonstrations(paths: list[str]) -> tuple[list[Demonstration], list[str]]:
    out, notes = [], []
    for path in paths:
        try:
            conversations = import_traces(path)
        except FileNotFoundError:
            notes.append(f"traces: {path} not found (SFT keeps no copy of its trace files)")
            continue
        except (OSError, TraceError) as e:
            notes.append(f"traces: {path}: {e}")
            continue
        out += [Demonstration("traces", f"{path}#{i}", trained_text(c)) for i, c in enumerate(conversations)]
    return out, notes


def unit_demonstrations(run: RunDir, unit_dir: Path, cfg) -> tuple[dict[str, list[Demonstration]], dict[str, float], list[str]]:
    """(source -> its demonstrations, source -> mix weight, notes on what was not read) of one SFT unit."""
    mix = dict(cfg.mix) or {"tasks": 1.0, "traces": 1.0}  # stages/sft.py's default
    sources: dict[str, list[Demonstration]] = {}
    notes: list[str] = []
    if mix.get("tasks", 0) > 0:
        sources["tasks"], missing = task_demonstrations(run, unit_dir, cfg)
        notes += missing
    if mix.get("traces", 0) > 0 and cfg.traces:
        sources["traces"], missing = trace_demonstrations(list(cfg.traces))
        notes += missing
    for source, weight in sorted(mix.items()):
        kind, _, stage = source.partition(":")
        if kind != TEACHER_PREFIX or weight <= 0:
            continue
        try:
            demos = read_demos(run.stage_dir(stage))
        except FileNotFoundError as e:
            notes.append(f"{source}: {e}")
            continue
        sources[source] = [Demonstration(source, d["id"], trained_text(d["messages"])) for d in demos]
    if getattr(cfg, "relay_fraction", 0) > 0:
        notes.append(
            f"tasks: Relay variants (relay_fraction {cfg.relay_fraction:g}) not scanned: they are cut from the same worked solutions"
        )
    return sources, {s: mix[s] for s in sources if s in mix}, notes


def _excerpt(text: str, start: int, end: int, margin: int = 60) -> str:
    left, right = max(0, start - margin), min(len(text), end + margin)
    return ("…" if left else "") + " ".join(text[left:right].split()) + ("…" if right < len(text) else "")


def scan(run_dir: str | Path, pattern_text: str, stage: str | None = None) -> dict:
    """Per SFT unit and source: demonstrations, how many match, examples (see the module docstring)."""
    pattern = compile_pattern(pattern_text)  # refused before anything is read
    run = RunDir.open(run_dir)
    dag = build(run.config())
    nodes = dag.of_kind("sft", stage, run.path, "scan-data reads what an sft stage trained on")
    if not nodes:
        raise UserError(f"{run.path}: no sft stage")
    composed = run.config()
    units = {}
    for node in nodes:
        for unit in node.units:
            cfg = node.config if unit.index is None else config_mod.unit_config(composed, node.name, node.items[unit.index])
            sources, weights, notes = unit_demonstrations(run, run.unit_dir(unit), cfg)
            units[unit.key] = {"sources": {}, "notes": notes}
            for source, demos in sources.items():
                hits = [(d, m) for d in demos if (m := pattern.search(d.text))]
                units[unit.key]["sources"][source] = {
                    "weight": weights.get(source),
                    "demonstrations": len(demos),
                    "matched": len(hits),
                    "rate": len(hits) / len(demos) if demos else math.nan,
                    "examples": [{"id": d.ident, "excerpt": _excerpt(d.text, m.start(), m.end())} for d, m in hits[:EXAMPLES]],
                }
    return {"run": str(run.path), "pattern": pattern_text, "units": units}


def render(report: dict) -> str:
    lines = [
        f"# Demonstrations matching `{report['pattern']}`",
        "",
        f"Run `{report['run']}`. The assistant turns (reasoning and tool calls) of each SFT unit's distinct "
        "demonstrations, by source; weight: the source's `mix` weight (repeats per epoch, not in the counts).",
    ]
    for unit, u in report["units"].items():
        lines += [
            "",
            f"## {unit}",
            "",
            "| source | weight | matched / demonstrations | rate |",
            "|---|---|---|---|",
        ]
        for source, s in u["sources"].items():
            rate = "n/a" if math.isnan(s["rate"]) else f"{s['rate']:.3f}"
            weight = "-" if s["weight"] is None else f"{s['weight']:g}"
            lines.append(f"| {source} | {weight} | {s['matched']} / {s['demonstrations']} | {rate} |")
        examples = [f"- {source} `{e['id']}`: {e['excerpt']}" for source, s in u["sources"].items() for e in s["examples"]]
        lines += ["", "Examples:", "", *examples] if examples else []
        lines += ["", "Not covered:", "", *(f"- {n}" for n in u["notes"])] if u["notes"] else []
    return "\n".join(lines) + "\n"


def add_scan_data_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("--grep", metavar="PATTERN", required=True, help="a regular expression")
    parser.add_argument("--stage", help="only this sft stage (default: every sft stage)")
    parser.add_argument("--out", metavar="FILE", help="write the Markdown here and the JSON beside it")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")


def cmd_scan_data(args) -> int:
    report = scan(args.run, args.grep, args.stage)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out.with_suffix(".json"), nan_to_null(report))
        atomic_write_text(out, render(report))
    if args.json:
        print(json.dumps(nan_to_null(report), indent=2))
    else:
        print(render(report), end="")
    return 0
