"""Helpers for launches of several ``poseidon-run`` agents on this host (scripts/bench_restart.py and
tests/dist/test_elastic.py): the rendezvous port, and an agent lost as a node that dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def wait_for_port(port: int, bound_s: float) -> bool:
    """Until the first agent listens on the rendezvous port (it hosts the store; the others join it); False
    when nothing listened within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def kill_agent(proc: subprocess.Popen) -> None:
    """The agent (started with ``start_new_session``) and its workers, each of which torchrun starts in a
    session of its own, all killed at once, as a node that dies."""
    if proc.poll() is not None:
        return
    import psutil

    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
