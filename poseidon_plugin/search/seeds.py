"""Memory-aware seed plans: device types placed at the pipeline positions where their memory helps.

The contiguous-block greedy seeds (:meth:`.engine.SearchRun.seed`) put the types in a few fixed orders.
When memory binds (frontier-scale 1F1B: rank ``r`` keeps ``pp - r`` micro-batches of activations, so the
early ranks hold few layers) the best orders interleave the types. :func:`assignment_seeds` finds, for a
per-micro-batch work target ``X``, the assignment of types to positions that holds the most layers
(rank ``r`` on type ``t`` holds at most ``min(cap_t(r), X / (f_t + b_t))``, each type at most its slots):
a transportation problem, solved exactly by :func:`.assignment.best_assignment`. The smallest
``X`` (bisection over the finite set of per-rank works) whose assignment holds the model gives the
plans. Seeds only offer incumbents, so they never affect exactness.
"""

from __future__ import annotations

from typing import Sequence

from ..backend import compiled
from . import assignment
from .assignment import NEG
from .evaluate import greedy_split, rank_caps
from .shapes import ShapeData
from .tables import TypeTable

# the one assignment solver, compiled where built (the same file: the same results)
best_assignment = (compiled("assignment") or assignment).best_assignment

def assignment_seeds(table: TypeTable, shape: ShapeData, slots: Sequence[int], num_layers: int,
                     extra: int = 2) -> list[tuple[list[int], list[int]]]:
    """Seed plans ``(types per rank, layers per rank)``: the smallest per-micro-batch work target whose
    best type assignment holds every layer, and the next ``extra`` targets (their plans differ in the
    pipeline bubble, which the target ignores)."""
    pp, v = shape.pp, shape.virtual_stages
    nt = len(slots)
    supply = [min(s, pp) for s in slots]
    if sum(supply) < pp or v * pp > num_layers:
        return []
    cost = [table.forward_ms[t] + table.backward_ms[t] for t in range(nt)]
    caps = [rank_caps(table, shape, [t] * pp, num_layers) if supply[t] else [0] * pp for t in range(nt)]
    # the embedding and the head add their per-micro-batch work to the first and last rank
    ends = [[(table.embedding_forward_ms[t] + table.embedding_backward_ms[t] if r == 0 else 0.0)
             + (table.head_forward_ms[t] + table.head_backward_ms[t] if r == pp - 1 else 0.0)
             for r in (0, pp - 1)] for t in range(nt)]

    # candidate targets: each rank's work at each possible count
    works = sorted({cost[t] * n + e for t in range(nt) if supply[t] for n in range(v, num_layers + 1)
                    if n <= max(caps[t]) for e in (0.0, *ends[t])})


    def most(t: int, r: int, x: float) -> int:
        extra = ends[t][0] if r == 0 else ends[t][1] if r == pp - 1 else 0.0
        return min(caps[t][r], int(max(0.0, x - extra) / cost[t] * (1 + 1e-12)))

    def holds(x: float):
        value = [[most(t, r, x) if supply[t] else NEG for r in range(pp)] for t in range(nt)]
        value = [[h if h >= v else NEG for h in row] for row in value]
        return best_assignment(value, supply, pp), value

    lo, hi = 0, len(works) - 1
    found, _value = holds(works[hi]) if works else (None, None)
    if found is None or found[0] < num_layers:
        return []
    while lo < hi:                     # the smallest target whose assignment holds the model
        mid = (lo + hi) // 2
        got, _value = holds(works[mid])
        if got is not None and got[0] >= num_layers:
            hi = mid
        else:
            lo = mid + 1
    out = []
    for i in range(lo, min(lo + 1 + extra, len(works))):
        got, value = holds(works[i])
        if got is None or got[0] < num_layers:
            continue
        types = got[1]
        rank_layers = greedy_split(table, shape, types, num_layers, caps=[value[t][r] for r, t in enumerate(types)])
        if rank_layers is not None:
            out.append((types, rank_layers))
    return out


def relaxation_split(table: TypeTable, shape: ShapeData, types: Sequence[int], caps: Sequence[int],
                     num_layers: int) -> list[int] | None:
    """Layers per rank for the relaxation's own plan (``positional_bound``'s witness): each rank within
    ``caps`` and its memory (:func:`.evaluate.rank_caps`; the relaxation's caps may exceed the memory
    formula's, its largest chunk holding ``l / V``), then layers taken off the rank with the most
    per-micro-batch work (``(f + b) l`` and the embedding's or head's; the earliest on ties: early ranks
    keep the most activations)
    while more than the model's are held, or added, within memory, where the work stays least while
    fewer are. None when memory cannot hold the model on these ranks (at least ``V`` each)."""
    v = shape.virtual_stages
    pp = len(types)
    cost = [table.forward_ms[t] + table.backward_ms[t] for t in types]
    ends = [0.0] * pp
    ends[0] += table.embedding_forward_ms[types[0]] + table.embedding_backward_ms[types[0]]
    ends[-1] += table.head_forward_ms[types[-1]] + table.head_backward_ms[types[-1]]
    room = rank_caps(table, shape, types, num_layers)
    if min(room) < v or sum(room) < num_layers:
        return None
    layers = [max(v, min(c, m)) for c, m in zip(caps, room)]
    while sum(layers) > num_layers:
        r = max((r for r in range(len(layers)) if layers[r] > v), key=lambda r: (cost[r] * layers[r] + ends[r], -r))
        layers[r] -= 1
    while sum(layers) < num_layers:
        r = min((r for r in range(len(layers)) if layers[r] < room[r]), key=lambda r: (cost[r] * (layers[r] + 1) + ends[r], -r))
        layers[r] += 1
    return layers

__all__ = ["assignment_seeds", "best_assignment", "relaxation_split"]
