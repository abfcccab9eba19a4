"""Agreement between ranks: JSON over collectives, phases that succeed or fail on every rank together.

Poseidon's start-up must never leave one rank training while another died, nor hang: every phase
(inventory, probing, profiling, planning, placement) runs under :class:`Phases`, and a failure on any
rank ends every rank with the same one-line message naming the phase and the rank that failed (the failure
travels through the launch's key-value store, so ranks blocked in a collective with the failed one learn
why). Every collective is bounded by the process group's timeout (``--poseidon-timeout``). Rank 0's
search result -- the plan or the error -- is broadcast, so all ranks go on or stop together.

Data crosses ranks as JSON (validated by the receiver), never pickled.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from poseidon_plugin.errors import PoseidonError

T = TypeVar("T")


class PhaseFailed(RuntimeError):
    """A phase failed on at least one rank; the message is the same on every rank.

    ``user_error`` is True when the cause is a user mistake (PoseidonError: exit 2), else exit 1.
    """

    def __init__(self, message: str, *, user_error: bool) -> None:
        super().__init__(message)
        self.user_error = user_error


def _bytes_tensor(payload: bytes, size: int, device: torch.device) -> torch.Tensor:
    buffer = torch.zeros(size, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(device)


def all_gather_json(obj: Any, device: torch.device, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order."""
    payload = json.dumps(obj, sort_keys=True, allow_nan=False).encode("utf-8")
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, _bytes_tensor(payload, longest, device), group=group)
    return [
        json.loads(bytes(t[: int(n.item())].cpu().tolist()).decode("utf-8")) for t, n in zip(gathered, sizes)
    ]


def broadcast_json(obj: Any, device: torch.device, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (other ranks pass anything, e.g. None)."""
    payload = json.dumps(obj, sort_keys=True, allow_nan=False).encode("utf-8") if dist.get_rank() == src else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buffer = _bytes_tensor(payload, int(size.item()), device)
    dist.broadcast(buffer, src=src)
    return json.loads(bytes(buffer.cpu().tolist()).decode("utf-8"))


FAILURE_KEY = "poseidon/failure"


@dataclass(kw_only=True, slots=True)
class Phases:
    """Runs named phases; a failure on any rank ends every rank with that failure's message.

    The failing rank records its message in the launch's key-value store (first failure wins)
    and leaves; the others, blocked in a collective with it or stopped by torchrun, read the record and
    report the same failure. Nothing waits for a rank that is gone: gloo reports a closed peer at once, and
    every other wait is bounded by the process-group timeout.
    """

    device: torch.device
    rank: int
    store: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    fault: tuple[str, int, str] | None = None
    """Test-only injected fault ``(phase, rank, "raise" | "exit")`` (``POSEIDON_INJECT_FAULT``)."""
    failing: bool = False
    """Set once this rank is on its way out with a failure (a SIGTERM then must not cut its message)."""

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()``; PhaseFailed (the same message on every rank) if this or another rank failed."""
        start = time.perf_counter()
        try:
            self._maybe_inject(name)
            result = fn()
        except PhaseFailed as exc:  # e.g. rank 0's search error, broadcast to every rank
            self._record_and_raise(str(exc), exc.user_error)
        except PoseidonError as exc:
            self.fail(name, str(exc), user_error=True)
        except Exception as exc:  # noqa: BLE001  (a peer's death surfaces here as a collective error)
            self.failing = True
            recorded = self.recorded_failure(wait_s=2.0)
            if recorded is not None:
                raise recorded from None
            if _is_peer_loss(exc):
                raise PhaseFailed(
                    f"{name}: lost contact with the other ranks ({type(exc).__name__}: {_first_line(exc)}); "
                    f"another rank died or did not answer within the timeout, see its output above",
                    user_error=False,
                ) from None
            self.fail(name, f"{type(exc).__name__}: {_first_line(exc)}", user_error=False)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return result

    def fail(self, name: str, error: str, *, user_error: bool) -> None:
        """Record this rank's failure of phase ``name`` for the others, then raise it here."""
        self._record_and_raise(f"{name} failed on rank {self.rank}: {error}", user_error)

    def _record_and_raise(self, message: str, user_error: bool) -> None:
        """Record the failure in the store before this rank can exit (torchrun then stops the others, whose
        SIGTERM handler reads it), and raise the first failure recorded by any rank."""
        self.failing = True
        record = {"message": message, "user": user_error}
        if self.store is not None:
            try:
                # First failure wins: when several ranks fail, all of them report the same one.
                record = json.loads(self.store.compare_set(FAILURE_KEY, "", json.dumps(record)))
            except Exception:  # noqa: BLE001  (a dead store must not hide the real error)
                pass
        raise _failure(record)

    def recorded_failure(self, wait_s: float = 0.0) -> PhaseFailed | None:
        """The first failure any rank recorded, as the exception to raise here; None when there is none."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check([FAILURE_KEY]):
                    return _failure(json.loads(self.store.get(FAILURE_KEY)))
            except Exception:  # noqa: BLE001
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _maybe_inject(self, name: str) -> None:
        if self.fault is None or self.fault[0] != name or self.fault[1] != self.rank:
            return
        if self.fault[2] == "exit":
            sys.stderr.write(f"poseidon[rank {self.rank}]: injected hard exit in {name}\n")
            sys.stderr.flush()
            os._exit(3)
        raise RuntimeError(f"injected fault in {name} (POSEIDON_INJECT_FAULT)")

    def summary(self) -> str:
        """``inventory 0.1 s | probing 0.3 s | ...`` in phase order, with the total."""
        parts = [f"{name} {sec:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                 for name, sec in self.seconds.items()]
        return " | ".join(parts) + f" | total {sum(self.seconds.values()):.2f} s"


def _failure(record: dict) -> PhaseFailed:
    return PhaseFailed(str(record["message"]), user_error=bool(record["user"]))


def _is_peer_loss(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(hint in text for hint in ("connection closed", "connection reset", "timed out", "timeout",
                                         "broken pipe", "peer"))


def parse_fault(text: str | None) -> tuple[str, int, str] | None:
    """``"profiling:2"`` or ``"profiling:2:exit"`` -> ``("profiling", 2, "exit")``; None when unset."""
    if not text:
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit() or (len(parts) == 3 and parts[2] not in ("raise", "exit")):
        raise PoseidonError(f"POSEIDON_INJECT_FAULT={text!r} is not PHASE:RANK[:raise|exit]")
    return parts[0], int(parts[1]), parts[2] if len(parts) == 3 else "raise"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
