"""FakeHub: a test double of the Hugging Face Hub's HTTP API (there is no hub, nor network, here).

It serves, for the repositories a test gives it, exactly the requests the installed
`huggingface_hub` makes to stage a repository: `repo_info` / `model_info` / `dataset_info`
(`GET /api/{models,datasets}/{repo}[/revision/{rev}]`), the tree listing `snapshot_download` asks
for (`GET /api/{type}s/{repo}/tree/{rev}`), and each file (`HEAD` / `GET` on
`/[datasets/]{repo}/resolve/{rev}/{path}` with the headers it checks: X-Repo-Commit, ETag,
Content-Length). Unknown repositories, revisions and files get the hub's 404 with its
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), which `huggingface_hub` turns into
its own exceptions; so does anything else (the library's best-effort look-up of
/api/agent-harnesses, which it ignores). Commits are hashes of their parent and files; branches
move with `push`. Every request is logged, so a test can check which revision each file was
fetched at.

Point `huggingface_hub` at it with HF_ENDPOINT in a subprocess, or `use_endpoint` in this one
(the library reads HF_ENDPOINT once, at import).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's content (what the hub calls a file's `oid`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[tuple[str, str], dict] = {}  # (type, id) -> {"branches": {name: sha}, "commits": {sha: files}}
        self.requests: list[tuple[str, str]] = []  # (method, path) as received
        self.after_repo_info: list = []  # callables run once, right after the next repo_info answer (e.g. a push)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------ content

    def push(self, repo_id: str, files: dict[str, bytes] | Path, branch: str = "main", repo_type: str = "model") -> str:
        """A commit of `files` (a dict, or every file under a directory) on `branch`; its sha."""
        if isinstance(files, Path):
            files = {str(p.relative_to(files)): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
        repo = self.repos.setdefault((repo_type, repo_id), {"branches": {}, "commits": {}})
        parent = repo["branches"].get(branch, "")
        manifest = json.dumps({k: git_blob_id(v) for k, v in sorted(files.items())}).encode()
        sha = hashlib.sha1(parent.encode() + manifest).hexdigest()
        with self._lock:
            repo["commits"][sha] = dict(files)
            repo["branches"][branch] = sha
        return sha

    def fetched_revisions(self) -> set[str]:
        """The revisions named in every file request so far."""
        return {path.split("/resolve/", 1)[1].split("/", 1)[0] for _, path in self.requests if "/resolve/" in path}

    # ------------------------------------------------------------ server

    def __enter__(self) -> FakeHub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """No hub from here on (idempotent): a request now fails to connect, as on a compute node."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, "FakeHub not running (use it as a context manager)"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def use_endpoint(self, monkeypatch, home: Path) -> None:
        """Point this process's huggingface_hub at the fake, online, as HF_ENDPOINT and HF_HOME=`home`
        do at import (so nothing lands in the user's own cache)."""
        from huggingface_hub import constants  # noqa: PLC0415 (only tests that talk to the fake import it)

        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    # ------------------------------------------------------------ requests

    def _resolve(self, repo_type: str, rest: str):
        """(repo id, its record, what follows it in the path) for the longest known repo id that
        `rest` starts with; the repo id is the first two segments when none is known."""
        parts = rest.split("/")
        for n in (2, 1):
            repo_id = "/".join(parts[:n])
            if (repo_type, repo_id) in self.repos:
                return repo_id, self.repos[(repo_type, repo_id)], parts[n:]
        return "/".join(parts[:2]), None, parts[2:]

    def _commit(self, repo: dict, revision: str) -> str | None:
        revision = revision or "main"
        if revision in repo["branches"]:
            return repo["branches"][revision]
        matches = [sha for sha in repo["commits"] if sha.startswith(revision)] if len(revision) >= 7 else []
        return matches[0] if len(matches) == 1 else None

    def answer(self, method: str, raw_path: str):
        """(status, headers, body) for one request."""
        self.requests.append((method, raw_path))
        path = urllib.parse.urlsplit(raw_path).path
        segments = [urllib.parse.unquote(s) for s in path.strip("/").split("/")]
        if segments[:1] == ["api"] and len(segments) >= 3 and segments[1] in ("models", "datasets"):
            return self._api(segments[1][:-1], "/".join(segments[2:]))
        if "resolve" in segments:
            repo_type = "dataset" if segments[0] == "datasets" else "model"
            rest = segments[1:] if repo_type == "dataset" else segments
            at = rest.index("resolve")
            return self._file(repo_type, "/".join(rest[:at]), rest[at + 1], "/".join(rest[at + 2 :]), method)
        return _error(404, "EntryNotFound", f"the fake hub does not serve {path}")

    def _api(self, repo_type: str, rest: str):
        repo_id, repo, tail = self._resolve(repo_type, rest)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository Not Found for {repo_id}")
        if tail[:1] in (["revision"], ["tree"]):
            kind, revision = tail[0], tail[1] if len(tail) > 1 else ""
        elif not tail:
            kind, revision = "revision", "main"
        else:
            return _error(404, "EntryNotFound", f"the fake hub does not serve /api/{repo_type}s/{rest}")
        sha = self._commit(repo, revision)
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo["commits"][sha]
        if kind == "tree":
            listing = [{"type": "file", "path": p, "size": len(b), "oid": git_blob_id(b)} for p, b in sorted(files.items())]
            return _json(listing)
        answer = _json({"id": repo_id, "sha": sha, "private": False, "siblings": [{"rfilename": p} for p in sorted(files)]})
        while self.after_repo_info:
            self.after_repo_info.pop(0)()
        return answer

    def _file(self, repo_type: str, repo_id: str, revision: str, filename: str, method: str):
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository Not Found for {repo_id}")
        sha = self._commit(repo, revision)
        if sha is None:
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        data = repo["commits"][sha].get(filename)
        if data is None:
            return _error(404, "EntryNotFound", f"{filename} is not in {repo_id}@{sha}", commit=sha)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_id(data)}"', "Content-Length": str(len(data))}
        return 200, headers, b"" if method == "HEAD" else data


def _json(obj) -> tuple[int, dict, bytes]:
    body = json.dumps(obj).encode()
    return 200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body


def _error(status: int, code: str, message: str, commit: str | None = None) -> tuple[int, dict, bytes]:
    body = json.dumps({"error": message}).encode()
    headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
    headers["Content-Length"] = str(len(body))
    if commit:
        headers["X-Repo-Commit"] = commit
    return status, headers, body


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _reply(self, method: str) -> None:
            status, headers, body = hub.answer(method, self.path)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._reply("GET")

        def do_HEAD(self) -> None:
            self._reply("HEAD")

        def log_message(self, *args) -> None:  # the request log is hub.requests
            pass

    return Handler
