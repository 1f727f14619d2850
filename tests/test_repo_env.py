"""RepoEnv: tool calls parsed from the model's tokens, run in real sandboxes, the scripted expert's
demonstrations, verification on submit, and the agent loop driving many episodes at once."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from snowcat.stages.agent import Budget, EpisodeJob, RepoEnv, Trajectory, behaviour, run_episodes, teacher_messages
from snowcat.stages.agent.repo_env import (
    TOOL_HINT,
    TOOL_SCHEMAS,
    TOOLS,
    ToolCallError,
    parse_tool_call,
    picked,
    tool_call_message,
    tool_call_text,
    user_message,
)
from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import Task, generate_domain
from snowcat.stages.tokenizer import message_text, train_tokenizer
from tests.conftest import masked_runs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"),
    reason="RepoEnv runs tools in LocalSandbox as root",
)


@pytest.fixture(scope="module")
def world():
    tasks = generate_domain(np.random.default_rng(3), "swe_mini", [1, 2], 6)
    demos = [teacher_messages(t, "repo") for t in tasks]
    texts = [message_text(m) for d in demos for m in d]
    return tasks, demos, train_tokenizer(texts, 512)


def test_parse_tool_call():
    assert parse_tool_call(tool_call_text("edit", {"path": "a.py", "old": "-", "new": "+"})) == (
        "edit",
        {"path": "a.py", "old": "-", "new": "+"},
    )
    assert parse_tool_call('thinking... <tool_call>\n{"name": "test", "arguments": {}}\n</tool_call>') == ("test", {})
    for bad, why in [
        ("I fixed it", "no tool call"),
        ("<tool_call>{name: test}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "rm"}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "command"),
        ('<tool_call>["test"]</tool_call>', "must be"),
    ]:
        with pytest.raises(ToolCallError, match=why):
            parse_tool_call(bad)


@pytest.mark.slow
def test_teacher_demonstrations_are_real_and_reproducible(world):
    tasks, demos, _ = world
    for task, msgs in zip(tasks, demos):
        assert msgs[0] == {"role": "template", "tools": TOOL_SCHEMAS}  # the template's default enable_thinking
        assert task.prompt in msgs[1]["content"]
        assert [m["role"] for m in msgs] == ["template", "user"] + ["assistant", "tool"] * 4 + ["assistant"]
        names = [parse_tool_call(message_text(m))[0] for m in msgs if m["role"] == "assistant"]
        assert names == ["test", "view", "edit", "test", "submit"]
        first_test, last_test = msgs[3]["content"], msgs[9]["content"]
        assert "FAILED" in first_test and "exit 1" in first_test, first_test
        assert "OK" in last_test and "exit 0" in last_test, last_test
        for m in msgs:  # paths do not depend on the host: tracebacks name /workspace, never the sandbox's host dir
            if m["role"] == "tool":
                assert "snowcat-sandbox" not in m["content"], m["content"]
                assert all(p.startswith("/workspace/") for p in re.findall(r'File "([^"]+)"', m["content"])), m["content"]
    assert teacher_messages(tasks[0], "repo") == demos[0]  # no timings, no host paths: same bytes again
    assert teacher_messages(tasks[0], "repo", enable_thinking=False)[0] == {
        "role": "template",
        "tools": TOOL_SCHEMAS,
        "enable_thinking": False,
    }


def test_a_detour_demonstration_opens_a_wrong_file_reads_the_error_and_trains_only_the_recovery(world):
    tasks, demos, tok = world
    task, plain = tasks[0], demos[0]
    msgs = teacher_messages(task, "repo", detour=True)
    module = task.meta["module"]
    folder, name = module.rsplit("/", 1)
    # the plain episode with two messages more: a view of a file beside the module that is not there, and its error
    assert msgs[:4] + msgs[6:] == plain
    call, error = msgs[4:6]
    wrong = parse_tool_call(message_text(call))[1]["path"]
    assert call["train"] is False and wrong.startswith(f"{folder}/") and wrong != module
    assert error["role"] == "tool" and error["content"].startswith(f"error: {wrong}: no such file ({folder}/ has: ")
    assert name in error["content"]
    assert all(m.get("train", True) for m in msgs if m is not call)
    # trained: the same tokens as the plain episode's (the detour turn is context only)
    ids, mask = tok.encode_chat(msgs)
    plain_ids, plain_mask = tok.encode_chat(plain)
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == [i for i, m in zip(plain_ids, plain_mask) if m] and len(ids) > len(plain_ids)
    assert teacher_messages(task, "repo", detour=True) == msgs  # reproducible
    # which tasks take one: a share by task id, none at 0 and all at 1
    ids_ = [f"t{i}" for i in range(2000)]
    shares = [
        sum(picked(Task(i, "swe_mini", 1, "", "", "repo"), share, "detour") for i in ids_) / len(ids_) for share in (0, 0.3, 1)
    ]
    assert shares[0] == 0 and 0.25 < shares[1] < 0.35 and shares[2] == 1


def test_an_exploring_demonstration_reads_the_test_module_after_the_first_run_and_trains_it(world):
    tasks, demos, tok = world
    task, plain = tasks[0], demos[0]
    msgs = teacher_messages(task, "repo", explore=True)
    # the plain episode with two messages more, after the first test run: a view of the test module and its text
    assert msgs[:4] + msgs[6:] == plain
    call, text = msgs[4:6]
    name, args = parse_tool_call(message_text(call))
    test_module = f"tests/test_{task.meta['module'].rsplit('/', 1)[1]}"
    assert (name, args["path"]) == ("view", test_module) and "import unittest" in text["content"]
    assert all(m.get("train", True) for m in msgs)  # the habit is taught, as the teacher had it
    ids, mask = tok.encode_chat(msgs)
    assert sum(mask) > sum(tok.encode_chat(plain)[1])
    assert teacher_messages(task, "repo", explore=True) == msgs  # reproducible
    # both habits: the test module first, then the wrong file, then the module
    both = teacher_messages(task, "repo", explore=True, detour=True)
    assert [parse_tool_call(message_text(m))[1].get("path") for m in both if m["role"] == "assistant"][1:4] == [
        test_module,
        parse_tool_call(message_text(teacher_messages(task, "repo", detour=True)[4]))[1]["path"],
        task.meta["module"],
    ]
    # the two shares pick apart: as many tasks explore among the detoured as among the rest
    group = [Task(f"t{i}", "swe_mini", 1, "", "", "repo") for i in range(4000)]
    detoured = [t for t in group if picked(t, 0.5, "detour")]
    assert 0.45 < sum(picked(t, 0.5, "explore") for t in detoured) / len(detoured) < 0.55


def test_the_tool_table_is_one_place():
    """The schemas the template shows, the arguments the parser requires and the statement's hint agree."""
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == list(TOOLS)
    for schema in TOOL_SCHEMAS:
        fn = schema["function"]
        assert schema["type"] == "function" and fn["description"] and fn["parameters"]["type"] == "object"
        required = fn["parameters"]["required"]
        assert required == list(fn["parameters"]["properties"])
        assert f"{fn['name']}({', '.join(required)})" in TOOL_HINT
        for arg in required:  # each required argument is enforced, and only the named ones are
            with pytest.raises(ToolCallError, match=arg):
                parse_tool_call(tool_call_text(fn["name"], {a: "x" for a in required if a != arg}))
        assert parse_tool_call(tool_call_text(fn["name"], {a: "x" for a in required})) == (fn["name"], {a: "x" for a in required})
    # the hint snowcat's own template shows (it has no tools section): the one the agent demo was measured with
    assert TOOL_HINT == "Tools: bash(command), view(path), edit(path, old, new), test(), submit()."


