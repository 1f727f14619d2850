"""Planted credentials never survive scrubbing, and the tree scan finds them wherever they hide."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import snowcat.pipeline.scrub as scrub
from snowcat.pipeline.scrub import (
    REDACTED,
    Finding,
    env_secrets,
    is_secret_name,
    looks_like_secret,
    scan_tree,
    scrub_env,
    scrub_text,
    shannon_entropy,
)

HF = "hf_planted123AbCdEfGhIjKlMnOpQrStUvWx"
DAYTONA = "dtn_7f3c9a0e5b2d4c1f8a6e9b3d7c5a1f0e"  # hex-ish: caught by its name, not its shape
ENV = {
    "HF_TOKEN": HF,
    "DAYTONA_API_KEY": DAYTONA,
    "SLURM_JOB_ID": "4242",
    "KEYBOARD": "us",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "8",
    "INNOCENT_NAME": "ghp_" + "A1b2C3d4" * 5,  # a GitHub token under a harmless name
}


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "DAYTONA_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "MYSQL_PASSWORD",
        "PGPASSWD",
        "APIKEY",
        "apiKey",
        "GOOGLE_CREDENTIALS",
        "OAUTH_CLIENT",
        "SESSION_COOKIE",
        "SSH_PRIVATE",
        "GITHUB_PAT",
        "SENTRY_DSN",
        "hfToken",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "KEYBOARD",
        "TOKENIZERS_PARALLELISM",
        "GIT_AUTHOR_NAME",
        "PATH",
        "PWD",
        "SLURM_JOB_PARTITION",
        "HF_TOKEN_PATH",
        "SSH_AUTH_SOCK",
        "PYTHONPATH",
    ],
)
def test_not_secret_names(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    "value",
    [
        HF,
        "ghp_" + "x" * 36,
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
        "AKIAIOSFODNN7EXAMPLE",
        "sk-proj-abcdefghijklmnopqrstuvwxyz0123",
        "xoxb-1234567890-abcdefghij",
        "-----BEGIN OPENSSH PRIVATE KEY-----",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "https://user:s3cr3tpass@example.org/repo.git",
        "Zx8Qv2LmN4pR7sT1uW3yA5cE6gH9jK0bD",
    ],
)
def test_looks_like_secret(value):
    assert looks_like_secret(value)


@pytest.mark.parametrize(
    "value",
    [
        "a" * 64,
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "27c0bcf8e3a1d7f49b0c2e6a5d8f1b3c7e9a0d2f",
        "123e4567-e89b-12d3-a456-426614174000",
        "/work/main/.venv/lib/python3.11/site-packages",
        "TOKENIZERS_PARALLELISM_IS_FALSE_TODAY",
        "the quick brown fox jumps over the lazy dog",
        "false",
        "4242",
    ],
)
def test_not_looks_like_secret(value):
    assert not looks_like_secret(value)


def test_entropy_measure():
    assert shannon_entropy("aaaa") == 0
    assert shannon_entropy("abcd") == 2.0
    assert shannon_entropy("") == 0


def test_scrub_env_redacts_values_not_names():
    out = scrub_env(ENV)
    assert set(out) == set(ENV)
    assert out["HF_TOKEN"] == out["DAYTONA_API_KEY"] == out["INNOCENT_NAME"] == REDACTED
    assert out["SLURM_JOB_ID"] == "4242" and out["KEYBOARD"] == "us" and out["TOKENIZERS_PARALLELISM"] == "false"
    blob = repr(out)
    assert HF not in blob and DAYTONA not in blob and "planted" not in blob


def test_scrub_text_known_and_patterns(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    text = f"export HF_TOKEN={HF}\nDaytona key {DAYTONA} ok\nslurm 4242 at /work/x\nother AKIAIOSFODNN7EXAMPLE end"
    out = scrub_text(text)  # known secrets default to this process's environment
    assert HF not in out and DAYTONA not in out and "AKIAIOSFODNN7EXAMPLE" not in out
    assert "slurm 4242 at /work/x" in out and out.count(REDACTED) == 3
    assert scrub_text(f"x {DAYTONA} y", known_secrets={"K": DAYTONA}) == f"x {REDACTED} y"
    assert scrub_text(f"x {DAYTONA} y", known_secrets=[]) == f"x {DAYTONA} y"  # no known values, hex shape is not a pattern
    assert set(env_secrets(ENV)) == {"HF_TOKEN", "DAYTONA_API_KEY", "INNOCENT_NAME"}


def test_scan_tree_finds_planted_values_in_text_binary_and_hdf5(tmp_path):
    known = {"HF_TOKEN": HF, "DAYTONA_API_KEY": DAYTONA}
    nested = tmp_path / "stages" / "rl" / "logs"
    nested.mkdir(parents=True)
    (nested / "clean.log").write_text("step 1 loss 0.5\nsha 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n")
    (nested / "leak.log").write_text(f"line one\nline two\nDAYTONA_API_KEY={DAYTONA}\n")
    blob = os.urandom(3000) + b"\x00" + HF.encode() + b"\x00" + os.urandom(3000)
    (tmp_path / "stages" / "weights.bin").write_bytes(blob)
    with h5py.File(tmp_path / "history.h5", "w") as f:  # compressed: invisible to a byte scan
        f.create_dataset("notes", data=np.array([("cfg " + DAYTONA).encode()] * 200), compression="gzip")
        f.attrs["cmd"] = "train"
    with h5py.File(tmp_path / "traces.h5", "w") as f:  # as the traces are kept: variable-length rows
        rows = f.create_dataset("token_ids", (2,), dtype=h5py.vlen_dtype(np.int32), compression="gzip")
        rows[0], rows[1] = np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32)
        f.create_dataset("text", data=["ok", "export HF_TOKEN=" + HF], dtype=h5py.string_dtype(), compression="gzip")
    findings = scan_tree(tmp_path, known_secrets=known)
    got = {(f.path.relative_to(tmp_path).as_posix(), f.kind) for f in findings}
    assert ("stages/rl/logs/leak.log", "known:DAYTONA_API_KEY") in got
    assert ("stages/weights.bin", "known:HF_TOKEN") in got and ("stages/weights.bin", "huggingface_token") in got
    assert ("history.h5", "known:DAYTONA_API_KEY") in got
    assert ("traces.h5", "known:HF_TOKEN") in got  # in a variable-length string row, compressed
    assert not any(f.path.name == "clean.log" for f in findings)
    leak = next(f for f in findings if f.path.name == "leak.log")
    assert leak.line == 3
    assert all(HF not in str(f) and DAYTONA not in str(f) for f in findings)  # reports never repeat the secret


def test_scan_tree_match_across_chunk_edge(tmp_path, monkeypatch):
    monkeypatch.setattr(scrub, "_CHUNK", 1000)
    monkeypatch.setattr(scrub, "_MAX_MATCH", 100)  # overlap smaller than a chunk, as with real sizes
    data = b"x\n" * 4000  # 8000 bytes: several chunks
    for at in (990, 2999, 5000):
        data = data[:at] + HF.encode() + data[at:]
    (tmp_path / "f.bin").write_bytes(data)
    hits = [f for f in scan_tree(tmp_path, known_secrets={"HF_TOKEN": HF}) if f.kind == "known:HF_TOKEN"]
    assert len(hits) == 3  # each found once, none lost at a chunk edge
    assert [h.line for h in hits] == sorted(h.line for h in hits)


def test_scan_tree_high_entropy_opt_in(tmp_path):
    (tmp_path / "a.txt").write_text("api said Zx8Qv2LmN4pR7sT1uW3yA5cE6gH9jK0bD\n")
    assert scan_tree(tmp_path, known_secrets={}) == []
    assert scan_tree(tmp_path, known_secrets={}, high_entropy=True) == [Finding(tmp_path / "a.txt", 1, "high_entropy")]


def test_url_password_needs_printable_user_and_password(tmp_path):
    # Weight files are random bytes: "://", ":" and "@" with binary between them is not a credential.
    (tmp_path / "weights.bin").write_bytes(b"\x00\x13://\x8f\x02\xfe:\x91\x07@\x00" * 3)
    assert scan_tree(tmp_path, known_secrets={}) == []
    (tmp_path / "weights.bin").write_bytes(b"\x00\x13https://ci:tok-en_1.2~x@host\x00")
    assert [f.kind for f in scan_tree(tmp_path, known_secrets={})] == ["url_password"]


_HOLDS_OUTPUT = """
import subprocess, sys
from snowcat.pipeline.logscrub import scrubbed_output
with scrubbed_output():
    print("secret is " + sys.argv[1], flush=True)
    # like multiprocessing's resource tracker: a child that inherits the pipe and outlives the block
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(40)"], start_new_session=True)
    sys.stdout.write("last line, no newline")
"""


def test_scrubbed_output_does_not_wait_for_children_and_keeps_the_last_line(tmp_path):
    secret = "hf_" + "Zq8Lw3" * 6
    proc = subprocess.run(
        [sys.executable, "-c", _HOLDS_OUTPUT, secret],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_TOKEN": secret},
        cwd=Path(__file__).resolve().parent.parent,
        timeout=25,
    )  # the old pump waited 30 s for an EOF the child never sends
    assert proc.returncode == 0, proc.stderr
    assert secret not in proc.stdout
    assert proc.stdout.endswith("last line, no newline")
    assert proc.stdout.startswith("secret is ")


_CRASHES_IN_C = """
import ctypes
from snowcat.pipeline.logscrub import scrubbed_output

def dies_in_c_code():
    ctypes.string_at(0)  # a segfault, as in MPI_Init or a torch kernel

with scrubbed_output():
    print("before the crash", flush=True)
    dies_in_c_code()
"""


def test_a_crash_in_c_code_leaves_its_python_stack_in_the_log():
    """The pump thread dies with the process: the crash's Python stack must not go through it."""
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHES_IN_C],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "in dies_in_c_code" in proc.stderr
