"""Fault-injection campaign: kill, signal, starve and damage small runs, resume them, compare.

    snowcat bench faults [--faults 200] [--seed 19] [--config configs/faults.yaml] [--root DIR]
                         [--timeout 180] [--retries 4] [--kinds a,b,...] [--json FILE] [--keep-failed 3]

Makes one uninterrupted reference run of CONFIG (local executor), then for each fault a fresh run
(or a copy of the reference, for faults that damage finished outputs) with the fault injected,
`snowcat resume` until done (at most --retries resumes, each killed after --timeout seconds), and
compares the outcome with the reference. Per fault kind it counts:

  torn          a file whose content is neither old nor new: JSON/JSONL that does not parse, a
                parquet footer that does not read, a done unit or a checkpoint whose manifest does
                not verify (looked for right after the fault, before any resume, and at the end)
  lost          a unit done before the fault that is not done after recovery, or was re-run
  hangs         a command that ran past --timeout (killed, with everything it started)
  mismatches    a final output file that differs from the reference's (see EXCLUDED)
  killed        the decoy, an unrelated `sleep` started before each fault, did not survive it
  unrecovered   still not done after the retries, or a refusal the fault did not call for
  orphans       a stage process still alive after its driver was SIGKILLed
  leftovers     temp/staging/`.old` entries left in the stage directories after recovery
  two_writers   a second driver or a by-hand unit worked on a unit while another process ran it
  undetected    a file the fault damaged on purpose, still holding the damaged bytes after resume reported success

Faults that damage outputs expect a refusal (exit 2 naming the file) followed by the documented
remedy, deleting the stage directory and resuming; a damaged config.yaml must be refused (exit 2
naming it) and is then restored. Instants and targets come from --seed. One line per fault, a
table at the end; the result JSON (written atomically after every fault, so an interrupted campaign
leaves its counts so far) holds the counts, every problem found, the exclusions and why, the
machine, the git revision and the command line. Run it against committed code (docs/faults.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from snowcat.pipeline import procid
from snowcat.pipeline.fsio import atomic_write_json, sha256_file, verify_manifest
from snowcat.pipeline.provenance import host_state
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.volatile import RULE, strip_volatile

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "faults.yaml"
RL_CONFIG = REPO / "configs" / "faults-rl.yaml"
RESULTS = REPO / "benchmarks" / "results" / "faults-local.json"
CATEGORIES = (
    "torn",
    "lost",
    "hangs",
    "mismatches",
    "killed",
    "unrecovered",
    "orphans",
    "leftovers",
    "two_writers",
    "undetected",
)

# What the comparison with the reference leaves out, and why. Every other byte of every file in a
# stage manifest must be equal.
# The retention ledger also records a preemption checkpoint (saved at the notice's step, kept only
# until the next checkpoint) and its deletion: the notice's history, not output. Everything else in
# it, deletions and their reasons included, is compared.
EXCLUDED = [
    {
        "what": "fields volatile by schema (pipeline/volatile.py: " + RULE + ") in JSON and JSONL files and in a "
        "Markdown file's YAML header (the kept trajectories' dataset card); those seen in each reference are listed "
        "in references.<name>.volatile_fields_left_out",
        "why": "wall-clock durations, speeds and stamps: the rule `snowcat reproduce` applies",
    },
    {
        "what": "checkpoints/retention.json: the entries of preemption checkpoints (marked `preemption`) and of their deletion",
        "why": "a preempted stage saves one more checkpoint at the notice's step, which the next checkpoint supersedes "
        "(pipeline/retention.py); every other entry, deletions and reasons included, is compared",
    },
    {
        "what": "any JSON string holding the run directory's path (or the reference's, in a copied run)",
        "why": "each run lives in its own directory; replaced by <run>",
    },
    {
        "what": "stages/<stage>/manifest.json (the stage's own; nested checkpoint/weight manifests are compared)",
        "why": "it hashes metrics.json, timings included; every file it lists is compared on its own",
    },
    {"what": "DONE markers", "why": "they hold the finishing time and the manifest's hash (above)"},
    {
        "what": "outside stages/: state/, run.json, logs/, provenance/, history.h5, locks",
        "why": "the executor's records (pids, attempts, times, hosts), not stage outputs; run.json and "
        "config.yaml are checked by the faults that damage them",
    },
]
VOCABULARIES = {"tokenizer.json"}  # its keys are tokens ("s" is one), not field names: compared byte for byte
TEMP_NAME = re.compile(r"^\..*(\.tmp|\.staging|\.old)$")
STAGING = re.compile(r"^\..*\.(staging|tmp)$")


# --- processes ------------------------------------------------------------------------------------


def _cli(*args: str, log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A snowcat command in its own session: a hang is killed with everything it started. `cwd`: the
    Slurm part's way to tell one fault's jobs from another's (their WorkDir)."""
    out = open(log, "ab")
    out.write(f"\n$ snowcat {' '.join(args)}\n".encode())
    out.flush()
    proc = subprocess.Popen(
        [sys.executable, "-m", "snowcat.pipeline.cli", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=cwd,
    )
    out.close()
    return proc


def _unit_cmd(run: Path, stage: str, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "snowcat.stages", str(run), stage],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _proc_table() -> list[tuple[int, int, list[str]]]:
    """(pid, session id, argv) of every live process."""
    rows = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            rows.append((int(d.name), int(fields[3]), argv))
    return rows


def kill_session(sid: int) -> None:
    for pid, session, _ in _proc_table():
        if session == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stage_pids(run: Path) -> list[tuple[int, str]]:
    """(pid, stage) of the stage processes working on `run` (python -m snowcat.stages RUN STAGE)."""
    out = []
    for pid, _, argv in _proc_table():
        if "snowcat.stages" in argv and str(run) in argv:
            i = argv.index(str(run))
            out.append((pid, argv[i + 1] if i + 1 < len(argv) else "?"))
    return out


def wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """Exit code, or None after killing the command's whole session at the time-out."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        proc.wait()
        return None


def wait_for(predicate: Callable[[], object], timeout: float, poll: float = 0.005) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    return None


def last_output(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(x.strip() for x in text[-lines:])


# --- reading a run directory ------------------------------------------------------------------------


def stage_graph(run: Path) -> dict[str, list[str]]:
    """stage -> needs, from the run's frozen config (or the reference's, when damaged)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    return {name: list(s.get("needs") or []) for name, s in cfg["stages"].items()}


