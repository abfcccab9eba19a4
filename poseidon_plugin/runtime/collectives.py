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

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
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
# Phases any torchrun job of the script pays too (reported apart from Poseidon's own cost)
SHARED_PHASES = ("start-up",)
WHO_KEY = "poseidon/who/{}"
BEAT_KEY = "poseidon/beat/{}"
FINISHED_KEY = "poseidon/finished/{}"
"""Set by a rank whose training script returned: its silence and its exit are not a loss."""


class Liveness:
    """Each rank's heartbeat in the launch's key-value store, so that a lost rank can be *named*.

    Every rank registers its host and pid, and a daemon thread stamps its wall clock every ``beat_s``
    seconds through a store client of its own (a blocking store call of the main thread must not stall
    it). A rank that is gone is then told apart from one that is only slow: on this host by its process
    (absent or a zombie), elsewhere by a beat older than ``silent_s``. A stopped (SIGSTOP) or hung rank
    stops beating too. A store that is not a TCPStore (no address to connect to) disables it: messages then
    fall back to not naming the rank.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, beat_s: float = 1.0, silent_s: float = 5.0,
                 prefix: str = ""):
        self.rank, self.world_size, self.beat_s, self.silent_s = rank, world_size, beat_s, silent_s
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None
        # Every store call holds this lock, and stop() closes the client under it: a thread still inside the
        # store client's C++ call when the process exits aborts it ("terminate called without an active
        # exception"), which turned a finished job into a SIGABRT. Reentrant: the SIGTERM handler may ask
        # lost() while the main thread is inside it.
        self._lock = threading.RLock()
        self._closed = False
        tcp = store
        while hasattr(tcp, "underlying_store"):  # torchrun and the process group each add a PrefixStore
            tcp = tcp.underlying_store
        if isinstance(tcp, dist.TCPStore):
            try:
                self._client = dist.TCPStore(tcp.host, tcp.port, is_master=False,
                                             timeout=datetime.timedelta(seconds=max(5.0, 4 * beat_s)))
                if prefix:  # one attempt's keys: a restarted rank must not read attempt 0's pids and beats
                    self._client = dist.PrefixStore(prefix, self._client)
            except Exception:  # noqa: BLE001  (no liveness is better than no start)
                self._client = None

    def start(self) -> "Liveness":
        """Register this rank and start beating."""
        if self._client is not None:
            with self._lock:
                self._client.set(WHO_KEY.format(self.rank), json.dumps({"host": self.host, "pid": os.getpid()}))
                self._client.set(BEAT_KEY.format(self.rank), repr(time.time()))
            self._thread = threading.Thread(target=self._beat, name="poseidon-liveness", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (the training script's own failures are torchrun's to report). Returns
        once no thread of this object is inside a store call, and none will enter one: a process that exits
        while a thread is inside the store client's C++ call can abort ("terminate called without an active
        exception"). A call in flight is bounded by the client's timeout."""
        self._stop.set()
        with self._lock:
            self._closed = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(2.0, 2 * self.beat_s))

    def _open(self) -> bool:
        """Whether store calls may still be made (call with the lock held)."""
        return self._client is not None and not self._closed

    def mark_finished(self) -> None:
        """This rank's script returned: the others stop counting it as lost when it goes quiet or exits."""
        with self._lock:
            if not self._open():
                return
            try:
                self._client.set(FINISHED_KEY.format(self.rank), "1")
            except Exception:  # noqa: BLE001
                pass

    def guard(self, on_lost: Callable[[list[str]], None], *, silent_s: float, ranks: Any = None) -> None:
        """While this rank trains, call ``on_lost`` (once, from a daemon thread) when another rank (of ``ranks``,
        default all) is lost: its
        process gone on this host, or silent for ``silent_s`` elsewhere. Without it a peer lost during training
        can leave this rank waiting in a store call for the process group's timeout (gloo's 30 minutes for a
        group megatron-core creates) instead of letting torchrun restart the job at once."""
        if self._client is None:
            return

        def watch() -> None:
            while not self._stop.wait(self.beat_s):
                gone = self.lost(silent_s=silent_s, ranks=ranks)
                if gone and not self._stop.is_set():
                    on_lost(gone)
                    return

        threading.Thread(target=watch, name="poseidon-guard", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            with self._lock:
                if not self._open():
                    return
                try:
                    self._client.set(BEAT_KEY.format(self.rank), repr(time.time()))
                except Exception:  # noqa: BLE001  (the store is gone: the launch is ending)
                    return

    def lost(self, *, silent_s: float | None = None, ranks: Any = None) -> list[str]:
        """The other ranks (of ``ranks``, default all) that are gone or silent (for ``silent_s``, default the
        instance's), each described (``rank 2 (pid 81 on node-a): died``); a rank whose script finished is
        not lost."""
        return [description for _, description in self._lost(silent_s, ranks)]

    def lost_ids(self, *, silent_s: float | None = None) -> set[int]:
        """The ranks :meth:`lost` describes."""
        return {rank for rank, _ in self._lost(silent_s, None)}

    def _lost(self, silent_s: float | None, ranks: Any) -> list[tuple[int, str]]:
        with self._lock:
            return self._lost_now(self.silent_s if silent_s is None else silent_s, ranks) if self._open() else []

    def _lost_now(self, silent_s: float, ranks: Any) -> list[tuple[int, str]]:
        out = []
        now = time.time()
        for rank in range(self.world_size) if ranks is None else sorted(ranks):
            if rank == self.rank:
                continue
            try:
                if self._client.check([FINISHED_KEY.format(rank)]):
                    continue
                who = json.loads(self._client.get(WHO_KEY.format(rank))) \
                    if self._client.check([WHO_KEY.format(rank)]) else None
                beat = float(self._client.get(BEAT_KEY.format(rank))) \
                    if self._client.check([BEAT_KEY.format(rank)]) else None
            except Exception:  # noqa: BLE001
                return out
            if who is None:
                continue  # never registered: it is still starting, or failed before the process group
            where = f"rank {rank} (pid {who['pid']} on {who['host']})"
            if who["host"] == self.host and not _process_alive(int(who["pid"])):
                out.append((rank, f"{where}: its process is gone"))
            elif beat is not None and now - beat > silent_s:
                out.append((rank, f"{where}: silent for {now - beat:.0f} s (stopped, hung or dead)"))
        return out


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
    liveness: Liveness | None = None
    """Names the rank that was lost when a collective fails without any rank's recorded message."""

    stall_s: float = 15.0
    """After this long in one phase, name every rank that is gone or silent (once each, on stderr)."""

    def run(self, name: str, fn: Callable[[], T]) -> T:
        """``fn()``; PhaseFailed (the same message on every rank) if this or another rank failed."""
        start = time.perf_counter()
        done = threading.Event()
        if self.liveness is not None:
            threading.Thread(target=self._watch_stall, args=(name, done), name="poseidon-stall",
                             daemon=True).start()
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
                lost = self.lost_ranks()
                raise PhaseFailed(
                    f"{name}: lost contact with {'; '.join(lost)}" if lost else
                    f"{name}: lost contact with the other ranks ({type(exc).__name__}: {first_line(exc)}); "
                    f"another rank died or did not answer within the timeout, see its output above",
                    user_error=False,
                ) from None
            self.fail(name, f"{type(exc).__name__}: {first_line(exc)} ({origin(exc)})", user_error=False)
        finally:
            done.set()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return result

    def _watch_stall(self, name: str, done: threading.Event) -> None:
        """While phase ``name`` waits longer than ``stall_s``, say which ranks it may be waiting for."""
        said: set[str] = set()
        if done.wait(self.stall_s):
            return
        while not done.is_set():
            for line in self.lost_ranks():
                rank = line.partition(" (")[0]
                if rank not in said:
                    said.add(rank)
                    sys.stderr.write(f"poseidon[rank {self.rank}]: {name} is waiting for {line}; it fails "
                                     f"when the timeout (--poseidon-timeout) runs out\n")
                    sys.stderr.flush()
            done.wait(5.0)

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

    def lost_ranks(self) -> list[str]:
        """Other ranks known to be gone or silent, described; empty when none is known (or no liveness)."""
        return self.liveness.lost() if self.liveness is not None else []

    def _maybe_inject(self, name: str) -> None:
        if self.fault is None or self.fault[0] != name or self.fault[1] != self.rank:
            return
        if self.fault[2] == "exit":
            sys.stderr.write(f"poseidon[rank {self.rank}]: injected hard exit in {name}\n")
            sys.stderr.flush()
            os._exit(3)
        if self.fault[2] in ("kill", "stop"):  # a rank lost without a word: killed, or frozen
            os.kill(os.getpid(), signal.SIGKILL if self.fault[2] == "kill" else signal.SIGSTOP)
        if self.fault[2] == "wait":  # until the launcher stops it (SIGTERM)
            while True:
                time.sleep(0.1)
        raise RuntimeError(f"injected fault in {name} (POSEIDON_INJECT_FAULT)")

    def summary(self) -> str:
        """``Poseidon 1.52 s (inventory 0.10 s | probing 0.30 s | ...); start-up 5.68 s ...``: Poseidon's own
        phases and their total, apart from the start-up (imports, process group) that the training script
        pays under plain torchrun too."""
        own = {name: sec for name, sec in self.seconds.items() if name not in SHARED_PHASES}
        parts = [f"{name} {sec:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                 for name, sec in own.items()]
        text = f"Poseidon {sum(own.values()):.2f} s ({' | '.join(parts)})"
        shared = [f"{name} {self.seconds[name]:.2f} s" for name in SHARED_PHASES if name in self.seconds]
        if shared:
            text += f"; {', '.join(shared)} before it (imports and process group: a plain torchrun run pays them too)"
        return text


def _failure(record: dict) -> PhaseFailed:
    return PhaseFailed(str(record["message"]), user_error=bool(record["user"]))


def _is_peer_loss(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(hint in text for hint in ("connection closed", "connection reset", "timed out", "timeout",
                                         "broken pipe", "peer"))


FAULT_KINDS = ("raise", "exit", "kill", "stop", "wait")
"""``wait``: the rank waits until the launcher stops it (a membership change in elastic tests)."""


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def parse_fault(text: str | None, attempt: int = 0, world_size: int = 1) -> tuple[str, int, str] | None:
    """``"profiling:2"``, ``"profiling:2:exit"`` -> ``("profiling", 2, "exit")``; ``"hand-over:1:kill:0"`` only on
    torchrun attempt 0 (restart tests), ``"hand-over:0:wait:w1"`` only in a world of 1 rank (elastic tests: a
    membership change does not count as a restart); None when unset or for another attempt or world."""
    if not text:
        return None
    parts = text.split(":")
    when = parts[3] if len(parts) == 4 else ""
    if (len(parts) not in (2, 3, 4) or not parts[1].isdigit() or (len(parts) >= 3 and parts[2] not in FAULT_KINDS)
            or (len(parts) == 4 and not (when.isdigit() or (when[:1] == "w" and when[1:].isdigit())))):
        raise PoseidonError(f"POSEIDON_INJECT_FAULT={text!r} is not "
                            f"PHASE:RANK[:{'|'.join(FAULT_KINDS)}[:ATTEMPT|wWORLD]]")
    if when and (int(when[1:]) != world_size if when[0] == "w" else int(when) != attempt):
        return None
    return parts[0], int(parts[1]), parts[2] if len(parts) >= 3 else "raise"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def origin(exc: BaseException) -> str:
    """Where ``exc`` was raised: ``at megatron/core/transformer/torch_norm.py:45 in __new__`` (the path from
    its package folder on, so it reads the same on every machine). The innermost frame that is neither torch's
    nor a torch-function mode passing the call on (the CPU shim's): the call that failed, not the plumbing."""
    frames = [(f, _package_path(f.filename)) for f in traceback.extract_tb(exc.__traceback__)]
    if not frames:
        return "where unknown"
    caller = [(f, path) for f, path in frames if not path.startswith("torch/") and f.name != "__torch_function__"]
    frame, path = (caller or frames)[-1]
    return f"at {path}:{frame.lineno} in {frame.name}"


def _package_path(filename: str) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    for top in ("megatron", "poseidon_plugin", "torch", "mindspeed", "mindspeed_llm"):
        if top in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(top):])
    return parts[-1]
