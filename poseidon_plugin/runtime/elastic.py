"""Restarts and elastic launches: every torchrun attempt gets a key-value store of its own.

torchrun (2.13) shares one TCPStore, hosted by the rendezvous' rank-0 agent and created once for the
agent's lifetime, with the workers of *every* attempt (``TORCHELASTIC_USE_AGENT_STORE=True``), while the
workers' ``env://`` rendezvous assumes a fresh store per attempt and adds no prefix
(``torch/distributed/rendezvous.py``: "We create a new TCPStore for every retry"). A restarted rank that
reaches ``init_process_group`` before a peer has re-published its address reads the peer's attempt-0
address: gloo connects to a dead process (``connectFullMesh failed ... Connection refused``) or waits for
it (plain torchrun hangs). Poseidon's own keys (heartbeats, failure record) go stale the same way.

Two measures (docs/RUNTIME.md, "Restarts and elastic jobs"):

- the launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless the user set it: with the c10d
  rendezvous every round (a restart or a membership change) then gets a fresh store on a fresh port,
  hosted by worker rank 0 of that round;
- where the agent's store is used all the same (the static rendezvous, or a user who set the variable to
  0), each rank opens the store itself under the prefix ``poseidon/attempt-N`` (N =
  ``TORCHELASTIC_RESTART_COUNT``), so attempts never mix their keys there either.

A rank the plan leaves unused must not exit while the job runs: its agent would enter torchrun's exit
barrier, time out (300 s) and leave, taking the rendezvous store with it when it hosts it, and with a
per-round store the process of launcher rank 0 *is* the store. Unused ranks therefore wait until every
planned rank has finished (:func:`wait_for_job`); the store's host waits for every rank to be done.
torchrun has no option for the barrier's timeout; tests shorten it with :data:`EXIT_BARRIER_ENV`
(:func:`torchrun_agent`) to check that a job outliving it ends well.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.specs.fields import write_json_atomic

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
PLANNED_DONE_KEY = "poseidon/planned-done"
DONE_KEY = "poseidon/done"
LEFT_KEY = "poseidon/left/{}"
"""Set by a rank leaving after a failure (:func:`mark_left`)."""


def attempt(env: Mapping[str, str] = os.environ) -> int:
    """torchrun's restart count of this attempt (0 outside torchrun)."""
    try:
        return int(env.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


def agent(env: Mapping[str, str] = os.environ) -> int:
    """This rank's agent (torchrun's ``GROUP_RANK``): part of a node's identity, besides its host."""
    try:
        return int(env.get("GROUP_RANK", "0"))
    except ValueError:
        return 0


def store_prefix(env: Mapping[str, str] = os.environ) -> str:
    """The prefix of every key this attempt writes.

    With a store of its own per round (``TORCHELASTIC_USE_AGENT_STORE`` false: the c10d default this launcher
    sets) the store already belongs to one attempt. torchrun's agent store outlives attempts: the static
    rendezvous, whose agents all restart on a failure, so their restart counts agree. The restart count
    is an agent's own: an agent whose workers were healthy restarts them for another agent's membership
    change without counting, so it cannot name a c10d round (a shared c10d store is left to the timeout).
    """
    if env.get(AGENT_STORE_ENV) != "True":
        return "poseidon/round"
    return f"poseidon/attempt-{attempt(env)}"


def hosts_store(rank: int, env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process hosts the workers' store (torchrun's rule: rank 0 unless the agent hosts it)."""
    return rank == 0 and env.get(AGENT_STORE_ENV) != "True"


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the launcher sets for torchrun's agents: a fresh worker store per rendezvous round."""
    return {} if SHARE_STORE_ENV in environ else {SHARE_STORE_ENV: "1"}


EXIT_BARRIER_ENV = "POSEIDON_INJECT_EXIT_BARRIER"
"""Test-only: seconds torchrun's agents wait in their exit barrier (torchrun's 300 s is not an option)."""


def exit_barrier_timeout(env: Mapping[str, str] = os.environ) -> float | None:
    """:data:`EXIT_BARRIER_ENV` in seconds (None when unset); PoseidonError when it is not a positive number."""
    text = env.get(EXIT_BARRIER_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise PoseidonError(f"{EXIT_BARRIER_ENV}={text!r} is not a positive number of seconds (it is test-only; "
                            f"unset it for torchrun's 300 s)")
    return seconds


@contextlib.contextmanager
def torchrun_agent(exit_barrier_s: float | None) -> Iterator[None]:
    """torchrun's agents of this launcher: with their exit barrier's timeout (``exit_barrier_s``; None:
    torchrun's own), killing a stopped worker at once when the agent stops its workers
    (:func:`_kill_stopped_on_close`)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent

    class Agent(original):  # the class torchrun's launch_agent builds
        def __init__(self, *args, **kwargs) -> None:
            if exit_barrier_s is not None:
                kwargs["exit_barrier_timeout"] = exit_barrier_s
            super().__init__(*args, **kwargs)

        def _start_workers(self, *args, **kwargs):
            result = super()._start_workers(*args, **kwargs)
            if self._pcontext is not None:
                _kill_stopped_on_close(self._pcontext)
            return result

    api.LocalElasticAgent = Agent
    try:
        yield
    finally:
        api.LocalElasticAgent = original


def _kill_stopped_on_close(pcontext) -> None:
    """Make ``pcontext.close`` (torchrun's agent calls it when it stops its workers: a failure, a restart,
    the end) first kill (``SIGKILL``, its whole process group: each worker leads a session of its own) each
    worker that is stopped: it cannot take torchrun's ``SIGTERM``, which torchrun would wait 30 s on
    before killing it all the same."""
    close = pcontext.close

    def close_killing_stopped(*args, **kwargs):
        for pid in pcontext.pids().values():
            if process_stopped(int(pid)):
                try:
                    os.killpg(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return close(*args, **kwargs)

    pcontext.close = close_killing_stopped


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (``SIGSTOP``, ``SIGTSTP``: state ``T`` in
    ``/proc/PID/stat``); False where that cannot be read (gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["T"]


def open_store(rank: int, world_size: int, timeout_s: float, env: Mapping[str, str] = os.environ):
    """This attempt's store: torchrun's (``MASTER_ADDR:MASTER_PORT``, hosted as torchrun would) under
    :func:`store_prefix`. Outside torchrun without those variables: None (``env://`` then fails as usual)."""
    import torch.distributed as dist

    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    tcp = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, hosts_store(rank, env),
                        datetime.timedelta(seconds=timeout_s), multi_tenant=True)
    return dist.PrefixStore(store_prefix(env), tcp)


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: float) -> None:
    """``init_process_group`` on this attempt's store (``env://`` when there is no torchrun store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = open_store(rank, world_size, timeout_s)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


# --- what every agent was told ------------------------------------------------------------------

EMULATE_ENV = "POSEIDON_EMULATE"
PER_AGENT = "(each agent its own devices)"
"""What the agreement compares for ``--poseidon-emulate`` when every agent declares its own devices."""


def agent_declares(declared: int, world_size: int, local_world_size: int) -> bool:
    """Whether ``--poseidon-emulate`` of ``declared`` devices names this agent's devices only (one per rank of
    this agent, while the job has more ranks): each agent of an elastic job declares its own, and the job's
    devices are the union of the agents that are there. A declaration of the whole job's devices (the
    same on every agent) is the other case; with one agent both are the same."""
    return declared == local_world_size and declared != world_size


def told(options_env: Mapping[str, str], script_args: list[str], *, own_devices: str | None = None,
         host_factor: float = 1.0) -> dict:
    """What this rank was started with, comparable across agents: its agent, options and job flags;
    ``own_devices``: this agent's own ``--poseidon-emulate`` (compared as :data:`PER_AGENT`); ``host_factor``:
    how much slower than the emulation's reference its host runs (not compared: :func:`slowest_host`)."""
    options = dict(sorted(options_env.items()))
    if own_devices is not None:
        options[EMULATE_ENV] = PER_AGENT
    return {"agent": agent(), "options": options, "args": list(script_args), "devices": own_devices,
            "host_factor": float(host_factor)}