def downstream(graph: dict[str, list[str]], stage: str) -> set[str]:
    out, todo = set(), [stage]
    while todo:
        s = todo.pop()
        for name, needs in graph.items():
            if s in needs and name not in out:
                out.add(name)
                todo.append(name)
    return out


def unit_dirs(run: Path) -> dict[str, Path]:
    """unit key -> directory, for every unit directory under stages/ (fan-out elements included)."""
    out = {}
    for stage in sorted((run / "stages").glob("*")) if (run / "stages").is_dir() else []:
        if stage.is_dir():
            elements = sorted(p for p in stage.iterdir() if p.is_dir() and p.name.isdigit())
            out |= {f"{stage.name}/{p.name}": p for p in elements} or {stage.name: stage}
    return out


def done_units(run: Path) -> dict[str, str]:
    """unit key -> its DONE marker's text (a re-run unit gets a new one)."""
    return {k: (d / "DONE").read_text() for k, d in unit_dirs(run).items() if (d / "DONE").is_file()}


def verify_unit(d: Path) -> list[str]:
    try:
        marker = json.loads((d / "DONE").read_text())
    except (OSError, ValueError):
        return [f"{d / 'DONE'}: does not parse"]
    if not (d / "manifest.json").is_file() or sha256_file(d / "manifest.json") != marker.get("manifest_sha256"):
        return [f"{d / 'manifest.json'}: does not match the DONE marker"]
    try:
        return verify_manifest(d, exclude=("DONE",))
    except (ValueError, KeyError, TypeError) as e:
        return [f"{d / 'manifest.json'}: unreadable ({e})"]


def torn_files(run: Path, skip: frozenset[Path] = frozenset()) -> list[str]:
    """Files whose content is neither an old nor a new version. Temp names are not looked at: they
    are invisible to readers by construction (leftovers are counted apart)."""
    torn = []
    root = run / "stages"
    for p in sorted(root.rglob("*")) if root.is_dir() else []:
        rel = p.relative_to(run)
        if p in skip or any(TEMP_NAME.match(part) for part in rel.parts) or not p.is_file():
            continue
        try:
            if p.suffix == ".json" or p.name == "DONE":
                json.loads(p.read_text())
            elif p.suffix == ".jsonl":
                for line in p.read_text().splitlines():
                    if line.strip():
                        json.loads(line)
            elif p.suffix == ".parquet":
                pq.read_metadata(p)
        except Exception as e:  # noqa: BLE001 (any failure to read is the finding)
            torn.append(f"{rel}: {type(e).__name__}")
    for key, d in unit_dirs(run).items():
        if (d / "DONE").is_file() and not any(s in skip for s in [d, *d.rglob("*")]):
            torn += [f"unit {key}: {x}" for x in verify_unit(d)]
        ckpts = d / "checkpoints"
        for c in sorted(ckpts.iterdir()) if ckpts.is_dir() else []:
            if c.is_dir() and not c.name.startswith(".") and c not in skip and not any(s in skip for s in c.rglob("*")):
                if not (c / "manifest.json").is_file():
                    torn.append(f"{c.relative_to(run)}: checkpoint without manifest")
                else:
                    try:
                        torn += [f"checkpoint {x}" for x in verify_manifest(c)]
                    except (ValueError, KeyError, TypeError) as e:
                        torn.append(f"{c.relative_to(run)}/manifest.json: unreadable ({e})")
    return torn


def leftovers(run: Path) -> list[str]:
    root = run / "stages"
    return sorted(str(p.relative_to(run)) for p in root.rglob(".*") if TEMP_NAME.match(p.name)) if root.is_dir() else []


def _unpath(obj, paths: tuple[str, ...]):
    if isinstance(obj, dict):
        return {k: _unpath(v, paths) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpath(v, paths) for v in obj]
    if isinstance(obj, str):
        for p in paths:
            obj = obj.replace(p, "<run>")
    return obj


def _structured(path: Path, text: str):
    """The content of a JSON/JSONL file, or {header, body} of Markdown with a YAML header (a dataset
    card); None for a Markdown file without one."""
    if path.suffix == ".jsonl":
        return [json.loads(x) for x in text.splitlines() if x.strip()]
    if path.suffix == ".json":
        return json.loads(text)
    head, sep, body = text.removeprefix("---\n").partition("\n---\n")
    return {"header": yaml.safe_load(head), "body": body} if text.startswith("---\n") and sep else None


def normalized(path: Path, paths: tuple[str, ...], removed: dict[str, set[str]] | None = None) -> str:
    """sha256 of the file; of JSON, JSONL and a Markdown file's YAML header, of the content less the
    fields volatile by schema (pipeline/volatile.py; their names go to `removed[file name]`), with
    `paths` (run directories) replaced by <run>."""
    if path.suffix not in (".json", ".jsonl", ".md") or path.name in VOCABULARIES:
        return sha256_file(path)
    text = path.read_text(errors="replace")
    try:
        obj = _structured(path, text)
    except (ValueError, yaml.YAMLError):
        return "unparseable:" + hashlib.sha256(text.encode()).hexdigest()
    if obj is None:
        return sha256_file(path)
    obj, gone = strip_volatile(obj)
    obj = _unpath(obj, paths)
    if removed is not None and gone:
        removed.setdefault(path.name, set()).update(gone)
    if path.name == "retention.json" and isinstance(obj, dict) and isinstance(obj.get("checkpoints"), dict):
        notice = {k for k, v in obj["checkpoints"].items() if isinstance(v, dict) and v.get("preemption")}
        obj["checkpoints"] = {k: v for k, v in obj["checkpoints"].items() if k not in notice}
        obj["deleted"] = [d for d in obj.get("deleted", []) if not (isinstance(d, dict) and str(d.get("step")) in notice)]
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprint(
    run: Path, reference: Path | None = None, removed: dict[str, set[str]] | None = None
) -> dict[str, dict[str, str]]:
    """unit key -> {file in its manifest -> normalized hash}. `reference`: the run this one may be a
    copy of (its path, too, stands for the run directory); `removed`: see `normalized`."""
    paths = tuple(str(p) for p in (run, reference) if p is not None)
    out = {}
    for key, d in unit_dirs(run).items():
        try:
            files = json.loads((d / "manifest.json").read_text())["files"]
        except (OSError, ValueError, KeyError):
            out[key] = {"<manifest>": "unreadable"}
            continue
        out[key] = {rel: normalized(d / rel, paths, removed) if (d / rel).is_file() else "missing" for rel in sorted(files)}
        # nested manifests (a checkpoint's, a weight version's) are outputs too, but no stage manifest
        # lists them: fsio.list_files leaves out every file named manifest.json, at any depth
        for m in sorted(d.rglob("manifest.json")):
            rel = m.relative_to(d)
            if m != d / "manifest.json" and not any(part.startswith(".") for part in rel.parts) and str(rel) not in files:
                out[key][str(rel)] = normalized(m, paths, removed)
    return out


