"""The provenance card: a Markdown model card (with Hugging Face model-card YAML) from recorded facts only.

Every statement comes from a file of the run directory: run.json, config.yaml, the stages' outputs
(tasks parquet files, checkpoint manifests, retention ledgers, evaluate results.json, export.json)
and provenance records. A fact that is not recorded is written as "not recorded", never guessed.
`snowcat card RUN [-o FILE]` prints or writes it; the `card` stage writes `card.md` into the run.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from snowcat.stages.agent.demos import read_demos
from snowcat.stages.agent.detectors import DETECTORS
from snowcat.stages.config import prompt_stage
from snowcat.stages.taskgen.rows import SOURCES

from . import compare, plot
from . import config as config_mod
from .dag import Unit, build
from .errors import UserError
from .fsio import atomic_write_text, checkpoint_dir, read_json, sha256_file
from .plan import compare as plan_compare
from .provenance import record_path
from .rundir import RunDir
from .scrub import scrub_text
from .sweep import input_units, ref_unit, unit_path
from .traces import reward_hack_counts

NR = "not recorded"
TRAINING_KINDS = ("sft", "rl")


def _v(value: Any, fmt: str = "{}") -> str:
    return NR if value is None or value == "" else fmt.format(value)


def _percent(x: Any) -> str:
    return NR if x is None else f"{100 * x:.1f}%"


def _pct(x: Any, se: Any = None) -> str:
    if x is None:
        return NR
    return f"{100 * x:.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")


class Facts:
    """What the run directory records, read once."""

    def __init__(self, run: RunDir):
        self.run = run
        self.info = run.info
        self.cfg = run.config()
        self.dag = build(self.cfg)
        self.config_sha256 = sha256_file(run.path / "config.yaml")

    def nodes(self, *kinds: str):
        return [n for n in self.dag if n.kind in kinds]

    def done(self, name: str) -> bool:
        return all(self.run.is_done(u) for u in self.dag[name].units)

    def stage_dir(self, name: str) -> Path:
        return self.run.stage_dir(name)

    def units(self, node) -> list[tuple[str, Any, Any]]:
        """(label, the config it ran with, unit) per unit: a sweep unit's own values set, its label
        naming them as a reference does (`rl[estimator=grpo,lr=0.001]`). A fanned-out stage's
        directory holds only its units' directories, so every reader of a stage's files goes
        through this; a plain stage is its one unit, labelled with the stage's name."""
        return [(self.label(u), self.unit_config(u), u) for u in node.units]

    def label(self, unit) -> str:
        item = self.dag[unit.stage].items[unit.index] if unit.index is not None else None
        return unit.stage if item is None else f"{unit.stage}[{','.join(f'{k}={v}' for k, v in item.items())}]"

    def unit_config(self, unit):
        node = self.dag[unit.stage]
        return node.config if unit.index is None else config_mod.unit_config(self.cfg, node.name, node.items[unit.index])

    def unit_dir(self, unit) -> Path:
        return self.run.unit_dir(unit)

    def ref_unit(self, ref: str | None) -> Unit | None:
        """The unit a checkpoint reference (`rl[estimator=grpo]:best`, `sft:final`) names; None: no
        stage of this run (an `hf:` model, a malformed reference)."""
        try:
            stage, index, _ = ref_unit(ref or "", {n: node.config for n, node in self.dag.nodes.items()})
        except (ValueError, UserError):
            return None
        return Unit(stage, index)

    def provenance(self, name: str, index: int | None = None) -> dict | None:
        return read_json(record_path(self.run.path, name, index))

    def manifest(self, unit) -> dict:
        return (read_json(self.unit_dir(unit) / "manifest.json") or {}).get("files", {})


def _one_or_each(pairs: list[tuple[str, Any]]) -> Any:
    """A plain stage's value; a fanned-out stage's once when its units agree ("…, each of its N
    units"), else each unit's, labelled. None where nothing was recorded."""
    if len(pairs) == 1:
        return pairs[0][1]
    values = [v for _, v in pairs]
    if all(v == values[0] for v in values) and values[0] is not None:
        return f"{values[0]} (each of `{pairs[0][0].partition('[')[0]}`'s {len(pairs)} units)"
    return "; ".join(f"{label}: {_v(v)}" for label, v in pairs) if any(v is not None for v in values) else None


# --- sections -------------------------------------------------------------------------------------


def _initializer(f: Facts) -> tuple[list[str], dict]:
    trainers = f.nodes(*TRAINING_KINDS)
    if not trainers:
        return [f"- Initializer: {NR} (the run has no training stage)"], {}
    # the first training stage's `checkpoints/initial`, per unit: a sweep over `init_from`, `model` or
    # a replica (another seed) starts each unit elsewhere
    blocks = [_unit_initializer(f, label, config, unit) for label, config, unit in f.units(trainers[0])]
    lines = [line for block, _ in blocks for line in block]
    if len(blocks) == 1:
        return lines, blocks[0][1]
    digests = {label: m["initializer_manifest_sha256"] for (label, _, _), (_, m) in zip(f.units(trainers[0]), blocks)}
    bases = sorted({m["base_model"] for _, m in blocks if m.get("base_model")})
    meta = {"initializer_manifest_sha256": digests} | ({"base_model": bases[0] if len(bases) == 1 else bases} if bases else {})
    return lines, meta


def _unit_initializer(f: Facts, label: str, c, unit) -> tuple[list[str], dict]:
    init = f.unit_dir(unit) / "checkpoints" / "initial"
    manifest = init / "manifest.json"
    digest = sha256_file(manifest) if manifest.is_file() else None
    weights = {k: v["sha256"] for k, v in (read_json(manifest) or {}).get("files", {}).items() if k.endswith(".safetensors")}
    meta = read_json(init / "meta.json") or {}
    source = c.init_from
    lineage = meta.get("lineage") or {}
    if lineage:
        where = f"hub id `{lineage['hub_id']}`" if lineage.get("hub_id") else "a local directory"
        what = (
            f"pretrained checkpoint `{lineage['source']}` (named by `stages.{unit.stage}.model`; {where}, "
            f"revision {_v(lineage.get('revision'))}, license {_v(lineage.get('license'))})"
        )
    elif source:
        what = f"checkpoint `{source}` (named by `stages.{unit.stage}.init_from`)"
    else:
        what = f"fresh initialization of the `{_v(c.model)}` preset, seed {_v(meta.get('seed'))}"
    of = "" if unit.index is None else f" of `{label}`"
    lines = [
        f"- Initializer{of}: {what}",
        f"- Initializer checkpoint{of}: `{f.run.path.name}/{init.relative_to(f.run.path)}`, manifest sha256 `{_v(digest)}`",
    ]
    lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(weights.items())]
    if lineage:
        lines.append(f"- Pretrained source files (as loaded; staged copy sha256 `{_v(lineage.get('staged_sha256'))}`):")
        lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(lineage.get("files", {}).items())]
        return lines, {"initializer_manifest_sha256": digest, "base_model": lineage.get("hub_id") or lineage["source"]}
    return lines, {"initializer_manifest_sha256": digest}


def _domain_counts(path: Path) -> dict[str, int] | None:
    try:
        domains = pq.read_table(path, columns=["domain"]).column("domain").to_pylist()
    except Exception:  # no such column, or not a readable parquet file: said as not recorded
        return None
    return {d: domains.count(d) for d in sorted(set(domains))}


def _data(f: Facts) -> list[str]:
    rows = ["| stage | file | rows | per domain | sha256 |", "|---|---|---|---|---|"]
    for node in f.nodes("tasks"):
        for label, _, unit in f.units(node):
            for rel, meta in sorted(f.manifest(unit).items()):
                if not rel.endswith(".parquet"):
                    continue
                try:
                    n = pq.ParquetFile(f.unit_dir(unit) / rel).metadata.num_rows
                except Exception:
                    n = None
                counts = _domain_counts(f.unit_dir(unit) / rel)
                per = ", ".join(f"{d} {c}" for d, c in counts.items()) if counts else NR
                rows.append(f"| {label} | `{rel}` | {_v(n)} | {per} | `{meta['sha256']}` |")
    if len(rows) == 2:
        return [f"Training data: {NR} (no tasks stage outputs)."]
    rows.append("")
    rows += _task_sources(f)
    for node in f.nodes("tasks"):
        for label, _, unit in f.units(node):
            m = f.run.metrics(unit) if f.run.is_done(unit) else {}
            if "validation/checked" in m:
                excluded = ", ".join(
                    f"{k.split('/')[1].replace('_', ' ')} {v}"
                    for k, v in sorted(m.items())
                    if k.startswith("validation/") and k not in ("validation/checked", "validation/valid") and v
                )
                rows.append(
                    f"- Task validation (`{label}`): {m['validation/checked']} repository tasks run with their gold and empty "
                    f"solutions, {_v(m.get('validation/valid'))} valid; excluded: {excluded or 'none'} (reasons in `validation.json`)"
                )
    for node in f.nodes("select"):
        for label, _, unit in f.units(node):
            m = f.run.metrics(unit) if f.run.is_done(unit) else {}
            per = ", ".join(f"{k.split('/')[0]} {v}" for k, v in sorted(m.items()) if k.endswith("/selected"))
            rows.append(
                f"- RL task band (`{label}`): {_v(m.get('selected'))} of {_v(m.get('probed'))} probed tasks"
                + (f" ({per})" if per else "")
            )
    for node in f.nodes("rl"):
        seeds = [((f.provenance(u.stage, u.index) or {}).get("extra") or {}).get("seed") for u in node.units]
        whose = f"the stage seed {_v(seeds[0])}" if node.items is None else "the unit's stage seed"
        rule = (
            f"batch k is slice k of a sequence of per-epoch permutations of its task pool seeded by {whose} "
            "(`stages/rl.py: batch_tasks`), so the tasks behind any step can be recomputed; the trajectories per "
            "domain that entered the loss are the history's `exposure/<domain>`"
        )
        if getattr(node.config, "domain_weights", None):
            rule = rule.replace(
                "of its task pool", "of each weighted domain's tasks, `domain_quotas` of each per batch (`domain_weights`),"
            ).replace("rl.py: batch_tasks", "rl.py: weighted_batch_tasks")
        if node.items is None:
            rows.append(f"- `{node.name}` data order: {rule}")
            continue
        rows.append(f"- `{node.name}` data order, per unit: {rule}, summed here over each unit's updates:")
        for (label, _, unit), seed in zip(f.units(node), seeds, strict=True):
            rows.append(f"  - `{label}`: seed {_v(seed)}; exposure {_v(_exposure_text(_unit_exposure(f, unit)))}")
    return rows


