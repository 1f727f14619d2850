"""`snowcat plan`: what a run will cost before it is submitted (docs/planning.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json
from snowcat.slurm import site as site_mod

from . import compare, proposal, report, search
from .core import make_plan
from .lengths import inputs_of


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", help="run config (not with --compare)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dot paths)")
    p.add_argument(
        "--site",
        help="site profile: NAME or a YAML file (default: $SNOWCAT_SITE); --compare: instead of the run's own (e.g. one calibrated since)",
    )
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument(
        "--model-config",
        action="append",
        default=[],
        metavar="[SOURCE=]PATH",
        help="a Hugging Face config.json (or its directory) for an hf: model not staged here; SOURCE: which one (default: all)",
    )
    p.add_argument(
        "--budget", type=float, help="remaining allocation, in the site's charge unit: refuse a plan that charges more"
    )
    p.add_argument(
        "--proposal", metavar="FILE.md", help="write the technical justification of a compute-time proposal (and FILE.png)"
    )
    p.add_argument("--runs", type=int, default=1, help="--proposal: how many runs of this config the proposal asks for")
    p.add_argument("--search", metavar="STAGE", help="list the layouts of a training stage that fit, cheapest first")
    p.add_argument("--max-nodes", type=int, help="--search: at most this many trainer nodes")
    p.add_argument("--compare", metavar="RUN", help="a finished run: predicted against measured step time, memory, node-hours")


def model_configs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        source, sep, path = item.rpartition("=")
        out[source if sep else "*"] = path
    return out


def load_typed(config: str, overrides: list[str], site: str | None):
    cfg = config_mod.load(config, list(overrides), site=site)
    return config_mod.typed(cfg)


def _staging_from_anywhere(run, frozen) -> None:
    """A relative staging_dir is relative to where the run was submitted from (its jobs start
    there): found from the run directory's place under a relative run_root, so that the plan of a
    run reads its staged models from any working directory."""
    root = Path(str(frozen.get("run_root") or ""))
    parent = run.path.resolve().parent
    if not root.parts or root.is_absolute() or parent.parts[len(parent.parts) - len(root.parts) :] != root.parts:
        return
    submitted = Path(*parent.parts[: len(parent.parts) - len(root.parts)])
    for stage in (frozen.get("stages") or {}).values():
        staging = stage.get("staging_dir") if stage.get("kind") == "prestage" else None
        if staging and not Path(staging).is_absolute() and not Path(staging).exists():
            stage.staging_dir = str(submitted / staging)


def open_run(path: str, site: str | None):
    """(run, typed config, DAG, site name) of a run directory: its frozen config, planned on the
    site profile frozen in it, or on `site` where one is named (a run without a site, executor local;
    or a profile whose planner fields were calibrated since the run: its rules are the run's
    anyway, so only the planner's figures differ). $SNOWCAT_SITE stands in only for a run without one."""
    from snowcat.pipeline.dag import build  # noqa: PLC0415
    from snowcat.pipeline.rundir import RunDir  # noqa: PLC0415

    run = RunDir.open(path)
    frozen = run.config()
    _staging_from_anywhere(run, frozen)
    named = site
    site = site_mod.default_site(site)
    if site and (named or frozen.get("site") is None):
        _, profile = site_mod.site_config(site)
        frozen.site = OmegaConf.merge(OmegaConf.structured(site_mod.SiteProfile), profile)
    elif frozen.get("site") is not None:
        site = None  # the run's own profile
    return run, config_mod.typed(frozen), build(frozen), site


def cmd_plan(args) -> int:
    configs = model_configs(args.model_config)
    if args.compare:
        run, typed, dag, site = open_run(args.compare, args.site)
        done_dir = compare.finished(run, dag)
        plan = make_plan(typed, configs, inputs=lambda name: inputs_of(typed, name, done_dir))
        result = compare.compare(run, dag, plan)
        result["command"] = " ".join(["snowcat", "plan", "--compare", str(run.path), *(["--site", site] if site else [])])
        result["run_origin"] = (read_json(run.path / "run.json") or {}).get("origin")  # the config and overrides it ran
        result["site_profile"] = site or "the run's own (frozen in its config)"
        try:
            recorded = f"recorded in {compare.write(run, result)}; `snowcat card` includes it"
        except PermissionError:  # another user's run: compared all the same, recorded by its owner
            recorded = (
                f"not recorded: {run.path / compare.COMPARE} is not writable by you (its owner's `plan --compare` records it)"
            )
        print(report.to_json(result) if args.json else compare.text(result) + f"\n({recorded})")
        return 0
    if not args.config:
        raise UserError("snowcat plan: give a CONFIG (or --compare RUN)")
    site = site_mod.default_site(args.site)
    run = load_typed(args.config, args.overrides, site)
    if args.search:
        if run.site is None:
            raise UserError("snowcat plan --search needs a site profile: --site NAME (or $SNOWCAT_SITE)")
        result = search.search(run, args.search, configs, args.max_nodes)
        print(report.to_json(result) if args.json else search.text(result))
        return 0
    plan = make_plan(run, configs, args.budget)
    if args.proposal:
        written = proposal.write(plan, args.proposal, args.runs)
        print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    print(report.to_json(plan) if args.json else report.text(plan))
    return 0 if plan["fits"] else 1


def gate(cfg, printer) -> None:
    """What `snowcat run` does with the plan: print its summary line, refuse (UserError) a plan that
    cannot fit; a site without the planner's fields, or a model whose config is not here yet, gets a
    line saying the plan is not available, and the run goes on."""
    if cfg.get("site") is None:
        return
    try:
        plan = make_plan(config_mod.typed(cfg))
    except UserError as e:
        printer(f"plan: not available ({e})")
        return
    printer(report.summary(plan))
    hard = [p for p in plan["problems"] if "resources.time_min" not in p]  # walltime: an estimate, warned, not refused
    if hard:
        raise UserError(
            f"the plan cannot fit: {hard[0]}; nothing was submitted (`snowcat plan` for the breakdown; --skip-plan to submit anyway)"
        )
