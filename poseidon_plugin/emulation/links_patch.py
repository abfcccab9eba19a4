"""Emulated links: inter-stage p2p transfers and the DP gradient sync take their emulated time.

Used only by the deterministic emulation (``--poseidon-emulate-model``, ``emulation/harness.py``).
Megatron-core's ``P2PCommunicator._communicate`` posts its sends and receives through one of two module
functions, ``_batched_p2p_ops`` (a list of requests) or ``_p2p_ops`` (a dict, used with ``overlap_p2p_comm``),
and then waits for the requests (at once, or later in the schedule with overlap). The wrappers here return
the same requests, each wrapped so that ``wait()`` first waits for the real (tiny) transfer and then sleeps
until the emulated transfer is over: *the later of the two posts, plus the link's* ``send_ms``, which is
what the simulator's ``megatron`` model charges.

The later of the two posts needs the peer's posting time. Ranks of one host share it through a small mapped
file (see :class:`Stamps`): each op writes its posting time under (sender, receiver, its side, its sequence
number on that ordered pair), and the j-th send from A to B is the j-th receive at B from A (gloo, like NCCL,
matches in posting order on a pair; megatron-core uses one communicator per ordered pair). The real transfer
completes only once both sides posted (a rendezvous), so the peer's stamp is there when the wait returns.
The bootstrap hands every planned rank the same file, whichever torchrun agent started it
(``emulation/harness.share_stamps``). Without it (a job on several hosts, or no launcher) the transfer
counts from when its completion is first seen, and several requests of one call found complete together
share that moment.

``finalize_model_grads`` is held for the emulated DP sync time of the rank's stage (the cost model's ring
all-reduce of the preset's gradients over the DP group's emulated link) *before* it runs for real: it
starts with the DP gradient all-reduce (``finish_grad_sync``), which begins when the stage's last backward
ends (its DP replicas run in lockstep), and goes on to the pipeline collectives (the tied embedding's
all-reduce between the first and the last stage), which wait for the other stages. Holding it after its
return charged the last stage the first stage's remaining backwards and then its own sync on top (a 1F1B
plan with a long last stage measured 11 % over its prediction).

Every wrapper falls through to the original until :func:`set_state` gives an emulation state that has been
bound to the plan (before that, e.g. while profiling, nothing is delayed and nothing is counted).
"""

from __future__ import annotations

import functools
import mmap
import os
import time
from typing import Any

from poseidon_plugin.emulation.compute_patch import sleep_until
from poseidon_plugin.patches.table import Patch, PatchTable

STAMPS_ENV = "POSEIDON_EMULATION_STAMPS"
"""Where this agent's launcher lets its ranks create stamp files (a path prefix in a folder it removes at
the end; set by ``poseidon-run`` for an emulated job)."""

_state: dict[str, Any] = {"emulation": None, "stamps": None}


def set_state(state: Any, stamps: Stamps | None = None) -> None:
    """The rank's ``EmulationState`` (``p2p_ms(peer, mbs)``, ``sync_ms``, ``my_rank``), or None to switch
    delays off; ``stamps`` shares posting times with the peers (None: none shared)."""
    _state["emulation"] = state
    _state["stamps"] = stamps


def set_stamps(stamps: Stamps | None) -> None:
    """Share posting times through ``stamps`` from now on (None: not shared)."""
    _state["stamps"] = stamps


class Stamps:
    """Posting times of the emulated p2p ops, shared by the ranks of one host through a mapped file.

    Slot ``(src, dst, side, seq % SLOTS)`` holds ``(seq + 1, time)``: ``side`` 0 is the sender's post, 1 the
    receiver's. The writer stores the time before the sequence number, the reader checks the number on both
    sides of reading the time (8-byte aligned stores are atomic). At most a few ops are in flight on a pair,
    so ``SLOTS`` entries never wrap onto one still to be read; a stale or missing entry reads as None.
    Times are ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for every process of the host).
    """

    SLOTS = 16
    WAIT_S = 1.0
    """How long a reader waits for a stamp its peer writes right after posting (then: None)."""

    def __init__(self, path: str, world_size: int, *, create: bool = True) -> None:
        """Map ``path`` for ``world_size`` ranks; ``create=False``: it must exist (OSError otherwise)."""
        self.world = int(world_size)
        size = self.world * self.world * 2 * self.SLOTS * 2 * 8
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every rank asks the same size; zero-filled: no stamp yet
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("d")
        self._next: dict[tuple[int, int, int], int] = {}

    def _index(self, src: int, dst: int, side: int, seq: int) -> int:
        return (((src * self.world + dst) * 2 + side) * self.SLOTS + seq % self.SLOTS) * 2

    def post(self, src: int, dst: int, side: int, when: float) -> int:
        """Record this rank's post of the next op on ``src -> dst`` (its side); returns its sequence number."""
        key = (src, dst, side)
        seq = self._next.get(key, 0)
        self._next[key] = seq + 1
        i = self._index(src, dst, side, seq)
        self._slots[i + 1] = when
        self._slots[i] = float(seq + 1)
        return seq

    def read(self, src: int, dst: int, side: int, seq: int) -> float | None:
        """The posting time of op ``seq`` on ``src -> dst`` by ``side``, once written (None after WAIT_S)."""
        i = self._index(src, dst, side, seq)
        give_up = None
        while True:
            if self._slots[i] == seq + 1:
                when = self._slots[i + 1]
                if self._slots[i] == seq + 1:
                    return when
            now = time.perf_counter()
            give_up = give_up or now + self.WAIT_S
            if now > give_up or self._slots[i] > seq + 1:
                return None
            time.sleep(0.0001)

    def in_range(self, *ranks: int) -> bool:
        return all(0 <= r < self.world for r in ranks)


