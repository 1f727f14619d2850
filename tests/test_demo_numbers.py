"""The numbers a user is promised are the numbers measured: README.md, configs/demo.yaml and the
docs quote the committed multi-seed demo benchmark (`snowcat bench demo --seeds 3`,
benchmarks/results/demo-cpu-3seeds.json) exactly as `benchmarks.demo.quote` renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snowcat.benchmarks.demo import HEADLINE, RESULTS, quote

REPO = Path(__file__).resolve().parent.parent
QUOTED_IN = {
    "README.md": list(HEADLINE),
    "configs/demo.yaml": [
        "sft/val_greedy_pass@1/closure",
        "sft/val_greedy_pass@1/arith",
        "eval/rl:final - sft:final/all/pass@1_diff",
    ],
    "docs/training.md": ["sft/val_greedy_pass@1/closure", "sft/val_greedy_pass@1/arith"],
    "docs/rl.md": [
        "eval/rl:final - sft:final/all/pass@1_diff",
        "eval/rl:final - sft:final/all/pass@1_diff_se",
        "eval/rl:best/all/pass@1",
    ],
}


def test_results_cover_three_seeds_and_name_the_machine():
    results = json.loads(RESULTS.read_text())
    assert len(results["seeds"]) >= 3
    assert results["machine"]["cpu_model"] and results["machine"]["cpu_flags"]
    for key in HEADLINE:
        assert results["summary"][key]["n"] == len(results["seeds"]), key


@pytest.mark.parametrize("doc", sorted(QUOTED_IN))
def test_docs_quote_the_measured_numbers(doc):
    summary = json.loads(RESULTS.read_text())["summary"]
    text = " ".join((REPO / doc).read_text().split())
    text = text.replace(" # ", " ")  # YAML comments wrap lines
    for key in QUOTED_IN[doc]:
        assert quote(summary[key]) in text, f"{doc} does not quote {key} as measured: {quote(summary[key])}"


@pytest.mark.parametrize("doc", sorted(QUOTED_IN))
def test_docs_name_the_machine_the_numbers_are_from(doc):
    """Numbers differ between CPU generations: where a doc quotes them, it names the CPU the file records."""
    machine = json.loads(RESULTS.read_text())["machine"]
    text = " ".join((REPO / doc).read_text().split()).replace(" # ", " ")
    assert machine["cpu_model"] in text, f"{doc} does not name {machine['cpu_model']}"
    has_amx = any(f.startswith("amx") for f in machine["cpu_flags"])
    assert ("no AMX" in text) is not has_amx, f"{doc}: AMX {'present' if has_amx else 'absent'} on the measured CPU"


AGENT_RESULTS = REPO / "benchmarks" / "results" / "agent-demo-cpu-1seed.json"


def test_agent_demo_numbers_in_the_docs_are_the_committed_run():
    """docs/agents.md quotes the earlier config's one run (3 decimals): every figure of its table and text."""
    results = json.loads(AGENT_RESULTS.read_text())
    assert results["config"] == "configs/agent-demo.yaml" and results["machine"]["cpu_model"]
    (rows,) = results["per_seed"].values()
    text = (REPO / "docs" / "agents.md").read_text()
    section = text[text.index("## The agent demo, measured") :].split("\n## ")[0]
    for ref in ("sft:final", "rl:final"):
        for key in (
            f"eval/{ref}/all/pass@1",
            f"eval/{ref}/swe_mini/d1/pass@1",
            f"eval/{ref}/swe_mini/d3/pass@1",
            f"eval/{ref}/bug_kind/wrong_default/pass_rate",
            f"eval/{ref}/bug_kind/wrong_operator/pass_rate",
            f"eval/{ref}/agent/invalid_actions_per_episode",
            f"eval/{ref}/agent/no_submission_frac",
            f"eval/{ref}/agent/claim_precision",
        ):
            assert f"{rows[key]:.3f}" in section, key
    for key in ("probe/pass_rate", "eval/rl:final - sft:final/all/pass@1_diff", "eval/rl:final - sft:final/all/pass@1_diff_se"):
        assert f"{rows[key]:.3f}" in section, key


AGENT_SEEDS = REPO / "benchmarks" / "results" / "agent-demo-3seeds.json"


def test_the_agent_demo_holds_its_gate_on_three_seeds_and_the_docs_quote_each():
    """configs/agent-demo.yaml as committed, seeds 1234-1236 (issue 39: RL over SFT by more than 2 paired
    SE on each): the committed runs hold the gate, and docs/agents.md and the config's header quote every
    seed's SFT and RL held-out pass@1, the gain and its SE (3 decimals)."""
    results = json.loads(AGENT_SEEDS.read_text())
    assert results["config"] == "configs/agent-demo.yaml" and results["overrides"] == [] and results["machine"]["cpu_model"]
    assert results["seeds"] == [1234, 1235, 1236]
    (gate,) = results["gates"]
    assert (gate["key"], gate["how"], gate["threshold"]) == ("eval/rl:final - sft:final/all/pass@1_diff/z", "above", 2.0)
    assert sorted(gate["held"]) == ["1234", "1235", "1236"] and all(gate["held"].values())
    text = (REPO / "docs" / "agents.md").read_text()
    section = text[text.index("## The agent demo, measured") :].split("\n## ")[0]
    header = (REPO / "configs" / "agent-demo.yaml").read_text().split("\nname:")[0]
    for rows in results["per_seed"].values():
        for key in (
            "eval/sft:final/all/pass@1",
            "eval/rl:final/all/pass@1",
            "eval/rl:final - sft:final/all/pass@1_diff",
            "eval/rl:final - sft:final/all/pass@1_diff_se",
        ):
            assert f"{rows[key]:.3f}" in section and f"{rows[key]:.3f}" in header, key
