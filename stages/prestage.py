"""`prestage` stage: copy or fetch every artefact compute stages need into the site's staging dir.

Runs on a login node (the only place with internet on JSC systems). Each artefact lands at
`<staging_dir>/<kind>/<name>/`, built under a temp name and renamed into place, hashed, and
recorded in `<staging_dir>/index.json` (see pipeline.offline). Staging is idempotent: an artefact
already staged with the same source and an intact hash is not fetched again.

Sources: `path` (a local file or directory), `url` (file:// or http(s)://), or `name` alone:
a Hugging Face repo id for model/tokenizer/dataset (needs huggingface_hub), a pip requirement for
wheel (`pip download`, from `find_links` when given, e.g. a local wheel directory), a
`docker://<reference>` for image (`apptainer pull` into `image.sif`: a task's meta["image"], e.g.
SWE-bench's instance images, taken by `tasks.imports[].staged_images`; a prebuilt .sif is a `path`).

A hub download resolves its revision (`revision`, else the default branch) to a commit first and
downloads that commit, so a push in between cannot mix two versions; the entry records the hub,
the requested revision and the commit (`hub`). The hub is huggingface_hub's (HF_ENDPOINT).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

from filelock import FileLock
from omegaconf import OmegaConf

from snowcat.containers.images import apptainer_binary
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_dir, atomic_write_json, build_manifest, read_json, sha256_file
from snowcat.pipeline.offline import INDEX, tree_digest
from snowcat.stages.config import Artefact


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "artefact"


def _source(art) -> dict:
    fields = ("path", "url", "revision", "find_links")
    return {k: str(getattr(art, k)) for k in fields if getattr(art, k)}


def _fetch(art, dest: Path) -> dict | None:
    """Put the artefact's content into the (empty, temporary) directory `dest`; a hub download
    returns what it resolved (see _hub_download)."""
    if art.path:
        src = Path(art.path).expanduser()
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=False)
        elif src.is_file():
            shutil.copy2(src, dest / src.name)
        else:
            raise UserError(f"artefact '{art.name}': path {src} does not exist")
    elif art.url:
        parsed = urllib.parse.urlparse(art.url)
        target = dest / (Path(urllib.parse.unquote(parsed.path)).name or "download")
        if parsed.scheme == "file":
            src = Path(urllib.parse.unquote(parsed.path))
            if not src.is_file():
                raise UserError(f"artefact '{art.name}': {art.url} does not exist")
            shutil.copy2(src, target)
        elif parsed.scheme in ("http", "https"):
            try:
                with urllib.request.urlopen(art.url, timeout=60) as resp, open(target, "wb") as f:
                    shutil.copyfileobj(resp, f, 1 << 20)
            except OSError as e:
                raise UserError(f"artefact '{art.name}': cannot download {art.url}: {e}") from e
        else:
            raise UserError(f"artefact '{art.name}': url scheme '{parsed.scheme}' not supported (file, http, https)")
    elif art.kind == "wheel":
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
        if art.find_links:
            cmd += ["--no-index", "--find-links", str(art.find_links)]
        proc = subprocess.run(cmd + [art.name], capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(f"artefact '{art.name}': pip download failed: {last}")
    elif art.kind in ("model", "tokenizer", "dataset"):
        return _hub_download(art, dest)
    elif art.kind == "image":
        _pull_image(art.name, dest / IMAGE_FILE)
    else:
        raise UserError(f"artefact '{art.name}': give a path or url for a {art.kind}")
    return None


IMAGE_FILE = "image.sif"


def _pull_image(name: str, target: Path) -> None:
    """`apptainer pull` of a Docker reference (docker://...) into the SIF `target` (login nodes:
    the registry is on the internet)."""
    if not name.startswith("docker://"):
        raise UserError(f"artefact '{name}': an image is pulled by its docker://<reference> (or give the path of a .sif)")
    proc = subprocess.run([apptainer_binary(), "pull", "--force", str(target), name], capture_output=True, text=True)
    if proc.returncode != 0 or not target.is_file():
        last = ((proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise UserError(f"artefact '{name}': apptainer pull failed: {last}")


def _hub_download(art, dest: Path) -> dict:
    """The hub repo `art.name` at the commit its revision names now, into `dest`; returns
    {endpoint, repo_type, requested_revision (None: the default branch), revision (the commit)}."""
    try:
        # only name-only hub downloads need it (login nodes)
        from huggingface_hub import HfApi, snapshot_download  # noqa: PLC0415
        from huggingface_hub.errors import HFValidationError, HTTPError, RepositoryNotFoundError, RevisionNotFoundError  # noqa: PLC0415
    except ImportError as e:
        raise UserError(f"artefact '{art.name}': fetching by Hugging Face id needs huggingface_hub (or give a path/url)") from e
    repo_type = "dataset" if art.kind == "dataset" else "model"
    api = HfApi()
    asked = f"revision '{art.revision}'" if art.revision else "the default branch"
    try:
        commit = api.repo_info(art.name, repo_type=repo_type, revision=art.revision).sha
        # by its commit: a branch moved since repo_info cannot mix two versions into one copy
        snapshot_download(repo_id=art.name, repo_type=repo_type, revision=commit, local_dir=dest)
    except RevisionNotFoundError as e:
        raise UserError(f"artefact '{art.name}': {asked} is not in the {repo_type} repo on {api.endpoint}") from e
    except RepositoryNotFoundError as e:  # gated and private repos answer so too without a token
        raise UserError(
            f"artefact '{art.name}': no {repo_type} repo of that name on {api.endpoint} (or it is private or gated: set HF_TOKEN)"
        ) from e
    except (HFValidationError, HTTPError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"artefact '{art.name}': cannot download {asked} from {api.endpoint}: {first}") from e
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # hub bookkeeping, not content
    return {"endpoint": api.endpoint, "repo_type": repo_type, "requested_revision": art.revision, "revision": commit}


def _digest(path: Path) -> tuple[str, int, int]:
    """(sha256, files, bytes) of an artefact dir: the single file's own hash if it holds one file."""
    files = build_manifest(path)
    if not files:
        raise UserError(f"artefact at {path}: nothing was staged (empty)")
    size = sum(f["size"] for f in files.values())
    if len(files) == 1:
        return next(iter(files.values()))["sha256"], 1, size
    return tree_digest(files), len(files), size