@pytest.mark.slow
def test_rollout_layout_equals_the_teacher_demonstration(world):
    """Playing the teacher's calls through env.step gives exactly encode_chat(teacher), and submit verifies."""
    tasks, demos, tok = world
    task, msgs = tasks[0], demos[0]
    env = RepoEnv(tok)
    state = env.reset(task)
    try:
        ids = env.prompt(task)
        # snowcat's template has no tools section: the declaration changes no id (the demo's prompts as measured)
        assert ids == tok.render_prompt([user_message(task)]) and tok.decode(ids).count("bash") == 1
        teacher_ids, mask = tok.encode_chat(msgs)
        for m in msgs[1:]:
            if m["role"] != "assistant":
                continue
            call = tok.encode(message_text(m)) + [tok.end_of_turn_id]
            step = env.step(task, state, call)
            ids = ids + call + step.observation
        assert step.done and step.reward == 1.0 and task.meta["module"] in step.answer
        assert ids == teacher_ids
    finally:
        env.finish(state)


def test_tools_refuse_escapes_and_keep_the_episode_going(world, tmp_path):
    tasks, _, tok = world
    task = tasks[1]
    env = RepoEnv(tok, observation_chars=400)
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    state = env.reset(task)
    try:
        sb = state["sandbox"]
        os.symlink(secret, sb.workdir / "link.py")
        assert env.run_tool(state, "view", {"path": "link.py"}) == "error: link.py: outside the repository"
        assert "outside" in env.run_tool(state, "view", {"path": "../../etc/passwd"})
        assert "no such file" in env.run_tool(state, "view", {"path": "missing.py"})
        assert "occurs 0 times" in env.run_tool(state, "edit", {"path": task.meta["module"], "old": "zzz", "new": "y"})
        out = env.run_tool(state, "bash", {"command": "cat /proc/self/status | grep -c . ; seq 1 5000"})
        assert out.startswith("exit 0") and "characters cut" in out and len(out) < 500
        # a turn that is not a tool call is an error message, not the end of the episode
        step = env.step(task, state, tok.encode("the bug is fixed") + [tok.end_of_turn_id])
        assert not step.done and "no tool call" in tok.decode(step.observation)
        # editing the tests and submitting gains nothing
        test_file = task.meta["repo"]["test_paths"][0]
        (sb.workdir / test_file).write_text("import unittest\n")
        step = env.step(task, state, tok.encode(tool_call_text("submit")) + [tok.end_of_turn_id])
        assert step.done and step.reward == 0.0
    finally:
        env.finish(state)
    assert "sandbox" not in state and not sb.workdir.exists()


