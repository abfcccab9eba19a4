"""One structure's tree walked by several processes at once (``SearchOptions.workers``).

A walk goes alone for its first ``SHARE_AT`` nodes: most trees end there, and a process costs more than
they do. A walk that passes them is shared: the process forks ``workers - 1`` copies of itself (each
with the whole search state, the walk's included) and every process goes on from where the walk
stopped, each taking some of the subtrees of one depth (``SplitSearch.share``: a subtree belongs to one
process by its path, the decisions above it, which every process that reaches it sees alike). Each
searches below the least threshold any of them has reached (a double in memory the processes share), so
a plan one finds cuts the others' trees as it would cut the walk's own. The children write their result
to a pipe as JSON and exit; the parent keeps the fastest plan, of equal ones the plan whose path the walk
alone meets first (``SplitSearch.best_path``), and sums the counters.

What the processes search together is what the walk alone would search, split, so the plan is the same
(docs/SEARCH.md, "The walk shared among processes"; with ``--gap`` the processes may keep another plan
within the gap). A process that stops early (the clock) leaves its part of the tree open: the walk is
then not resumed where it stopped (``SplitSearch.forget``), its next run starts from the root. A child
that fails (killed, no result) has its part searched again, by the parent alone from the root: a lost
process costs time, never a plan.

One-chunk trees of exact mode race two walks, from the end and in pipeline order (``SearchRun.race``).
With two processes or more they race in two (:func:`raced_run`): the other walk in a forked child, both to
their end below the least threshold either reached, the first to end closing the structure. Their plan
is the walks' optimum; of two equally fast plans the race keeps the lesser ``(types, layers)``, where the
race in one process keeps the one it met first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import signal
import time

from .counters import N_COUNTERS, NODES
from .split_result import SplitResult

INF = math.inf
SHARE_AT = 2_048        # nodes a walk goes alone before it is shared
SHARE_MIN = 128         # the shared depth: the shallowest with at least this many nodes per process in the
                        # walk's first SHARE_AT nodes (deeper: the subtrees are smaller and share out evenly)
RACE_LEG = 2_048        # a raced walk's nodes between two looks at the other walk (raced_run)
MAX_AUTO_WORKERS = 8    # processes ``workers="auto"`` takes at most (the cores this process may run on)


def auto_workers() -> int:
    """The processes a search takes by default: the cores this process may run on (``taskset``, cgroups'
    CPU sets), at most MAX_AUTO_WORKERS; 1 where the system has no ``fork``."""
    if not hasattr(os, "fork"):
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cores))


def shared_run(splitter, vec, tau: float, *, workers: int, shrink: float, deadline: float,
               resume: bool) -> SplitResult:
    """``splitter.run(vec, tau, deadline=deadline, resume=resume)`` (no node budget), by ``workers``
    processes once the walk passes SHARE_AT nodes. ``shrink``: the search's ``1 / (1 + gap)``."""
    if workers <= 1 or not hasattr(os, "fork"):
        return splitter.run(vec, tau, deadline=deadline, resume=resume)
    first = splitter.run(vec, tau, deadline=deadline, max_nodes=SHARE_AT, resume=resume)
    if not first.aborted or first.counters[NODES] < SHARE_AT or time.monotonic() > deadline:
        return first
    profile = splitter.depth_profile()
    depth = next((k for k in range(1, len(profile)) if profile[k] >= SHARE_MIN * workers),
                 max(range(1, len(profile)), key=profile.__getitem__))
    limit = tau if first.time_ms == INF else min(tau, first.time_ms * shrink)
    found = [(first.time_ms, (), first.types, first.layers)]   # leg one's: the processes search below it
    counters = list(first.counters)
    aborted = False
    failed = False
    shared, tau_buffer = _shared_doubles(INF)      # the least threshold
    children: list[tuple[int, int]] = []
    try:
        for index in range(1, workers):
            children.append(_fork(_child, splitter, vec, limit, deadline, workers, index, depth, tau_buffer))
        splitter.share(workers, 0, depth, tau_buffer)
        try:
            mine = splitter.run(vec, limit, deadline=deadline, resume=True)
        finally:
            splitter.share(1, 0, -1)
        results = [(mine.time_ms, splitter.best_path(), mine.types, mine.layers, mine.counters, mine.aborted)]
        while children:
            pid, read_end = children.pop(0)
            got = _collect(pid, read_end)
            if got is None:
                failed = True
            else:
                results.append(got)
        for ms, path, types, layers, ctr, stopped in results:
            found.append((ms, path, types, layers))
            for i in range(N_COUNTERS):
                counters[i] += ctr[i]
            aborted = aborted or stopped
    finally:
        for pid, read_end in children:   # the parent stopped before it read them: stop them too
            _stop_child(pid, read_end, {})
        tau_buffer = None
        _release(shared)
    if failed:
        # a child's part is not searched: the whole tree again, alone, below the best plan found
        splitter.forget()
        best = min(found, key=lambda f: (f[0], f[1]))
        again = splitter.run(vec, tau if best[0] == INF else min(tau, best[0] * shrink), deadline=deadline)
        found.append((again.time_ms, splitter.best_path(), again.types, again.layers))
        for i in range(N_COUNTERS):
            counters[i] += again.counters[i]
        aborted = again.aborted
    if aborted:
        splitter.forget()               # the parts of the tree before the walk's stop are not all searched
    ms, _path, types, layers = min(found, key=lambda f: (f[0], f[1]))
    if ms == INF:
        types = layers = ()
    return SplitResult(time_ms=ms, types=tuple(types), layers=tuple(layers), counters=tuple(counters),
                       aborted=aborted, resumed=first.resumed)


