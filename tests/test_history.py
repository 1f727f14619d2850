"""Metrics history: committed rows only, torn rows detected, resume replays replace, writers serialised."""

import multiprocessing as mp

import numpy as np
import pytest

from snowcat.pipeline.history import FILENAME, History, _open, _q, check_gaps


def metrics_at(step):
    return {"loss/policy": 1.0 / (step + 1), "reward": step % 3, "lr": 1e-6}


def test_append_read_new_metric_and_slash_names(tmp_path):
    h = History(tmp_path)
    for s in range(3):
        h.append("rl", s, metrics_at(s))
    h.append("rl", 3, {"reward": 5, "eval/pass@1": 0.25})  # a metric appears late, others skipped
    h.append("sft", 0, {"loss": 2.0})
    d = h.read("rl")
    assert (tmp_path / FILENAME).exists() and h.stages() == ["rl", "sft"]
    np.testing.assert_array_equal(d["step"], [0, 1, 2, 3])
    np.testing.assert_allclose(d["loss/policy"], [1, 0.5, 1 / 3, np.nan])
    np.testing.assert_allclose(d["eval/pass@1"], [np.nan, np.nan, np.nan, 0.25])
    np.testing.assert_allclose(d["reward"], [0, 1, 2, 5])
    assert check_gaps(tmp_path) == []
    with pytest.raises(ValueError, match="'lr'"):
        h.append("rl", 4, {"lr": "fast"})


def test_resumed_history_equals_uninterrupted(tmp_path):
    straight = History(tmp_path / "a")
    for s in range(10):
        straight.append("rl", s, metrics_at(s))
    resumed = History(tmp_path / "b")
    for s in range(8):  # crashed after step 7, last checkpoint at step 4
        resumed.append("rl", s, {**metrics_at(s), "reward": -1} if s > 4 else metrics_at(s))
    for s in range(5, 10):  # the replay recomputes 5.. and replaces what the lost attempt logged
        resumed.append("rl", s, metrics_at(s))
    a, b = straight.read("rl"), resumed.read("rl")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_torn_last_row_is_ignored_reported_and_overwritten(tmp_path):
    h = History(tmp_path)
    for s in range(3):
        h.append("rl", s, metrics_at(s))
    with _open(h.path, "a") as f:  # what a kill between row write and commit leaves behind
        g = f[_q("rl")]
        for ds in [g["step"], *g["m"].values()]:
            ds.resize((4,))
            ds[3] = 99
    np.testing.assert_array_equal(h.read("rl")["step"], [0, 1, 2])
    problems = check_gaps(tmp_path)
    assert len(problems) == 1 and "'rl'" in problems[0] and "torn" in problems[0]
    h.append("rl", 3, metrics_at(3))
    np.testing.assert_array_equal(h.read("rl")["step"], [0, 1, 2, 3])
    assert h.read("rl")["reward"][3] == 0 and check_gaps(tmp_path) == []


def test_gaps_and_truncation_name_the_stage(tmp_path):
    h = History(tmp_path)
    for s in (0, 1, 2, 5, 6):
        h.append("probe", s, {"x": s})
    h.append("rl", 0, {"x": 0})
    problems = check_gaps(tmp_path, expected_last={"rl": 3, "sft": 1})
    assert any("'probe'" in p and "step 2 followed by 5" in p for p in problems)
    assert any("'rl'" in p and "ends at step 0" in p and "truncated" in p for p in problems)
    assert any("'sft'" in p and "no rows" in p for p in problems)
    assert len(problems) == 3


def _writer(path, stage, n):
    h = History(path)
    for s in range(n):
        h.append(stage, s, {"v": s * 10})


def test_concurrent_writers_to_different_stages(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, stage, 15)) for stage in ("sft", "rl", "probe")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    h = History(tmp_path)
    for stage in ("sft", "rl", "probe"):
        d = h.read(stage)
        np.testing.assert_array_equal(d["step"], np.arange(15))
        np.testing.assert_array_equal(d["v"], np.arange(15) * 10)
    assert check_gaps(tmp_path) == []


def test_plot(tmp_path):
    h = History(tmp_path)
    for s in range(5):
        h.append("rl", s, metrics_at(s))
    out = h.plot("rl", ["loss/policy", "reward"], tmp_path / "plots" / "rl.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="nope"):
        h.plot("rl", ["nope"], tmp_path / "x.png")


def test_group_without_datasets_after_early_crash(tmp_path):
    h = History(tmp_path)
    with _open(h.path, "a") as f:  # killed right after creating the stage's group
        f.create_group("rl")
    assert len(h.read("rl")["step"]) == 0 and check_gaps(tmp_path) == []
    h.append("rl", 0, {"x": 1.0})
    np.testing.assert_array_equal(h.read("rl")["x"], [1.0])
