"""A pool of long-lived fidelity ranks (``_fidelity_worker.py`` subprocesses) with bounded waits.

Used by ``scripts/bench_fidelity.py`` and ``tests/dist/test_fidelity.py``. Each rank imports torch and
megatron-core once and then serves one configuration after another; a configuration uses the first
``world_size`` ranks. Every wait has a deadline: on a timeout or a rank error the whole pool is killed
(by process id) and a fresh one is started on the next call.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fidelity_worker.py")
PREFIX = "@@"
STARTUP_TIMEOUT_S = 180.0


class FidelityPoolError(RuntimeError):
    """A rank failed, died or did not answer in time."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Rank:
    """One worker subprocess and a reader thread that forwards its ``@@`` answers to a queue."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = tempfile.TemporaryFile("w+")  # the rank's stderr, quoted when it dies
        self.proc = subprocess.Popen(
            [sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.answers.put(json.loads(line[len(PREFIX):]))
        self.answers.put(None)  # end of output: the process exited

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def answer(self, deadline: float) -> dict:
        try:
            ans = self.answers.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise FidelityPoolError("timed out") from None
        if ans is None:
            raise FidelityPoolError(
                f"rank process {self.proc.pid} exited (code {self.proc.poll()}); stderr tail:\n{self.stderr_tail()}")
        return ans

    def stderr_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class FidelityPool:
    """``size`` ranks ready to run fidelity configurations (see ``_fidelity_worker.py``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ranks: list[_Rank] = []
        self._start()

    def _start(self) -> None:
        self._ranks = [_Rank() for _ in range(self.size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            for r in self._ranks:
                ans = r.answer(deadline)
                if not ans.get("ok"):
                    raise FidelityPoolError(ans.get("error", "rank failed to start"))
        except FidelityPoolError:
            self.close(kill=True)
            raise

    def run(self, cfg: dict, world_size: int, timeout_s: float) -> list[dict]:
        """Run ``cfg`` on ranks 0..world_size-1; return their answers in rank order."""
        if world_size > self.size:
            raise ValueError(f"configuration needs {world_size} ranks, the pool has {self.size}")
        if not self._ranks or any(r.proc.poll() is not None for r in self._ranks):
            self.close(kill=True)
            self._start()
        port = free_port()
        for rank in range(world_size):
            self._ranks[rank].send({"op": "run", "rank": rank, "world_size": world_size, "port": port,
                                    "cfg": cfg})
        deadline = time.monotonic() + timeout_s
        answers = []
        try:
            for rank in range(world_size):
                ans = self._ranks[rank].answer(deadline)
                if not ans.get("ok"):
                    raise FidelityPoolError(f"rank {rank} failed:\n{ans.get('error')}")
                answers.append(ans)
        except FidelityPoolError:
            # Ranks blocked in a collective never come back: kill them all, restart on next use.
            self.close(kill=True)
            raise
        return answers

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks (all asked at once, then waited for up to 10 s); ``kill`` skips the polite exit."""
        if not kill:
            for r in self._ranks:
                if r.proc.poll() is None:
                    try:
                        r.send({"op": "exit"})
                        r.proc.stdin.close()
                    except OSError:
                        pass
            deadline = time.monotonic() + 10.0
            for r in self._ranks:
                try:
                    r.proc.wait(timeout=max(0.01, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for r in self._ranks:
            r.kill()
        self._ranks = []

    def __enter__(self) -> "FidelityPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
