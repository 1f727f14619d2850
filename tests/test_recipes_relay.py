"""Relay SFT with a real student (docs/recipes.md, stages/agent/relay.py, the teacher stage's
`student`): the student starts each episode, the teacher takes over at the first take-over point
(an invalid action, the context margin, a completion claim) and plays the same episode to its end;
each point fires exactly where it should, on calculator, repository and terminal tasks; the
demonstration keeps the student's turns as context (token masks exact, through SFT's packing) and
only verified episodes the teacher played in are kept; a relay whose take-over points could never
fire is refused naming the key.

Scripted students and teachers (engines that play a script, turn by turn) pin each take-over to a
turn; the stage test runs tiny models."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import snowcat.stages.sft as sft
import snowcat.stages.teacher as teacher
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import (
    Budget,
    CalculatorEnv,
    EpisodeJob,
    RepoEnv,
    calculate,
    episode_seed,
    run_episodes,
    teacher_messages,
)
from snowcat.stages.agent.demos import DEMOS, ObservationLog, demo_messages, read_demos
from snowcat.stages.agent.relay import RelayEngine, Takeover, TextTeacher, relay_messages
from snowcat.stages.agent.repo_env import gold_edit, solution_command, tool_call_text, user_message
from snowcat.stages.config import TAKEOVER_POINTS
from snowcat.stages.model import save_model_dir
from snowcat.stages.rollout import Completion, SamplingParams
from snowcat.stages.taskgen import generate_domain, save_tasks, verify
from snowcat.stages.taskgen.importers import import_harbor
from snowcat.stages.taskgen.repo import RepoSpec, snapshot_files
from snowcat.stages.tokenizer import load_tokenizer, message_text, train_tokenizer
from snowcat.stages.train.packing import Example, pack_rows
from tests.conftest import masked_runs, write_config
from tests.test_agent import overfit, tiny_model, tiny_tokenizer

SEED = 7
PARAMS = SamplingParams(1.0, 0, 1.0, 16)
needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"),
    reason="RepoEnv runs tools in LocalSandbox as root",
)


class Scripted:
    """An engine that plays a script: turn t of an episode is `script(task, t, transcript text)`,
    ended by the end-of-turn id (cut at the request's max_tokens, as an engine cuts); each request
    is recorded as (group, turn, prompt length)."""

    def __init__(self, tok, jobs, max_turns: int, script):
        self.tok, self.script, self.asked, self.prompts = tok, script, [], []
        self.place = {episode_seed(SEED, j.group_id, j.attempt, t): (j, t) for j in jobs for t in range(max_turns)}

    def generate_seeded(self, prompts, params, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds):
            job, t = self.place[seed]
            self.asked.append((job.group_id, t, len(prompt)))
            self.prompts.append(list(prompt))
            ids = self.tok.encode(self.script(job.task, t, self.tok.decode(prompt))) + [self.tok.end_of_turn_id]
            reason = "stop" if len(ids) <= params.max_tokens else "length"
            out.append(Completion(ids[: params.max_tokens], [0.0] * min(len(ids), params.max_tokens), reason))
        return out

    def turns(self, group: int) -> list[int]:
        return [t for g, t, _ in self.asked if g == group]


def relay(student, teacher_engine, env, jobs, budget, points=TAKEOVER_POINTS, margin=1, verifier=None):
    """(trajectories, take-overs) of `jobs` played by the relay of the two engines."""
    engine = RelayEngine(student, teacher_engine, env=env, jobs=jobs, seed=SEED, budget=budget, points=points, margin=margin)
    trajs = run_episodes(engine, env.tok, jobs, env, PARAMS, budget, SEED, 0, verifier=verifier)
    return trajs, engine.takeovers()


def assistant_turns(messages: list[dict]) -> list[tuple[str, bool]]:
    return [(message_text(m), m.get("train", True)) for m in messages if m["role"] == "assistant"]


# ---------------------------------------------------------------- calculator tasks


def call(task) -> str:
    return f"<tool_call>{task.prompt.rstrip().removesuffix('=')}</tool_call>"


def calc_teacher(task, t, text):
    """Calls the calculator, then answers with its result."""
    return task.answer if "<tool_result>" in text else call(task)


STUDENT_SCRIPTS = {
    0: lambda task, t, text: [call(task), "0"][t],  # a (wrong) completion claim at turn 1
    1: lambda task, t, text: [call(task), "<tool_call>1+</tool_call>"][t],  # an invalid call at turn 1
    2: lambda task, t, text: call(task),  # calls the tool every turn: the transcript grows to the margin
    3: lambda task, t, text: "7" * 40 if t == 0 else calc_teacher(task, t, text),  # turn 0 cut by the turn budget
}


@pytest.fixture(scope="module")
def calc():
    """Four arith tasks, a tokenizer, and the margin at which the context-margin point fires at turn 2
    of episode 2 (whose transcript grows by one call and one result a turn)."""
    tasks = generate_domain(np.random.default_rng(3), "arith", [2], 4)
    tok = train_tokenizer([message_text(m) for t in tasks for m in teacher_messages(t, "calculator")] * 4, 300)
    env = CalculatorEnv(ObservationLog(tok))
    jobs = [EpisodeJob(t, group_id=g, attempt=0) for g, t in enumerate(tasks)]
    budget = Budget(max_context=160, max_turn_tokens=16, max_turns=5)
    result = str(calculate(call(tasks[2]).removeprefix("<tool_call>").removesuffix("</tool_call>")))
    growth = len(tok.encode(call(tasks[2])) + [tok.end_of_turn_id]) + len(tok.observation_ids("tool", result))
    margin = budget.max_context - (len(env.prompt(tasks[2])) + 2 * growth)
    return tasks, tok, env, jobs, budget, margin


def student_engine(tok, jobs, budget):
    return Scripted(tok, jobs, budget.max_turns, lambda task, t, text: STUDENT_SCRIPTS[jobs_index(jobs, task)](task, t, text))


def jobs_index(jobs, task) -> int:
    return next(j.group_id for j in jobs if j.task is task)


def test_each_takeover_point_fires_where_it_should_and_the_teacher_continues_the_same_episode(calc):
    tasks, tok, env, jobs, budget, margin = calc
    student, teach = student_engine(tok, jobs, budget), Scripted(tok, jobs, budget.max_turns, calc_teacher)
    verified = []

    def verifier(task, text):
        verified.append((task.task_id, text))
        return verify(task, text)

    trajs, handed = relay(student, teach, env, jobs, budget, margin=margin, verifier=verifier)
    assert handed == [
        Takeover("completion_claim", 1),  # the claim is not played: the teacher plays turn 1
        Takeover("invalid_action", 1),  # the calculator would end the episode on it: the teacher plays turn 1
        Takeover("context_margin", 2),
        Takeover("invalid_action", 0),  # a turn cut by the turn budget is no whole action
    ]
    # the student was asked for every turn up to its take-over (a claim or invalid action included),
    # the teacher for every turn from it, and nobody else
    assert [student.turns(g) for g in range(4)] == [[0, 1], [0, 1], [0, 1], [0]]
    assert [teach.turns(g) for g in range(4)] == [[1], [1], [2], [0, 1]]
    # the context margin: the first turn whose context is within `margin` of max_context, not one earlier
    lengths = {t: n for g, t, n in student.asked + teach.asked if g == 2}
    assert budget.max_context - lengths[2] <= margin < budget.max_context - lengths[1]
    for g in (0, 1, 3):  # no other episode came near it before its own take-over
        assert all(budget.max_context - n > margin for gg, t, n in student.asked if gg == g)
    # every episode finished by the teacher, verified: the student's claim "0" never was
    assert all(t.status == "ok" and t.passed for t in trajs)
    assert sorted(verified) == sorted((t.task_id, t.answer) for t in tasks)
    for t, h, task in zip(trajs, handed, tasks):
        msgs = relay_messages(demo_messages(t, task, env, tok, env.tok), h.turn)
        turns = assistant_turns(msgs)
        assert [train for _, train in turns] == [False] * h.turn + [True] * (len(turns) - h.turn)
        assert turns[-1] == (task.answer, True)  # the teacher's answer is the target
        assert all(text == call(task) for text, train in turns if not train)  # the student's calls, as context


def test_a_point_not_named_does_not_fire(calc):
    """Only the context margin named: the student's claim stands and is verified, its invalid action
    ends its episode, as without a teacher."""
    tasks, tok, env, jobs, budget, margin = calc
    student, teach = student_engine(tok, jobs[:2], budget), Scripted(tok, jobs[:2], budget.max_turns, calc_teacher)
    trajs, handed = relay(student, teach, env, jobs[:2], budget, points=("context_margin",), margin=margin)
    assert handed == [None, None] and teach.asked == []
    assert (trajs[0].status, trajs[0].passed) == ("ok", False)  # "0", verified
    assert trajs[1].status == "invalid_action"


def test_the_teacher_with_another_tokenizer_reads_the_episode_as_text(calc, tmp_path):
    """A teacher whose tokenizer is not the student's gets the transcript rendered by its own chat
    template (the opening, the student's turns, the tool results as written) and its turn comes back
    as text in the student's ids: the same take-overs and verified episodes as a same-tokenizer teacher."""
    from snowcat.stages.model.tiny_hf import hf_chat_tokenizer  # noqa: PLC0415 (transformers: slow import)

    tasks, tok, env, jobs, budget, margin = calc
    texts = [message_text(m) for t in tasks for m in teacher_messages(t, "calculator")]
    other = hf_chat_tokenizer(texts * 4, tmp_path / "hf")
    assert other.fingerprint() != tok.fingerprint()
    # every teacher turn here: the call at turn 0, the answer after it
    teach = Scripted(other, jobs, budget.max_turns, lambda task, t, text: call(task) if t == 0 else task.answer)
    bridged = TextTeacher(teach, other, student_tok=tok, observations=env.tok, env=env)
    trajs, handed = relay(student_engine(tok, jobs, budget), bridged, env, jobs, budget, margin=margin)
    assert [h.point for h in handed] == ["completion_claim", "invalid_action", "context_margin", "invalid_action"]
    assert all(t.status == "ok" and t.passed for t in trajs)
    # what the teacher read at turn 1 of episode 0: its own template's rendering of the opening, the
    # student's call and the calculator's result
    first = next(p for (g, _, _), p in zip(teach.asked, teach.prompts) if g == 0)
    assert first == other.render_prompt(demo_messages(trajs[0], tasks[0], env, tok, env.tok)[:3])
    # and its turn entered the student's transcript as text, in the student's ids
    assert tok.decode(trajs[3].token_ids[slice(*trajs[3].turn_boundaries[0])].tolist()) == call(tasks[3]) + "<|end|>"


# ---------------------------------------------------------------- repository and terminal tasks


@pytest.fixture
def harbor_task(tmp_path):
    """A terminal task (a Harbor task directory: instruction, environment, test script, solution)."""
    root = tmp_path / "fix-greeting"
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "instruction.md").write_text("Make greet.sh print 'hello world'.\n")
    (root / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 20.0\n')
    (root / "environment" / "greet.sh").write_text("echo 'hello wrld'\n")
    (root / "tests" / "test.sh").write_text(
        'if [ "$(sh greet.sh)" = "hello world" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    (root / "solution" / "solve.sh").write_text("sed -i 's/wrld/world/' greet.sh\n")
    return import_harbor(root)


def repo_teacher(task, t, text):
    """The expert, from wherever the episode stands: fix (the gold edit, or the gold script), then submit."""
    if task.meta.get("solution"):
        fixed = "SNOWCAT_SOLUTION" in text
        return tool_call_text("submit") if fixed else tool_call_text("bash", {"command": solution_command(task.meta["solution"])})
    if "edited " in text:
        return tool_call_text("submit")
    path, old, new = gold_edit(task, snapshot_files(RepoSpec.from_task(task)))
    return tool_call_text("edit", {"path": path, "old": old, "new": new})


class CountingRepoEnv(RepoEnv):
    """RepoEnv that records each submission it judges (a claim the relay did not play never is)."""

    def submit(self, task, state):
        self.submitted = [*getattr(self, "submitted", []), task.task_id]
        return super().submit(task, state)


@needs_sandbox
def test_repository_and_terminal_episodes_take_over_at_an_invalid_action_and_a_submission(harbor_task):
    swe = generate_domain(np.random.default_rng(3), "swe_mini", [1], 2)
    tasks = [swe[0], swe[1], harbor_task]
    view = [tool_call_text("view", {"path": gold_edit(t, snapshot_files(RepoSpec.from_task(t)))[0]}) for t in swe]
    scripts = {  # (view and edit run in this process: only the verdicts and the terminal's bash use sandboxes)
        0: [view[0], view[0], "The bug must be in total."],  # invalid at turn 2: answered, kept
        1: [view[1], tool_call_text("submit")],  # a completion claim at turn 1
        2: [tool_call_text("bash", {"command": "cat greet.sh"}), tool_call_text("submit")],  # the same, terminal
    }
    texts = [user_message(t)["content"] for t in tasks] + [line for lines in scripts.values() for line in lines]
    tok = train_tokenizer(texts * 2, 400)  # byte-level: any text encodes; these merges keep it short
    env = CountingRepoEnv(ObservationLog(tok))
    jobs = [EpisodeJob(t, group_id=g, attempt=0) for g, t in enumerate(tasks)]
    budget = Budget(max_context=4096, max_turn_tokens=256, max_turns=6)
    student = Scripted(tok, jobs, budget.max_turns, lambda task, t, text: scripts[jobs_index(jobs, task)][t])
    teach = Scripted(tok, jobs, budget.max_turns, repo_teacher)
    trajs, handed = relay(student, teach, env, jobs, budget, margin=64)
    assert handed == [Takeover("invalid_action", 3), Takeover("completion_claim", 1), Takeover("completion_claim", 1)]
    assert all(t.status == "ok" and t.reward == 1.0 for t in trajs), [t.detail for t in trajs]
    assert sorted(env.submitted) == sorted(t.task_id for t in tasks)  # only the teacher's submissions were judged
    msgs = relay_messages(demo_messages(trajs[0], tasks[0], env, tok, env.tok), handed[0].turn)
    assert [m["role"] for m in msgs] == ["template", "user"] + ["assistant", "tool"] * 4 + ["assistant"]
    assert [train for _, train in assistant_turns(msgs)] == [False, False, False, True, True]
    assert msgs[7]["content"].startswith("error: no tool call found")  # the environment's answer to it, as context
    for t, h, task in zip(trajs[1:], handed[1:], tasks[1:]):
        turns = assistant_turns(relay_messages(demo_messages(t, task, env, tok, env.tok), h.turn))
        assert turns[0] == (scripts[jobs_index(jobs, task)][0], False) and all(train for _, train in turns[1:])
        assert turns[-1][0] == tool_call_text("submit") and len(turns) == 3  # the student's claim is not in it


# ---------------------------------------------------------------- token masks


def assert_exact_masks(tok, messages: list[dict]) -> None:
    """The relay demonstration's tokens are the plain demonstration's; its mask is the plain one
    with every student turn's tokens 0 and every teacher turn's unchanged; SFT's packing trains
    exactly the masked-in tokens."""
    plain = [{k: v for k, v in m.items() if k != "train"} for m in messages]
    ids, mask = tok.encode_chat(messages)
    plain_ids, plain_mask = tok.encode_chat(plain)
    assert ids == plain_ids
    runs = masked_runs(plain_mask)  # one run of trained tokens per assistant turn
    turns = [m for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(turns)
    want = list(plain_mask)
    for (s, e), m in zip(runs, turns):
        if m.get("train", True) is False:
            want[s:e] = [0] * (e - s)
    assert mask == want and 0 < sum(mask) < sum(plain_mask)
    rows = pack_rows([Example(ids, mask, 0)], len(ids) + 1, 0)
    trained = (rows["targets"][0] >= 0).nonzero().flatten().tolist()
    assert trained == [j - 1 for j, m in enumerate(mask) if m and j > 0]


def test_student_turns_are_masked_and_teacher_turns_trained_token_for_token(calc, tmp_path):
    from snowcat.stages.model.tiny_hf import hf_chat_tokenizer  # noqa: PLC0415 (transformers: slow import)

    tasks, tok, env, jobs, budget, margin = calc
    trajs, handed = relay(
        student_engine(tok, jobs, budget), Scripted(tok, jobs, 5, calc_teacher), env, jobs, budget, margin=margin
    )
    demos = [relay_messages(demo_messages(t, task, env, tok, env.tok), h.turn) for t, h, task in zip(trajs, handed, tasks)]
    other = hf_chat_tokenizer([message_text(m) for d in demos for m in d] * 4, tmp_path / "hf")
    for messages in demos[:3]:  # those with student turns
        assert_exact_masks(tok, messages)  # the student's own template
        assert_exact_masks(other, messages)  # a Hugging Face template (a student with another tokenizer)


# ---------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """tasks/ and sft/checkpoints/final: a test-micro model that learnt six arith tasks' calculator
    demonstrations by heart; it is both the student and the teacher here."""
    root = tmp_path_factory.mktemp("relay_inputs")
    train = generate_domain(np.random.default_rng(5), "arith", [2], 6)
    save_tasks(root / "tasks", "train", train)
    save_tasks(root / "tasks", "val", generate_domain(np.random.default_rng(6), "arith", [2], 2))
    tok = tiny_tokenizer(train)
    torch.set_num_threads(1)
    model = overfit(tiny_model(tok, seed=1), tok, [teacher_messages(t, "calculator") for t in train], max_steps=60)
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)
    return root


RELAY = dict(
    teacher="sft:final",
    student="sft:final",
    env="calculator",
    attempts=2,
    batch_size=12,
    max_turn_tokens=16,
    max_context=128,
    max_turns=3,
    context_margin_tokens=8,
    temperature=0.0,
    verifier_timeout_s=0,
)


def test_the_stage_keeps_verified_relay_demonstrations_with_provenance_and_sft_reads_their_masks(inputs, tmp_path):
    ctx = StageContext.standalone(
        "teacher", RELAY, run_dir=tmp_path, inputs={"tasks": inputs / "tasks", "sft": inputs / "sft"}, seed=9
    )
    metrics = teacher.run(ctx)
    summary = json.loads((tmp_path / "teacher" / "teacher.json").read_text())
    demos = [json.loads(line) for line in (tmp_path / "teacher" / DEMOS).read_text().splitlines()]
    assert summary["student"] == "sft:final" and summary["episodes"] == 12
    # the overfit student calls the tool, then claims: the teacher takes over at every claim
    assert summary["takeovers"]["completion_claim"] == metrics["takeover/completion_claim"] > 0
    assert summary["kept"] + summary["duplicates"] + summary["cut_turns"] + summary["student_alone"] == summary["verified"]
    assert demos and len(demos) == summary["kept"]
    for d in demos:
        p = d["provenance"]
        assert p["relay"]["student"] == "sft:final" and p["relay"]["takeover_points"] == list(TAKEOVER_POINTS)
        assert p["relay"]["teacher_reads"] == "ids" and len(p["relay"]["student_sha256"]) == 64
        assert p["verdict"]["passed"] is True and p["takeover"]["point"] in TAKEOVER_POINTS
        trains = [train for _, train in assistant_turns(d["messages"])]
        assert trains == [False] * p["takeover"]["turn"] + [True] * (len(trains) - p["takeover"]["turn"])
    assert any(d["provenance"]["takeover"]["turn"] > 0 for d in demos)
    # SFT reads them through the teacher:<stage> source, the student's turns still context
    sft_ctx = StageContext.standalone(
        "sft",
        {"model": "test-micro", "mix": {"tasks": 0, "teacher:relay": 1}},
        run_dir=tmp_path,
        inputs={"tasks": inputs / "tasks", "relay": tmp_path / "teacher"},
    )
    convs = sft.teacher_conversations(sft_ctx, sft_ctx.config, sft_ctx.config.mix)
    assert [c for c, _ in convs] == [d["messages"] for d in read_demos(tmp_path / "teacher")]
    tok = load_tokenizer(inputs / "sft" / "checkpoints" / "final")
    for messages, _ in convs:
        if any(m.get("train") is False for m in messages):
            assert_exact_masks(tok, messages)


def test_unverified_relay_episodes_are_not_kept():
    """A failed verdict or a student that finished alone: no demonstration, each counted."""
    provenance = {"relay": {"student": "s:final"}}
    msgs = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    base = {"domain": "arith", "group_id": 0, "attempt": 0, "status": "ok", "reward": 1.0, "detail": "", "turns": 1}
    records = [
        {**base, "task_id": "a", "passed": False, "takeover": {"point": "completion_claim", "turn": 0}},
        {**base, "task_id": "b", "passed": True, "takeover": None, "messages": msgs},
        {**base, "task_id": "c", "passed": True, "takeover": {"point": "context_margin", "turn": 0}, "messages": msgs},
    ]
    demos, counts = teacher.demonstrations(records, "all", provenance)
    assert [d["task_id"] for d in demos] == ["c"] and demos[0]["provenance"]["takeover"]["point"] == "context_margin"
    assert counts["verified"] == 2 and counts["student_alone"] == 1 and counts["kept"] == 1
    assert counts["takeovers"] == {"invalid_action": 0, "context_margin": 1, "completion_claim": 1}


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "over, line",
    [
        ({"takeover": []}, r"stages\.teacher\.takeover: no take-over point"),
        ({"takeover": ["bored"]}, r"stages\.teacher\.takeover: unknown take-over point 'bored'"),
        ({"context_margin_tokens": 128}, r"stages\.teacher\.context_margin_tokens: 128 >= max_context \(128\)"),
        ({"context_margin_tokens": 0}, r"stages\.teacher\.context_margin_tokens: must be >= 1"),
        ({"max_turns": 1}, r"stages\.teacher\.max_turns: Relay needs at least 2 turns"),
        ({"env": "single"}, r"stages\.teacher\.env: single: the student's one turn is its answer"),
    ],
)
def test_takeover_points_that_can_never_fire_are_refused_naming_the_key(over, line, tmp_path):
    with pytest.raises(UserError, match="^" + line):
        StageContext.standalone("teacher", {**RELAY, **over}, run_dir=tmp_path, inputs={"tasks": tmp_path, "sft": tmp_path})


def test_a_relay_config_that_can_never_fire_exits_2_with_one_line_before_anything_runs(snowcat, tmp_path):
    path = write_config(
        tmp_path / "r.yaml",
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  relay: {kind: teacher, needs: [tasks, sft], teacher: 'sft:final', student: 'sft:final', env: calculator,"
        " max_turns: 3, takeover: []}\n",
    )
    with pytest.raises(UserError, match=r"stages\.relay\.takeover: no take-over point"):
        config_mod.load(path)
    proc = snowcat("run", path, "--run-dir", tmp_path / "run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and not (tmp_path / "run").exists()
    assert len(lines) == 1 and "stages.relay.takeover: no take-over point" in lines[0], proc.stderr
    # a student stage that is not needed is named too
    bad = (
        path.read_text()
        .replace("student: 'sft:final'", "student: 'probe:final'")
        .replace("takeover: []", "takeover: [invalid_action]")
    )
    with pytest.raises(UserError, match=r"stages\.relay\.student: 'probe:final' names stage 'probe', which is not in"):
        config_mod.load(write_config(tmp_path / "s.yaml", bad))
