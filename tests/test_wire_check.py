"""The compiled check of a received trajectory batch (stages/agent/_wire.c) accepts exactly the
messages the Python checks accept, gives the reader what they give, and is not used when it was
built from another source. (tests/test_transport.py runs every reading test under both.)"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from snowcat.benchmarks.transport import make_batch as ascii_batch
from snowcat.stages.agent import FIELDS, TrajectoryBatch, trajectory
from snowcat.stages.agent.trajectory import _built_for_this_source, _scan
from tests.test_transport import agent_records, routed_alike

_HEAD = 4 + len(FIELDS)


def _bases() -> dict[str, np.ndarray]:
    """Messages of every kind the reader meets: segments, a teacher's episode, kept supports and none,
    routes and none, UTF-8 strings and ASCII ones, no records at all, many records."""
    return {
        "segments": TrajectoryBatch.write(1, agent_records(1)).buffer,
        "many": TrajectoryBatch.write(2, agent_records(2, 40)).buffer,
        "empty": TrajectoryBatch.write(3, []).buffer,
        "one policy": TrajectoryBatch.of(4, routed_alike(4)).buffer,
        "ascii": TrajectoryBatch.of(5, ascii_batch(6, seed=5, min_tokens=12, max_tokens=40)).buffer,
        "ascii, supports": TrajectoryBatch.of(
            6,
            [
                dataclasses.replace(t, support_lengths=np.ones(len(t), np.int32), support_ids=np.arange(len(t)))
                for t in ascii_batch(3, seed=6, min_tokens=8, max_tokens=20)
            ],
        ).buffer,
    }


BASES = _bases()
# the columns the checks read (the others' values are free), and values that sit on their edges
CHECKED = ("token_offsets", "turn_offsets", "string_offsets", "route_width", "segment", "status", "segment_kind", "source")
CHECKED += ("support_lengths", "strings")
EDGES = (-(2**63), -(2**31), -1, 0, 1, 2, 3, 4, 8, 127, 128, 255, 2**31 - 1, 2**40, 2**62, 2**63 - 1)


def _python(buf):
    try:
        return _scan(buf)
    except ValueError as e:
        return str(e)


def _fields(t) -> dict:
    """A record's fields, arrays as their bytes (a changed byte may make a NaN, unequal to itself)."""
    out = {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in vars(t).items() if k != "earlier"}
    return out | {"earlier": [_fields(r) for r in t.earlier]}


def _read(buf):
    """What the reader gives: the batch's episodes, or its error."""
    try:
        return [_fields(t) for t in TrajectoryBatch.read(buf)]
    except ValueError as e:
        return str(e)


def _mutate(data, buf: np.ndarray) -> np.ndarray:
    """A copy of `buf` with one to three changes: a header word, an entry of a checked column, the
    padding after a coded column or a byte anywhere, to a value near its own or on an edge."""
    buf = buf.copy()
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(("header", "column", "padding", "byte")))
        if where == "byte":
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
            continue
        try:
            batch = TrajectoryBatch.read(buf)
        except ValueError:  # an earlier change broke it: change its header or any byte
            where = "header"
        if where == "header":
            words, i = buf[: 8 * _HEAD].view(np.int64), data.draw(st.integers(0, _HEAD - 1))
        else:
            name = data.draw(st.sampled_from(CHECKED[5:8] if where == "padding" else CHECKED))
            column = batch.column(name)
            at = column.ctypes.data - buf.ctypes.data
            if where == "padding":
                words, i = buf, at + len(column) + data.draw(st.integers(0, 7))
                if i >= at + ((len(column) + 7) & -8):
                    continue
            elif not len(column):
                continue
            else:
                words, i = column, data.draw(st.integers(0, len(column) - 1))
        info = np.iinfo(words.dtype)
        value = data.draw(st.one_of(st.sampled_from(EDGES), st.integers(-3, 3).map(lambda d, v=int(words[i]): v + d)))
        words[i] = min(max(value, info.min), info.max)
    return buf


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_check_accepts_exactly_what_the_python_checks_accept(data):
    """Over damaged messages of every kind: either both refuse (the reader then raises the Python
    checks' error) or both accept with the same header, columns, episode starts and strings."""
    buf = _mutate(data, BASES[data.draw(st.sampled_from(sorted(BASES)))])
    compiled, python = trajectory._wire.scan(buf), _python(buf)
    assert (compiled is None) == isinstance(python, str), (compiled, python)
    event("refused" if compiled is None else "accepted")  # (pytest --hypothesis-show-statistics: both occur)
    if compiled is not None:
        assert compiled[:6] == python[:6]  # header, offsets, widths, segments
        assert (compiled[6] is None) == (python[6] is None) and (compiled[6] is None or list(compiled[6]) == python[6])
        assert compiled[7] is None or compiled[7].isascii()  # strings: one str where ASCII, else the reader's
    with_compiled = _read(buf)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(trajectory, "_scan_compiled", None)
        assert _read(buf) == with_compiled


@pytest.mark.parametrize("name", sorted(BASES))
def test_an_intact_message_of_every_kind_is_accepted_by_both(name, monkeypatch):
    buf = BASES[name]
    compiled = trajectory._wire.scan(buf)
    assert compiled is not None and compiled[:6] == _scan(buf)[:6]
    assert (compiled[7] is not None) == (name.startswith("ascii") or name == "empty")  # one str where ASCII
    assert (compiled[6] is not None) == (name in ("segments", "many"))  # episode starts where records are segments
    batch = TrajectoryBatch.read(buf)
    monkeypatch.setattr(trajectory, "_scan_compiled", None)
    assert TrajectoryBatch.read(buf) == batch and len(batch) == len(TrajectoryBatch.read(buf))


def test_any_buffer_and_alignment_is_read_and_a_non_buffer_is_refused():
    buf = BASES["ascii"]
    moved = np.concatenate([np.zeros(3, np.uint8), buf])[3:]  # not 8-byte aligned
    assert moved.ctypes.data % 8 and trajectory._wire.scan(moved)[:6] == trajectory._wire.scan(buf)[:6]
    assert trajectory._wire.scan(buf.tobytes())[:6] == trajectory._wire.scan(buf)[:6]
    assert trajectory._wire.scan("not a buffer") is None and trajectory._wire.scan(buf[:-8]) is None


def test_the_test_install_built_the_compiled_check():
    """.ci/setup.sh's editable install compiles it: the tests above are not checking the Python path twice."""
    assert trajectory.compiled_check() == "compiled"


@pytest.mark.parametrize(
    "change", [{"REVISION": 0}, {"WIRE_VERSION": 3}, {"MAGIC": 0}, {"FIELDS": ()}, {"CODES": (4, 2, 4)}], ids=str
)
def test_a_build_from_another_source_is_not_used(change, monkeypatch):
    """An editable checkout updated without reinstalling keeps the old build: the reader checks in
    Python then, and `compiled_check` (doctor, the benchmark) says why."""
    wire = trajectory._wire
    assert _built_for_this_source(wire)
    keys = ("REVISION", "WIRE_VERSION", "MAGIC", "FIELDS", "CODES")
    stale = SimpleNamespace(**({k: getattr(wire, k) for k in keys} | change), __file__="/x/_wire.so")
    assert not _built_for_this_source(stale)
    monkeypatch.setattr(trajectory, "_wire", stale)
    assert trajectory.compiled_check() == "python (/x/_wire.so was built from another source: reinstall snowcat)"
    monkeypatch.setattr(trajectory, "_wire", None)
    assert trajectory.compiled_check().startswith("python (the compiled check was not built")
