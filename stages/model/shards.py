"""Safetensors shards written from and read into tensor memory, checksummed as the bytes pass.

`write_shards(dir, tensors)` writes `model.safetensors` (or `model-0000i-of-0000n.safetensors` +
`model.safetensors.index.json`) straight from each tensor's memory and checksums that same memory
while the shard's fsync waits for the disk: SHA-256 (model directories: their provenance rests on
it) or, for the weight handoff, a CRC-32 per chunk (`fsio.checksum`). The manifest entry of a
shard comes from the bytes handed to `write`, never from reading the file back (the tensors must
not change meanwhile; if they did, the entry would not match the file and readers would refuse
it). It takes the tensors as a stream, in the order given, and holds only the shards not yet
written: a sharded trainer that gathers one weight at a time (`stages.train`'s `whole_tensors`)
never has the whole model at once. `read_shards_into(dir, files, dest)` reads each tensor's bytes
straight into the tensor that receives it (`dest`, e.g. views of a model's parameters) and
checksums them as they land, so the check covers exactly the bytes that end up in the model, in
one pass over the file. Writes and reads go in calls of up to 64 MiB: on the development
machine's ext4 under load, writing in 1 MiB calls took about twice as long.

Shards are independent checksum streams, so both sides take them on parallel threads (hashlib,
zlib and file I/O release the GIL): one SHA-256 stream on one core takes about as long as copying
the bytes, a CRC-32 stream about a third of that. The files
are ordinary safetensors (any reader loads them): the format is 8 bytes of header length, a JSON
header naming each tensor's dtype, shape and byte range, then the data. It is written here rather
than through `safetensors.torch.save_file` because that library hashes nothing and writes in an
order of its own, and read here because `safe_open` hands out tensors of its own instead of
filling the ones given.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from snowcat.pipeline.fsio import CRC32_CHUNK, IO, Crc32Chunks, Sha256, checksum

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

SHARD_BYTES = 256 << 20  # a shard per 256 MiB: parallel hashing for a 0.5 GB model, ~230 files for 30B in bf16
WRITERS = 8  # writer threads at most: enough to keep a parallel filesystem busy; bounds the memory held
_CHUNK = 64 << 20  # a write / read call at most this long (Linux moves < 2 GiB per call)
_MAX_HEADER = 100 << 20  # the limit safetensors readers set

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH = {v: k for k, v in DTYPES.items()}


class ShardMismatch(ValueError):
    """The files do not map one to one onto the receiving tensors (names, shapes, an unknown
    dtype, a header that does not parse): nothing has been written into them."""


def workers(n_files: int) -> int:
    """Threads for `n_files` independent shards: the cores this process may use."""
    return max(1, min(n_files, len(os.sched_getaffinity(0))))


def _bytes(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a flat byte view (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data: memoryview) -> None:
    for at in range(0, len(data), _CHUNK):
        chunk = data[at : at + _CHUNK]
        while chunk:
            chunk = chunk[os.write(fd, chunk) :]


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    entries, at = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned, as safetensors pads it
    return len(head).to_bytes(8, "little") + head


def _write_one(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], check: str) -> dict:
    """One safetensors file, written and fsynced; its manifest entry from the bytes written (the
    same memory, checksummed while the fsync waits for the disk): SHA-256, or CRC-32 chunks
    (`check` "crc32")."""
    parts = [memoryview(_header(tensors, metadata)), *(_bytes(t) for t in tensors.values())]
    checker = Crc32Chunks(CRC32_CHUNK) if check == "crc32" else Sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        for data in parts:
            _write_all(fd, data)
        with ThreadPoolExecutor(1) as sync:
            synced = sync.submit(os.fsync, fd)
            for data in parts:
                checker.update(data)
            synced.result()
    finally:
        os.close(fd)
    return {**checker.fields(), "size": sum(len(d) for d in parts)}


def write_shards(
    dir: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int | None = None, check: str = "sha256"
) -> dict[str, dict]:
    """Write `tensors`, (name, tensor) pairs in the order they come, as safetensors shards of about
    `shard_bytes` (default `SHARD_BYTES`) into `dir` (a directory being built under `atomic_dir`),
    each file fsynced. A full shard goes to a writer thread while the next one fills; at most one
    shard per thread (`WRITERS` at most) is held, so memory stays bounded whatever the model's
    size or the node's core count. Returns the manifest entries {name: {sha256, size}} of every
    file written, the index included; `check` "crc32": the shards' entries are
    {crc32, crc32_chunk, size} (`fsio.checksum`; the index keeps its SHA-256)."""
    if check not in ("sha256", "crc32"):
        raise ValueError(f"check {check!r}: sha256 or crc32")
    dir, shard_bytes = Path(dir), shard_bytes or SHARD_BYTES
    threads = min(WRITERS, len(os.sched_getaffinity(0)))
    parts: list[list[str]] = []  # the tensor names of each shard, in file order
    written, waited = [], 0
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    with ThreadPoolExecutor(threads) as pool:

        def hand_over() -> None:
            nonlocal waited
            # named by position until the count is known (renamed below): the files' bytes do not depend on it
            part = dir / f".part-{len(parts):05d}"
            written.append(pool.submit(_write_one, part, dict(shard), {"format": "pt"}, check))
            parts.append(list(shard))
            shard.clear()
            while len(written) - waited > threads:  # shards held: at most one per writer thread
                written[waited].result()
                waited += 1

        for name, t in tensors:
            t = t.detach().contiguous().cpu()
            n = t.numel() * t.element_size()
            if shard and size + n > shard_bytes:
                hand_over()
                size = 0
            shard[name] = t
            size += n
            total += n
        if shard or not parts:
            hand_over()
        entries_by_part = [f.result() for f in written]
    names = [SINGLE] if len(parts) == 1 else [f"model-{i:05d}-of-{len(parts):05d}.safetensors" for i in range(1, len(parts) + 1)]
    for i, name in enumerate(names):
        os.replace(dir / f".part-{i:05d}", dir / name)
    entries = dict(zip(names, entries_by_part))
    IO.update(files_written=len(entries), bytes_written=sum(e["size"] for e in entries.values()), fsyncs=len(entries))
    if len(parts) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, keys in zip(names, parts) for k in keys}}
        entries[INDEX] = write_file(dir / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    return entries


def write_file(path: Path, data: bytes) -> dict:
    """A small file of a directory being built under `atomic_dir`: written, fsynced, and its
    manifest entry from the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    IO.update(files_written=1, bytes_written=len(data), fsyncs=1)
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


