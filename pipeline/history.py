"""Per-run metrics history: one append-only HDF5 file, a group per stage, a row per step.

Layout of `<run_dir>/history.h5`:
    /<stage>/            attrs["rows"] = number of committed rows
        step             int64 [rows]
        m/<metric>       float64 [rows]  (NaN where a step did not report that metric)
Names are percent-quoted, so "loss/policy" stays one dataset and not a subgroup.

Commit protocol: a row is written into every dataset first and `rows` is bumped last, then the
file is flushed and fsynced. A crash before the bump leaves datasets one row longer than `rows`:
readers ignore that torn row, `check_gaps` reports it, and the next append overwrites it. (A crash
*inside* the HDF5 library's own metadata write can still damage the file; HDF5 gives no stronger
guarantee without SWMR, which forbids the resizes and new datasets we need.)

Concurrency: HDF5 files are not safe for concurrent writers, and several stages (processes,
possibly on different nodes) append to the same file: every open, read or write, holds the lock
file `history.h5.lock` (fcntl locks: fine on GPFS, needs the `flock` mount option on Lustre).
One writer per stage at a time is assumed: two processes appending to the *same* stage would
interleave rows.

Resume: appending step s when the stage already holds steps >= s (a resumed stage replays from
its last checkpoint) first drops every row from s on, then appends. So the history always shows
the attempt that produced the final weights, and a resumed run's history equals an uninterrupted
one's whenever the stage itself is deterministic.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import quote, unquote

import h5py
import numpy as np
from filelock import FileLock

from snowcat.pipeline.fsio import atomic_write_figure

FILENAME = "history.h5"


def _q(name: str) -> str:
    return quote(name, safe="")


def _open(path: Path, mode: str):
    # our lock serialises access; HDF5's own lock fails on filesystems without fcntl support
    return h5py.File(path, mode, locking="best-effort")


class History:
    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.path = path if path.suffix in (".h5", ".hdf5") else path / FILENAME  # a file or a run dir
        self.lock = FileLock(str(self.path) + ".lock")

    def append(self, stage: str, step: int, metrics: Mapping[str, float]) -> None:
        """Commit one row for `stage` at `step` (see the module docstring for crash and resume rules)."""
        step = int(step)
        row = {}
        for name, v in metrics.items():
            try:
                row[name] = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"history {stage}: metric {name!r} at step {step} is not a number: {v!r}") from None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            with _open(self.path, "a") as f:
                g = f.require_group(_q(stage))
                rows = int(g.attrs.get("rows", 0))
                if "step" not in g:  # also after a crash between creating the group and its datasets
                    g.create_dataset("step", shape=(0,), maxshape=(None,), dtype="i8", chunks=(1024,))
                g.require_group("m")
                if rows and step <= g["step"][rows - 1]:
                    rows = int(np.searchsorted(g["step"][:rows], step))  # replay: drop rows >= step
                m = g["m"]
                for name in row:
                    if _q(name) not in m:
                        m.create_dataset(_q(name), shape=(0,), maxshape=(None,), dtype="f8", chunks=(1024,), fillvalue=np.nan)
                for key, ds in [("step", g["step"])] + [(unquote(k), m[k]) for k in m]:
                    ds.resize((rows + 1,))
                    ds[rows] = step if key == "step" else row.get(key, np.nan)
                f.flush()
                g.attrs["rows"] = rows + 1  # the commit point
                f.flush()
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def stages(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.lock, _open(self.path, "r") as f:
            return sorted(unquote(k) for k in f)

    def read(self, stage: str) -> dict[str, np.ndarray]:
        """{"step": steps, metric: values} of the committed rows (a torn last row is left out)."""
        with self.lock, _open(self.path, "r") as f:
            if _q(stage) not in f:
                raise KeyError(f"{self.path}: no history for stage {stage!r}")
            g = f[_q(stage)]
            rows = int(g.attrs.get("rows", 0))
            out = {"step": g["step"][:rows] if "step" in g else np.zeros(0, dtype=np.int64)}
            out.update({unquote(k): ds[:rows] for k, ds in g["m"].items()} if "m" in g else {})
            return out

    def plot(self, stage: str, metrics: Iterable[str], out_png: str | os.PathLike) -> Path:
        """One panel per metric against step, written atomically as PNG."""
        import matplotlib  # noqa: PLC0415 (matplotlib loads only when a figure is drawn)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib loads only when a figure is drawn)

        data = self.read(stage)
        metrics = list(metrics)
        missing = [m for m in metrics if m not in data]
        if missing:
            raise KeyError(f"{self.path}: stage {stage!r} has no metric {', '.join(missing)}")
        fig, axes = plt.subplots(len(metrics), 1, figsize=(6, 2.2 * len(metrics)), sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], metrics):
            ax.plot(data["step"], data[name], lw=1)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        axes[0, 0].set_title(stage)
        atomic_write_figure(out_png, fig)
        return Path(out_png)


def check_gaps(path: str | os.PathLike, expected_last: Mapping[str, int] | None = None) -> list[str]:
    """Problems with a history file: torn rows, non-contiguous steps, stages ending early.

    `expected_last` maps a stage to the step its history must reach (e.g. the final RL step).
    """
    hist = History(path)
    if not hist.path.exists():
        return [f"{hist.path}: missing"] if expected_last else []
    problems = []
    with hist.lock, _open(hist.path, "r") as f:
        for key in sorted(f):
            stage, g = unquote(key), f[key]
            rows = int(g.attrs.get("rows", 0))
            datasets = ([g["step"]] if "step" in g else []) + (list(g["m"].values()) if "m" in g else [])
            longest = max((len(ds) for ds in datasets), default=0)
            if longest > rows:
                problems.append(f"{hist.path}: stage {stage!r}: torn last row (datasets hold {longest} rows, {rows} committed)")
            steps = g["step"][:rows] if "step" in g else np.zeros(0, dtype=np.int64)
            for i in np.flatnonzero(np.diff(steps) != 1):
                problems.append(f"{hist.path}: stage {stage!r}: step {steps[i]} followed by {steps[i + 1]} (not contiguous)")
    for stage, last in (expected_last or {}).items():
        steps = hist.read(stage)["step"] if stage in hist.stages() else np.array([], dtype=int)
        if not len(steps) or steps[-1] < last:
            got = f"ends at step {steps[-1]}" if len(steps) else "has no rows"
            problems.append(f"{hist.path}: stage {stage!r}: {got}, expected step {last} (truncated)")
    return problems
