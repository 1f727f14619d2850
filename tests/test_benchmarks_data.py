"""Smoke tests of the data-movement and trainer-memory benchmarks at tiny sizes: each runs end to
end and writes the fields its committed result has, with positive ratios (no timing is judged)."""

from __future__ import annotations

import json
import shutil

import pytest

from snowcat.benchmarks import handoff, trainer_memory, transport
from snowcat.pipeline import cli
from snowcat.pipeline.errors import UserError


def _positive(x) -> bool:
    return isinstance(x, float | int) and x > 0


def test_handoff_bench_reports_both_rows_and_loads_the_published_weights(tmp_path):
    out = tmp_path / "handoff.json"
    args = ["--hidden", "32", "--layers", "1", "--experts", "2", "--repeats", "2", "--dir", str(tmp_path), "--json", str(out)]
    assert handoff.main(args) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "handoff" and result["machine"]["cpus"] > 0
    (row,) = result["results"]
    assert row["filesystem"] != "unknown" and row["loaded_weights_equal"]
    assert row["bytes"] == sum(row["files"].values()) and "model.safetensors" in row["files"] and "STABLE" in row["files"]
    assert [len(row["runs"][k]) for k in ("handoff", "raw")] == [2, 2]
    assert _positive(row["ratio_raw_over_handoff"]) and all(_positive(v) for v in row["median_s"].values())
    assert set(row["profiled_handoff_s"]) == {label for label, _f, _n in handoff.PHASES}
    assert row["profiled_handoff_s"]["load: read + crc32 the shards into the model"] > 0  # the profile found the phases
    assert _positive(row["sha256_one_core_s"])
    assert [p.name for p in tmp_path.iterdir()] == ["handoff.json"]  # nothing left behind


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_transport_bench_runs_two_ranks_and_receives_intact_batches(tmp_path):
    out = tmp_path / "transport.json"
    assert transport.main(["--batches", "1,3", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mpi"]["OMPI_MCA_btl"] == "self,tcp" and result["batch_check"] == "compiled"
    assert [r["trajectories"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert r["received_equal"] and r["bytes"] > 0 and r["tokens"] >= 256 * r["trajectories"]
        assert [len(r["times_s"][k]) for k in ("typed", "message", "raw")] == [2, 2, 2]
        assert all(_positive(r[f"ratio_raw_over_{k}"]) and _positive(r[f"ratio_of_minimums_{k}"]) for k in ("typed", "message"))
        assert set(r["median_s"]) == {"typed", "message", "raw", "read", "decode", "encode", "write", "arrays"}
        assert all(0 < r["min_s"][k] <= r["median_s"][k] for k in r["min_s"])


def test_transport_batches_look_like_agent_episodes():
    batch = transport.make_batch(4, seed=1)
    assert batch == transport.make_batch(4, seed=1)  # deterministic: both ranks build the same batch
    for t in batch:
        assert 256 <= len(t) <= 2048 and t.routes.shape == (len(t), transport.ROUTE_WIDTH)
        assert len(t.turn_boundaries) == 3 and t.loss_mask.sum() == sum(e - s for s, e in t.turn_boundaries)


@pytest.mark.slow
def test_trainer_memory_bench_reports_each_rank(tmp_path):
    out = tmp_path / "memory.json"
    tiny = ["--hidden", "32", "--layers", "1", "--experts", "2", "--vocab", "256", "--seq", "16"]
    # one allocator (the fixed threshold, the one plan validation reads): each is its own set of child
    # processes, and the default one is measured the same way under another environment
    args = [*tiny, "--modes", "ddp,fsdp", "--stored-dtype", "bfloat16", "--allocator", "fixed", "--json", str(out)]
    assert trainer_memory.main(args) == 0
    result = json.loads(out.read_text())
    assert list(result["results"]) == ["fixed mmap threshold 128 KiB"] and result["model"]["params"] > 0
    for by_mode in result["results"].values():
        ddp = by_mode["ddp"]
        assert [r["rank"] for r in ddp["ranks"]] == [0, 1]
        for r in ddp["ranks"]:
            assert r["start_kib"] <= r["setup_kib"] and _positive(r["step_mib"]) and _positive(r["save_mib"])
            assert r["peak_mib"] == max(r["setup_mib"], r["step_mib"], r["save_mib"])
            assert r["save_added_mib"] == round((r["save_kib"] - r["trained_kib"]) / 1024, 1)
            # from a bf16 directory: fp32 masters and two fp32 moments, whole on every DDP rank
            assert r["master_dtype"] == "torch.float32" and r["state_bytes_per_param"] == pytest.approx(12, rel=0.01)
        # FSDP2 (ZeRO-3) on 2 ranks: half of it each
        assert [r["state_bytes_per_param"] for r in by_mode["fsdp"]["ranks"]] == pytest.approx([6, 6], rel=0.05)
        assert all(ddp[f"{phase}_ratio_to_ddp"] == 1.0 for phase in ("setup", "step", "save", "peak"))


def test_trainer_memory_bench_refuses_unknown_modes(capsys):
    assert cli.main(["bench", "trainer-memory", "--modes", "ddp,zero9"]) == 2  # the CLI name finds trainer_memory.py
    assert "--modes: zero9" in capsys.readouterr().err
    with pytest.raises(UserError, match="ddp first"):
        trainer_memory.main(["--modes", "zero2"])
