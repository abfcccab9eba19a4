"""``--exhaustive``: simulate every plan of the search space (small problems; the reference).

A plain loop over the public :class:`~poseidon_plugin.costmodel.CostModel` API: it enumerates the
space as docs/SEARCH.md defines it (groups, shapes, ranks per type, type orders, layer splits), keeps
every candidate that :meth:`CostModel.fits`, and times it with :meth:`CostModel.iteration_ms`. It
shares nothing with the branch and bound (no cost tables, no bound, no search state), so the exact
search is checked against an independent route to the same optimum (tests/unit/test_search_exact.py).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Iterator

from ..costmodel import Candidate, CostModel
from ..errors import InputError, NoFeasiblePlanError
from .leaderboard import Leaderboard, plan_key
from .options import SearchOptions, SearchResult, SearchStats, TimeLimitError
from .space import micro_batch_sizes, tp_degrees

PRUNED_NONE = {"shape_bound": 0, "structure_bound": 0, "stage_bound": 0, "path_bound": 0, "memory": 0,
               "ridge": 0, "order": 0}


def rank_splits(total: int, pp: int, minimum: int):
    """Every way to give ``pp`` ranks at least ``minimum`` layers each, ``total`` in all."""
    if pp == 1:
        if total >= minimum:
            yield (total,)
        return
    for first in range(minimum, total - minimum * (pp - 1) + 1):
        for rest in rank_splits(total - first, pp - 1, minimum):
            yield (first,) + rest


def orders(counts) -> list[tuple[int, ...]]:
    """Every distinct device-type sequence with ``counts[t]`` ranks of type ``t``."""
    items = [t for t, n in enumerate(counts) for _ in range(n)]
    return sorted(set(itertools.permutations(items)))


def spread_layers(rank_layers, v: int) -> tuple[int, ...]:
    """Layers per virtual stage ``vs = c x pp + r``: rank ``r``'s chunk ``c`` holds
    ``(l + V - 1 - c) // V`` of its ``l`` layers (the plan space of docs/SEARCH.md)."""
    pp = len(rank_layers)
    return tuple((rank_layers[vs % pp] + v - 1 - vs // pp) // v for vs in range(pp * v))


def count_vectors(slots, pp: int) -> list[tuple[int, ...]]:
    """Ranks per type: each at most the type's stage slots, ``pp`` in all."""
    if not slots:
        return [()] if pp == 0 else []
    return [(n,) + rest for n in range(min(slots[0], pp) + 1)
            for rest in count_vectors(slots[1:], pp - n)]


def type_sequences(slots, pp: int) -> int:
    """How many device-type sequences of ``pp`` ranks use each type at most its slots (the sum over
    :func:`count_vectors` of the multinomial ``pp! / prod n_t!``)."""
    ways = [1] + [0] * pp             # ways[j]: sequences of j ranks over the types so far
    for s in slots:
        new = [0] * (pp + 1)
        for j, w in enumerate(ways):
            if w:
                for n in range(min(s, pp - j) + 1):
                    new[j + n] += w * math.comb(j + n, n)
        ways = new
    return ways[pp]


def shapes(cm: CostModel, options: SearchOptions) -> Iterator[tuple]:
    """Every ``(tp, mbs, dp, M, types, slots, schedule, V, pp, ep, etp)`` of the space: a TP degree,
    micro-batch size and DP degree with ``M = GBS / (dp x mbs)`` whole, the device types with room for a
    stage of ``dp x tp`` devices, a schedule, its chunks per rank, a pipeline size and an expert layout
    (``CostModel.expert_layouts``; ``(1, None)`` for a dense model)."""
    num_layers = cm.model.num_layers
    gbs = cm.model.global_batch_size
    limit = options.max_pipeline_stages or num_layers
    lowest = options.min_pipeline_stages or 1
    for tp in tp_degrees(cm, options):
        names = tuple(t for t in cm.device_types if tp in cm.tp_degrees(t))
        for mbs in micro_batch_sizes(cm, options):
            for dp in range(1, gbs // mbs + 1):
                if dp % options.dp_multiple:
                    continue
                m = cm.micro_batches(dp, mbs)
                if m is None:
                    continue
                types = tuple(t for t in names if cm.max_stages(t, tp, dp) > 0)
                if not types:
                    break
                slots = tuple(cm.max_stages(t, tp, dp) for t in types)
                for ep, etp in cm.expert_layouts(tp, dp, options.expert_parallel):
                    for schedule in options.schedules:
                        for v in (options.virtual_stages if schedule == "interleaved-1f1b" else (1,)):
                            for pp in range(lowest, min(sum(slots), limit, num_layers // v) + 1):
                                if v > 1 and (pp < 2 or m % pp):
                                    continue
                                yield tp, mbs, dp, m, types, slots, schedule, v, pp, ep, etp


def space_size(cm: CostModel, options: SearchOptions) -> int:
    """Number of plans the exhaustive search would simulate (before the memory check)."""
    total = 0
    for _tp, _mbs, _dp, _m, _types, slots, _schedule, v, pp, _ep, _etp in shapes(cm, options):
        n_splits = math.comb(cm.model.num_layers - v * pp + pp - 1, pp - 1)
        total += type_sequences(slots, pp) * n_splits
    return total


def exhaustive_search(cm: CostModel, options: SearchOptions) -> SearchResult:
    """Simulate every plan; raise :class:`InputError` when there are more than the option allows."""
    t0 = time.perf_counter()
    deadline = math.inf if options.time_limit_s is None else time.monotonic() + options.time_limit_s
    size = space_size(cm, options)
    if size > options.max_exhaustive_plans:
        raise InputError(f"--exhaustive would simulate {size:,} plans, more than the limit of "
                         f"{options.max_exhaustive_plans:,}; it is a reference for small problems -- "
                         "use --exact (provably optimal, pruned) instead")
    board = Leaderboard(options.top_k, exact_alternatives=True)
    all_shapes = list(shapes(cm, options))
    calls = structures = 0
    complete = True
    kernels = set()
    for i, (tp, mbs, dp, _m, types, slots, schedule, v, pp, ep, etp) in enumerate(all_shapes):
        if time.monotonic() > deadline:
            complete = False
            break
        splits = [spread_layers(ranks, v) for ranks in rank_splits(cm.model.num_layers, pp, v)]
        for vec in count_vectors(slots, pp):
            structures += 1
            for order in orders(vec):
                stage_types = tuple(types[t] for t in order)
                for layers in splits:
                    cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, stage_types=stage_types,
                                     layers=layers, schedule=schedule, virtual_stages=v, ep=ep, etp=etp)
                    if not cm.fits(cand):
                        continue
                    calls += 1
                    board.offer(plan_key(cand), cm.iteration_ms(cand, options.comm_model), cand)
        kernels.add(cm.simulator(schedule, pp, _m, v, options.comm_model).kernel_name)
        if options.progress is not None:
            options.progress((i + 1) / len(all_shapes), f"{i + 1}/{len(all_shapes)} shapes")
    if not board.best:
        if not complete:
            raise TimeLimitError(options.time_limit_s)
        from .diagnose import explain_infeasible
        from .space import SearchSpace
        raise NoFeasiblePlanError(explain_infeasible(cm, SearchSpace(cm, options)))
    # every plan simulated: the best is its own lower bound; cut by the clock, the shapes left have none
    best = board.best_ms_all()
    stats = SearchStats(mode="exhaustive", kernel="/".join(sorted(kernels)),
                        wall_s=time.perf_counter() - t0, complete=complete, structures=structures,
                        shapes=len(all_shapes), warmup_samples=0, simulator_calls=calls,
                        bound_evaluations=0, nodes=0, pruned=dict(PRUNED_NONE),
                        comm_model=options.comm_model, alternatives_proven=complete,
                        lower_bound_ms=best if complete else 0.0, gap=0.0 if complete else math.inf,
                        unproven=None if complete else f"the time limit stopped the search: {len(all_shapes) - i} "
                                                       f"of {len(all_shapes)} shapes not simulated (no lower bound)")
    return board.result(cm, stats, options.comm_model)


__all__ = ["count_vectors", "exhaustive_search", "orders", "rank_splits", "shapes", "space_size",
           "spread_layers", "type_sequences"]
