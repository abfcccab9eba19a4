"""Per-rank operation orders of the pipeline schedules the simulator knows.

Each order is the exact sequence of forward/backward computations one pipeline rank executes in one
iteration, as the runtime that executes the schedule issues them:

* ``gpipe``: all forwards, then all backwards, both in micro-batch order.
* ``1f1b``: Megatron's non-interleaved schedule (``forward_backward_pipelining_without_interleaving``):
  ``w = min(pp - rank - 1, M)`` warm-up forwards, then pairs (forward, backward), then the remaining
  backwards.
* ``eager-1f1b``: the paper's Eager 1F1B (App. B.1): ``w = min(2 (pp - rank - 1) + 1, M)`` warm-up
  forwards, then pairs (backward, forward), backward first, then the remaining backwards.
* ``interleaved-1f1b``: Megatron's interleaved schedule with ``V`` model chunks per rank and the default
  micro-batch group size ``pp``: warm-up ``min((pp - rank - 1) * 2 + (V - 1) * pp, M * V)`` virtual
  micro-batches, then (forward, backward) pairs, then the remaining backwards. Virtual micro-batch ``k``
  maps to (micro-batch, chunk) through Megatron's schedule table; backwards run the chunks in reverse.

Ranks and micro-batches are 0-based. An op is a tuple ``(kind, chunk, micro_batch)`` with kind ``"F"`` or
``"B"``. Nothing here imports torch.
"""

from __future__ import annotations

from ..errors import InputError

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b")
"""Every pipeline schedule the simulator (and so the cost model and the plan) knows; the one definition."""
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
"""The schedules Megatron-LM runs (the plan's flags and the search's default)."""

FORWARD = "F"
BACKWARD = "B"


def validate_shape(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise :class:`InputError` unless (schedule, pp, M, V) is a shape the schedule can execute."""
    if schedule not in SCHEDULES:
        raise InputError(f"schedule={schedule!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    for name, value in (("pipeline ranks (len(stages))", pp), ("micro_batches", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name}={value!r} must be an integer >= 1")
    if schedule == "interleaved-1f1b":
        if pp < 2:
            raise InputError(
                f"schedule='interleaved-1f1b' needs at least 2 pipeline ranks, got {pp}; "
                "use '1f1b' for a single stage")
        if virtual_stages < 2:
            raise InputError(
                f"schedule='interleaved-1f1b' needs virtual_stages >= 2, got {virtual_stages}; "
                "use '1f1b' for one chunk per rank")
        if micro_batches % pp:
            raise InputError(
                f"schedule='interleaved-1f1b' needs micro_batches to be a multiple of the pipeline "
                f"size: micro_batches={micro_batches} is not a multiple of pp={pp}")
    elif virtual_stages != 1:
        raise InputError(
            f"virtual_stages={virtual_stages} is only allowed with schedule='interleaved-1f1b'; "
            f"schedule={schedule!r} needs virtual_stages=1")


def interleaved_table(micro_batches: int, virtual_stages: int, group: int) -> list[tuple[int, int]]:
    """Megatron's interleaved schedule table: virtual micro-batch k -> (micro_batch, chunk)."""
    table: list[tuple[int, int]] = []
    for lo in range(0, micro_batches, group):
        hi = micro_batches if lo + group >= micro_batches else lo + group
        table.extend((m, c) for c in range(virtual_stages) for m in range(lo, hi))
    return table


def _warmup_then_pairs(warmup: int, total: int, fwd, bwd, backward_first: bool):
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        pair = (bwd(k), fwd(k + warmup)) if backward_first else (fwd(k + warmup), bwd(k))
        ops.extend(pair)
    ops.extend(bwd(k) for k in range(total - warmup, total))
    return ops


def rank_order(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
               rank: int) -> list[tuple[str, int, int]]:
    """The ordered ops ``(kind, chunk, micro_batch)`` pipeline rank ``rank`` executes in one iteration."""
    validate_shape(schedule, pp, micro_batches, virtual_stages)
    m_total = micro_batches
    if schedule == "gpipe":
        return ([(FORWARD, 0, m) for m in range(m_total)]
                + [(BACKWARD, 0, m) for m in range(m_total)])
    if schedule in ("1f1b", "eager-1f1b"):
        if schedule == "1f1b":
            warmup = min(pp - rank - 1, m_total)
        else:
            warmup = min(2 * (pp - rank - 1) + 1, m_total)
        return _warmup_then_pairs(
            warmup, m_total,
            lambda k: (FORWARD, 0, k), lambda k: (BACKWARD, 0, k),
            backward_first=(schedule == "eager-1f1b"))
    # interleaved-1f1b
    v = virtual_stages
    total = m_total * v
    table = interleaved_table(m_total, v, pp)
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    return _warmup_then_pairs(
        warmup, total,
        lambda k: (FORWARD, table[k][1], table[k][0]),
        lambda k: (BACKWARD, v - 1 - table[k][1], table[k][0]),
        backward_first=False)


def warmup_forwards(schedule: str, pp: int, micro_batches: int, virtual_stages: int, rank: int) -> int:
    """Forwards ``rank`` runs before its first (forward, backward) pair: the warm-up of
    :func:`rank_order` (``M`` for GPipe, which has no pairs)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(pp - rank - 1, micro_batches)
    if schedule == "eager-1f1b":
        return min(2 * (pp - rank - 1) + 1, micro_batches)
    return min((pp - rank - 1) * 2 + (virtual_stages - 1) * pp, micro_batches * virtual_stages)


def peak_live_microbatches(schedule: str, pp: int, micro_batches: int,
                           virtual_stages: int = 1) -> list[int]:
    """Per rank, the largest number of (chunk, micro-batch) activations alive at once.

    An activation is alive from the start of its forward to the end of its backward, so the count is a
    property of the op order alone. With ``V > 1`` each unit holds one chunk's activations (1/V of a
    rank's layers when chunks are even); the memory model multiplies by the per-chunk activation size.

    By formula, from the shape of :func:`rank_order` (``w`` warm-up forwards, then pairs, then the
    remaining backwards; ``tests/unit/test_simulator.py`` checks it against counting the ops): the
    pairs of ``1f1b`` / ``interleaved-1f1b`` run forward first, so ``w + 1`` are alive, those of
    ``eager-1f1b`` backward first, so ``w``; with no pair (``w`` = every unit) all ``w``. O(pp), where
    walking the ops costs O(pp x M x V) (seconds over a search at frontier scale).
    """
    validate_shape(schedule, pp, micro_batches, virtual_stages)
    total = micro_batches * virtual_stages
    peaks = []
    for rank in range(pp):
        w = warmup_forwards(schedule, pp, micro_batches, virtual_stages, rank)
        if w >= total or schedule == "eager-1f1b":
            peaks.append(w)
        else:
            peaks.append(w + 1)
    return peaks
