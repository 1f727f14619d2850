"""The `teacher` stage with an OpenAI-compatible endpoint as the teacher (docs/recipes.md): a real vLLM
server (`python -m vllm.entrypoints.openai.api_server`, CPU) serves a tiny Hugging Face teacher taught
a few calculator episodes, behind an API key; the stage plays the training tasks turn by turn over
HTTP, its replies re-tokenised by the student's tokenizer (another one than the teacher's). Only
verified successes enter, with provenance that says the tokens are re-tokenised endpoint text; the
key never reaches the run directory; an unreachable endpoint is refused before any episode; an
endpoint failing mid-stage makes those episodes infra failures; a resumed stage equals an
uninterrupted one."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import snowcat.stages.agent.demos as demos_mod
import snowcat.stages.teacher as teacher
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, run_episodes, teacher_messages
from snowcat.stages.config import DEFAULT_VERIFIER
from snowcat.stages.model import save_model_dir
from snowcat.stages.model.tiny_hf import tiny_checkpoint
from snowcat.stages.rlcore.episodes import reward_verifier
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.rollout.endpoint import ChatEndpoint, EndpointEngine, EndpointError
from snowcat.stages.taskgen import demonstration, generate_domain, load_tasks, save_tasks, verify
from snowcat.stages.tokenizer import message_text
from tests.test_agent import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.xdist_group("teacher_endpoint")  # one worker starts the vLLM server once

KEY_ENV = "SNOWCAT_TEST_TEACHER_KEY"
MODEL = "tiny-teacher"
SMALL = dict(
    env="calculator",
    tokenizer="sft:final",
    limit=8,
    attempts=2,
    batch_size=8,
    max_turn_tokens=24,
    max_context=128,
    max_turns=2,
    verifier_timeout_s=0,  # in this process: no verifier worker to start
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _teach(model_dir: Path, conversations: list[list[dict]], steps: int = 60) -> None:
    """Teach the Hugging Face teacher the conversations by heart, as its chat template renders them."""
    import transformers  # noqa: PLC0415

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    encoded = [list(tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in conversations]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id)
    labels = torch.full((len(encoded), width), -100)
    for b, e in enumerate(encoded):
        ids[b, : len(e)], labels[b, : len(e)] = torch.tensor(e), torch.tensor(e)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """tasks/, sft/checkpoints/final (the student: its tokenizer renders the episodes) and hf/, the
    teacher: a tiny Qwen3 with its own tokenizer that learnt three of the played tasks' calculator
    episodes (it solves those, and fails others under the real verifier)."""
    root = tmp_path_factory.mktemp("endpoint_inputs")
    rng = np.random.default_rng(3)
    train = generate_domain(rng, "arith", [2], 20) + generate_domain(rng, "closure", [1], 20)
    save_tasks(root / "tasks", "train", train)
    torch.set_num_threads(1)
    tok = tiny_tokenizer(train)
    save_model_dir(root / "sft" / "checkpoints" / "final", tiny_model(tok), tok)
    played = demos_mod.domains_in_turn(train, SMALL["limit"])
    taught = [teacher_messages(t, "calculator") for t in played[:3]]
    texts = [t.prompt for t in train] + [demonstration(t) for t in train] + [message_text(m) for c in taught for m in c]
    tiny_checkpoint(root / "hf", texts, arch="qwen3", seed=1)
    _teach(root / "hf", taught)
    return root


@pytest.fixture(scope="module")
def server(inputs, tmp_path_factory):
    """vLLM's OpenAI-compatible server on the teacher, requiring the key in KEY_ENV; its URL."""
    key = "sk-test-" + secrets.token_hex(16)
    os.environ[KEY_ENV] = key
    port, scratch = _free_port(), tmp_path_factory.mktemp("vllm")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(scratch), "VLLM_API_KEY": key}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(inputs / "hf")]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"]
    cmd += ["--max-model-len", "512", "--seed", "0"]
    log = open(scratch / "server.log", "wb")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited {proc.returncode}: {(scratch / 'server.log').read_text()[-3000:]}")
            try:
                req = urllib.request.Request(url + "/models", headers={"Authorization": f"Bearer {key}"})
                urllib.request.urlopen(req, timeout=5).close()
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail("vLLM's server did not answer in 600 s")
                time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        os.environ.pop(KEY_ENV, None)


