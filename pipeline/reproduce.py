"""`snowcat reproduce RUN [--run-dir NEW]`: rerun a run from its archived config and code; compare.

1. Code: the run's provenance records name the code revision and the (content-addressed) patch of
   uncommitted changes it ran with. If this source tree is exactly that state, the reproduction
   runs from here. Otherwise a detached git worktree of the recorded revision is made next to the
   new run and the recorded patch applied to it; if the revision is unknown or the patch does not
   apply, reproduce refuses (UserError) and runs nothing.
2. Run: `snowcat run <RUN>/config.yaml --run-dir NEW` (the archived resolved config, no edits; NEW
   is a fresh run id next to the original unless given), with the recorded executor. A local run
   is waited for; a Slurm run is submitted, and the same command compares once it has finished.
3. Compare, per stage and unit: metrics and every output file of the manifests by sha256; JSON
   files also after removing volatile fields and run paths (`compare_files`). What is volatile is
   a rule over names (pipeline.volatile: units of time and speed, timing namespaces), not a list,
   and every field it removed is named in the report. Exit 0 only if everything else matches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .dag import build
from .errors import UserError
from .fsio import read_json, sha256_file
from .provenance import code_state, source_root
from .rundir import RunDir, new_run_id
from .volatile import RULE, strip_volatile

# Output files that record the run's own identity, hosts or times, so they differ by design.
RUN_SPECIFIC_FILES = {
    "card.md": "states the run's own id, times and hosts",
    # the card's and the scan stage's: a tree edited during a run leaves more provenance patches
    "scan.json": "counts the files of the run directory itself (logs, provenance patches), not outputs of the stage",
}


# --- code state -----------------------------------------------------------------------------------


def recorded_code(run: RunDir) -> dict:
    """The code state the run was produced with: the latest one its provenance records name."""
    records = [r for p in sorted((run.path / "provenance").glob("*.json")) if (r := read_json(p)) and "code" in r]
    if not records:
        raise UserError(f"{run.path}/provenance: no provenance records; the run's code state is unknown")
    codes = {(r["code"].get("revision"), r["code"].get("patch_sha256"), r["code"].get("patch")) for r in records}
    latest = max(records, key=lambda r: r.get("captured_at") or "")["code"]
    if not latest.get("revision"):
        raise UserError(f"{run.path}: provenance records no code revision ({latest.get('error', 'not a git checkout')})")
    return {**latest, "states": len(codes)}


def current_code() -> dict:
    with tempfile.TemporaryDirectory(prefix="snowcat-code-") as tmp:
        return code_state(Path(tmp))


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-c", f"safe.directory={root}", "-C", str(root), *args], capture_output=True, text=True, timeout=300
    )


def pinned_source(run: RunDir, code: dict, where: Path) -> tuple[Path, str]:
    """(source root to run from, how it was obtained) for the recorded code state."""

    root = source_root()
    here = current_code()
    if here.get("revision") == code["revision"] and here.get("patch_sha256") == code["patch_sha256"]:
        return root, "this source tree equals the recorded revision + patch"
    tree = where / f".code-{code['revision'][:12]}-{code['patch_sha256'][:12]}"
    patch = run.path / code["patch"]
    ready = tree.with_name(tree.name + ".ready")  # outside the tree: an untracked file would change its patch
    if ready.is_file() and tree.is_dir():
        return tree, f"worktree {tree} (recorded revision + patch, made earlier)"
    if tree.exists():  # left by an interrupted earlier attempt
        _git(root, "worktree", "remove", "--force", str(tree))
        shutil.rmtree(tree, ignore_errors=True)
    if not patch.is_file() or sha256_file(patch) != code["patch_sha256"]:
        raise UserError(f"{patch}: the recorded patch is missing or altered; cannot restore the run's code")
    if _git(root, "cat-file", "-e", f"{code['revision']}^{{commit}}").returncode != 0:
        raise UserError(
            f"{run.path}: this tree differs from the recorded code and revision {code['revision']} is not in "
            f"the git repository at {root}; fetch it or run from the original checkout"
        )
    proc = _git(root, "worktree", "add", "--detach", "--force", str(tree), code["revision"])
    if proc.returncode != 0:
        raise UserError(f"{tree}: git worktree add failed: {proc.stderr.strip().splitlines()[-1:]}")
    if patch.stat().st_size:
        proc = subprocess.run(
            ["git", "apply", "--binary", "--whitespace=nowarn", str(patch)], cwd=tree, capture_output=True, text=True
        )
        if proc.returncode != 0:
            _git(root, "worktree", "remove", "--force", str(tree))
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise UserError(
                f"{patch}: this tree differs from the recorded revision {code['revision'][:12]} + patch, and the "
                f"patch does not apply to that revision ({last})"
            )
    ready.write_text(code["revision"] + "\n")
    return tree, f"worktree {tree} of revision {code['revision'][:12]} with the recorded patch applied"


def import_path(root: Path) -> Path:
    """A directory holding `snowcat` -> root: first on PYTHONPATH, `snowcat.*` is imported from that tree
    (the package's folders are the checkout's top-level folders, so the checkout itself is no import path)."""
    shim = root.with_name(root.name + ".import")
    if not (shim / "snowcat").is_symlink():
        shim.mkdir(exist_ok=True)
        (shim / "snowcat").symlink_to(root, target_is_directory=True)
    return shim


# --- comparison -----------------------------------------------------------------------------------


def _replace_paths(obj: Any, paths: tuple[str, str]) -> Any:
    """obj with the run's own directory and id replaced by `<run>`."""
    if isinstance(obj, dict):
        return {k: _replace_paths(v, paths) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_paths(v, paths) for v in obj]
    if isinstance(obj, str):
        # the id only as a whole name: a short one ("a", "run") is also a piece of other words
        return re.sub(rf"(?<![\w.-]){re.escape(paths[1])}(?![\w.-])", "<run>", obj.replace(paths[0], "<run>"))
    return obj


