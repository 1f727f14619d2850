"""`snowcat doctor`: check, live, that a cluster is what its site profile says; `snowcat onboard`.

Every check asks the cluster itself (scontrol, sinfo, sacctmgr, sbatch --test-only, srun, a tiny
test job, the filesystem) and reports pass / warn / fail with the fix. Site profiles collect facts
from centre documentation, some unverified; doctor is where they meet reality.
`onboard` turns the findings into a user's site override (account, run root, partitions).
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from snowcat.containers.wrap import site_mpi_plugin
from snowcat.slurm.site import SiteProfile, load_site, use_local_cluster

from .errors import UserError
from .fsio import atomic_write_text
from .offline import require_staged

# Filesystems a compute node sees the same way as the login node (statfs type names, `stat -f -c %T`).
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "fuse.sshfs", "panfs", "wekafs")
PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str  # pass | warn | fail
    detail: str
    fix: str = ""
    found: dict = field(default_factory=dict)  # facts for `onboard` (accounts, partitions ...)


def _sh(cmd: list[str], timeout: float = 30, env: dict | None = None) -> tuple[int, str]:
    """(exit code, stdout+stderr); 127 when the program is missing, 124 on timeout."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: no answer after {timeout:.0f}s"
    return p.returncode, (p.stdout + p.stderr).strip()


