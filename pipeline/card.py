"""The provenance card: a Markdown model card (with Hugging Face model-card YAML) from recorded facts only.

Every statement comes from a file of the run directory: run.json, config.yaml, the stages' outputs
(tasks parquet files, checkpoint manifests, retention ledgers, evaluate results.json, export.json)
and provenance records. A fact that is not recorded is written as "not recorded", never guessed.
`snowcat card RUN [-o FILE]` prints or writes it; the `card` stage writes `card.md` into the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from .dag import build
from .fsio import atomic_write_text, read_json, sha256_file
from .provenance import record_path
from .rundir import RunDir
from .scrub import scrub_text

NR = "not recorded"
TRAINING_KINDS = ("sft", "rl")


def _v(value: Any, fmt: str = "{}") -> str:
    return NR if value is None or value == "" else fmt.format(value)


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

    def provenance(self, name: str, index: int | None = None) -> dict | None:
        return read_json(record_path(self.run.path, name, index))

    def manifest(self, name: str) -> dict:
        return (read_json(self.stage_dir(name) / "manifest.json") or {}).get("files", {})


# --- sections -------------------------------------------------------------------------------------


def _initializer(f: Facts) -> tuple[list[str], dict]:
    trainers = f.nodes(*TRAINING_KINDS)
    if not trainers:
        return [f"- Initializer: {NR} (the run has no training stage)"], {}
    first = trainers[0]
    init = f.stage_dir(first.name) / "checkpoints" / "initial"
    manifest = init / "manifest.json"
    digest = sha256_file(manifest) if manifest.is_file() else None
    weights = {k: v["sha256"] for k, v in (read_json(manifest) or {}).get("files", {}).items() if k.endswith(".safetensors")}
    meta = read_json(init / "meta.json") or {}
    source = first.config.init_from
    lineage = meta.get("lineage") or {}
    if lineage:
        where = f"hub id `{lineage['hub_id']}`" if lineage.get("hub_id") else "a local directory"
        what = (
            f"pretrained checkpoint `{lineage['source']}` (named by `stages.{first.name}.model`; {where}, "
            f"revision {_v(lineage.get('revision'))}, license {_v(lineage.get('license'))})"
        )
    elif source:
        what = f"checkpoint `{source}` (named by `stages.{first.name}.init_from`)"
    else:
        what = f"fresh initialization of the `{_v(first.config.model)}` preset, seed {_v(meta.get('seed'))}"
    lines = [
        f"- Initializer: {what}",
        f"- Initializer checkpoint: `{f.run.path.name}/stages/{first.name}/checkpoints/initial`, manifest sha256 `{_v(digest)}`",
    ]
    lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(weights.items())]
    if lineage:
        lines.append(f"- Pretrained source files (as loaded; staged copy sha256 `{_v(lineage.get('staged_sha256'))}`):")
        lines += [f"  - `{k}` sha256 `{v}`" for k, v in sorted(lineage.get("files", {}).items())]
        return lines, {"initializer_manifest_sha256": digest, "base_model": lineage.get("hub_id") or lineage["source"]}
    return lines, {"initializer_manifest_sha256": digest}


def _data(f: Facts) -> list[str]:
    rows = ["| stage | file | rows | sha256 |", "|---|---|---|---|"]
    for node in f.nodes("tasks"):
        for rel, meta in sorted(f.manifest(node.name).items()):
            if not rel.endswith(".parquet"):
                continue
            try:
                n = pq.ParquetFile(f.stage_dir(node.name) / rel).metadata.num_rows
            except Exception:
                n = None
            rows.append(f"| {node.name} | `{rel}` | {_v(n)} | `{meta['sha256']}` |")
    return rows if len(rows) > 2 else [f"Training data: {NR} (no tasks stage outputs)."]


def _recipe(f: Facts) -> list[str]:
    lines = []
    for node in f.nodes(*TRAINING_KINDS):
        c, res = node.config, node.config.resources
        metrics = f.run.metrics(node.units[0]) if f.done(node.name) else {}
        prov = f.provenance(node.name) or {}
        world = (prov.get("extra") or {}).get("world_size")
        lines.append(f"- `{node.name}` ({node.kind}):")
        if node.kind == "sft":
            lines.append(
                f"  - objective: supervised fine-tuning on task demonstrations (assistant tokens only), "
                f"Relay fraction {_v(c.relay_fraction)}"
            )
            lines.append(
                f"  - batch: {_v(c.batch_rows)} packed rows × {_v(c.seq_len)} tokens, {_v(c.micro_batches)} micro-batch(es)"
            )
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
            lines.append(
                f"  - updates: {_v(metrics.get('updates', metrics.get('steps')))} completed of {_v(c.updates)} configured"
            )
        comps = (
            ", ".join(f"{k}: {v.nodes}×{v.gpus_per_node} GPU" for k, v in res.components.items())
            if res.components
            else f"{res.nodes} node(s) × {res.tasks_per_node} task(s) × {res.gpus_per_node} GPU"
        )
        name = getattr(c, "backend", None)  # RL has no choice of backend (torch)
        backend = (f"{name}" + (f" ZeRO-{c.zero_stage}" if name == "deepspeed" else "")) if name else NR
        lines.append(f"  - parallelism: data parallel, world size {_v(world)}; backend {backend}; resources {comps}")
    return lines or [f"Recipe: {NR} (no training stage)."]


AGENT_ROWS = (  # results.json `behaviour` keys shown on the card (stages.agent.behaviour)
    ("turns_mean", "turns per episode", lambda v: _v(v, "{:.2f}")),
    ("calls/edit", "edits per episode", lambda v: _v(v, "{:.2f}")),
    ("invalid_actions_per_episode", "invalid actions per episode", lambda v: _v(v, "{:.2f}")),
    ("no_submission_frac", "episodes without a submission", _pct),
    ("submitted_untested_frac", "submissions without a test run", _pct),
    ("claim_precision", "claim precision (passed / submitted)", _pct),
)


def _evaluations(f: Facts, exported_ref: str | None) -> tuple[list[str], list[str], list[dict]]:
    lines, limits, index = [], [], []
    for node in f.nodes("evaluate"):
        if not f.done(node.name):
            status = f.run.state()["stages"].get(node.name, {}).get("status", "not run")
            limits.append(f"Evaluation `{node.name}` did not complete ({status}); it reports nothing.")
            continue
        results = read_json(f.stage_dir(node.name) / "results.json")
        if results is None:
            lines += [f"**{node.name}**: results.json {NR}.", ""]
            limits.append(f"Evaluation `{node.name}`: its results are {NR}.")
            continue
        # the evaluate stage's first checkpoint is its baseline (results.json keys are sorted on disk)
        refs = [r for r in getattr(node.config, "checkpoints", []) if r in results["checkpoints"]]
        refs += sorted(r for r in results["checkpoints"] if r not in refs)
        initial = refs[0]
        exported = exported_ref if exported_ref in refs else None
        cols = [initial] + ([exported] if exported and exported != initial else [r for r in refs[1:]])
        # "initializer" only where it is one: a checkpoint named `initial`, or what the exported stage started from
        init_refs = {r for r in refs if r.endswith(":initial")}
        if exported_ref and exported_ref.partition(":")[0] in f.dag.nodes:
            init_refs.add(f.dag[exported_ref.partition(":")[0]].config.init_from)
        labels = [
            ("initializer" if r in init_refs else "baseline") if r == initial else ("exported" if r == exported else "")
            for r in cols
        ]
        lines.append(
            f"**{node.name}**: split `{results.get('split')}`, {results.get('tasks')} tasks × "
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
                if metric == "pass@1":
                    for r in cols:
                        s = results["checkpoints"][r]["groups"].get(g) or {}
                        index.append({"stage": node.name, "checkpoint": r, "group": g, "pass@1": s.get("pass@1")})
        for key, label, fmt in AGENT_ROWS:  # multi-turn evaluations: what the agent did
            if any(key in results["checkpoints"][r].get("behaviour", {}) for r in cols):
                vals = [fmt(results["checkpoints"][r].get("behaviour", {}).get(key)) for r in cols]
                lines.append(f"| agent | {label} | " + " | ".join(vals) + " |")
        if exported_ref and exported is None:
            limits.append(f"Evaluation `{node.name}` did not evaluate the exported checkpoint `{exported_ref}`.")
        for r in cols:
            infra = (results["checkpoints"][r]["groups"].get("all") or {}).get("infra_rate")
            if infra:
                limits.append(
                    f"`{node.name}` on `{r}`: {100 * infra:.1f}% of attempts were infrastructure failures "
                    "(excluded from the denominators)."
                )
        lines.append("")
    if not lines:
        lines = [f"Evaluation: {NR} (no completed evaluate stage)."]
    return lines, limits, index


def _export(f: Facts) -> tuple[list[str], dict | None]:
    nodes = f.nodes("export")
    if not nodes:
        return [f"Export: {NR} (the run has no export stage)."], None
    node = nodes[0]
    record = read_json(f.stage_dir(node.name) / "export.json")
    if record is None or not f.done(node.name):
        return [f"Export `{node.name}`: {NR} (the stage did not complete)."], None
    src, eq, fmt = record["source"], record.get("equivalence") or {}, record.get("format") or {}
    lines = [
        f"- Exported checkpoint: `{src.get('ref')}` (`{src.get('path')}`, manifest sha256 `{_v(src.get('manifest_sha256'))}`)",
        f"- Why this one: {src.get('reason')}",
        f"- Format: {fmt.get('architecture')} safetensors, {fmt.get('dtype')}, {fmt.get('files')} files, "
        f"{fmt.get('params')} parameters; model manifest sha256 `{record.get('model_manifest_sha256')}`",
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
        ledger = read_json(f.stage_dir(node.name) / "checkpoints" / "retention.json")
        if ledger is None:
            lines.append(f"- `{node.name}`: no retention ledger; what intermediate checkpoints were deleted is {NR}.")
            continue
        deleted = ledger.get("deleted") or []
        lines.append(f"- `{node.name}`: policy {json.dumps(ledger.get('policy'))}; {len(deleted)} checkpoint(s) deleted:")
        lines += [f"  - step {d.get('step')}: {d.get('reason')}" for d in deleted]
    return lines or ["- No training stage: nothing retained or deleted."]


def _software(f: Facts) -> tuple[list[str], dict]:
    records = [r for node in f.dag for u in node.units if (r := f.provenance(u.stage, u.index))]
    if not records:
        return [f"Software: {NR} (no provenance records)."], {}
    codes = {(r["code"].get("revision"), r["code"].get("patch_sha256"), r["code"].get("patch")) for r in records}
    images = {json.dumps(r.get("container"), sort_keys=True) for r in records}
    last = records[-1]
    lines = []
    for rev, digest, patch in sorted(codes, key=str):
        lines.append(f"- Code: snowcat revision `{_v(rev)}` + patch `{_v(patch)}` (sha256 `{_v(digest)}`)")
    pkgs = ", ".join(f"{k} {v}" for k, v in sorted(last.get("packages", {}).items()) if v)
    lines.append(f"- Python {_v(last.get('python', {}).get('version'))}; packages: {pkgs or NR}")
    for image in sorted(images):
        c = json.loads(image)
        lines.append(
            "- Container: none (stages ran on the host)"
            if c is None
            else f"- Container: `{c.get('image')}` sha256 `{_v(c.get('sha256'))}`"
        )
    hosts = sorted({r.get("host", {}).get("hostname") or NR for r in records})
    lines.append(f"- Hosts: {', '.join(hosts)}")
    # The CPU decides which kernels ran, so whether a rerun elsewhere is bit-identical (docs/users.md).
    cpus = sorted(
        {
            f"{_v(r.get('host', {}).get('cpu_model'))} (torch kernels: {_v(r.get('host', {}).get('cpu_capability'))})"
            for r in records
        }
    )
    lines.append(f"- CPUs: {'; '.join(cpus)}")
    rev = next(iter(codes))[0] if len(codes) == 1 else None
    return lines, {"code_revision": rev}


def build_card(run: RunDir) -> str:
    f = Facts(run)
    init_lines, init_meta = _initializer(f)
    export_lines, export_record = _export(f)
    exported_ref = export_record["source"]["ref"] if export_record else None
    eval_lines, eval_limits, eval_index = _evaluations(f, exported_ref)
    soft_lines, soft_meta = _software(f)
    origin = f.info.get("origin") or {}

    limits = list(eval_limits)
    if f.nodes("evaluate"):
        limits.append(
            "Mean reward is the verifiers' reward, which may give partial credit: it is not the fraction of "
            "tasks solved. pass@1 counts only explicit verifier passes."
        )
    for node in f.nodes("sft"):
        if node.config.eval_tasks:
            limits.append(
                f"The validation split also served `{node.name}`'s end-of-stage greedy check: it is a "
                "development set, not an independent final evaluation."
            )
    after_card = {n for c in f.nodes("card") for n in f.dag.downstream(c.name)} | {c.name for c in f.nodes("card")}
    undone = [n.name for n in f.dag if not f.done(n.name) and n.name not in after_card]
    if undone:
        limits.append(f"Stages not completed when this card was written: {', '.join(undone)}.")
    if export_record is None:
        limits.append("No verified export: the inference-equivalence of any published weights is not established.")

    base_model = init_meta.pop("base_model", None)
    meta: dict[str, Any] = {
        **({"base_model": base_model} if base_model else {}),  # the Hugging Face model-card field for lineage
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["snowcat", "mixture-of-experts", "qwen3_moe", "coding-agent"],
    }
    if eval_index:
        meta["model-index"] = [
            {
                "name": f.info.get("run_id"),
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
    }
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
        "## Exported model",
        "",
        *export_lines,
        "",
        "## Deleted checkpoints (retention)",
        "",
        *_retention(f),
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
    ]

    return scrub_text("\n".join(parts))  # e.g. an override holding a token must not reach a published card


# --- CLI ------------------------------------------------------------------------------------------


def add_card_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("-o", "--output", help="write the card here (default: print it)")


def cmd_card(args) -> int:
    text = build_card(RunDir.open(args.run))
    if args.output:
        atomic_write_text(args.output, text)
    else:
        print(text, end="")
    return 0
