"""What a Slurm cluster allows, read live: partition limits, array size, requeue, submit limits.

`live_limits()` asks the cluster itself (`scontrol show config|partition|node`, `sacctmgr show
qos|assoc|user`) and returns a typed `LiveLimits`; a query that fails leaves its values None and
says why in `errors` (a cluster without slurmdbd has no QoS data, a login node may not answer
sacctmgr). `snowcat doctor` compares it with the site profile; `submit_limit(site, partition)`
gives the job budget of a submission the tightest submit limit known, live or from the profile.

Units follow the profiles: minutes, GiB (floor of Slurm's MiB), physical cores. Nothing here
changes the cluster.
"""

from __future__ import annotations

import getpass
import os
import time
from dataclasses import dataclass, field
from typing import Any

from snowcat.slurm import commands

QUERY_TIMEOUT_S = 20.0  # a slurmdbd that does not answer must not hang a submission
CACHE_S = 60.0  # live values are reused this long within one process (a submission asks per stage)


@dataclass(frozen=True)
class PartitionLimits:
    """One partition as Slurm enforces it (None: unlimited, or not known)."""

    max_nodes: int | None = None  # per job: MaxNodes, at most the partition's node count
    max_time_min: int | None = None  # MaxTime
    mem_gb: int | None = None  # per node a job may ask for: smallest RealMemory - MemSpecLimit, capped by MaxMemPerNode
    qos: str | None = None  # the partition's QoS (QoS=), applied to every job in it
    max_submit: int | None = None  # that QoS's MaxSubmitPU (jobs + array tasks queued or running, per user)
    max_jobs: int | None = None  # that QoS's MaxJobsPU (running at once, per user)
    max_nodes_per_user: int | None = None  # that QoS's MaxTRESPU node= (nodes over a user's running jobs)
    cores_per_node: int | None = None  # smallest Sockets x CoresPerSocket of its nodes
    cpus_per_node: int | None = None  # smallest CPUTot (Slurm CPUs: threads where hyperthreading is configured)
    nodes: int = 0


@dataclass(frozen=True)
class Association:
    """A user's association (sacctmgr show assoc): the account, its limits and the QoS it may use."""

    account: str
    partition: str = ""  # "" : every partition
    qos: tuple[str, ...] = ()
    default_qos: str = ""
    max_submit: int | None = None  # MaxSubmitJobs of the association
    max_jobs: int | None = None

    def job_qos(self) -> str | None:
        """The QoS a job of this association runs under when it names none."""
        if self.default_qos:
            return self.default_qos
        if len(self.qos) == 1:
            return self.qos[0]
        return "normal" if "normal" in self.qos else None


@dataclass(frozen=True)
class LiveLimits:
    cluster: str | None = None
    max_array_size: int | None = None  # MaxArraySize: array indices must be below it
    requeue: bool | None = None  # JobRequeue: batch jobs requeueable by default
    user: str = ""
    account: str | None = None  # the account the per-user values are for (the profile's, else the default)
    max_submit_per_user: int | None = None  # tightest of the account's association MaxSubmit and its job QoS MaxSubmitPU
    max_submit_source: str = ""
    max_jobs_per_user: int | None = None
    partitions: dict[str, PartitionLimits] = field(default_factory=dict)
    qos: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # name -> (MaxSubmitPU, MaxJobsPU)
    qos_nodes: dict[str, int | None] = field(default_factory=dict)  # name -> MaxTRESPU node=
    associations: tuple[Association, ...] = ()
    errors: tuple[str, ...] = ()  # queries that did not answer, one line each

    def __post_init__(self):
        if self.max_submit_per_user is None and not self.max_submit_source and self.associations:
            submit, source = _user_submit_limit(self, None)
            assoc = self.association()
            running = [assoc.max_jobs, self.qos.get(assoc.job_qos() or "", (None, None))[1]] if assoc else []
            running = [v for v in running if v is not None]
            object.__setattr__(self, "max_submit_per_user", submit)
            object.__setattr__(self, "max_submit_source", source)
            if self.max_jobs_per_user is None:
                object.__setattr__(self, "max_jobs_per_user", min(running) if running else None)

    @property
    def accounting(self) -> bool:
        """Whether sacctmgr answered (QoS and association values are known)."""
        return bool(self.qos) or bool(self.associations)

    def association(self, partition: str | None = None) -> Association | None:
        """The association a job of `account` on `partition` is charged to: a partition-specific
        one first, else the account's own."""
        rows = [a for a in self.associations if a.account == self.account]
        exact = [a for a in rows if partition and a.partition == partition]
        general = [a for a in rows if not a.partition]
        return (exact or general or [None])[0]


