"""Shared helpers for multi-process tests on gloo/CPU: a pool of ranks that stays alive across cases.

Importing torch + megatron-core costs ~5 s per process, so tests reuse one pool per world size::

    def _body(rank, world_size, n):          # module-level, so the spawned ranks can import it
        return rank * n

    def test_something(gloo_pool):
        pool = gloo_pool(2)                   # session-wide pool of 2 ranks, process group initialised
        assert pool.run(_body, 3, timeout_s=60) == [0, 3]

``pool.run`` calls ``target(rank, world_size, *args)`` on every rank and returns the per-rank results
in rank order. Every wait is bounded: a rank that raises fails the call with its traceback, a rank that
hangs past ``timeout_s`` gets the whole pool killed (the next ``gloo_pool(n)`` starts a fresh one).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from poseidon_plugin.emulation.harness import HOST_FACTOR_ENV

# Seconds a rank may take to start (imports) and join the process group.
STARTUP_TIMEOUT_S = 120.0
# The launches of these tests emulate on the reference host (emulation.harness.host_factor 1): the emulation
# they expect (deterministic_state, a plan's priced SCALE) is built in the test process with the reference's
# costs, so a factor poseidon-run times on a busy test host must not change the ranks' SCALE. The launcher's
# timing is tested on its own (tests/unit/test_runtime_elastic.py).
REFERENCE_HOST = {HOST_FACTOR_ENV: "1"}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, tasks: Any, results: Any, pg_timeout_s: float) -> None:
    """Body of one pooled rank: join the gloo group, then serve (target, args) tasks until None."""
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        target, args = task
        try:
            results.put((rank, "ok", target(rank, world_size, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    """``world_size`` spawned processes that joined one gloo process group and run tasks on demand."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world_size, port, self._tasks[r], self._results, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", STARTUP_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        """True while every rank process is running."""
        return all(p.is_alive() for p in self._procs)

    def run(self, target: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """Run ``target(rank, world_size, *args)`` on all ranks; return results in rank order."""
        for q in self._tasks:
            q.put((target, args))
        return self._collect("ok", timeout_s)

    def _collect(self, expected: str, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = _now() + timeout_s
        while len(out) < self.world_size:
            try:
                rank, status, value = self._results.get(timeout=max(0.05, min(1.0, deadline - _now())))
            except queue.Empty:
                if _now() >= deadline or not self.alive:
                    self.close(kill=True)
                    missing = sorted(set(range(self.world_size)) - set(out))
                    reason = "timed out" if _now() >= deadline else "a rank process died"
                    raise TimeoutError(f"gloo pool: {reason} after {timeout_s:.0f} s; ranks {missing} did not answer")
                continue
            if status == "error":
                self.close(kill=True)
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            if status != expected:
                self.close(kill=True)
                raise RuntimeError(f"rank {rank}: unexpected status {status!r}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks (politely unless ``kill``), then kill any that did not exit within 10 s."""
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            if kill and p.is_alive():
                p.kill()
            p.join(timeout=10.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def _now() -> float:
    import time

    return time.monotonic()


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Callable[[int], GlooPool]]:
    """Factory fixture: ``gloo_pool(n)`` returns the session's pool of n ranks (created on first use)."""
    pools: dict[int, GlooPool] = {}

    def get(world_size: int) -> GlooPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = GlooPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


def run_gloo(target: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """One-off: start ``world_size`` ranks, run ``target(rank, world_size, *args)`` once, shut them down."""
    pool = GlooPool(world_size)
    try:
        return pool.run(target, *args, timeout_s=timeout_s)
    finally:
        pool.close()


def selected(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether this session runs test ``name`` (any of its parametrizations) of the requesting module."""
    return any(getattr(item, "originalname", item.name) == name and item.module is request.module
               for item in request.session.items)


@contextlib.contextmanager
def in_background(calls: dict[Any, Callable[[], Any]]) -> Iterator[dict[Any, Future]]:
    """Start every call at once, each in a thread of its own; yield their futures by key; leave once all of
    them have ended (each launch is bounded by its subprocess timeout).

    For launches that spend most of their time idle (waiting out a timeout, sleeping to emulated deadlines):
    a module-scoped fixture starts them with the module's first test and the tests read their results, so
    they run beside each other and the module's other tests instead of one after another. Single-node
    launches running at once each need a rendezvous port of their own (``--master-port``, :func:`free_port`)."""
    with ThreadPoolExecutor(max(1, len(calls))) as pool:
        yield {key: pool.submit(call) for key, call in calls.items()}


def module_launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    launches: dict[str, Callable[[Any], Any]]):
    """:func:`in_background` of ``launches[name](a fresh temporary folder)`` for each test ``name`` of the
    requesting module that this session runs (keyed by the test's name)."""
    calls = {}
    for name, launch in launches.items():
        if selected(request, name):
            tmp = tmp_path_factory.mktemp(name[:40])
            calls[name] = lambda launch=launch, tmp=tmp: launch(tmp)
    return in_background(calls)
