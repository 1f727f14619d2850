"""RepoEnv: a coding agent fixing a repository task with tools, each episode in its own sandbox.

The model calls a tool per turn in the tool-call format of its chat template (Hermes/Qwen style):

    <tool_call>{"name": "edit", "arguments": {"path": "pkg/core.py", "old": "a - b", "new": "a + b"}}</tool_call>

Tools (`TOOL_SCHEMAS`, OpenAI function schemas: the one table the chat template's `tools=`, the
parser and the statement's one-line hint come from):
    bash   {"command": str}                 run a shell command in the repository (the sandbox)
    view   {"path": str}                    the file with line numbers
    edit   {"path": str, "old": str, "new": str}   replace the one occurrence of `old`
    test   {}                               run the task's visible tests (`visible_tests`)
    submit {}                               end the episode: the patch is judged by the verifier

Every conversation opens with a template declaration (`opening`): a checkpoint's template renders
the schemas (Qwen3: `# Tools` and `<tools>` in its system turn) and `enable_thinking` when set;
snowcat's own template has no tools section and shows the hint in the statement alone.

Each result comes back as a tool message, cut to `observation_chars` (head and tail kept). A turn
without a parseable call gets an error message and the episode goes on (counted as an invalid
action by `behaviour`); the budget ends it if the model never recovers. On submit the env verifies
the patch itself (`verify_patch`: clean sandbox, test files restored) and sets the reward, so
verification runs in parallel with the other episodes' tool calls. A sandbox that cannot start and
a verifier time-out raise: the loop records `infra_error`, never a model failure.

`view` and `edit` run in the parent on the work dir (path checked to stay inside, symlinks never
followed); `bash` and `test` run in the sandbox (no network, only the work dir writable, whole-call
limits: docs/containers.md).

No answer key in the agent's view: the work dir is the snapshot (the test patch is applied by the
verifier alone), and `test` runs only the visible tests — the FAIL_TO_PASS/PASS_TO_PASS ids whose
test file is in the snapshot and untouched by the test patch, or the task's own list
(`meta["visible_tests"]`) — so no tool result, prompt or demonstration names a hidden test or shows
its body. With no visible test, `test` says so (`NO_VISIBLE_TESTS`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from pathlib import Path

from snowcat.stages.agent.envs import ACTION, ANSWER, INVALID, SingleTurnEnv, Step, _strip_stop
from snowcat.stages.sandbox import WORKSPACE, Limits, open_sandbox, write_files
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, patched_paths, read_tree, snapshot_files, verify_patch
from snowcat.stages.tokenizer import TEMPLATE_ROLE, render_tool_call


def _function(name: str, description: str, **args: str) -> dict:
    """An OpenAI-style function schema whose arguments are all required strings."""
    properties = {a: {"type": "string", "description": d} for a, d in args.items()}
    parameters = {"type": "object", "properties": properties, "required": list(args)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


# The tool table: what the chat template shows the model (`tools=`), what parse_tool_call checks,
# and the one-line hint in the problem statement (all snowcat's own template shows).
TOOL_SCHEMAS = [
    _function(
        "bash",
        "Run a shell command from the repository root (no network; only the repository is writable).",
        command="the shell command",
    ),
    _function("view", "Show a file of the repository with line numbers.", path="the file's path from the repository root"),
    _function(
        "edit",
        "Replace the one occurrence of `old` in a file by `new`.",
        path="the file's path from the repository root",
        old="text that occurs exactly once in the file",
        new="what replaces it",
    ),
    _function("test", "Run the task's visible tests and show their output (the verifier runs hidden tests too)."),
    _function("submit", "End the episode: the changes are judged by the task's tests."),
]
TOOL_ARGS = {s["function"]["name"]: tuple(s["function"]["parameters"]["required"]) for s in TOOL_SCHEMAS}
TOOLS = tuple(TOOL_ARGS)
TOOL_HINT = "Tools: " + ", ".join(f"{name}({', '.join(args)})" for name, args in TOOL_ARGS.items()) + "."


def user_message(task) -> dict:
    """The episode's first turn: the problem statement and the tools (the prompt and the demonstrations' start)."""
    return {"role": "user", "content": f"{task.prompt}\n{TOOL_HINT}"}


def template_kwargs(enable_thinking: bool | None = None) -> dict:
    """The chat template's keyword arguments of a repository episode: the tool schemas and, when
    set, `enable_thinking` (None: the template's own default)."""
    return {"tools": TOOL_SCHEMAS, **({} if enable_thinking is None else {"enable_thinking": enable_thinking})}


def tool_call_message(name: str, arguments: dict | None = None) -> dict:
    """An assistant turn that calls one tool (OpenAI form: each tokenizer renders it in its template's format)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments or {}}}],
    }


def tool_call_text(name: str, arguments: dict | None = None) -> str:
    """A tool call as snowcat's template renders it (`<tool_call>{json}</tool_call>`)."""
    return render_tool_call({"function": {"name": name, "arguments": arguments or {}}})


NO_VISIBLE_TESTS = "no visible tests: run your own with bash"
NO_SUCH_FILE = "no such file"  # what view and edit answer for a path that is not a file (behaviour counts it)


def visible_tests(task, base: dict[str, bytes]) -> list[str]:
    """The test ids the agent's `test` tool runs: `meta["visible_tests"]` when the task names them;
    else the FAIL_TO_PASS + PASS_TO_PASS ids whose test file is in the snapshot `base` and not
    touched by the test patch (a test patch that adds or changes a file hides every id in it: the
    agent's copy of a changed file is the snapshot's, so those ids are not the tests it can run)."""
    if task.meta.get("visible_tests") is not None:
        return list(dict.fromkeys(str(t) for t in task.meta["visible_tests"]))
    spec = RepoSpec.from_task(task)
    hidden = set(patched_paths(spec.test_patch))
    known = set(base) | hidden
    out = []
    for test_id in dict.fromkeys(spec.fail_to_pass + spec.pass_to_pass):
        path = _test_file(test_id, known)
        if path is not None and path in base and path not in hidden:
            out.append(test_id)
    return out


def _test_file(test_id: str, known: set[str]) -> str | None:
    """The file that defines a test id, among `known` paths (the snapshot's and the test patch's):
    a path (pytest `path::name`, a script `tests/test.sh`), or unittest's `module[.Class[.test]]`
    (the longest dotted prefix that is a module of `known`, followed by at most a class and a test).
    None when no file defines it."""
    if "::" in test_id or "/" in test_id or test_id.endswith(".py"):
        return test_id.split("::", 1)[0].removeprefix("./")
    parts = test_id.split(".")
    for k in range(len(parts), 0, -1):
        stem = "/".join(parts[:k])
        for path in (f"{stem}.py", f"{stem}/__init__.py"):
            if path in known:
                return path if len(parts) - k <= 2 else None
    return None


class ToolCallError(ValueError):
    """The model's turn is not one well-formed call of a known tool."""


def parse_tool_call(text: str) -> tuple[str, dict]:
    """(name, arguments) of the one tool call in an assistant turn's text."""
    m = re.search(r"<tool_call>(.*?)</tool_call>", text, re.S)
    if m is None:
        raise ToolCallError("no tool call found; call one tool per turn, or submit()")
    try:
        call = json.loads(m.group(1).strip())
    except json.JSONDecodeError as e:
        raise ToolCallError(f"tool call is not JSON: {e.msg}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('tool call must be {"name": ..., "arguments": {...}}')
    name, args = call["name"], call.get("arguments") or {}
    if name not in TOOLS:
        raise ToolCallError(f"unknown tool {name!r}; tools: {', '.join(TOOLS)}")
    if not isinstance(args, dict):
        raise ToolCallError("arguments must be an object")
    missing = [k for k in TOOL_ARGS[name] if not isinstance(args.get(k), str)]
    if missing:
        raise ToolCallError(f"{name} needs string argument(s) {', '.join(missing)}")
    return name, args


def clip(text: str, chars: int) -> str:
    """`text` cut to about `chars` characters, keeping its head and tail (errors are often at the end)."""
    if len(text) <= chars:
        return text
    head = chars * 2 // 3
    tail = chars - head
    return f"{text[:head]}\n[... {len(text) - chars} characters cut ...]\n{text[-tail:]}"


class RepoEnv(SingleTurnEnv):
    name = "repo"
    answers_invalid_actions = True  # an unparseable call gets an error message; the model may recover

    def __init__(
        self,
        tokenizer,
        image: str | None = None,
        observation_chars: int = 1000,
        tool_timeout_s: float = 30.0,
        enable_thinking: bool | None = None,
    ):
        super().__init__(tokenizer)
        self.image = image
        self.observation_chars = observation_chars
        self.tool_timeout_s = tool_timeout_s
        self.template = template_kwargs(enable_thinking)
        self.parallel = True  # the loop may run step() of different episodes at once

    def opening(self, task) -> list[dict]:
        """The conversation's start: the template declaration (tools, enable_thinking), then the
        problem statement. The prompt and every demonstration begin with it."""
        return [{"role": TEMPLATE_ROLE, **self.template}, user_message(task)]

    def prompt(self, task) -> list[int]:
        return self.tok.render_prompt(self.opening(task))

    def note(self, text: str) -> list[int]:
        return self.tok.observation_ids("tool", text, template=self.template)

    def reset(self, task) -> dict:
        spec = RepoSpec.from_task(task)
        base = snapshot_files(spec)
        visible = visible_tests(task, base)
        image = task.meta.get("sandbox_image") or self.image  # the task's own image first
        limits = Limits(cpu_s=int(spec.timeout_s) + 1, memory_bytes=spec.memory_mb << 20)
        sandbox = open_sandbox(image, limits, inside=spec.workdir or WORKSPACE)  # SWE-bench images: /testbed
        write_files(sandbox.workdir, base)
        return {"spec": spec, "base": base, "sandbox": sandbox, "visible": visible}

    def finish(self, state: dict) -> None:
        if "sandbox" in state:
            state.pop("sandbox").close()

    def step(self, task, state: dict, turn_ids: list[int]) -> Step:
        text = self.tok.decode(_strip_stop(self.tok, turn_ids))
        try:
            name, args = parse_tool_call(text)
        except ToolCallError as e:
            return Step(done=False, observation=self.note(f"error: {e}"))
        if name == "submit":
            return self.submit(task, state)
        return Step(done=False, observation=self.note(self.run_tool(state, name, args)))

    def turn_kind(self, task, turn_ids: list[int]) -> str:
        try:
            name, _ = parse_tool_call(self.tok.decode(_strip_stop(self.tok, turn_ids)))
        except ToolCallError:
            return INVALID
        return ANSWER if name == "submit" else ACTION

    def submit(self, task, state: dict) -> Step:
        patch = make_patch(state["base"], read_tree(state["sandbox"].workdir))
        reward, _, detail = verify_patch(task, patch, image=self.image, base=state["base"])
        return Step(done=True, answer=patch, reward=reward, detail=detail)

    def run_tool(self, state: dict, name: str, args: dict) -> str:
        """The observation text of one non-submit tool call."""
        sb, spec = state["sandbox"], state["spec"]
        if name in ("view", "edit"):
            try:
                path = self._inside(sb.workdir, args["path"])
            except ValueError as e:
                return clip(f"error: {e}", self.observation_chars)
            if name == "view":
                lines = path.read_text(errors="replace").splitlines()
                return clip("\n".join(f"{i:>3} {line}" for i, line in enumerate(lines, 1)), self.observation_chars)
            return self._edit(path, args["old"], args["new"], sb)
        if name == "test" and not state["visible"]:
            return NO_VISIBLE_TESTS
        cmd = args["command"] if name == "bash" else spec.command(state["visible"])
        if spec.env_setup.strip():  # the image's environment (SWE-bench: its conda env), as the verifier has it
            cmd = f"{spec.env_setup}\n{cmd}"
        r = sb.run(cmd, timeout_s=min(self.tool_timeout_s, spec.timeout_s))
        if r.status == "infra_error":
            raise RuntimeError(f"sandbox: {r.detail}")  # the loop records infra_error
        status = f"exit {r.exit_code}" if r.status == "ok" else f"{r.status}: {r.detail}"
        out = f"{status}\n{r.stdout}{r.stderr}".rstrip()
        if name == "test":  # test runners print their wall time: keep demonstrations reproducible
            out = re.sub(r"(Ran \d+ tests?) in [\d.]+s", r"\1", out)
        return clip(out, self.observation_chars)

    @staticmethod
    def _inside(root: Path, rel: str) -> Path:
        path, top = root / rel, root.resolve()
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(top) or path.is_symlink():
            raise ValueError(f"{rel}: outside the repository")
        if not path.is_file():
            what = "a directory" if real.is_dir() else NO_SUCH_FILE
            raise ValueError(f"{rel}: {what}{RepoEnv._nearest_listing(top, real)}")
        return path

    @staticmethod
    def _nearest_listing(root: Path, real: Path, most: int = 20) -> str:
        """What the nearest directory at or above a missing file holds (`real`: resolved, inside `root`), as
        agent tools answer a wrong path: a model that guessed a module's name can read the right one.
        ` (pkg/ has: a.py, b/)`."""
        here = real if real.is_dir() else real.parent
        while here != root and not here.is_dir():
            here = here.parent
        names = sorted(p.name + "/" * p.is_dir() for p in here.iterdir() if not p.name.startswith("."))
        shown = ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")
        where = f"{here.relative_to(root)}/" if here != root else "the repository"
        return f" ({where} has: {shown or 'nothing'})"

    @staticmethod
    def _edit(path: Path, old: str, new: str, sb) -> str:
        text = path.read_text(errors="replace")
        n = text.count(old) if old else 0
        if n != 1:
            return f"error: `old` occurs {n} times in {path.relative_to(sb.workdir)}; it must occur exactly once"
        path.write_text(text.replace(old, new, 1))
        return f"edited {path.relative_to(sb.workdir)}"


# ---------------------------------------------------------------- the scripted expert


def gold_edit(task, base: dict[str, bytes]) -> tuple[str, str, str]:
    """(path, old, new) of the smallest edit that applies the gold patch's (first) hunk, unique in the
    file (`base`: the task's snapshot)."""
    hunk = re.search(r"^\+\+\+ b/(\S+)\n@@[^\n]*@@\n(.*?)(?=^@@|^diff |\Z)", task.answer, re.S | re.M)
    if hunk is None:
        raise ValueError(f"task {task.task_id}: no gold patch hunk")
    path, body = hunk.group(1), hunk.group(2).splitlines()
    changed = [i for i, line in enumerate(body) if line[:1] in "+-"]
    lo, hi = changed[0], changed[-1] + 1
    source = base[path].decode()

    def sides(lo: int, hi: int) -> tuple[str, str]:
        old = [line[1:] for line in body[lo:hi] if line[:1] in " -"]
        new = [line[1:] for line in body[lo:hi] if line[:1] in " +"]
        return "\n".join(old) + "\n", "\n".join(new) + "\n"

    old, new = sides(lo, hi)
    while (not old.strip() or source.count(old) != 1) and (lo > 0 or hi < len(body)):
        lo, hi = max(0, lo - 1), min(len(body), hi + (lo == 0))
        old, new = sides(lo, hi)
    return path, old, new


def solution_command(script: str) -> str:
    """A gold script (Harbor's solve.sh) as one `bash` tool call: run by bash, as the verifier runs it."""
    return f"bash <<'SNOWCAT_SOLUTION'\n{script.rstrip()}\nSNOWCAT_SOLUTION"


# where the expert's detour looks first: module names the agent demo's model guesses for a module it did not read
DETOUR_NAMES = ("core.py", "util.py", "utils.py", "helpers.py", "stats.py", "main.py")


def detour_path(task, path: str, base: dict[str, bytes]) -> str | None:
    """A file beside `path` that is not in the task's snapshot (the first of `DETOUR_NAMES`, from a
    place the task id picks), or None when all of them are there."""
    folder = path.rpartition("/")[0]
    at = int(hashlib.sha256(task.task_id.encode()).hexdigest(), 16) % len(DETOUR_NAMES)
    for name in DETOUR_NAMES[at:] + DETOUR_NAMES[:at]:
        wrong = f"{folder}/{name}" if folder else name
        if wrong not in base:
            return wrong
    return None


def picked(task, share: float, why: str) -> bool:
    """Whether `task` is among a `share` of tasks picked for `why` ("detour", "explore"): by the task
    id, so the same whatever the order or number of tasks, and independently for each `why`."""
    return int(hashlib.sha256(f"{why}:{task.task_id}".encode()).hexdigest()[:8], 16) < share * 2**32


def teacher_episode(task, env: RepoEnv, detour: bool = False, explore: bool = False) -> list[dict]:
    """The expert's demonstration as chat messages, every observation produced by the real tools:
    run the (visible) tests, view the module, edit, run the tests again, submit. A task with no gold
    patch but a gold script (Harbor's solve.sh, `meta["solution"]`): run the tests, run the script
    with `bash`, submit.

    With `detour`, the expert first views a file beside the module that is not there
    (`detour_path`), reads the tool's answer (what the folder holds) and views the module: the
    recovery is trained, the wrong call is not (`"train": False`), so SFT teaches reading an
    error without teaching the mistake. The agent demo's SFT models fail most episodes on a wrong
    module name they never recover from (docs/agents.md).

    With `explore`, the expert reads the first visible test module after the first test run, a
    trained call like the others: harmless in the expert's unbounded context, a few hundred tokens
    that a student with a small context budget cannot spare (the habit the agent demo's RL unlearns)."""
    state = env.reset(task)
    try:
        if not task.answer.strip() and task.meta.get("solution", "").strip():
            calls = [("test", {}, True), ("bash", {"command": solution_command(task.meta["solution"])}, True)]
        else:
            path, old, new = gold_edit(task, state["base"])
            calls = [("test", {}, True)]
            if explore and state["visible"] and (tests := _test_file(state["visible"][0], set(state["base"]))):
                calls.append(("view", {"path": tests}, True))
            if detour and (wrong := detour_path(task, path, state["base"])):
                calls.append(("view", {"path": wrong}, False))  # the detour: context for the recovery, not taught
            calls += [("view", {"path": path}, True), ("edit", {"path": path, "old": old, "new": new}, True), ("test", {}, True)]
        messages = env.opening(task)
        for name, args, train in calls:
            messages.append(tool_call_message(name, args))
            if not train:
                messages[-1]["train"] = False
            messages.append({"role": "tool", "content": env.run_tool(state, name, args)})
        step = env.submit(task, state)
        if step.reward != 1.0:
            raise RuntimeError(f"task {task.task_id}: the scripted expert's patch does not pass")
        messages.append(tool_call_message("submit"))
        return messages
    finally:
        env.finish(state)


# ---------------------------------------------------------------- behaviour, read back from the tokens


def behaviour(trajectories, tokenizer) -> dict:
    """What agents did, from the sampled turns (and, for a view or edit, the tool's answer): turns,
    tool calls by kind, invalid actions, repeated identical commands, files named that do not exist,
    submissions without a test run before, context exhaustion, and claim precision (passed among
    submitted)."""
    calls: Counter = Counter()
    out = Counter()
    for t in trajectories:
        seen, tested, submitted, wrong_path = set(), False, False, False
        out["episodes"] += 1
        out["turns"] += len(t.turn_boundaries)
        starts = [s for s, _ in t.turn_boundaries[1:]] + [len(t.token_ids)]
        for (start, end), after in zip(t.turn_boundaries, starts):
            text = tokenizer.decode(_strip_stop(tokenizer, [int(i) for i in t.token_ids[start:end]]))
            try:
                name, args = parse_tool_call(text)
            except ToolCallError:
                out["invalid_actions"] += 1
                continue
            calls[name] += 1
            key = json.dumps([name, args], sort_keys=True)
            out["repeated_calls"] += key in seen and name != "test"
            seen.add(key)
            if name in ("view", "edit") and not wrong_path:  # the tool's answer: the ids up to the next turn
                wrong_path = NO_SUCH_FILE in tokenizer.decode([int(i) for i in t.token_ids[end:after]])
            if name == "test" or (name == "bash" and "test" in args.get("command", "")):
                tested = True
            if name == "submit":
                submitted = True
                out["submitted"] += 1
                out["submitted_untested"] += not tested
                out["submitted_passed"] += t.reward >= 1.0
        out["context_exhausted"] += t.status == "truncated" and "context" in t.detail
        out["no_submission"] += not submitted
        out["wrong_path"] += wrong_path
    n = max(out["episodes"], 1)
    res = {
        "episodes": out["episodes"],
        "turns_mean": out["turns"] / n,
        "invalid_actions_per_episode": out["invalid_actions"] / n,
        "repeated_calls_per_episode": out["repeated_calls"] / n,
        "context_exhausted_frac": out["context_exhausted"] / n,
        "wrong_path_frac": out["wrong_path"] / n,  # episodes that viewed or edited a file not there
        "no_submission_frac": out["no_submission"] / n,
        "submitted_untested_frac": out["submitted_untested"] / max(out["submitted"], 1),
        "claim_precision": out["submitted_passed"] / out["submitted"] if out["submitted"] else None,
    }
    res.update({f"calls/{k}": calls[k] / n for k in TOOLS})
    return res