def slowest_host(everyone: list[dict]) -> float:
    """The host factor the whole job emulates with: its agents' largest (each agent times its own host, and
    every rank must build the same emulation; the slowest host's deadlines are the ones to keep)."""
    return max(float(doc.get("host_factor", 1.0)) for doc in everyone)


def union_of_agents(everyone: list[dict]) -> str:
    """The job's ``--poseidon-emulate``: every agent's own declaration, in rank order (torchrun numbers an
    agent's ranks contiguously, agents in ``GROUP_RANK`` order). PoseidonError when they do not fit."""
    parts: list[str] = []
    seen: list[int] = []
    for rank, doc in enumerate(everyone):
        if not doc.get("devices"):
            raise PoseidonError(f"agent {doc['agent']} (rank {rank}) declared no devices of its own; give every "
                                f"agent --poseidon-emulate with its own devices")
        if seen and seen[-1] == doc["agent"]:
            continue
        if doc["agent"] in seen:
            raise PoseidonError(f"agent {doc['agent']}'s ranks are not contiguous (rank {rank}); torchrun "
                                f"numbers each agent's ranks in one block")
        seen.append(doc["agent"])
        parts.append(doc["devices"])
    return ",".join(parts)


def check_agreement(everyone: list[dict]) -> None:
    """PoseidonError naming the first agent and field told differently from rank 0's agent."""
    first = everyone[0]
    for rank, other in enumerate(everyone):
        if other["options"] != first["options"]:
            keys = sorted(set(first["options"]) | set(other["options"]))
            key = next(k for k in keys if first["options"].get(k) != other["options"].get(k))
            raise PoseidonError(
                f"agent {other['agent']} (rank {rank}) was started with {key}={other['options'].get(key, '(unset)')!r} "
                f"but agent {first['agent']} (rank 0) with {key}={first['options'].get(key, '(unset)')!r}; "
                f"give every agent the same --poseidon-* options")
        if other["args"] != first["args"]:
            index = next((i for i, (a, b) in enumerate(zip(first["args"], other["args"])) if a != b),
                         min(len(first["args"]), len(other["args"])))
            mine = " ".join(other["args"][max(0, index - 1): index + 2]) or "(end)"
            theirs = " ".join(first["args"][max(0, index - 1): index + 2]) or "(end)"
            raise PoseidonError(
                f"agent {other['agent']} (rank {rank}) runs the script with different flags than agent "
                f"{first['agent']} (rank 0): argument {index + 1} is {mine!r} there, {theirs!r} on rank 0; "
                f"give every agent the same command line")