def test_a_wrong_path_is_answered_with_what_the_nearest_directory_holds(world, tmp_path):
    """The demo model's commonest failure is a guessed module name (lumen/util.py for lumen/numbers.py):
    the error names the files that are there, and never anything outside the repository."""
    tasks, _, tok = world
    task = tasks[0]
    env = RepoEnv(tok, observation_chars=400)
    (tmp_path / "outside.py").write_text("x = 1\n")
    state = env.reset(task)
    try:
        sb = state["sandbox"]
        module = task.meta["module"]  # e.g. lumen/numbers.py
        package = module.rsplit("/", 1)[0]
        here = sorted(p.name + "/" * p.is_dir() for p in (sb.workdir / package).iterdir() if not p.name.startswith("."))
        (sb.workdir / package / ".hidden.py").write_text("")
        listing = f"({package}/ has: {', '.join(here)})"
        assert Path(module).name in here
        for tool, args in [("view", {}), ("edit", {"old": "a", "new": "b"})]:
            assert (
                env.run_tool(state, tool, {"path": f"{package}/nope.py", **args})
                == f"error: {package}/nope.py: no such file {listing}"
            )
        # deeper than anything there: the nearest directory that exists; a directory itself: its own files
        assert env.run_tool(state, "view", {"path": f"{package}/a/b/c.py"}).endswith(listing)
        assert env.run_tool(state, "view", {"path": package}) == f"error: {package}: a directory {listing}"
        top = env.run_tool(state, "view", {"path": "nopkg/x.py"})
        assert top.startswith("error: nopkg/x.py: no such file (the repository has: ") and f"{package}/" in top
        # what the agent may plant there is named, never opened or followed: a FIFO (viewing it would
        # block), a dangling link; viewing the FIFO itself is refused at once
        os.mkfifo(sb.workdir / package / "pipe.py")
        os.symlink("/nonexistent/dir", sb.workdir / package / "dangling")
        planted = env.run_tool(state, "view", {"path": f"{package}/nope.py"})
        assert (
            planted
            == f"error: {package}/nope.py: no such file ({package}/ has: {', '.join(sorted([*here, 'dangling', 'pipe.py']))})"
        )
        assert env.run_tool(state, "view", {"path": f"{package}/pipe.py"}).startswith(f"error: {package}/pipe.py: no such file (")
        # through a symlinked directory that leaves the repository: refused, nothing listed
        os.symlink(tmp_path, sb.workdir / "out")
        assert env.run_tool(state, "view", {"path": "out/missing.py"}) == "error: out/missing.py: outside the repository"
        assert "outside.py" not in env.run_tool(state, "view", {"path": "out2/missing.py"})
    finally:
        env.finish(state)