def stage_artefact(art, staging_dir: Path, index: dict) -> tuple[dict, bool]:
    """Stage one artefact; returns (index entry, whether it was fetched now)."""
    rel_dir = Path(art.kind) / _slug(art.name)
    source = _source(art)
    old = index.get(art.name)
    if old and old.get("source") == source and old.get("kind") == art.kind:
        target = staging_dir / old["path"]
        if target.exists():
            actual = sha256_file(target) if target.is_file() else tree_digest(build_manifest(target))
            if actual == old["sha256"] and (art.sha256 in (None, old["sha256"])):
                return old, False
    with atomic_dir(staging_dir / rel_dir) as tmp:
        hub = _fetch(art, tmp)
        digest, nfiles, size = _digest(tmp)
        if art.sha256 and art.sha256 != digest:
            raise UserError(f"artefact '{art.name}': sha256 {digest} does not match the configured {art.sha256}")
        only = next(iter(build_manifest(tmp))) if nfiles == 1 else None
    rel = rel_dir / only if only else rel_dir
    entry = {"kind": art.kind, "path": str(rel), "sha256": digest, "files": nfiles, "bytes": size, "source": source}
    return entry | ({"hub": hub} if hub else {}), True


def prestage(staging_dir: str | os.PathLike, artefacts) -> dict:
    """Stage every artefact into `staging_dir` and rewrite its index; returns the index."""

    # Typed, whatever the caller passed (dataclasses, dicts, DictConfigs): every field present.
    artefacts = [OmegaConf.merge(OmegaConf.structured(Artefact), a) for a in artefacts]
    staging_dir = Path(staging_dir)
    staging_dir.mkdir(parents=True, exist_ok=True)
    # Two runs may stage into one shared dir at once: the index is read-modify-written under a lock.
    with FileLock(str(staging_dir / ".index.lock")):
        index = (read_json(staging_dir / INDEX) or {}).get("artefacts", {})
        fetched = 0
        for art in artefacts:
            entry, new = stage_artefact(art, staging_dir, index)
            index[art.name] = entry
            fetched += new
            # Record each artefact as soon as it is staged: a later failure keeps earlier work.
            atomic_write_json(staging_dir / INDEX, {"artefacts": index})
        atomic_write_json(staging_dir / INDEX, {"artefacts": index})
    return {"artefacts": index, "fetched": fetched}


def run(ctx: StageContext) -> dict:
    staging_dir = Path(str(ctx.config.staging_dir))
    result = prestage(staging_dir, list(ctx.config.artefacts))
    # The run directory keeps its own copy: which artefacts (and hashes) this run was staged with.
    wanted = {a.name for a in ctx.config.artefacts}
    atomic_write_json(
        ctx.out_dir / "staged.json",
        {
            "staging_dir": str(staging_dir),
            "artefacts": {k: v for k, v in result["artefacts"].items() if k in wanted},
        },
    )
    total = sum(v["bytes"] for k, v in result["artefacts"].items() if k in wanted)
    return {"artefacts": len(wanted), "fetched": result["fetched"], "bytes": total}
