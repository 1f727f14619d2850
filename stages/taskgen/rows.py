"""Reading the row files task sets are published as, and what a task set's source files hash to.

Row sets are JSONL, JSON (a list of rows) or parquet files. Every error is one `TaskImportError`
naming the file, the row (1-based; a JSONL file's line) and the field, so a set is imported whole
or not at all and the user is told where to look.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from snowcat.pipeline.fsio import sha256_file

ROW_SUFFIXES = (".jsonl", ".json", ".parquet")
SOURCES = "sources.json"  # the tasks stage's record of its imports' sources (format, path, sha256, counts)


class TaskImportError(ValueError):
    """A task that cannot be imported; the message names the file (and row or task dir) and the field."""


def read_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a JSONL, JSON (a list of objects) or parquet file; `where` is
    `<file>:<row>` (1-based; a JSONL file's line). Parquet is read offline with `datasets`
    (`load_dataset("parquet", data_files=...)`); JSON and JSONL with `json`, because pyarrow's JSON
    reader turns ISO dates (`created_at`) into datetimes without their zone and refuses a column
    whose type differs between rows (FAIL_TO_PASS as a list in one row, a JSON string in another)."""
    path = Path(path)
    if path.suffix not in ROW_SUFFIXES:
        raise TaskImportError(f"{path}: not a row file (expected {', '.join(ROW_SUFFIXES)})")
    if path.suffix == ".parquet":
        yield from ((f"{path}:{n}", row) for n, row in enumerate(_load_parquet(path), 1))
        return
    text = _text(path)
    if path.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                yield f"{path}:{n}", _object(line, f"{path}:{n}")
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskImportError(f"{path}: not JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(rows, list):
        raise TaskImportError(f"{path}: not a JSON list of rows")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise TaskImportError(f"{path}:{n}: not a JSON object")
        yield f"{path}:{n}", row


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskImportError(f"{path}: unreadable: {e}") from None


def _object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskImportError(f"{where}: not JSON: {e.msg}") from None
    if not isinstance(row, dict):
        raise TaskImportError(f"{where}: not a JSON object")
    return row


def _load_parquet(path: Path) -> list[dict]:
    import datasets  # noqa: PLC0415 (heavy: only where parquet is read)

    cache = tempfile.mkdtemp(prefix="snowcat-import-")  # nothing left in the user's HF cache
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True)
        return [{k: _plain(v) for k, v in row.items()} for row in ds.to_list()]
    except Exception as e:  # datasets/pyarrow raise many kinds for a bad file
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TaskImportError(f"{path}: unreadable as parquet: {detail[:300]}") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if bars:
            datasets.utils.enable_progress_bars()


def _plain(value):
    """A parquet timestamp as the ISO string the JSON form of the set carries."""
    return value.isoformat() if isinstance(value, datetime.date) else value


def require(row: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [k for k in fields if row.get(k) in (None, "", [])]
    if missing:
        raise TaskImportError(f"{where}: missing {', '.join(missing)}")


def source_sha256(path: str | Path) -> str:
    """The sha256 of a task set's source: a file's bytes; for a directory (Harbor tasks), of every
    file under it as `<relative path>\0<sha256 of its bytes>\n` lines in path order, so a renamed,
    added or changed file changes it."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    lines = [f"{p.relative_to(path).as_posix()}\0{sha256_file(p)}\n" for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()
