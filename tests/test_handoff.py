"""Weight handoff: published versions load exactly; torn, unstable or corrupt versions never load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rlcore.handoff import STABLE, HandoffError, WeightHandoff, version_for_batch

REPO = Path(__file__).resolve().parent.parent


def _model(seed: int) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(PRESETS["test-micro"])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_version_for_batch_is_exact_staleness():
    assert [version_for_batch(k, 2) for k in range(5)] == [0, 0, 0, 1, 2]
    assert [version_for_batch(k, 0) for k in range(3)] == [0, 1, 2]


def test_publish_then_load_gives_the_published_weights(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    src, dst = _model(1), _model(2)
    assert not _same(src, dst)
    path = h.publish(3, src)
    assert (path / STABLE).is_file() and h.is_stable(3) and h.versions() == [3]
    h.load_into(dst, 3, timeout_s=1)
    assert _same(src, dst)


def test_unpublished_version_times_out_with_a_clear_error(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    with pytest.raises(HandoffError, match=r"weights step 4 not loadable after .*not published"):
        h.load_into(_model(0), 4, timeout_s=0.2)


def test_version_without_stable_marker_is_never_loaded(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(1, _model(1))
    (h.path(1) / STABLE).unlink()  # as if the publisher died after the rename, before STABLE
    dst = _model(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(HandoffError, match="no STABLE marker"):
        h.load_into(dst, 1, timeout_s=0.2)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())
    h.clean(keep_upto=10)
    assert h.versions() == []  # the trainer's start-up repair drops it (and then republishes)


def test_corrupted_shard_is_never_loaded(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    h.publish(2, _model(1))
    shard = h.path(2) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(HandoffError, match="sha256 differs from manifest"):
        h.load_into(_model(2), 2, timeout_s=0.2)


def test_stopping_while_waiting_is_an_error_not_a_hang(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    with pytest.raises(HandoffError, match="stopped while waiting"):
        h.wait_verified(0, timeout_s=60, should_stop=lambda: True)


def test_prune_and_clean(tmp_path):
    h = WeightHandoff(tmp_path / "weights")
    m = _model(0)
    for v in range(4):
        h.publish(v, m)
    assert h.prune(below=2) == [0, 1] and h.versions() == [2, 3]
    h.clean(keep_upto=2)  # a trainer resumed at step 2 drops the future it will republish
    assert h.versions() == [2]


_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    import snowcat.stages.model as model, snowcat.stages.rlcore.handoff as handoff
    from snowcat.stages.model import PRESETS, MoEForCausalLM
    where, root = sys.argv[1], sys.argv[2]
    real_save, real_write = model.save_model_dir, handoff.atomic_write_text

    def pause(*_):
        print("PAUSED", flush=True)
        time.sleep(600)

    def save(path, model, *a, extra_files=None, **kw):  # pause inside the temp dir, before the manifest
        return real_save(path, model, *a, extra_files={**(extra_files or {}), "x": pause}, **kw)

    def write(path, text):  # pause after the rename, before STABLE
        pause() if path.name == "STABLE" else real_write(path, text)

    if where == "building":
        model.save_model_dir = handoff.save_model_dir = save  # handoff calls the name it imported
    else:
        handoff.atomic_write_text = write
    torch.manual_seed(0)
    handoff.WeightHandoff(root).publish(5, MoEForCausalLM(PRESETS["test-micro"]))
""")


@pytest.mark.parametrize("where", ["building", "before_stable"])
def test_publisher_killed_mid_publish_leaves_nothing_loadable(tmp_path, where):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    root = tmp_path / "weights"
    proc = subprocess.Popen(
        [sys.executable, str(script), where, str(root)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "PAUSED"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    h = WeightHandoff(root)
    assert not h.is_stable(5)
    with pytest.raises(HandoffError):
        h.load_into(_model(1), 5, timeout_s=0.2)
    h.clean(keep_upto=5)
    assert list(root.iterdir()) == []  # temp dir / unstable version gone
    src, dst = _model(0), _model(1)
    h.publish(5, src)  # the resumed trainer republishes; now it loads
    h.load_into(dst, 5, timeout_s=1)
    assert _same(src, dst)