def endpoint_cfg(url: str, **over) -> dict:
    # vLLM: keep the teacher tokenizer's special tokens (<tool_call>) in the text; one request at a
    # time, so that the server's batches (and so its float sums) are the same in every run
    return {"url": url, "model": MODEL, "api_key_env": KEY_ENV, "concurrency": 1, "extra": {"skip_special_tokens": False}, **over}


def make_ctx(inputs: Path, run_dir: Path, url: str, cls=StageContext, endpoint: dict | None = None, **over):
    values = {**SMALL, "endpoint": endpoint or endpoint_cfg(url), **over}
    return cls.standalone("teacher", values, run_dir=run_dir, inputs={"tasks": inputs / "tasks", "sft": inputs / "sft"}, seed=9)


def demos_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "teacher" / demos_mod.DEMOS).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(inputs, server, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("endpoint_run")
    teacher.run(make_ctx(inputs, run_dir, server))
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_only_verified_successes_enter_as_re_tokenised_text_with_complete_provenance(inputs, server, straight):
    """The same episodes played apart through the endpoint engine (same seeds) and verified: the
    demonstrations are exactly its successes; each says whose text it is and that its tokens are
    the student's re-tokenisation of it."""
    from snowcat.stages.model.io import open_model_dir  # noqa: PLC0415

    demos, summary = demos_of(straight), json.loads((straight / "teacher" / "teacher.json").read_text())
    _, tok = open_model_dir(inputs / "sft" / "checkpoints" / "final")
    tasks = demos_mod.domains_in_turn(load_tasks(inputs / "tasks", "train"), SMALL["limit"])
    jobs = [EpisodeJob(t, group_id=i, attempt=a) for i, t in enumerate(tasks) for a in range(2)]
    observations = demos_mod.ObservationLog(tok)
    env, budget = CalculatorEnv(observations), Budget(128, 24, 2)
    client = ChatEndpoint(server, MODEL, api_key_env=KEY_ENV, concurrency=1, extra={"skip_special_tokens": False})
    engine = EndpointEngine(
        client, student_tok=observations, observations=observations, env=env, jobs=jobs, seed=9, budget=budget
    )
    params = SamplingParams(1.0, 0, 1.0, 24, (tok.end_of_turn_id,))
    trajs = run_episodes(
        engine, observations, jobs, env, params, budget, 9, 0, verifier=reward_verifier(DEFAULT_VERIFIER, "pass")
    )
    passed = {(t.task_id, t.attempt) for t in trajs if t.status == "ok" and t.passed}
    assert 0 < len(passed) < len(trajs) and summary["verified"] == len(passed) and summary["episodes"] == len(trajs)
    assert summary["kept"] + summary["duplicates"] + summary["cut_turns"] == len(passed) and summary["infra_failures"] == 0
    kept = {(d["task_id"], d["provenance"]["attempt"]) for d in demos}
    assert kept <= passed and len(kept) == summary["kept"] > 0
    assert summary["teacher"] == f"{MODEL} at {server}" and summary["teacher_sha256"] is None
    assert summary["tokens"] == "re-tokenised endpoint text" and summary["endpoint"]["identity"]["id"] == MODEL
    by_id = {t.task_id: t for t in tasks}
    for d in demos:
        p = d["provenance"]
        assert p["teacher"] == f"{MODEL} at {server}" and p["tokens"] == "re-tokenised endpoint text"
        assert p["endpoint"]["url"] == server and p["endpoint"]["model"] == MODEL
        assert p["endpoint"]["identity"] == {k: v for k, v in p["endpoint"]["identity"].items() if k != "created"}
        assert p["endpoint"]["identity"]["root"] == str(inputs / "hf")  # what vLLM says it serves
        assert [m for m, _ in p["answered_by"]] == [MODEL] and p["answered_by"][0][1].startswith("vllm-")
        assert p["tokenizer"] == tok.fingerprint() and p["tokenizer_ref"] == "sft:final" and p["seed"] == 9
        assert p["sampling"] == {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "engine": "endpoint",
            "extra": {"skip_special_tokens": False},
        }
        assert p["budget"] == {"max_context": 128, "max_turn_tokens": 24, "max_turns": 2} and p["env"] == "calculator"
        assert p["verdict"]["passed"] is True and p["verdict"]["status"] == "ok" and tasks[p["group_id"]].task_id == d["task_id"]
        assert d["messages"][0] == {"role": "user", "content": by_id[d["task_id"]].prompt}
        assert verify(by_id[d["task_id"]], d["messages"][-1]["content"]).passed
        # the demonstration is the student's ids of the episode, read back: the endpoint's text,
        # re-tokenised, and the observations as the environment wrote them
        episode = next(t for t in trajs if (t.task_id, t.attempt) == (d["task_id"], p["attempt"]))
        assert tok.decode(tok.encode_chat(d["messages"])[0]) == tok.decode(episode.token_ids)
    assert any("<tool_call>" in d["messages"][1]["content"] and len(d["messages"]) == 4 for d in demos)  # a tool-using turn
    assert len({d["id"] for d in demos}) == len(demos)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_api_key_never_reaches_the_run_directory(straight):
    key = os.environ[KEY_ENV].encode()
    files = [f for f in straight.rglob("*") if f.is_file()]
    assert files and not [f for f in files if key in f.read_bytes()]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_endpoint_that_cannot_be_reached_or_refuses_the_key_is_refused_before_any_episode(inputs, server, tmp_path):
    """One line naming the key; no episode played (no saved batch)."""
    closed = f"http://127.0.0.1:{_free_port()}/v1"
    cases = [
        (endpoint_cfg(closed), "stages.teacher.endpoint.url: cannot reach"),
        (endpoint_cfg(server, api_key_env="SNOWCAT_TEST_UNSET_KEY"), "stages.teacher.endpoint.api_key_env: environment variable"),
        (endpoint_cfg(server, model="other"), "stages.teacher.endpoint.model:"),
    ]
    os.environ["SNOWCAT_TEST_WRONG_KEY"] = "sk-wrong"
    cases.append((endpoint_cfg(server, api_key_env="SNOWCAT_TEST_WRONG_KEY"), "stages.teacher.endpoint.api_key_env:"))
    try:
        for i, (endpoint, start) in enumerate(cases):
            run_dir = tmp_path / str(i)
            with pytest.raises(UserError) as e:
                teacher.run(make_ctx(inputs, run_dir, server, endpoint=endpoint))
            assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
            assert not list((run_dir / "teacher").rglob("batch_*"))
    finally:
        os.environ.pop("SNOWCAT_TEST_WRONG_KEY")


class Gateway(http.server.ThreadingHTTPServer):
    """A gateway in front of the real server (as a site's proxy is): it forwards every request but
    the chat requests it is told to fail (`fail`: how many more, -1 = all), which it answers 503
    Service Unavailable, after `stall_s` (a client with a shorter timeout has given up by then)."""

    def __init__(self, upstream: str):
        self.upstream, self.fail, self.stall_s, self.lock = upstream, 0, 0.0, threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self, body: bytes | None):
                if self.path.endswith("/chat/completions") and outer.take_failure():
                    time.sleep(outer.stall_s)
                    self.send_error(503, "Service Unavailable")
                    return
                req = urllib.request.Request(outer.upstream + self.path.removeprefix("/v1"), data=body, method=self.command)
                for h in ("Authorization", "Content-Type"):
                    if self.headers.get(h):
                        req.add_header(h, self.headers[h])
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        code, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    code, data = e.code, e.read()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def take_failure(self) -> bool:
        with self.lock:
            if self.fail == 0:
                return False
            self.fail -= self.fail > 0
            return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