def _stamps() -> Stamps | None:
    return _state["stamps"]


class _Call:
    """The requests of one p2p call: without stamps, when one wait returns, every request already complete
    is stamped with that moment."""

    __slots__ = ("works",)

    def __init__(self) -> None:
        self.works: list[_DelayedWork] = []


class _DelayedWork:
    """A torch.distributed Work whose ``wait()`` also lasts the emulated transfer time.

    ``peer_post`` is where the peer's posting time is found (``(stamps, src, dst, side, seq)``), with
    ``posted_at`` this side's; without it the transfer counts from when its completion was first seen.
    """

    __slots__ = ("work", "seconds", "call", "done_at", "waited", "posted_at", "peer_post")

    def __init__(self, work: Any, seconds: float, call: _Call, posted_at: float = 0.0,
                 peer_post: tuple | None = None) -> None:
        self.work, self.seconds, self.call, self.done_at, self.waited = work, seconds, call, None, False
        self.posted_at, self.peer_post = posted_at, peer_post
        call.works.append(self)

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if not self.waited:
            self.work.wait(*args, **kwargs)  # always, even when stamped complete: it reports the transfer's errors
            self.waited = True
            if self.done_at is None:
                self.done_at = self._both_posted()
            if self.done_at is None:
                now = time.perf_counter()
                self.done_at = now
                for other in self.call.works:
                    if other.done_at is None and other.peer_post is None and other._really_completed():
                        other.done_at = now
        sleep_until(self.done_at + self.seconds)
        return True

    def _both_posted(self) -> float | None:
        """The later of the two posts (the real transfer is complete, so the peer's stamp is written)."""
        if self.peer_post is None:
            return None
        stamps, *where = self.peer_post
        peer = stamps.read(*where)
        return None if peer is None else max(self.posted_at, peer)

    def _really_completed(self) -> bool:
        try:
            return bool(self.work.is_completed())
        except (AttributeError, RuntimeError):
            return False

    def is_completed(self) -> bool:
        return self.done_at is not None and time.perf_counter() >= self.done_at + self.seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _seconds(state: Any, tensor: Any, peer: int) -> float:
    if tensor is None or tensor.dim() < 2:
        return 0.0
    return state.p2p_ms(peer, int(tensor.shape[1])) / 1e3


_ORDER = ("send_prev", "recv_prev", "send_next", "recv_next")
"""``_batched_p2p_ops`` posts in this order, skipping absent tensors (``_p2p_ops`` returns a dict in its
posting order)."""


def _delayed_p2p(original):
    """Wrapper for ``_batched_p2p_ops`` / ``_p2p_ops`` (same keyword-only signature)."""

    @functools.wraps(original)
    def ops(**kwargs: Any) -> Any:
        reqs = original(**kwargs)
        posted = time.perf_counter()
        state = _state["emulation"]
        if state is None or state.my_rank is None or not reqs:
            return reqs
        me, prev, nxt = state.my_rank, kwargs["prev_pipeline_rank"], kwargs["next_pipeline_rank"]
        delays = {
            "send_prev": _seconds(state, kwargs.get("tensor_send_prev"), prev),
            "recv_prev": _seconds(state, kwargs.get("tensor_recv_prev"), prev),
            "send_next": _seconds(state, kwargs.get("tensor_send_next"), nxt),
            "recv_next": _seconds(state, kwargs.get("tensor_recv_next"), nxt),
        }
        if isinstance(reqs, dict):
            posted_in_order = list(reqs.items())
        else:
            names = [n for n in _ORDER if kwargs.get("tensor_" + n) is not None]
            if len(names) != len(reqs):  # coalesced requests: the call lasts its slowest link
                call, slowest = _Call(), max(delays.values())
                return [_DelayedWork(work, slowest, call) for work in reqs]
            posted_in_order = list(zip(names, reqs))
        stamps, call, out = _stamps(), _Call(), []
        for name, work in posted_in_order:
            peer_post = None
            if stamps is not None:
                send = name.startswith("send")
                peer = prev if name.endswith("prev") else nxt
                src, dst = (me, peer) if send else (peer, me)
                if stamps.in_range(src, dst):
                    seq = stamps.post(src, dst, 0 if send else 1, posted)
                    peer_post = (stamps, src, dst, 1 if send else 0, seq)
            out.append((name, _DelayedWork(work, delays.get(name, 0.0), call, posted, peer_post)))
        return dict(out) if isinstance(reqs, dict) else [work for _name, work in out]

    return ops


def _held_sync(original):
    """Wrapper for ``finalize_model_grads``: the rank's emulated DP sync time first, then the real call."""

    @functools.wraps(original)
    def finalize(*args: Any, **kwargs: Any) -> Any:
        state = _state["emulation"]
        sync_ms = getattr(state, "sync_ms", 0.0) if state is not None else 0.0
        if sync_ms > 0.0:
            sleep_until(time.perf_counter() + sync_ms / 1e3)
        return original(*args, **kwargs)

    return finalize


TABLE = PatchTable(
    "emulated_links",
    (
        Patch(target="megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops", make=_delayed_p2p),
        Patch(target="megatron.core.pipeline_parallel.p2p_communication._p2p_ops", make=_delayed_p2p),
        Patch(target="megatron.core.distributed.finalize_model_grads.finalize_model_grads", make=_held_sync,
              sweep=True),
    ),
)