def _task_sources(f: Facts) -> list[str]:
    """One line per imported task set: its format, file and sha256 as the tasks stage read it."""
    lines = []
    for node in f.nodes("tasks"):
        for label, _, unit in f.units(node):
            recorded = read_json(f.unit_dir(unit) / SOURCES) if f.run.is_done(unit) else None
            for s in (recorded or {}).get("imports", []):
                lines.append(
                    f"- Imported task set (`{label}`, `{s.get('format')}`, domain {_v(s.get('domain'))}): `{s.get('path')}`, "
                    f"sha256 `{_v(s.get('sha256'))}`; {_v(s.get('train'))} train, {_v(s.get('val'))} val tasks"
                )
    return lines


def _unit_exposure(f: Facts, unit, through: int | None = None) -> tuple[Counter, int | None]:
    """Trajectories per domain that entered a training unit's loss (its history's `exposure/<d>`),
    through step `through` (None: every update), and the last step summed."""
    totals: Counter = Counter()
    last = None
    for row in _unit_history(f, unit):
        if "step" in row and (through is None or row["step"] <= through) and any(k.startswith("exposure/") for k in row):
            totals.update({k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("exposure/")})
            last = row["step"] if last is None else max(last, row["step"])
    return totals, last


def _exposure_text(found: tuple[Counter, int | None], step: int | None = None) -> str | None:
    totals, last = found
    if not totals:
        return None
    return f"{', '.join(f'{d} {n}' for d, n in sorted(totals.items()))} trajectories in the loss through step {_v(step if step is not None else last)}"


def _recipe(f: Facts) -> list[str]:
    lines = []
    for node in f.nodes(*TRAINING_KINDS):
        for label, config, unit in f.units(node):
            lines += _unit_recipe(f, node, label, config, unit)
    return lines or [f"Recipe: {NR} (no training stage)."]


def _unit_recipe(f: Facts, node, label: str, c, unit) -> list[str]:
    """One training unit's recipe: the config it ran with, its metrics and records."""
    res = c.resources
    metrics = f.run.metrics(unit) if f.run.is_done(unit) else {}
    prov = f.provenance(unit.stage, unit.index) or {}
    world = (prov.get("extra") or {}).get("world_size")
    of = "" if unit.index is None else f", unit {unit.index} of {len(node.units)}"
    lines = [f"- `{label}` ({node.kind}{of}):"]
    if node.kind == "sft":
        lines.append(
            f"  - objective: supervised fine-tuning on task demonstrations (assistant tokens only), "
            f"Relay fraction {_v(c.relay_fraction)}"
        )
        mix = dict(getattr(c, "mix", {}) or {}) or {"tasks": 1, "traces": 1}
        lines.append(
            "  - demonstrations, weight per epoch (`mix`): "
            + ", ".join(f"{src} ×{w:g}" for src, w in sorted(mix.items()))
            + (
                "; teacher:<stage>: that stage's verified successes, each with its provenance in demos.jsonl"
                if any(k.startswith("teacher:") for k in mix)
                else ""
            )
        )
        teachers = [src for src, w in sorted(mix.items()) if src.startswith("teacher:") and w > 0]
        lines += [line for src in teachers for line in _teacher_demos(f, src)]
        lines.append(f"  - batch: {_v(c.batch_rows)} packed rows × {_v(c.seq_len)} tokens, {_v(c.micro_batches)} micro-batch(es)")
        lines.append(
            f"  - lr {_v(c.lr)} ({_v(c.schedule)}, warmup {_v(c.warmup_steps)}, "
            f"min ratio {_v(c.min_lr_ratio)}), weight decay {_v(c.weight_decay)}, grad clip {_v(c.grad_clip)}"
        )
        lines.append(f"  - updates: {_v(metrics.get('steps'))} completed of {_v(c.steps)} configured")
    else:
        lines.append(
            f"  - estimator: {_v(c.estimator)}, aggregation {_v(c.aggregation)}, "
            f"truncated importance sampling cap {_v(c.tis_cap)}, staleness lag {_v(c.lag)}"
        )
        lines.append(f"  - batch: {_v(c.tasks_per_update)} tasks × {_v(c.attempts)} attempts per update")
        lines.append(f"  - lr {_v(c.lr)}, KL coef {_v(c.kl_coef)}")
        lines += _rl_recipe_lines(c)
        if getattr(c, "teacher_rollouts", 0):
            lines.append(_teacher_rollouts(f, c, unit))
        lines.append(f"  - updates: {_v(metrics.get('updates', metrics.get('steps')))} completed of {_v(c.updates)} configured")
    meta = _checkpoint_meta(f.run.unit_dir(unit))
    name = meta.get("backend") or getattr(c, "backend", None)  # what the checkpoint says ran, else the config
    zero = {"deepspeed": f" ZeRO-{c.zero_stage}", "fsdp": " (ZeRO-3)"}.get(name, "")
    backend = f"{name}{zero}" if name else NR
    lines.append(f"  - layout: {_layout(node, world, meta)}; backend {backend}; resources {_shapes(res)}")
    lines += _precision_lines(metrics)
    return lines


def _rl_recipe_lines(c) -> list[str]:
    """An RL unit's task mix (rehearsal weights) and rollout prompt, from its config (docs/recipes.md)."""
    weights = dict(getattr(c, "domain_weights", {}) or {})
    if weights:
        total = sum(w for w in weights.values() if w > 0)
        trained = ", ".join(f"{d} {w / total:.3g}" for d, w in sorted(weights.items()) if w > 0)
        held = ", ".join(d for d, w in sorted(weights.items()) if w <= 0)
        mix = (
            f"  - task mix (`domain_weights`): every batch {trained} of its tasks (floor or ceiling of each share)"
            + (f"; held out, not trained: {held}" if held else "")
            + "; held-out pass@1 per domain in the history"
        )
    elif getattr(c, "domains", None):
        mix = f"  - task mix: the pool of domains {', '.join(c.domains)} as it comes (no `domain_weights`)"
    else:
        mix = "  - task mix: the task pool as it comes (no `domain_weights`)"
    prompt = getattr(c, "rollout_prompt", "")
    if prompt and (chooser := prompt_stage(prompt)) is not None:
        return [
            mix,
            f"  - rollout prompt: the one prompt-selection stage `{chooser}` chose (its prompts.json: the candidates, "
            "their paired statistics on development tasks, the choice and its sha256; an empty choice is ordinary RL): "
            "in the context sampled in, removed from the update's context; gap per turn in the history (`prompt_gap/*`)",
        ]
    if prompt:
        digest = hashlib.sha256(prompt.encode()).hexdigest()[:16]
        return [
            mix,
            f"  - rollout prompt (sha256 {digest}…, {len(prompt)} characters): in the context sampled in, removed from "
            "the update's context; gap per turn in the history (`prompt_gap/*`)",
        ]
    return [mix]


def _teacher_demos(f: Facts, source: str) -> list[str]:
    """An SFT source `teacher:<stage>`: which teacher made its demonstrations (the stage's teacher.json,
    else each demonstration's provenance), how many distinct ones SFT read, and the teacher's pass rate
    over the stage's episodes."""
    stage = source.partition(":")[2]
    head = f"  - `{source}`:"
    if stage not in f.dag.nodes or not f.done(stage):
        return [f"{head} {NR} (stage `{stage}` not finished)"]
    try:
        demos = read_demos(f.stage_dir(stage))
    except FileNotFoundError:
        return [f"{head} {NR} (no demos.jsonl)"]
    summaries = [read_json(f.unit_dir(u) / "teacher.json") or {} for u in f.dag[stage].units]
    line = f"{head} teacher {_named(summaries + [d['provenance'] for d in demos], 'teacher')}"
    students = summaries + [d["provenance"]["relay"] for d in demos if "relay" in d["provenance"]]
    relay = any(r.get("student") for r in students)  # the student started each episode; its turns are context
    if relay:
        line += f"; Relay student {_named(students, 'student')}"
    episodes, verified, infra = (sum(s.get(k, 0) for s in summaries) for k in ("episodes", "verified", "infra_failures"))
    scored = episodes - infra
    whose = "the Relay episodes' pass rate" if relay else "the teacher's pass rate"
    line += (
        f"; {len(demos)} distinct verified demonstrations read; {whose} "
        f"{_percent(verified / scored) if scored else NR} ({verified} verified of {scored} scored episodes, "
        f"{infra} infrastructure failures left out; `{stage}`'s teacher.json)"
    )
    return [line]