def compare(ref: dict[str, dict[str, str]], got: dict[str, dict[str, str]]) -> list[str]:
    problems = []
    for key in sorted(set(ref) | set(got)):
        a, b = ref.get(key), got.get(key)
        if a is None or b is None:
            problems.append(f"unit {key}: only in the {'reference' if b is None else 'resumed run'}")
            continue
        for rel in sorted(set(a) | set(b)):
            if rel not in a or rel not in b:
                problems.append(f"{key}/{rel}: only in the {'reference' if rel not in b else 'resumed run'}")
            elif a[rel] != b[rel]:
                problems.append(f"{key}/{rel}: differs")
    return problems


def same_torch_content(a: Path, b: Path) -> bool:
    """Whether two torch files hold equal values (bytes can differ: pickling is not canonical)."""
    import torch  # noqa: PLC0415 (only to explain a mismatch)

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(same, x, y))
        return x == y

    try:
        return same(torch.load(a, weights_only=False), torch.load(b, weights_only=False))
    except Exception:  # noqa: BLE001
        return False


def explain(problem: str, ref: Path, run: Path) -> str:
    """A mismatch of a torch file, annotated with whether its values are equal."""
    m = re.match(r"(.+): differs$", problem)
    if not m or not m.group(1).endswith(".pt"):
        return problem
    key, _, rel = m.group(1).partition("/")
    a, b = unit_dirs(ref).get(key), unit_dirs(run).get(key)
    if a is None or b is None:
        return problem
    same = same_torch_content(a / rel, b / rel)
    return f"{problem} ({'bytes only: equal values' if same else 'values differ'})"


# --- faults -----------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    index: int
    dir: Path
    run: Path
    params: dict = field(default_factory=dict)
    done_before: dict[str, str] = field(default_factory=dict)
    exempt: set[str] = field(default_factory=set)  # units the fault damaged: they (and downstream) may re-run
    remedy: bool = False  # a refusal naming a damaged output is expected, then the documented remedy
    skip_torn: frozenset[Path] = frozenset()  # what the fault itself damaged (not torn by the pipeline)
    damaged: dict[Path, str] = field(default_factory=dict)  # file -> its sha256 right after the damage
    ref: str = "main"  # which reference run (and config) the fault starts from and is compared with
    config_backup: str | None = None
    expect_config_refusal: bool = False
    problems: dict[str, list[str]] = field(default_factory=lambda: {c: [] for c in CATEGORIES})
    notes: list[str] = field(default_factory=list)
    resumes: int = 0
    remedies: int = 0

    @property
    def log(self) -> Path:
        return self.dir / "commands.log"


@dataclass
class Reference:
    """An uninterrupted run of a config: what every fault's outcome is compared with."""

    config: Path
    path: Path
    print: dict[str, dict[str, str]] = field(default_factory=dict)
    wall: float = 0.0
    command_s: float = 0.0  # how long `snowcat run` took (on Slurm: the submission alone)
    volatile: dict[str, set[str]] = field(default_factory=dict)  # file name -> fields left out of the comparison