# ------------------------------------------------------------------------------------ parsing


def minutes(limit: str) -> int | None:
    """Slurm time limit in minutes (None: unlimited). Forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    limit = limit.strip()
    if limit.lower() in ("infinite", "unlimited", "n/a", "none", ""):
        return None
    days, _, rest = limit.rpartition("-")
    f = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = (f + [0, 0])[:3]
    else:
        h, m, s = {1: (0, f[0], 0), 2: (0, *f), 3: tuple(f)}[len(f)]
    return (int(days) if days else 0) * 1440 + h * 60 + m + (1 if s else 0)


def _int(value: Any) -> int | None:
    """An integer limit (None for unlimited, unset or not a number)."""
    text = str(value or "").strip()
    return int(text) if text.isdigit() else None


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` -> {key: value}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol -o show partition|node`: one record a line of KEY=VALUE tokens; a token without
    `=` continues the previous value (OS=Linux 6.1 #1 SMP, Reason=...)."""
    records = []
    for line in text.splitlines():
        record: dict[str, str] = {}
        last = None
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep and key and (key[0].isupper() or key[0].isdigit()):
                record[key] = value
                last = key
            elif last is not None:
                record[last] += " " + token
        if record:
            records.append(record)
    return records


def _mem_gb(mib: int | None) -> int | None:
    return None if mib is None else mib // 1024


def partition_limits(
    partitions: str, nodes: str, qos: dict[str, tuple[int | None, int | None]], qos_nodes: dict[str, int | None] | None = None
) -> dict[str, PartitionLimits]:
    """PartitionLimits from `scontrol -o show partition` and `scontrol -o show node` output."""
    per_part: dict[str, list[dict[str, str]]] = {}
    for node in parse_records(nodes):
        for name in (node.get("Partitions") or "").split(","):
            if name:
                per_part.setdefault(name, []).append(node)
    out = {}
    for rec in parse_records(partitions):
        name = rec.get("PartitionName")
        if not name:
            continue
        members = per_part.get(name, [])
        total = _int(rec.get("TotalNodes")) or len(members)
        max_nodes = _int(rec.get("MaxNodes"))
        if total:
            max_nodes = min(max_nodes, total) if max_nodes is not None else total
        mems = [
            (_int(n.get("RealMemory")) or 0) - (_int(n.get("MemSpecLimit")) or 0) for n in members if _int(n.get("RealMemory"))
        ]
        mem = min(mems) if mems else None
        cap = _int(rec.get("MaxMemPerNode"))
        if cap is not None:
            mem = min(mem, cap) if mem is not None else cap
        cores = [
            _int(n.get("Sockets")) * _int(n.get("CoresPerSocket"))
            for n in members
            if _int(n.get("Sockets")) and _int(n.get("CoresPerSocket"))
        ]
        cpus = [_int(n.get("CPUTot")) for n in members if _int(n.get("CPUTot"))]
        part_qos = rec.get("QoS") if rec.get("QoS") not in (None, "", "N/A", "(null)") else None
        submit, jobs = qos.get(part_qos, (None, None)) if part_qos else (None, None)
        out[name] = PartitionLimits(
            max_nodes=max_nodes,
            max_time_min=minutes(rec.get("MaxTime", "")),
            mem_gb=_mem_gb(mem),
            qos=part_qos,
            max_submit=submit,
            max_jobs=jobs,
            max_nodes_per_user=(qos_nodes or {}).get(part_qos) if part_qos else None,
            cores_per_node=min(cores) if cores else None,
            cpus_per_node=min(cpus) if cpus else None,
            nodes=total,
        )
    return out