def _named(records: list[dict], key: str) -> str:
    """A teacher's (`key`) or Relay student's reference and files' manifest sha256, from the first
    records that name them (a teacher stage's units and its demonstrations agree on both)."""
    ref = next((r[key] for r in records if r.get(key)), None)
    digest = next((r[f"{key}_sha256"] for r in records if r.get(f"{key}_sha256")), None)
    return f"`{_v(ref)}`, files' manifest sha256 `{_v(digest)}`"


def _teacher_rollouts(f: Facts, c, unit) -> str:
    """An RL unit's teacher rollouts: the teacher it served (its teacher.json), the episodes the teacher
    played and its pass rate, summed over the updates of the history (`teacher/*`)."""
    record = read_json(f.unit_dir(unit) / "teacher.json") or {}
    ref = record.get("teacher") or c.teacher
    rows = [r for r in _unit_history(f, unit) if "step" in r and "teacher/episodes" in r]
    episodes = sum(r["teacher/episodes"] for r in rows)
    line = (
        f"  - teacher rollouts (`teacher_rollouts` {c.teacher_rollouts} per task per update, in the task's group, "
        f"weighted by min(π/π_teacher, {_v(c.tis_cap)})): teacher `{_v(ref)}`, files' manifest sha256 "
        f"`{_v(record.get('teacher_sha256'))}`"
    )
    if not rows:
        return f"{line}; episodes {NR}"
    passed = sum(r.get("teacher/passed", math.nan) for r in rows)  # counted since the card names the teacher
    scored = episodes - sum(r.get("teacher/infra_failures", math.nan) for r in rows)
    rate = f"{_percent(passed / scored)} ({passed:g} passed of {scored:g} scored)" if scored > 0 else NR
    return f"{line}; {episodes:g} teacher episodes over {len(rows)} updates, the teacher's pass rate {rate}"


def _precision_lines(metrics: dict) -> list[str]:
    """The unit's three dtypes, and how much of the model its updates moved in the stored dtype."""
    p = metrics.get("precision")
    if not p:
        return [f"  - precision: {NR}"]
    warn = " (bfloat16 masters, asked for in the config: small updates round away)" if p.get("master") == "bfloat16" else ""
    lines = [
        f"  - precision: master weights and optimizer state {p['master']}{warn}, compute {p['compute']}, storage {p['storage']}"
    ]
    same = metrics.get("weights_unchanged")
    if same:
        kinds = ", ".join(f"{k} {v:.1%}" for k, v in same.items() if k != "all")
        lines.append(f"  - weights bit-identical to the start in the stored dtype: {same['all']:.1%} ({kinds})")
    return lines


def _checkpoint_meta(unit_dir: Path) -> dict:
    """What the trainer recorded in its checkpoints' meta.json: the latest step checkpoint's (it
    holds backend and world size), overlaid by `final`'s."""
    root = unit_dir / "checkpoints"
    steps = sorted(root.glob("step_*/meta.json"))
    meta = dict(read_json(steps[-1]) or {}) if steps else {}
    return meta | (read_json(root / "final" / "meta.json") or {})


def _shapes(res) -> str:
    """The resources asked for: nodes × tasks × GPUs, per hetjob component where there are components."""

    def shape(r) -> str:
        return f"{r.nodes} node(s) × {r.tasks_per_node} task(s) × {r.gpus_per_node} GPU"

    return ", ".join(f"{k}: {shape(v)}" for k, v in res.components.items()) if res.components else shape(res)


def _layout(node, world: int | None, meta: dict) -> str:
    """Ranks as recorded: the MPI/torch world rank 0 saw (provenance), the trainer's data-parallel
    ranks (its checkpoint meta) and, for multi-role stages, the ranks per role the config declared."""
    comps = node.config.resources.components
    trainer = f"{_v(meta.get('world_size'))} data-parallel trainer rank(s) (checkpoint meta)"
    if comps:
        roles = ", ".join(f"{k} {v.nodes * v.tasks_per_node}" for k, v in comps.items())
        return f"{trainer}; ranks per role {roles} (config); one world of {_v(world)} rank(s) (recorded by rank 0)"
    return f"{trainer} in a world of {_v(world)} rank(s) (recorded by rank 0)"


AGENT_ROWS = (  # results.json `behaviour` keys shown on the card (stages.agent.behaviour)
    ("turns_mean", "turns per episode", lambda v: _v(v, "{:.2f}")),
    ("calls/edit", "edits per episode", lambda v: _v(v, "{:.2f}")),
    ("invalid_actions_per_episode", "invalid actions per episode", lambda v: _v(v, "{:.2f}")),
    ("no_submission_frac", "episodes without a submission", _pct),
    ("submitted_untested_frac", "submissions without a test run", _pct),
    ("claim_precision", "claim precision (passed / submitted)", _pct),
)


def _diff(d: dict | None) -> str:
    if not d or d.get("diff") is None:
        return NR
    lo, hi = d.get("ci95") or (None, None)
    ci = f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if lo is not None and hi is not None and lo == lo and hi == hi else ""
    return f"{100 * d['diff']:+.1f} ± {_v(d.get('se') and 100 * d['se'], '{:.1f}')}{ci}"


def _reward_hacks(f: Facts) -> list[str]:
    """The reward-hack detectors' counts over every group of kept episodes (stages/agent/detectors.py)."""
    counts = reward_hack_counts(f.run)
    if not counts:
        return [f"Reward-hack detectors: {NR} (no kept trajectories; `keep_trajectories` keeps them)."]
    lines = [
        "Episodes the reward-hack detectors flagged in the kept trajectories, each as flagged (of them "
        "passed); the pass rate beside the one with every flagged pass counted as a failure is what the "
        "hacks were worth (`snowcat traces` cites the episodes):",
        "",
        "| episodes | scored | pass rate % | without flagged passes % | " + " | ".join(DETECTORS) + " |",
        "|---|---|---|---|" + "---|" * len(DETECTORS),
    ]
    lines += [
        f"| {c['group']} | {c['episodes']} | {_pct(c['pass_rate'])} | {_pct(c['pass_rate_unflagged'])} | "
        + " | ".join(f"{c[name]} ({c[name + '/passed']})" for name in DETECTORS)
        + " |"
        for c in counts
    ]
    lines += ["", *[f"- `{name}`: {rule}" for name, (_, rule) in DETECTORS.items()]]
    return lines


def _resolve(f: Facts, ref: str) -> Path | None:
    """The directory a checkpoint reference names now (`rl:best` is a file naming a step)."""
    try:
        stage, index, name = ref_unit(ref, {n: node.config for n, node in f.dag.nodes.items()})
        return checkpoint_dir(unit_path(f.stage_dir(stage), index), name).resolve()
    except (ValueError, UserError):
        return None


def _evaluations(f: Facts, export: dict | None) -> tuple[list[str], list[str], list[dict], list[str]]:
    """Tables per evaluate unit; limitations; the model-index entries (the exported weights only);
    per evaluation, the exported weights' score beside their initializer's (the checklist's)."""
    lines, limits, index, versus = [], [], [], []
    source = (export or {}).get("source") or {}
    exported_dir = (f.run.path / source["path"]).resolve() if source.get("path") else None
    for node in f.nodes("evaluate"):
        pairs = compare.card_section(f.run, node.name)  # over every unit's traces: pairs across units too
        units = f.units(node)
        missed = []  # units that did not score the exported checkpoint (a fan-out over `checkpoint`: all but one)
        for label, config, unit in units:
            if not f.run.is_done(unit):
                status = f.run.state()["stages"].get(unit.key, {}).get("status", "not run")
                limits.append(f"Evaluation `{label}` did not complete ({status}); it reports nothing.")
                continue
            results = read_json(f.unit_dir(unit) / "results.json")
            if results is None:
                lines += [f"**{label}**: results.json {NR}.", ""]
                limits.append(f"Evaluation `{label}`: its results are {NR}.")
                continue
            block, found = _evaluation(f, label, config, results, source, exported_dir, bool(pairs))
            lines += block + (pairs if len(units) == 1 else []) + [""]
            if source.get("ref") and not found["versus"]:
                missed.append(label)
                if len(units) == 1:
                    limits.append(f"Evaluation `{label}` did not evaluate the exported checkpoint `{source['ref']}`.")
            limits += found["limits"]
            index += found["index"]
            versus += found["versus"]
        if len(units) > 1 and pairs:
            lines += pairs[1:] + [""]  # (its first line is blank)
        if len(units) > 1 and missed and len(missed) == sum(f.run.is_done(u) for _, _, u in units):
            limits.append(
                f"Evaluation `{node.name}` (none of its units) did not evaluate the exported checkpoint `{source['ref']}`."
            )
    if not lines:
        lines = [f"Evaluation: {NR} (no completed evaluate stage)."]
    return lines, limits, index, versus


def _further_scores(group: dict) -> dict[str, str]:
    """A group's further verifier scores (IFEval's loose accuracy: stages/evaluate.py) as the card shows
    them, those that cover every scored task of the group (not `all` where one domain has them)."""
    scores = group.get("scores") or {}
    names = [n for n in scores if not n.endswith(("_se", "_tasks")) and scores.get(f"{n}_tasks") == group.get("tasks_scored")]
    return {n: _pct(scores[n], scores.get(f"{n}_se")) for n in names}


