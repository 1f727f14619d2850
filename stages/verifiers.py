"""Verifiers: the function a "module:function" spec names, and the same run in a worker process under
a time limit, so that a hung or crashing verifier is an infrastructure failure, never the model's."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import signal

from snowcat.pipeline.errors import UserError
from snowcat.stages.taskgen import Verdict, VerifierError


def load_verifier(spec: str, key: str = "verifier"):
    """The verifier function a "module:function" spec names (config key `key` in errors)."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"{key}={spec!r}: cannot import '<module>:<function>': {e}") from None


def _verifier_worker(spec: str, conn) -> None:
    verify = load_verifier(spec)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        task, text = msg
        try:
            v = verify(task, text)
            scores = {str(k): float(x) for k, x in getattr(v, "scores", {}).items()}  # a custom verifier's Verdict may have none
            conn.send(("ok", (float(v.reward), bool(v.passed), str(v.detail), scores)))
        except VerifierError as e:
            conn.send(("infra", str(e)))
        except Exception as e:  # a verifier bug is infrastructure, never the model's fault
            conn.send(("infra", f"verifier crashed: {e!r}"))


class TimedVerifier:
    """Runs `verify` in a worker process; a call past `timeout_s` kills the worker (a fresh one
    serves the next call) and raises VerifierError. Spawned, not forked: the parent holds torch."""

    def __init__(self, spec: str, timeout_s: float, startup_timeout_s: float = 120.0):
        self.spec, self.timeout_s, self.startup_timeout_s = spec, timeout_s, startup_timeout_s
        self.proc = None
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_verifier_worker, args=(self.spec, child), daemon=True)
        # Slurm sends the end-of-job notice (SIGUSR2) to every process of the job step; it is the
        # stage's, and its default action would kill the worker. Blocked while the worker is
        # spawned, it stays blocked there (the mask survives exec); here it is only held back.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        child.close()
        try:
            ready = self.conn.poll(self.startup_timeout_s) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.close()
            raise RuntimeError(f"verifier {self.spec}: worker process did not start (see its traceback above)")

    def _restart(self) -> None:
        self.close()
        self._start()

    def __call__(self, task, text: str):
        try:
            self.conn.send((task, text))
        except OSError:  # the worker died since the last call (killed, out of memory): not this task's doing
            self._restart()
            self.conn.send((task, text))
        if not self.conn.poll(self.timeout_s):
            self._restart()
            raise VerifierError(f"verifier timed out after {self.timeout_s:g}s")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            self._restart()
            raise VerifierError("verifier process died") from None
        if kind == "infra":
            raise VerifierError(payload)
        return Verdict(*payload)

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None
