"""A real Slurm cluster on this machine, for tests, demos and trying snowcat without a supercomputer.

`up(root)` starts munged, MariaDB + slurmdbd (so sacct/sacctmgr work), slurmctld and one slurmd per
virtual node (n1, n2: 8 CPUs, 8000 MB, 4 fake GPUs each) from Debian's packages, all inside `root`
(pids, logs, spool, state, configs). It is idempotent: running daemons are left alone, stale pid
files from a crash are cleared. `down(root)` cancels jobs and stops everything; `status(root)` says
what runs. Clients need only `SLURM_CONF` (see `<root>/env.sh`). Facts behind the configuration:
/work/shared/notes/slurm-test-cluster.md.

`up(root, site="tacc-vista")` runs the same two nodes under a real site's rules, from its profile
(`site_mode`), with Slurm's own mechanisms: the site's partitions with their MaxTime/MaxNodes, whole
nodes (OverSubscribe=EXCLUSIVE), AllocNodes, requeue off, one QOS per partition in slurmdbd with
its per-user caps (MaxSubmitJobsPerUser, MaxJobsPerUser, MaxTRESPerUser=node), and a job_submit/lua
filter that refuses what the site refuses (--mem, --gres, sbatch inside a job, a missing account)
with a message naming the rule. `up(root)` puts it back (its QOS are deleted).

    python -m snowcat.slurm.cluster up|down|status [--root DIR] [--as SITE]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import string
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock
from rich.console import Console
from rich.table import Table

from snowcat.pipeline import procid
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_dir, atomic_write_text

CLUSTER_NAME = "snowcat"
ACCOUNT = "snowcat"
NODES = ("n1", "n2")
CPUS_PER_NODE = 8
MEM_MB_PER_NODE = 8000
GPUS_PER_NODE = 4
MAX_TIME_MIN = 60
PARTITIONS = ("cpu", "gpu")
CRED_EXPIRE_S = 10  # also the delay before a requeued job may start again (Slurm's default: 120 s)
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0

TEMPLATES = Path(__file__).with_name("cluster")
_READY_NODE_STATES = {"idle", "mixed", "allocated", "completing"}
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # daemons live in sbin


class ClusterError(UserError):
    """The local cluster could not be started or stopped; the message ends with the log tail."""


@dataclass(frozen=True)
class ClusterInfo:
    root: Path
    slurm_conf: Path
    env: dict[str, str]  # what a client (sbatch, sacct, submitit) needs in its environment
    nodes: tuple[str, ...] = NODES
    partitions: tuple[str, ...] = PARTITIONS
    account: str = ACCOUNT
    ports: dict[str, int] = field(default_factory=dict)
    site: str | None = None  # the site whose rules it runs under (`up --as`), None: its own


def default_root() -> Path:
    env = os.environ.get("SNOWCAT_CLUSTER_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".cluster"


def _ports(root: Path) -> dict[str, int]:
    # Derived from the root path so that two roots on one machine do not collide.
    base = 20000 + (zlib.crc32(str(root).encode()) % 1200) * 10  # below the ephemeral range
    ports = {"slurmctld": base, "slurmdbd": base + 1, "mariadb": base + 2}
    ports.update({f"slurmd-{n}": base + 3 + i for i, n in enumerate(NODES)})
    return ports


# ---------------------------------------------------------------- daemons and pid files


@dataclass(frozen=True)
class _Daemon:
    name: str
    exe: str
    pidfile: Path
    log: Path


def _daemons(root: Path) -> list[_Daemon]:
    """In start order; `down` stops them in reverse."""
    run, log = root / "run", root / "log"
    ds = [
        _Daemon("munged", "munged", run / "munged.pid", log / "munged.log"),
        _Daemon("mariadbd", "mariadbd", run / "mariadbd.pid", log / "mariadbd.log"),
        _Daemon("slurmdbd", "slurmdbd", run / "slurmdbd.pid", log / "slurmdbd.log"),
        _Daemon("slurmctld", "slurmctld", run / "slurmctld.pid", log / "slurmctld.log"),
    ]
    ds += [_Daemon(f"slurmd-{n}", "slurmd", run / f"slurmd-{n}.pid", log / f"slurmd-{n}.log") for n in NODES]
    return ds


def _live_pid(d: _Daemon) -> int | None:
    """The daemon's pid if its pid file names a live (non-zombie) process of the right program."""
    try:
        pid = int(d.pidfile.read_text().split()[0])
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, ValueError, IndexError):
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return pid if state not in ("Z", "X") and Path(argv0).name == d.exe else None


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait(ready: Callable[[], bool], what: str, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise ClusterError(f"local cluster: {what} not ready after {timeout:.0f}s; tail of {log}:\n{_tail(log)}")
        time.sleep(0.3)


def _ok(cmd: list[str], env: dict[str, str], timeout: float = 20) -> bool:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> str:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise ClusterError(f"local cluster: `{' '.join(cmd)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout


def _start(d: _Daemon, argv: list[str], env: dict[str, str], daemonizes: bool = True) -> None:
    if _live_pid(d):
        return
    d.pidfile.unlink(missing_ok=True)  # stale, from a crash
    with open(d.log, "ab") as out:
        if daemonizes:
            p = subprocess.run(argv, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
            if p.returncode != 0:
                raise ClusterError(f"local cluster: {d.name} exited {p.returncode}; tail of {d.log}:\n{_tail(d.log)}")
        else:  # own session, so it outlives us and ignores our terminal's signals
            subprocess.Popen(argv, env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    _wait(lambda: _live_pid(d) is not None, d.name, d.log)


def _stop(d: _Daemon) -> None:
    """SIGTERM, SIGKILL past STOP_TIMEOUT_S; returns once the process has exited (its pid no longer
    runs the process it was: gone, a zombie, or reused)."""
    pid = _live_pid(d)
    process = procid.identify(pid) if pid else None  # the process, not the number: an exiting one's
    if procid.alive(process):  # cmdline is empty before it is a zombie, and `_live_pid` stops naming it
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while procid.alive(process) and time.monotonic() < deadline:
            time.sleep(0.2)
        if procid.alive(process):
            os.kill(pid, signal.SIGKILL)
            while procid.alive(process) and time.monotonic() < deadline + STOP_TIMEOUT_S:
                time.sleep(0.05)
    d.pidfile.unlink(missing_ok=True)


# ---------------------------------------------------------------- site modes

MODE_FILE = "site-mode.json"  # <root>/etc/: the site the cluster runs as, and the QOS it created


@dataclass(frozen=True)
class Qos:
    name: str
    max_submit: int | None = None  # MaxSubmitJobsPerUser
    max_jobs: int | None = None  # MaxJobsPerUser
    max_nodes: int | None = None  # MaxTRESPerUser=node=

    def sacctmgr_set(self) -> list[str]:
        """`sacctmgr modify qos NAME set ...` arguments (-1 clears a limit)."""
        v = [-1 if x is None else x for x in (self.max_submit, self.max_jobs, self.max_nodes)]
        return [f"MaxSubmitJobsPerUser={v[0]}", f"MaxJobsPerUser={v[1]}", f"MaxTRESPerUser=node={v[2]}"]


@dataclass(frozen=True)
class SiteMode:
    """What `up --as SITE` configures: slurm.conf lines, the QOS to create, the job_submit filter."""

    site: str
    partitions: tuple[str, ...]  # PartitionName= lines
    qos: tuple[Qos, ...]
    requeue: bool
    gpus: int  # fake GPUs per node
    lua: str  # job_submit.lua
    site_lines: tuple[str, ...]  # other slurm.conf lines
    partition_names: tuple[str, ...] = ()


def _lua_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _lua_filter(site) -> str:
    """job_submit.lua refusing, with the site's words, what the profile says the site refuses."""
    label = site.description.split(" — ")[0] or site.name
    rules = []
    if not site.sbatch_on_compute:
        rules.append(
            (
                "job_desc.script ~= nil and env ~= nil and (env.SLURM_JOB_ID ~= nil or env.SLURMD_NODENAME ~= nil)",
                f"{label}: sbatch is not available on compute nodes; submit from a login node",
            )
        )
    rejected = set(site.rejected_options)
    if "--mem" in rejected:
        rules.append(
            (
                "job_desc.pn_min_memory ~= nil and job_desc.pn_min_memory ~= slurm.NO_VAL64",
                f"{label}: --mem is not available; the scheduler will not accept jobs that set it (whole nodes are allocated)",
            )
        )
    if rejected & {"--gres", "--gpus-per-task"} or site.gpu_request == "none":
        rules.append(
            (
                "job_desc.tres_per_node ~= nil or job_desc.tres_per_task ~= nil or job_desc.tres_per_job ~= nil",
                f"{label}: --gres, --gpus and --gpus-per-task are not supported; the queue sets the GPUs",
            )
        )
    if rejected & {"--nodelist", "--exclude"}:
        rules.append(
            (
                "job_desc.req_nodes ~= nil or job_desc.exc_nodes ~= nil",
                f"{label}: jobs may not name or exclude nodes (--nodelist, --exclude)",
            )
        )
    if site.account_required:
        rules.append(
            (
                "job_desc.account == nil",
                f"{label}: no budget given: pass --account=<budget> or set it with " + (site.env_setup or "SBATCH_ACCOUNT"),
            )
        )
    checks = "".join(
        f"  if {cond} then\n    slurm.log_user({_lua_str(msg)})\n    return slurm.ERROR\n  end\n" for cond, msg in rules
    )
    return (
        f"-- job_submit/lua filter of `snowcat cluster up --as {site.name}` (slurm/cluster.py, from the site profile).\n"
        "function slurm_job_submit(job_desc, part_list, submit_uid)\n"
        "  local env = nil\n"
        "  if job_desc.script ~= nil then env = job_desc.environment end\n"
        f"{checks}"
        "  return slurm.SUCCESS\n"
        "end\n\n"
        "function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)\n"
        "  return slurm.SUCCESS\n"
        "end\n"
    )


def site_mode(name: str, host: str | None = None) -> SiteMode:
    """The local cluster's configuration under site `name`'s rules (its profile in slurm/sites/)."""
    from snowcat.slurm.site import load_site  # noqa: PLC0415 (site imports this module)

    site = load_site(name)
    # slurmctld takes a job's AllocNode from the address the request came from: 127.0.0.1 is
    # `localhost` for the login shell and for the virtual nodes alike (one host), so here the
    # job_submit filter is what refuses sbatch inside a job; on a real cluster AllocNodes alone does.
    host = host or "localhost"
    lines, qos = [], []
    for pname, part in site.partitions.items():
        words = [
            f"PartitionName={pname}",
            f"Nodes={_node_range()}",
            *(["Default=YES"] if pname == site.default_partition else []),
            f"MaxTime={part.max_time_min}",
            f"MaxNodes={part.max_nodes}",
            *(["OverSubscribe=EXCLUSIVE"] if site.exclusive_nodes else []),
            *([f"AllocNodes={host}"] if not site.sbatch_on_compute else []),
        ]
        limits = (part.max_submit_jobs, part.max_running_jobs, part.max_nodes_per_user)
        if any(v is not None for v in limits):
            qos.append(Qos(pname, *limits))
            words.append(f"QOS={pname}")
        lines.append(" ".join([*words, "State=UP"]))
    extra = []
    if site.arrays_allowed:
        extra.append(f"MaxArraySize={site.max_array_size + 1}")
    extra.append("JobSubmitPlugins=lua")
    gpus = max((p.gpus_per_node for p in site.partitions.values()), default=0)
    return SiteMode(
        site=site.name,
        partitions=tuple(lines),
        qos=tuple(qos),
        requeue=bool(site.requeue_allowed),
        gpus=max(1, min(gpus, GPUS_PER_NODE)),
        lua=_lua_filter(site),
        site_lines=tuple(extra),
        partition_names=tuple(site.partitions),
    )


def _node_range() -> str:
    return f"n[1-{len(NODES)}]"


def _ensure_qos(env: dict[str, str], root: Path, mode: SiteMode | None) -> None:
    """The site mode's QOS in slurmdbd, with their limits; those of an earlier mode that this one
    does not have are deleted (back to the cluster's own rules: all of them)."""
    record = root / "etc" / MODE_FILE
    before = json.loads(record.read_text()).get("qos", []) if record.is_file() else []
    want = {q.name: q for q in (mode.qos if mode else ())}
    existing = set(_run(["sacctmgr", "-n", "-P", "list", "qos", "format=name"], env).split())
    for q in want.values():
        if q.name not in existing:
            _run(["sacctmgr", "-i", "add", "qos", q.name], env)
        _run(["sacctmgr", "-i", "modify", "qos", "where", f"name={q.name}", "set", *q.sacctmgr_set()], env)
    for name in before:
        if name not in want and name in existing and name != "normal":
            _run(["sacctmgr", "-i", "delete", "qos", name], env)
    if mode is None:
        record.unlink(missing_ok=True)
    else:
        atomic_write_text(record, json.dumps({"site": mode.site, "qos": sorted(want)}) + "\n")


def current_site(root: Path | None = None) -> str | None:
    """The site whose rules the cluster under `root` runs as, None for its own."""
    record = Path(root or default_root()).resolve() / "etc" / MODE_FILE
    return json.loads(record.read_text()).get("site") if record.is_file() else None


# ---------------------------------------------------------------- configuration


def _client_env(root: Path) -> dict[str, str]:
    return {"SLURM_CONF": str(root / "etc" / "slurm.conf")}


def _render(root: Path, ports: dict[str, int], db_pass: str, mode: SiteMode | None = None) -> dict[str, str]:
    first, last = ports[f"slurmd-{NODES[0]}"], ports[f"slurmd-{NODES[-1]}"]
    gpus = mode.gpus if mode else GPUS_PER_NODE
    own = (
        f"PartitionName=cpu Nodes={_node_range()} Default=YES MaxTime={MAX_TIME_MIN} State=UP",
        f"PartitionName=gpu Nodes={_node_range()} MaxTime={MAX_TIME_MIN} State=UP",
    )
    values = dict(
        root=root,
        cluster=CLUSTER_NAME,
        host=socket.gethostname(),
        munge_socket=root / "run" / "munge.socket",
        cred_expire=CRED_EXPIRE_S,
        ctld_port=ports["slurmctld"],
        dbd_port=ports["slurmdbd"],
        db_port=ports["mariadb"],
        db_pass=db_pass,
        node_range=_node_range(),
        port_range=f"[{first}-{last}]",
        cpus=CPUS_PER_NODE,
        mem_mb=MEM_MB_PER_NODE,
        gpus=gpus,
        last_gpu=gpus - 1,
        max_time_min=MAX_TIME_MIN,
        requeue=0 if mode and not mode.requeue else 1,
        partitions="\n".join(mode.partitions if mode else own),
        site_lines="".join(f"{line}\n" for line in (mode.site_lines if mode else ())),
    )
    out = {
        n: string.Template((TEMPLATES / n).read_text()).substitute(values) for n in ("slurm.conf", "gres.conf", "slurmdbd.conf")
    }
    if mode:  # read by job_submit/lua from the directory of slurm.conf
        out["job_submit.lua"] = mode.lua
    return out


def _prepare(root: Path, mode: SiteMode | None = None) -> set[str]:
    """Create the directory tree, keys, fake GPUs and configs. The names of the configs that changed."""
    for sub in ("etc", "run", "log", "state", "dev", *(f"spool/{n}" for n in NODES), *(f"tmp/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # munged refuses group/other-writable directories on its paths
    key = root / "etc" / "munge.key"
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
    db_pass_file = root / "etc" / "db.pass"
    if not db_pass_file.exists():
        atomic_write_text(db_pass_file, secrets.token_hex(16))
        db_pass_file.chmod(0o600)
    for i in range(GPUS_PER_NODE):
        gpu = root / "dev" / f"gpu{i}"
        if not os.path.lexists(gpu):  # Slurm only stats them: /dev/null's device numbers
            try:
                os.mknod(gpu, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            except PermissionError:  # no CAP_MKNOD: a link to /dev/null stats the same
                gpu.symlink_to("/dev/null")
    changed = set()
    rendered = _render(root, _ports(root), db_pass_file.read_text().strip(), mode)
    for name, text in rendered.items():
        path = root / "etc" / name
        if not path.exists() or path.read_text() != text:
            if path.exists():
                changed.add(name)
            atomic_write_text(path, text)
    lua = root / "etc" / "job_submit.lua"
    if "job_submit.lua" not in rendered and lua.exists():
        lua.unlink()
        changed.add("job_submit.lua")
    (root / "etc" / "slurmdbd.conf").chmod(0o600)  # slurmdbd insists: it holds the DB password
    env_sh = "".join(f"export {k}={v}\n" for k, v in _client_env(root).items())
    atomic_write_text(root / "env.sh", env_sh)
    return changed


# ---------------------------------------------------------------- up / down / status


def up(root: Path | None = None, site: str | None = None) -> ClusterInfo:
    """Start (or complete) the cluster under `root`, under `site`'s rules if one is named (else its
    own: a cluster running as a site is put back); return once every node is usable."""
    root = Path(root or default_root()).resolve()
    mode = site_mode(site) if site and site != "local" else None  # a bad name fails before anything changes
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / ".lock"):  # concurrent test sessions may all call up()
        return _up(root, mode)


_CONTROLLER_CONFIGS = {"slurm.conf", "gres.conf", "job_submit.lua"}  # a change restarts slurmctld and the slurmds only


def _up(root: Path, mode: SiteMode | None = None) -> ClusterInfo:
    missing = [
        exe
        for exe in ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sacctmgr")
        if not shutil.which(exe, path=_SEARCH_PATH)
    ]
    if missing:
        raise ClusterError(f"local cluster: missing programs {missing}; run .ci/cluster.sh to install Debian's packages")
    changed = _prepare(root, mode)
    if changed and any(_live_pid(d) for d in _daemons(root)):
        # A changed config: restart rather than half-reconfigure; only the controller and the nodes
        # when only their files changed (a site mode), everything otherwise.
        _down(root, only_slurm=changed <= _CONTROLLER_CONFIGS)
    env = {**os.environ, **_client_env(root), "PATH": _SEARCH_PATH}
    ports = _ports(root)
    munged, mariadbd, slurmdbd, slurmctld, *slurmds = _daemons(root)
    etc, run = root / "etc", root / "run"

    _start(
        munged,
        [
            "munged",
            f"--key-file={etc / 'munge.key'}",
            f"--socket={run / 'munge.socket'}",
            f"--pid-file={munged.pidfile}",
            f"--log-file={munged.log}",
            f"--seed-file={run / 'munge.seed'}",
        ],
        env,
    )

    sock = run / "mysqld.sock"
    if not (root / "mysql").exists():  # built under a temp name: a failed install leaves nothing half-made
        with atomic_dir(root / "mysql") as datadir, open(mariadbd.log, "ab") as out:
            if (
                subprocess.run(
                    [
                        "mariadb-install-db",
                        "--no-defaults",
                        "--user=root",
                        f"--datadir={datadir}",
                        "--auth-root-authentication-method=socket",
                        "--skip-test-db",
                    ],
                    env=env,
                    stdout=out,
                    stderr=out,
                ).returncode
                != 0
            ):
                raise ClusterError(f"local cluster: mariadb-install-db failed; tail of {mariadbd.log}:\n{_tail(mariadbd.log)}")
    _start(
        mariadbd,
        [
            "mariadbd",
            "--no-defaults",
            "--user=root",
            f"--datadir={root / 'mysql'}",
            f"--socket={sock}",
            f"--port={ports['mariadb']}",
            "--bind-address=127.0.0.1",
            f"--pid-file={mariadbd.pidfile}",
            f"--log-error={mariadbd.log}",
            "--skip-name-resolve",
            "--innodb-buffer-pool-size=64M",
            "--performance-schema=OFF",
        ],
        env,
        daemonizes=False,
    )
    mysql = ["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root"]
    _wait(lambda: _ok([*mysql, "-e", "SELECT 1"], env), "mariadbd", mariadbd.log)
    db_pass = (etc / "db.pass").read_text().strip()
    _run(
        [
            *mysql,
            "-e",
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_pass}';"
            f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_pass}';"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';",
        ],
        env,
    )

    _start(slurmdbd, ["slurmdbd"], env)
    _wait(lambda: _ok(["sacctmgr", "-n", "list", "cluster"], env), "slurmdbd", slurmdbd.log)
    _ensure_accounting(env)
    _ensure_qos(env, root, mode)

    _start(slurmctld, ["slurmctld", "-f", env["SLURM_CONF"]], env)
    _wait(lambda: _ok(["scontrol", "ping"], env), "slurmctld", slurmctld.log)
    for d, node in zip(slurmds, NODES):
        _start(d, ["slurmd", "-N", node, "-f", env["SLURM_CONF"]], env)
    _wait(lambda: _nodes_ready(env), "nodes " + ",".join(NODES), slurmctld.log)
    return ClusterInfo(
        root=root,
        slurm_conf=etc / "slurm.conf",
        env=_client_env(root),
        partitions=mode.partition_names if mode else PARTITIONS,
        ports=ports,
        site=mode.site if mode else None,
    )


def _ensure_accounting(env: dict[str, str]) -> None:
    """Cluster, account `snowcat` and the current user in it: jobs with another account are refused."""
    user = pwd.getpwuid(os.getuid()).pw_name

    def has(kind: str, fmt: str, name: str) -> bool:
        return name in _run(["sacctmgr", "-n", "-P", "list", kind, f"format={fmt}"], env).split()

    if not has("cluster", "cluster", CLUSTER_NAME):
        _run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env)
    if not has("account", "account", ACCOUNT):
        _run(
            [
                "sacctmgr",
                "-i",
                "add",
                "account",
                ACCOUNT,
                f"cluster={CLUSTER_NAME}",
                "description=snowcat local test cluster",
                "organization=snowcat",
            ],
            env,
        )
    # root already has an association with the `root` account; check the (account, user) pair.
    if not has("association", "account,user", f"{ACCOUNT}|{user}"):
        _run(["sacctmgr", "-i", "add", "user", user, f"account={ACCOUNT}", f"cluster={CLUSTER_NAME}"], env)
    if not has("user", "user,defaultaccount", f"{user}|{ACCOUNT}"):
        _run(["sacctmgr", "-i", "modify", "user", user, "set", f"defaultaccount={ACCOUNT}"], env)


def _node_states(env: dict[str, str]) -> dict[str, str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return {}
    return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)


def _nodes_ready(env: dict[str, str]) -> bool:
    states = _node_states(env)
    # sinfo suffixes: * not responding, ~ powered off, # powering up, ! pending power down, etc.
    return all(states.get(n, "").rstrip("*~#!%$@^-+").lower() in _READY_NODE_STATES for n in NODES)


def down(root: Path | None = None) -> None:
    """Cancel all jobs and stop every daemon of the cluster under `root` (no-op if it is not running)."""
    root = Path(root or default_root()).resolve()
    if root.exists():
        with FileLock(root / ".lock"):
            _down(root)


def _down(root: Path, only_slurm: bool = False) -> None:
    """Cancel every job, then stop the daemons (with `only_slurm`, slurmctld and the slurmds)."""
    ds = _daemons(root)
    env = {**os.environ, **_client_env(root)}
    if _live_pid(ds[3]):  # slurmctld: cancel jobs so no step daemons outlive the cluster
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True, timeout=20).stdout.split()
        if jobs:
            _ok(["scancel", *jobs], env)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while (
                time.monotonic() < deadline
                and subprocess.run(
                    ["squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True, timeout=20
                ).stdout.split()
            ):
                time.sleep(0.5)
    # Controller first so it does not mark nodes down; then nodes, accounting, database, munge.
    for d in [ds[3], *ds[4:], *([] if only_slurm else [ds[2], ds[1], ds[0]])]:
        _stop(d)


def status(root: Path | None = None) -> dict:
    """{"root", "up", "daemons": {name: pid|None}, "nodes": {node: state}, "env", "ports"}."""
    root = Path(root or default_root()).resolve()
    daemons = {d.name: _live_pid(d) for d in _daemons(root)}
    env = {**os.environ, **_client_env(root)}
    nodes = _node_states(env) if daemons["slurmctld"] else {}
    return {
        "root": str(root),
        "up": all(daemons.values()) and _nodes_ready(env) if daemons["slurmctld"] else False,
        "daemons": daemons,
        "nodes": nodes,
        "env": _client_env(root),
        "ports": _ports(root),
    }


def _print_status(st: dict) -> None:
    table = Table(title=f"snowcat local cluster at {st['root']}: {'[green]UP' if st['up'] else '[red]DOWN'}")
    table.add_column("daemon")
    table.add_column("pid")
    table.add_column("state")
    for name, pid in st["daemons"].items():
        node = name.removeprefix("slurmd-") if name.startswith("slurmd-") else None
        state = st["nodes"].get(node, "") if node else ""
        table.add_row(name, str(pid) if pid else "[red]stopped", state)
    console = Console()
    console.print(table)
    if st["up"]:
        console.print(
            f"clients: [bold]source {st['root']}/env.sh[/bold]  (" + " ".join(f"{k}={v}" for k, v in st["env"].items()) + ")"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snowcat.slurm.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument(
        "--root", type=Path, default=None, help="cluster directory (default: $SNOWCAT_CLUSTER_ROOT or <repo>/.cluster)"
    )
    parser.add_argument(
        "--as", dest="site", default=None, help="up: run under this site's rules (a profile name, e.g. tacc-vista); none: its own"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            up(args.root, args.site)
        elif args.command == "down":
            down(args.root)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    st = status(args.root)
    _print_status(st)
    return 0 if st["up"] or args.command == "down" else 1


if __name__ == "__main__":
    sys.exit(main())
