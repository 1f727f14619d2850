"""Agent sandboxes: isolation and limits of LocalSandbox (real namespaces), ApptainerSandbox rendering,
and stripping a task repo's git history."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from snowcat.stages.cgroup import CallCgroup
from snowcat.stages.sandbox import ApptainerSandbox, Limits, LocalSandbox, default_exposed, strip_git_history

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="isolating LocalSandbox tests run as root with util-linux unshare"
)


@pytest.fixture
def sandbox():
    with LocalSandbox(limits=Limits(cpu_s=2, memory_bytes=1 << 30, file_bytes=1 << 20, output_bytes=20_000)) as sb:
        yield sb


@needs_root
def test_runs_in_work_dir_as_nobody_with_files(sandbox):
    r = sandbox.run("cat task/spec.txt; id -u; pwd", files={"task/spec.txt": "fix the bug\n"}, timeout_s=30)
    assert r.status == "ok" and r.exit_code == 0, r
    assert r.stdout.splitlines() == ["fix the bug", "65534", "/workspace"]
    # The work dir persists between calls of one episode.
    assert sandbox.run("echo 1 > a && cat a", timeout_s=30).stdout == "1\n"
    assert sandbox.run("cat a", timeout_s=30).stdout == "1\n"


@needs_root
def test_no_network_even_to_parent_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = (
        "import socket,sys\n"
        f"try: socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
        "except OSError as e: sys.exit(f'blocked: {e}')\n"
        "print('connected')"
    )
    # The same probe outside the sandbox connects: the server is really there.
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout == "connected\n"
    r = sandbox.run([sys.executable, "-c", probe], timeout_s=30)
    server.close()
    assert r.status == "ok" and r.exit_code == 1 and "blocked" in r.stderr, r


@needs_root
def test_cannot_write_outside_work_dir(sandbox):
    outside = Path(tempfile.mkdtemp(prefix="snowcat-outside-", dir="/tmp"))
    outside.chmod(0o777)  # permissions would allow it: the host path does not exist in the sandbox
    tag = f"x-{os.getpid()}"
    r = sandbox.run(
        f"echo pwned > {outside}/x; echo pwned > /usr/{tag}; echo pwned > /{tag}; echo private > /tmp/{tag};"
        " mount -o remount,rw / ; echo rc=$?",
        timeout_s=30,
    )
    assert r.status == "ok", r
    assert "nonexistent" in r.stderr and r.stderr.count("Read-only file system") == 2, r.stderr
    assert "rc=0" not in r.stdout
    # the sandbox's /tmp is its own: nothing reaches the host's
    assert not (outside / "x").exists() and not Path(f"/tmp/{tag}").exists() and not Path(f"/usr/{tag}").exists()
    shutil.rmtree(outside)


@needs_root
def test_host_filesystem_is_not_readable(sandbox, tmp_path):
    # Another checkout with its git history, world-readable: outside the exposed paths it does not exist.
    other = tmp_path / "other-checkout"
    (other / ".git").mkdir(parents=True)
    (other / ".git" / "HEAD").write_text("ref: refs/heads/secret-fix\n")
    for p in (tmp_path, other, other / ".git"):
        p.chmod(0o755)
    (other / ".git" / "HEAD").chmod(0o644)
    r = sandbox.run(f"cat {other}/.git/HEAD; ls /home /var /srv; ls -A /", timeout_s=30)
    assert r.status == "ok" and "secret-fix" not in r.stdout, r
    assert r.stderr.count("No such file") == 4, r.stderr
    # exposing the interpreter's prefix exposes it alone, not the checkout it may sit in
    prefix = Path(sys.prefix).resolve()
    r = sandbox.run(f"ls -A {prefix.parent}", timeout_s=30)
    assert r.stdout.split() == [prefix.name], r
    # ... while the system and the interpreter are there to run the task's tools
    r = sandbox.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.version_info[:2]))"], timeout_s=30)
    assert r.status == "ok" and r.stdout.strip() == json.dumps(list(sys.version_info[:2])), r


@needs_root
def test_no_host_unix_socket(sandbox, tmp_path):
    # The network namespace does not cover filesystem sockets: a 0777 socket under /tmp must be unreachable by path.
    path = Path(tempfile.mkdtemp(prefix="snowcat-sock-", dir="/tmp")) / "agent.sock"
    path.parent.chmod(0o777)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen()
    probe = (
        "import socket,sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"try: s.connect({str(path)!r})\n"
        "except OSError as e: sys.exit(f'blocked: {e}')\n"
        "print('connected')"
    )
    outside = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
    )
    assert outside.stdout == "connected\n", outside.stderr  # nobody on the host does reach it
    r = sandbox.run([sys.executable, "-c", probe], timeout_s=30)
    server.close()
    shutil.rmtree(path.parent)
    assert r.status == "ok" and r.exit_code == 1 and "blocked" in r.stderr, r


@needs_root
def test_cpu_limit(sandbox):
    r = sandbox.run([sys.executable, "-c", "while True: pass"], timeout_s=60)
    assert r.status == "limit" and r.detail in ("SIGXCPU", "cpu 2s for the call"), r


needs_cgroup = pytest.mark.skipif(
    CallCgroup.open(1 << 30, 64) is None, reason="needs a writable cgroup (v2 delegated, or v1 as root) for whole-call caps"
)


@needs_root
@needs_cgroup
def test_cpu_seconds_are_capped_for_the_call_as_a_whole(sandbox):
    # Three processes, 1.5 CPU seconds each: none reaches the 2 s per-process rlimit, the call does.
    spin = f"{sys.executable} -c 'import time; t = time.process_time(); exec(\"while time.process_time() - t < 1.5: pass\")'"
    r = sandbox.run(f"{spin} & {spin} & {spin} & wait; echo finished", timeout_s=60)
    assert (r.status, r.detail) == ("limit", "cpu 2s for the call"), r
    assert sandbox.caps in ("cgroup-v1", "cgroup-v2")


@needs_root
@needs_cgroup
def test_fork_and_allocate_bomb_is_held_by_the_call_cap():
    # Six children of 100 MiB each under a 256 MiB limit: every one is within the per-process
    # address-space limit; the call as a whole is not.
    limits = Limits(cpu_s=20, memory_bytes=256 << 20, nproc=64)
    alloc = f"{sys.executable} -c 'import time; b = bytearray(100 << 20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(3)'"
    with LocalSandbox(limits=limits) as sb:
        r = sb.run(" & ".join([alloc] * 6) + " & wait; echo survived", timeout_s=60)
        assert (r.status, r.detail) == ("limit", "memory for the call"), r
        bomb = sb.run("for i in $(seq 200); do sleep 5 & done; wait", timeout_s=60)
        assert (bomb.status, bomb.detail) == ("limit", "pids for the call") and "fork" in bomb.stderr, bomb
        # the host is untouched and the sandbox still serves the next call
        assert sb.run("echo fine", timeout_s=30).stdout == "fine\n"


@needs_root
@needs_cgroup
def test_calls_side_by_side_do_not_share_a_process_count():
    # Other sandboxes' commands also run as nobody: 70 of them alive on the host must not make this
    # call's forks fail under its own cap of 64 (RLIMIT_NPROC would count them all together).
    others = [subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"]) for _ in range(70)]
    try:
        with LocalSandbox(limits=Limits(nproc=64)) as sb:
            r = sb.run("for i in $(seq 10); do sleep 0.2 & done; wait; echo forked", timeout_s=60)
        assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "forked\n"), r
    finally:
        for p in others:
            p.kill()
            p.wait()


@needs_root
def test_wall_time_kills_everything(sandbox):
    # A background child that would outlive its parent is killed with the tool call's namespace.
    r = sandbox.run("(sleep 2; touch late) & sleep 30", timeout_s=1)
    assert r.status == "timeout", r
    time.sleep(2.5)
    assert not (sandbox.workdir / "late").exists()


@needs_root
def test_memory_limit(sandbox):
    r = sandbox.run([sys.executable, "-c", "b = bytearray(2 << 30); print('allocated')"], timeout_s=60)
    assert r.exit_code != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout, r


@needs_root
def test_output_and_file_size_limits(sandbox):
    r = sandbox.run("yes", timeout_s=60)
    assert r.status == "limit" and r.truncated and len(r.stdout) + len(r.stderr) <= 20_000, r.detail
    r = sandbox.run("head -c 3000000 /dev/zero > big", timeout_s=60)
    assert (r.status, r.detail) == ("limit", "SIGXFSZ"), r
    assert (sandbox.workdir / "big").stat().st_size <= 1 << 20


def test_sandbox_machinery_failures_are_infra_errors(tmp_path):
    missing = LocalSandbox(unshare=str(tmp_path / "no-unshare"))
    r = missing.run("echo hi")
    assert r.status == "infra_error" and "no-unshare" in r.detail
    missing.close()

    broken = LocalSandbox(unshare="false")  # namespace setup refused: exits before the command starts
    r = broken.run("echo hi")
    assert r.status == "infra_error" and r.stdout == "", r
    broken.close()

    gone = LocalSandbox()
    shutil.rmtree(gone.workdir)
    r = gone.run("echo hi")
    assert r.status == "infra_error" and "unavailable" in r.detail
    gone.close()

    # ... whereas a command failing on its own is the model's: status ok, its exit code kept.
    with LocalSandbox(isolate=False) as plain:
        r = plain.run("exit 3")
        assert (r.status, r.exit_code) == ("ok", 3)


def test_files_cannot_escape_work_dir():
    with LocalSandbox(isolate=False) as sb:
        r = sb.run("true", files={"../escape.txt": "x"})
        assert r.status == "infra_error" and "outside the work dir" in r.detail


def test_apptainer_sandbox_rendering(tmp_path, monkeypatch):
    sb = ApptainerSandbox("/img/sandbox.sif", workdir=tmp_path)
    argv = sb.command("pytest -q")
    assert argv == [
        "apptainer",
        "exec",
        "--containall",
        "--no-home",
        "--net",
        "--network",
        "none",
        "--writable-tmpfs",
        "--bind",
        f"{tmp_path}:/workspace",
        "--pwd",
        "/workspace",
        "/img/sandbox.sif",
        "sh",
        "-c",
        "pytest -q",
    ]
    with pytest.raises(FileNotFoundError, match="apptainer not found"):  # -> infra_error in run()
        sb.command(["ls"], ready_fd=7)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apptainer").write_text("#!/bin/sh\n")
    (fake / "apptainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    wrapped = sb.command(["ls"], ready_fd=7)
    assert wrapped[:2] == ["bash", "-c"] and wrapped[-len(argv) + 2 :][-1] == "ls"
    # the binary resolved on the caller's PATH: the wrapper runs with the sandbox's own PATH
    assert wrapped[4:] == [str(fake / "apptainer")] + argv[1:-3] + ["ls"]


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_strip_git_history_leaves_no_future(tmp_path):
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    _git(upstream, "init", "-q", "-b", "main")
    _git(upstream, "config", "user.email", "t@example.com")
    _git(upstream, "config", "user.name", "t")
    (upstream / "lib.py").write_text("def add(a, b):\n    return a - b\n")
    _git(upstream, "add", ".")
    _git(upstream, "commit", "-qm", "buggy")
    base = _git(upstream, "rev-parse", "HEAD")
    (upstream / "lib.py").write_text("def add(a, b):\n    return a + b  # THE FIX\n")
    _git(upstream, "commit", "-qam", "fix add")
    fix = _git(upstream, "rev-parse", "HEAD")
    fix_blob = _git(upstream, "rev-parse", "HEAD:lib.py")
    _git(upstream, "tag", "v1", fix)
    _git(upstream, "branch", "feature", fix)

    # The task repo: a clone sharing objects with upstream (alternates) plus a remote and packed refs.
    task = tmp_path / "task"
    subprocess.run(["git", "clone", "-q", "--shared", str(upstream), str(task)], check=True)
    _git(task, "pack-refs", "--all")
    _git(task, "stash", "list")

    assert strip_git_history(task, base) == base
    assert _git(task, "rev-parse", "HEAD") == base
    assert "return a - b" in (task / "lib.py").read_text()
    assert _git(task, "for-each-ref", "--format=%(refname)").splitlines() == ["refs/heads/main"]
    assert _git(task, "remote") == ""
    assert _git(task, "rev-list", "--all", "--reflog") == base
    for obj in (fix, fix_blob):
        assert subprocess.run(["git", "-C", str(task), "cat-file", "-e", obj]).returncode != 0, obj
    gitdir = task / ".git"
    assert not (gitdir / "objects" / "info" / "alternates").exists()
    assert "THE FIX" not in subprocess.run(["grep", "-r", "THE FIX", str(gitdir)], capture_output=True, text=True).stdout
    assert _git(task, "fsck", "--full") == ""  # still a healthy repo


@needs_root
def test_exposed_paths_under_tmp_survive_the_private_tmp():
    # A checkout (and its venv) under /tmp, as in CI: exposed read-only inside the private /tmp.
    shared = Path(tempfile.mkdtemp(prefix="snowcat-expose-", dir="/tmp"))
    shared.chmod(0o755)
    (shared / "data.txt").write_text("visible\n")
    (shared / "data.txt").chmod(0o644)
    with LocalSandbox(expose=(*default_exposed(), str(shared))) as sb:
        r = sb.run(f"cat {shared}/data.txt; echo scratch > /tmp/mine && cat /tmp/mine; echo x > {shared}/z", timeout_s=30)
    shutil.rmtree(shared)
    assert r.stdout.splitlines() == ["visible", "scratch"], r
    assert "Read-only file system" in r.stderr