def parse_qos(text: str) -> dict[str, tuple[int | None, int | None]]:
    """`sacctmgr -n -P show qos format=name,maxsubmitpu,maxjobspu` -> {name: (MaxSubmitPU, MaxJobsPU)}."""
    out = {}
    for line in text.splitlines():
        name, submit, jobs = (line.split("|") + ["", "", ""])[:3]
        if name.strip():
            out[name.strip()] = (_int(submit), _int(jobs))
    return out


QOS_FORMAT = "name,maxsubmitpu,maxjobspu,maxtrespu"


def tres_nodes(tres: str) -> int | None:
    """The node= count of a TRES string (`cpu=96,node=4`), None when it names none."""
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "node":
            return _int(value)
    return None


def parse_qos_nodes(text: str) -> dict[str, int | None]:
    """`sacctmgr -n -P show qos format=QOS_FORMAT` -> {name: MaxTRESPU node=}."""
    out = {}
    for line in text.splitlines():
        fields = (line.split("|") + ["", "", "", ""])[:4]
        if fields[0].strip():
            out[fields[0].strip()] = tres_nodes(fields[3])
    return out


ASSOC_FORMAT = "cluster,account,partition,qos,defaultqos,maxsubmit,maxjobs"


def parse_associations(text: str, cluster: str | None = None) -> tuple[Association, ...]:
    """`sacctmgr -n -P show assoc user=U format=ASSOC_FORMAT` -> the user's associations on `cluster`."""
    out = []
    for line in text.splitlines():
        fields = (line.split("|") + [""] * 7)[:7]
        where, account, partition, qos, default_qos, submit, jobs = (f.strip() for f in fields)
        if not account or (cluster and where and where != cluster):
            continue
        out.append(
            Association(
                account=account,
                partition=partition,
                qos=tuple(q for q in qos.split(",") if q),
                default_qos=default_qos,
                max_submit=_int(submit),
                max_jobs=_int(jobs),
            )
        )
    return tuple(out)


# ------------------------------------------------------------------------------------ queries


