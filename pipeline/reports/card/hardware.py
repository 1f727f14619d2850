"""The card's record of where and how the run ran: software and installs, stages with their
hardware and hours, the credential scan, the model-card tags."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter

from snowcat.pipeline.fsio import read_json

from .facts import NR, Facts, one_or_each, shown


def software(f: Facts) -> tuple[list[str], dict]:
    records = [r for node in f.dag for u in node.units if (r := f.provenance(u.stage, u.index))]
    if not records:
        return [f"Software: {NR} (no provenance records)."], {}
    codes = {(r["code"].get("revision"), r["code"].get("patch_sha256"), r["code"].get("patch")) for r in records}
    images = {json.dumps(r.get("container"), sort_keys=True) for r in records}
    lines = []
    for rev, digest, patch in sorted(codes, key=str):
        lines.append(f"- Code: snowcat revision `{shown(rev)}` + patch `{shown(patch)}` (sha256 `{shown(digest)}`)")
    pythons = sorted({shown(r.get("python", {}).get("version")) for r in records})
    lines.append(f"- Python {', '.join(pythons)}; packages (over all {len(records)} unit records): {_packages(records) or NR}")
    lines += _installs(records)
    for image in sorted(images):
        c = json.loads(image)
        lines.append(
            "- Container: none (stages ran on the host)"
            if c is None
            else f"- Container: `{c.get('image')}` sha256 `{shown(c.get('sha256'))}`"
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
            f"{shown(model)} (torch kernels: {shown(capability)})"
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
            lines.append(f"{head}: compared with no lock ({shown(inst.get('lock_error'))})")
        else:
            differs = inst.get("mismatches") or []
            extra = inst.get("unlocked") or []
            verdict = f"differs from it in {len(differs)}: {', '.join(differs)}" if differs else "every locked package as pinned"
            lines.append(
                f"{head}: lock `{inst['lock']}` (sha256 `{shown(inst.get('lock_sha256'))}`), {verdict}"
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


def stages_section(f: Facts) -> tuple[list[str], dict]:
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
    return f"  - `{label}`: {status}, {attempts}{where}, wall-clock {shown(secs, '{:.0f} s')}, {gpu}"


def gpu_hours(totals: dict) -> str | None:
    """The checklist's GPU-hours: per stage and in total, from the stages' lines (`stages_section`)."""
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


def role_hardware(f: Facts, node, role: str) -> str:
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
    return f"{node.name}: {each[0][1]}" if node.items is None else one_or_each(each)


def _findings(report: dict) -> str:
    found = report.get("findings") or []
    where = f"in {report['files']} file(s)" if report.get("files") is not None else f"(files searched: {NR})"
    if not found:
        return f"clean: no credential found {where}"
    shown = "; ".join(f"`{r['file']}`:{r['line']} {r['kind']}" for r in found[:10])
    return f"{len(found)} CREDENTIAL FINDING(S) {where}: {shown}" + (
        f"; {len(found) - 10} more in scan.json" if len(found) > 10 else ""
    )


def credential_scan(f: Facts) -> tuple[list[str], str, list[str]]:
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


def tags(f: Facts, export: dict | None) -> list[str]:
    """Tags from what was recorded: the exported architecture, experts, and a coding-agent
    environment only where a training stage ran one."""
    found = ["snowcat"]
    # (an export record is a plain export stage's: a fanned-out one gives none, `export`)
    config = read_json(f.stage_dir(f.nodes("export")[0].name) / "model" / "config.json") if export else None
    if config:
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        found += (["mixture-of-experts"] if experts > 1 else []) + [config.get("model_type") or "unknown-architecture"]
    if any(getattr(c, "env", None) == "repo" for n in f.nodes("sft", "probe", "rl") for _, c, _ in f.units(n)):
        found.append("coding-agent")
    return found