# --- the end of an attempt ------------------------------------------------------------------------


def mark_done(store, *, planned: bool) -> None:
    """This rank is done (after its script, for a planned rank)."""
    try:
        if planned:
            store.add(PLANNED_DONE_KEY, 1)
        store.add(DONE_KEY, 1)
    except Exception:  # noqa: BLE001  (a store that is gone: the others learn it from the launcher)
        pass


def mark_left(store, rank: int) -> None:
    """This rank leaves after a failure, its message written: the store's host need not keep the store for it."""
    try:
        store.set(LEFT_KEY.format(rank), "1")
    except Exception:  # noqa: BLE001  (a store that is gone has no one left to wait)
        pass


def wait_for_peers_to_leave(store, rank: int, world_size: int, lost: Callable[[], set[int]], timeout_s: float, *,
                            poll_s: float = 0.1, clock: Callable[[], float] = time.monotonic,
                            sleep: Callable[[float], None] = time.sleep) -> bool:
    """The store's host, failing, keeps the store up (at most ``timeout_s``) until every other rank has left
    (:func:`mark_left`, after reading the recorded failure) or is lost (``lost()``: the ranks gone or silent).
    True when none is left to wait for."""
    deadline = clock() + timeout_s
    while True:
        try:
            waiting = {r for r in range(world_size) if r != rank and not store.check([LEFT_KEY.format(r)])}
        except Exception:  # noqa: BLE001
            return False
        if not waiting - lost():
            return True
        if clock() >= deadline:
            return False
        sleep(poll_s)


def _count(store, key: str) -> int:
    return int(store.add(key, 0))


def wait_for_job(store, planned: int, lost: Callable[[], list[str]], *, poll_s: float = 0.5,
                 sleep: Callable[[float], None] = time.sleep) -> str | None:
    """An unused rank waits until the ``planned`` ranks have finished; None then, else why it stopped waiting
    (a planned rank gone, or the store gone). Never bounded by a clock: the job may run for days."""
    while True:
        try:
            if _count(store, PLANNED_DONE_KEY) >= planned:
                return None
        except Exception as exc:  # noqa: BLE001
            return f"the job's store is gone ({type(exc).__name__})"
        gone = lost()
        if gone:
            try:  # a planned rank that finished and left in the meantime is not lost
                if _count(store, PLANNED_DONE_KEY) >= planned:
                    return None
            except Exception:  # noqa: BLE001
                pass
            return "lost " + "; ".join(gone)
        sleep(poll_s)


