"""Reference planners for ``scripts/bench_search.py``: what one gets without Poseidon's search.

* :func:`best_uniform` -- "homogeneous-style" Megatron by hand: every rank holds the same number of
  layers (stock Megatron needs ``L % (pp x V) == 0``), stages take devices in the cluster's order, and
  the best such configuration is chosen by the same DAG simulator;
* :func:`best_by_eq1` -- the plan a planner picks when it ranks candidates with the paper's
  approximate Eq. 1, ``sum_s t_s + (M - 1) max_s t_s + DP_all``, instead of the DAG (``t_s``: forward +
  backward + transfer of one micro-batch on stage ``s``); its true time is then simulated.
"""

from __future__ import annotations

import math

from ..costmodel import Candidate, CostModel
from .engine import use_pure_python
from .evaluate import fill_plan, greedy_split, plan_fits, spread
from .options import SearchOptions
from .shapes import ShapeCache
from .space import SearchSpace, ShapeGroup

INF = math.inf


def _candidate(sg: ShapeGroup, types, layers) -> Candidate:
    g = sg.group
    return Candidate(tp=g.tp, pp=sg.pp, dp=g.dp, mbs=g.mbs, stage_types=tuple(g.names[t] for t in types),
                     layers=tuple(layers), schedule=sg.schedule, virtual_stages=sg.virtual_stages, ep=g.ep,
                     etp=g.etp)


def _space(cm: CostModel, options: SearchOptions) -> tuple[SearchSpace, ShapeCache]:
    return SearchSpace(cm, options), ShapeCache(use_pure_python(options), options.comm_model, cm.comm_extras)


def _block_orders(counts, names, tb):
    """Contiguous type blocks: cluster order, fastest first, most memory first (distinct)."""
    used = [t for t in range(len(names)) if counts[t]]
    out = []
    for order in (used, sorted(used, key=lambda t: tb.forward_ms[t] + tb.backward_ms[t]),
                  sorted(used, key=lambda t: -tb.usable_bytes[t])):
        seq = tuple(t for t in order for _ in range(counts[t]))
        if seq not in out:
            out.append(seq)
    return out


def best_uniform(cm: CostModel, options: SearchOptions) -> tuple[float, object] | None:
    """Best uniform-split plan with devices used in cluster order: ``(ms, Candidate)`` or None."""
    space, shapes = _space(cm, options)
    best: tuple[float, object] | None = None
    num_layers = space.num_layers
    for sg in space.shape_groups():
        g, v = sg.group, sg.virtual_stages
        if num_layers % (sg.pp * v):
            continue
        counts, left = [], sg.pp
        for slots in g.slots:            # devices in the cluster's order
            counts.append(min(slots, left))
            left -= counts[-1]
        types = [t for t in range(len(counts)) for _ in range(counts[t])]
        layers = [num_layers // (sg.pp * v)] * (sg.pp * v)
        table = space.table(g)
        shape = shapes.get(sg.schedule, sg.pp, g.micro_batches, v)
        if not plan_fits(table, shape, types, layers):
            continue
        params = shape.new_params()
        fill_plan(params, table, shape, types, layers)
        ms = shape.kernel.longest(params)
        if best is None or ms < best[0]:
            best = (ms, _candidate(sg, types, layers))
    return best


def eq1_time(params, pp: int, v: int, micro_batches: int) -> float:
    """The paper's Eq. 1 on a filled parameter vector (per-stage F + B + transfer, max all-reduce)."""
    nv = pp * v
    t = [sum(params[1 + r * v + c] + params[1 + nv + r * v + c] for c in range(v))
         + params[1 + 2 * nv + r] for r in range(pp)]
    dp_all = max(params[1 + 2 * nv + pp + r] for r in range(pp))
    return sum(t) + (micro_batches - 1) * max(t) + dp_all


def best_by_eq1(cm: CostModel, options: SearchOptions, vectors_per_shape: int = 5
                ) -> tuple[float, float, object] | None:
    """The Eq. 1 winner among balanced candidates: ``(dag_ms, eq1_ms, Candidate)`` or None.

    Candidates: every shape group, its ``vectors_per_shape`` fastest ranks-per-type vectors,
    contiguous type blocks in three orders, the compute-balanced split within memory.
    """
    space, shapes = _space(cm, options)
    best = None
    for sg in space.shape_groups():
        g, v = sg.group, sg.virtual_stages
        table, shape = space.table(g), shapes.get(sg.schedule, sg.pp, g.micro_batches, v)
        vecs = space.count_vectors(sg)
        vecs.sort(key=lambda vec: -sum(n / (table.forward_ms[t] + table.backward_ms[t]) for t, n in enumerate(vec)))
        params = None
        for vec in vecs[:vectors_per_shape]:
            for types in _block_orders(vec, g.names, table):
                ranks = greedy_split(table, shape, types, space.num_layers)
                if ranks is None:
                    continue
                layers = spread(ranks, sg.pp, v)
                if not plan_fits(table, shape, types, layers):
                    continue
                if params is None:
                    params = shape.new_params()
                fill_plan(params, table, shape, types, layers)
                e1 = eq1_time(params, sg.pp, v, g.micro_batches)
                if best is None or e1 < best[1]:
                    best = (shape.kernel.longest(params), e1, _candidate(sg, types, layers))
    return best
