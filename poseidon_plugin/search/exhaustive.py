"""``--exhaustive``: simulate every plan of the search space (small problems; the reference).

No pruning at all: every group, shape, ranks-per-type vector, device-type order and layer split that
fits memory is simulated through the same DAG kernel as the branch and bound, and the same
leaderboard keeps the top-k keys. The exact search must find the same best time (tests check it).
"""

from __future__ import annotations

import itertools
import math

from ..costmodel import CostModel
from ..errors import InputError, NoFeasiblePlanError
from .engine import Leaderboard, _Run
from .evaluate import plan_fits, simulate_plan, spread
from .options import SearchOptions, SearchResult
from .space import ShapeGroup


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


def space_size(run: _Run, sgs: list[ShapeGroup]) -> int:
    """Number of plans the exhaustive search would simulate (before the memory check)."""
    total = 0
    for sg in sgs:
        v, pp = sg.virtual_stages, sg.pp
        n_splits = math.comb(run.space.num_layers - v * pp + pp - 1, pp - 1)
        for vec in run.space.count_vectors(sg, canonical=False):
            n_orders = math.factorial(pp)
            for n in vec:
                n_orders //= math.factorial(n)
            total += n_orders * n_splits
    return total


def exhaustive_search(cm: CostModel, options: SearchOptions) -> SearchResult:
    """Simulate every plan; raise :class:`InputError` when there are more than the option allows."""
    run = _Run(cm, options)
    run.ridge = run.blocks = False
    sgs = list(run.space.shape_groups())
    size = space_size(run, sgs)
    if size > options.max_exhaustive_plans:
        raise InputError(f"--exhaustive would simulate {size:,} plans, more than the limit of "
                         f"{options.max_exhaustive_plans:,}; it is a reference for small problems -- "
                         "use --exact (provably optimal, pruned) instead")
    board: Leaderboard = run.board
    calls = 0
    for i, sg in enumerate(sgs):
        if run.out_of_time():
            break
        g = sg.group
        table, shape = run.space.table(g), run.shape(sg)
        params = shape.new_params()
        splits = list(rank_splits(run.space.num_layers, sg.pp, sg.virtual_stages))
        for vec in run.space.count_vectors(sg, canonical=False):
            for types in orders(vec):
                for rank_layers in splits:
                    layers = spread(rank_layers, sg.pp, sg.virtual_stages)
                    if not plan_fits(table, shape, types, layers):
                        continue
                    ms = simulate_plan(params, table, shape, types, layers)
                    calls += 1
                    board.offer(sg.key, ms, (sg, tuple(types), tuple(layers)))
        if options.progress is not None:
            options.progress((i + 1) / len(sgs), f"{i + 1}/{len(sgs)} shapes")
    if not board.best:
        from .diagnose import explain_infeasible
        raise NoFeasiblePlanError(explain_infeasible(cm, run.space))
    run.sim_calls = calls
    return run.result()


__all__ = ["exhaustive_search", "orders", "rank_splits", "space_size"]