@pytest.fixture
def gateway(server):
    g = Gateway(server)
    thread = threading.Thread(target=g.serve_forever, daemon=True)
    thread.start()
    yield g
    g.shutdown()
    g.server_close()
    thread.join()


class _FailAfterFirstBatch(StageContext):
    gateway: Gateway

    def progress(self, done, total, **kw):
        self.gateway.fail = -1  # the endpoint goes down after the first batch
        super().progress(done, total, **kw)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("how", ["503", "time-out"])
def test_an_endpoint_failing_mid_stage_makes_those_episodes_infra_not_failures(inputs, straight, gateway, tmp_path, how):
    """The first batch is answered, every later request fails (503 after a retry, or no answer in
    timeout_s): those episodes are infra failures (out of the pass rate, no demonstrations), the
    first batch's demonstrations are the straight run's."""
    over = dict(retries=1, backoff_s=0) if how == "503" else dict(retries=0, timeout_s=5)
    gateway.stall_s = 0.0 if how == "503" else 6.0
    url = gateway.url
    ctx = make_ctx(inputs, tmp_path, url, cls=_FailAfterFirstBatch, endpoint=endpoint_cfg(url, **over), infra_retries=0)
    ctx.gateway = gateway
    metrics = teacher.run(ctx)
    summary = json.loads((tmp_path / "teacher" / "teacher.json").read_text())
    whole = json.loads((straight / "teacher" / "teacher.json").read_text())
    first = SMALL["batch_size"]
    assert summary["episodes"] == whole["episodes"] and summary["infra_failures"] == whole["episodes"] - first
    assert metrics["pass_rate"] == summary["verified"] / first  # infra failures are out of the rate
    early = [d for d in demos_of(straight) if d["provenance"]["group_id"] * 2 + d["provenance"]["attempt"] < first]
    strip = lambda ds: [(d["id"], d["provenance"]["verdict"]) for d in ds]  # noqa: E731
    assert strip(demos_of(tmp_path)) == strip(early)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_transient_failure_is_sent_again_and_answered(gateway):
    """Two 503s, then the answer: with retries=2 the reply is the real server's, as without them."""
    client = ChatEndpoint(gateway.url, MODEL, api_key_env=KEY_ENV, retries=2, backoff_s=0, concurrency=1)
    messages, params = [{"role": "user", "content": "12+34="}], SamplingParams(1.0, 0, 1.0, 8, ())
    plain = client.chat(messages, params, seed=5)
    gateway.fail = 2
    assert client.chat(messages, params, seed=5) == plain and gateway.fail == 0
    gateway.fail = 3
    with pytest.raises(EndpointError, match="HTTP 503 .* after 3 tries"):
        client.chat(messages, params, seed=5)