# -- reading ------------------------------------------------------------------------------------


def _plan(path: Path, dest: dict[str, torch.Tensor]) -> tuple[bytes, list[tuple[str, int, torch.dtype]], int]:
    """(the header's bytes, [(tensor name, data length, file dtype)] in file order, data length):
    what reading `path` into `dest` takes. ShardMismatch unless every tensor of the file goes to a
    `dest` tensor of its shape and the tensors tile the data without gaps."""
    with open(path, "rb", buffering=0) as f:  # unbuffered: no byte past the header is read twice
        prefix = f.read(8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < n <= _MAX_HEADER:
            raise ShardMismatch(f"{path}: no safetensors header")
        head = f.read(n)
    try:
        entries = json.loads(head)
        entries.pop("__metadata__", None)
        spans = sorted((tuple(e["data_offsets"]), name, e["dtype"], tuple(e["shape"])) for name, e in entries.items())
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ShardMismatch(f"{path}: header does not parse ({e})") from e
    plan, at = [], 0
    for (begin, end), name, dtype, shape in spans:
        target = dest.get(name)
        if target is None or dtype not in _TORCH or tuple(target.shape) != shape:
            raise ShardMismatch(f"{path}: tensor {name} ({dtype} {list(shape)}) has no receiving tensor of that shape")
        if begin != at or end - begin != target.numel() * _TORCH[dtype].itemsize:
            raise ShardMismatch(f"{path}: tensor {name} at bytes {begin}-{end} does not follow the one before")
        plan.append((name, end - begin, _TORCH[dtype]))
        at = end
    return prefix + head, plan, at


def _read_checked(f, view: memoryview, check, path: Path) -> None:
    """Fill `view` from `f`, checksumming each read's bytes as they land."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got : got + _CHUNK])
        if not n:
            raise EOFError(f"{path}: ends {len(view) - got} bytes early")
        check.update(view[got : got + n])
        got += n


def _read_one(path: Path, prefix: bytes, plan, dest: dict[str, torch.Tensor], like: dict | None) -> dict:
    """Read one planned file into `dest`; its manifest entry as read, with the checksum `like` records."""
    check, size = checksum(like), len(prefix)
    check.update(prefix)
    with open(path, "rb", buffering=0) as f:
        f.seek(size)
        for name, nbytes, dtype in plan:
            target = dest[name]
            direct = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
            into = target if direct else torch.empty(target.shape, dtype=dtype)
            _read_checked(f, _bytes(into), check, path)
            size += nbytes
            if not direct:
                target.copy_(into)
        rest = f.read()  # bytes past the last tensor make the entry differ from the manifest's
        check.update(rest)
        size += len(rest)
    return {**check.fields(), "size": size}


def read_shards_into(
    dir: str | os.PathLike, files: list[str], dest: dict[str, torch.Tensor], like: dict[str, dict] | None = None
) -> dict[str, dict]:
    """Read the safetensors `files` of `dir` into the tensors of `dest` (every one of them must
    be covered exactly once) and return {file: manifest entry} of the bytes read, for the caller
    to compare with its manifest: each file checksummed as `like[file]` (its manifest entry)
    records, SHA-256 by default. A tensor is read straight into its `dest` tensor when that is a
    contiguous CPU tensor of the file's dtype, otherwise through a temporary one (copy_ converts
    dtype and device). ShardMismatch, raised before anything is written into `dest`, when the
    files do not map onto it; after that `dest` holds whatever the files held, checked or not.
    ValueError (nothing written either) when an entry of `like` names no usable checksum."""
    dir, like = Path(dir), like or {}
    for name in files:
        checksum(like.get(name))
    plans = {name: _plan(dir / name, dest) for name in files}
    seen = [t for _, plan, _ in plans.values() for t, _, _ in plan]
    if len(seen) != len(set(seen)) or set(seen) != set(dest):
        missing = sorted(set(dest) - set(seen))
        what = f"tensor {missing[0]} is in none of them" if missing else "a tensor is in more than one"
        raise ShardMismatch(f"{dir}: {len(files)} safetensors files for {len(dest)} tensors: {what}")
    with ThreadPoolExecutor(workers(len(files))) as pool:
        got = dict(zip(files, pool.map(lambda n: _read_one(dir / n, plans[n][0], plans[n][1], dest, like.get(n)), files)))
    IO.update(files_hashed=len(got), bytes_hashed=sum(e["size"] for e in got.values()))
    return got
