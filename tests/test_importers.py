"""Importers round trip: a SWE-bench JSONL row over a local clone, a Harbor task directory, and an
external OpenAI-style agent trace, each judged or parsed by the same code the pipeline runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from snowcat.stages.agent.repo_env import parse_tool_call
from snowcat.stages.agent.traces import TraceError, import_traces
from snowcat.stages.taskgen import verify
from snowcat.stages.taskgen.importers import TaskImportError, import_harbor, import_swebench
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, snapshot_files
from snowcat.stages.tokenizer import message_text
from tests.qwen3_template import qwen3_tokenizer

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="verifies in LocalSandbox as root"
)


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def swebench(tmp_path):
    """A local clone `acme__calc` (base commit: the bug; a later fix commit the agent must not see) and a JSONL row."""
    clone = tmp_path / "repos" / "acme__calc"
    clone.mkdir(parents=True)
    _git(clone, "init", "-q", "-b", "main")
    _git(clone, "config", "user.email", "t@example.com")
    _git(clone, "config", "user.name", "t")
    (clone / "calc").mkdir()
    (clone / "calc" / "__init__.py").write_text("")
    (clone / "calc" / "ops.py").write_text("def add(a, b):\n    return a - b  # bug\n")
    (clone / "tests").mkdir()
    (clone / "tests" / "__init__.py").write_text("")
    (clone / "tests" / "test_old.py").write_text(
        "import unittest\nfrom calc.ops import add\n\nclass T(unittest.TestCase):\n    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n"
    )
    _git(clone, "add", ".")
    _git(clone, "commit", "-qm", "base")
    base = _git(clone, "rev-parse", "HEAD")
    (clone / "calc" / "ops.py").write_text("def add(a, b):\n    return a + b  # THE FIX\n")
    _git(clone, "commit", "-qam", "fix")
    gold = make_patch(
        {"calc/ops.py": b"def add(a, b):\n    return a - b  # bug\n"}, {"calc/ops.py": b"def add(a, b):\n    return a + b\n"}
    )
    new_test = "import unittest\nfrom calc.ops import add\n\nclass N(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
    test_patch = make_patch({}, {"tests/test_new.py": new_test.encode()})
    row = {
        "instance_id": "acme__calc-1",
        "repo": "acme/calc",
        "base_commit": base,
        "problem_statement": "add() subtracts",
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps(["tests.test_new.N.test_add"]),
        "PASS_TO_PASS": json.dumps(["tests.test_old.T.test_zero"]),
        "difficulty": "<15 min fix",
    }
    path = tmp_path / "swe.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path, tmp_path / "repos", row


def test_swebench_import_refers_to_the_local_clone_without_history(swebench):
    path, repos, row = swebench
    (task,) = import_swebench(path, repos, test_command="python3 -m unittest -v {tests}")
    spec = RepoSpec.from_task(task)
    assert (task.task_id, task.difficulty, task.prompt, task.answer) == ("acme__calc-1", 1, "add() subtracts", row["patch"])
    assert spec.source == {"git": str((repos / "acme__calc").resolve()), "base_commit": row["base_commit"]}
    assert (spec.fail_to_pass, spec.pass_to_pass) == (["tests.test_new.N.test_add"], ["tests.test_old.T.test_zero"])
    files = snapshot_files(spec)
    assert b"a - b" in files["calc/ops.py"] and "tests/test_new.py" not in files  # base state; hidden tests hidden
    assert not any(p.startswith(".git") for p in files) and not any(b"THE FIX" in b for b in files.values())


@needs_sandbox
def test_swebench_task_is_judged_by_its_hidden_tests(swebench):
    path, repos, row = swebench
    (task,) = import_swebench(path, repos, test_command="python3 -m unittest -v {tests}")
    assert verify(task, task.answer).passed
    empty = verify(task, "")
    assert not empty.passed and "FAIL_TO_PASS 1/1" in empty.detail


def test_swebench_import_errors_name_the_row(swebench, tmp_path):
    path, repos, row = swebench
    with pytest.raises(TaskImportError, match=rf"{path}:1: no local clone of acme/calc .*prestage"):
        import_swebench(path, tmp_path / "elsewhere")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({k: v for k, v in row.items() if k != "base_commit"}) + "\n")
    with pytest.raises(TaskImportError, match=rf"{bad}:1: missing base_commit"):
        import_swebench(bad, repos)
    bad.write_text(json.dumps(row | {"base_commit": "0" * 40}) + "\n")
    with pytest.raises(TaskImportError, match="does not hold base_commit"):
        import_swebench(bad, repos)


@pytest.fixture
def harbor(tmp_path):
    root = tmp_path / "fix-greeting"
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "solution").mkdir()
    (root / "instruction.md").write_text("Make greet.sh print 'hello world'.\n")
    (root / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty = "medium"\n[verifier]\ntimeout_sec = 20.0\n[agent]\ntimeout_sec = 60.0\n'
        '[environment]\nmemory = "1G"\n'
    )
    (root / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY greet.sh /app/greet.sh\n")
    (root / "environment" / "greet.sh").write_text("echo 'hello wrld'\n")
    (root / "tests" / "test.sh").write_text(  # as Harbor's tests do: the verdict is the reward file
        'if [ "$(sh greet.sh)" = "hello world" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    (root / "solution" / "solve.sh").write_text("sed -i 's/wrld/world/' greet.sh\n")
    return root


def test_harbor_import(harbor):
    task = import_harbor(harbor)
    spec = RepoSpec.from_task(task)
    assert task.difficulty == 2 and task.prompt.startswith("Make greet.sh") and task.verifier == "repo"
    assert spec.source == {"files": {"greet.sh": "echo 'hello wrld'\n"}}  # the build context, not the Dockerfile
    assert spec.test_paths == ["tests/test.sh"] and "tests/test.sh" in spec.test_patch and spec.memory_mb == 1024
    assert spec.timeout_s == 20.0 and task.meta["agent_timeout_s"] == 60.0 and "sed -i" in task.meta["solution"]
    assert "From: python:3.11-slim" in task.meta["apptainer_recipe"]
    (harbor / "task.toml").write_text("not [toml")
    with pytest.raises(TaskImportError, match="task.toml"):
        import_harbor(harbor)
    with pytest.raises(TaskImportError, match="not a Harbor task"):
        import_harbor(harbor / "tests")


@needs_sandbox
def test_harbor_task_is_judged_by_its_test_script(harbor):
    task = import_harbor(harbor)
    fixed = make_patch({"greet.sh": b"echo 'hello wrld'\n"}, {"greet.sh": b"echo 'hello world'\n"})
    assert verify(task, fixed).passed
    assert not verify(task, "").passed
    # an agent that writes its own tests/test.sh gains nothing: the verifier's copy replaces it
    cheat = make_patch({}, {"tests/test.sh": b"exit 0\n"})
    assert not verify(task, cheat).passed


def test_trace_import_round_trip(tmp_path):
    trace = {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": [{"type": "text", "text": "Fix add()."}]},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "view", "arguments": '{"path": "calc/ops.py"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1 def add(a, b):"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "submit", "arguments": {}}}]},
        ]
    }
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(trace) + "\n\n" + json.dumps(trace["messages"]) + "\n")
    convs = import_traces(path)
    assert len(convs) == 2 and convs[0] == convs[1]
    msgs = convs[0]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "Fix add()." and msgs[2]["content"] == "Let me look."
    assert msgs[2]["tool_calls"] == [{"type": "function", "function": {"name": "view", "arguments": {"path": "calc/ops.py"}}}]
    # snowcat's template renders them in the protocol RepoEnv parses
    assert message_text(msgs[2]).startswith("Let me look.<tool_call>")
    assert parse_tool_call(message_text(msgs[2])) == ("view", {"path": "calc/ops.py"})
    assert parse_tool_call(message_text(msgs[4])) == ("submit", {})
    assert message_text(msgs[3]) == "<tool_result>1 def add(a, b):</tool_result>"
    path.write_text(
        '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "bash", "arguments": "{oops"}}]}]}\n'
    )
    with pytest.raises(TraceError, match=rf"{path}:1: message 0: tool call arguments are not JSON"):
        import_traces(path)
    path.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(TraceError, match="message 0: role must be"):
        import_traces(path)


def test_a_traces_tools_reach_the_checkpoints_template(tmp_path):
    """A trace row's `tools` (the schemas its agent was offered) open the conversation as a template
    declaration: Qwen3's template lists them in the system turn SFT trains after; without them, no
    tools section."""
    view = {
        "name": "view",
        "description": "Show a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    messages = [
        {"role": "user", "content": "Fix add()."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "view", "arguments": {"path": "ops.py"}}}]},
        {"role": "tool", "content": "def add(a, b):"},
        {"role": "assistant", "content": "Done."},
    ]
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": [{"type": "function", "function": view}]}) + "\n")
    path.write_text(path.read_text() + json.dumps({"messages": messages, "tools": [view]}) + "\n" + json.dumps(messages) + "\n")
    with_tools, bare_form, without = import_traces(path)
    assert with_tools[0] == {"role": "template", "tools": [{"type": "function", "function": view}]} == bare_form[0]
    assert with_tools[1:] == without and without[0]["role"] == "user"
    qwen3 = qwen3_tokenizer(["Fix add().", "Done.", "def add(a, b):", "Show a file."], tmp_path / "qwen3")
    (ids, mask), (plain, plain_mask) = qwen3.encode_chat(with_tools), qwen3.encode_chat(without)
    text = qwen3.decode(ids)
    assert "<tools>" in text and '"name": "view"' in text and "<tools>" not in qwen3.decode(plain)
    assert sum(mask) == sum(plain_mask)  # the declaration adds prompt, not trained tokens
    path.write_text(json.dumps({"messages": messages, "tools": [{"type": "function"}]}) + "\n")
    with pytest.raises(TraceError, match=rf"{path}:1: tools\[0\] needs function.name"):
        import_traces(path)