def _evaluation(f: Facts, label: str, config, results: dict, source: dict, exported_dir, paired: bool):
    """One evaluate unit's table: its first checkpoint (the baseline) and the exported one, or every
    one when nothing exported was scored; the others named in a line (the paired tables hold them)."""
    lines, found = [], {"limits": [], "index": [], "versus": []}
    exported_ref = source.get("ref")
    exported_unit = f.ref_unit(exported_ref)
    # the evaluate stage's first checkpoint is its baseline (results.json keys are sorted on disk)
    refs = [r for r in getattr(config, "checkpoints", []) if r in results["checkpoints"]]
    refs += sorted(r for r in results["checkpoints"] if r not in refs)
    initial = refs[0]
    exported = next((r for r in refs if exported_dir is not None and _resolve(f, r) == exported_dir), None)
    cols = [initial] + ([exported] if exported and exported != initial else [r for r in refs[1:]])
    # "initializer" only where it is one: a checkpoint named `initial`, or what the exported unit started from
    init_refs = {r for r in refs if r.endswith(":initial")}
    if exported_unit is not None:
        init_refs.add(f.unit_config(exported_unit).init_from)
    labels = [
        ("initializer" if r in init_refs else "baseline") if r == initial else ("exported" if r == exported else "") for r in cols
    ]
    lines.append(
        f"**{label}**: split `{results.get('split')}`, {results.get('tasks')} tasks × "
        f"{results.get('attempts')} attempts, sampling {json.dumps(results.get('sampling'))}. "
        "Values in %, ± one standard error over tasks."
    )
    lines.append("")
    head = " | ".join(f"{r}{' (' + lab + ')' if lab else ''}" for r, lab in zip(cols, labels))
    lines.append(f"| group | metric | {head} |")
    lines.append("|---|---|" + "---|" * len(cols))
    groups = [g for g in results["checkpoints"][initial]["groups"] if "/" not in g]
    for g in sorted(groups, key=lambda g: (g != "all", g)):
        for metric, fmt in (
            ("pass@1", lambda s: _pct(s.get("pass@1"), s.get("pass@1_se"))),
            ("mean reward", lambda s: _pct(s.get("reward"), s.get("reward_se"))),
            ("infra failure rate", lambda s: _pct(s.get("infra_rate"))),
        ):
            vals = [fmt(results["checkpoints"][r]["groups"].get(g) or {}) for r in cols]
            lines.append(f"| {g} | {metric} | " + " | ".join(vals) + " |")
            if metric == "pass@1" and exported is not None:
                s = results["checkpoints"][exported]["groups"].get(g) or {}
                found["index"].append({"stage": label, "checkpoint": exported, "group": g, "pass@1": s.get("pass@1")})
        for name in sorted({n for r in cols for n in _further_scores(results["checkpoints"][r]["groups"].get(g) or {})}):
            vals = [_further_scores(results["checkpoints"][r]["groups"].get(g) or {}).get(name, "—") for r in cols]
            lines.append(f"| {g} | {name} | " + " | ".join(vals) + " |")
    for key, name, fmt in AGENT_ROWS:  # multi-turn evaluations: what the agent did
        if any(key in results["checkpoints"][r].get("behaviour", {}) for r in cols):
            vals = [fmt(results["checkpoints"][r].get("behaviour", {}).get(key)) for r in cols]
            lines.append(f"| agent | {name} | " + " | ".join(vals) + " |")
    comparisons = results.get("comparisons") or {}
    overall = {r: (results["checkpoints"][r]["groups"].get("all") or {}) for r in refs}
    extras = [r for r in refs if r not in cols]
    if extras:  # a reader sees that more was scored, and where each stands
        lines += [
            "",
            f"Also scored by `{label}`{', compared in the paired tables below' if comparisons or paired else ''}: "
            + ", ".join(f"`{r}` {_pct(overall[r].get('pass@1'), overall[r].get('pass@1_se'))}" for r in extras)
            + " (pass@1 in %, all tasks).",
        ]
    if comparisons:  # paired over the same tasks: the honest way to say one checkpoint beats another
        lines += ["", "Paired differences (same tasks and attempt seeds), in points, ± SE, [95% bootstrap CI]:", ""]
        lines += ["| comparison | group | tasks | Δ pass@1 | Δ mean reward |", "|---|---|---|---|---|"]
        for pair, by_group in sorted(comparisons.items()):
            for g in sorted((g for g in by_group if "/" not in g), key=lambda g: (g != "all", g)):
                c = by_group[g]
                lines.append(f"| {pair} | {g} | {_v(c.get('tasks'))} | {_diff(c.get('pass@1'))} | {_diff(c.get('reward'))} |")
    if exported is not None:
        found["versus"].append(_versus(f, label, exported, exported_unit, refs, overall, comparisons))
    selected_on = source.get("metric", "").partition("/")[0]
    if exported is not None and selected_on and selected_on == results.get("split"):
        found["limits"].append(
            f"SELECTION ON THE SCORING SPLIT: the exported checkpoint `{exported_ref}` was chosen by "
            f"{source['metric']} = {_v(source.get('value'), '{:.4f}')}{_selection_se(f, source)} on the "
            f"`{selected_on}` split, the split `{label}` scores it on: its score there is biased upward."
        )
    for r in cols:
        infra = (results["checkpoints"][r]["groups"].get("all") or {}).get("infra_rate")
        if infra:
            found["limits"].append(
                f"`{label}` on `{r}`: {100 * infra:.1f}% of attempts were infrastructure failures "
                "(excluded from the denominators)."
            )
    return lines, found


def _versus(f: Facts, label: str, exported: str, unit, refs: list[str], overall: dict, comparisons: dict) -> str:
    """The exported weights' pass@1 beside their initializer's, where the evaluation scored it: the
    checkpoint their training unit started from (`init_from`, or its own `checkpoints/initial`)."""
    config = f.unit_config(unit) if unit is not None else None
    start = getattr(config, "init_from", "") or (f"{f.label(unit)}:initial" if unit is not None else "")
    targets = {d for d in (_resolve(f, start), unit and (f.unit_dir(unit) / "checkpoints" / "initial").resolve()) if d}
    inits = [r for r in refs if r != exported and _resolve(f, r) in targets]
    text = f"{label}: exported `{exported}` pass@1 {_percent(overall[exported].get('pass@1'))}"
    if not inits:
        return text + f", initializer {NR} (`{label}` did not score {f'`{start}`' if start else 'it'})"
    parts = []
    for r in inits:
        d = (comparisons.get(f"{exported} - {r}") or {}).get("all", {}).get("pass@1")
        parts.append(f"`{r}` {_percent(overall[r].get('pass@1'))}" + (f" (paired Δ {_diff(d)} points)" if d else ""))
    return text + ", initializer " + ", ".join(parts)


def _history(f: Facts, source: dict) -> list[dict]:
    """The metrics history rows of the unit an export source (`<stage>[<unit>]:<name>`) came from."""
    unit = f.ref_unit(source.get("ref"))
    return _unit_history(f, unit) if unit is not None else []


def _unit_history(f: Facts, unit) -> list[dict]:
    path = f.unit_dir(unit) / "metrics_history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _selection_se(f: Facts, source: dict) -> str:
    """The selection value's standard error over tasks, from the stage's history row at that step."""
    row = next((r for r in _history(f, source) if r.get("step") == source.get("step")), {})
    se, n = row.get(f"{source.get('metric')}_se"), row.get(f"{source.get('metric', '').partition('/')[0]}/tasks")
    return f" ± {se:.4f} (SE over {n} tasks)" if isinstance(se, (int, float)) else " (SE not recorded)"


def _selection(f: Facts, source: dict, results: list[dict]) -> list[str]:
    """The exported checkpoint's selection when it was made on a split no evaluation scores (the
    opposite case is a limitation, from `_evaluations`)."""
    split = source.get("metric", "").partition("/")[0]
    scored = sorted({r.get("split") for r in results if r.get("split")})
    if not split or not scored or split in scored:
        return []
    return [
        f"the exported checkpoint was chosen by {source['metric']} = {_v(source.get('value'), '{:.4f}')}"
        f"{_selection_se(f, source)} on the `{split}` split, which no evaluation scores (they score "
        f"{', '.join(f'`{s}`' for s in scored)})"
    ]


def _export(f: Facts) -> tuple[list[str], dict | None, list[str]]:
    """The Exported model section, the export record the rest of the card describes, limitations.
    A card is about one published model: an export stage fanned out into several units lists each
    unit's export here and names none of them as the card's exported weights."""
    nodes = f.nodes("export")
    if not nodes:
        return [f"Export: {NR} (the run has no export stage)."], None, []
    node = nodes[0]
    blocks = [(label, unit, _export_lines(f, label, unit)) for label, _, unit in f.units(node)]
    if node.items is None:
        lines, record = blocks[0][2]
        return lines, record, []
    lines = [f"`{node.name}` fans out into {len(blocks)} units, each its own export:", ""]
    for label, _, (unit_lines, _) in blocks:
        lines += [f"- `{label}`:", *(f"  {line}" for line in unit_lines)]
    limit = (
        f"`{node.name}` exported {len(blocks)} models (one per unit): this card names none of them as its exported "
        "weights (no model-index, no exported score or selection); each unit's export is listed under Exported model."
    )
    return lines, None, [limit]


