"""The card's training sections: the initializer, the training data (task sources, exposure), the recipe
of each training stage (its teachers, precision, layout)."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.stages.agent.demos import read_demos
from snowcat.stages.config import prompt_stage
from snowcat.stages.taskgen.rows import SOURCES

from .facts import NR, TRAINING_KINDS, Facts, percent, shown, unit_history


def initializer(f: Facts) -> tuple[list[str], dict]:
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
            f"revision {shown(lineage.get('revision'))}, license {shown(lineage.get('license'))})"
        )
    elif source:
        what = f"checkpoint `{source}` (named by `stages.{unit.stage}.init_from`)"
    else:
        what = f"fresh initialization of the `{shown(c.model)}` preset, seed {shown(meta.get('seed'))}"
    of = "" if unit.index is None else f" of `{label}`"
    lines = [
        f"- Initializer{of}: {what}",
        f"- Initializer checkpoint{of}: `{f.run.path.name}/{init.relative_to(f.run.path)}`, manifest sha256 `{shown(digest)}`",
    ]
    lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(weights.items())]
    if lineage:
        lines.append(f"- Pretrained source files (as loaded; staged copy sha256 `{shown(lineage.get('staged_sha256'))}`):")
        lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(lineage.get("files", {}).items())]
        return lines, {"initializer_manifest_sha256": digest, "base_model": lineage.get("hub_id") or lineage["source"]}
    return lines, {"initializer_manifest_sha256": digest}


def domain_counts(path: Path) -> dict[str, int] | None:
    try:
        domains = pq.read_table(path, columns=["domain"]).column("domain").to_pylist()
    except Exception:  # no such column, or not a readable parquet file: said as not recorded
        return None
    return {d: domains.count(d) for d in sorted(set(domains))}


def data(f: Facts) -> list[str]:
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
                counts = domain_counts(f.unit_dir(unit) / rel)
                per = ", ".join(f"{d} {c}" for d, c in counts.items()) if counts else NR
                rows.append(f"| {label} | `{rel}` | {shown(n)} | {per} | `{meta['sha256']}` |")
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
                    f"solutions, {shown(m.get('validation/valid'))} valid; excluded: {excluded or 'none'} (reasons in `validation.json`)"
                )
    for node in f.nodes("select"):
        for label, _, unit in f.units(node):
            m = f.run.metrics(unit) if f.run.is_done(unit) else {}
            per = ", ".join(f"{k.split('/')[0]} {v}" for k, v in sorted(m.items()) if k.endswith("/selected"))
            rows.append(
                f"- RL task band (`{label}`): {shown(m.get('selected'))} of {shown(m.get('probed'))} probed tasks"
                + (f" ({per})" if per else "")
            )
    for node in f.nodes("rl"):
        seeds = [((f.provenance(u.stage, u.index) or {}).get("extra") or {}).get("seed") for u in node.units]
        whose = f"the stage seed {shown(seeds[0])}" if node.items is None else "the unit's stage seed"
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
            rows.append(f"  - `{label}`: seed {shown(seed)}; exposure {shown(exposure_text(unit_exposure(f, unit)))}")
    return rows


def _task_sources(f: Facts) -> list[str]:
    """One line per imported task set: its format, file and sha256 as the tasks stage read it."""
    lines = []
    for node in f.nodes("tasks"):
        for label, _, unit in f.units(node):
            recorded = read_json(f.unit_dir(unit) / SOURCES) if f.run.is_done(unit) else None
            for s in (recorded or {}).get("imports", []):
                lines.append(
                    f"- Imported task set (`{label}`, `{s.get('format')}`, domain {shown(s.get('domain'))}): `{s.get('path')}`, "
                    f"sha256 `{shown(s.get('sha256'))}`; {shown(s.get('train'))} train, {shown(s.get('val'))} val tasks"
                )
    return lines


def unit_exposure(f: Facts, unit, through: int | None = None) -> tuple[Counter, int | None]:
    """Trajectories per domain that entered a training unit's loss (its history's `exposure/<d>`),
    through step `through` (None: every update), and the last step summed."""
    totals: Counter = Counter()
    last = None
    for row in unit_history(f, unit):
        if "step" in row and (through is None or row["step"] <= through) and any(k.startswith("exposure/") for k in row):
            totals.update({k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("exposure/")})
            last = row["step"] if last is None else max(last, row["step"])
    return totals, last


def exposure_text(found: tuple[Counter, int | None], step: int | None = None) -> str | None:
    totals, last = found
    if not totals:
        return None
    return f"{', '.join(f'{d} {n}' for d, n in sorted(totals.items()))} trajectories in the loss through step {shown(step if step is not None else last)}"


def recipe(f: Facts) -> list[str]:
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
            f"Relay fraction {shown(c.relay_fraction)}"
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
        lines.append(
            f"  - batch: {shown(c.batch_rows)} packed rows × {shown(c.seq_len)} tokens, {shown(c.micro_batches)} micro-batch(es)"
        )
        lines.append(
            f"  - lr {shown(c.lr)} ({shown(c.schedule)}, warmup {shown(c.warmup_steps)}, "
            f"min ratio {shown(c.min_lr_ratio)}), weight decay {shown(c.weight_decay)}, grad clip {shown(c.grad_clip)}"
        )
        lines.append(f"  - updates: {shown(metrics.get('steps'))} completed of {shown(c.steps)} configured")
    else:
        lines.append(
            f"  - estimator: {shown(c.estimator)}, aggregation {shown(c.aggregation)}, "
            f"truncated importance sampling cap {shown(c.tis_cap)}, staleness lag {shown(c.lag)}"
        )
        lines.append(f"  - batch: {shown(c.tasks_per_update)} tasks × {shown(c.attempts)} attempts per update")
        lines.append(f"  - lr {shown(c.lr)}, KL coef {shown(c.kl_coef)}")
        lines += _rl_recipe_lines(c)
        if getattr(c, "teacher_rollouts", 0):
            lines.append(_teacher_rollouts(f, c, unit))
        lines.append(
            f"  - updates: {shown(metrics.get('updates', metrics.get('steps')))} completed of {shown(c.updates)} configured"
        )
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
        f"{percent(verified / scored) if scored else NR} ({verified} verified of {scored} scored episodes, "
        f"{infra} infrastructure failures left out; `{stage}`'s teacher.json)"
    )
    return [line]


def _named(records: list[dict], key: str) -> str:
    """A teacher's (`key`) or Relay student's reference and files' manifest sha256, from the first
    records that name them (a teacher stage's units and its demonstrations agree on both)."""
    ref = next((r[key] for r in records if r.get(key)), None)
    digest = next((r[f"{key}_sha256"] for r in records if r.get(f"{key}_sha256")), None)
    endpoint = next((r["endpoint"] for r in records if key == "teacher" and r.get("endpoint")), None)
    if digest is None and endpoint:  # no files of ours: what the service said it serves stands for them
        identity = json.dumps(endpoint.get("identity"), sort_keys=True)
        return (
            f"`{shown(ref)}`, an OpenAI-compatible endpoint (its /v1/models entry: `{identity}`; its text "
            "re-tokenised by the student's tokenizer)"
        )
    return f"`{shown(ref)}`, files' manifest sha256 `{shown(digest)}`"


def _teacher_rollouts(f: Facts, c, unit) -> str:
    """An RL unit's teacher rollouts: the teacher it served (its teacher.json), the episodes the teacher
    played and its pass rate, summed over the updates of the history (`teacher/*`)."""
    record = read_json(f.unit_dir(unit) / "teacher.json") or {}
    ref = record.get("teacher") or c.teacher
    rows = [r for r in unit_history(f, unit) if "step" in r and "teacher/episodes" in r]
    episodes = sum(r["teacher/episodes"] for r in rows)
    line = (
        f"  - teacher rollouts (`teacher_rollouts` {c.teacher_rollouts} per task per update, in the task's group, "
        f"weighted by min(π/π_teacher, {shown(c.tis_cap)})): teacher `{shown(ref)}`, files' manifest sha256 "
        f"`{shown(record.get('teacher_sha256'))}`"
    )
    if not rows:
        return f"{line}; episodes {NR}"
    passed = sum(r.get("teacher/passed", math.nan) for r in rows)  # counted since the card names the teacher
    scored = episodes - sum(r.get("teacher/infra_failures", math.nan) for r in rows)
    rate = f"{percent(passed / scored)} ({passed:g} passed of {scored:g} scored)" if scored > 0 else NR
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
    trainer = f"{shown(meta.get('world_size'))} data-parallel trainer rank(s) (checkpoint meta)"
    if comps:
        roles = ", ".join(f"{k} {v.nodes * v.tasks_per_node}" for k, v in comps.items())
        return f"{trainer}; ranks per role {roles} (config); one world of {shown(world)} rank(s) (recorded by rank 0)"
    return f"{trainer} in a world of {shown(world)} rank(s) (recorded by rank 0)"
