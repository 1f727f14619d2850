"""Offline compute nodes: what was staged, and failing fast when something a stage needs was not.

JSC compute nodes have no internet; everything (models, tokenizers, datasets, wheels, images) is
staged from a login node by the `prestage` stage into the site's staging dir, which records it in
`index.json`. A compute stage calls `enter_offline(staging_dir, names)` first thing: it checks that
every named artefact is staged and intact, and switches Hugging Face libraries to offline mode,
so a missing artefact is a one-line UserError before any work instead of a hang on a network call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from .errors import UserError
from .fsio import build_manifest, read_json, sha256_bytes, sha256_file
from .schema import hf_sources, hub_id

INDEX = "index.json"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def offline_env(staging_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a compute stage on a node without internet.

    With a staging dir, Hugging Face caches point into it too, so nothing is fetched or written
    under $HOME (small quotas, and not where staged artefacts live).
    """
    env = dict(OFFLINE_ENV)
    if staging_dir is not None:
        env["HF_HOME"] = str(Path(staging_dir) / "hf-home")
    return env


def load_index(staging_dir_or_index: str | os.PathLike) -> dict[str, dict]:
    """The staged-artefacts index {name: {kind, path, sha256, files, bytes, source, [hub]}} ({} if
    nothing was staged). `source` is the configured one; a hub download adds `hub`: {endpoint,
    repo_type, requested_revision (None: the default branch), revision (the commit staged)}."""
    path = Path(staging_dir_or_index)
    if path.is_dir():
        path = path / INDEX
    index = read_json(path, default=None)
    if index is None:
        return {}
    if not isinstance(index, dict) or not isinstance(index.get("artefacts"), dict):
        raise UserError(f"{path}: not a staged-artefacts index (run the prestage stage again)")
    return {name: dict(entry, _root=str(path.parent)) for name, entry in index["artefacts"].items()}


def image_artefact(image: str) -> str:
    """The name a task's Docker image (meta["image"]) is staged under by the prestage stage (an
    `image` artefact, pulled into a SIF)."""
    return image if image.startswith("docker://") else f"docker://{image}"


def staged_revision(entry: dict) -> str | None:
    """The revision of a staged artefact: the commit its hub download resolved to, else the revision
    its source named (entries staged before the commit was recorded), else None."""
    return (entry.get("hub") or {}).get("revision") or (entry.get("source") or {}).get("revision")


def tree_digest(files: dict[str, dict]) -> str:
    """sha256 of a directory artefact: of its manifest {relative path: {sha256, size}}, canonical."""
    return sha256_bytes(json.dumps(files, sort_keys=True, separators=(",", ":")).encode())


def _verify(name: str, entry: dict, deep: bool) -> str | None:
    path = Path(entry["_root"]) / entry["path"]
    if not path.exists():
        return f"staged artefact '{name}' is in the index but {path} is missing"
    if not deep:
        return None
    if path.is_file():
        actual = sha256_file(path)
    else:
        actual = tree_digest(build_manifest(path))
    if actual != entry["sha256"]:
        return f"staged artefact '{name}' at {path} changed since staging (sha256 differs)"
    return None


def require_staged(index: dict[str, dict] | str | os.PathLike, names: Iterable[str], deep: bool = False) -> dict[str, Path]:
    """Paths of the named artefacts; UserError naming the first one not staged (or broken).

    deep=True re-hashes every file (slow for large models; prestage already verified them).
    """
    if not isinstance(index, dict):
        where = str(index)
        index = load_index(index)
    else:
        where = next((e["_root"] for e in index.values()), "the staging dir")
    out = {}
    for name in names:
        entry = index.get(name)
        if entry is None:
            raise UserError(
                f"artefact '{name}' is not staged in {where}: add it to the prestage stage "
                f"and run it on a login node (compute nodes have no internet)"
            )
        problem = _verify(name, entry, deep)
        if problem:
            raise UserError(f"{problem}: run the prestage stage again")
        out[name] = Path(entry["_root"]) / entry["path"]
    return out


def enter_offline(staging_dir: str | os.PathLike, names: Iterable[str], deep: bool = False) -> dict[str, Path]:
    """Check the named artefacts are staged, then put this process in offline mode.

    Call it before doing any work in a stage that runs on nodes without internet; it returns the
    staged paths by name.
    """
    paths = require_staged(staging_dir, list(names), deep=deep)
    os.environ.update(offline_env(staging_dir))
    return paths


def prepare(ctx) -> dict[str, Path]:
    """What the stage runner calls before a stage's `run(ctx)`: offline checks from the config.

    A stage section may list `staged: [names]`; they are looked up in the staging dir of the run's
    prestage stage. On a site whose compute nodes have no internet, every stage runs offline even
    if it lists nothing. Returns the staged paths by name ({} when nothing applies).
    """
    cfg = ctx.run_config
    # hub models the stage names (hf:org/name) must be staged too; it then runs offline
    names = list(dict.fromkeys([*ctx.config.staged, *filter(None, (hub_id(v) for _, v in hf_sources(ctx.config)))]))
    site_online = cfg.site.internet_on_compute if cfg.site is not None else None
    staging_dirs = [s.staging_dir for s in cfg.stages.values() if s.kind == "prestage"]
    if names and not staging_dirs:
        raise UserError(f"stages.{ctx.name}.staged: lists artefacts but the run has no prestage stage")
    if site_online is False or names:
        return enter_offline(staging_dirs[0] if staging_dirs else ".", names)
    return {}
