"""Behaviour records per episode (stages/agent/behaviour_records.py), `snowcat behaviour` (two
checkpoints compared by what their agents did: pipeline/reports/behaviour.py) and `snowcat scan-data` (a
pattern traced to the SFT demonstrations: pipeline/reports/scan_data.py).

Episodes are built token by token as the agent loop builds them, written with the real trajectory
writer and read back from Parquet, so the records see only what a run keeps."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from snowcat import stages as sft_module
from snowcat.pipeline import cli, config
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.reports import scan_data
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import evalstats
from snowcat.stages.agent import Trajectory
from snowcat.stages.agent.behaviour_records import (
    DIRNAME,
    read_paths,
    read_records,
    record,
    repo_path,
    write_records,
    write_timings,
)
from snowcat.stages.agent.dataset import DIRNAME as KEPT
from snowcat.stages.agent.dataset import TrajectoryWriter
from snowcat.stages.agent.repo_env import tool_call_text, user_message
from snowcat.stages.procedure import parse_rule, rule_kept
from snowcat.stages.taskgen import generate_domain, save_tasks
from snowcat.stages.taskgen.repo import patched_paths
from snowcat.stages.tokenizer import train_tokenizer
from tests.test_traces import episode as traces_episode

CLAIM = "I fixed the bug, all tests pass now."


@pytest.fixture(scope="module")
def tok():
    texts = ['<tool_call>{"name":"view","arguments":{"path":"a.py"}}</tool_call>', CLAIM, "edited exit 0 FAIL"]
    return train_tokenizer(texts * 4, vocab_size=300)


@pytest.fixture(scope="module")
def tasks():
    return generate_domain(np.random.default_rng(0), "swe_mini", [1], 4)


def call(name: str, **args) -> str:
    return tool_call_text(name, args)


def episode(tok, task, turns, *, attempt=0, reward=0.0, status="ok", detail="") -> Trajectory:
    """turns: (model text, tool result or None), laid out as the agent loop lays them out."""
    prompt = tok.render_prompt([user_message(task)])
    return traces_episode(
        tok, prompt, turns, task_id=task.task_id, domain=task.domain, attempt=attempt, reward=reward, status=status, detail=detail
    )


def gold(task) -> str:
    return patched_paths(task.answer)[0]


def fixer(tok, task, attempt=0) -> Trajectory:
    """Runs the tests, views the gold file, edits it, runs the tests again, submits: passes."""
    g = gold(task)
    turns = [
        (call("test"), "exit 1 FAIL"),
        (call("view", path=g), "1 def f(): ..."),
        (call("edit", path=g, old="a", new="b"), f"edited {g}"),
        (call("test"), "exit 0"),
        (call("submit"), None),
    ]
    return episode(tok, task, turns, attempt=attempt, reward=1.0, detail="3 tests pass")


def claimer(tok, task, attempt=0) -> Trajectory:
    """Claims the fix is done and submits at once, with no edit: fails."""
    detail = "tests fail: FAIL_TO_PASS 1/1 failing, PASS_TO_PASS 0/2 failing"
    return episode(tok, task, [(CLAIM + call("submit"), None)], attempt=attempt, detail=detail)


def viewer(tok, task, attempt=0) -> Trajectory:
    """Only reads files (view, bash cat, a view of a missing file), then runs out of turns."""
    turns = [
        (call("view", path=gold(task)), "1 def f(): ..."),
        (call("bash", command="cat ./tests/__init__.py | head -3"), "exit 0"),
        (call("view", path="nope.py"), "error: nope.py: no such file"),
    ]
    return episode(tok, task, turns, attempt=attempt, status="truncated", detail="no answer in 3 turns")


def kept(tmp_path: Path, tok, tasks, label: str, trajs: list[Trajectory]) -> Path:
    writer = TrajectoryWriter(tmp_path / KEPT, stage="eval", env="repo", keep=None, seed=0)
    return writer.write(label, trajs, tok, checkpoint=label, tasks={t.task_id: t for t in tasks})


def test_records_of_hand_built_episodes(tmp_path, tok, tasks):
    task = tasks[0]
    g = gold(task)
    trajs = [fixer(tok, task), claimer(tok, task, 1), viewer(tok, task, 2)]
    path = write_records(kept(tmp_path, tok, [task], "sft:final", trajs))
    assert path == tmp_path / DIRNAME / "sft_final.parquet"
    (fix, claim, view), procedure = read_records(path)
    assert procedure == ["test before submit", "test after edit"]

    def tokens(t: Trajectory) -> tuple[int, int]:
        bounds = t.turn_boundaries
        model = sum(e - s for s, e in bounds)
        after = sum((bounds[j + 1][0] if j + 1 < len(bounds) else len(t.token_ids)) - e for j, (_, e) in enumerate(bounds))
        return model, after

    model, after = tokens(trajs[0])
    calls = [call("test"), call("view", path=g), call("edit", path=g, old="a", new="b"), call("test"), call("submit")]
    assert fix == {
        "id": "sft_final/0", "checkpoint": "sft:final", "task_id": task.task_id, "domain": "swe_mini", "env": "repo",
        "attempt": 0, "status": "ok", "passed": 1, "reward": 1.0, "turns": 5, "tool_calls": 5,
        "gold_files": [g], "opened_files": [g], "edited_files": [g], "opened_relevant": True, "edited_relevant": True,
        "edits": 1, "relevant_edits": 1, "target_tests": 1, "test_runs": 2,
        "claimed": True, "claim_turn": 4, "tests_before_claim": 2, "claimed_untested": False, "claimed_without_edit": False,
        "model_tokens": model, "tool_output_tokens": after,
        "reasoning_chars": 0, "action_chars": sum(map(len, calls)),
        "tool_output_chars": len("exit 1 FAIL") + len("1 def f(): ...") + len(f"edited {g}") + len("exit 0"),
        "reasoning_tokens": 0, "action_tokens": model, "tokens_exact": True,
        "procedure_applicable": 2, "procedure_broken": [],
    }  # fmt: skip

    # claimed completion at once, with neither an edit nor a test: the verifier judged it, FAIL_TO_PASS failing
    model, after = tokens(trajs[1])
    assert {k: claim[k] for k in claim if k not in ("id", "task_id", "domain", "env", "reward", "checkpoint")} == {
        "attempt": 1, "status": "ok", "passed": 0, "turns": 1, "tool_calls": 1,
        "gold_files": [g], "opened_files": [], "edited_files": [], "opened_relevant": False, "edited_relevant": False,
        "edits": 0, "relevant_edits": 0, "target_tests": 0, "test_runs": 0,
        "claimed": True, "claim_turn": 0, "tests_before_claim": 0, "claimed_untested": True, "claimed_without_edit": True,
        "model_tokens": model, "tool_output_tokens": after,
        "reasoning_chars": len(CLAIM), "action_chars": len(call("submit")), "tool_output_chars": 0,
        # counted against the tokenizer: the claim's own tokens, then the call's (with the end of turn)
        "reasoning_tokens": len(tok.encode(CLAIM)), "action_tokens": model - len(tok.encode(CLAIM)), "tokens_exact": True,
        "procedure_applicable": 1, "procedure_broken": ["test before submit"],
    }  # fmt: skip

    # only viewed files: opened the gold file (and tests/__init__.py through bash), edited nothing, never judged
    assert view["opened_files"] == [g, "tests/__init__.py"] and view["edited_files"] == []
    assert (view["opened_relevant"], view["edited_relevant"], view["edits"], view["relevant_edits"]) == (True, False, 0, 0)
    assert (view["target_tests"], view["test_runs"], view["tool_calls"], view["turns"]) == (-1, 0, 3, 3)
    assert (view["claimed"], view["claim_turn"], view["tests_before_claim"]) == (False, -1, None)
    assert (view["claimed_untested"], view["claimed_without_edit"]) == (False, False)
    assert (view["procedure_applicable"], view["procedure_broken"]) == (0, [])

    # the same shard and procedure give the same bytes (a reproduction finds it identical)
    first = path.read_bytes()
    assert write_records(tmp_path / KEPT / "sft_final.parquet").read_bytes() == first


def test_a_shard_kept_before_tokens_were_counted_gets_the_character_split(tmp_path, tok, tasks):
    task = tasks[0]
    shard = kept(tmp_path, tok, [task], "sft:final", [claimer(tok, task)])
    table = pq.read_table(shard)
    pq.write_table(table.drop_columns(["turn_action_tokens"]), shard)  # as an earlier version wrote it
    (claim,), _ = read_records(write_records(shard))
    model = claim["model_tokens"]
    action = round(model * len(call("submit")) / len(CLAIM + call("submit")))  # each turn's tokens split by characters
    assert (claim["reasoning_tokens"], claim["action_tokens"], claim["tokens_exact"]) == (model - action, action, False)
    assert action != model - len(tok.encode(CLAIM))  # (not what counting finds: the fallback is what ran)


def test_target_tests_bash_edits_and_paths(tok, tasks):
    task = tasks[0]
    row = {
        "id": "x/0", "checkpoint": "c", "task_id": task.task_id, "domain": "swe_mini", "attempt": 0, "status": "ok",
        "passed": 0, "reward": 0.0, "env": "repo", "loss_mask": [0, 1, 1, 0], "turn_starts": [1], "turn_ends": [3],
        "turns": [call("bash", command=f"sed -i 's/a/b/' {gold(task)} && python -m pytest -q")], "tool_names": ["bash"],
        "tool_args": [json.dumps({"command": f"sed -i 's/a/b/' {gold(task)} && python -m pytest -q"})],
        "tool_errors": [""], "tool_results": ["exit 1"], "answer_key": task.answer, "test_paths": ["tests/test_stats.py"],
        "detail": "tests fail: FAIL_TO_PASS 0/2 failing, PASS_TO_PASS 1/3 failing",
    }  # fmt: skip
    r = record(row)
    # FAIL_TO_PASS all passing, PASS_TO_PASS broken: the target tests were left passing, the episode failed
    assert r["target_tests"] == 1 and r["passed"] == 0
    # one bash command that writes the gold file and runs the tests: an edit and a test run in one turn
    assert r["edited_files"] == [gold(task)] and r["edited_relevant"] and r["test_runs"] == 1
    # no submit; steps of one turn are simultaneous for the rules: the test is not after the edit
    assert r["procedure_broken"] == ["test after edit"] and r["procedure_applicable"] == 1
    assert record(row | {"env": "calculator"})["target_tests"] == -1
    assert record(row | {"answer_key": ""})["edited_relevant"] is None  # no gold patch: not known
    assert read_paths("grep -n span gable/stats.py; sed -n 1,5p a.py | nl") == ["gable/stats.py", "a.py"]
    assert [repo_path(p) for p in ("./a.py", "/workspace/b/c.py", "/tmp/x", "../up.py")] == ["a.py", "b/c.py", None, None]


def test_procedure_rules():
    assert parse_rule("view before edit") == ("view", "before", "edit")
    for bad in ("test whenever submit", "run before submit", "test before test", "test before"):
        with pytest.raises(ValueError, match="rule"):
            parse_rule(bad)
    steps = [{"view"}, {"edit"}, {"test"}, {"edit"}, {"submit"}]
    assert rule_kept("test before submit", steps) is True
    assert rule_kept("test after edit", steps) is False  # the last edit has no test after it
    assert rule_kept("view before edit", steps) is True
    assert rule_kept("test before submit", [{"view"}]) is None  # no submit: does not apply


def test_a_bad_procedure_is_refused_at_load(tmp_path):
    (tmp_path / "c.yaml").write_text(EVAL_CONFIG.replace('"sft:final"]}', '"sft:final"], procedure: ["test whenever submit"]}'))
    with pytest.raises(UserError, match=r"stages\.eval\.procedure: rule 'test whenever submit'"):
        config.load(tmp_path / "c.yaml")


# ---------------------------------------------------------------- snowcat behaviour

EVAL_CONFIG = """\
name: b
stages:
  tasks: {kind: tasks}
  sft: {kind: sft, needs: [tasks], model: test-micro}
  eval: {kind: evaluate, needs: [tasks, sft], env: repo, checkpoints: ["sft:initial", "sft:final"]}
  eval2: {kind: evaluate, needs: [tasks, sft], checkpoints: ["sft:final"]}
