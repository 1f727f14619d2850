"""`snowcat site detect`: a draft site profile from what the cluster says about itself.

For an admin (or a first user) on a centre snowcat has no profile for. It asks the login node —
`scontrol show config`, `scontrol -o show partition`, `scontrol -o show node` (the same node data as
`sinfo -N`: GPUs, memory, cores, architecture), `sacctmgr show qos` (per-user caps of each
partition's QOS), the user's default account — and reads the environment ($WORK, $SCRATCH,
$PROJECT, SBATCH_ACCOUNT, ibrun, apptainer, Lmod). It writes a profile that loads as it is, with
every field marked in a comment: `detected` (with the command it came from) or `to fill` (what the
cluster cannot say: rejected options, the GPU model, where runs should go, ...). Keys to fill are
also listed in `unverified`, so `snowcat doctor` keeps asking about them; each detected limit names
its command and date in its partition's `sources`.

Nothing here changes the cluster.
"""

from __future__ import annotations

import datetime
import getpass
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_text
from snowcat.slurm import limits

Runner = Callable[[list[str]], tuple[int, str]]
DETECTED, TO_FILL = "detected", "to fill"


@dataclass
class Draft:
    """A draft profile: values in profile order, and for each key how it was found."""

    values: dict[str, Any] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)  # key -> "detected: <command>" or "to fill: <why>"

    def set(self, key: str, value: Any, how: str) -> None:
        self.values[key] = value
        self.marks[key] = how

    def to_fill(self) -> list[str]:
        return [k for k, how in self.marks.items() if how.startswith(TO_FILL)]

    def yaml(self) -> str:
        """The profile as YAML, one key a line, each with its mark as a comment."""
        lines = [
            f"# Draft site profile written by `snowcat site detect` on {self.values.get('_date', '')}: every key says",
            "# whether it was detected (and from what) or is still to fill. Check it, fill the rest, then",
            "# `snowcat doctor --site <this file>`.",
        ]
        for key, value in self.values.items():
            if key.startswith("_"):
                continue
            if key == "partitions":
                lines.append("partitions:")
                for name, part in value.items():
                    lines.append(f"  # {name}: {self.marks.get(f'partitions.{name}', '')}")
                    lines.append(f"  {_flow(name)}: {_flow(part)}")
                continue
            lines.append(f"{key}: {_flow(value)}  # {self.marks.get(key, '')}")
        return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    """A YAML flow value (JSON is YAML; plain names stay plain)."""
    if (
        isinstance(value, str)
        and re.fullmatch(r"[A-Za-z_][\w.-]*", value)
        and value not in ("null", "true", "false", "yes", "no")
    ):
        return value
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _gpus(gres: str) -> tuple[int, str | None]:
    """(count, type) of the GPUs in a node's Gres (`gpu:4`, `gpu:a100:4(S:0-1)`, `gpu:h100:2,shard:8`)."""
    for item in (gres or "").split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu":
            count = int(parts[-1]) if parts[-1].isdigit() else 1
            kind = parts[1] if len(parts) == 3 else None
            return count, kind
    return 0, None