def test_agent_loop_runs_repo_episodes_in_parallel_and_cleans_up(world, tmp_path, monkeypatch):
    tasks, demos, tok = world
    torch.manual_seed(0)
    model = MoEForCausalLM(dataclasses.replace(PRESETS["test-micro"], vocab_size=tok.vocab_size)).eval()
    broken = Task("swe-broken", "swe_mini", 1, "fix", "", "repo", {"repo": {"source": {}}})
    jobs = [EpisodeJob(t, g, a) for g, t in enumerate(tasks[:3]) for a in range(2)] + [EpisodeJob(broken, 9, 0)]
    sandboxes = private_tempdir(tmp_path, monkeypatch)
    params = SamplingParams(1.0, 0, 1.0, 16, (tok.end_of_turn_id,))
    trajs = run_episodes(
        TorchEngine(model, max_batch=8), tok, jobs, RepoEnv(tok), params, Budget(1024, 16, 3), seed=1, policy_version=0
    )
    assert len(trajs) == len(jobs)
    assert trajs[-1].status == "infra_error" and "reset" in trajs[-1].detail
    # a random model does not submit: its episodes end on the budget with invalid actions counted
    assert all(t.status == "truncated" for t in trajs[:-1]), [(t.status, t.detail) for t in trajs]
    stats = behaviour(trajs[:-1], tok)
    assert stats["episodes"] == 6 and stats["no_submission_frac"] == 1.0 and stats["invalid_actions_per_episode"] > 0
    assert not list(sandboxes.glob("snowcat-sandbox-*"))  # every episode's sandbox is gone


def test_behaviour_reads_the_teacher_protocol(world):
    tasks, demos, tok = world
    trajs = []
    for i, msgs in enumerate(demos[:2]):
        ids, mask = tok.encode_chat(msgs)
        turns = masked_runs(mask)
        ok = i == 0
        trajs.append(Trajectory(tasks[i].task_id, i, 0, 0, ids, mask, [0.0] * len(ids), float(ok), "ok", turns, "swe_mini", 0))
    stats = behaviour(trajs, tok)
    assert stats["turns_mean"] == 5 and stats["invalid_actions_per_episode"] == 0
    assert stats["calls/test"] == 2 and stats["calls/submit"] == 1 and stats["submitted_untested_frac"] == 0
    assert stats["claim_precision"] == 0.5 and stats["no_submission_frac"] == 0 and stats["wrong_path_frac"] == 0
    # the first demonstration again, its view of a file that is not there (the tool's answer says so)
    msgs = [dict(m) for m in demos[0]]
    view = next(i for i, m in enumerate(msgs) if m["role"] == "assistant" and "view" in str(m))
    msgs[view] = tool_call_message("view", {"path": "nope/util.py"})
    msgs[view + 1] = {"role": "tool", "content": "error: nope/util.py: no such file (the repository has: pkg/, tests/)"}
    ids, mask = tok.encode_chat(msgs)
    astray = Trajectory(tasks[0].task_id, 2, 0, 0, ids, mask, [0.0] * len(ids), 0.0, "ok", masked_runs(mask), "swe_mini", 0)
    stats = behaviour([*trajs, astray], tok)
    assert stats["wrong_path_frac"] == 1 / 3 and stats["calls/view"] == 1
    assert set(TOOLS) == {k.split("/")[1] for k in stats if k.startswith("calls/")}