def wait_for_everyone(store, world_size: int, timeout_s: float, *, poll_s: float = 0.2,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> bool:
    """The store's host waits (at most ``timeout_s``) until every launcher rank is done: its exit ends the
    store. True when all were."""
    deadline = clock() + timeout_s
    while clock() < deadline:
        try:
            if _count(store, DONE_KEY) >= world_size:
                return True
        except Exception:  # noqa: BLE001
            return False
        sleep(poll_s)
    return False


def record_plan(path: str, plan_doc: dict, devices: dict[str, int]) -> dict | None:
    """Write this attempt's plan summary to ``path`` (atomically, numbered one past the previous record)
    and return the previous attempt's record, if any (a damaged record counts as none)."""
    previous = None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if (isinstance(doc, dict) and isinstance(doc.get("devices"), dict) and isinstance(doc.get("plan"), dict)
                and isinstance(doc.get("sequence"), int)
                and all(isinstance(v, int) for v in doc["devices"].values())):
            previous = doc
    except (OSError, ValueError):
        previous = None
    sequence = previous["sequence"] + 1 if previous is not None else 0
    write_json_atomic(path, {"sequence": sequence, "devices": devices, "plan": plan_doc})
    return previous


def fleet_change(old: Mapping[str, int], new: Mapping[str, int]) -> str:
    """``A2-4 x2 gone, A2-2 x1 added`` (or ``same devices``)."""
    parts = []
    for name in sorted(set(old) | set(new)):
        delta = new.get(name, 0) - old.get(name, 0)
        if delta < 0:
            parts.append(f"{name} x{-delta} gone")
        elif delta > 0:
            parts.append(f"{name} x{delta} added")
    return ", ".join(parts) or "same devices"


# --- resuming under another TP: the vocabulary's padding ---------------------------------------------

VOCAB_DIVISIBLE_BY = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``."""
TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming a checkpoint folder's last complete iteration (``release`` or a number)."""


def padded_vocab(tokens: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron-LM's embedding rows for ``tokens`` under TP ``tp``: a multiple of ``divisible_by x tp``."""
    multiple = divisible_by * tp
    return -(-tokens // multiple) * multiple


def checkpoint_folder(load: str, ckpt_step: int | None = None) -> str | None:
    """The checkpoint folder ``--load DIR`` (``--ckpt-step N``) resumes from, as Megatron-LM finds it; None
    when there is none (a fresh start) or the tracker does not name one."""
    if ckpt_step is None:
        try:
            with open(os.path.join(load, TRACKER), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            return None
        if text != "release" and not text.isdigit():
            return None
        name = "release" if text == "release" else f"iter_{int(text):07d}"
    else:
        name = f"iter_{ckpt_step:07d}"
    folder = os.path.join(load, name)
    return folder if os.path.isdir(folder) else None


def checkpoint_vocab_rows(folder: str) -> int | None:
    """The embedding rows of a torch_dist checkpoint (its word embedding's global shape, from the metadata
    megatron-core's loader reads); None when the folder has no such tensor."""
    from megatron.core import dist_checkpointing

    for key, tensor in dist_checkpointing.load_tensors_metadata(folder).items():
        if key.endswith("word_embeddings.weight") and getattr(tensor, "global_shape", None):
            return int(tensor.global_shape[0])
    return None


def divisor_for_rows(rows: int, tokens: int, tp: int) -> int | None:
    """A ``--make-vocab-size-divisible-by`` that pads ``tokens`` to exactly ``rows`` under TP ``tp`` (the largest
    power of two that does, else the smallest number); None when none does."""
    if rows < tokens or rows % tp:
        return None
    fitting = [d for d in range(1, rows // tp + 1) if padded_vocab(tokens, tp, d) == rows]
    powers = [d for d in fitting if d & (d - 1) == 0]
    return max(powers) if powers else (min(fitting) if fitting else None)


def vocab_padding_warning(*, load: str, checkpoint_rows: int, tokens: int, tp: int,
                          divisible_by: int = VOCAB_DIVISIBLE_BY) -> str | None:
    """One line when this plan's TP pads the vocabulary to other rows than the checkpoint's (None when alike):
    what it does to the embedding and the flag that avoids it."""
    rows = padded_vocab(tokens, tp, divisible_by)
    if rows == checkpoint_rows:
        return None
    if rows > checkpoint_rows:
        effect = (f"rows {checkpoint_rows + 1}-{rows} are not in the checkpoint: they start from their "
                  f"initialization and join the softmax, so the loss resumes above the uninterrupted run's")
    else:
        effect = (f"the checkpoint's rows {rows + 1}-{checkpoint_rows} are left out (the softmax loses "
                  f"trained padding rows), so the loss resumes off the uninterrupted run's")
    divisor = divisor_for_rows(checkpoint_rows, tokens, tp)
    fix = (f"--make-vocab-size-divisible-by {divisor} pads TP {tp} to the checkpoint's {checkpoint_rows} rows"
           if divisor is not None else
           f"no --make-vocab-size-divisible-by pads TP {tp} to {checkpoint_rows} rows: resume under a TP that "
           f"divides {checkpoint_rows} and pads alike")
    return (f"warning: --load {load}: the checkpoint's embedding has {checkpoint_rows} vocabulary rows but this "
            f"plan's TP {tp} pads the {tokens} tokens to {rows} (a multiple of --make-vocab-size-divisible-by "
            f"{divisible_by} x TP {tp}): {effect}; {fix}")
