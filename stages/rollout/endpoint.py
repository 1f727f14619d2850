"""An OpenAI-compatible chat endpoint as a teacher (`teacher` stage, `endpoint:`; docs/recipes.md).

`ChatEndpoint` speaks `/v1/chat/completions` and `/v1/models` over HTTP (the standard library's
client: nothing to install on a compute node): a vLLM server inside the allocation, or a site's
inference service. It takes chat messages and returns text: the endpoint's tokenizer is not ours.

`EndpointEngine` is what the agent loop samples from for one batch of episodes: per request it reads
the episode so far (the student's ids) back as chat messages (stages/agent/demos.py), sends them,
and returns the reply's text encoded by the student's tokenizer, closed by the student's end of
turn when the endpoint stopped on its own. The turn budget is counted in the student's tokens: a
reply longer than the turn's `max_tokens` is cut there and ends `length`, as a sampled turn would.
The returned logprobs are zeros: the teacher's probabilities of the student's tokens do not exist
(SFT does not read them; RL must not be given an endpoint teacher).

Failures: a request that cannot connect, times out, or is answered 429 or 5xx is sent again
`retries` times (after `backoff_s`, doubled each time); then `EndpointError` (an `EngineError`), which
the loop counts as infrastructure for the episodes of that call, never as the teacher's failure.
Another 4xx is not retried. `check()` is the stage's refusal before any episode: an endpoint that
cannot be reached, refuses the key, or does not serve the model is a `UserError` naming the key.

The API key is read from the environment variable the config names, sent only in the
Authorization header, and never written anywhere (errors name the variable, not its value).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from snowcat.pipeline.errors import UserError
from snowcat.stages.agent.demos import transcript_messages
from snowcat.stages.agent.loop import episode_seed
from snowcat.stages.rollout.engine import Completion, EngineError

# the fields of a /v1/models entry that say which model answers; `created` (vLLM: the time of the
# request) and `permission` (fresh ids per request) would make two identical runs differ
IDENTITY_FIELDS = ("id", "object", "owned_by", "root", "parent", "max_model_len")


class EndpointError(EngineError):
    """The endpoint did not answer (after its retries): infrastructure, not the teacher's failure."""


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str  # the endpoint's: "stop", "length", ...
    model: str  # the model name the reply gives
    fingerprint: str | None  # its system_fingerprint, where it sends one