class _PreemptAfter(StageContext):
    def checkpoint_due(self) -> bool:
        return True


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_preempted_then_resumed_stage_equals_an_uninterrupted_one(inputs, server, straight, tmp_path):
    with pytest.raises(Preempted):
        teacher.run(make_ctx(inputs, tmp_path, server, cls=_PreemptAfter))
    assert len(list((tmp_path / "teacher" / "partial").glob("batch_*.json"))) == 1
    teacher.run(make_ctx(inputs, tmp_path, server))
    for name in (demos_mod.DEMOS, "teacher.json"):
        assert (tmp_path / "teacher" / name).read_bytes() == (straight / "teacher" / name).read_bytes()


def test_the_config_refuses_a_key_in_place_of_its_name_and_an_endpoint_without_a_tokenizer():
    """Bad endpoint settings: one line naming the key, when the config loads."""
    from snowcat.pipeline.config import stage_config  # noqa: PLC0415

    ok = {"url": "http://node1:8000/v1", "model": "m", "api_key_env": "SITE_KEY"}
    assert stage_config("teacher", {"needs": ["tasks", "sft"], "endpoint": ok, "tokenizer": "sft:final"}).endpoint.model == "m"
    for over, key in [
        ({"endpoint": {**ok, "api_key_env": "sk-abc123"}, "tokenizer": "sft:final"}, "endpoint.api_key_env"),
        ({"endpoint": ok}, "tokenizer"),
        ({"endpoint": ok, "tokenizer": "sft:final", "teacher": "sft:final"}, "teacher"),
        ({"endpoint": {**ok, "url": "node1:8000"}, "tokenizer": "sft:final"}, "endpoint.url"),
        # a key in the URL would be written into the provenance with it, and the message must not repeat it
        ({"endpoint": {**ok, "url": "http://u:s3cret@node1:8000/v1"}, "tokenizer": "sft:final"}, "endpoint.url"),
        ({"endpoint": {**ok, "url": "https://tok3n@node1/v1"}, "tokenizer": "sft:final"}, "endpoint.url"),
        ({"endpoint": {**ok, "url": "http://node1:8000/v1?api_key=s3cret"}, "tokenizer": "sft:final"}, "endpoint.url"),
        ({"endpoint": {**ok, "url": "http://node1:8000/v1#s3cret"}, "tokenizer": "sft:final"}, "endpoint.url"),
        ({"endpoint": {**ok, "extra": {"seed": 1}}, "tokenizer": "sft:final"}, "endpoint.extra"),
        ({"tokenizer": "sft:final", "teacher": "sft:final"}, "tokenizer"),
    ]:
        with pytest.raises(UserError, match=rf"^stages\.teacher\.{key}: [^\n]*$") as refused:
            stage_config("teacher", {"needs": ["tasks", "sft"], **over})
        assert "s3cret" not in str(refused.value) and "tok3n" not in str(refused.value)


