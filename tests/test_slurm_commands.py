"""Every Slurm client command goes through slurm/commands.py: a busy controller is retried where a
retry is safe, never for sbatch (a timed-out submission may have been queued), and "no answer" stays
apart from an answer."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from snowcat.slurm import commands


@pytest.fixture
def flaky(tmp_path, monkeypatch):
    """A client that says the controller timed out `n` times, then answers; it counts its calls."""
    monkeypatch.setattr(commands, "RETRY_PAUSE_S", 0.0)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    def make(name: str, busy_times: int, answer: str = "ok") -> Path:
        calls = tmp_path / f"{name}.calls"
        script = tmp_path / name
        script.write_text(
            "#!/bin/sh\n"
            f"echo x >> {calls}\n"
            f'if [ "$(wc -l < {calls})" -le {busy_times} ]; then\n'
            '  echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1\n'
            "fi\n"
            f"echo '{answer}'\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        return calls

    return make


def _calls(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_query_is_asked_again_while_the_controller_is_busy(flaky):
    calls = flaky("squeue", busy_times=2, answer="123|RUNNING|None")
    reply = commands.query(["squeue", "-h"])
    assert reply.ok and reply.out.strip() == "123|RUNNING|None" and _calls(calls) == 3


def test_a_query_that_never_gets_an_answer_says_so(flaky):
    calls = flaky("squeue", busy_times=99)
    reply = commands.query(["squeue", "-h"])
    assert not reply.ok and reply.busy and _calls(calls) == commands.QUERY_TRIES
    assert "Socket timed out" in reply.why()


def test_a_plain_failure_is_not_retried(flaky, tmp_path):
    script = tmp_path / "sacct"
    script.write_text(f"#!/bin/sh\necho x >> {tmp_path}/sacct.calls\necho 'sacct: error: Invalid field' >&2\nexit 1\n")
    script.chmod(0o755)
    reply = commands.query(["sacct", "-o", "Nope"])
    assert reply.code == 1 and not reply.busy and _calls(tmp_path / "sacct.calls") == 1


def test_sbatch_is_never_retried_and_its_refusal_names_the_reason(flaky):
    calls = flaky("sbatch", busy_times=1, answer="4242")
    with pytest.raises(subprocess.CalledProcessError, match="Socket timed out"):
        commands.sbatch("job.sh")
    assert _calls(calls) == 1  # a second try might queue the job twice
    assert commands.sbatch("job.sh") == "4242"


def test_a_missing_program_and_a_hung_one_are_told_apart_from_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "RETRY_PAUSE_S", 0.0)
    monkeypatch.setenv("PATH", str(tmp_path))
    missing = commands.query(["squeue"])
    assert missing.code == commands.NOT_FOUND and not missing.busy
    hung = tmp_path / "sinfo"
    hung.write_text("#!/bin/sh\nexec /bin/sleep 30\n")
    hung.chmod(0o755)
    reply = commands.run([str(hung)], timeout=0.5)
    assert reply.code == commands.NO_ANSWER and reply.busy


def _live_processes_with_arg(arg: str) -> list[int]:
    """Processes (not zombies: a killed orphan stays one until init reaps it) with `arg` in their argv."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if arg.encode() in argv and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.mark.timeout(60)  # without the session kill the caller waits on the child's pipes until it ends
def test_a_timeout_stops_what_a_wrapper_script_started_too(tmp_path):
    """A site's tools are often shell wrappers: a child still holding the output pipes would keep the
    caller waiting past its timeout; the whole session the command started is killed."""
    marker = f"{3000 + secrets.randbelow(10**6) / 10**6:.6f}"  # this test's sleep, told apart from any other
    started = tmp_path / "started"
    wrapper = tmp_path / "lfs"
    wrapper.write_text(f"#!/bin/sh\n/bin/sleep {marker} &\ntouch {started}\nwait\n")
    wrapper.chmod(0o755)
    reply = commands.run([str(wrapper), "quota"], timeout=2)
    assert reply.code == commands.NO_ANSWER and reply.busy
    assert started.exists(), "the wrapper did not start its child within the timeout (machine too loaded?)"
    assert _live_processes_with_arg(marker) == []


@pytest.mark.timeout(60)
def test_a_child_that_left_the_session_does_not_keep_the_caller_waiting(tmp_path):
    """A session kill cannot reach a child that made a session of its own (setsid), and that child
    still holds the output pipes: the caller stops reading them rather than wait for it."""
    marker = f"{3000 + secrets.randbelow(10**6) / 10**6:.6f}"
    wrapper = tmp_path / "sinfo"
    wrapper.write_text(f"#!/bin/sh\nsetsid /bin/sleep {marker} &\nwait\n")
    wrapper.chmod(0o755)
    try:
        reply = commands.run([str(wrapper)], timeout=1)
        assert reply.code == commands.NO_ANSWER and reply.busy
    finally:
        for pid in _live_processes_with_arg(marker):
            os.kill(pid, 9)


def test_a_program_that_cannot_be_run_is_a_reply_not_an_exception(tmp_path):
    not_executable = tmp_path / "taccinfo"
    not_executable.write_text("#!/bin/sh\necho hi\n")
    reply = commands.run([str(not_executable)], timeout=5)
    assert reply.code == commands.CANNOT_RUN and "Permission denied" in reply.err