def raced_run(lead, other, vec, tau: float, *, shrink: float, deadline: float, resume_lead: bool,
              resume_other: bool) -> tuple[SplitResult, int]:
    """The race of two walks of the same tree (``SearchRun.race``: a one-chunk tree decided from the end and
    in pipeline order) in two processes: ``lead`` here, ``other`` in a forked child, each to its end in
    legs of RACE_LEG nodes, below the least threshold either has reached. The first walk to end has
    searched every plan below it: the structure is closed, and the other stops at its next leg (a walk
    that ended first asks it to; one that learns the other ended stops). Returns the result (the fastest
    plan of both; of equal ones the lesser ``(types, layers)``; both walks' counters) and which walk ended
    (0: ``lead``, 1: ``other``). The clock stops both: the result is then aborted, ``lead`` may resume
    where it stopped (it searched the whole tree before its path), ``other``'s walk (the child's) is lost.
    A child that fails without a result: ``lead`` searches the tree again alone."""
    shared, buffer = _shared_doubles(INF, 0.0)    # the least threshold, the stop flag
    reaped: dict[int, int] = {}         # the child's exit status, once a look between legs found it gone
    pid = None
    read_end = -1
    try:
        pid, read_end = _fork(_race_child, other, vec, tau, shrink, deadline, resume_other, buffer)
        lead.share(2, 0, -1, buffer)
        try:
            mine = _legs(lead, vec, tau, shrink, deadline, resume_lead, buffer, lambda: _exited(pid, reaped))
        finally:
            lead.share(1, 0, -1)
        buffer[1] = 1.0                 # the child stops at its next leg, if it runs still
        got = _collect_race(pid, read_end, reaped)
        pid = None
    finally:
        if pid is not None:             # stopped before it read the child: stop it too
            _stop_child(pid, read_end, reaped)
        buffer = None
        _release(shared)
    if got is None:
        # no result from the child, whose plans may have cut this walk: the tree again, alone
        lead.forget()
        again = lead.run(vec, tau, deadline=deadline)
        return dataclasses.replace(again, counters=tuple(a + b for a, b in zip(again.counters,
                                                                                mine[0].counters))), 0
    res, ended = mine
    other_res, other_ended = got
    ms, types, layers = min((res.time_ms, res.types, res.layers), (other_res.time_ms, other_res.types,
                                                                    other_res.layers))
    counters = tuple(a + b for a, b in zip(res.counters, other_res.counters))
    if ended or other_ended:
        if not ended:
            lead.forget()               # its walk stopped short: the other's proof closed the tree
        return SplitResult(time_ms=ms, types=types, layers=layers, counters=counters,
                           resumed=res.resumed), 0 if ended else 1
    return SplitResult(time_ms=ms, types=types, layers=layers, counters=counters, aborted=True,
                       resumed=res.resumed), 0