@pytest.mark.parametrize("template,enable_thinking", [("tiny_hf", None), ("qwen3", None), ("qwen3", False)])
def test_a_checkpoint_template_renders_the_same_protocol(world, tmp_path, template, enable_thinking):
    """With a Hugging Face chat template (tiny_hf's Qwen-style imitation, the real Qwen3 template in
    both thinking modes), demonstrations carry structured tool calls that the template renders as
    `<tool_call>\\n{json}\\n</tool_call>`, and the tool schemas where the template has a place for
    them (Qwen3: its system turn). The demonstration begins with exactly the episode's prompt;
    replaying its trained turns through RepoEnv gives exactly the template's ids, and the env parses
    the template's own format."""
    from snowcat.stages.model.tiny_hf import hf_chat_tokenizer  # noqa: PLC0415 - transformers is slow to import
    from tests.qwen3_template import EMPTY_THINK, qwen3_tokenizer  # noqa: PLC0415

    tasks, _, _ = world
    task = tasks[0]
    msgs = teacher_messages(task, "repo", enable_thinking=enable_thinking)
    make = hf_chat_tokenizer if template == "tiny_hf" else qwen3_tokenizer
    tok = make([message_text(m) for m in msgs], tmp_path, vocab_size=600)
    ids, mask = tok.encode_chat(msgs)
    text = tok.decode(ids)
    assert '<tool_call>\n{"name": "view", "arguments": {"path": ' in text
    env = RepoEnv(tok, enable_thinking=enable_thinking)
    prompt = env.prompt(task)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])  # SFT trains after the very prompt the loop samples from
    if template == "qwen3":  # every tool's schema, as the template writes it, in the system turn before the statement
        head = tok.decode(prompt)
        assert head.startswith("<|im_start|>system\n# Tools\n") and head.index("</tools>") < head.index(task.prompt)
        for schema in TOOL_SCHEMAS:
            assert json.dumps(schema) in head
        think = head.endswith(f"<|im_start|>assistant\n{EMPTY_THINK}")
        assert think == (enable_thinking is False)  # thinking off: the template writes the empty think block itself
    else:  # no tools section: ids as without the declaration
        assert prompt == tok.render_prompt([user_message(task)])
    turns = [ids[a:b] for a, b in masked_runs(mask)]
    assert len(turns) == 5
    state = env.reset(task)
    try:
        rollout = env.prompt(task)
        for turn in turns:
            step = env.step(task, state, turn)
            rollout += turn + step.observation
        assert step.done and step.reward == 1.0
    finally:
        env.finish(state)
    # the whole conversation, up to the newline the template writes after the final <|im_end|>
    assert ids[: len(rollout)] == rollout and tok.decode(ids[len(rollout) :]).strip() == ""


def test_repo_env_in_a_sandbox_image_through_the_apptainer_test_double(world, tmp_path, monkeypatch):
    """On clusters episodes run in the sandbox image (ApptainerSandbox). Apptainer cannot run here:
    tests/fake_apptainer (a TEST DOUBLE) checks the arguments and runs the command on the host in
    the bound work dir, which is enough to show the env, the verifier and the infra path use it."""
    tasks, demos, tok = world
    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'fake_apptainer'}{os.pathsep}{os.environ['PATH']}")
    image = tmp_path / "sandbox.sif"
    image.write_text("FAKE-SIF {}\n")
    env = RepoEnv(tok, image=str(image))
    task, msgs = tasks[0], demos[0]
    state = env.reset(task)
    try:
        assert env.run_tool(state, "test", {}).startswith("exit 1")
        # the command ran through `apptainer exec ... IMAGE` (the double exports the image it was given)
        assert str(image) in env.run_tool(state, "bash", {"command": "echo $FAKE_APPTAINER_IMAGE"})
        for m in msgs[1:]:
            if m["role"] == "assistant":
                step = env.step(task, state, tok.encode(message_text(m)) + [tok.end_of_turn_id])
        assert step.done and step.reward == 1.0  # the verifier ran in the image too
    finally:
        env.finish(state)
    image.unlink()  # the image gone: the sandbox cannot start, which is infrastructure, not the model
    state = env.reset(task)
    try:
        with pytest.raises(RuntimeError, match="sandbox"):
            env.run_tool(state, "test", {})
    finally:
        env.finish(state)


def private_tempdir(tmp_path, monkeypatch):
    """Sandboxes made under a directory of this test's own (other tests make theirs in parallel)."""
    where = tmp_path / "tempdir"
    where.mkdir()
    monkeypatch.setenv("TMPDIR", str(where))
    monkeypatch.setattr(tempfile, "tempdir", str(where))
    return where
