"""The card of a real run names its teachers (docs/recipes.md): for SFT on a teacher stage's
demonstrations and for RL with teacher rollouts, which teacher (its reference and the sha256 of its
files' manifest, as the run recorded them), what it contributed (demonstrations read, episodes
played) and its own pass rate; and the run still passes `snowcat audit`."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from snowcat.pipeline.fsio import build_manifest
from snowcat.stages.agent.demos import read_demos
from tests.conftest import REPO, SHARED_RUN_TIMEOUT_S, make_run, snowcat_in_repo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(SHARED_RUN_TIMEOUT_S),
    pytest.mark.xdist_group("card_teacher"),  # one worker makes the module's run once
]

# tasks → sft (the teacher of all) → a teacher stage in two shards, and a Relay stage whose student is
# sft_student → SFT on both stages' demonstrations, and RL with 1 teacher episode per task per update
# → card. The verifier passes about half of an untrained
# model's answers (tests.rl_stage:parity_verify): every count on the card is some, not none.
CONFIG = """\
name: teacher-card
seed: 7
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 60, val_count: 12, difficulties: [1]}
      arith: {count: 60, val_count: 12, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: test-micro
    tokenizer_vocab_size: 320
    seq_len: 64
    batch_rows: 8
    steps: 100               # enough to end its turns: a cut turn is no verdict
    threads: 1
    eval_tasks: 0
  teach:
    kind: teacher
    needs: [tasks, sft]
    teacher: "sft:final"
    limit: 16
    attempts: 2
    max_context: 64
    max_turn_tokens: 16
    verifier: "tests.rl_stage:parity_verify"
    verifier_timeout_s: 0
    fan_out: {shard: [0, 1]}
  relay:                     # Relay: the student starts, the teacher takes over
    kind: teacher
    needs: [tasks, sft, sft_student]
    teacher: "sft:final"
    student: "sft_student:final"
    env: calculator
    limit: 8
    attempts: 2
    max_context: 64
    max_turn_tokens: 16
    max_turns: 2
    context_margin_tokens: 16
    verifier: "tests.rl_stage:parity_verify"
    verifier_timeout_s: 0
  sft_student:
    kind: sft
    needs: [tasks, sft]
    init_from: "sft:final"
    seq_len: 64
    batch_rows: 4
    steps: 1
    threads: 1
    eval_tasks: 0
  sft_mixed:
    kind: sft
    needs: [tasks, sft, teach, relay]
    init_from: "sft:final"
    mix: {tasks: 1, "teacher:teach": 2, "teacher:relay": 1}
    seq_len: 64
    batch_rows: 4
    steps: 2
    threads: 1
    eval_tasks: 0
  rl:
    kind: rl
    needs: [tasks, sft, sft_mixed]
    init_from: "sft:final"
    teacher: "sft_mixed:final"
    teacher_rollouts: 1
    tis_cap: 2.0
    updates: 3
    tasks_per_update: 4
    attempts: 2
    max_tokens: 16
    verifier: "tests.rl_stage:parity_verify"
    eval_tasks: 0
    threads: 1
  card:
    kind: card
    needs: [tasks, sft, teach, sft_student, relay, sft_mixed, rl]
"""


def digest(checkpoint: Path) -> str:
    """The teacher's digest as the teacher and RL stages take it: sha256 of its files' manifest."""
    return hashlib.sha256(json.dumps(build_manifest(checkpoint), sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    # the stage processes import the test verifier
    return make_run(tmp_path_factory.mktemp("teacher-card"), CONFIG, env={"PYTHONPATH": str(REPO)})


def line_of(card: str, start: str) -> str:
    return next(line for line in card.splitlines() if line.startswith(start))


def test_the_card_names_the_teacher_of_the_demonstrations_and_its_pass_rate(run_dir):
    card = (run_dir / "stages" / "card" / "card.md").read_text()
    stages = run_dir / "stages"
    summaries = [json.loads((stages / "teach" / u / "teacher.json").read_text()) for u in ("0000", "0001")]
    episodes = sum(s["episodes"] for s in summaries)
    verified = sum(s["verified"] for s in summaries)
    infra = sum(s["infra_failures"] for s in summaries)
    assert episodes == 16 * 2 and 0 < verified < episodes
    assert {s["teacher_sha256"] for s in summaries} == {digest(stages / "sft" / "checkpoints" / "final")}
    line = line_of(card, "  - `teacher:teach`:")
    assert f"teacher `sft:final`, files' manifest sha256 `{summaries[0]['teacher_sha256']}`" in line
    demos = read_demos(stages / "teach")  # what SFT read: both units', deduplicated
    assert demos and f"; {len(demos)} distinct verified demonstrations read;" in line
    rate = f"{100 * verified / (episodes - infra):.1f}%"
    assert f"the teacher's pass rate {rate} ({verified} verified of {episodes - infra} scored episodes" in line
    assert "Relay" not in line
    relay = json.loads((stages / "relay" / "teacher.json").read_text())
    assert relay["student_sha256"] == digest(stages / "sft_student" / "checkpoints" / "final")
    line = line_of(card, "  - `teacher:relay`:")
    assert f"teacher `sft:final`, files' manifest sha256 `{summaries[0]['teacher_sha256']}`" in line
    assert f"; Relay student `sft_student:final`, files' manifest sha256 `{relay['student_sha256']}`;" in line
    relay_demos, scored = len(read_demos(stages / "relay")), relay["episodes"] - relay["infra_failures"]
    assert f"; {relay_demos} distinct verified demonstrations read; the Relay episodes' pass rate " in line
    assert f"({relay['verified']} verified of {scored} scored episodes" in line
    # every episode the teachers played is in the reward-hack table: a hack among their successes
    # would become a demonstration
    for group, summary in (("teach[0]", summaries[0]), ("teach[1]", summaries[1]), ("relay", relay)):
        assert line_of(card, f"| {group} | {summary['episodes']} | ")


def test_the_card_names_the_teacher_of_the_rollouts_its_episodes_and_pass_rate(run_dir):
    card = (run_dir / "stages" / "card" / "card.md").read_text()
    out = run_dir / "stages" / "rl"
    recorded = json.loads((out / "teacher.json").read_text())
    assert recorded["teacher"] == "sft_mixed:final"
    assert recorded["teacher_sha256"] == digest(run_dir / "stages" / "sft_mixed" / "checkpoints" / "final")
    rows = [json.loads(line) for line in (out / "metrics_history.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "teacher/episodes" in r]
    assert len(rows) == 3 and all(r["teacher/episodes"] == 4 for r in rows)  # 4 tasks x 1 teacher episode
    passed = sum(r["teacher/passed"] for r in rows)
    scored = 12 - sum(r["teacher/infra_failures"] for r in rows)
    assert 0 < passed < scored
    # the pass rate is the ratio of the counts, and each update's rate is its own counts' ratio
    for r in rows:
        if r["teacher/episodes"] > r["teacher/infra_failures"]:
            assert r["teacher/pass_rate"] == pytest.approx(r["teacher/passed"] / (4 - r["teacher/infra_failures"]))
    line = line_of(card, "  - teacher rollouts (`teacher_rollouts` 1 per task per update")
    assert f"teacher `sft_mixed:final`, files' manifest sha256 `{recorded['teacher_sha256']}`" in line
    assert re.search(
        rf"; 12 teacher episodes over 3 updates, the teacher's pass rate {100 * passed / scored:.1f}% "
        rf"\({passed:g} passed of {scored:g} scored\)$",
        line,
    )


def test_the_run_with_teachers_passes_the_audit(run_dir):
    proc = snowcat_in_repo("audit", run_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "audit passed" in proc.stdout
