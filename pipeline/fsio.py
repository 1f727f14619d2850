"""Atomic, verifiable writes: every file that matters is written to a temp file, fsynced, renamed.

A kill at any instant leaves either the old content or the new, never a torn file. Directories
(checkpoints, weight versions) are built under a temp name and renamed into place the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from snowcat.pipeline.errors import UserError

MANIFEST = "manifest.json"
_CHUNK = 1 << 20

# What this process wrote and hashed through this module: files_written, bytes_written, fsyncs,
# files_hashed, bytes_hashed. Cheap counters for benchmarks and tests (e.g. that `status` hashes
# nothing); read a difference, never an absolute value.
IO = Counter()


def _fsync(fd: int) -> None:
    os.fsync(fd)
    IO["fsyncs"] += 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it (os.umask can only set, which races threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_temp_dir(parent: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """mkdtemp, but with the permissions any new directory gets (mkdtemp makes 0700): a project
    group on a shared filesystem reads a colleague's run as far as the umask allows."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
    tmp.chmod(0o777 & ~current_umask())
    return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; a plain open() honours the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            _fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    IO["files_written"] += 1
    IO["bytes_written"] += len(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def nan_to_null(obj: Any) -> Any:
    """NaN (e.g. the SE of a single task) -> None, in nested dicts and lists, so the JSON is strict."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nan_to_null(v) for v in obj]
    return obj


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE); False where the filesystem or libc
    cannot (e.g. NFS), so the caller falls back to two renames."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_tree(root: Path, synced: Collection[str] = ()) -> None:
    """fsync every file (but those in `synced`, relative paths its writer fsynced already), then
    every directory bottom-up: a directory entry is durable only once the directory holding it is
    synced, nested ones included."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            if os.path.relpath(os.path.join(dirpath, name), root) in synced:
                continue
            with open(os.path.join(dirpath, name), "rb") as fh:
                _fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, synced: Collection[str] = ()) -> Iterator[Path]:
    """Build a directory under a temp name; put it at `path` only if the block succeeds.

    An existing `path` is swapped with the new one in a single rename (readers see old or new,
    never a mix or nothing); where the filesystem cannot swap, the old one is moved aside to
    `.<name>.old` first, which `remove_leftovers` puts back if a kill falls between the two renames.
    `synced`: relative paths the block's writers fsync themselves (a set it may fill as it goes),
    which are not fsynced a second time before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(path.parent, f".{path.name}.", ".tmp")
    try:
        yield tmp
        _fsync_tree(tmp, synced)
        if path.exists() and _exchange(tmp, path):
            _fsync_dir(path.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # now the old content
            return
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(root: str | os.PathLike) -> list[Path]:
    """Temp files and directories a killed writer left under `root` (`.<name>.*.tmp`, `.<name>.old`).

    Call it only while no writer can be at work there (the unit's lock held). A `.<name>.old` whose
    `<name>` is missing is the previous complete version, caught between atomic_dir's two renames:
    it is put back, not removed. Returns what was removed or restored."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return found
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            if not name.startswith("."):
                continue
            entry = Path(dirpath) / name
            if name.endswith(".old"):
                target = entry.with_name(name[1:-4])
                if not target.exists():
                    os.replace(entry, target)
                    _fsync_dir(entry.parent)
                    found.append(entry)
                    continue
            elif not name.endswith(".tmp"):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            found.append(entry)
        dirs[:] = [d for d in dirs if (Path(dirpath) / d).is_dir()]
    return found


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            IO["bytes_hashed"] += len(chunk)
    IO["files_hashed"] += 1
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- manifest entries: {"sha256", "size"}, or {"crc32", "crc32_chunk", "size"} -------------------
#
# SHA-256 is what model directories, checkpoints and a unit's outputs record: their provenance
# (`snowcat audit`, the card) rests on it. The weight handoff's shards record a CRC-32 of every
# `crc32_chunk` bytes instead: that manifest only guards a transient copy between a trainer and
# its rollout ranks against torn, stale or damaged files (a CRC catches every burst of up to 32
# bits and other damage but for 1 in 2^32 per chunk, as HDFS and Btrfs check their blocks), and at
# ~7 GB/s on one core (zlib) against SHA-256's ~2 GB/s it costs a fraction of the copy rather than
# more than the copy (benchmarks/results/README.md, handoff). Neither is a defence against someone
# who can write the directory: the manifest beside the files is not signed.

CRC32_CHUNK = 16 << 20


class Sha256:
    """SHA-256 of a byte stream fed to `update`; `fields()` the manifest entry's part."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, data) -> None:
        self._h.update(data)

    def fields(self) -> dict:
        return {"sha256": self._h.hexdigest()}


class Crc32Chunks:
    """CRC-32 of each `chunk` bytes of a byte stream fed to `update` (the last chunk may be short)."""

    def __init__(self, chunk: int = CRC32_CHUNK):
        self.chunk, self._done, self._crc, self._filled = chunk, [], 0, 0

    def update(self, data) -> None:
        data = memoryview(data).cast("B")
        while data:
            n = min(len(data), self.chunk - self._filled)
            self._crc = zlib.crc32(data[:n], self._crc)  # releases the GIL on large buffers, as hashlib does
            self._filled += n
            data = data[n:]
            if self._filled == self.chunk:
                self._done.append(self._crc)
                self._crc = self._filled = 0

    def fields(self) -> dict:
        return {"crc32": self._done + ([self._crc] if self._filled else []), "crc32_chunk": self.chunk}


def checksum(like: dict | None = None) -> Sha256 | Crc32Chunks:
    """A fresh checksum of the kind manifest entry `like` records (SHA-256 when `like` is None or
    names no CRC). ValueError for a CRC entry without a positive chunk length."""
    if like is None or "crc32" not in like:
        return Sha256()
    chunk = like.get("crc32_chunk")
    if type(chunk) is not int or chunk <= 0:
        raise ValueError(f"crc32_chunk {chunk!r} is not a byte count")
    return Crc32Chunks(chunk)


def checksum_kind(entry: dict) -> str:
    return "crc32" if "crc32" in entry else "sha256"


def file_entry(path: str | os.PathLike, like: dict | None = None) -> dict:
    """The manifest entry of the file at `path` as it is now, with the checksum `like` records: one
    read, into one reused buffer."""
    check, size, buf = checksum(like), 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            check.update(view[:n])
            size += n
    IO["files_hashed"] += 1
    IO["bytes_hashed"] += size
    return {**check.fields(), "size": size}


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def list_files(root: Path, exclude: tuple[str, ...] = ()) -> list[Path]:
    """Files under root, relative, sorted; hidden (temp) entries and `exclude` names skipped."""
    out = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        # `exclude` names entries of root itself: a checkpoint's own manifest.json deeper down is content
        if p.is_file() and not _is_hidden(rel) and rel.parts[0] not in exclude:
            out.append(rel)
    return sorted(out)


def build_manifest(
    root: str | os.PathLike, exclude: tuple[str, ...] = (), hashed: dict[str, dict] | None = None
) -> dict[str, dict]:
    """{relative path: {sha256, size}} of every file under `root`. `hashed`: entries the writer
    computed from the very bytes it wrote (one pass over them instead of writing, then reading
    back), with the checksum it chose (see `checksum`); each is taken as it is once the file on
    disk has that size, the rest are hashed here. Readers re-hash what they read, so an entry that
    did not match the disk would be refused, not trusted."""
    root = Path(root)
    hashed = hashed or {}
    out = {}
    for rel in list_files(root, exclude + (MANIFEST,)):
        size, known = (root / rel).stat().st_size, hashed.get(str(rel))
        if known is not None and known["size"] != size:
            raise OSError(f"{root / rel}: {size} bytes on disk, {known['size']} written")
        out[str(rel)] = dict(known) if known is not None else {"sha256": sha256_file(root / rel), "size": size}
    if set(hashed) - set(out):
        raise OSError(f"{root / sorted(set(hashed) - set(out))[0]}: written, but not there")
    return out


def write_manifest(
    root: str | os.PathLike, exclude: tuple[str, ...] = (), hashed: dict[str, dict] | None = None
) -> dict[str, dict]:
    files = build_manifest(root, exclude, hashed)
    atomic_write_json(Path(root) / MANIFEST, {"files": files})
    return files


def _differs(path: Path, meta: dict) -> bool:
    if "crc32" not in meta:
        return sha256_file(path) != meta["sha256"]
    try:
        return file_entry(path, meta) != meta
    except ValueError:  # a CRC entry without its chunk length: nothing can match it
        return True


def verify_manifest(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> list[str]:
    """Problems found comparing `root` with its manifest (empty list: verified)."""
    root = Path(root)
    try:
        manifest = read_json(root / MANIFEST)
        recorded = None if manifest is None else dict(manifest["files"])
    except (ValueError, TypeError, KeyError):  # torn or damaged: unverified, never a crash
        return [f"{root / MANIFEST}: damaged (not a manifest)"]
    if recorded is None:
        return [f"{root / MANIFEST}: missing"]
    problems = []
    for rel, meta in sorted(recorded.items()):
        p = root / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != meta["size"] or _differs(p, meta):
            problems.append(f"{p}: {checksum_kind(meta)} differs from manifest")
    for rel in list_files(root, exclude + (MANIFEST,)):
        if str(rel) not in recorded:
            problems.append(f"{root / rel}: not in manifest")
    return problems


def file_stats(root: str | os.PathLike, rels) -> dict[str, list[int]]:
    """{relative path: [size, mtime in ns]}: what `check_stats` compares later without reading a byte."""
    root = Path(root)
    return {str(rel): [(st := (root / rel).stat()).st_size, st.st_mtime_ns] for rel in rels}


def _same_mtime(recorded: int, now: int) -> bool:
    """Equal, or equal to the second where one side kept whole seconds only: Lustre's servers store
    seconds (the writing node may have seen nanoseconds), and so do some copy tools (tar's default
    format); an edit made within the same second of completion then goes unnoticed here (audit sees it)."""
    if recorded == now:
        return True
    whole = 10**9
    return (recorded % whole == 0 or now % whole == 0) and recorded // whole == now // whole


def check_stats(
    root: str | os.PathLike, recorded: dict[str, list[int]], exclude: tuple[str, ...] = (), unrecorded: bool = True
) -> list[str]:
    """Problems found comparing the size and mtime of the files under `root` with those recorded at
    completion (`file_stats`), plus (`unrecorded`) files that are not recorded. Reads no content: a
    change that keeps size and mtime (a byte overwritten in place and the mtime set back) is not seen
    here; `verify_manifest` re-hashes."""
    root = Path(root)
    problems = []
    for rel, (size, mtime_ns) in sorted(recorded.items()):
        p = root / rel
        try:
            st = p.stat()
        except FileNotFoundError:
            problems.append(f"{p}: missing")
            continue
        if st.st_size != size or not _same_mtime(mtime_ns, st.st_mtime_ns):
            problems.append(f"{p}: size or mtime changed since the unit completed (not re-hashed; `snowcat audit` re-hashes)")
    for rel in list_files(root, exclude + (MANIFEST,)) if unrecorded else []:
        if str(rel) not in recorded:
            problems.append(f"{root / rel}: not in manifest")
    return problems


def atomic_write_figure(path: str | os.PathLike, fig) -> None:
    """Save a matplotlib figure as PNG atomically, then close it (figures hold memory until closed)."""

    import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib loads only when a figure is drawn)

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


MODEL_CONFIG = "model_config.json"  # what makes a directory a model directory (stages/model/io.py writes it)


def checkpoint_dir(stage_dir: str | os.PathLike, name: str) -> Path:
    """`<stage_dir>/checkpoints/<name>`, a model directory; a plain file there (e.g. `best`) names the
    checkpoint it stands for."""
    root = Path(stage_dir) / "checkpoints"
    path = root / name
    if path.is_file():
        path = root / path.read_text().strip()
    if not (path / MODEL_CONFIG).is_file():
        raise UserError(f"{path}: no such checkpoint (expected a model directory)")
    return path
