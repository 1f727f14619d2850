"""benchmarks.logprob smoke test on CPU at tiny shapes: every requested method gets a row."""

from __future__ import annotations

import json

import pytest

from snowcat.benchmarks.logprob import main


@pytest.mark.slow
def test_benchmark_reports_every_method(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "rows.json"
    methods = ["eager", "torch_lce", "liger", "cce", "reference", "triton"]
    rc = main(
        [
            "--device",
            "cpu",
            "--n",
            "48",
            "--h",
            "16",
            "--v",
            "96",
            "--warmup",
            "1",
            "--iters",
            "1",
            "--methods",
            ",".join(methods),
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == methods
    for name in ("eager", "reference"):
        assert rows[name]["status"] == "ok" and rows[name]["entropy"]
        assert rows[name]["max_dlogp"] < 1e-4 and rows[name]["max_dent"] < 1e-4
        assert rows[name]["ms"] > 0
        assert rows[name]["extra_gib"] is None or rows[name]["extra_gib"] >= 0
    # Anchors that cannot run here are reported, not dropped.
    for name in ("liger", "cce"):
        assert rows[name]["status"] in ("missing", "unavailable") and rows[name]["note"]
    assert rows["triton"]["status"] == "unavailable"
    printed = capsys.readouterr().out
    assert all(name in printed for name in methods) and "N=48 H=16 V=96" in printed
