"""Emulated links: inter-stage p2p transfers and the DP gradient sync take their emulated time.

Used only by the deterministic emulation (``--poseidon-emulate-model``, ``poseidon_plugin/runtime/emulation.py``).
Megatron-core's ``P2PCommunicator._communicate`` posts its sends and receives through one of two module
functions, ``_batched_p2p_ops`` (a list of requests) or ``_p2p_ops`` (a dict, used with ``overlap_p2p_comm``),
and then waits for the requests (at once, or later in the schedule with overlap). The wrappers here return
the same requests, each wrapped so that ``wait()`` first waits for the real (tiny) transfer and then
sleeps until *its completion + the emulated transfer time* of the link to that peer: the moment both sides
had posted, plus ``send_ms``, which is what the simulator's ``megatron`` model charges. Several requests of
one call complete together when they really did (a request found complete when another's wait returns
shares that completion time), so the call lasts the slowest link's time, not the sum.

``finalize_model_grads`` (DP gradient all-reduce, megatron's DDP) runs for real and is then held for the
emulated sync time of the rank's stage (the cost model's ring all-reduce of the preset's gradients over the
DP group's emulated link), counted from its return: the real collective returns when the last replica
arrived, which is when the emulated all-reduce would start.

Every wrapper falls through to the original until :func:`set_state` gives an emulation state that has been
bound to the plan (before that, e.g. while profiling, nothing is delayed).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from .emulation import sleep_until
from .table import Patch, PatchTable

_state: dict[str, Any] = {"emulation": None}


def set_state(state: Any) -> None:
    """The rank's ``EmulationState`` (``p2p_ms(peer, mbs)``, ``sync_ms``), or None to switch delays off."""
    _state["emulation"] = state


class _Call:
    """The requests of one p2p call: when one wait returns, every request already complete is stamped."""

    __slots__ = ("works",)

    def __init__(self) -> None:
        self.works: list[_DelayedWork] = []


class _DelayedWork:
    """A torch.distributed Work whose ``wait()`` also lasts the emulated transfer time."""

    __slots__ = ("work", "seconds", "call", "done_at", "waited")

    def __init__(self, work: Any, seconds: float, call: _Call) -> None:
        self.work, self.seconds, self.call, self.done_at, self.waited = work, seconds, call, None, False
        call.works.append(self)

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        if not self.waited:
            self.work.wait(*args, **kwargs)  # always, even when stamped complete: it reports the transfer's errors
            self.waited = True
            if self.done_at is None:
                now = time.perf_counter()
                self.done_at = now
                for other in self.call.works:
                    if other.done_at is None and other._really_completed():
                        other.done_at = now
        sleep_until(self.done_at + self.seconds)
        return True

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


def _delayed_p2p(original):
    """Wrapper for ``_batched_p2p_ops`` / ``_p2p_ops`` (same keyword-only signature)."""

    @functools.wraps(original)
    def ops(**kwargs: Any) -> Any:
        reqs = original(**kwargs)
        state = _state["emulation"]
        if state is None or state.my_rank is None or not reqs:
            return reqs
        prev, nxt = kwargs["prev_pipeline_rank"], kwargs["next_pipeline_rank"]
        delays = {
            "send_prev": _seconds(state, kwargs.get("tensor_send_prev"), prev),
            "recv_prev": _seconds(state, kwargs.get("tensor_recv_prev"), prev),
            "send_next": _seconds(state, kwargs.get("tensor_send_next"), nxt),
            "recv_next": _seconds(state, kwargs.get("tensor_recv_next"), nxt),
        }
        call = _Call()
        if isinstance(reqs, dict):
            return {name: _DelayedWork(work, delays.get(name, 0.0), call) for name, work in reqs.items()}
        # _batched_p2p_ops posts in this order, skipping absent tensors
        names = [n for n in ("send_prev", "recv_prev", "send_next", "recv_next")
                 if kwargs.get("tensor_" + n) is not None]
        if len(names) == len(reqs):
            return [_DelayedWork(work, delays[n], call) for work, n in zip(reqs, names)]
        slowest = max(delays.values())  # coalesced requests: the call lasts its slowest link
        return [_DelayedWork(work, slowest, call) for work in reqs]

    return ops


def _held_sync(original):
    """Wrapper for ``finalize_model_grads``: hold it for the rank's emulated DP sync time."""

    @functools.wraps(original)
    def finalize(*args: Any, **kwargs: Any) -> Any:
        state = _state["emulation"]
        sync_ms = getattr(state, "sync_ms", 0.0) if state is not None else 0.0
        if sync_ms <= 0.0:
            return original(*args, **kwargs)
        out = original(*args, **kwargs)
        sleep_until(time.perf_counter() + sync_ms / 1e3)
        return out

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
