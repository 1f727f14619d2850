"""`snowcat doctor`: check, live, that a cluster is what its site profile says; `snowcat onboard`.

Every check asks the cluster itself (scontrol, sinfo, sacctmgr, sbatch --test-only, srun, a tiny
test job, the filesystem, the centre's budget tool) and reports pass / warn / fail with the fix, or
skip where there is nothing to ask (no budget tool). The checks that ask Slurm live in `slurm.checks`
(the limits from `slurm.limits`: one typed read of scontrol and sacctmgr); here are the ones on
packages, containers, storage and budget, the driver and `onboard`. Site profiles collect facts from
centre documentation, some unverified; doctor is where they meet reality (`CHECKED_KEYS`: which
check covers which profile key). `onboard` turns the findings into a user's site override: its
`base` profile and what differs (account, run root, partitions, limits).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import getpass
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from snowcat.slurm import commands
from snowcat.slurm import limits as limits_mod
from snowcat.slurm.checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    check_account,
    check_array_size,
    check_arrays,
    check_hetjobs,
    check_internet,
    check_limit_sources,
    check_mpi,
    check_node_limits,
    check_partitions,
    check_requeue,
    check_running_limits,
    check_slurm,
    check_submit_limits,
    job_args,
    preferred_account,
    profile_gpus,
    profile_partitions,
    single_host_cluster,
)
from snowcat.slurm.site import (
    SITES_DIR,
    SiteProfile,
    default_site,
    env_account,
    load_site,
    profile_path,
    use_local_cluster,
)

from . import lock as lock_mod
from .errors import UserError
from .fsio import atomic_write_text
from .offline import require_staged
from .plan import budget as budget_mod

# Filesystems a compute node sees the same way as the login node (statfs type names, `stat -f -c %T`).
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "fuse.sshfs", "panfs", "wekafs")


def _sh(cmd: list[str], timeout: float = 30, env: dict | None = None) -> tuple[int, str]:
    """(exit code, stdout+stderr); 127 when the program is missing, 124 on timeout."""
    reply = commands.run(cmd, timeout=timeout, env=env)
    if reply.code == commands.NO_ANSWER:
        return reply.code, f"{' '.join(cmd)}: {reply.err}"
    return reply.code, (reply.out + reply.err).strip()


# Which check confirms each profile key (fnmatch patterns): what docs/sites/*.md may say doctor
# confirms; a key that maps to nothing is one doctor does not check.
CHECKED_KEYS = {
    "partitions": "partitions",
    "default_partition": "partitions",
    "partitions.*.gpus_per_node": "partitions",
    "partitions.*.max_nodes": "limits.max_nodes",
    "partitions.*.max_time_min": "limits.max_time",
    "partitions.*.mem_gb": "limits.memory",
    "partitions.*.cpus_per_node": "limits.cores",
    "partitions.*.max_submit_jobs": "limits.submit",
    "partitions.*.max_running_jobs": "limits.running",
    "partitions.*.max_nodes_per_user": "limits.running",
    "max_submit_jobs": "limits.submit",
    "max_array_size": "limits.array_size",
    "requeue_allowed": "limits.requeue",
    "arrays_allowed": "arrays",
    "hetjobs_allowed": "hetjobs",
    "account": "account",
    "account_required": "account",
    "mpi_plugin": "mpi",
    "launcher": "mpi",
    "container_runtime": "apptainer",
    "internet_on_compute": "internet",
    "run_root": "run_root.*",
    "scratch_purge_days": "run_root.purge",
}


def checked_by(site: SiteProfile, key: str) -> str | None:
    """The doctor check that confirms profile key `key` (e.g. `partitions.gh.mem_gb`), None if none does.
    `container_module: null` (apptainer on PATH without a module) is what the apptainer check sees."""
    if key == "container_module":
        return "apptainer" if site.container_module is None else None
    return next((check for pattern, check in CHECKED_KEYS.items() if fnmatch.fnmatchcase(key, pattern)), None)


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


def check_megatron(have: Mapping[str, str] | None = None) -> Check:
    """Whether `trainer.backend: megatron` can run here, and on which path: megatron-core and mbridge
    installed (megatron-core 0.16.1 is the last release for Python 3.11), Transformer Engine for
    the fused GPU path (without it the backend takes megatron's local layers, as on a CPU)."""
    have = lock_mod.installed() if have is None else dict(have)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    missing = [n for n in ("megatron-core", "mbridge") if n not in have]
    if missing:
        fix = "pip install 'snowcat[megatron]' (megatron-core 0.16.1 on Python 3.11; newer releases need 3.12)"
        return Check("megatron", WARN, f"{' and '.join(missing)} not installed: trainer.backend megatron cannot run here", fix)
    te = "transformer-engine" in have or "transformer_engine" in have
    path = "Transformer Engine's fused layers" if te else "megatron's local layers (no Transformer Engine)"
    detail = f"megatron-core {have['megatron-core']}, mbridge {have['mbridge']} on Python {python}; {path}"
    return Check("megatron", PASS, detail, found={"megatron-core": have["megatron-core"], "transformer_engine": te})


def check_batch_reader() -> Check:
    """Whether the trainer checks received trajectory batches with the compiled check (stages/agent/
    _wire.c, built at install where a C compiler and Python's headers are found) or in Python, which
    costs a small batch's transfer more (docs/performance.md)."""
    from snowcat.stages.agent.trajectory import compiled_check  # noqa: PLC0415 (pyarrow: only when doctor runs)

    state = compiled_check()
    if state == "compiled":
        return Check("batch_reader", PASS, "received trajectory batches are checked by the compiled check")
    fix = "install gcc and Python's headers (python3-dev), then reinstall snowcat (`pip install -e .` in the checkout)"
    return Check("batch_reader", WARN, f"received trajectory batches are checked in {state}", fix)


def closed_to_others(path: str | os.PathLike) -> Path | None:
    """The first folder on `path` (after links), or the file itself, that other users may not pass
    through or execute; None when they may."""
    real = Path(os.path.realpath(path))
    return next((p for p in (*reversed(real.parents), real) if not p.stat().st_mode & stat.S_IXOTH), None)


def check_install(interpreter: str | None = None, package: str | os.PathLike | None = None) -> Check:
    """Whether users other than its owner can run this install: a centre's shared venv must be (a
    job runs the venv's python, a link to the interpreter it was made from, as its user, and a
    folder closed to others on that path, such as pyenv's under /root, fails the job's exec)."""
    interpreter = interpreter or sys.executable
    package = package or Path(__file__).resolve().parents[1]  # where `snowcat` is imported from
    for what, path in (("interpreter", interpreter), ("snowcat package", package)):
        closed = closed_to_others(path)
        if closed is not None:
            mode = f"{closed.stat().st_mode & 0o777:o}"
            detail = (
                f"other users cannot run this install: {closed} (mode {mode}) closes the path to its {what}"
                f" {os.path.realpath(path)}; fine for your own runs"
            )
            fix = "for a centre's install, make the venv from a Python every user may execute (the OS's or a module's) on shared storage (docs/admins.md)"
            return Check("install", WARN, detail, fix)
    return Check("install", PASS, f"other users can run this install (interpreter {os.path.realpath(interpreter)})")


def check_packages(have: Mapping[str, str] | None = None, set_name: str | None = None) -> Check:
    """The installed versions of the key packages (torch, vLLM, transformers, Triton, DeepSpeed,
    Megatron-Core, mpi4py) against the lock of this environment's set (`lock.current_set`: cpu where
    vLLM's or torch's CPU build is installed); every locked package is compared, drift warns."""
    have = lock_mod.installed() if have is None else dict(have)
    set_name = set_name or lock_mod.current_set(have)
    try:
        lock = lock_mod.find_lock(set_name)
    except UserError as e:
        versions = ", ".join(f"{n} {have[n]}" for n in lock_mod.KEY_PACKAGES if n in have) or "none of the key packages"
        fix = lock_mod.refresh_command(set_name, lock_mod.running_python(), lock_mod.machine())
        return Check("packages", WARN, f"{versions}; {e}", f"`{fix}` in a checkout, then install from it (docs/installs.md)")
    pins = lock.pins
    versions = ", ".join(
        f"{n} {have.get(n) or 'absent'}" + ("" if n in have and lock_mod.same_version(have[n], pins[n]) else f" (lock {pins[n]})")
        if n in pins
        else f"{n} {have[n]} (not in the lock)"
        for n in lock_mod.KEY_PACKAGES
        if n in pins or n in have
    )
    drifted = lock_mod.drift(lock, have)
    where = f"{set_name} lock {lock.label()}"
    if not drifted:
        return Check("packages", PASS, f"{versions}: all {len(pins)} packages as in the {where}", found={"lock": lock.label()})
    return Check(
        "packages",
        WARN,
        f"{versions}; {len(drifted)} of {len(pins)} locked packages differ from the {where}: "
        + ", ".join(drifted[:8])
        + (", ..." if len(drifted) > 8 else ""),
        f"{sys.executable} -m pip install --no-deps --require-hashes -r {lock.path} (a container: rebuild its image)",
        {"lock": lock.label(), "drift": drifted},
    )


# Compute-budget tools: JSC (`jutil`, older `sbudget`) and TACC (`taccinfo`, where the planner reads it).
TACCINFO = budget_mod.TACCINFO


def _budget_tools() -> list[tuple[str, list[str]]]:
    tools = []
    if shutil.which("jutil"):
        tools.append(("jutil", ["jutil", "user", "projects", "-o", "columns"]))
    if shutil.which("sbudget"):
        tools.append(("sbudget", ["sbudget"]))
    if os.access(TACCINFO, os.X_OK):
        tools.append(("taccinfo", [TACCINFO]))
    return tools


def check_budget(site: SiteProfile) -> Check:
    """The compute budget as the centre's own tool reports it (shown, not judged: their formats are
    the centres'); skipped where no such tool exists."""
    name = "budget"
    tools = _budget_tools()
    if not tools:
        return Check(
            name,
            SKIP,
            f"no budget tool here (JSC: jutil or sbudget on PATH; TACC: {TACCINFO}); compute budget not checked",
        )
    shown = []
    for tool, cmd in tools:
        code, out = _sh(cmd)
        if code != 0:
            return Check(
                name,
                WARN,
                f"`{' '.join(cmd)}` failed: {out.splitlines()[-1] if out else code}",
                "check your project membership with the centre (JSC: JuDoor; TACC: the allocation's PI)",
            )
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        if site.account and not any(site.account in line for line in lines):
            return Check(
                name,
                WARN,
                f"account '{site.account}' does not appear in `{' '.join(cmd)}`: " + " | ".join(lines[-6:]),
                "check that the account is a compute project (budget) you belong to",
                {"budget": lines},
            )
        ours = [line for line in lines if site.account and site.account in line]
        shown.append(f"{tool}: " + " | ".join(ours or lines[-6:]))
    return Check(name, PASS, "; ".join(shown), found={"budget": shown})


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
    elif single_host_cluster():
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
        live = limits_mod.live_limits(user=user, account=site_profile.account)
        checks += check_node_limits(site_profile, live)
        checks += [
            check_array_size(site_profile, live),
            check_requeue(site_profile, live),
            check_submit_limits(site_profile, live),
            check_running_limits(site_profile, live),
        ]
        args = job_args(site_profile, checks)
        checks += [check_hetjobs(site_profile, args), check_arrays(site_profile, args), check_mpi(site_profile)]
    checks.append(check_limit_sources(site_profile))
    checks.append(check_budget(site_profile))
    checks.append(check_apptainer(site_profile))
    checks.append(check_install())
    checks.append(check_packages())
    checks.append(check_megatron())
    checks.append(check_batch_reader())
    checks += check_run_root(site_profile, run_root, home)
    if jobs and checks[0].status != FAIL:
        checks.append(check_internet(site_profile, job_args(site_profile, checks), wait_s=job_wait_s))
    checks.append(check_staged(staging_dir, staged))
    return checks


def format_checks(checks: list[Check], as_json: bool = False) -> str:
    if as_json:
        return json.dumps([{k: v for k, v in asdict(c).items() if k != "found"} for c in checks], indent=2)
    mark = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL", SKIP: "SKIP"}
    lines = []
    for c in checks:
        lines.append(f"{mark[c.status]}  {c.name:<18} {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"      {'':<18} fix: {c.fix}")
    failed = sum(c.status == FAIL for c in checks)
    skipped = sum(c.status == SKIP for c in checks)
    lines.append(
        f"{failed} failed, {sum(c.status == WARN for c in checks)} warnings, {sum(c.status == PASS for c in checks)} passed"
        + (f", {skipped} skipped" if skipped else "")
    )
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def _merge(into: dict, more: dict) -> dict:
    """`more` merged into `into`, nested mappings key by key."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def onboard(
    site_profile: SiteProfile,
    run_root: str | os.PathLike | None = None,
    checks: list[Check] | None = None,
    user: str | None = None,
    env: dict | None = None,
    base: str | None = None,
) -> dict:
    """A user's site override from doctor's findings, without questions: account, run root,
    partitions, and every limit a check found the profile to overstate.

    Only what differs from (or is missing in) the profile is written; paths prefer the centre's
    project/work storage over scratch (purged) and never $HOME. With `base` (the profile's name or
    file) the override names it first, so `--site OVERRIDE.yaml` merges it over that profile.
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
    override: dict[str, Any] = {"base": base} if base else {}
    accounts = by_name.get("account", Check("", PASS, "")).found.get("accounts", [])
    want = site_profile.account
    if accounts and want not in accounts:
        # The account the environment selects ($SBATCH_ACCOUNT, JSC's `jutil env activate`) when it is
        # one of the user's; else a project account over a personal/default one named after the user or root.
        chosen = env_account(env)
        override["account"] = chosen if chosen in accounts else preferred_account(accounts, user)
    live = by_name.get("partitions", Check("", PASS, "")).found.get("partitions", {})
    if live:
        wanted = profile_partitions(site_profile)
        parts = {}
        for name, spec in wanted.items():
            if name in live:
                fixed = {}
                if profile_gpus(spec) is not None and profile_gpus(spec) > live[name]["gpus_per_node"]:
                    fixed["gpus_per_node"] = live[name]["gpus_per_node"]
                if fixed:
                    parts[name] = fixed
        if not any(n in live for n in wanted):  # none of the profile's partitions exist: offer the live ones
            parts = {n: {"gpus_per_node": s["gpus_per_node"], "max_time_min": s["max_time_min"]} for n, s in live.items()}
            override["default_partition"] = max(live, key=lambda n: live[n]["gpus_per_node"])
        if parts:
            override["partitions"] = parts
    for check in checks:  # what a limits check found the profile to overstate
        if check.status in (FAIL, WARN) and check.found.get("override"):
            _merge(override, json.loads(json.dumps(check.found["override"])))
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
    """Write the override as YAML (atomic). With its `base`, `snowcat run --site FILE` (or a config's
    `defaults: - site: FILE`) merges it over that profile."""

    path = Path(path)
    header = "# written by `snowcat onboard` from `snowcat doctor` findings\n"
    if override.get("base"):
        header += f"# use it as the site: snowcat run CONFIG --executor slurm --site {path} (merged over {override['base']})\n"
    atomic_write_text(path, header + OmegaConf.to_yaml(OmegaConf.create(override)))
    return path


def override_base(name: str) -> tuple[str, dict]:
    """(what a new override names as its base, values of an old override to keep) for an override
    written from `--site name`: a known site by name, a profile file by absolute path; an override
    file is flattened (its own base, its values kept), so rewriting an override in place never makes
    it its own base."""
    path = profile_path(name)
    if path.parent.resolve() == SITES_DIR.resolve():
        return path.stem, {}
    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    if not isinstance(raw, dict) or "base" not in raw:
        return str(path.resolve()), {}
    base = str(raw.pop("base"))
    if Path(base).suffix in (".yaml", ".yml") and not Path(base).expanduser().is_absolute():
        base = str((path.parent / base).resolve())
    return base, raw


# --------------------------------------------------------------------------------------- CLI


def load_profile(name: str | None, account_from_env: bool = True) -> SiteProfile:
    """The site profile by name or file (slurm.site.load_site; default $SNOWCAT_SITE), its account
    taken from $SBATCH_ACCOUNT where it names none (as `snowcat run` does); without any, a generic
    profile that claims nothing a check could contradict (the generic checks only)."""
    name = default_site(name)
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
    if account_from_env and site.account is None and env_account():
        site = dataclasses.replace(site, account=env_account())
        print(f"account {site.account} (from $SBATCH_ACCOUNT: the site profile names none)", file=sys.stderr)
    return site


def add_arguments(p) -> None:
    p.add_argument(
        "--site",
        default=None,
        help="site profile to check against: NAME (slurm/sites/NAME.yaml) or a YAML file (default: $SNOWCAT_SITE)",
    )
    p.add_argument("--run-root", default=None, help="where runs go (default: the profile's run_root, else ./logs)")
    p.add_argument("--staging-dir", default=None, help="staging dir whose artefacts must be present")
    p.add_argument("--staged", nargs="*", default=[], help="artefact names that must be staged")
    p.add_argument("--no-jobs", action="store_true", help="skip the check that starts a tiny test job")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_onboard_arguments(p) -> None:
    add_arguments(p)
    p.add_argument("-o", "--output", default="site-override.yaml")


def cmd_doctor(args) -> int:
    site = load_profile(args.site)
    run_root = args.run_root or site.run_root
    checks = run_doctor(site, run_root, staging_dir=args.staging_dir, staged=args.staged, jobs=not args.no_jobs)
    print(format_checks(checks, as_json=args.json))
    return exit_code(checks)


def cmd_onboard(args) -> int:
    """Write the user's site override (default ./site-override.yaml) from doctor's findings: it
    names its base profile, so `--site FILE` uses it."""
    name = default_site(args.site)
    if not name:
        raise UserError("onboard needs a site to write an override for: --site NAME (or set $SNOWCAT_SITE)")
    base, kept = override_base(name)
    site = load_profile(name)
    run_root = args.run_root or None
    checks = run_doctor(site, run_root or site.run_root, jobs=not args.no_jobs)
    found = onboard(load_profile(name, account_from_env=False), run_root, checks)
    override = {"base": base, **_merge(kept, found)}
    path = write_override(override, args.output)
    print(format_checks(checks, as_json=False) if not args.json else json.dumps(override, indent=2))
    print(f"wrote {path}: use it with --site {path}")
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