CLI_CONFIG = """\
name: teacher-endpoint
seed: 9
executor: {{kind: local, max_parallel: 1}}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {{count: 12, val_count: 2, difficulties: [2]}}
  teacher:
    kind: teacher
    needs: [tasks]
    tokenizer: "hf:{tokenizer}"
    endpoint: {{url: "{url}", model: {model}, api_key_env: {key_env}, concurrency: 1, extra: {{skip_special_tokens: false}}}}
    env: calculator
    limit: 4
    attempts: 1
    batch_size: 4
    max_turn_tokens: 24
    max_context: 128
    max_turns: 2
    verifier_timeout_s: 0
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_through_the_cli_the_key_reaches_no_file_and_an_unreachable_endpoint_fails_with_one_line(inputs, server, tmp_path):
    """`snowcat run` end to end (the runner's logs, provenance and status included): no file of the run
    holds the key; with the endpoint down, the stage fails as bad input does (exit 2), one line naming the key."""
    from tests.conftest import Snowcat  # noqa: PLC0415

    fill = dict(tokenizer=inputs / "sft" / "checkpoints" / "final", model=MODEL, key_env=KEY_ENV)
    good = tmp_path / "good.yaml"
    good.write_text(CLI_CONFIG.format(url=server, **fill))
    Snowcat(tmp_path)("run", good, "--run-dir", tmp_path / "good", timeout=900, check=True)
    assert json.loads((tmp_path / "good" / "stages" / "teacher" / "teacher.json").read_text())["episodes"] == 4
    key = os.environ[KEY_ENV].encode()
    files = [f for f in (tmp_path / "good").rglob("*") if f.is_file()]
    assert len(files) > 10 and not [f for f in files if key in f.read_bytes()]

    down = tmp_path / "down.yaml"
    down.write_text(CLI_CONFIG.format(url=f"http://127.0.0.1:{_free_port()}/v1", **fill))
    proc = Snowcat(tmp_path)("run", down, "--run-dir", tmp_path / "down", timeout=900)
    assert proc.returncode != 0
    # the runner's UserError path (exit 2): one line in the unit's log, no traceback (that is exit 1's)
    log = (tmp_path / "down" / "logs" / "teacher.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert (
        len(errors) == 1 and errors[0].startswith("error: stages.teacher.endpoint.url: cannot reach") and "Traceback" not in log
    )
    stage = json.loads(Snowcat(tmp_path)("status", tmp_path / "down", "--json").stdout)["stages"]["teacher"]
    assert stage["status"] == "failed" and stage["error"].startswith("UserError: stages.teacher.endpoint.url: cannot reach")
    assert not list((tmp_path / "down" / "stages" / "teacher").rglob("batch_*"))
