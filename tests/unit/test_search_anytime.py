"""Anytime answers: the proven lower bound, ``--gap`` in exact mode, and the time limit honoured
semantically (an injected clock and a node budget, never wall time).

On random small problems the exhaustive reference gives the true optimum: the proven lower bound never
exceeds it, whatever stopped the search, and equals it when the search completes.
"""

import pytest

from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.search.engine import SearchRun

from .test_search_exact import random_problem

SEEDS = range(0, 60, 3)


def optimum(cm, schedules):
    ref = search(cm, SearchOptions(mode="exhaustive", schedules=schedules, top_k=1000))
    return ref


def run(cm, **kw):
    clock, budget = kw.pop("clock", None), kw.pop("node_budget", None)
    r = SearchRun(cm, SearchOptions(**kw), clock=clock, node_budget=budget)
    r.search()
    return r, r.result()


@pytest.mark.parametrize("seed", SEEDS)
def test_lower_bound_is_valid_and_tight_when_complete(seed, pure_python):
    cm, schedules = random_problem(seed)
    best = optimum(cm, schedules).plan.predicted_iteration_ms
    _r, res = run(cm, mode="exact", schedules=schedules, warmup_samples=0, pure_python=pure_python)
    st = res.stats
    assert st.complete
    assert st.lower_bound_ms == res.plan.predicted_iteration_ms == best
    assert st.gap == 0.0
    assert res.plan.search_stats["gap"] == 0.0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("budget", [1, 2, 5])
def test_lower_bound_valid_when_stopped_by_node_budget(seed, budget, pure_python):
    cm, schedules = random_problem(seed)
    best = optimum(cm, schedules).plan.predicted_iteration_ms
    r, res = run(cm, mode="exact", schedules=schedules, warmup_samples=4, pure_python=pure_python,
                 node_budget=budget)
    st = res.stats
    assert st.lower_bound_ms <= best <= res.plan.predicted_iteration_ms
    if st.complete:
        assert st.lower_bound_ms == best
    else:
        assert st.gap == pytest.approx(res.plan.predicted_iteration_ms / st.lower_bound_ms - 1)


class TickClock:
    """A clock that advances one unit per read: the search sees time pass only where it looks."""

    def __init__(self):
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("limit", [1.5, 4.5, 12.5])
def test_time_limit_honoured_on_an_injected_clock(seed, limit, pure_python):
    cm, schedules = random_problem(seed)
    best = optimum(cm, schedules).plan.predicted_iteration_ms
    clock = TickClock()
    opts = dict(mode="exact", schedules=schedules, warmup_samples=4, pure_python=pure_python,
                time_limit_s=limit)
    try:
        r, res = run(cm, clock=clock, **opts)
    except Exception as exc:       # no plan before the deadline: the one-line error, nothing else
        assert "--time-limit" in str(exc)
        assert clock.reads <= limit + 2
        return
    st = res.stats
    if not st.complete:
        # the deadline (read number 1 + limit) stopped it at the first look past it: one more read
        # at most, then nothing (every later check answers from the flag)
        assert clock.reads <= limit + 2
        assert st.lower_bound_ms <= best
    else:
        assert st.lower_bound_ms == best == res.plan.predicted_iteration_ms


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_gap(seed, pure_python):
    """``--gap F`` in exact mode: the plan is within 1 + F of the optimum, and so is the bound."""
    cm, schedules = random_problem(seed)
    best = optimum(cm, schedules).plan.predicted_iteration_ms
    for gap in (0.02, 0.3):
        _r, res = run(cm, mode="exact", schedules=schedules, gap=gap, warmup_samples=4,
                      pure_python=pure_python)
        got = res.plan.predicted_iteration_ms
        assert best <= got <= best * (1 + gap) * (1 + 1e-12)
        assert res.stats.lower_bound_ms <= best
        assert got <= res.stats.lower_bound_ms * (1 + gap) * (1 + 1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_pipeline_bound_below_every_shape_groups_optimum(seed):
    """The shape-free bound the engine keeps for open pieces, against the best plan of every key."""
    cm, schedules = random_problem(seed)
    ref = optimum(cm, schedules)
    r = SearchRun(cm, SearchOptions(mode="exact", schedules=schedules))
    bests = {(a.tp, a.pp, a.dp, a.micro_batch_size, a.schedule, a.virtual_stages): a.predicted_iteration_ms
             for a in (ref.plan, *ref.alternatives)}
    checked = 0
    for sg in r.space.shape_groups():
        if sg.key in bests:
            for memory in (False, True):
                assert r.bound(sg, memory=memory) <= bests[sg.key]
            checked += 1
    assert checked == len(bests)
