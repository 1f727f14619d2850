"""`snowcat`: the command line. Every user error is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf, read_write
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from snowcat.slurm import site as site_mod
from snowcat.stages.registry import KINDS

from . import config as config_mod
from . import notify
from .dag import Dag, build
from .errors import UserError
from .executors import make_executor
from .fsio import remove_leftovers
from .progress import progress_lines, styled
from .reports import plot, traces
from .rundir import RunDir, new_run_id
from .schema import hf_sources, resolve_hf
from .scrub import scrub_text

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


# --- run / resume ----------------------------------------------------------------------------


def _plan_table(dag: Dag, cfg, run: RunDir | None = None) -> Table:
    table = Table(title=Text(f"plan: {cfg.name} (executor {cfg.executor.kind})"))
    for col in ("stage", "kind", "needs", "units", "resources", "action"):
        table.add_column(col)
    for node in dag:
        res = node.config.resources
        if res.components:
            what = " + ".join(f"{k}: {c.nodes}n×{c.gpus_per_node}g" for k, c in res.components.items())
        else:
            what = f"{res.nodes}n×{res.gpus_per_node}g {res.time_min}min"
        action = "run"
        if run is not None:
            status, _ = run.stage_status(dag, node.name)
            action = "skip (done)" if status == "done" else "run"
        table.add_row(*map(Text, (node.name, node.kind, ",".join(node.needs) or "-", str(len(node.units)), what, action)))
    return table


def drive(run: RunDir, dag: Dag, cfg) -> int:
    """Run or submit what is not done. Done stages are verified; changed outputs stop the run."""
    with run.driver_lock():
        executor = make_executor(cfg.executor.kind, run, dag, cfg)
        executor.refresh()
        todo = []
        for node in dag:
            status, problems = run.stage_status(dag, node.name)
            if status == "modified":
                raise UserError(
                    f"{problems[0]} — stage {node.name!r} is done but its outputs changed; restore them, "
                    f"or delete {run.stage_dir(node.name)} to recompute it"
                )
            if status == "stale":
                for unit in node.units:
                    with run.unit_lock(unit):
                        where = run.set_aside(unit)
                err.print(Text(f"{problems[0]}: re-running it; its old outputs are in {where.parent}"))
            if status != "done":
                todo.append(node.name)
        _remove_leftovers(run, dag)
        if not todo:
            err.print(Text.assemble((f"all {len(dag.nodes)} stages done", "green"), f" in {run.path}"))
            return 0
        skipped = [n for n in dag.order if n not in todo]
        if skipped:
            err.print(Text(f"skipping done stages (outputs verified): {', '.join(skipped)}"))
        err.print(Text.assemble("run ", (run.run_id, "bold"), f" in {run.path}"))
        code = executor.launch(todo)
    if cfg.executor.kind == "local":
        verdict = ("run finished", "green") if code == 0 else ("run stopped", "red")
        err.print(Text.assemble(verdict, f": snowcat status {run.path}"))
        notify.quietly(run)  # the config's notifications of failures or the end (this is no compute node)
    return code


def _remove_leftovers(run: RunDir, dag: Dag) -> None:
    """Temp files a killed writer left behind, in every unit nobody is running now."""
    for node in dag:
        for unit in node.units:
            try:
                with run.unit_lock(unit):
                    remove_leftovers(run.unit_dir(unit))
            except UserError:
                continue  # being run (by hand, or a job of this run): its temp files may be in use


def site_choice(args) -> tuple[str | None, str | None]:
    """(site, where the choice came from): `--site`, else $SNOWCAT_SITE unless the config names a
    site itself (`defaults: - site: NAME`), else none."""
    if args.site:
        return args.site, "--site"
    env = site_mod.default_site(None)
    if env and not config_mod.names_site(args.config):
        return env, f"${site_mod.SITE_ENV}"
    return None, None


def account_from_env(cfg) -> str | None:
    """Where the profile and config give no account, the one the environment selects for sbatch
    ($SBATCH_ACCOUNT, set at JSC by `jutil env activate -p <project>`) goes into the config, so the
    frozen config records the account the jobs ran under. Returns it when it was taken."""
    if cfg.get("site") is None or cfg.site.account:
        return None
    account = site_mod.env_account()
    if account:
        with read_write(cfg.site):  # the profile is read-only for the code that reads it, not for loading
            cfg.site.account = account
    return account


_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def run_root(cfg, placeholders: bool = False) -> Path:
    """Where new runs go: the config's `run_root` (the site profile's when the config sets none),
    shell variables ($PROJECT, $WORK, $USER) and ~ expanded here; an unset variable is a UserError
    naming the key that holds it (and the site's `env_setup` command that sets it), or, with
    `placeholders` (a dry run), stays in the path as written."""
    value = str(cfg.run_root)
    unset = [a or b for a, b in _VAR.findall(value) if not os.environ.get(a or b)]
    if unset and not placeholders:
        site = cfg.get("site")
        key = f"site {site.name}: key run_root" if site is not None and str(site.run_root) == value else "config key run_root"
        setup = f"run {site.env_setup} first, " if site is not None and site.get("env_setup") else ""
        raise UserError(
            f"{key} is {value!r}, but ${unset[0]} is not set on this machine; {setup or 'set it, '}"
            "or choose the directory with --run-dir DIR or run_root=DIR"
        )
    return Path(os.path.expanduser(os.path.expandvars(value)))


def cmd_run(args) -> int:
    overrides = list(args.overrides)
    if args.executor:
        overrides.append(f"executor.kind={args.executor}")
    site, site_from = site_choice(args)
    cfg = config_mod.load(args.config, overrides, site=site)
    account = account_from_env(cfg)
    if site_from and site_from != "--site":
        err.print(Text(f"site {site} (from {site_from})"))
    if account:
        err.print(Text(f"account {account} (from ${site_mod.ACCOUNT_ENV}: the site profile and config name none)"))
    dag = build(cfg)
    if cfg.executor.kind == "slurm" and not args.skip_plan:
        from .plan import command as plan_cmd  # noqa: PLC0415 (see _COMMANDS)

        plan_cmd.gate(cfg, lambda line: err.print(Text(line)))  # one line; refuses a plan that cannot fit
    run_dir = Path(args.run_dir) if args.run_dir else None
    existing = run_dir is not None and (run_dir / "config.yaml").is_file()
    if args.dry_run:
        return dry_run(cfg, dag, RunDir.open(run_dir) if existing else None, run_dir)
    if existing:
        run = RunDir.open(run_dir)
        if config_mod.to_yaml(run.config()) != config_mod.to_yaml(cfg):
            raise UserError(
                f"{run_dir}: holds a run with a different config; use another --run-dir or `snowcat resume {run_dir}`"
            )
    else:
        origin = {"config": str(Path(args.config).resolve()), "overrides": overrides, "site": site}
        if site_from and site_from != "--site":
            origin["site_from"] = site_from
        if account:
            origin["account_from"] = f"${site_mod.ACCOUNT_ENV}"
        run = RunDir.create(cfg, run_dir or run_root(cfg) / new_run_id(cfg.name), origin=origin)
    return drive(run, dag, cfg)


def dry_run(cfg, dag: Dag, run: RunDir | None, run_dir: Path | None) -> int:
    """The plan; for Slurm also every batch script a submission would send, after the same checks."""
    if cfg.executor.kind != "slurm":
        out.print(_plan_table(dag, cfg, run))
        out.print(Text("dry run: nothing written"))
        return 0
    target = run if run is not None else RunDir(run_dir or run_root(cfg, placeholders=True) / new_run_id(cfg.name))  # not created
    todo = [n for n in dag.order if run is None or run.stage_status(dag, n)[0] != "done"]
    scripts = Path(tempfile.mkdtemp(prefix="snowcat-dry-run-"))
    try:
        written = make_executor("slurm", target, dag, cfg).dry_run(todo, scripts)
    except BaseException:
        shutil.rmtree(scripts, ignore_errors=True)
        raise
    out.print(_plan_table(dag, cfg, run))
    out.print(
        Text(
            f"dry run: the {len(written)} batch script(s) a submission would send, rendered for run directory "
            f"{target.path}, are in {scripts}; nothing was submitted and the run directory was not written"
        )
    )
    return 0


def cmd_resume(args) -> int:
    run = RunDir.open(args.run)
    cfg = run.config()
    return drive(run, build(cfg), cfg)


# --- status / cancel ---------------------------------------------------------------------------


def status_record(run: RunDir) -> dict:
    cfg = run.config()
    dag = build(cfg)
    make_executor(cfg.executor.kind, run, dag, cfg).refresh()
    state = run.state()["stages"]
    stages = {}
    for node in dag:
        status, problems = run.stage_status(dag, node.name, verify="stat")  # sizes and mtimes; audit re-hashes
        record = dict(state.get(node.name, {}))
        units = {}
        for u in node.units:
            if u.index is not None:
                units[u.key] = {
                    "status": "done" if run.is_done(u) else state.get(u.key, {}).get("status", "pending"),
                    "metrics": run.metrics(u),
                }
        metrics = run.metrics(node.units[0]) if node.items is None else {}
        stages[node.name] = {
            "kind": node.kind,
            "status": status,
            "attempts": record.get("attempts", 0) or sum(state.get(k, {}).get("attempts", 0) for k in units),
            "job_ids": record.get("job_ids", []),
            "started": record.get("started"),
            "ended": record.get("ended"),
            "error": record.get("error"),
            "slurm": record.get("slurm"),
            "metrics": metrics,
            "problems": problems,
            "progress": progress_lines(run, dag, node.name) if status != "done" else [],
            "alarms": traces.stage_alarms(run, node),  # RL: entropy collapse, reward hacking
        } | ({"units": units} if units else {})
    record = {"run_id": run.run_id, "run_dir": str(run.path), "executor": cfg.executor.kind, "stages": stages}
    return record | {"curves": plot.status_line(run, cfg)}


_HEADLINE_HINTS = ("pass@1", "reward", "loss", "selected", "val", "train")


def _headline(metrics: dict, n: int = 3) -> str:
    """The few metrics worth a glance: pass rates first, then rewards, losses, counts."""

    def rank(key: str) -> int:
        return next((i for i, hint in enumerate(_HEADLINE_HINTS) if hint in key), len(_HEADLINE_HINTS))

    numeric = [
        (k, v) for k, v in metrics.items() if k != "duration_s" and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    items = sorted(numeric, key=lambda kv: rank(kv[0]))[:n]
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


def cmd_status(args) -> int:
    run = RunDir.open(args.run)
    record = status_record(run)
    notify.quietly(run)  # on stderr; sends the config's notifications from the login node
    if args.json:
        print(json.dumps(record, indent=2, default=str))
        return 0
    rows = []
    for name, s in record["stages"].items():
        dur = s["metrics"].get("duration_s")
        extra = (s.get("slurm") or {}) if s["status"] != "done" else {}  # scheduler info matters while unfinished
        note = (
            extra.get("reason")
            or (s.get("error") if s["status"] != "done" else "")
            or (s["problems"][0] if s["problems"] else "")
        )
        summary = Text(_headline(s["metrics"]) or "; ".join(s["progress"]))
        if note:
            summary.append(f" {note}" if summary else note, style="dim")
        for alarm in s["alarms"]:
            summary.append(f"\nALARM {alarm}", style="bold red")
        rows.append(
            [
                Text(name),
                Text(s["kind"]),
                styled(s["status"]),
                Text(str(s["attempts"])),
                Text(str((s["job_ids"] or ["-"])[-1])),
                Text(f"{dur:.0f}s" if dur else "-"),
                summary,
            ]
        )
    # One line per stage in any width (80 columns, a non-TTY log): the named columns keep their
    # width, the metrics take the rest and a value too long ends in "…" (`--json` has it whole);
    # alarms keep lines of their own.
    table = Table(title=Text(f"{record['run_id']}  ({record['executor']})"), expand=True)
    for i, col in enumerate(("stage", "kind", "status", "tries", "job", "time")):
        table.add_column(col, no_wrap=True, min_width=min(24, max([len(col), *(r[i].cell_len for r in rows)])))
    table.add_column("metrics", no_wrap=True, overflow="ellipsis", ratio=1)
    for row in rows:
        table.add_row(*row)
    out.print(table)
    if record["curves"]:
        out.print(Text(record["curves"]))  # folded at the console's width, as the table
    return 0


def cmd_cancel(args) -> int:
    run = RunDir.open(args.run)
    cfg = run.config()
    cancelled = make_executor(cfg.executor.kind, run, build(cfg), cfg).cancel()
    out.print(Text(f"cancelled: {', '.join(cancelled) or 'nothing was running'}"))
    return 0


def cmd_config(args) -> int:
    site, _ = site_choice(args)
    cfg = config_mod.load(args.config, list(args.overrides), site=site)
    account_from_env(cfg)
    print(OmegaConf.to_yaml(cfg, sort_keys=False), end="")
    for line in _model_sizes(config_mod.typed(cfg)):
        print(f"# {line}")  # comments: the output stays a valid config
    return 0


def _model_sizes(run) -> list[str]:
    """One line per hf: model a stage names whose config.json is readable here (local or staged)."""
    from snowcat.stages.model import hf  # noqa: PLC0415 (see _COMMANDS)

    from . import offline  # noqa: PLC0415

    staged = {}
    for stage in run.stages.values():
        if stage.kind == "prestage":
            staged |= {name: e["_root"] + "/" + e["path"] for name, e in offline.load_index(stage.staging_dir).items()}
    lines = []
    for name, stage in run.stages.items():
        for key, source in hf_sources(stage):
            path = resolve_hf(source, staged)
            if path is None:
                lines.append(f"stages.{name}.{key} {source}: not staged yet (its size shows once prestage ran)")
                continue
            try:
                mcfg = hf.model_config_from_hf(hf.read_hf_config(path), f"{path}/config.json")
            except UserError as e:
                lines.append(f"stages.{name}.{key} {source}: {e}")
                continue
            backend, zero = getattr(stage, "backend", "torch"), getattr(stage, "zero_stage", 0)
            world = stage.resources.nodes * stage.resources.tasks_per_node
            lines.append(
                f"stages.{name}.{key} {source}: " + hf.describe(mcfg, backend=backend, zero_stage=zero, world_size=world)
            )
    return lines


def cmd_cluster(args) -> int:
    from snowcat.slurm import cluster  # noqa: PLC0415 (see _COMMANDS)

    return cluster.main([args.action] + (["--root", args.root] if args.root else []) + (["--as", args.site] if args.site else []))


def cmd_site(args) -> int:
    from snowcat.slurm import detect  # noqa: PLC0415 (only this command needs it)

    draft = detect.detect(args.name)
    path = detect.write_draft(draft, args.output, force=args.force)
    fill = [k for k in draft.to_fill() if k not in ("name", "description", "sources")]
    err.print(
        Text(f"wrote {path}: {len(draft.marks) - len(draft.to_fill())} keys detected, to fill: {', '.join(fill) or 'nothing'}")
    )
    return 0


def cmd_tiny_hf(args) -> int:
    # torch and transformers load only when this command runs (as for bench)
    return importlib.import_module("snowcat.stages.model.tiny_hf").main(list(args.args))


def cmd_bench(args) -> int:
    try:
        module = importlib.import_module(f"snowcat.benchmarks.{args.name.replace('-', '_')}")  # trainer-memory
    except ModuleNotFoundError:
        raise UserError(f"unknown benchmark {args.name!r} (see benchmarks/)") from None
    return module.main(list(args.args))


# --- entry point -------------------------------------------------------------------------------


# Commands whose arguments and code live in a module of their own: (module, its add-arguments
# function, its command, summary). A module loads only when its command is asked for (to run, or for
# its --help): a `snowcat status` on a busy login node does not pay for the audit's or the planner's
# imports.
_COMMANDS = {
    "audit": (
        ".reports.audit",
        "add_audit_arguments",
        "cmd_audit",
        "re-hash every artefact, check provenance, history and credentials; verdict table",
    ),
    "compare": (
        ".reports.compare",
        "add_compare_arguments",
        "cmd_compare",
        "paired statistics over the checkpoints evaluate stages scored (Markdown + plots)",
    ),
    "traces": (
        ".reports.traces",
        "add_traces_arguments",
        "cmd_traces",
        "what agents did: behaviour, reward-hack detectors with examples, weight drift",
    ),
    "behaviour": (
        ".reports.behaviour",
        "add_behaviour_arguments",
        "cmd_behaviour",
        "two checkpoints compared by what their agents did (files, tests, claims, tokens; Markdown + plots)",
    ),
    "scan-data": (
        ".reports.scan_data",
        "add_scan_data_arguments",
        "cmd_scan_data",
        "how many SFT demonstrations match a pattern, by source, with examples",
    ),
    "card": (
        ".reports.card",
        "add_card_arguments",
        "cmd_card",
        "the provenance card (Markdown with model-card metadata) from recorded facts",
    ),
    "track": (
        ".tracking",
        "add_track_arguments",
        "cmd_track",
        "feed experiment trackers (wandb, tensorboard, mlflow) from the run directory",
    ),
    "sync": (
        ".tracking",
        "add_sync_arguments",
        "cmd_sync_and_notify",
        "upload the run's offline W&B runs (wandb sync; login node), record it in the run; send notifications",
    ),
    "plot": (
        ".reports.plot",
        "add_plot_arguments",
        "cmd_plot",
        "the run's curves as PNGs (reward, pass@1, entropy, mismatch, staleness, tokens/s, loss)",
    ),
    "notify": (
        ".notify",
        "add_notify_arguments",
        "cmd_notify",
        "summary lines of failures and the run's end; deliver them (login node; cron)",
    ),
    "reproduce": (
        ".reproduce",
        "add_reproduce_arguments",
        "cmd_reproduce",
        "re-run a run from its archived config and compare hashes and metrics",
    ),
    "doctor": (
        ".doctor",
        "add_arguments",
        "cmd_doctor",
        "check a cluster live against a site profile (pass/warn/fail with fixes)",
    ),
    "lock": (
        ".lock",
        "add_lock_arguments",
        "cmd_lock",
        "resolve an install set into its hashed lock (containers/locks/), or --export part of one",
    ),
    "onboard": (
        ".doctor",
        "add_onboard_arguments",
        "cmd_onboard",
        "write a user's site override (account, paths, partitions) from doctor's findings",
    ),
    "plan": (
        ".plan.command",
        "add_arguments",
        "cmd_plan",
        "memory per GPU, step time, node-hours and charge before submitting; --proposal, --search, --compare",
    ),
}


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser; of the `_COMMANDS`, only the one `argv` names gets its arguments."""
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    p = argparse.ArgumentParser(prog="snowcat", description="Post-train MoE models into coding agents on Slurm clusters.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="create a run from a config and run (local) or submit (slurm) its stages")
    r.add_argument("config")
    r.add_argument("overrides", nargs="*", help="key=value overrides (dot paths)")
    r.add_argument(
        "--run-dir", help="run directory (default: <run_root>/<run-id>; run_root: the config's, else the site profile's)"
    )
    r.add_argument("--executor", choices=["local", "slurm"])
    r.add_argument(
        "--site",
        help="site profile: NAME (slurm/sites/NAME.yaml) or a YAML file, e.g. an onboard override (default: $SNOWCAT_SITE)",
    )
    r.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    r.add_argument("--skip-plan", action="store_true", help="submit even where `snowcat plan` says the run cannot fit")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="stages of a run with status, jobs, durations and headline metrics")
    s.add_argument("run")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    rs = sub.add_parser("resume", help="run or resubmit what is not done")
    rs.add_argument("run")
    rs.set_defaults(func=cmd_resume)

    c = sub.add_parser("cancel", help="stop every process or job of a run")
    c.add_argument("run")
    c.set_defaults(func=cmd_cancel)

    cf = sub.add_parser(
        "config",
        help="print the resolved config (validates it)",
        epilog="stage kinds (docs/configuration.md):\n" + "\n".join(f"  {k.name:<10} {k.summary}" for k in KINDS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cf.add_argument("config")
    cf.add_argument("overrides", nargs="*")
    cf.add_argument("--site", help="as for run (default: $SNOWCAT_SITE)")
    cf.set_defaults(func=cmd_config)

    for name, (module, add_arguments, command, summary) in _COMMANDS.items():
        sp = sub.add_parser(name, help=summary)
        if name == chosen:  # only its module loads
            mod = importlib.import_module(module, __package__)
            getattr(mod, add_arguments)(sp)
            sp.set_defaults(func=getattr(mod, command))

    cl = sub.add_parser("cluster", help="the local virtual Slurm test cluster: up | down | status")
    cl.add_argument("action", choices=["up", "down", "status"])
    cl.add_argument("--root", help="cluster directory (default: $SNOWCAT_CLUSTER_ROOT or <repo>/.cluster)")
    cl.add_argument(
        "--as", dest="site", help="up: under this site's rules (e.g. tacc-vista, jsc-juwels-booster); without: its own"
    )
    cl.set_defaults(func=cmd_cluster)

    st = sub.add_parser("site", help="site profiles: `site detect` drafts one from the cluster you are logged in to")
    st.add_argument("action", choices=["detect"])
    st.add_argument("-o", "--output", default="site-draft.yaml", help="where to write the draft profile")
    st.add_argument("--name", default="draft", help="the profile's name")
    st.add_argument("--force", action="store_true", help="replace the output file if it exists")
    st.set_defaults(func=cmd_site)

    b = sub.add_parser("bench", help="run a benchmark from benchmarks/ (e.g. logprob)")
    b.add_argument("name")
    b.add_argument("args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)

    th = sub.add_parser("tiny-hf", help="write a small random Hugging Face checkpoint + tokenizer (tests, configs/hf-tiny.yaml)")
    th.add_argument("args", nargs=argparse.REMAINDER, help="OUT_DIR [--arch qwen3_moe|qwen3|olmoe] [--seed N]")
    th.set_defaults(func=cmd_tiny_hf)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser(argv)
    args, extra = p.parse_known_args(argv)
    if extra:  # key=value overrides are accepted anywhere, also after options
        if not hasattr(args, "overrides") or any("=" not in a or a.startswith("-") for a in extra):
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except UserError as e:
        err.print(f"[red]error:[/] {escape(scrub_text(str(e)))}", highlight=False, soft_wrap=True)  # may quote an override
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
