"""Scrub credentials from everything a stage process writes to its stdout and stderr.

The stage's file descriptors 1 and 2 are redirected into a pipe; a thread reads it line by line,
replaces secret values (from this environment) and credential-shaped strings, and writes the
result to the original destination (the local log file, or Slurm's output file). Working at the
descriptor level covers prints, C extensions and child processes alike.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import sys
import threading
from collections.abc import Iterator

from .scrub import env_secrets, scrub_text


@contextlib.contextmanager
def scrubbed_output() -> Iterator[None]:
    secrets = env_secrets()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    read_end, write_end = os.pipe()
    for fd in (1, 2):
        os.dup2(write_end, fd)
    os.close(write_end)
    # A crash in C (a segfault in MPI or torch) kills the pump with the process: its Python stack
    # goes straight to the original stderr (file names and lines, nothing to scrub).
    faulthandler.enable(file=saved[2])

    done = threading.Event()

    def pump() -> None:
        # Not "read until EOF": a child that outlives the block (multiprocessing's resource tracker)
        # keeps a write end open. Once the block is over, drain what was written and stop.
        pending = b""
        while True:
            readable, _, _ = select.select([read_end], [], [], 0.1)
            chunk = os.read(read_end, 65536) if readable else b""
            if not chunk:
                if readable or done.is_set():  # EOF, or nothing left after the block ended
                    break
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if lines:
                text = scrub_text(b"\n".join(lines).decode(errors="replace"), secrets) + "\n"
                os.write(saved[1], text.encode())
        if pending:  # a last line without a newline is still output
            os.write(saved[1], scrub_text(pending.decode(errors="replace"), secrets).encode())

    thread = threading.Thread(target=pump, name="log-scrubber", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)  # our write ends are closed; everything we wrote is in the pipe
        faulthandler.enable()  # back on fd 2, before saved[2] is closed
        done.set()
        thread.join()
        os.close(read_end)
        for fd in saved.values():
            os.close(fd)