def _sh(cmd: list[str], timeout: float = QUERY_TIMEOUT_S) -> tuple[int, str]:
    """(exit code, stdout) of a query; 127 when the program is missing, 124 on timeout (stderr in
    the text on failure)."""
    reply = commands.query(cmd, timeout=timeout)
    if not reply.ok:
        return reply.code, (reply.err or reply.out).strip()
    return 0, reply.out


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def live_limits(user: str | None = None, account: str | None = None, timeout: float = QUERY_TIMEOUT_S) -> LiveLimits:
    """Ask the cluster (as the Slurm clients see it: SLURM_CONF) for its limits, for `user` (default:
    this user) and `account` (default: the user's default account)."""
    user = user or getpass.getuser()
    errors = []
    code, out = _sh(["scontrol", "show", "config"], timeout)
    config = parse_config(out) if code == 0 else {}
    if code != 0:
        errors.append(f"scontrol show config: {_last_line(out)}")
    cluster = config.get("ClusterName") or None
    requeue = {"1": True, "0": False}.get(config.get("JobRequeue", ""))

    code, out = _sh(["sacctmgr", "-n", "-P", "show", "qos", f"format={QOS_FORMAT}"], timeout)
    qos = parse_qos(out) if code == 0 else {}
    qos_nodes = parse_qos_nodes(out) if code == 0 else {}
    if code != 0:
        errors.append(f"sacctmgr show qos: {_last_line(out)}")

    code, parts = _sh(["scontrol", "-o", "show", "partition"], timeout)
    code2, nodes = _sh(["scontrol", "-o", "show", "node"], timeout)
    partitions = partition_limits(parts, nodes if code2 == 0 else "", qos, qos_nodes) if code == 0 else {}
    if code != 0:
        errors.append(f"scontrol show partition: {_last_line(parts)}")
    if code2 != 0:
        errors.append(f"scontrol show node: {_last_line(nodes)}")

    code, out = _sh(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", f"format={ASSOC_FORMAT}"], timeout)
    associations = parse_associations(out, cluster) if code == 0 else ()
    if code != 0:
        errors.append(f"sacctmgr show assoc: {_last_line(out)}")
    if account is None and associations:
        code, out = _sh(["sacctmgr", "-n", "-P", "show", "user", user, "format=defaultaccount"], timeout)
        default = out.strip().splitlines()[0].strip() if code == 0 and out.strip() else ""
        account = default or associations[0].account

    return LiveLimits(
        cluster=cluster,
        max_array_size=_int(config.get("MaxArraySize")),
        requeue=requeue,
        user=user,
        account=account,
        partitions=partitions,
        qos=qos,
        qos_nodes=qos_nodes,
        associations=associations,
        errors=tuple(errors),
    )  # the per-user submit limits are derived from the associations (__post_init__)


_cache: dict[tuple, tuple[float, LiveLimits]] = {}


def cached_live_limits(user: str | None = None, account: str | None = None) -> LiveLimits:
    """live_limits, reused for CACHE_S seconds per (cluster config, user, account) in this process."""
    key = (os.environ.get("SLURM_CONF"), user or getpass.getuser(), account)
    hit = _cache.get(key)
    if hit is None or time.monotonic() - hit[0] > CACHE_S:
        hit = (time.monotonic(), live_limits(user, account))
        _cache[key] = hit
    return hit[1]


# ------------------------------------------------------------------------------------ budget


def _user_submit_limit(live: LiveLimits, partition: str | None) -> tuple[int | None, str]:
    """Tightest per-user submit limit of the account's association and its job QoS."""
    found = []
    assoc = live.association(partition)
    if assoc is not None:
        where = f"{assoc.account}{'/' + assoc.partition if assoc.partition else ''}"
        if assoc.max_submit is not None:
            found.append((assoc.max_submit, f"sacctmgr: association {where} MaxSubmitJobs"))
        job_qos = assoc.job_qos()
        if job_qos and live.qos.get(job_qos, (None, None))[0] is not None:
            found.append((live.qos[job_qos][0], f"sacctmgr: QoS {job_qos} (of association {where}) MaxSubmitPU"))
    return min(found) if found else (None, "")


def live_submit_limits(live: LiveLimits, partition: str) -> list[tuple[int, str]]:
    """Every live per-user submit limit that applies to a job on `partition`: the partition's QoS,
    the association's MaxSubmitJobs and its job QoS."""
    found = []
    part = live.partitions.get(partition)
    if part is not None and part.max_submit is not None:
        found.append((part.max_submit, f"sacctmgr: QoS {part.qos} of partition {partition} MaxSubmitPU"))
    limit, source = _user_submit_limit(live, partition)
    if limit is not None:
        found.append((limit, source))
    return found


def profile_submit_limits(site: Any, partition: str) -> list[tuple[int, str]]:
    """The profile's submit limits for `partition` (partition level and site level)."""
    found = []
    part = site.partitions.get(partition) if site is not None else None
    if part is not None and part.max_submit_jobs is not None:
        found.append((int(part.max_submit_jobs), f"site profile {site.name}: partitions.{partition}.max_submit_jobs"))
    if site is not None and site.max_submit_jobs is not None:
        found.append((int(site.max_submit_jobs), f"site profile {site.name}: max_submit_jobs"))
    return found


def submit_limit(site: Any, partition: str, live: LiveLimits | None = None) -> tuple[int | None, str]:
    """(limit, source): the most jobs (array tasks each count) this user may have queued or running
    on `partition` at once, the tightest known — the live QoS and association limits (sacctmgr) and
    the profile's `max_submit_jobs` (partition, then site level), whichever is lowest; the profile's
    alone when sacctmgr does not answer. (None, why) when nothing limits it as far as anyone knows.
    It is a limit on everything the user has queued, this run's jobs and any others."""
    if live is None:
        live = cached_live_limits(account=getattr(site, "account", None))
    found = live_submit_limits(live, partition) + profile_submit_limits(site, partition)
    if found:
        return min(found)
    if live.accounting:
        return None, f"no submit limit: none in sacctmgr's QoS/associations for partition {partition}, none in the profile"
    why = "; ".join(e for e in live.errors if e.startswith("sacctmgr")) or "sacctmgr gave nothing"
    return None, f"no submit limit known: sacctmgr did not answer ({why}) and the profile names none"


def _tightest(found: list[tuple[int, str]]) -> tuple[int | None, str]:
    return min(found) if found else (None, "")


def _partition_limit(site: Any, partition: str, live: LiveLimits | None, qos_field: str, qos_label: str, profile_key: str):
    """(limit, source): the tightest of the partition QoS's `qos_field` (live, named `qos_label`)
    and the profile's `partitions.<partition>.<profile_key>`."""
    found = []
    part = live.partitions.get(partition) if live is not None else None
    if part is not None and getattr(part, qos_field) is not None:
        found.append((getattr(part, qos_field), f"sacctmgr: QoS {part.qos} of partition {partition} {qos_label}"))
    prof = site.partitions.get(partition)
    if prof is not None and getattr(prof, profile_key) is not None:
        found.append((int(getattr(prof, profile_key)), f"site profile {site.name}: partitions.{partition}.{profile_key}"))
    return _tightest(found)


def running_limit(site: Any, partition: str, live: LiveLimits | None) -> tuple[int | None, str]:
    """(limit, source): the most jobs this user may have running at once on `partition`, the
    tightest of the partition QoS's MaxJobsPU (live) and the profile's `max_running_jobs`."""
    return _partition_limit(site, partition, live, "max_jobs", "MaxJobsPU", "max_running_jobs")


def node_limit(site: Any, partition: str, live: LiveLimits | None) -> tuple[int | None, str]:
    """(limit, source): the most nodes this user's running jobs on `partition` may hold together,
    the tightest of the partition QoS's MaxTRESPU node= (live) and the profile's `max_nodes_per_user`."""
    return _partition_limit(site, partition, live, "max_nodes_per_user", "MaxTRESPU node", "max_nodes_per_user")


def corun_problem(site: Any, components: list[tuple[str, int]], live: LiveLimits | None = None) -> str | None:
    """Why the parts of one stage that must run at the same time (a heterogeneous job's components,
    each a job to Slurm's limits: (partition, nodes) each) can never all run under the per-user
    running-job and node caps, or None. A stage refused here would wait forever, or its first
    component would burn walltime waiting for the others."""
    jobs: dict[str, int] = {}
    nodes: dict[str, int] = {}
    for partition, n in components:
        jobs[partition] = jobs.get(partition, 0) + 1
        nodes[partition] = nodes.get(partition, 0) + int(n)
    for partition in sorted(jobs):
        limit, source = running_limit(site, partition, live)
        if limit is not None and jobs[partition] > limit:
            return (
                f"partition {partition}: {jobs[partition]} jobs must run together (each component counts), "
                f"a user may run {limit} at once ({source})"
            )
        limit, source = node_limit(site, partition, live)
        if limit is not None and nodes[partition] > limit:
            return f"partition {partition}: {nodes[partition]} nodes must be held together, a user may hold {limit} ({source})"
    return None


def stage_problem(site: Any, stage: Any, live: LiveLimits | None = None) -> str | None:
    """Why a stage (its typed config) cannot run on this site whatever is queued, or None: its
    sampling engine needs CUDA on an xpu partition, or its components cannot run together."""
    from snowcat.slurm.site import engine_problem  # noqa: PLC0415 (site imports nothing of this module)

    res = stage.resources
    comps = dict(res.components.items()) if res.components else {}
    engine = getattr(stage, "engine", None)
    where = [comps["rollout"]] if "rollout" in comps else list(comps.values()) or [res]
    for r in where:
        why = engine_problem(site, str(r.partition or site.default_partition), engine)
        if why:
            return why
    if len(comps) > 1:
        return corun_problem(site, [(str(c.partition or site.default_partition), int(c.nodes)) for c in comps.values()], live)
    return None