def _minutes(limit: str) -> int | None:
    """Slurm time limit in minutes (None: unlimited). Forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    limit = limit.strip()
    if limit.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, rest = limit.rpartition("-")
    f = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = (f + [0, 0])[:3]
    else:
        h, m, s = {1: (0, f[0], 0), 2: (0, *f), 3: tuple(f)}[len(f)]
    return (int(days) if days else 0) * 1440 + h * 60 + m + (1 if s else 0)


def profile_partitions(site: SiteProfile) -> dict[str, dict]:
    """{name: {gpus_per_node, max_time_min, ...}} from the profile."""
    return {name: dataclasses.asdict(part) for name, part in site.partitions.items()}


def _profile_time(spec: dict) -> int | None:
    for key in ("max_time_min", "walltime_min", "max_walltime_min", "time_limit_min"):
        if spec.get(key) is not None:
            return int(spec[key])
    return None


def _profile_gpus(spec: dict) -> int | None:
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
        want_t, have_t = _profile_time(spec), live[name]["max_time_min"]
        if want_t is not None and have_t is not None and want_t > have_t:
            problems.append(f"'{name}' walltime is {have_t} min, the profile says {want_t}")
            fixes.append(f"set partitions.{name}.max_time_min: {have_t}")
        want_g, have_g = _profile_gpus(spec), live[name]["gpus_per_node"]
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
            f"set account: {_preferred_account(accounts, user)} in your site override (`snowcat onboard`)",
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
        else f"set account: {_preferred_account(accounts, user)} in your site override "
        f"(`python -m snowcat.pipeline.doctor --onboard FILE`)",
        found,
    )


def _preferred_account(accounts: list[str], user: str) -> str:
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


def check_apptainer(site: SiteProfile) -> Check:
    runtime = site.container_runtime
    binary = shutil.which("apptainer") or shutil.which("singularity")
    module = site.container_module or "apptainer"
    if not binary:
        if runtime == "apptainer":
            return Check(
                "apptainer",
                FAIL,
                "the profile runs stages in Apptainer but apptainer is not on PATH",
                f"`module load {module}` before snowcat (TACC: compute nodes only), or set container_runtime: none",
            )
        return Check(
            "apptainer",
            WARN,
            "apptainer not found; stages run without containers (runtime none)",
            f"to use images: `module load {module}` and set container_runtime: apptainer",
        )
    code, out = _sh([binary, "--version"])
    gpu = shutil.which("nvidia-smi")
    detail = f"{out.strip()}" + ("" if gpu else "; no nvidia-smi on this node, --nv not verifiable here")
    return Check(
        "apptainer",
        PASS if gpu or runtime == "none" else WARN,
        detail,
        "" if gpu else "run `snowcat doctor` inside a GPU job to check `apptainer exec --nv`",
        {"apptainer": out.strip()},
    )


def _single_host_cluster() -> bool:
    """True when every Slurm node is this machine (the local test cluster): local disks are shared."""
    code, out = _sh(["sinfo", "-h", "-N", "-o", "%o"])
    addrs = set(out.split()) if code == 0 else set()

    return bool(addrs) and addrs <= {"127.0.0.1", "::1", "localhost", socket.gethostname()}


def _fs_type(path: Path) -> str:
    code, out = _sh(["stat", "-f", "-c", "%T", str(path)])
    return out.strip() if code == 0 else "unknown"


def check_run_root(site: SiteProfile, run_root: str | os.PathLike, home: str | None = None) -> list[Check]:
    root = Path(os.path.expandvars(str(run_root))).expanduser().absolute()
    home = Path(home or os.path.expanduser("~")).resolve()
    existing = next((p for p in [root, *root.parents] if p.exists()), Path("/"))
    checks = []
    if root == home or home in root.resolve().parents or existing.resolve() == home:
        checks.append(
            Check(
                "run_root.home",
                FAIL,
                f"run root {root} is under $HOME ({home}): small quota, slow, often not for jobs",
                "set run_root to project or scratch storage (JSC: $PROJECT or $SCRATCH/snowcat; TACC: $WORK or $SCRATCH)",
            )
        )
    else:
        checks.append(Check("run_root.home", PASS, f"run root {root} is not under $HOME"))
    try:  # in the run root, or where it would be created: doctor itself creates nothing
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".snowcat-doctor-") as f:
            f.write(b"ok")
            f.flush()
        checks.append(
            Check(
                "run_root.writable",
                PASS,
                f"{existing} writable" + ("" if existing == root else f" ({root} will be created there)"),
            )
        )
    except OSError as e:
        checks.append(
            Check(
                "run_root.writable",
                FAIL,
                f"cannot write in {existing}: {e.strerror or e}",
                f"create {root} with the right group or choose another run_root",
            )
        )
        return checks
    root = existing
    fs = _fs_type(root)
    need_shared = site.shared_fs_required
    if fs in SHARED_FS:
        checks.append(Check("run_root.shared", PASS, f"{root} is on {fs} (shared)"))
    elif _single_host_cluster():
        checks.append(Check("run_root.shared", PASS, f"{root} is on {fs}; every Slurm node is this machine"))
    else:
        checks.append(
            Check(
                "run_root.shared",
                WARN if not need_shared else FAIL,
                f"{root} is on {fs}, not a known shared filesystem",
                "stages on other nodes must see the run dir: put run_root on the parallel filesystem"
                if need_shared
                else "fine for a single-machine cluster",
            )
        )
    usage = shutil.disk_usage(root)
    free_gb = usage.free / 2**30
    min_gb = site.min_free_gb
    checks.append(
        Check(
            "run_root.space",
            PASS if free_gb >= min_gb else WARN,
            f"{free_gb:.0f} GiB free on {root}",
            ""
            if free_gb >= min_gb
            else f"free space or quota below {min_gb:.0f} GiB: clean old runs (`snowcat` retention) or move run_root",
        )
    )
    quota = _quota(root, fs)
    if quota:
        checks.append(Check("run_root.quota", PASS, quota))
    scratch = site.scratch
    purge = site.scratch_purge_days
    if scratch and Path(os.path.expandvars(str(scratch))).expanduser() in [root, *root.parents]:
        checks.append(
            Check(
                "run_root.purge",
                WARN,
                f"run root is on scratch ({scratch})"
                + (f", purged after {purge} days unused" if purge else ", which centres purge"),
                "export finished runs (`snowcat card`, export stage) to project storage; keep staged artefacts out of scratch",
            )
        )
    return checks


def _quota(root: Path, fs: str) -> str | None:
    user = getpass.getuser()
    if fs == "lustre" and shutil.which("lfs"):
        code, out = _sh(["lfs", "quota", "-h", "-u", user, str(root)])
    elif fs == "gpfs" and shutil.which("mmlsquota"):
        code, out = _sh(["mmlsquota", "--block-size", "auto"])
    elif shutil.which("jutil"):
        code, out = _sh(["jutil", "user", "dataquota"])
    else:
        return None
    return f"quota: {out.splitlines()[-1].strip()}" if code == 0 and out else None


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


def check_staged(staging_dir: str | os.PathLike | None, names: Iterable[str]) -> Check:
    names = list(names)
    if not names:
        return Check("staged", PASS, "no staged artefacts required")
    if not staging_dir:
        return Check(
            "staged",
            FAIL,
            f"{len(names)} artefacts required but no staging dir configured",
            "set the prestage stage's staging_dir (shared storage) and run prestage",
        )
    try:
        paths = require_staged(staging_dir, names)
    except UserError as e:
        return Check("staged", FAIL, str(e), "run the prestage stage on a login node (it has internet)")
    return Check("staged", PASS, f"{len(paths)} artefacts staged in {staging_dir}")


# --------------------------------------------------------------------------------------- driver


def run_doctor(
    site_profile: SiteProfile,
    run_root: str | os.PathLike,
    *,
    user: str | None = None,
    staging_dir: str | os.PathLike | None = None,
    staged: Iterable[str] = (),
    jobs: bool = True,
    home: str | None = None,
    job_wait_s: int = 120,
) -> list[Check]:
    """Every check, in order. jobs=False skips the one that starts a (tiny) job; it waits at most
    job_wait_s for a node (a busy cluster turns the check into a warning, not a hang)."""
    user = user or getpass.getuser()
    checks = [check_slurm()]
    if checks[0].status != FAIL:
        checks += [check_partitions(site_profile), check_account(site_profile, user)]
        args = job_args(site_profile, checks)
        checks += [check_hetjobs(site_profile, args), check_arrays(site_profile, args), check_mpi(site_profile)]
    checks.append(check_apptainer(site_profile))
    checks += check_run_root(site_profile, run_root, home)
    if jobs and checks[0].status != FAIL:
        checks.append(check_internet(site_profile, job_args(site_profile, checks), wait_s=job_wait_s))
    checks.append(check_staged(staging_dir, staged))
    return checks


def format_checks(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([{k: v for k, v in asdict(c).items() if k != "found"} for c in checks], indent=2)
    mark = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}
    lines = []
    for c in checks:
        lines.append(f"{mark[c.status]}  {c.name:<18} {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"      {'':<18} fix: {c.fix}")
    failed = sum(c.status == FAIL for c in checks)
    lines.append(
        f"{failed} failed, {sum(c.status == WARN for c in checks)} warnings, {sum(c.status == PASS for c in checks)} passed"
    )
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def onboard(
    site_profile: SiteProfile,
    run_root: str | os.PathLike | None = None,
    checks: list[Check] | None = None,
    user: str | None = None,
    env: dict | None = None,
) -> dict:
    """A user's site override from doctor's findings, without questions: account, run root, partitions.

    Only what differs from (or is missing in) the profile is written; paths prefer the centre's
    project/work storage over scratch (purged) and never $HOME.
    """
    env = dict(os.environ if env is None else env)
    user = user or getpass.getuser()
    if run_root is None:
        for var, sub in (("PROJECT", f"{user}/snowcat"), ("WORK", "snowcat"), ("SCRATCH", "snowcat")):
            if env.get(var):
                run_root = str(Path(env[var]) / sub)
                break
    if checks is None:
        checks = run_doctor(site_profile, run_root or ".", user=user, jobs=False)
    by_name = {c.name: c for c in checks}
    override: dict[str, Any] = {}
    accounts = by_name.get("account", Check("", PASS, "")).found.get("accounts", [])
    want = site_profile.account
    if accounts and want not in accounts:
        # Prefer a project account over a personal/default one named after the user or root.
        override["account"] = _preferred_account(accounts, user)
    live = by_name.get("partitions", Check("", PASS, "")).found.get("partitions", {})
    if live:
        wanted = profile_partitions(site_profile)
        parts = {}
        for name, spec in wanted.items():
            if name in live:
                fixed = {}
                if _profile_gpus(spec) is not None and _profile_gpus(spec) > live[name]["gpus_per_node"]:
                    fixed["gpus_per_node"] = live[name]["gpus_per_node"]
                have_t, want_t = live[name]["max_time_min"], _profile_time(spec)
                if have_t is not None and want_t is not None and want_t > have_t:
                    fixed["max_time_min"] = have_t
                if fixed:
                    parts[name] = fixed
        if not any(n in live for n in wanted):  # none of the profile's partitions exist: offer the live ones
            parts = {n: {"gpus_per_node": s["gpus_per_node"], "max_time_min": s["max_time_min"]} for n, s in live.items()}
        if parts:
            override["partitions"] = parts
    if run_root is not None:
        override["run_root"] = str(run_root)
    internet = by_name.get("internet")
    if internet and "internet_on_compute" in internet.found:
        override["internet_on_compute"] = internet.found["internet_on_compute"]
    mpi = by_name.get("mpi")
    if mpi and mpi.status == FAIL and mpi.found.get("mpi"):
        listed = mpi.found["mpi"]
        override["mpi_plugin"] = "pmix" if "pmix" in listed else listed[0]
    return override


def write_override(override: dict, path: str | os.PathLike) -> Path:
    """Write the override as YAML (atomic); `snowcat run --site NAME` merges it over the profile."""

    path = Path(path)
    atomic_write_text(
        path, "# written by `snowcat onboard` from `snowcat doctor` findings\n" + OmegaConf.to_yaml(OmegaConf.create(override))
    )
    return path


# --------------------------------------------------------------------------------------- CLI


def load_profile(name: str | None) -> SiteProfile:
    """The site profile by name (slurm.site.load_site); without one, a generic profile that claims
    nothing a check could contradict (the generic checks only)."""
    if not name:
        return SiteProfile(
            name="generic",
            default_partition="",
            container_runtime="none",
            internet_on_compute=None,
            scratch=os.environ.get("SCRATCH", ""),
        )
    site = load_site(name)
    use_local_cluster(site)
    return site


def add_arguments(p) -> None:
    p.add_argument("--site", default=None, help="site profile to check against (slurm/sites/NAME.yaml)")
    p.add_argument("--run-root", default=None, help="where runs go (default: the profile's run_root, else ./logs)")
    p.add_argument("--staging-dir", default=None, help="staging dir whose artefacts must be present")
    p.add_argument("--staged", nargs="*", default=[], help="artefact names that must be staged")
    p.add_argument("--no-jobs", action="store_true", help="skip the check that starts a tiny test job")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_doctor(args) -> int:
    site = load_profile(args.site)
    run_root = args.run_root or site.run_root
    checks = run_doctor(site, run_root, staging_dir=args.staging_dir, staged=args.staged, jobs=not args.no_jobs)
    print(format_checks(checks, as_json=args.json))
    return exit_code(checks)


def cmd_onboard(args) -> int:
    """Write the user's site override (default ./site-override.yaml) from doctor's findings."""
    site = load_profile(args.site)
    run_root = args.run_root or None
    checks = run_doctor(site, run_root or site.run_root, jobs=not args.no_jobs)
    override = onboard(site, run_root, checks)
    path = write_override(override, getattr(args, "output", None) or "site-override.yaml")
    print(format_checks(checks, as_json=False) if not args.json else json.dumps(override, indent=2))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="snowcat doctor", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--onboard", metavar="OUTPUT", default=None, help="also write a site override YAML here")
    args = p.parse_args(argv)
    try:
        if args.onboard:
            args.output = args.onboard
            return cmd_onboard(args)
        return cmd_doctor(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
