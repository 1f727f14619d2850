"""Publishing and loading a weight version through the handoff against a raw copy of the same bytes.

    snowcat bench handoff [--hidden 512 --layers 8 --experts 16] [--repeats 3] [--dir DIR ...] [--json FILE]

In a fresh process, per directory (default: the system temp directory; name several to compare
filesystems, e.g. a disk and /dev/shm), `--repeats` times each, in rotating order:
  - `handoff`: `WeightHandoff.publish` (HF-named views of the parameters, safetensors shards
    written straight from them with a CRC-32 per 16 MiB taken of each piece just before its write,
    one fsync per file, manifest, one rename into place, `STABLE`) then `load_into` a second model
    (the small files verified, each shard read straight into the parameters and checked piece by
    piece as it lands, compared with the manifest);
  - `handoff-sha256`: the same with SHA-256 over the shards instead (what the handoff took before:
    the cost of a cryptographic hash of every byte, twice);
  - `raw`: the very files the handoff wrote, held in memory, written to the same filesystem
    (write + fsync each, fsync the directory) and read back into memory allocated beforehand (as
    the handoff reads into the parameters).
Reports the median of each and `raw / handoff` (1.0: the handoff costs nothing beyond moving the
bytes), the ratio the handoff is judged by (>= 0.9 on every filesystem): the last line prints it.
Reads come from the page cache in all rows (nothing drops caches). One extra, profiled publish +
load says where the handoff's time goes (the main thread's view: the shards' threads show as the
calls that wait for them), and SHA-256 and CRC-32 of the same bytes on one core say what a pass of
each costs. The record names the machine, the commit (and whether the measured files differ from
it) and the load average before and after.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from snowcat.benchmarks import revision, run_python
from snowcat.benchmarks.trainer_memory import bench_model
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.provenance import host_state
from snowcat.stages.model import MoEForCausalLM
from snowcat.stages.rlcore.handoff import WeightHandoff

# (label, file suffix, function name) of the profiled phases; cumulative seconds, so nested phases
# are parts of the ones around them.
PHASES = (
    # the publisher's views are made as write_shards takes them, so its row counts them
    ("load: HF-named views of the parameters", "stages/model/io.py", "hf_state_dict"),
    ("publish: write + crc32 + fsync the shards", "stages/model/shards.py", "write_shards"),
    ("publish: configs (written, hashed, fsynced)", "stages/model/shards.py", "write_file"),
    ("publish: manifest from the writers' hashes", "pipeline/fsio.py", "write_manifest"),
    ("publish: fsync the tree before the rename", "pipeline/fsio.py", "_fsync_tree"),
    ("load: read + crc32 the shards into the model", "stages/model/shards.py", "read_shards_into"),
    ("load: the shards' headers", "stages/model/shards.py", "_plan"),
)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    real = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, mount, fstype = line.split()[:3]
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


# the code this benchmark measures: the record says whether it differs from the commit named
MEASURED = ("stages/rlcore/handoff.py", "stages/model/shards.py", "pipeline/fsio.py", "benchmarks/handoff.py")
ROWS = ("handoff", "handoff-sha256", "raw")


def handoff_once(root: Path, step: int, model, target, check: str = "crc32") -> tuple[float, float]:
    handoff = WeightHandoff(root, check=check)
    t0 = time.perf_counter()
    handoff.publish(step, model)
    t1 = time.perf_counter()
    handoff.load_into(target, step, timeout_s=60)
    return t1 - t0, time.perf_counter() - t1


def raw_once(root: Path, files: dict[str, bytes], sinks: dict[str, np.ndarray]) -> tuple[float, float]:
    """Write + fsync each file and the directory, then read every file back into its sink: memory
    that exists already, as the handoff reads into the parameters (a fresh buffer would add page
    faults to the raw row, and hand freed memory back for the next row to fault in again)."""
    for sink in sinks.values():
        sink.fill(0xFF)  # so the comparison below sees what the read put there
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    for name, data in files.items():
        with open(root / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t1 = time.perf_counter()
    for name, sink in sinks.items():
        with open(root / name, "rb", buffering=0) as f:
            view, got = memoryview(sink), 0
            while got < len(view) and (n := f.readinto(view[got:])):  # a short file fails the comparison below
                got += n
    t2 = time.perf_counter()
    assert all(sink.tobytes() == files[name] for name, sink in sinks.items())
    return t1 - t0, t2 - t1


def profile_phases(root: Path, model, target) -> dict[str, float]:
    prof = cProfile.Profile()
    prof.enable()
    handoff_once(root, 0, model, target)
    prof.disable()
    found = {}
    for (file, _line, func), (_cc, _nc, _tt, cumulative, _callers) in pstats.Stats(prof).stats.items():
        for label, suffix, name in PHASES:
            if func == name and file.replace(os.sep, "/").endswith(suffix):
                found[label] = found.get(label, 0.0) + cumulative
    return {label: round(found.get(label, 0.0), 3) for label, _s, _n in PHASES}


def measure(base: Path, model, target, repeats: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="snowcat-handoff-", dir=base))
    try:
        first = WeightHandoff(work / "weights").publish(0, model)
        files = {p.name: p.read_bytes() for p in sorted(first.iterdir()) if p.is_file()}
        sinks = {name: np.empty(len(data), np.uint8) for name, data in files.items()}
        shutil.rmtree(work / "weights")
        os.sync()
        rows = {kind: [] for kind in ROWS}
        for r in range(repeats):
            for kind in ROWS[r % 3 :] + ROWS[: r % 3]:  # each row first, second and last in turn
                where = work / f"{kind}-{r}"
                if kind == "raw":
                    write_s, read_s = raw_once(where, files, sinks)
                else:
                    write_s, read_s = handoff_once(where, r, model, target, "sha256" if kind == "handoff-sha256" else "crc32")
                rows[kind].append(
                    {"write_s": round(write_s, 4), "read_s": round(read_s, 4), "total_s": round(write_s + read_s, 4)}
                )
                shutil.rmtree(where)
                # commit the deletion now (on a disk mounted with `discard`, the trim of 0.5 GB):
                # otherwise the next row's writes and fsyncs pay for it, whichever row that is
                os.sync()
        phases = profile_phases(work / "profiled", model, target)
        t0 = time.perf_counter()
        for data in files.values():
            hashlib.sha256(data).hexdigest()
        sha256_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for data in files.values():
            zlib.crc32(data)
        crc32_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    median = {kind: statistics.median(x["total_s"] for x in runs) for kind, runs in rows.items()}
    return {
        "dir": str(base),
        "filesystem": filesystem(base),
        "bytes": sum(len(d) for d in files.values()),
        "files": {name: len(d) for name, d in files.items()},
        "runs": rows,
        "median_s": {kind: round(v, 4) for kind, v in median.items()},
        "median_write_s": {kind: round(statistics.median(x["write_s"] for x in runs), 4) for kind, runs in rows.items()},
        "median_read_s": {kind: round(statistics.median(x["read_s"] for x in runs), 4) for kind, runs in rows.items()},
        "ratio_raw_over_handoff": round(median["raw"] / median["handoff"], 3),
        "ratio_raw_over_handoff_sha256": round(median["raw"] / median["handoff-sha256"], 3),
        "loaded_weights_equal": same,
        "profiled_handoff_s": phases,
        "sha256_one_core_s": round(sha256_s, 4),
        "crc32_one_core_s": round(crc32_s, 4),
    }


def run(shape: dict, dirs: list[str], repeats: int) -> dict:
    """The measurements, in the child process (see CHILD)."""
    cfg = bench_model(shape["hidden"], shape["layers"], shape["experts"], vocab=32768, seq=2048)  # as trainer-memory's
    torch.manual_seed(0)
    model, target = MoEForCausalLM(cfg), MoEForCausalLM(cfg)
    results = [measure(Path(d), model, target, repeats) for d in dirs]
    return {"model": cfg.to_dict() | {"params": model.num_params()}, "torch": torch.__version__, "results": results}


# Measured in a fresh process with OpenMP threads that sleep when idle, as every stage runs
# (pipeline/executors/local.py, the Slurm batch scripts): spinning threads make torch's many small
# copies while loading several times slower when another process holds the other core.
CHILD = r"""
import json, sys
from snowcat.benchmarks.handoff import run
print(json.dumps(run(**json.loads(sys.argv[1]))))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench handoff", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each row per directory (median reported)")
    ap.add_argument("--dir", action="append", type=Path, help="where to write (repeatable; default: the temp directory)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    shape = {"hidden": args.hidden, "layers": args.layers, "experts": args.experts}
    dirs = [str(d) for d in args.dir or [Path(tempfile.gettempdir())]]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load_before = os.getloadavg()
    measured = run_python(CHILD, json.dumps({"shape": shape, "dirs": dirs, "repeats": args.repeats}))
    load_after = os.getloadavg()
    results = measured["results"]
    print(
        f"model: {measured['model']['params'] / 1e6:.0f} M parameters (fp32), {args.layers} layers, {args.experts} experts,"
        f" hidden {args.hidden}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    )
    for r in results:
        print(
            f"\n{r['dir']} ({r['filesystem']}): {r['bytes'] / 2**20:.0f} MiB in {len(r['files'])} files, median of {args.repeats}"
        )
        for kind in ROWS:
            print(
                f"  {kind:14s} write {r['median_write_s'][kind]:7.3f} s  read {r['median_read_s'][kind]:7.3f} s"
                f"  total {r['median_s'][kind]:7.3f} s"
            )
        print(
            f"  raw / handoff: {r['ratio_raw_over_handoff']:.2f}x  (with SHA-256: {r['ratio_raw_over_handoff_sha256']:.2f}x;"
            f" loaded weights equal: {r['loaded_weights_equal']})"
        )
        print("  where one profiled handoff spends its time (cumulative s):")
        for label, s in r["profiled_handoff_s"].items():
            print(f"    {label:<48s} {s:7.3f}")
        print(
            f"  one pass over the same bytes on one core: sha256 {r['sha256_one_core_s']:.3f} s, crc32 {r['crc32_one_core_s']:.3f} s"
            " (the handoff takes two: publish and load)"
        )
    host, rev = host_state(probe_gpu=False), revision(MEASURED)
    machine = {k: host[k] for k in ("hostname", "platform", "cpu_model", "memory_bytes")}
    machine |= {"cpus": host["cpu_count"], "torch": measured["torch"]}
    print(
        f"\n{host['cpu_model']}, {host['cpu_count']} cpus; commit {(rev['commit'] or '?')[:12]}"
        + (f" + uncommitted {', '.join(rev['uncommitted'])}" if rev["uncommitted"] else "")
        + f"; load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}"
    )
    judged = ", ".join(f"{r['filesystem']} {r['dir']} {r['ratio_raw_over_handoff']:.2f}x" for r in results)
    print(f"raw / handoff (goal >= 0.9x on each): {judged}")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "benchmark": "handoff",
                "what": __doc__.splitlines()[0],
                "machine": machine,
                "revision": rev,
                "environment": {"OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"]},
                "load_average_1min": {"before": load_before[0], "after": load_after[0]},
                "model": measured["model"],
                "repeats": args.repeats,
                "results": results,
                "command": " ".join(["snowcat", "bench", "handoff", *(argv if argv is not None else sys.argv[1:])]),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