class ChatEndpoint:
    """`url`: the API's base (e.g. http://node42:8000/v1); `model`: the served name to ask for;
    `api_key_env`: the name of the environment variable holding the key ("" = send none)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        api_key_env: str = "",
        timeout_s: float = 120.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        concurrency: int = 8,
        extra: dict | None = None,
        key: str = "stages.teacher.endpoint",
    ):
        self.url, self.model = url.rstrip("/"), model
        self.timeout_s, self.retries, self.backoff_s, self.concurrency = timeout_s, retries, backoff_s, concurrency
        self.where = key  # the config key errors name
        self.extra = dict(extra or {})
        self._headers = {"Content-Type": "application/json"}
        if api_key_env:
            value = os.environ.get(api_key_env)
            if not value:
                raise UserError(f"{key}.api_key_env: environment variable {api_key_env} is not set (it should hold the API key)")
            self._headers["Authorization"] = f"Bearer {value}"

    # --- HTTP ------------------------------------------------------------------------------------

    def _request(self, path: str, body: dict | None = None) -> dict:
        """One request, no retry: the decoded JSON answer, or urllib's error."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self._headers, method="GET" if body is None else "POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def _with_retries(self, path: str, body: dict) -> dict:
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return self._request(path, body)
            except urllib.error.HTTPError as e:
                transient = e.code == 429 or e.code >= 500
                cause = f"HTTP {e.code} {e.reason}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                transient, cause = True, f"{getattr(e, 'reason', e)}"
            except (ValueError, OSError) as e:  # an answer that is not JSON, a reset mid-read
                transient, cause = True, repr(e)
            if not transient or attempt == self.retries:
                tries = f" after {attempt + 1} tries" if transient and attempt else ""
                raise EndpointError(f"{self.url}{path}: {cause}{tries}")
            time.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    # --- what the stage asks ---------------------------------------------------------------------

    def check(self) -> dict:
        """The served model's identity (its /v1/models entry, IDENTITY_FIELDS), or UserError: the
        endpoint cannot be reached, refuses the key, or does not serve `model`."""
        try:
            listing = self._request("/models")
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise UserError(f"{self.where}.api_key_env: {self.url}/models refused the key (HTTP {e.code})") from None
            raise UserError(f"{self.where}.url: {self.url}/models answered HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError, OSError) as e:
            raise UserError(f"{self.where}.url: cannot reach {self.url}: {getattr(e, 'reason', e)}") from None
        served = [m for m in listing.get("data", []) if isinstance(m, dict)]
        entry = next((m for m in served if m.get("id") == self.model), None)
        if entry is None:
            names = ", ".join(str(m.get("id")) for m in served) or "none"
            raise UserError(f"{self.where}.model: {self.url} does not serve {self.model!r} (it serves {names})")
        return {k: entry[k] for k in IDENTITY_FIELDS if k in entry}

    def chat(self, messages: list[dict], params, seed: int) -> Reply:
        """One reply to `messages` under `params` (temperature, top_p, top_k where > 0, max_tokens)
        and `seed` (honoured by vLLM; a service may ignore it)."""
        body = {
            **self.extra,
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "seed": int(seed) & 0x7FFFFFFFFFFFFFFF,
            "n": 1,
        }
        if params.top_k > 0:  # not in OpenAI's API: sent only when asked for (vLLM reads it)
            body["top_k"] = params.top_k
        out = self._with_retries("/chat/completions", body)
        try:
            choice = out["choices"][0]
            return Reply(
                choice["message"]["content"] or "",
                choice.get("finish_reason") or "stop",
                out.get("model", ""),
                out.get("system_fingerprint"),
            )
        except (KeyError, IndexError, TypeError) as e:
            raise EndpointError(f"{self.url}/chat/completions: an answer without a message ({e!r})") from None

    def chat_many(self, conversations: Sequence[list[dict]], params, seeds: Sequence[int]) -> list[Reply]:
        """`chat` for each conversation, `concurrency` at a time; the first failure is raised."""
        if len(conversations) <= 1 or self.concurrency == 1:
            return [self.chat(m, params, s) for m, s in zip(conversations, seeds)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(self.chat, conversations, [params] * len(conversations), seeds))


class EndpointEngine:
    """`generate_seeded` for `run_episodes` over `jobs` (one batch), played by `endpoint`.

    The loop seeds turn t of episode (group, attempt) with `episode_seed(seed, group, attempt, t)`;
    that seed places a request (episode, turn), as in RelayEngine. Each episode's turns so far (in
    the student's ids) are tracked here, so its ids read back as the opening, the turns' text and
    the observations the environment wrote (`observations`: the loop's ObservationLog)."""

    def __init__(self, endpoint: ChatEndpoint, *, student_tok, observations, env, jobs, seed: int, budget):
        self.endpoint, self.tok, self.observations, self.env = endpoint, student_tok, observations, env
        self.tasks = [j.task for j in jobs]
        self.place = {
            episode_seed(seed, j.group_id, j.attempt, t): (k, t) for k, j in enumerate(jobs) for t in range(budget.max_turns)
        }
        if len(self.place) != len(jobs) * budget.max_turns:
            raise ValueError("two episodes share a group and attempt: their turns cannot be told apart")
        self.turns: list[list[tuple[int, int]]] = [[] for _ in jobs]
        self.served: list[set[tuple[str, str | None]]] = [set() for _ in jobs]  # (model, fingerprint) per episode

    def answered_by(self) -> list[list[list]]:
        """Per job, the (model name, system fingerprint) pairs its replies gave, sorted."""
        return [sorted([m, f] for m, f in s) for s in self.served]

    def generate_seeded(self, prompts, params, seeds) -> list[Completion]:
        placed = [self.place[int(s)] for s in seeds]
        conversations = [
            transcript_messages(self.tasks[k], prompt, self.turns[k], self.env, self.tok, self.observations)
            for (k, _), prompt in zip(placed, prompts)
        ]
        replies = self.endpoint.chat_many(conversations, params, seeds)
        out = []
        for (k, _), prompt, reply in zip(placed, prompts, replies):
            self.served[k].add((reply.model, reply.fingerprint))
            ids = self.tok.encode(reply.text)
            finish = "stop" if reply.finish_reason == "stop" else "length"
            if finish == "stop":
                ids.append(self.tok.end_of_turn_id)
            if len(ids) > params.max_tokens:  # the budget is the student's tokens: cut as a sampled turn is
                ids, finish = ids[: params.max_tokens], "length"
            self.turns[k].append((len(prompt), len(prompt) + len(ids)))
            out.append(Completion(ids, [0.0] * len(ids), finish, support=None, routes=None))
        return out