def _export_lines(f: Facts, label: str, unit) -> tuple[list[str], dict | None]:
    record = read_json(f.unit_dir(unit) / "export.json")
    if record is None or not f.run.is_done(unit):
        return [f"Export `{label}`: {NR} (the stage did not complete)."], None
    src, eq, fmt = record["source"], record.get("equivalence") or {}, record.get("format") or {}
    files = (read_json(f.unit_dir(unit) / "model" / "manifest.json") or {}).get("files", {})
    shards = sum(rel.endswith(".safetensors") for rel in files) if files else None
    lines = [
        f"- Exported checkpoint: `{src.get('ref')}` (`{src.get('path')}`, manifest sha256 `{_v(src.get('manifest_sha256'))}`)",
        f"- Why this one: {src.get('reason')}",
        f"- Format: {fmt.get('architecture')} safetensors, {fmt.get('dtype')}, {_v(shards)} weight shard(s) "
        f"({len(files)} files with config and tokenizer, no optimizer state), {fmt.get('params')} parameters; "
        f"model manifest sha256 `{record.get('model_manifest_sha256')}`",
        f"- Inference equivalence (transformers, offline, local files only): max |Δlogit| "
        f"{_v(eq.get('max_abs_dlogit'), '{:.3g}')} on {eq.get('probe', {}).get('rows')}×{eq.get('probe', {}).get('len')} "
        f"probe tokens (tolerance {_v(eq.get('tolerance'))}); greedy generations "
        f"{'match' if eq.get('greedy_match') else 'DIFFER'} over {eq.get('greedy_tokens_compared')} tokens; chat template ids "
        f"{'match' if eq.get('chat_template_match') else 'DIFFER'}",
    ]
    return lines, record


def _retention(f: Facts) -> list[str]:
    lines = []
    for node in f.nodes(*TRAINING_KINDS):
        for label, _, unit in f.units(node):  # each unit deletes its own checkpoints (its own ledger)
            ledger = read_json(f.unit_dir(unit) / "checkpoints" / "retention.json")
            if ledger is None:
                lines.append(f"- `{label}`: no retention ledger; what intermediate checkpoints were deleted is {NR}.")
                continue
            deleted = ledger.get("deleted") or []
            lines.append(
                f"- `{label}`: policy {json.dumps(ledger.get('policy'))}; {len(deleted)} checkpoint(s) deleted{':' if deleted else ''}"
            )
            lines += [f"  - step {d.get('step')}: {d.get('reason')}" for d in deleted]
    return lines or ["- No training stage: nothing retained or deleted."]


def _software(f: Facts) -> tuple[list[str], dict]:
    records = [r for node in f.dag for u in node.units if (r := f.provenance(u.stage, u.index))]
    if not records:
        return [f"Software: {NR} (no provenance records)."], {}
    codes = {(r["code"].get("revision"), r["code"].get("patch_sha256"), r["code"].get("patch")) for r in records}
    images = {json.dumps(r.get("container"), sort_keys=True) for r in records}
    lines = []
    for rev, digest, patch in sorted(codes, key=str):
        lines.append(f"- Code: snowcat revision `{_v(rev)}` + patch `{_v(patch)}` (sha256 `{_v(digest)}`)")
    pythons = sorted({_v(r.get("python", {}).get("version")) for r in records})
    lines.append(f"- Python {', '.join(pythons)}; packages (over all {len(records)} unit records): {_packages(records) or NR}")
    lines += _installs(records)
    for image in sorted(images):
        c = json.loads(image)
        lines.append(
            "- Container: none (stages ran on the host)"
            if c is None
            else f"- Container: `{c.get('image')}` sha256 `{_v(c.get('sha256'))}`"
        )
    hosts = sorted({r.get("host", {}).get("hostname") or NR for r in records})
    lines.append(f"- Hosts: {', '.join(hosts)}")
    lines.append(f"- CPUs: {cpu_line(records)}")
    rev = next(iter(codes))[0] if len(codes) == 1 else None
    return lines, {"code_revision": rev}


def cpu_line(records: list[dict]) -> str:
    """The CPUs the units ran on, each with the kernels torch dispatched to there. The CPU decides which
    kernels ran, so whether a rerun elsewhere is bit-identical (docs/users.md). A unit that never
    loaded torch records no capability: its CPU is named by the units that did."""
    seen = {(r.get("host", {}).get("cpu_model"), r.get("host", {}).get("cpu_capability")) for r in records}
    kernels = {model for model, capability in seen if capability is not None}
    return "; ".join(
        sorted(
            f"{_v(model)} (torch kernels: {_v(capability)})"
            for model, capability in seen
            if capability is not None or model not in kernels
        )
    )


def _packages(records: list[dict]) -> str:
    """One entry per package: its version where every stage had the same, each version with the
    stages that had it where they differ, "absent" where a stage recorded it as not installed."""
    versions: dict[str, dict[str, list[str]]] = {}
    for r in records:
        for name, version in (r.get("packages") or {}).items():
            versions.setdefault(name, {}).setdefault(version or "absent", []).append(r.get("stage", "?"))
    out = []
    for name, by_version in sorted(versions.items()):
        if len(by_version) == 1:
            out.append(f"{name} {next(iter(by_version))}")
        else:
            out.append(f"{name} " + " / ".join(f"{v} ({', '.join(sorted(set(st)))})" for v, st in sorted(by_version.items())))
    return ", ".join(out)


def _installs(records: list[dict]) -> list[str]:
    """Each distinct installed set the stages ran with (provenance `install`, pipeline.lock): its
    sha256, the lock it was compared with (file and sha256) and every difference from it, then the
    set itself, package by package."""
    by_set: dict[str, list[dict]] = {}
    for r in records:
        by_set.setdefault((r.get("install") or {}).get("installed_sha256") or "", []).append(r)
    lines = []
    for digest, group in sorted(by_set.items()):
        stages = ", ".join(sorted({r.get("stage", "?") for r in group}))
        if not digest:
            lines.append(f"- Installed set: {NR} (stages {stages})")
            continue
        inst = group[0]["install"]
        head = f"- Installed set sha256 `{digest}` ({len(inst.get('installed') or {})} packages; stages {stages})"
        if not inst.get("lock"):
            lines.append(f"{head}: compared with no lock ({_v(inst.get('lock_error'))})")
        else:
            differs = inst.get("mismatches") or []
            extra = inst.get("unlocked") or []
            verdict = f"differs from it in {len(differs)}: {', '.join(differs)}" if differs else "every locked package as pinned"
            lines.append(
                f"{head}: lock `{inst['lock']}` (sha256 `{_v(inst.get('lock_sha256'))}`), {verdict}"
                + (f"; not in the lock: {', '.join(extra)}" if extra else "")
            )
        listing = " ".join(f"`{name}=={version}`" for name, version in sorted((inst.get("installed") or {}).items()))
        lines.append(f"  <details><summary>the installed set</summary>{listing}</details>")
    return lines