"""
# per task (T1..T4), two attempts: sft:initial (A) and sft:final (B)
PLAN = {
    "sft:initial": [("fix", "fix"), ("fix", "view"), ("view", "claim"), ("claim", "claim")],
    "sft:final": [("fix", "fix"), ("fix", "fix"), ("fix", "view"), ("claim", "view")],
}


@pytest.fixture(scope="module")
def behaviour_run(tmp_path_factory, tok, tasks):
    root = tmp_path_factory.mktemp("behaviour")
    (root / "c.yaml").write_text(EVAL_CONFIG)
    run = RunDir.create(config.load(root / "c.yaml"), root / "run")
    make = {"fix": fixer, "view": viewer, "claim": claimer}
    unit = run.unit_dir(Unit("eval"))
    for ref, plan in PLAN.items():
        trajs = [make[kind](tok, task, i) for task, kinds in zip(tasks, plan) for i, kind in enumerate(kinds)]
        shard = kept(unit, tok, tasks, ref, trajs)
        write_records(shard)
        if ref == "sft:final":  # as the agent loop times its episodes: episode j took j + 1 s, half of it tools
            for j, t in enumerate(trajs):
                t.timing = {"wall_s": j + 1.0, "generate_s": (j + 1.0) / 2, "env_s": (j + 1.0) / 2}
            write_timings(shard, trajs)
    run.mark_done(Unit("eval"), {"duration_s": 1.0, "sft:initial/sample_s": 2.5, "sft:final/sample_s": 3.0}, {})
    return run


def test_rates_intervals_paired_test_and_winners(behaviour_run, tasks, tmp_path, capsys):
    out = tmp_path / "report" / "b.md"
    assert cli.main(["behaviour", str(behaviour_run.path), "sft:initial", "sft:final", "--out", str(out)]) == 0
    report = read_json(out.with_suffix(".json"))
    assert report["stage"] == "eval" and report["a"]["episodes"] == report["b"]["episodes"] == 8
    assert report["a"]["sample_s"] == 2.5 and report["a"]["records"] == "stored"

    # edited a relevant file, per task: A 1, .5, 0, 0; B 1, 1, .5, 0
    a, b = np.array([1, 0.5, 0, 0]), np.array([1, 1, 0.5, 0])
    edited = report["behaviours"]["edited_relevant"]
    assert (edited["a"]["count"], edited["a"]["episodes"], edited["b"]["count"]) == (3, 8, 5)
    assert edited["a"]["mean"] == pytest.approx(a.mean()) and edited["b"]["mean"] == pytest.approx(b.mean())
    assert edited["a"]["ci95"] == pytest.approx(list(evalstats.bootstrap_ci(a, seed=0)))
    assert edited["a"]["ci95"][0] <= a.mean() <= edited["a"]["ci95"][1]
    d = b - a
    assert edited["paired"]["diff"] == pytest.approx(d.mean()) and edited["paired"]["se"] == pytest.approx(d.std(ddof=1) / 2)
    # sign flips of the two differing tasks (+.5, +.5): sums 1, 0, 0, -1; |sum| >= 1 in 2 of 4
    assert edited["paired"]["p"] == pytest.approx(0.5)
    # claimed completion without any edit: A .0, .0, .5, 1; B 0, 0, 0, .5
    no_edit = report["behaviours"]["claimed_without_edit"]
    assert no_edit["a"]["mean"] == pytest.approx(0.375) and no_edit["b"]["mean"] == pytest.approx(0.125)
    assert report["behaviours"]["broke:test before submit"]["a"]["count"] == 3  # each claimer
    assert report["measures"]["turns"]["b"]["mean_passed"] == 5  # the fixers
    # T3: B passed, A never; A's viewer opened the file B's passing attempt edited, A edited nothing
    wl = report["winners_and_losers"]
    assert [t["task_id"] for t in wl["tasks"]] == [tasks[2].task_id]
    assert wl["by_winner"]["sft:final"] == {
        "tasks": 1, "loser_reached": 1, "loser_edited": 0, "loser_opened_gold": 1, "winner_edited_nothing": 0
    }  # fmt: skip
    md = out.read_text()
    assert "| edited a relevant file | 3/8 |" in md and "## Winners and losers" in md and "## Wall time" in md
    # wall seconds per task (B's episodes 1..8 s, two per task): 1.5, 3.5, 5.5, 7.5; A kept none
    wall = report["measures"]["wall_s"]
    assert wall["b"]["mean"] == pytest.approx(4.5) and wall["b"]["episodes"] == 8 and wall["a"]["episodes"] == 0
    assert wall["b"]["mean_passed"] == pytest.approx(np.mean([1, 2, 3, 4, 5]))  # the fixers: episodes 1-5
    assert report["measures"]["env_s"]["b"]["mean"] == pytest.approx(2.25)
    assert "| wall seconds to the episode's end (batch-mates' turns included) | n/a [n/a, n/a] |" in md
    for figure in ("b-rates.png", "b-tokens.png"):
        assert (out.parent / figure).read_bytes()[:4] == b"\x89PNG" and f"]({figure})" in md
    assert capsys.readouterr().out == md


def test_grep_counts_attempts_with_examples(behaviour_run, capsys):
    assert cli.main(["behaviour", str(behaviour_run.path), "sft:initial", "sft:final", "--grep", "fixed the bug", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["grep"]
    assert (found["a"]["count"], found["a"]["tasks_matched"], found["b"]["count"], found["b"]["tasks_matched"]) == (3, 2, 1, 1)
    assert found["a"]["mean"] == pytest.approx((0 + 0 + 0.5 + 1) / 4)
    assert found["a"]["pass_rate_matched"] == 0 and found["a"]["pass_rate_others"] == pytest.approx(3 / 5)
    assert len(found["a"]["examples"]) == 3 and "fixed the bug" in found["a"]["examples"][0]["excerpt"]


def test_records_are_computed_from_trajectories_kept_without_them(behaviour_run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(behaviour_run.path, copy)
    shutil.rmtree(RunDir.open(copy).unit_dir(Unit("eval")) / DIRNAME)
    assert cli.main(["behaviour", str(copy), "sft:initial", "sft:final", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["a"]["records"] == "computed from the kept trajectories"
    assert report["behaviours"]["edited_relevant"]["paired"]["diff"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "args, message",
    [
        (["a", "b", "--grep", "(unclosed"], "--grep '(unclosed': not a valid regular expression"),
        (["sft:initial", "rl:best"], "checkpoint 'rl:best': no evaluate stage of"),
        (
            ["sft:initial", "sft:final", "--stage", "eval2"],
            "stage 'eval2' kept no trajectories (not run yet, or keep_trajectories: none)",
        ),
        (
            ["sft:initial", "sft:final", "--stage", "sft"],
            "--stage 'sft': a sft stage; behaviour compares what an evaluate stage kept",
        ),
        (["sft:initial", "sft:final", "--stage", "nope"], "--stage 'nope': no such stage"),
        (["sft:final", "sft:final"], "behaviour compares two checkpoints; both are 'sft:final'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(behaviour_run, capsys, args, message):
    assert cli.main(["behaviour", str(behaviour_run.path), *args]) == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.split()) and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- snowcat scan-data

SCAN_CONFIG = """\
name: s
stages:
  tasks: {kind: tasks}
  sft: {kind: sft, needs: [tasks], model: test-micro}
  teach: {kind: teacher, needs: [tasks, sft], teacher: 'sft:final'}
  s2: {kind: sft, needs: [tasks, teach], model: test-micro, mix: {tasks: 1, traces: 0.5, 'teacher:teach': 2}, traces: [TRACES, MISSING]}
