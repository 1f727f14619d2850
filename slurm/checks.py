"""The checks of `snowcat doctor` that ask Slurm: the controller answers, the profile's partitions
exist with the GPUs it says, the account is associated, hetjobs, arrays and the MPI plugin are
accepted, the live limits (scontrol, sacctmgr: `slurm.limits`) against the profile's, and whether a
compute node reaches the internet (a tiny job step). Each returns a `Check` with the fix; every
command goes through `slurm.commands` (timeouts, retries on a busy controller).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

from snowcat.containers.wrap import site_mpi_plugin
from snowcat.slurm import commands
from snowcat.slurm import limits as limits_mod
from snowcat.slurm.limits import LiveLimits
from snowcat.slurm.site import SiteProfile, unsourced_limits

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail | skip (not checkable here: the detail says why)
    detail: str
    fix: str = ""
    found: dict = field(default_factory=dict)  # facts for `onboard` (accounts, partitions ...)


def _sh(cmd: list[str], timeout: float = 30) -> tuple[int, str]:
    """(exit code, stdout+stderr) of a Slurm command; 127 when it is missing, 124 on timeout."""
    reply = commands.query(cmd, timeout=timeout)
    return reply.code, (reply.out + reply.err).strip()


_minutes = limits_mod.minutes  # Slurm time limit in minutes (None: unlimited)


def profile_partitions(site: SiteProfile) -> dict[str, dict]:
    """{name: {gpus_per_node, max_time_min, ...}} from the profile."""
    return {name: dataclasses.asdict(part) for name, part in site.partitions.items()}


def _profile_time(spec: dict) -> int | None:
    for key in ("max_time_min", "walltime_min", "max_walltime_min", "time_limit_min"):
        if spec.get(key) is not None:
            return int(spec[key])
    return None


def profile_gpus(spec: dict) -> int | None:
    for key in ("gpus_per_node", "gpus"):
        if spec.get(key) is not None:
            return int(spec[key])
    return None


# --------------------------------------------------------------------------------------- checks


def check_slurm() -> Check:
    code, out = _sh(["scontrol", "version"])
    if code == 127:
        return Check("slurm", FAIL, "scontrol not found", "run doctor on a login node of the cluster (or `module load slurm`)")
    code2, out2 = _sh(["sinfo", "-h", "-o", "%P"])
    if code2 != 0:
        return Check(
            "slurm",
            FAIL,
            f"{out} installed but the controller does not answer: {out2.splitlines()[-1] if out2 else code2}",
            "check SLURM_CONF / that slurmctld is up (locally: `snowcat cluster up`)",
        )
    return Check("slurm", PASS, f"{out}; controller reachable", found={"version": out.split()[-1]})


def _sinfo_partitions() -> dict[str, dict]:
    code, out = _sh(["sinfo", "-h", "-o", "%P|%l|%G|%D|%a"])
    parts: dict[str, dict] = {}
    if code != 0:
        return parts
    for line in out.splitlines():
        name, limit, gres, nodes, avail = (line.split("|") + [""] * 5)[:5]
        name = name.rstrip("*")
        gpus = 0
        for item in gres.split(","):
            bits = item.split("(")[0].split(":")
            if bits[0] == "gpu" and bits[-1].isdigit():
                gpus = max(gpus, int(bits[-1]))
        entry = parts.setdefault(name, {"max_time_min": _minutes(limit), "gpus_per_node": 0, "nodes": 0, "up": avail == "up"})
        entry["gpus_per_node"] = max(entry["gpus_per_node"], gpus)
        entry["nodes"] += int(nodes) if nodes.isdigit() else 0
    return parts


def check_partitions(site: SiteProfile) -> Check:
    live = _sinfo_partitions()
    wanted = profile_partitions(site)
    if not live:
        return Check("partitions", FAIL, "sinfo lists no partitions", "check that Slurm answers (see the slurm check)")
    problems, fixes, notes = [], [], []
    for name, spec in wanted.items():
        if name not in live:
            problems.append(f"partition '{name}' does not exist")
            fixes.append(f"remove '{name}' from the profile's partitions or pick one of: {', '.join(sorted(live))}")
            continue
        want_g, have_g = profile_gpus(spec), live[name]["gpus_per_node"]
        # More GPUs than the nodes have: jobs would never start. Fewer is a choice (0: CPU-only use).
        if want_g is not None and want_g > have_g:
            problems.append(f"'{name}' has {have_g} GPUs per node, the profile says {want_g}")
            fixes.append(f"set partitions.{name}.gpus_per_node: {have_g}")
        elif want_g and want_g < have_g:
            notes.append(f"'{name}' nodes have {have_g} GPUs, the profile uses {want_g}")
        if not live[name]["up"]:
            problems.append(f"'{name}' is not up")
    found = {"partitions": live}
    if problems:
        return Check("partitions", FAIL, "; ".join(problems), "; ".join(fixes) or "ask the centre", found)
    names = (
        ", ".join(f"{n} ({live[n]['gpus_per_node']} GPU/node, {live[n]['max_time_min']} min)" for n in wanted)
        or "none in profile"
    )
    if notes:
        return Check(
            "partitions",
            WARN,
            f"profile partitions present: {names}; " + "; ".join(notes),
            "raise gpus_per_node in the profile to use every GPU",
            found,
        )
    return Check("partitions", PASS, f"profile partitions present: {names}", found=found)


def check_account(site: SiteProfile, user: str) -> Check:
    code, out = _sh(["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account,partition,qos"])
    if code != 0:
        return Check(
            "account",
            WARN,
            f"sacctmgr failed: {out.splitlines()[-1] if out else code}",
            "accounting is not queryable here; make sure jobs pass --account=<your project>",
        )
    accounts = sorted({line.split("|")[0] for line in out.splitlines() if line.strip()})
    want = site.account
    found = {"accounts": accounts}
    if not accounts:
        return Check(
            "account",
            FAIL,
            f"user {user} has no Slurm account association",
            "ask your PI/centre to add you to a project (JSC: JuDoor; TACC: the allocation's PI)",
            found,
        )
    if want and want not in accounts:
        return Check(
            "account",
            FAIL,
            f"account '{want}' is not one of {user}'s associations: {', '.join(accounts)}",
            f"set account: {preferred_account(accounts, user)} in your site override (`snowcat onboard`)",
            found,
        )
    if want:
        return Check("account", PASS, f"account '{want}' associated with {user}", found=found)
    required = site.account_required
    status = FAIL if required else (PASS if len(accounts) == 1 else WARN)
    return Check(
        "account",
        status,
        f"no account set{' (the site requires one)' if required else ''}; {user} has {', '.join(accounts)}",
        ""
        if status == PASS
        else f"set account: {preferred_account(accounts, user)} in your site override "
        f"(`python -m snowcat.pipeline.doctor --onboard FILE`)",
        found,
    )


def preferred_account(accounts: list[str], user: str) -> str:
    # A project account rather than a personal one named after the user (or root's own).
    return ([a for a in accounts if a not in (user, "root")] or accounts)[0]


def _test_only(args: list[str]) -> tuple[int, str]:
    return _sh(["sbatch", "--test-only", *args])


def _probe_partition(site: SiteProfile) -> str | None:
    wanted = profile_partitions(site)
    # The shortest-walltime partition is usually the devel/debug one: quickest to start a test job.
    if not wanted:
        return None
    return min(wanted, key=lambda n: _profile_time(wanted[n]) or 10**9)


def job_args(site: SiteProfile, checks: list[Check] = ()) -> list[str]:
    """--account/--partition for doctor's own test jobs: the profile's, unless doctor found them
    wrong; then what exists, so one wrong setting is reported once, not by every later check."""
    by_name = {c.name: c for c in checks}
    acct = site.account
    accounts = by_name["account"].found.get("accounts") if "account" in by_name else None
    if accounts is not None and acct not in accounts:
        acct = None  # the user's default account
    partition = _probe_partition(site)
    live = by_name["partitions"].found.get("partitions") if "partitions" in by_name else None
    if live and partition not in live:
        partition = next((p for p in live if live[p]["up"]), None)
    return ([f"--account={acct}"] if acct else []) + ([f"--partition={partition}"] if partition else [])


def check_hetjobs(site: SiteProfile, args: list[str] | None = None) -> Check:
    args = " ".join(job_args(site) if args is None else args)
    claimed = site.hetjobs_allowed
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(f"#!/bin/sh\n#SBATCH {args} -N1 -n1 -t 1\n#SBATCH hetjob\n#SBATCH {args} -N1 -n1 -t 1\ntrue\n")
    try:
        code, out = _test_only([f.name])
    finally:
        os.unlink(f.name)
    if code == 0:
        return Check("hetjobs", PASS, "a heterogeneous job passes `sbatch --test-only`")
    status = FAIL if claimed else WARN
    return Check(
        "hetjobs",
        status,
        f"hetjob rejected: {out.splitlines()[-1] if out else code}",
        "multi-role stages (RL) need hetjobs: ask the centre to allow them, or set hetjobs_allowed: false "
        "in the profile to run roles as separate jobs",
    )


def check_arrays(site: SiteProfile, args: list[str] | None = None) -> Check:
    claimed = site.arrays_allowed
    code, out = _test_only(
        [*(job_args(site) if args is None else args), "-N1", "-n1", "-t", "1", "--array=0-1", "--wrap", "true"]
    )
    if code == 0:
        return Check(
            "arrays",
            PASS if claimed else WARN,
            "job arrays accepted" + ("" if claimed else " (profile says not)"),
            "" if claimed else "set arrays_allowed: true in the profile",
        )
    return Check(
        "arrays",
        FAIL if claimed else PASS,
        f"job arrays rejected: {out.splitlines()[-1] if out else code}",
        "set arrays_allowed: false in the profile (fan-out then submits one job per item)" if claimed else "",
    )


def check_mpi(site: SiteProfile) -> Check:
    plugin = site_mpi_plugin(site)
    if site.launcher == "ibrun" and not shutil.which("ibrun"):
        return Check(
            "mpi",
            FAIL,
            "the profile's launcher is ibrun but ibrun is not on PATH",
            "run doctor on the site's login node, or set launcher: srun",
        )
    code, out = _sh(["srun", "--mpi=list"])
    if code != 0:
        return Check("mpi", FAIL, f"srun --mpi=list failed: {out}", "check that srun works on this node")
    listed = {
        line.strip().split()[-1]
        for line in out.splitlines()
        if line.strip() and not line.strip().endswith(":") and "plugin" not in line
    }
    if plugin is None:  # ibrun sites: hetjob steps use srun's default plugin
        code, default = _sh(["scontrol", "show", "config"])
        mpi_default = next(
            (line.split("=", 1)[1].strip() for line in default.splitlines() if line.replace(" ", "").startswith("MpiDefault=")),
            "unknown",
        )
        return Check(
            "mpi",
            PASS if mpi_default not in ("none", "unknown") else WARN,
            f"launcher ibrun; hetjob steps use srun's MpiDefault={mpi_default} (has: {', '.join(sorted(listed))})",
            ""
            if mpi_default not in ("none", "unknown")
            else "set mpi_plugin to one of the listed plugins so hetjob components share one MPI world",
            {"mpi": sorted(listed)},
        )
    if plugin in listed:
        return Check("mpi", PASS, f"srun --mpi={plugin} available", found={"mpi": sorted(listed)})
    return Check(
        "mpi",
        FAIL,
        f"srun has no --mpi={plugin} (has: {', '.join(sorted(listed))})",
        f"set mpi_plugin: <one of {', '.join(sorted(listed))}> in the profile (pmix for OpenMPI; JSC: pspmix)",
        {"mpi": sorted(listed)},
    )


# ------------------------------------------------------------------------------ live limits


def _unreadable(name: str, live: LiveLimits, what: str) -> Check:
    errors = "; ".join(live.errors) or "no answer"
    return Check(name, WARN, f"{what} not readable here ({errors})", "run doctor on a login node of the cluster")


def _partition_limit(name: str, site: SiteProfile, live: LiveLimits, key: str, have_of, unit: str, consequence: str) -> Check:
    """Compare one per-partition value of the profile (`key`) with what Slurm enforces (`have_of`
    applied to the partition's live limits; None: unlimited or not known)."""
    if not live.partitions:
        return _unreadable(name, live, "partition limits (scontrol show partition)")
    over, fine, unknown, override = [], [], [], {}
    for part_name, part in site.partitions.items():
        if part_name not in live.partitions:
            continue  # the partitions check reports it
        want, have = getattr(part, key), have_of(live.partitions[part_name])
        if have is None:
            unknown.append(part_name)
        elif want > have:
            over.append(f"'{part_name}' allows {have}{unit}, the profile says {want}")
            override[part_name] = {key: have}
        else:
            fine.append(f"{part_name} {want}{unit} (live {have})")
    if over:
        return Check(
            name,
            FAIL,
            "; ".join(over) + f": {consequence}",
            "; ".join(f"set partitions.{p}.{key}: {v[key]}" for p, v in override.items()),
            {"override": {"partitions": override}},
        )
    detail = "within the live limits: " + (", ".join(fine) or "no profile partition exists here")
    if unknown:
        detail += f"; unlimited or not reported for {', '.join(unknown)}"
    return Check(name, PASS, detail)


def check_node_limits(site: SiteProfile, live: LiveLimits) -> list[Check]:
    """Per partition: nodes per job (MaxNodes, at most the partition's nodes), walltime (MaxTime),
    memory per node (smallest RealMemory less MemSpecLimit, capped by MaxMemPerNode) and cores per
    node, against the profile (`scontrol show partition`, `scontrol show node`)."""
    return [
        _partition_limit(
            "limits.max_nodes",
            site,
            live,
            "max_nodes",
            lambda p: p.max_nodes,
            " nodes per job",
            "a stage asking for the profile's maximum is refused at submission (or never starts)",
        ),
        _partition_limit(
            "limits.max_time",
            site,
            live,
            "max_time_min",
            lambda p: p.max_time_min,
            " min",
            "longer walltimes are refused; stages plan their continuations on the profile's walltime",
        ),
        _partition_limit(
            "limits.memory",
            site,
            live,
            "mem_gb",
            lambda p: p.mem_gb,
            " GiB per node",
            "stages sized on the profile's memory are refused or run out of memory",
        ),
        _partition_limit(
            "limits.cores",
            site,
            live,
            "cpus_per_node",
            lambda p: p.cores_per_node if p.cores_per_node is not None else p.cpus_per_node,
            " cores per node",
            "jobs that take a whole node's cores (cpus-per-task x tasks) are refused",
        ),
    ]


def check_array_size(site: SiteProfile, live: LiveLimits) -> Check:
    """MaxArraySize (`scontrol show config`) against the profile's max_array_size."""
    name = "limits.array_size"
    if not site.arrays_allowed:
        return Check(name, PASS, "the profile submits no arrays (arrays_allowed: false)")
    have = live.max_array_size
    if have is None:
        return _unreadable(name, live, "MaxArraySize (scontrol show config)")
    if site.max_array_size > have:
        return Check(
            name,
            FAIL,
            f"MaxArraySize={have} (array indices 0..{have - 1}), the profile says max_array_size {site.max_array_size}: "
            "larger fan-outs are refused by sbatch",
            f"set max_array_size: {have}",
            {"override": {"max_array_size": have}},
        )
    note = f"; the profile could say up to {have}" if site.max_array_size < have else ""
    return Check(name, PASS, f"MaxArraySize={have}: the profile's max_array_size {site.max_array_size} fits{note}")


def check_requeue(site: SiteProfile, live: LiveLimits) -> Check:
    """JobRequeue (`scontrol show config`) against the profile's requeue_allowed."""
    name = "limits.requeue"
    if live.requeue is None:
        return _unreadable(name, live, "JobRequeue (scontrol show config)")
    if site.requeue_allowed and not live.requeue:
        return Check(
            name,
            WARN,
            "JobRequeue=0: batch jobs are not requeued unless they ask (snowcat passes --requeue); the profile relies on requeue",
            "if a walltime continuation does not come back, set requeue_allowed: false (chained continuation jobs)",
        )
    if site.requeue_allowed:
        return Check(name, PASS, "JobRequeue=1: jobs may be requeued, as the profile relies on")
    state = "allows requeue (JobRequeue=1)" if live.requeue else "does not requeue by default (JobRequeue=0)"
    return Check(name, PASS, f"the profile continues long stages with chained jobs; the scheduler {state}")


def check_submit_limits(site: SiteProfile, live: LiveLimits) -> Check:
    """Per-user submit limits (QoS MaxSubmitPU of each partition's QoS and of the association's job
    QoS, the association's MaxSubmitJobs; `sacctmgr`) against the profile's max_submit_jobs."""
    name = "limits.submit"
    if not live.accounting:
        known = ", ".join(f"{v} ({s})" for p in site.partitions for v, s in limits_mod.profile_submit_limits(site, p))
        return Check(
            name,
            WARN,
            f"QoS and association limits not readable ({'; '.join(live.errors) or 'sacctmgr gave nothing'}); "
            f"submissions are budgeted on the profile alone: {known or 'no limit'}",
            "run doctor where sacctmgr answers (a login node), or set max_submit_jobs in the profile by hand",
        )
    if not live.partitions:
        return _unreadable(name, live, "the partitions' QoS (scontrol show partition)")
    problems, notes, fixes, override = [], [], [], {}
    for part_name in site.partitions:
        if part_name not in live.partitions:
            continue
        live_found = limits_mod.live_submit_limits(live, part_name)
        profile_found = limits_mod.profile_submit_limits(site, part_name)
        have = min(live_found) if live_found else None
        want = min(profile_found) if profile_found else None
        if have is None:
            if want is not None:
                notes.append(f"'{part_name}': no live submit limit, the profile says {want[0]}")
            continue
        part = live.partitions[part_name]
        running = f", MaxJobsPU {part.max_jobs}" if part.max_jobs is not None else ""
        if want is None:
            problems.append(f"'{part_name}': {have[1]} is {have[0]}{running}; the profile names no submit limit")
        elif want[0] > have[0]:
            problems.append(f"'{part_name}': {have[1]} is {have[0]}{running}, the profile says {want[0]}")
        else:
            notes.append(f"'{part_name}' {want[0]} (live {have[0]})")
            continue
        fixes.append(f"set partitions.{part_name}.max_submit_jobs: {have[0]}")
        override[part_name] = {"max_submit_jobs": have[0]}
    user = f"{live.user}/{live.account}: " + (
        f"{live.max_submit_per_user} jobs ({live.max_submit_source})"
        if live.max_submit_per_user is not None
        else "no per-user MaxSubmit"
    )
    if live.max_jobs_per_user is not None:
        user += f", {live.max_jobs_per_user} running"
    if problems:
        return Check(
            name,
            WARN,
            "; ".join(problems) + f"; {user}",
            "; ".join(fixes),
            {"override": {"partitions": override}},
        )
    return Check(name, PASS, f"profile submit limits within the live ones: {', '.join(notes) or 'none set, none live'}; {user}")


def check_running_limits(site: SiteProfile, live: LiveLimits) -> Check:
    """Per-user running-job and node caps of each partition's QoS (MaxJobsPU, MaxTRESPU node=)
    against the profile's max_running_jobs / max_nodes_per_user: a profile above the live cap names
    the field (runs are planned on the stricter of the two either way)."""
    name = "limits.running"
    if not live.accounting or not live.partitions:
        return _unreadable(name, live, "the partitions' QoS (sacctmgr show qos, scontrol show partition)")
    problems, fixes, notes, override = [], [], [], {}
    for part_name, part in site.partitions.items():
        have = live.partitions.get(part_name)
        if have is None:
            continue
        for key, want, got, what in (
            ("max_running_jobs", part.max_running_jobs, have.max_jobs, "MaxJobsPU"),
            ("max_nodes_per_user", part.max_nodes_per_user, have.max_nodes_per_user, "MaxTRESPU node"),
        ):
            if got is None:
                continue
            if want is None or want > got:
                said = "names none" if want is None else f"says {want}"
                problems.append(f"partitions.{part_name}.{key}: QoS {have.qos} {what} is {got}, the profile {said}")
                fixes.append(f"set partitions.{part_name}.{key}: {got}")
                override.setdefault(part_name, {})[key] = got
            else:
                notes.append(f"{part_name}.{key} {want} (live {got})")
    if problems:
        return Check(name, WARN, "; ".join(problems), "; ".join(fixes), {"override": {"partitions": override}})
    return Check(name, PASS, f"within the live caps: {', '.join(notes) or 'none set, none live'}")


def check_limit_sources(site: SiteProfile) -> Check:
    """Every per-partition limit of the profile says where it came from (partitions.P.sources.F:
    a URL and the date read) or is listed in `unverified`."""
    missing = unsourced_limits(site)
    if missing:
        return Check(
            "limits.sources",
            WARN,
            f"no source for {', '.join(missing)}",
            f"add partitions.<p>.sources.<field>: '<URL> (read YYYY-MM-DD)', or list the key in unverified (first: {missing[0]})",
        )
    return Check("limits.sources", PASS, "every partition limit names its source or is listed as unverified")


def single_host_cluster() -> bool:
    """True when every Slurm node is this machine (the local test cluster): local disks are shared."""
    code, out = _sh(["sinfo", "-h", "-N", "-o", "%o"])
    addrs = set(out.split()) if code == 0 else set()

    return bool(addrs) and addrs <= {"127.0.0.1", "::1", "localhost", socket.gethostname()}


_INTERNET_PROBE = (
    "import socket,sys\n"
    "try: socket.create_connection((sys.argv[1], 443), timeout=10); print('ONLINE')\n"
    "except OSError as e: print('OFFLINE', e)"
)


def check_internet(site: SiteProfile, args: list[str] | None = None, host: str = "pypi.org", wait_s: int = 120) -> Check:
    claimed = site.internet_on_compute
    cmd = [
        "srun",
        *(job_args(site) if args is None else args),
        "-N1",
        "-n1",
        "-t",
        "2",
        f"--immediate={wait_s}",
        "--job-name=snowcat-doctor",
        "python3",
        "-c",
        _INTERNET_PROBE,
        host,
    ]
    code, out = _sh(cmd, timeout=wait_s + 120)
    if "ONLINE" not in out and "OFFLINE" not in out:
        return Check(
            "internet",
            WARN,
            f"test job did not run within {wait_s}s: {out.splitlines()[-1] if out else code}",
            "internet on compute nodes unverified; prestage everything to be safe",
        )
    online = "ONLINE" in out
    found = {"internet_on_compute": online}
    what = f"a compute node {'reaches' if online else 'cannot reach'} {host}:443"
    if claimed is None:
        return Check(
            "internet", WARN, what + "; the profile does not say", f"set internet_on_compute: {str(online).lower()}", found
        )
    if bool(claimed) == online:
        return Check("internet", PASS, what + " as the profile says", found=found)
    if claimed and not online:
        return Check(
            "internet",
            FAIL,
            what + " but the profile says compute nodes have internet",
            "set internet_on_compute: false and add a prestage stage (run it on the login node)",
            found,
        )
    return Check(
        "internet",
        WARN,
        what + " although the profile says they have none",
        "set internet_on_compute: true (prestaging still works)",
        found,
    )