def _seconds(times: dict) -> float | None:
    try:
        return (dt.datetime.fromisoformat(times["ended"]) - dt.datetime.fromisoformat(times["started"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None


def _rank_records(f: Facts, unit) -> list[dict]:
    """The records ranks other than 0 wrote for a unit (provenance/ranks/): role, host, GPUs."""
    name = unit.stage if unit.index is None else f"{unit.stage}.{unit.index}"
    return [r for p in sorted((f.run.path / "provenance" / "ranks").glob(f"{name}.rank*.json")) if (r := read_json(p))]


def _unit_gpus(f: Facts, unit, prov: dict) -> dict[str, set[str]] | None:
    """The GPUs a unit's ranks recorded, per host: rank 0's (the unit's provenance) and every other
    rank's. A GPU is counted once: by its uuid where recorded, else as the i-th of its host (so
    ranks on one host that each saw the host's GPUs count them once). None: a rank recorded no
    GPU probe, so the unit's GPUs are not known."""
    hosts = [prov.get("host")] + [r.get("host") for r in _rank_records(f, unit)]
    if any(not isinstance(h, dict) or h.get("gpus") is None for h in hosts):
        return None
    seen: dict[str, set[str]] = {}
    for h in hosts:
        ids = seen.setdefault(h.get("hostname") or "?", set())
        ids.update(f"{g.get('name', '?')}|{g.get('uuid') or f'#{i}'}" for i, g in enumerate(h["gpus"]))
    return seen


def _gpu_text(per_host: dict[str, set[str]]) -> str:
    names = Counter(g.split("|")[0] for ids in per_host.values() for g in ids)
    n = sum(names.values())
    return f"{n} GPU(s) ({', '.join(f'{c}× {k}' for k, c in sorted(names.items()))} on {len(per_host)} host(s))"


def _stages(f: Facts) -> tuple[list[str], dict]:
    """One line per stage: final state, attempts, jobs, wall-clock and GPU use as recorded, and one
    line per unit of a fanned-out stage. GPU-hours of a unit: the GPUs its ranks recorded × its
    recorded wall-clock (the completed attempt's).

    Where a fanned-out stage's records live: the local executor records attempts and processes per
    unit; the Slurm executor records a submission of the whole stage (its array or hetjobs: attempts,
    job ids) under the stage's name and each unit's own jobs under the unit."""
    state = f.run.state()["stages"]
    totals = {"gpu_hours": {}, "gpu_unknown": [], "cpu_only": 0, "earlier_attempts": [], "attempts": 0, "retried": []}
    lines = []
    for node in f.dag:
        status, _ = f.run.stage_status(f.dag, node.name, verify=False)
        records = [state.get(u.key, {}) for u in node.units]
        whole = state.get(node.name, {}) if node.items is not None else {}
        attempts = whole.get("attempts", 0) or sum(r.get("attempts", 0) or 0 for r in records)
        jobs = sorted({j for r in [whole, *records] for j in (*r.get("job_ids", []), *r.get("own_job_ids", []))})
        provs = {u: p for u in node.units if (p := f.provenance(u.stage, u.index))}
        secs = [x for p in provs.values() if (x := _seconds(p.get("times") or {})) is not None]
        gpus = {u: _unit_gpus(f, u, p) for u, p in provs.items()}
        done = [u for u in node.units if f.run.is_done(u)]
        hours, known = 0.0, bool(done)
        for u in done:
            x = _seconds((provs.get(u) or {}).get("times") or {})
            if gpus.get(u) is None or x is None:
                known = False
            else:
                hours += sum(map(len, gpus[u].values())) * x / 3600
        totals["attempts"] += attempts
        retried = whole.get("attempts", 0) > 1 or any((r.get("attempts", 0) or 0) > 1 for r in records)
        if retried:
            totals["retried"].append(node.name)
        wall = f"{sum(secs):.0f} s" if secs else NR
        if node.items is not None and secs:  # units may run at once: their sum is not the time it took
            wall += f" summed over its units ({_span(provs.values())} from the first start to the last end)"
        continued = sum(int(r.get("continuations_used") or 0) for r in records)  # requeues or chained jobs
        where = (f"{len(jobs)} job(s)/process(es)" if jobs else "no job recorded") + (
            f", continued {continued} time(s) after a walltime or preemption signal" if continued else ""
        )
        used: dict[str, set[str]] = {}  # over the stage's units: a GPU two units used counts once
        for per_host in filter(None, gpus.values()):
            for host, ids in per_host.items():
                if ids:
                    used.setdefault(host, set()).update(ids)
        if not done:
            gpu = f"GPUs {NR}" if not provs else (_gpu_text(used) if used else "no GPU recorded")
        elif not known:
            gpu = f"GPUs or wall-clock {NR} for some unit: GPU-hours {NR}"
            totals["gpu_unknown"].append(node.name)
        elif used:
            gpu = f"{_gpu_text(used)}, {hours:.2f} GPU-hours"
            totals["gpu_hours"][node.name] = hours
            if retried or continued:
                gpu += " (the completed attempt's; earlier attempts' run time not recorded)"
                totals["earlier_attempts"].append(node.name)
        else:
            gpu = "0 GPUs (CPU only)"
            totals["cpu_only"] += len(done)
        of, counted = "", ""
        if node.items is not None:
            of = f", {len(node.units)} units"
            counted = " (submissions of the whole stage)" if whole.get("attempts") else " (summed over its units)"
        lines.append(
            f"- `{node.name}` ({node.kind}{of}): {status}, {attempts} attempt(s){counted}, {where}, wall-clock {wall}, {gpu}"
        )
        if node.items is not None:
            lines += [
                _unit_stage_line(f, label, u, state.get(u.key, {}), provs.get(u), gpus.get(u)) for label, _, u in f.units(node)
            ]
    return lines, totals


def _span(provs) -> str:
    times = [(p.get("times") or {}) for p in provs]
    try:
        start = min(dt.datetime.fromisoformat(t["started"]) for t in times)
        end = max(dt.datetime.fromisoformat(t["ended"]) for t in times)
    except (KeyError, TypeError, ValueError):
        return f"{NR}"
    return f"{(end - start).total_seconds():.0f} s"


def _unit_stage_line(f: Facts, label: str, unit, record: dict, prov: dict | None, gpus) -> str:
    """A unit of a fanned-out stage: its state, what its own record says of attempts and jobs, its
    wall-clock and GPUs."""
    done = f.run.is_done(unit)
    status = "done" if done else record.get("status", "pending")
    attempts = f"{record['attempts']} attempt(s), " if record.get("attempts") else ""
    jobs = list(dict.fromkeys([*record.get("own_job_ids", []), *record.get("job_ids", [])]))
    continued = int(record.get("continuations_used") or 0)
    where = (f"job(s) {', '.join(jobs)}" if jobs else "no job of its own recorded") + (
        f", continued {continued} time(s)" if continued else ""
    )
    secs = _seconds((prov or {}).get("times") or {})
    if gpus is None:
        gpu = f"GPUs {NR}"
    elif any(gpus.values()):
        gpu = _gpu_text({h: ids for h, ids in gpus.items() if ids}) + (
            f", {sum(map(len, gpus.values())) * secs / 3600:.2f} GPU-hours" if done and secs is not None else ""
        )
    else:
        gpu = "0 GPUs (CPU only)"
    return f"  - `{label}`: {status}, {attempts}{where}, wall-clock {_v(secs, '{:.0f} s')}, {gpu}"


def _gpu_hours(totals: dict) -> str | None:
    """The checklist's GPU-hours: per stage and in total, from the stages' lines (`_stages`)."""
    per, unknown = totals["gpu_hours"], totals["gpu_unknown"]
    if per:
        text = f"{sum(per.values()):.2f} in total ({', '.join(f'{k} {v:.2f}' for k, v in per.items())}; GPUs each rank recorded × the unit's wall-clock)"
        if totals["earlier_attempts"]:
            text += f"; at least: earlier attempts of {', '.join(totals['earlier_attempts'])} not recorded"
    elif totals["cpu_only"] and not unknown:
        return f"0 (CPU only: no rank of the {totals['cpu_only']} completed unit(s) recorded a GPU)"
    elif not unknown:
        return None
    else:
        text = "0 where recorded"
    return text + (f"; {NR} for {', '.join(unknown)}" if unknown else "")


def _role_hardware(f: Facts, node, role: str) -> str:
    """Hosts and GPUs the ranks of one role ran on, per unit: the other ranks' records
    (provenance/ranks/), and rank 0's own where it had that role or, alone in its world, both
    (stages/rl.py: one process alternates the roles)."""
    each = []
    for label, _, unit in f.units(node):
        records = [r for r in _rank_records(f, unit) if r.get("role") == role]
        prov = f.provenance(unit.stage, unit.index) or {}
        extra = prov.get("extra") or {}
        alone = extra.get("world_size") == 1
        if extra.get("role") == role or alone:
            records.insert(0, prov)
        if not records:
            each.append((label, f"{role} ranks' hosts and GPUs {NR}"))
            continue
        hosts = sorted({(r.get("host") or {}).get("hostname") or NR for r in records})
        gpus = sorted({g.get("name", "?") for r in records for g in (r.get("host") or {}).get("gpus") or []})
        who = "rank 0 (alone in its world: one process alternating both roles)" if alone else f"{len(records)} {role} rank(s)"
        each.append((label, f"{who} on {', '.join(hosts)}; GPUs: {', '.join(gpus) or 'none'}"))
    return f"{node.name}: {each[0][1]}" if node.items is None else _one_or_each(each)


def _findings(report: dict) -> str:
    found = report.get("findings") or []
    where = f"in {report['files']} file(s)" if report.get("files") is not None else f"(files searched: {NR})"
    if not found:
        return f"clean: no credential found {where}"
    shown = "; ".join(f"`{r['file']}`:{r['line']} {r['kind']}" for r in found[:10])
    return f"{len(found)} CREDENTIAL FINDING(S) {where}: {shown}" + (
        f"; {len(found) - 10} more in scan.json" if len(found) > 10 else ""
    )


def _credential_scan(f: Facts) -> tuple[list[str], str, list[str]]:
    """What the scans recorded: the card stage's own (every artefact the card describes: all but its
    own outputs and the stages after it) and the scan stage's (the finished run, the card included),
    as lines, the checklist's value, and limitations. Nothing is scanned here: a card written
    outside the card stage states only what was recorded."""
    lines, summary, limits = [], [], []
    for node in f.nodes("card"):
        rel = f"stages/{node.name}/scan.json"
        report = read_json(f.run.path / rel)
        if report is None:
            lines.append(f"- Before the card (`{node.name}` stage): {NR} (no `{rel}`)")
            summary.append(f"{node.name} stage, before the card: {NR}")
            continue
        after = report.get("stages_after") or []
        left_out = ", ".join(f"`{d}/`" for d in report.get("excluded") or []) or "nothing"
        verdict = _findings(report)
        lines.append(
            f"- Before the card (`{node.name}` stage, `{rel}`): {verdict} of the run directory, every artefact this "
            f"card describes; left out: {left_out} (the card's own outputs"
            + (f" and the stages after it, not yet run: {', '.join(after)})" if after else ")")
        )
        summary.append(f"{node.name} stage, before the card: {verdict}")
        if report.get("findings"):
            limits.append(f"CREDENTIALS IN THE RUN DIRECTORY: the `{node.name}` stage's scan found {verdict}.")
    for node in f.nodes("scan"):
        rel = f"stages/{node.name}/scan.json"
        report = read_json(f.run.path / rel)
        status = f.run.stage_status(f.dag, node.name, verify=False)[0]
        if report is None:
            lines.append(f"- After the card (`{node.name}` stage, which scans the card too): {NR} (stage {status})")
            summary.append(f"{node.name} stage, after the card: {NR} ({status})")
            continue
        verdict = _findings(report)
        lines.append(f"- After the card (`{node.name}` stage, `{rel}`, the whole run directory, the card included): {verdict}")
        summary.append(f"{node.name} stage, after the card: {verdict}")
        if report.get("findings"):
            limits.append(f"CREDENTIALS IN THE RUN DIRECTORY: the `{node.name}` stage's scan found {verdict}.")
    if not lines:
        lines = [f"- Credential scan: {NR} (the run has no card or scan stage)"]
    return lines, "; ".join(summary) or NR, limits


def _tags(f: Facts, export: dict | None) -> list[str]:
    """Tags from what was recorded: the exported architecture, experts, and a coding-agent
    environment only where a training stage ran one."""
    tags = ["snowcat"]
    # (an export record is a plain export stage's: a fanned-out one gives none, `_export`)
    config = read_json(f.stage_dir(f.nodes("export")[0].name) / "model" / "config.json") if export else None
    if config:
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        tags += (["mixture-of-experts"] if experts > 1 else []) + [config.get("model_type") or "unknown-architecture"]
    if any(getattr(c, "env", None) == "repo" for n in f.nodes("sft", "probe", "rl") for _, c, _ in f.units(n)):
        tags.append("coding-agent")
    return tags


# The fields of the Snowball RL model card (shared/seeds/snowball-smartie-rl-model-card.txt), in its
# order; docs/provenance.md lists them. Each gets a row: the recorded value, or "not recorded".
CHECKLIST = (
    "model and run name",
    "research-artifact disclaimer",
    "exported checkpoint",
    "why this checkpoint",
    "historical best checkpoint and retention",
    "initializer",
    "initializer revision",
    "initializer parents (merge lineage)",
    "optimizer state at start",
    "RL estimator and importance-sampling correction",
    "learning rate",
    "prompt groups per update and responses per group",
    "updates completed",
    "policy parallelism layout",
    "rollout (inference) hardware",
    "training hardware",
    "GPU-hours",
    "wall-clock per stage",
    "training set size",
    "training set per domain",
    "data order rule",
    "per-cohort exposure through the exported step",
    "validation set size and per domain",
    "pass@1 scoring rule",
    "development vs independent evaluation",
    "initializer vs exported score",
    "sampling and token limits",
    "external benchmarks",
    "data file hashes",
    "data screening for credentials",
    "resolved config identity",
    "source revisions and patch",
    "launch command",
    "reproduction recipe",
    "credentials",
    "metrics history archive",
    "retained traces",
    "final state of the run",
    "resume and requeue history",
    "export source",
    "weight shards and optimizer state",
    "converter manifest",
    "architecture and tokenizer",
    "inference-equivalence test",
    "license",
    "intended use",
)


def _exposure(f: Facts, source: dict) -> str | None:
    """Trajectories per domain that entered the loss up to the exported step (RL's `exposure/<d>`);
    without an export, each RL unit's through its last update."""
    if not source:
        each = [
            f"{n.name}: {text}" if n.items is None else text
            for n in f.nodes("rl")
            if (text := _one_or_each([(label, _exposure_text(_unit_exposure(f, u))) for label, _, u in f.units(n)]))
        ]
        return f"no export; through each RL unit's last update: {'; '.join(each)}" if each else None
    step = source.get("step")
    if step is None and source.get("path"):  # exported by name (e.g. rl:final): its meta says the step
        step = (read_json(f.run.path / source["path"] / "meta.json") or {}).get("step")
    unit = f.ref_unit(source.get("ref"))
    if step is None or unit is None:
        return None
    return _exposure_text(_unit_exposure(f, unit, through=step), step)


def _external_benchmarks(f: Facts) -> str:
    """Which external benchmarks the run's evaluations scored: the tasks an evaluate stage scored
    that its tasks stage imported from files (SWE-bench / Harbor format), else "none run"."""
    evals = f.nodes("evaluate")
    if not evals:
        return "none run (the run has no evaluate stage)"
    out, generated = [], []
    stages = {n: node.config for n, node in f.dag.nodes.items()}
    for node in evals:
        for label, config, unit in f.units(node):
            results = read_json(f.unit_dir(unit) / "results.json") if f.run.is_done(unit) else None
            if results is None:
                out.append(f"{label}: {NR} (the stage did not complete)")
                continue
            first = next(iter(results.get("checkpoints", {}).values()), {})
            scored = sorted(g for g in first.get("groups", {}) if "/" not in g and g != "all")
            try:  # the tasks unit(s) this one read (`tasks`, or one unit of a fanned-out tasks stage)
                stage, indices = input_units(config.tasks, stages)
            except ValueError:
                stage, indices = None, []
            imports = [
                i for index in indices if stage in f.dag.nodes for i in getattr(f.unit_config(Unit(stage, index)), "imports", [])
            ]
            external = [i for i in imports if i.domain in scored]
            if external:
                named = ", ".join(f"`{i.format}` tasks from `{i.path}` (domain {i.domain})" for i in external)
                out.append(
                    f"{label}: imported {named} on this run's `{results.get('split')}` split, scored by the stage's "
                    f"verifier `{config.verifier}`, not by the benchmark's own harness"
                )
            else:
                generated.append(f"{label} ({', '.join(scored) or 'no domain'} of the `{results.get('split')}` split)")
    if generated:
        out.insert(0, f"none run: {', '.join(generated)} scored tasks this run generated")
    return "; ".join(out)


def _checklist(f: Facts, export: dict | None, versus: list[str], limits: list[str], totals: dict, scan: str) -> list[str]:
    src = (export or {}).get("source") or {}
    fmt = (export or {}).get("format") or {}
    eq = (export or {}).get("equivalence") or {}
    rl = f.nodes("rl")
    trainers = f.nodes(*TRAINING_KINDS)
    # the run's initializer: each unit's of the first training stage (`_initializer`)
    starts = [
        (label, c, (read_json(f.unit_dir(u) / "checkpoints" / "initial" / "meta.json") or {}).get("lineage") or {})
        for label, c, u in (f.units(trainers[0]) if trainers else [])
    ]
    tasks = f.nodes("tasks")
    evals = [(label, u) for n in f.nodes("evaluate") if f.done(n.name) for label, _, u in f.units(n)]
    results = [read_json(f.unit_dir(u) / "results.json") or {} for _, u in evals]

    def per_stage(fn, kinds=TRAINING_KINDS) -> str | None:
        """fn(config, unit) per training unit, labelled (a sweep's units each with their own config)."""
        vals = [f"{label}: {v}" for n in trainers if n.kind in kinds for label, c, u in f.units(n) if (v := fn(c, u)) is not None]
        return "; ".join(vals) or None

    def initializer(fn) -> Any:
        return _one_or_each([(label, fn(c, lineage)) for label, c, lineage in starts]) if starts else None

    def rows(split: str) -> tuple[Any, Any]:
        """(size, size and per domain) of the first tasks stage that wrote `split`, per unit."""
        for n in tasks:
            found = []
            for label, _, u in f.units(n):
                path = f.unit_dir(u) / f"{split}.parquet"
                if counts := (_domain_counts(path) if path.is_file() else None):
                    found.append((label, sum(counts.values()), ", ".join(f"{d} {c}" for d, c in counts.items())))
            if found:
                return (
                    _one_or_each([(label, size) for label, size, _ in found]),
                    _one_or_each([(label, f"{size} ({per})") for label, size, per in found]),
                )
        return None, None

    h5 = f.run.path / "history.h5"
    traces = sorted(str(p.relative_to(f.run.path)) for p in (f.run.path / "stages").rglob("traces*.h5"))
    state_counts = Counter(f.run.stage_status(f.dag, node.name, verify=False)[0] for node in f.dag)
    train_size, train_rows = rows("train")
    values = {
        "model and run name": f"{f.cfg.name}: {f.info.get('run_id')}",
        "research-artifact disclaimer": "stated above",
        "exported checkpoint": src.get("ref"),
        "why this checkpoint": src.get("reason"),
        "historical best checkpoint and retention": (
            f"historical best step {src['historical_best_step']}; exported step {src.get('step')}"
            + (" (the same)" if src["historical_best_step"] == src.get("step") else " (the best was deleted by retention)")
        )
        if src.get("historical_best_step") is not None
        else None,
        "initializer": initializer(lambda c, lineage: lineage.get("source") or f"`{c.init_from or c.model}`"),
        "initializer revision": initializer(lambda c, lineage: lineage.get("revision")),
        "initializer parents (merge lineage)": initializer(
            lambda c, lineage: (
                (
                    f"{', '.join(lineage['parents'])} ({lineage.get('parents_relation') or 'relation not stated'}; "
                    "as its model card names them, not pinned by revision or hash)"
                )
                if lineage.get("parents")
                else None
            )
        ),
        "optimizer state at start": per_stage(lambda c, u: "fresh (a stage loads model weights only)"),
        "RL estimator and importance-sampling correction": per_stage(
            lambda c, u: f"{c.estimator}, TIS cap {c.tis_cap}", kinds=("rl",)
        ),
        "learning rate": per_stage(lambda c, u: c.lr),
        "prompt groups per update and responses per group": per_stage(
            lambda c, u: f"{c.tasks_per_update} × {c.attempts}", kinds=("rl",)
        ),
        "updates completed": per_stage(
            lambda c, u: (m := f.run.metrics(u)).get("updates", m.get("steps")) if f.run.is_done(u) else None
        ),
        "policy parallelism layout": "see Recipe (layout)" if trainers else None,
        "rollout (inference) hardware": "; ".join(_role_hardware(f, n, "rollout") for n in rl) or None,
        "training hardware": "see Stages and Software (rank 0 hosts)" if trainers else None,
        "GPU-hours": _gpu_hours(totals),
        "wall-clock per stage": "see Stages",
        "training set size": train_size,
        "training set per domain": train_rows,
        "data order rule": "see Training data" if rl else None,
        "per-cohort exposure through the exported step": _exposure(f, src),
        "validation set size and per domain": rows("val")[1],
        "pass@1 scoring rule": "explicit verifier pass per attempt; infrastructure failures excluded from denominators"
        if evals
        else None,
        "development vs independent evaluation": "; ".join(
            [x.rstrip(".") for x in limits if "development set" in x or "SCORING SPLIT" in x] + _selection(f, src, results)
        )
        or ("no selection on an evaluated split recorded" if evals else None),
        "initializer vs exported score": "; ".join(versus) or None,
        "sampling and token limits": "; ".join(
            f"{label}: {json.dumps(r.get('sampling'))}" for (label, _), r in zip(evals, results)
        )
        or None,
        "external benchmarks": _external_benchmarks(f),
        "data file hashes": "see Training data" if tasks else None,
        "data screening for credentials": scan,
        "resolved config identity": f"sha256 {f.config_sha256}",
        "source revisions and patch": "see Software",
        "launch command": "see Reproduction",
        "reproduction recipe": "see Reproduction",
        "credentials": "none recorded (configs that hold credentials are refused; environment captures are scrubbed)",
        "metrics history archive": f"history.h5 sha256 {sha256_file(h5)}" if h5.is_file() else None,
        "retained traces": ", ".join(traces) or None,
        "final state of the run": ", ".join(f"{n} {k}" for k, n in sorted(state_counts.items())),
        "resume and requeue history": (
            f"{totals['attempts']} attempt(s) over {len(f.dag.nodes)} stages"
            + (f"; retried: {', '.join(totals['retried'])}" if totals["retried"] else "; no stage retried")
        ),
        "export source": src.get("path"),
        "weight shards and optimizer state": "see Exported model" if export else None,
        "converter manifest": (export or {}).get("model_manifest_sha256"),
        "architecture and tokenizer": f"{fmt.get('architecture')}, tokenizer files in the export" if fmt else None,
        "inference-equivalence test": (
            f"max abs Δlogit {eq.get('max_abs_dlogit')}, greedy {'match' if eq.get('greedy_match') else 'DIFFER'}" if eq else None
        ),
        "license": _license_text(f.cfg.card) or None,
        "intended use": f.cfg.card.intended_use or None,
    }
    return ["| field | value |", "|---|---|"] + [f"| {k} | {_v(values[k])} |" for k in CHECKLIST]


def _license_text(card) -> str:
    """The config's `card.license` as a reader should see it ("" when unset)."""
    if card.license == "other":
        return f"other: {card.license_name} ({card.license_link})"
    return card.license


def _license_meta(card) -> dict:
    """The model-card metadata the Hub reads for the license (nothing when unset: no guess)."""
    if not card.license:
        return {}
    if card.license == "other":
        return {"license": "other", "license_name": card.license_name, "license_link": card.license_link}
    return {"license": card.license}


def _curves(f: Facts, where: Path | None) -> list[str]:
    """The figures `snowcat plot` draws from the units' per-step histories (the card stage draws
    them into <run>/plots/), linked relative to where the card is written (None: the card stage's
    directory). Listed from the histories, not from the files, so the text repeats exactly."""
    found = plot.figures(f.run)
    if not found:
        return [f"Curves: {NR} (no unit recorded a per-step history)."]
    root = f.run.path / plot.PLOTS_DIR
    rel = Path("../..") / plot.PLOTS_DIR if where is None else Path(os.path.relpath(root, where))
    lines = [
        f"Drawn by `snowcat plot {f.run.path}` into `{plot.PLOTS_DIR}/` from each unit's `metrics_history.jsonl` "
        f"(x: {plot.X_LABEL}); the pictures are not hashed (throughput is a timing).",
        "",
    ]
    for concern, panels in found.items():
        units = sorted({s.unit for series in panels for s in series})
        lines += [f"![{concern.title}: {', '.join(units)}]({(rel / f'{concern.name}.png').as_posix()})", ""]
    return lines


def build_card(run: RunDir, where: Path | None = None) -> str:
    """The card's text; `where`: the directory it is written to (the figures are linked relative to
    it; None: the card stage's directory, <run>/stages/<name>/)."""
    f = Facts(run)
    init_lines, init_meta = _initializer(f)
    export_lines, export_record, export_limits = _export(f)
    exported_ref = export_record["source"]["ref"] if export_record else None
    eval_lines, eval_limits, eval_index, eval_versus = _evaluations(f, export_record)
    soft_lines, soft_meta = _software(f)
    origin = f.info.get("origin") or {}

    limits = [f"{text} (stated in the config)" for text in f.cfg.card.limitations] + list(eval_limits)
    if f.nodes("evaluate"):
        limits.append(
            "Mean reward is the verifiers' reward, which may give partial credit: it is not the fraction of "
            "tasks solved. pass@1 counts only explicit verifier passes."
        )
    for node in f.nodes("sft"):
        checked = [label for label, c, _ in f.units(node) if c.eval_tasks]  # each unit's own setting
        if checked:
            who = f"`{node.name}`'s" if len(checked) == len(node.units) else ", ".join(f"`{x}`'s" for x in checked)
            limits.append(
                f"The validation split also served {who} end-of-stage greedy check: it is a "
                "development set, not an independent final evaluation."
            )
    after_card = {n for c in f.nodes("card") for n in f.dag.downstream(c.name)} | {c.name for c in f.nodes("card")}
    undone = [n.name for n in f.dag if not f.done(n.name) and n.name not in after_card]
    if undone:
        limits.append(f"Stages not completed when this card was written: {', '.join(undone)}.")
    if export_limits:
        limits += export_limits
    elif export_record is None:
        limits.append("No verified export: the inference-equivalence of any published weights is not established.")

    base_model = init_meta.pop("base_model", None)
    meta: dict[str, Any] = {
        **({"base_model": base_model} if base_model else {}),  # the Hugging Face model-card field for lineage
        **_license_meta(f.cfg.card),
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": _tags(f, export_record),
    }
    if eval_index:  # scores of the exported weights only: the model-index describes what is published
        meta["model-index"] = [
            {
                "name": f"{f.info.get('run_id')} ({exported_ref})",
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {"name": f"{e['stage']} ({e['group']})", "type": "snowcat-tasks"},
                        "metrics": [{"type": "pass@1", "name": f"pass@1 {e['checkpoint']}", "value": e["pass@1"]}],
                    }
                    for e in eval_index
                    if e["pass@1"] is not None
                ],
            }
        ]
    meta["snowcat"] = {
        "run_id": f.info.get("run_id"),
        "created": f.info.get("created"),
        "config_sha256": f.config_sha256,
        "code_revision": soft_meta.get("code_revision"),
        "exported_checkpoint": exported_ref,
        "model_manifest_sha256": export_record.get("model_manifest_sha256") if export_record else None,
        **init_meta,
        "intended_use": f.cfg.card.intended_use or None,
        "limitations": list(f.cfg.card.limitations),
    }
    stage_lines, totals = _stages(f)
    scan_lines, scan_summary, scan_limits = _credential_scan(f)
    limits += scan_limits
    checklist = _checklist(f, export_record, eval_versus, limits, totals, scan_summary)
    overrides = " ".join(origin.get("overrides") or [])
    parts = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {f.cfg.name}: {f.info.get('run_id')}",
        "",
        f"{f.cfg.description or 'Description: ' + NR}",
        "",
        "Research artifact, produced by the snowcat pipeline. Every statement below is read from the run "
        f'directory; "{NR}" marks facts the run did not record.',
        "",
        "## Initializer",
        "",
        *init_lines,
        "",
        "## Training data",
        "",
        *_data(f),
        "",
        "## Recipe",
        "",
        f"- Run seed {f.cfg.seed}; resolved config `config.yaml` sha256 `{f.config_sha256}`",
        *_recipe(f),
        "",
        "## Evaluation",
        "",
        *eval_lines,
        "",
        "## Reward hacking",
        "",
        *_reward_hacks(f),
        "",
        "## Curves",
        "",
        *_curves(f, where),
        "## Exported model",
        "",
        *export_lines,
        "",
        "## Deleted checkpoints (retention)",
        "",
        *_retention(f),
        "",
        "## Intended use and license",
        "",
        f"- Intended use: {f.cfg.card.intended_use or NR}",
        f"- License: {_license_text(f.cfg.card) or NR}",
        "",
        "## Known limitations",
        "",
        *[f"- {x}" for x in limits],
        "",
        "## Reproduction",
        "",
        f"- Same code, config and seed: `snowcat reproduce {f.run.path}` (a new run from the archived "
        "resolved config, compared stage by stage with this one)",
        f"- Original command: `snowcat run {_v(origin.get('config'))}{' ' + overrides if overrides else ''}"
        f"{' --site ' + origin['site'] if origin.get('site') else ''}`",
        "",
        "## Software and containers",
        "",
        *soft_lines,
        "",
        "## Stages",
        "",
        *stage_lines,
        "",
        *(["## Plan against measurement", "", *plan_lines, ""] if (plan_lines := plan_compare.card_lines(f.run.path)) else []),
        "## Credential scan",
        "",
        *scan_lines,
        "",
        "## Record checklist",
        "",
        "Every field of a published post-training card, with the value this run recorded.",
        "",
        *checklist,
        "",
    ]

    return scrub_text("\n".join(parts))  # e.g. an override holding a token must not reach a published card


# --- CLI ------------------------------------------------------------------------------------------


def add_card_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("-o", "--output", help="write the card here (default: print it)")


def cmd_card(args) -> int:
    text = build_card(RunDir.open(args.run), Path(args.output).resolve().parent if args.output else Path.cwd())
    if args.output:
        atomic_write_text(args.output, text)
    else:
        print(text, end="")
    return 0