"""
RULE = "SQLite serial type 7 is an eight-byte IEEE double"


def test_scan_data_counts_demonstrations_by_source(tmp_path, tasks, capsys):
    traces, missing = tmp_path / "traces.jsonl", tmp_path / "gone.jsonl"
    (tmp_path / "c.yaml").write_text(SCAN_CONFIG.replace("TRACES", str(traces)).replace("MISSING", str(missing)))
    run = RunDir.create(config.load(tmp_path / "c.yaml"), tmp_path / "run")
    arith = generate_domain(np.random.default_rng(1), "arith", [2], 2)
    save_tasks(run.stage_dir("tasks"), "train", [tasks[0], *arith])
    for stage in ("s2", "teach"):
        run.unit_dir(Unit(stage)).mkdir(parents=True, exist_ok=True)
    expert = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": f"Known: {RULE}."}]
    # the task's second, exploring demonstration (explore_fraction) is one more the SFT unit trained on
    exploring = [expert[0], {"role": "assistant", "content": "view tests/test_core.py"}, *expert[1:]]
    (run.unit_dir(Unit("s2")) / scan_data.SFT_DEMOS_FILE).write_text(
        json.dumps({"key": "k", "demos": {tasks[0].task_id: expert, tasks[0].task_id + scan_data.SFT_EXPLORING: exploring}})
    )
    conversation = [{"role": "user", "content": RULE}, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "bash", "arguments": {"command": "echo 'serial type 7 is an eight-byte IEEE double'"}}}]}]  # fmt: skip
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "done"}]
    traces.write_text(json.dumps({"messages": conversation}) + "\n" + json.dumps({"messages": plain}) + "\n")
    demos = [{"id": "d0", "messages": plain}, {"id": "d1", "messages": [{"role": "user", "content": RULE}, *plain[1:]]}]
    (run.stage_dir("teach") / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))

    assert cli.main(["scan-data", str(run.path), "--grep", r"serial type 7", "--stage", "s2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sources = report["units"]["s2"]["sources"]
    # tasks: the expert's episode of the repository task says it, the arith worked solutions do not
    assert {k: (s["matched"], s["demonstrations"], s["weight"]) for k, s in sources.items()} == {
        "tasks": (2, 4, 1.0),
        "traces": (1, 2, 0.5),  # its tool call says it (the user turn that says it too is not trained on)
        "teacher:teach": (0, 2, 2.0),  # d1's user turn says it, no assistant turn does
    }
    assert [e["id"] for e in sources["tasks"]["examples"]] == [tasks[0].task_id, tasks[0].task_id + "#explore"]
    assert sources["tasks"]["examples"][0]["excerpt"] == f"Known: {RULE}."
    assert sources["traces"]["examples"][0]["id"] == f"{traces}#0"
    notes = report["units"]["s2"]["notes"]
    assert any(str(missing) in n and "not found" in n for n in notes) and any("Relay" in n for n in notes)

    assert cli.main(["scan-data", str(run.path), "--grep", r"\d[+-]\d+=", "--stage", "s2"]) == 0
    assert "| tasks | 1 | 2 / 4 | 0.500 |" in capsys.readouterr().out  # the arith worked solutions
    assert cli.main(["scan-data", str(run.path), "--grep", r"view tests/", "--stage", "s2"]) == 0
    assert "| tasks | 1 | 1 / 4 | 0.250 |" in capsys.readouterr().out  # the exploring demonstration alone

    for args, message in (
        (["--grep", "[unclosed"], "--grep '[unclosed': not a valid regular expression"),
        (["--grep", "x", "--stage", "teach"], "--stage 'teach': a teacher stage; scan-data reads what an sft stage trained on"),
        (["--grep", "x", "--stage", "nope"], "--stage 'nope': no such stage"),
    ):
        assert cli.main(["scan-data", str(run.path), *args]) == 2
        err = capsys.readouterr().err
        assert message in " ".join(err.split()) and len(err.strip().splitlines()) == 1


def test_the_sft_demonstrations_file_is_the_one_sft_writes():
    """scan-data names the file (and the exploring demonstrations' key suffix) stages/sft.py writes (the CLI may not import a stage kind; read, not imported: torch)."""
    tree = ast.parse((Path(sft_module.__file__).parent / "sft.py").read_text())
    for name, here in (("DEMOS_FILE", scan_data.SFT_DEMOS_FILE), ("EXPLORING", scan_data.SFT_EXPLORING)):
        values = [n.value.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == name]
        assert values == [here], name


def test_records_keep_the_trajectory_order(tmp_path, tok, tasks):
    shard = kept(tmp_path, tok, tasks, "x", [viewer(tok, t, i) for i, t in enumerate(tasks)])
    ids = pq.read_table(shard, columns=["id"]).column("id").to_pylist()
    assert [r["id"] for r in read_records(write_records(shard))[0]] == ids