def detect(name: str = "draft", run: Runner | None = None, environ: dict | None = None, today: str | None = None) -> Draft:
    """A draft profile of the cluster the Slurm clients see (SLURM_CONF); UserError when Slurm does not answer."""
    run = run or limits._sh
    environ = os.environ if environ is None else environ
    today = today or datetime.date.today().isoformat()
    code, out = run(["scontrol", "show", "config"])
    if code != 0:
        raise UserError(
            f"site detect: `scontrol show config` failed ({limits._last_line(out)}); run it on a login node of the cluster"
        )
    config = limits.parse_config(out)
    code, parts_out = run(["scontrol", "-o", "show", "partition"])
    if code != 0:
        raise UserError(f"site detect: `scontrol show partition` failed ({limits._last_line(parts_out)})")
    code, nodes_out = run(["scontrol", "-o", "show", "node"])
    nodes_out = nodes_out if code == 0 else ""
    code, qos_out = run(["sacctmgr", "-n", "-P", "show", "qos", f"format={limits.QOS_FORMAT}"])
    accounting = code == 0
    qos = limits.parse_qos(qos_out) if accounting else {}
    qos_nodes = limits.parse_qos_nodes(qos_out) if accounting else {}
    live = limits.partition_limits(parts_out, nodes_out, qos, qos_nodes)

    d = Draft()
    d.values["_date"] = today
    cluster = config.get("ClusterName") or name
    d.set("name", name, f"{TO_FILL}: a short name (cluster {cluster})")
    d.set("description", f"{cluster} (drafted by snowcat site detect)", f"{TO_FILL}: the system in a line")
    cmd = {
        "config": f"detected: scontrol show config ({today})",
        "partition": f"scontrol show partition ({today})",
        "qos": f"sacctmgr show qos ({today})",
    }
    d.set("sources", [f"snowcat site detect on {cluster}, {today}"], f"{TO_FILL}: add the centre's user guide (URL, date read)")

    members: dict[str, list[dict[str, str]]] = {}
    for node in limits.parse_records(nodes_out):
        for pname in (node.get("Partitions") or "").split(","):
            members.setdefault(pname, []).append(node)
    partitions, default, exclusive, login_only = {}, None, [], []
    for rec in limits.parse_records(parts_out):
        pname = rec.get("PartitionName")
        if not pname:
            continue
        lim = live.get(pname, limits.PartitionLimits())
        nodes = members.get(pname, [])
        gpus = min((_gpus(n.get("Gres", ""))[0] for n in nodes), default=0)
        kinds = {_gpus(n.get("Gres", ""))[1] for n in nodes} - {None}
        arches = {n.get("Arch") for n in nodes if n.get("Arch")}
        max_nodes = limits._int(rec.get("MaxNodes")) or lim.nodes or 1
        part: dict[str, Any] = {
            "gpus_per_node": gpus,
            "cpus_per_node": lim.cores_per_node or lim.cpus_per_node or 1,
            "mem_gb": lim.mem_gb or 0,
            "max_nodes": max_nodes,
            "max_time_min": lim.max_time_min or 2880,
        }
        sources = {"max_nodes": cmd["partition"]}
        found = ["gpus_per_node", "cpus_per_node", "mem_gb", "max_nodes"] if nodes else ["max_nodes"]
        if lim.max_time_min:
            sources["max_time_min"] = cmd["partition"]
            found.append("max_time_min")
        for key, value in (
            ("max_submit_jobs", lim.max_submit),
            ("max_running_jobs", lim.max_jobs),
            ("max_nodes_per_user", lim.max_nodes_per_user),
        ):
            if value is not None:
                part[key] = value
                sources[key] = f"{cmd['qos']}: QOS {lim.qos}"
                found.append(key)
        if len(kinds) == 1:
            part["gpu_type"] = kinds.pop()
        if len(arches) == 1:
            part["cpu_arch"] = arches.pop()
            found.append("cpu_arch")
        part["sources"] = sources
        partitions[pname] = part
        fill = "max_time_min (unlimited here)" if not lim.max_time_min else ""
        d.marks[f"partitions.{pname}"] = (
            f"detected: {', '.join(found)}"
            + (f"; to fill: {fill}" if fill else "")
            + ("; to fill: accelerator (cuda or xpu), gpu_type" if gpus else "")
        )
        if rec.get("Default") == "YES":
            default = pname
        exclusive.append(rec.get("OverSubscribe", "").startswith("EXCLUSIVE") or rec.get("ExclusiveUser") == "YES")
        login_only.append(rec.get("AllocNodes", "ALL") != "ALL")
    if not partitions:
        raise UserError("site detect: `scontrol show partition` lists no partition")
    d.set("partitions", partitions, "")
    d.set("default_partition", default or next(iter(partitions)), f"detected: scontrol show partition (Default=YES, {today})")
    gpu_parts = [p for p, v in partitions.items() if v["gpus_per_node"]]
    cpu_parts = [p for p, v in partitions.items() if not v["gpus_per_node"]]
    d.set("cpu_partition", cpu_parts[0] if cpu_parts and gpu_parts else None, f"{TO_FILL}: where CPU-only stages go (a guess)")
    d.set(
        "exclusive_nodes",
        all(exclusive),
        f"detected: OverSubscribe=EXCLUSIVE on {'every' if all(exclusive) else 'not every'} partition",
    )
    array = limits._int(config.get("MaxArraySize"))
    d.set("arrays_allowed", bool(array and array > 1), cmd["config"] + ": MaxArraySize")
    d.set("max_array_size", max(0, (array or 1) - 1), cmd["config"] + ": MaxArraySize - 1")
    d.set("hetjobs_allowed", True, f"{TO_FILL}: snowcat doctor tries one")
    requeue = config.get("JobRequeue")
    d.set(
        "requeue_allowed",
        requeue == "1",
        cmd["config"] + ": JobRequeue" if requeue in ("0", "1") else f"{TO_FILL}: JobRequeue not shown",
    )
    d.set(
        "sbatch_on_compute",
        not any(login_only),
        "detected: AllocNodes of the partitions"
        + ("; a job_submit filter may refuse more" if config.get("JobSubmitPlugins") not in (None, "(null)") else ""),
    )
    plugins = config.get("JobSubmitPlugins", "(null)")
    d.set(
        "rejected_options",
        [],
        f"{TO_FILL}: the options the site refuses (JobSubmitPlugins={plugins}: a filter's rules cannot be read; see its guide)",
    )
    d.set(
        "gpu_request",
        "gres" if gpu_parts else "none",
        f"{TO_FILL}: gres, gpus-per-node, or none where the queue implies the GPUs",
    )
    ibrun = shutil.which("ibrun", path=environ.get("PATH"))
    mpi = config.get("MpiDefault", "none")
    d.set(
        "mpi_plugin",
        "ibrun" if ibrun else (mpi if mpi not in ("none", "(null)") else "pmix"),
        "detected: ibrun on PATH" if ibrun else f"detected: MpiDefault={mpi} (pmix when none)",
    )
    d.set("launcher", "ibrun" if ibrun else "srun", "detected: ibrun on PATH" if ibrun else "detected: no ibrun on PATH")
    account = environ.get("SBATCH_ACCOUNT")
    how = "detected: $SBATCH_ACCOUNT"
    if not account and accounting:
        code, out = run(["sacctmgr", "-n", "-P", "show", "user", getpass.getuser(), "format=defaultaccount"])
        account = out.strip().splitlines()[0].strip() if code == 0 and out.strip() else None
        how = f"detected: sacctmgr show user (default account, {today})"
    d.set("account", account or None, how if account else f"{TO_FILL}: the project/budget to charge")
    enforce = config.get("AccountingStorageEnforce", "")
    d.set("account_required", "associations" in enforce, cmd["config"] + f": AccountingStorageEnforce={enforce or 'none'}")
    for key, var in (("run_root", "WORK"), ("scratch", "SCRATCH"), ("project", "PROJECT")):
        have = [v for v in (var, "WORK", "PROJECT", "SCRATCH") if environ.get(v)]
        if key == "run_root":
            value = f"${have[0]}/snowcat/runs" if have else "logs"
        else:
            value = f"${var}" if environ.get(var) else ("/tmp" if key == "scratch" else ".")
        d.set(key, value, f"{TO_FILL}: " + (f"${have[0]} is set here" if have else "no $WORK/$PROJECT/$SCRATCH here"))
    runtime = (
        "apptainer"
        if shutil.which("apptainer", path=environ.get("PATH")) or shutil.which("singularity", path=environ.get("PATH"))
        else "none"
    )
    d.set(
        "container_runtime",
        runtime,
        "detected: apptainer on PATH" if runtime == "apptainer" else f"{TO_FILL}: no apptainer on PATH (a module?)",
    )
    d.set("internet_on_compute", None, f"{TO_FILL}: snowcat doctor tries it from a job")
    d.set("unverified", [], "")
    d.values["unverified"] = [k for k in d.to_fill() if k not in ("name", "description", "sources", "unverified")]
    d.marks["unverified"] = "the keys still to fill"
    return d


def write_draft(draft: Draft, path: str | os.PathLike, force: bool = False) -> Path:
    """Write the draft atomically; refuse to replace a file unless `force`."""
    path = Path(path)
    if path.exists() and not force:
        raise UserError(f"site detect: {path} exists; choose another -o FILE or pass --force")
    atomic_write_text(path, draft.yaml())
    return path