def _legs(walk, vec, tau: float, shrink: float, deadline: float, resume: bool, buffer, stop) -> tuple:
    """Walk the tree in legs of RACE_LEG nodes until it ends, the clock stops it or ``stop()``: ``(result of
    the legs together, whether the walk ended)``."""
    best, types, layers = INF, (), ()
    counters = [0] * N_COUNTERS
    limit, again, resumed = tau, resume, None
    # a resumed leg first walks again down to where the last one stopped (a node per depth): a leg of
    # fewer nodes than that would never get past it
    leg = max(RACE_LEG, 2 * len(walk.depth_profile()))
    while True:
        res = walk.run(vec, limit, deadline=deadline, max_nodes=leg, resume=again)
        if resumed is None:
            resumed = res.resumed
        for i in range(N_COUNTERS):
            counters[i] += res.counters[i]
        if res.time_ms < best:
            best, types, layers = res.time_ms, res.types, res.layers
        ended = not res.aborted
        if ended or res.counters[NODES] < leg or stop():
            break
        # below what the walk reached (the other's threshold included): where it stopped is resumable
        limit = min(limit, best * shrink, buffer[0])
        again = True
    return SplitResult(time_ms=best, types=types, layers=layers, counters=tuple(counters), aborted=not ended,
                       resumed=bool(resumed)), ended


def _exited(pid: int, reaped: dict[int, int]) -> bool:
    """Whether the child has exited (it writes its result, then exits); its status into ``reaped`` (it is
    reaped here, so :func:`_collect_race` must not wait for it again)."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        reaped[pid] = status
    return bool(done)


def _race_child(walk, vec, tau: float, shrink: float, deadline: float, resume: bool, buffer,
                write_end: int) -> None:
    """A forked child of :func:`raced_run`: the other walk, to its end or until asked to stop; its result to
    ``write_end`` as JSON; exit (never returns)."""
    def body() -> dict:
        walk.share(2, 1, -1, buffer)
        res, ended = _legs(walk, vec, tau, shrink, deadline, resume, buffer, lambda: buffer[1] != 0.0)
        return {**_result_doc(res), "ended": ended}
    _run_child(body, write_end)


def _collect_race(pid: int, read_end: int, reaped: dict[int, int]):
    """The race child's ``(result, whether its walk ended)``, or None where it failed."""
    got = _read_child(pid, read_end, reaped)
    if got is None:
        return None
    doc, res = got
    ended = bool(doc.get("ended"))
    return dataclasses.replace(res, aborted=not ended), ended


def _child(splitter, vec, limit: float, deadline: float, workers: int, index: int, depth: int, tau_buffer,
           write_end: int) -> None:
    """A forked child of :func:`shared_run`: walk its part of the tree, write the result to ``write_end``
    as JSON, exit (never returns)."""
    def body() -> dict:
        splitter.share(workers, index, depth, tau_buffer)
        res = splitter.run(vec, limit, deadline=deadline, resume=True)
        return {**_result_doc(res), "path": splitter.best_path()}
    _run_child(body, write_end)


def _collect(pid: int, read_end: int):
    """A child's result (as :func:`shared_run` keeps them), or None where it failed."""
    got = _read_child(pid, read_end, {})
    if got is None:
        return None
    doc, res = got
    try:
        path = tuple((int(t), int(l)) for t, l in doc["path"])
    except (KeyError, TypeError, ValueError):
        return None
    return res.time_ms, path, res.types, res.layers, res.counters, res.aborted