def compare_metrics(a: dict, b: dict) -> tuple[list[str], dict[str, str]]:
    """(problems, {volatile metric left out: why}): every other metric must be equal."""
    (a, gone_a), (b, gone_b) = strip_volatile(a), strip_volatile(b)
    problems = [f"metric {k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return problems, gone_a | gone_b


def _read_json(path: Path) -> Any:
    text = path.read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()] if path.suffix == ".jsonl" else json.loads(text)


def compare_files(old: Path, new: Path, paths: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """('same' | 'same after ...' | 'differs', {field left out: why}) for one output file of a unit.

    Byte equality; JSON/JSONL files also count as equal when they are once the volatile fields
    (pipeline.volatile: timings, speeds, stamps) are removed and each run's own directory and id
    replaced by `<run>`. The fields removed are returned, to be reported."""
    if sha256_file(old) == sha256_file(new):
        return "same", {}
    if old.suffix not in (".json", ".jsonl"):
        return "differs", {}
    try:
        (a, gone_a), (b, gone_b) = strip_volatile(_read_json(old)), strip_volatile(_read_json(new))
    except ValueError:
        return "differs", {}
    if _replace_paths(a, paths[:2]) != _replace_paths(b, paths[2:]):
        return "differs", {}
    gone = gone_a | gone_b
    return ("same after removing volatile fields and run paths" if gone else "same after replacing run paths"), gone


def compare_runs(orig: RunDir, new: RunDir) -> dict:
    dag = build(orig.config())
    paths = (str(orig.path), orig.run_id, str(new.path), new.run_id)
    stages: dict[str, Any] = {}
    for node in dag:
        for unit in node.units:
            if not (orig.is_done(unit) and new.is_done(unit)):
                stages[unit.key] = {
                    "ok": False,
                    "problems": [f"not done in {'the original' if not orig.is_done(unit) else 'the reproduction'}"],
                }
                continue
            problems, gone = compare_metrics(orig.metrics(unit), new.metrics(unit))
            excluded = {"metrics.json": gone} if gone else {}
            fa = (read_json(orig.unit_dir(unit) / "manifest.json") or {}).get("files", {})
            fb = (read_json(new.unit_dir(unit) / "manifest.json") or {}).get("files", {})
            same = 0
            narrowed: dict[str, str] = {}
            skipped = {}
            for rel in sorted(set(fa) | set(fb)):
                if rel == "metrics.json":  # compared above, without its volatile fields
                    continue
                if Path(rel).name in RUN_SPECIFIC_FILES:
                    skipped[rel] = RUN_SPECIFIC_FILES[Path(rel).name]
                    continue
                if rel not in fa or rel not in fb:
                    problems.append(f"{rel}: only in the {'reproduction' if rel not in fa else 'original'}")
                    continue
                verdict, gone = compare_files(orig.unit_dir(unit) / rel, new.unit_dir(unit) / rel, paths)
                same += verdict == "same"
                if verdict.startswith("same after"):
                    narrowed[rel] = verdict
                if gone:
                    excluded[rel] = gone
                if verdict == "differs":
                    problems.append(f"{rel}: sha256 {fa[rel]['sha256'][:12]} != {fb[rel]['sha256'][:12]}")
            stages[unit.key] = {
                "ok": not problems,
                "files_identical": same,
                "files_equal_narrowed": narrowed,
                "files_not_compared": skipped,
                "excluded_fields": excluded,
                "problems": problems,
            }
    return {
        "original": str(orig.path),
        "reproduction": str(new.path),
        "ok": all(s["ok"] for s in stages.values()),
        "volatile_rule": RULE,
        "excluded_fields": [
            {"unit": key, "file": rel, "field": field, "why": why}
            for key, s in stages.items()
            for rel, fields in s.get("excluded_fields", {}).items()
            for field, why in sorted(fields.items())
        ],
        "run_specific_files": RUN_SPECIFIC_FILES,
        "stages": stages,
    }


# --- CLI ------------------------------------------------------------------------------------------


def add_reproduce_arguments(parser) -> None:
    parser.add_argument("run", help="the run directory to reproduce")
    parser.add_argument("--run-dir", help="directory of the reproduction (default: a fresh run id next to RUN)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")


def cmd_reproduce(args) -> int:
    err = Console(stderr=True, highlight=False)
    orig = RunDir.open(args.run)
    cfg = orig.config()
    new_path = Path(args.run_dir).resolve() if args.run_dir else orig.path.parent / new_run_id(cfg.name)
    if new_path == orig.path:
        raise UserError(f"--run-dir {args.run_dir}: is the original run; choose a new directory")
    code = recorded_code(orig)
    root, how = pinned_source(orig, code, new_path.parent)
    err.print(
        f"reproducing {orig.run_id} as {new_path.name}: code from {escape(how)}"
        + (f" [yellow](the run recorded {code['states']} code states; using the latest)[/]" if code["states"] > 1 else "")
    )
    env = dict(os.environ)
    if root != source_root():  # else the installed package is this tree
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_path(root)), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "snowcat.pipeline.cli", "run", str(orig.path / "config.yaml"), "--run-dir", str(new_path)],
        cwd=root,
        env=env,
    )
    new = RunDir.open(new_path) if (new_path / "run.json").is_file() else None
    if new is None:
        raise UserError(f"{new_path}: the reproduction did not start (snowcat run exited {proc.returncode})")
    if cfg.executor.kind != "local" and proc.returncode == 0 and not all(new.is_done(u) for u in _units(new)):
        err.print(
            f"submitted with the {cfg.executor.kind} executor; when it has finished, compare with: "
            f"snowcat reproduce {orig.path} --run-dir {new_path}"
        )
        return 1
    if root != source_root() and all(new.is_done(u) for u in _units(new)):  # the worktree served its purpose
        _git(source_root(), "worktree", "remove", "--force", str(root))
        root.with_name(root.name + ".ready").unlink(missing_ok=True)
        shutil.rmtree(root.with_name(root.name + ".import"), ignore_errors=True)
    report = compare_runs(orig, new) | {"code": how, "returncode": proc.returncode}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title=f"reproduce {orig.run_id} → {new.run_id}")
        for col in ("stage", "verdict", "identical files", "equal (narrowed)", "detail"):
            table.add_column(col, overflow="fold")
        for key, s in report["stages"].items():
            detail = (
                s["problems"][0] + (f" (+{len(s['problems']) - 1} more)" if len(s["problems"]) > 1 else "")
                if s["problems"]
                else (f"not compared: {', '.join(s['files_not_compared'])}" if s.get("files_not_compared") else "")
            )
            table.add_row(
                key,
                "[green]match[/]" if s["ok"] else "[red]DIFFERS[/]",
                str(s.get("files_identical", "-")),
                str(len(s.get("files_equal_narrowed", {}))),
                escape(detail),
            )
        Console(highlight=False, width=200).print(table)
        err.print(f"not compared, as volatile by schema: {RULE}")
        for unit, fields in _excluded_by_unit(report).items():
            err.print(f"  {escape(unit)}: {escape(', '.join(fields))}")
    return 0 if report["ok"] and proc.returncode == 0 else 1


def _excluded_by_unit(report: dict) -> dict[str, list[str]]:
    """unit -> ["file: field (why)", ...] of every field the comparison left out."""
    out: dict[str, list[str]] = {}
    for e in report["excluded_fields"]:
        out.setdefault(e["unit"], []).append(f"{e['file']}: {e['field']} ({e['why']})")
    return out


def _units(run: RunDir):
    return build(run.config()).units()
