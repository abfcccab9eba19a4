"""Memory-aware seeds (search/seeds.py): the assignment is optimal, the seeds are plans of the space."""

from __future__ import annotations

import itertools
import random

import pytest

from poseidon_plugin.search.assignment import NEG, best_assignment


def _brute(value, supply, pp):
    best = None
    for types in itertools.product(range(len(supply)), repeat=pp):
        if any(types.count(t) > supply[t] for t in range(len(supply))):
            continue
        if any(value[t][r] == NEG for r, t in enumerate(types)):
            continue
        total = sum(value[t][r] for r, t in enumerate(types))
        best = total if best is None else max(best, total)
    return best


@pytest.mark.parametrize("real", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_best_assignment_equals_brute_force(seed, real):
    """Integral values (the capacities) and real ones of either sign (the path gain's negated costs,
    with the supplies summing to the positions, as there): the optimum of brute force."""
    rng = random.Random(seed)
    nt, pp = rng.randint(1, 4 if real else 3), rng.randint(1, 6)
    if real:
        supply = [0] * nt
        for _ in range(pp):
            supply[rng.randrange(nt)] += 1
        value = [[NEG if rng.random() < 0.15 else rng.uniform(-500.0, 100.0) for _ in range(pp)]
                 for _ in range(nt)]
    else:
        supply = [rng.randint(0, pp) for _ in range(nt)]
        value = [[NEG if rng.random() < 0.2 else rng.randint(0, 9) for _ in range(pp)] for _ in range(nt)]
    got = best_assignment(value, supply, pp)
    want = _brute(value, supply, pp)
    if want is None:
        assert got is None
        return
    total, types = got
    assert total == pytest.approx(want, rel=1e-12, abs=1e-9)
    assert all(types.count(t) <= supply[t] for t in range(nt))
    assert sum(value[t][r] for r, t in enumerate(types)) == pytest.approx(total, rel=1e-12, abs=1e-9)


def test_assignment_seeds_are_fitting_plans_of_the_space():
    """Every seed of every shape group of Setting 6 at 96 NPUs: counts within the slots, every layer
    placed, at least V per rank, and within memory (the cost model's formula)."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.search.engine import SearchRun
    from poseidon_plugin.search.evaluate import plan_fits, spread
    from poseidon_plugin.search.seeds import assignment_seeds
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-96"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    run = SearchRun(cm, SearchOptions(mode="exact", max_pipeline_stages=12))
    seen = 0
    for sg in run.space.shape_groups():
        g, shape = sg.group, run.shape(sg)
        table = run.space.table(g)
        for types, rank_layers in assignment_seeds(table, shape, g.slots, run.space.num_layers):
            seen += 1
            assert len(types) == sg.pp and all(types.count(t) <= g.slots[t] for t in set(types))
            assert sum(rank_layers) == run.space.num_layers and min(rank_layers) >= sg.virtual_stages
            assert plan_fits(table, shape, types, spread(rank_layers, sg.pp, sg.virtual_stages))
    assert seen > 0


def test_polish_returns_a_fitting_plan_of_the_structure_never_slower():
    """evaluate.polish from the greedy seed of every V = 1 and interleaved shape group of Setting 6 at
    96 NPUs: the plan it returns keeps the ranks per type, places every layer with at least V per
    rank, fits memory, and its time is the cost model's for that candidate and never above the start;
    it improves some of them; with no budget it returns the start unchanged."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.search.engine import SearchRun
    from poseidon_plugin.search.evaluate import greedy_split, plan_fits, polish, simulate_plan, spread
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-96"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    run = SearchRun(cm, SearchOptions(mode="exact", max_pipeline_stages=8))
    tried = improved = 0
    for sg in run.space.shape_groups():
        g, shape = sg.group, run.shape(sg)
        table = run.space.table(g)
        pp, v = sg.pp, sg.virtual_stages
        order = sorted(range(len(g.names)), key=lambda t: table.forward_ms[t] + table.backward_ms[t])
        types = [t for t in order for _ in range(min(g.slots[t], pp))][:pp]
        if len(types) < pp:
            continue
        rank_layers = greedy_split(table, shape, types, run.space.num_layers)
        if rank_layers is None or not plan_fits(table, shape, types, spread(rank_layers, pp, v)):
            continue
        params = shape.new_params()
        start = simulate_plan(params, table, shape, types, spread(rank_layers, pp, v))
        assert polish(params, table, shape, types, rank_layers, start, max_evals=0) == \
            (start, types, rank_layers, 0)
        ms, t2, l2, sims = polish(params, table, shape, types, rank_layers, start, max_evals=400)
        tried += 1
        assert ms <= start and sims <= 400
        assert sorted(t2) == sorted(types)
        assert sum(l2) == run.space.num_layers and min(l2) >= v
        layers = spread(l2, pp, v)
        assert plan_fits(table, shape, t2, layers)
        cand = run.candidate(sg, t2, layers)
        assert ms == cm.iteration_ms(cand, run.options.comm_model)
        improved += ms < start
    assert tried > 10 and improved > 0