def _result_doc(res: SplitResult) -> dict:
    """A walk's result as JSON data (what :func:`_read_child` reads back)."""
    return {"time_ms": None if res.time_ms == INF else res.time_ms, "types": list(res.types),
            "layers": list(res.layers), "counters": list(res.counters), "aborted": res.aborted}


def _run_child(body, write_end: int) -> None:
    """The forked child's life: it ends with the search (Ctrl-C signals the whole process group; the kernel
    kills it when its parent dies), runs ``body`` and writes what it returns to ``write_end`` as JSON, then
    exits: status 0 with a result, 1 without (never returns, never runs the parent's exit handlers)."""
    status = 1
    try:
        parent = os.getppid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        if os.getppid() == parent:      # else the parent died before the kernel was asked
            data = json.dumps(body()).encode()
            while data:
                data = data[os.write(write_end, data):]
            status = 0
    except BaseException:
        pass
    finally:
        os._exit(status)


def _read_child(pid: int, read_end: int, reaped: dict[int, int]):
    """Read a child's pipe to its end, reap it (unless ``reaped`` holds its status) and parse its result:
    ``(the JSON document, the walk's SplitResult)``, or None where it failed (exit status, data)."""
    chunks = []
    try:
        while True:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
        status = reaped[pid] if pid in reaped else os.waitpid(pid, 0)[1]
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    try:
        doc = json.loads(b"".join(chunks))
        counters = tuple(int(x) for x in doc["counters"])
        if len(counters) != N_COUNTERS:
            return None
        res = SplitResult(time_ms=INF if doc["time_ms"] is None else float(doc["time_ms"]),
                          types=tuple(int(x) for x in doc["types"]), layers=tuple(int(x) for x in doc["layers"]),
                          counters=counters, aborted=bool(doc["aborted"]))
        return doc, res
    except (ValueError, KeyError, TypeError):
        return None


def _shared_doubles(*values: float) -> tuple:
    """Anonymous memory that forked children share with this process, holding ``values`` as doubles:
    ``(the mapping, a double view of it)``."""
    shared = mmap.mmap(-1, 8 * len(values))
    view = memoryview(shared).cast("d")
    for i, x in enumerate(values):
        view[i] = x
    return shared, view


def _release(shared: mmap.mmap) -> None:
    """Unmap :func:`_shared_doubles`' memory (left to the collector where a view of it is still held)."""
    try:
        shared.close()
    except BufferError:
        pass


def _fork(child, *args) -> tuple[int, int]:
    """Fork a child that runs ``child(*args, write_end)`` (it never returns: it writes its result to the
    pipe and exits); ``(its pid, the pipe's read end)``."""
    _find_prctl()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        child(*args, write_end)
    os.close(write_end)
    return pid, read_end


def _stop_child(pid: int, read_end: int, reaped: dict[int, int]) -> None:
    """Kill a child the parent no longer reads, close its pipe and reap it (each step may have been done)."""
    for step in (lambda: os.kill(pid, signal.SIGKILL), lambda: os.close(read_end),
                 lambda: pid in reaped or os.waitpid(pid, 0)):
        try:
            step()
        except OSError:
            pass


_PRCTL: list = []      # libc's prctl, looked up in the parent (a child of a threaded process must not dlopen)


def _find_prctl() -> None:
    """Look up libc's ``prctl`` once, before the first fork (Linux; elsewhere none)."""
    if _PRCTL:
        return
    try:
        import ctypes
        _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        _PRCTL.append(None)


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); elsewhere
    nothing (the parent's ``finally`` stops its children)."""
    if _PRCTL and _PRCTL[0] is not None:
        _PRCTL[0](1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG


__all__ = ["MAX_AUTO_WORKERS", "RACE_LEG", "SHARE_AT", "SHARE_MIN", "auto_workers", "raced_run", "shared_run"]