class Campaign:
    """The local part: runs under the local executor, each command's exit is the run's end. The Slurm
    part (benchmarks/faults_slurm.py) overrides the hooks marked so."""

    rl_kinds = ("kill_weight_publish", "kill_mpi_rank")
    run_args: tuple[str, ...] = ()  # hook: options of `snowcat run` besides the config and --run-dir

    def __init__(self, args, root: Path, config: Path, rl_config: Path | None = None):
        self.args = args
        self.root = root
        self.config = config
        self.timeout = args.timeout
        self.refs = {"main": Reference(config, root / "reference")}
        if rl_config is not None:
            self.refs["rl"] = Reference(rl_config, root / "reference-rl")

    @property
    def reference(self) -> Path:
        return self.refs["main"].path

    @property
    def ref_print(self) -> dict[str, dict[str, str]]:
        return self.refs["main"].print

    @property
    def ref_wall(self) -> float:
        return self.refs["main"].wall

    # -- hooks --

    @classmethod
    def unready(cls) -> str | None:
        """Why the campaign cannot start here (checked after the arguments), or None."""
        return None

    def workdir(self, run: Path) -> Path | None:
        """Where the commands of the run at `run` start (None: the campaign's own directory)."""
        return None

    def settle(self, run: Path) -> str | None:
        """Wait for the work a command left running (none locally); a complaint past the time-out."""
        return None

    def finished(self, run: Path) -> bool:
        """Whether a run whose last command exited 0 is done (locally: always)."""
        return True

    def cli(self, run: Path, *args: str, log: Path) -> subprocess.Popen:
        return _cli(*args, log=log, cwd=self.workdir(run))

    def before(self, f: Fault) -> None:
        """Right before the fault is injected (the decoy process already runs)."""

    def after(self, f: Fault) -> None:
        """After the verdict, whatever happened: nothing of this fault may run into the next one."""

    def describe(self) -> dict:
        """What the result file says besides the counts about where the campaign ran."""
        return {}

    # -- reference --

    def make_reference(self, name: str = "main") -> None:
        ref = self.refs[name]
        shutil.rmtree(ref.path, ignore_errors=True)
        log = self.root / f"{ref.path.name}.log"
        t0 = time.monotonic()
        rc = wait(self.cli(ref.path, "run", str(ref.config), *self.run_args, "--run-dir", str(ref.path), log=log), self.timeout)
        ref.command_s = time.monotonic() - t0
        hang = self.settle(ref.path) if rc == 0 else None
        ref.wall = time.monotonic() - t0
        if rc != 0 or hang or not self.finished(ref.path):
            raise SystemExit(f"the reference run of {ref.config} failed ({rc}, {hang}): {last_output(log)}")
        ref.print = fingerprint(ref.path, removed=ref.volatile)
        torn = torn_files(ref.path)
        if torn:
            raise SystemExit(f"the reference run {ref.path} has torn files: {torn[:3]}")

    def fresh(self, kind: str, index: int) -> Fault:
        d = self.root / "faults" / f"{index:04d}-{kind}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return Fault(kind, index, d, d / "run", ref="rl" if kind in self.rl_kinds else "main")

    def copy_reference(self, f: Fault) -> None:
        shutil.copytree(self.refs[f.ref].path, f.run, symlinks=True)
        f.done_before = done_units(f.run)

    def start(self, f: Fault) -> subprocess.Popen:
        proc = _cli("run", str(self.config), "--run-dir", str(f.run), log=f.log)
        wait_for(lambda: (f.run / "run.json").is_file() or proc.poll() is not None, self.timeout)
        return proc

    def finish_driver(self, f: Fault, proc: subprocess.Popen) -> int | None:
        rc = wait(proc, self.timeout)
        if rc is None:
            f.problems["hangs"].append(f"driver (after the fault) ran past {self.timeout}s")
        return rc

    def after_kill(self, f: Fault) -> None:
        """Children die with a SIGKILLed driver (PR_SET_PDEATHSIG): none may outlive it."""
        alive = wait_for(lambda: not stage_pids(f.run), 10, poll=0.05)
        if not alive:
            pids = stage_pids(f.run)
            f.problems["orphans"].append(f"stage processes alive 10 s after the driver died: {pids}")
            for pid, _ in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def instant(self, rng: random.Random) -> float:
        return rng.uniform(0.3, 0.95 * self.ref_wall)

    def check_torn(self, f: Fault, when: str) -> None:
        f.problems["torn"] += [f"{when}: {t}" for t in torn_files(f.run, f.skip_torn)]

    # -- kinds: each injects its fault and leaves the run ready for recovery --

    def kill_driver(self, f: Fault, rng: random.Random) -> None:
        proc = self.start(f)
        f.params["at_s"] = round(self.instant(rng), 2)
        time.sleep(f.params["at_s"])
        f.done_before = done_units(f.run)
        if proc.poll() is not None:
            f.notes.append("the run finished before the instant")
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.after_kill(f)
        self.check_torn(f, "after the kill")

    def _signal_stage(self, f: Fault, rng: random.Random, sig: int) -> None:
        proc = self.start(f)
        f.params["at_s"] = round(self.instant(rng), 2)
        time.sleep(f.params["at_s"])
        target = wait_for(lambda: stage_pids(f.run) or proc.poll() is not None, 30)
        f.done_before = done_units(f.run)
        if isinstance(target, list):
            pid, stage = target[0]
            f.params["stage"] = stage
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        else:
            f.notes.append("no stage process was running (the run had finished)")
        self.finish_driver(f, proc)
        self.check_torn(f, "after the signal")

    def kill_stage(self, f: Fault, rng: random.Random) -> None:
        self._signal_stage(f, rng, signal.SIGKILL)

    def sigterm_stage(self, f: Fault, rng: random.Random) -> None:
        self._signal_stage(f, rng, signal.SIGTERM)

    def sigusr2_stage(self, f: Fault, rng: random.Random) -> None:
        self._signal_stage(f, rng, signal.SIGUSR2)

    def sigterm_driver(self, f: Fault, rng: random.Random) -> None:
        proc = self.start(f)
        f.params["at_s"] = round(self.instant(rng), 2)
        time.sleep(f.params["at_s"])
        f.done_before = done_units(f.run)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        f.params["driver_rc"] = self.finish_driver(f, proc)
        self.after_kill(f)
        self.check_torn(f, "after SIGTERM")

    def wait_for_staging(self, proc, directory: Path, nth: int) -> tuple[str | None, set[str]]:
        """Poll until the nth temp directory (a checkpoint save or weight publication under way) is
        present in `directory`: "hit", "ended" (the process exited first) or None (time-out)."""
        seen: set[str] = set()

        def check():
            if proc.poll() is not None:
                return "ended"
            names = {p.name for p in directory.iterdir() if STAGING.match(p.name)} if directory.is_dir() else set()
            seen.update(names)
            return "hit" if len(seen) >= nth and names else None

        return wait_for(check, self.timeout, poll=0.002), seen

    def kill_ckpt_save(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL (the SFT process or the driver) while a checkpoint is being built under a temp name."""
        nth = rng.randint(1, 7)
        who = rng.choice(["stage", "driver"])
        f.params |= {"save": nth, "who": who}
        ckpts = f.run / "stages" / "sft" / "checkpoints"
        proc = self.start(f)
        state, seen = self.wait_for_staging(proc, ckpts, nth)
        f.done_before = done_units(f.run)
        if state != "hit":
            f.notes.append(f"only {len(seen)} checkpoint saves seen")
        elif who == "driver":
            f.params["during"] = sorted(seen)[-1]
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        else:
            f.params["during"] = sorted(seen)[-1]
            for pid, stage in stage_pids(f.run):
                if stage == "sft":
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self.finish_driver(f, proc)
        self.after_kill(f)
        self.check_torn(f, "after the kill")

    def kill_at_mark_done(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of a stage process at its commit point: metrics.json written, DONE not yet."""
        stage = rng.choice(sorted(stage_graph(self.reference)))
        f.params["stage"] = stage
        out = f.run / "stages" / stage
        proc = self.start(f)

        def committing():
            if proc.poll() is not None:
                return "ended"
            return "hit" if (out / "metrics.json").is_file() and not (out / "DONE").is_file() else None

        state = wait_for(committing, self.timeout, poll=0.001)
        f.done_before = done_units(f.run)
        if state != "hit":
            f.notes.append("the commit point was not seen")
        for pid, s in stage_pids(f.run) if state == "hit" else []:
            if s == stage:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        f.params["killed_before_done"] = not (out / "DONE").is_file()
        if state == "hit" and (out / "DONE").is_file():
            f.notes.append("the DONE marker was written before the kill landed")
        self.finish_driver(f, proc)
        self.check_torn(f, "after the kill")

    def disk_full(self, f: Fault, rng: random.Random) -> None:
        """The run directory on a small tmpfs: writes fail with ENOSPC; recovery enlarges it."""
        mnt = f.dir / "mnt"
        mnt.mkdir()
        size_kb = rng.randint(1024, 48 * 1024)
        f.params["size_kb"] = size_kb
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)], capture_output=True)
        if done.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs (root needed): {done.stderr.decode().strip()}")
        f.run = mnt / "run"
        proc = self.start(f)
        f.params["driver_rc"] = self.finish_driver(f, proc)
        f.done_before = done_units(f.run)
        self.after_kill(f)
        self.check_torn(f, "on the full disk")
        subprocess.run(["mount", "-o", "remount,size=1g", str(mnt)], check=True)

    def _damage(self, f: Fault, path: Path, rng: random.Random) -> str:
        data = path.read_bytes()
        mode = rng.choice(["flip", "truncate", "empty"]) if data else "append"
        if mode == "flip":
            i = rng.randrange(len(data))
            data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
        elif mode == "truncate":
            data = data[: rng.randrange(len(data))]
        elif mode == "empty":
            data = b""
        else:
            data = b"x"
        path.write_bytes(data)
        f.damaged[path] = sha256_file(path)
        return mode

    def corrupt_output(self, f: Fault, rng: random.Random) -> None:
        """A file of a done stage's manifest flipped or truncated (a checkpoint shard, a table, ...)."""
        self.copy_reference(f)
        units = unit_dirs(f.run)
        key = rng.choice(sorted(units))
        files = sorted(json.loads((units[key] / "manifest.json").read_text())["files"])
        rel = rng.choice(files)
        target = units[key] / rel
        f.params |= {"unit": key, "file": rel, "mode": self._damage(f, target, rng)}
        f.exempt, f.remedy, f.skip_torn = {key}, True, frozenset({target})

    def corrupt_checkpoint(self, f: Fault, rng: random.Random) -> None:
        """A file of a retained SFT checkpoint (model shard, optimizer state, manifest) damaged."""
        self.copy_reference(f)
        ckpts = f.run / "stages" / "sft" / "checkpoints"
        ckpt = rng.choice(sorted(p for p in ckpts.iterdir() if p.is_dir() and not p.name.startswith(".")))
        target = rng.choice(sorted(p for p in ckpt.rglob("*") if p.is_file()))
        f.params |= {"file": str(target.relative_to(f.run)), "mode": self._damage(f, target, rng)}
        f.exempt, f.remedy, f.skip_torn = {"sft"}, True, frozenset({target})

    def corrupt_manifest(self, f: Fault, rng: random.Random) -> None:
        self.copy_reference(f)
        key = rng.choice(sorted(unit_dirs(f.run)))
        target = unit_dirs(f.run)[key] / "manifest.json"
        f.params |= {"unit": key, "mode": self._damage(f, target, rng)}
        f.exempt, f.remedy, f.skip_torn = {key}, True, frozenset({target})

    def delete_done(self, f: Fault, rng: random.Random) -> None:
        """A DONE marker deleted: that unit must run again (its downstream may, as stale)."""
        self.copy_reference(f)
        key = rng.choice(sorted(unit_dirs(f.run)))
        (unit_dirs(f.run)[key] / "DONE").unlink()
        f.params["unit"] = key
        f.exempt = {key}

    def resume_from_bad_checkpoint(self, f: Fault, rng: random.Random) -> None:
        """SFT killed after a few checkpoints, the newest then damaged: resume must not trust it."""
        nth = rng.randint(2, 5)
        f.params["after_checkpoints"] = nth
        ckpts = f.run / "stages" / "sft" / "checkpoints"
        proc = self.start(f)

        def steps() -> list[Path]:
            return sorted(p for p in ckpts.glob("step_*") if p.is_dir()) if ckpts.is_dir() else []

        # configs/faults.yaml saves every 4 steps: wait for the nth save (or the run's end)
        wait_for(lambda: proc.poll() is not None or (steps() and int(steps()[-1].name[5:]) >= 4 * nth), self.timeout, poll=0.01)
        f.done_before = done_units(f.run)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.after_kill(f)
        if "sft" in f.done_before or not steps():
            f.notes.append("SFT finished before the kill")
            return
        newest = steps()[-1]
        target = rng.choice(sorted(p for p in newest.rglob("*") if p.is_file()))
        f.params |= {"file": str(target.relative_to(f.run)), "mode": self._damage(f, target, rng)}
        f.skip_torn = frozenset({newest, target})
        self.check_torn(f, "after the kill")

    def damaged_config(self, f: Fault, rng: random.Random) -> None:
        """config.yaml cut short (of a finished run, or after a kill): opening the run must refuse."""
        if rng.random() < 0.5:
            self.copy_reference(f)
            f.params["run"] = "finished"
        else:
            self.kill_driver(f, rng)
            f.params["run"] = "killed"
        path = f.run / "config.yaml"
        text = path.read_text()
        f.config_backup = text
        cut = rng.randrange(len(text))
        path.write_text(text[:cut])
        f.params["cut_at"] = cut
        f.expect_config_refusal = True

    def stale_pid_cancel(self, f: Fault, rng: random.Random) -> None:
        """`snowcat cancel` on a finished run whose recorded pids now name another process (the decoy)."""
        self.copy_reference(f)
        decoy = self.decoy
        where = rng.choice(["driver", "stages", "both"])
        f.params["where"] = where
        if where in ("driver", "both"):
            (f.run / ".driver.pid").write_text(str(decoy.pid))
        if where in ("stages", "both"):
            run = RunDir.open(f.run)
            recycled = {**procid.identify(), "pid": decoy.pid}  # the decoy's pid, another process's start time
            for key in run.state()["stages"]:
                run.update_stage(key, group=recycled, process=recycled)
        rc = wait(_cli("cancel", str(f.run), log=f.log), self.timeout)
        f.params["cancel_rc"] = rc
        time.sleep(0.2)

    def concurrent_driver(self, f: Fault, rng: random.Random) -> None:
        """A second `snowcat resume` while the first driver runs: it must refuse, changing nothing."""
        proc = self.start(f)
        f.params["at_s"] = round(self.instant(rng), 2)
        time.sleep(f.params["at_s"])
        first_alive = proc.poll() is None
        second = wait(_cli("resume", str(f.run), log=f.log), self.timeout)
        f.params["second_rc"] = second
        if second is None:
            f.problems["hangs"].append("the second driver ran past the time-out")
        elif first_alive and proc.poll() is None and second != 2:
            f.problems["two_writers"].append(f"the second driver exited {second} while the first was driving")
        f.params["first_rc"] = self.finish_driver(f, proc)
        f.done_before = done_units(f.run)
        self.check_torn(f, "after both drivers")

    def by_hand_unit(self, f: Fault, rng: random.Random) -> None:
        """`python -m snowcat.stages RUN sft` while the driver runs sft: one of them must stand aside."""
        proc = self.start(f)
        wait_for(lambda: any(s == "sft" for _, s in stage_pids(f.run)) or proc.poll() is not None, self.timeout)
        f.params["delay_s"] = round(rng.uniform(0, 3), 2)
        time.sleep(f.params["delay_s"])
        f.done_before = done_units(f.run)
        driver_sft = [pid for pid, s in stage_pids(f.run) if s == "sft"]
        hand_log = f.dir / "by-hand.log"
        hand = _unit_cmd(f.run, "sft", hand_log)

        def overlap() -> bool:  # the by-hand unit began training while the driver's SFT process lived
            return "sft (sft) rank" in hand_log.read_text(errors="replace") and any(
                Path(f"/proc/{p}").exists() for p in driver_sft
            )

        both = wait_for(lambda: overlap() or hand.poll() is not None, self.timeout, poll=0.02)
        if both is True and overlap():
            f.problems["two_writers"].append("the by-hand sft unit ran while the driver's sft process was running")
        f.params["by_hand_rc"] = wait(hand, self.timeout)
        f.params["driver_rc"] = self.finish_driver(f, proc)
        f.params["by_hand_said"] = last_output(hand_log, 1)[:300]
        self.check_torn(f, "after both")

    # -- RL kinds: on a copy of the RL reference with its rl stage removed, so only RL runs again --

    def _start_rl(self, f: Fault) -> subprocess.Popen:
        self.copy_reference(f)
        shutil.rmtree(f.run / "stages" / "rl")
        f.done_before = done_units(f.run)
        return _cli("resume", str(f.run), log=f.log)

    def _rl_ranks(self, f: Fault) -> dict[int, int]:
        """MPI rank -> pid of the rl stage's rank processes (their environment names the rank)."""
        ranks = {}
        for pid, stage in stage_pids(f.run):
            if stage != "rl":
                continue
            try:
                env = dict(
                    x.split("=", 1)
                    for x in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                    if "=" in x
                )
            except OSError:
                continue
            if env.get("OMPI_COMM_WORLD_RANK", "").isdigit():
                ranks[int(env["OMPI_COMM_WORLD_RANK"])] = pid
        return ranks

    def kill_weight_publish(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of the trainer rank (or the driver) while it publishes weights for the rollout rank."""
        nth = rng.randint(1, 6)
        who = rng.choice(["trainer", "driver"])
        f.params |= {"publish": nth, "who": who}
        weights = f.run / "stages" / "rl" / "weights"
        proc = self._start_rl(f)
        state, seen = self.wait_for_staging(proc, weights, nth)
        if state != "hit":
            f.notes.append(f"only {len(seen)} weight publications seen")
        else:
            f.params["during"] = sorted(seen)[-1]
            pid = proc.pid if who == "driver" else self._rl_ranks(f).get(0)
            if pid is None:
                f.notes.append("no trainer rank found")
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.finish_driver(f, proc)
        self.after_kill(f)
        self.check_torn(f, "after the kill")

    def kill_mpi_rank(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of one MPI rank of RL (trainer or rollout) at a random instant: the other must not hang."""
        rank = rng.randint(0, 1)
        duration = float(json.loads((self.refs["rl"].path / "stages" / "rl" / "metrics.json").read_text())["duration_s"])
        f.params |= {"rank": rank, "at_s": round(rng.uniform(0.5, duration + 2.0), 2)}
        proc = self._start_rl(f)
        wait_for(lambda: len(self._rl_ranks(f)) == 2 or proc.poll() is not None, self.timeout, poll=0.05)
        time.sleep(f.params["at_s"])
        pid = self._rl_ranks(f).get(rank)
        if pid is None:
            f.notes.append("the rank had already ended")
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.finish_driver(f, proc)
        self.check_torn(f, "after the kill")

    # -- recovery and verdict --

    def recover(self, f: Fault) -> None:
        if f.expect_config_refusal:
            proc = self.cli(f.run, "resume", str(f.run), log=f.log)
            rc = wait(proc, self.timeout)
            said = last_output(f.log, 1)
            f.params["refusal"] = said[:300]
            if rc != 2 or "config.yaml" not in said:
                f.problems["mismatches"].append(f"a damaged config.yaml was not refused (exit {rc}): {said[:200]}")
            (f.run / "config.yaml").write_text(f.config_backup or "")  # the user restores it
        for _ in range(self.args.retries):
            f.resumes += 1
            # a run whose creation the fault stopped (e.g. a full disk) does not exist yet: run it again
            again = (
                ("resume", str(f.run))
                if (f.run / "run.json").is_file()
                else ("run", str(self.refs[f.ref].config), *self.run_args, "--run-dir", str(f.run))
            )
            rc = wait(self.cli(f.run, *again, log=f.log), self.timeout)
            if rc is None:
                f.problems["hangs"].append(f"resume {f.resumes} ran past {self.timeout}s")
                continue
            said = last_output(f.log, 1)
            if rc == 0:
                hang = self.settle(f.run)
                if hang:
                    f.problems["hangs"].append(f"after resume {f.resumes}: {hang}")
                if self.finished(f.run):
                    return
                continue
            m = re.search(r"delete (\S+) to recompute it", said)
            if rc == 2 and m and f.remedy:
                shutil.rmtree(m.group(1))  # the documented remedy for outputs that changed
                f.remedies += 1
                continue
            if rc == 2:
                f.problems["unrecovered"].append(f"resume refused: {said[:300]}")
                return
        f.problems["unrecovered"].append(f"not done after {self.args.retries} resumes: {last_output(f.log, 1)[:300]}")

    def verdict(self, f: Fault) -> None:
        ref = self.refs[f.ref]
        graph = stage_graph(ref.path)
        may_rerun = set(f.exempt)
        for key in f.exempt:
            may_rerun |= downstream(graph, key.split("/")[0])
        after = done_units(f.run)
        for key, marker in f.done_before.items():
            if key.split("/")[0] in may_rerun:
                continue
            if key not in after:
                f.problems["lost"].append(f"{key}: done before the fault, not done after")
            elif after[key] != marker:
                f.problems["lost"].append(f"{key}: done before the fault, re-run after")
        # a file still holding the bytes the fault left: nothing refused, replaced or removed it
        still = [p for p, digest in f.damaged.items() if p.is_file() and sha256_file(p) == digest]
        f.problems["torn"] += [f"at the end: {t}" for t in torn_files(f.run, frozenset(still))]
        if not f.problems["unrecovered"]:  # a run that never recovered is counted there
            f.problems["undetected"] += [f"{p.relative_to(f.run)}: still damaged, yet resume reported success" for p in still]
        f.problems["leftovers"] += leftovers(f.run)
        if not f.problems["unrecovered"]:
            f.problems["mismatches"] += [explain(p, ref.path, f.run) for p in compare(ref.print, fingerprint(f.run, ref.path))]

    def one(self, kind: str, index: int, rng: random.Random) -> Fault:
        f = self.fresh(kind, index)
        if not self.refs[f.ref].print:
            self.make_reference(f.ref)
        self.decoy = subprocess.Popen(["sleep", "100000"], start_new_session=True)
        try:
            self.before(f)
            getattr(self, kind)(f, rng)
            self.recover(f)
            self.verdict(f)
        except Exception as e:  # noqa: BLE001 (a campaign error is recorded, never hidden)
            f.problems["unrecovered"].append(f"campaign error: {type(e).__name__}: {e}")
        finally:
            if self.decoy.poll() is not None:
                f.problems["killed"].append(f"decoy pid {self.decoy.pid} died ({self.decoy.returncode})")
            else:
                self.decoy.kill()
            self.decoy.wait()
            for pid, _ in stage_pids(f.run):  # nothing of this fault may run into the next one
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if kind == "disk_full":
                subprocess.run(["umount", "-l", str(f.dir / "mnt")], capture_output=True)
            self.after(f)
        return f


KINDS = (
    "kill_driver",
    "kill_stage",
    "kill_ckpt_save",
    "kill_at_mark_done",
    "sigterm_stage",
    "sigusr2_stage",
    "sigterm_driver",
    "disk_full",
    "corrupt_output",
    "corrupt_checkpoint",
    "corrupt_manifest",
    "delete_done",
    "resume_from_bad_checkpoint",
    "damaged_config",
    "stale_pid_cancel",
    "concurrent_driver",
    "by_hand_unit",
    "kill_weight_publish",
    "kill_mpi_rank",
)
RL_KINDS = Campaign.rl_kinds  # on configs/faults-rl.yaml (an RL stage: two MPI ranks)


# --- report ------------------------------------------------------------------------------------------


def summarize(faults: list[Fault]) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for f in faults:
        row = table.setdefault(f.kind, {"runs": 0, "missed": 0, **{c: 0 for c in CATEGORIES}, "handled": 0})
        row["runs"] += 1
        row["missed"] += bool(f.notes)  # every note says the target had ended before the fault landed
        for c in CATEGORIES:
            row[c] += bool(f.problems[c])
        row["handled"] += not any(f.problems.values())
    return table


def record(f: Fault) -> dict:
    return {
        "index": f.index,
        "kind": f.kind,
        "params": f.params,
        "resumes": f.resumes,
        "remedies": f.remedies,
        "notes": f.notes,
        "problems": {c: v for c, v in f.problems.items() if v},
    }


def git_revision() -> str | None:
    """The snapshot's revision: a `git archive` tarball records it in its pax header only, so the
    caller passes it in SNOWCAT_FAULTS_REVISION; else this checkout's HEAD."""
    if os.environ.get("SNOWCAT_FAULTS_REVISION"):
        return os.environ["SNOWCAT_FAULTS_REVISION"]
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def quote(result: dict) -> str:
    """The headline of a result file as docs/faults.md and benchmarks/results/README.md quote it."""
    t = result["totals"]
    problems = ", ".join(f"{c} {t[c]}" for c in CATEGORIES)
    return (
        f"{t['runs']} faults of {len(result['counts'])} kinds at {(result['git_revision'] or '?')[:7]} "
        f"({result['campaign_wall_s']:.0f} s): {t['handled']} handled, {t['missed']} missed; {problems}"
    )


def print_table(table: dict[str, dict]) -> None:
    cols = ["runs", "missed", *CATEGORIES, "handled"]
    print(f"{'fault kind':28}" + "".join(f"{c:>12}" for c in cols))
    for kind, row in table.items():
        print(f"{kind:28}" + "".join(f"{row[c]:>12}" for c in cols))
    total = {c: sum(r[c] for r in table.values()) for c in cols}
    print(f"{'total':28}" + "".join(f"{total[c]:>12}" for c in cols))


def parser(defaults: dict, kinds: tuple[str, ...], rl_kinds: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options of both parts (`defaults`: faults, timeout, json)."""
    p = argparse.ArgumentParser(prog="snowcat bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=defaults["faults"])
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--rl-config", default=str(RL_CONFIG), help="the pipeline of the RL kinds (" + ", ".join(rl_kinds) + ")")
    p.add_argument("--root", default=defaults["root"])
    p.add_argument("--timeout", type=float, default=defaults["timeout"], help="seconds per command before it counts as a hang")
    p.add_argument("--retries", type=int, default=4, help="resumes per fault at most")
    p.add_argument("--kinds", default=",".join(kinds), help="comma-separated subset of: " + ", ".join(kinds))
    p.add_argument("--json", default=str(defaults["json"]))
    p.add_argument("--keep-failed", type=int, default=3, help="run directories kept per kind when a fault found a problem")
    p.add_argument("--slurm", action="store_true", help="the part on the local Slurm cluster (benchmarks/faults_slurm.py)")
    return p


def main(argv: list[str]) -> int:
    if "--slurm" in argv:
        from snowcat.benchmarks import faults_slurm  # noqa: PLC0415 (the Slurm part's own imports)

        return faults_slurm.main(argv)
    defaults = {"faults": 200, "timeout": 180.0, "json": RESULTS, "root": "/tmp/snowcat-faults"}
    args = parser(defaults, KINDS, RL_KINDS).parse_args(argv)
    return campaign(args, argv, Campaign, KINDS, part="local")


def campaign(args, argv: list[str], cls: type[Campaign], known: tuple[str, ...], part: str) -> int:
    """Check the arguments, make the references, inject every fault, write the result."""
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        print(f"error: unknown fault kind(s) {', '.join(bad) or '(none given)'}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    if args.faults < 1 or args.retries < 1 or args.timeout <= 0:
        print("error: --faults and --retries must be >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    config = Path(args.config).resolve()
    if not config.is_file():
        print(f"error: {config}: no such config", file=sys.stderr)
        return 2
    root = Path(args.root).resolve()
    if REPO in root.parents or root == REPO:
        print(f"error: --root {root} is inside the repository; use a scratch directory", file=sys.stderr)
        return 2
    rl_config = Path(args.rl_config).resolve()
    wants_rl = any(k in cls.rl_kinds for k in kinds)
    if wants_rl and not rl_config.is_file():
        print(f"error: {rl_config}: no such config", file=sys.stderr)
        return 2
    unready = cls.unready()
    if unready:
        print(f"error: {unready}", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    camp = cls(args, root, config, rl_config if wants_rl else None)
    for name in camp.refs:
        camp.make_reference(name)
        ref = camp.refs[name]
        print(f"reference run: {ref.wall:.1f} s, {sum(map(len, ref.print.values()))} output files in {ref.path}", flush=True)
    rng = random.Random(args.seed)
    plan = [kinds[i % len(kinds)] for i in range(args.faults)]
    rng.shuffle(plan)
    faults: list[Fault] = []
    kept: dict[str, int] = {}
    t0 = time.monotonic()
    for i, kind in enumerate(plan):
        f = camp.one(kind, i, random.Random(f"{args.seed}-{i}"))
        faults.append(f)
        found = [f"{c}: {v[0]}" + (f" (+{len(v) - 1})" if len(v) > 1 else "") for c, v in f.problems.items() if v]
        params = " ".join(f"{k}={v}" for k, v in f.params.items() if k not in ("refusal", "by_hand_said"))
        print(
            f"[{i + 1:>4}/{args.faults}] {kind:27} {params[:90]:90} resumes={f.resumes} " + ("; ".join(found) or "ok"), flush=True
        )
        if found and kept.get(kind, 0) < args.keep_failed:
            kept[kind] = kept.get(kind, 0) + 1
        else:
            shutil.rmtree(f.dir, ignore_errors=True)
        write_result(args, argv, camp, faults, time.monotonic() - t0, partial=i + 1 < len(plan), part=part)
    print()
    print_table(summarize(faults))
    print(f"\nresult: {args.json}")
    return 0


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if REPO in path.parents else str(path)


def write_result(args, argv, camp: Campaign, faults: list[Fault], wall: float, partial: bool, part: str) -> None:
    table = summarize(faults)
    atomic_write_json(
        args.json,
        {
            "benchmark": "faults",
            "part": part,
            "partial": partial,
            "command": "snowcat bench faults " + " ".join(argv),
            "git_revision": git_revision(),
            "configs": {name: {"path": _shown(ref.config), "text": ref.config.read_text()} for name, ref in camp.refs.items()},
            "seed": args.seed,
            "timeout_s": args.timeout,
            "retries": args.retries,
            "machine": host_state(probe_gpu=False) | {"cpu_flags": None},
            "references": {
                name: {
                    "wall_s": round(ref.wall, 1),
                    "command_s": round(ref.command_s, 1),
                    "files_per_unit": {k: len(v) for k, v in ref.print.items()},
                    "volatile_fields_left_out": {k: sorted(v) for k, v in sorted(ref.volatile.items())},
                }
                for name, ref in camp.refs.items()
            },
            "excluded_from_comparison": EXCLUDED,
            "categories": list(CATEGORIES),
            "counts": table,
            "totals": {c: sum(r[c] for r in table.values()) for c in ["runs", "missed", *CATEGORIES, "handled"]},
            **camp.describe(),
            "campaign_wall_s": round(wall, 1),
            "faults": [record(f) for f in faults],
        },
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
