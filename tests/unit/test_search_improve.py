"""The iterated local search (search/evaluate.py ``iterated_polish``) and where the exact search uses it:
a group's first interleaved tree past ``IMPROVE_AT`` nodes stops, the group's best plan is improved, and the
tree's walk resumes where it stopped, below the new threshold (``SearchRun.improve``, ``SplitSearch.run``'s
``resume``; docs/SEARCH.md).

The small problems of the suite rarely need 8,192 nodes (nor the look-ahead's 256, which comes first), so
the engine tests stop the trees after 2 (the random problems, whose trees below their seeds are one node or
two, after 1): the answers must stay those of the exhaustive reference.
"""

import functools
import math
import os

import pytest

from poseidon_plugin.search import engine
from poseidon_plugin.search.engine import SearchRun
from poseidon_plugin.search.evaluate import _moves

from .test_search_anytime import run
from .test_search_exact import exact_and_exhaustive, random_problem
from .test_search_lookahead import assert_a_budgeted_search_stays_valid, assert_a_cut_search_stays_valid

SEEDS = range(40)


def _interleaved_starts(max_pp: int = 8):
    """``(run, group, table, shape, types, layers per rank)``: the greedy seed of every interleaved shape
    group of paper Setting 6 at 288 NPUs up to ``max_pp`` stages, fastest types first (their runs in
    one order: the start a polish keeps its runs from)."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.search.evaluate import greedy_split, plan_fits, spread
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-288"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    r = SearchRun(cm, SearchOptions(mode="exact", max_pipeline_stages=max_pp))
    for sg in r.space.shape_groups():
        if sg.virtual_stages == 1:
            continue
        g, shape = sg.group, r.shape(sg)
        table = r.space.table(g)
        order = sorted(range(len(g.names)), key=lambda t: table.forward_ms[t] + table.backward_ms[t])
        types = [t for t in order for _ in range(min(g.slots[t], sg.pp))][:sg.pp]
        if len(types) < sg.pp:
            continue
        rank_layers = greedy_split(table, shape, types, r.space.num_layers)
        if rank_layers is not None and plan_fits(table, shape, types, spread(rank_layers, sg.pp, sg.virtual_stages)):
            yield r, sg, table, shape, types, rank_layers


def test_the_block_moves_place_a_run_of_one_type_elsewhere():
    """With ``blocks`` the neighbours add each run of one type (two ranks or more, from rank ``i``) moved to
    start at ``j``, layers with their ranks; a block that would mix types is not one of them."""
    types, lay = [0, 0, 1, 1, 2], [3, 4, 5, 6, 7]
    plain = list(_moves(types, lay, 0, 3, 1))
    with_blocks = list(_moves(types, lay, 0, 3, 1, True))
    assert with_blocks[:len(plain)] == plain
    assert with_blocks[len(plain):] == [([1, 1, 2, 0, 0], [5, 6, 7, 3, 4])]
    # from rank 1 the run of 0s is one rank long: no block move (the single-rank move is there already)
    assert list(_moves(types, lay, 1, 3, 1, True)) == list(_moves(types, lay, 1, 3, 1))
    # a run moved forward: ranks 2-3 to start at 0
    assert ([1, 1, 0, 0, 2], [5, 6, 3, 4, 7]) in list(_moves(types, lay, 2, 0, 1, True))


def test_the_plan_simulator_gives_the_full_fill_s_answers():
    """PlanSimulator (one parameter vector, only changed ranks rewritten) against plan_fits and
    simulate_plan on a fresh vector: random plans of every interleaved group's structure in a row (each
    a few ranks away from the one before, as the local search's are, and some far), the same memory
    verdicts and bit-identical times."""
    import random

    from poseidon_plugin.search.evaluate import PlanSimulator, kick, plan_fits, simulate_plan, spread
    rng = random.Random(5)
    checked = fitting = 0
    for r, sg, table, shape, types, rank_layers in _interleaved_starts():
        pp, v = sg.pp, sg.virtual_stages
        sim = PlanSimulator(shape.new_params(), table, shape)
        t, lay = list(types), list(rank_layers)
        for step in range(60):
            kick(rng, t, lay, v, 1 if step % 10 else pp)        # mostly one move, now and then many
            layers = spread(lay, pp, v)
            ok = plan_fits(table, shape, t, layers)
            assert sim.fits(t, lay) == ok
            checked += 1
            if ok:
                fitting += 1
                assert sim.simulate(t, lay) == simulate_plan(shape.new_params(), table, shape, t, layers)
    assert fitting > 100 and checked > fitting


def test_iterated_polish_returns_a_fitting_plan_never_slower_and_the_same_each_run():
    """From the greedy seed of every interleaved group of Setting 6 at 288 NPUs: the plan keeps the ranks
    per type, places every layer with at least V per rank, fits memory, and its time is the cost model's
    for that candidate, never above the start nor above one polish's; within its budget; the same plan
    on a second run (seeded kicks); with patience 0 it is one polish with the block moves. The kicks
    better the polish somewhere (not a polish again)."""
    from poseidon_plugin.search.evaluate import iterated_polish, plan_fits, polish, simulate_plan, spread
    tried = beyond = 0
    for r, sg, table, shape, types, rank_layers in _interleaved_starts():
        pp, v = sg.pp, sg.virtual_stages
        params = shape.new_params()
        start = simulate_plan(params, table, shape, types, spread(rank_layers, pp, v))
        once = polish(params, table, shape, types, rank_layers, start, max_evals=3000, blocks=True)
        assert iterated_polish(params, table, shape, types, rank_layers, start, max_evals=3000,
                               patience=0) == once
        got = iterated_polish(params, table, shape, types, rank_layers, start, max_evals=3000, patience=4)
        assert got == iterated_polish(params, table, shape, types, rank_layers, start, max_evals=3000, patience=4)
        ms, t2, l2, sims = got
        tried += 1
        assert ms <= once[0] <= start and sims <= 3000
        assert sorted(t2) == sorted(types)
        assert sum(l2) == r.space.num_layers and min(l2) >= v
        layers = spread(l2, pp, v)
        assert plan_fits(table, shape, t2, layers)
        assert ms == r.cm.iteration_ms(r.candidate(sg, t2, layers), r.options.comm_model)
        beyond += ms < once[0]
    assert tried > 5 and beyond > 0


RESUMED = []      # improve_early: the node counts of each structure search that resumed a stopped walk


@pytest.fixture
def improve_early(monkeypatch):
    """IMPROVE_AT = 2 nodes (and LOOKAHEAD_AT: the first large tree stops for the look-ahead first); yields a
    list with one ``(run, group key, group's best before, after)`` per local search, and fills
    :data:`RESUMED`."""
    monkeypatch.setattr(engine, "IMPROVE_AT", 2)
    monkeypatch.setattr(engine, "LOOKAHEAD_AT", (2, 2))
    seen = []
    original = SearchRun.improve
    split = SearchRun.split
    RESUMED.clear()

    def counted(self, sg):
        before = self.board.best_ms(sg.key)
        original(self, sg)
        seen.append((self, sg.key, before, self.board.best_ms(sg.key)))

    def split_counted(self, *args, **kw):
        res = split(self, *args, **kw)
        if res.resumed:
            RESUMED.append(res.counters[0])
        return res

    monkeypatch.setattr(SearchRun, "improve", counted)
    monkeypatch.setattr(SearchRun, "split", split_counted)
    return seen


def test_the_local_search_keeps_the_exact_optimum(improve_early, pure_python, monkeypatch):
    """Exact = exhaustive (best and runner-up) with every interleaved group's first tree stopped at its root
    for the local search and resumed; it did happen."""
    monkeypatch.setattr(engine, "IMPROVE_AT", 1)
    monkeypatch.setattr(engine, "LOOKAHEAD_AT", (1, 1))
    for seed in SEEDS:
        cm, schedules = random_problem(seed)
        exact_and_exhaustive(cm, dict(schedules=schedules, top_k=2, warmup_samples=0, pure_python=pure_python))
    assert improve_early and RESUMED


def test_a_local_search_that_finds_nothing_leaves_the_tree_searched(improve_early, monkeypatch):
    """With a local search that returns its start, the stopped trees are searched on to their end: exact
    = exhaustive still (on these small problems; the Setting 6 test below is where a dropped tree loses
    the optimum)."""
    monkeypatch.setattr(engine, "IMPROVE_AT", 1)
    monkeypatch.setattr(engine, "LOOKAHEAD_AT", (1, 1))
    monkeypatch.setattr(engine, "iterated_polish",
                        lambda params, table, shape, types, layers, ms, **kw: (ms, list(types), list(layers), 0))
    for seed in SEEDS:
        cm, schedules = random_problem(seed)
        exact_and_exhaustive(cm, dict(schedules=schedules, top_k=2, warmup_samples=0))
    assert improve_early and RESUMED


def test_the_local_search_finds_better_plans_and_the_same_optimum(improve_early, pure_python, monkeypatch):
    """Paper Setting 6 at 96 NPUs, interleaved up to PP 8: the local search betters a group's best plan,
    and the search proves the optimum that it proves without the local search, and with one that finds
    nothing (the stopped trees are searched again to their end). Each group has at most one local search,
    on an interleaved group."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-96"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    opts = dict(mode="exact", max_pipeline_stages=8, schedules=("interleaved-1f1b",), warmup_samples=0,
                pure_python=pure_python)
    r, res = run(cm, **opts)
    assert res.stats.complete
    assert any(n > 1 for n in RESUMED)          # resumed walks that searched on past their stop
    keys = [key for who, key, _b, _a in improve_early if who is r]
    assert keys and len(keys) == len(set(keys)) and set(keys) == r.improved
    assert all(key[5] > 1 for key in keys)          # (tp, pp, dp, mbs, schedule, V)
    assert any(after < before for _r, _k, before, after in improve_early)
    # a local search that finds nothing: its stopped trees are searched to their end, the same optimum
    monkeypatch.setattr(engine, "iterated_polish",
                        lambda params, table, shape, types, layers, ms, **kw: (ms, list(types), list(layers), 0))
    improve_early.clear()
    _r, idle = run(cm, **opts)
    assert improve_early and idle.stats.complete
    assert idle.plan.predicted_iteration_ms == res.plan.predicted_iteration_ms
    monkeypatch.setattr(SearchRun, "may_improve", lambda self, sg: False)
    improve_early.clear()
    _r, plain = run(cm, **opts)
    assert not improve_early and plain.stats.complete
    assert plain.plan.predicted_iteration_ms == res.plan.predicted_iteration_ms


def test_default_mode_has_no_local_search(improve_early):
    for seed in SEEDS:
        cm, schedules = random_problem(seed)
        run(cm, mode="default", schedules=schedules, warmup_samples=0)
    assert not improve_early


@pytest.mark.parametrize("seed", range(0, 40, 4))
@pytest.mark.parametrize("fraction", [0.8, 0.9])
def test_a_search_cut_near_its_local_search_stays_valid(improve_early, seed, fraction, pure_python):
    """Cut by the clock (before, inside or after a local search), resumed with what the reserve leaves: the
    lower bound never passes the optimum, and a search that completes proves it."""
    assert_a_cut_search_stays_valid(seed, fraction, pure_python)


@pytest.mark.parametrize("seed", range(0, 40, 4))
@pytest.mark.parametrize("budget", [1, 3, 6])
def test_a_node_budget_with_the_local_search(improve_early, seed, budget, pure_python):
    """A test's node budget, below the stop's cap or above it: the lower bound stays valid, and a complete
    search proves the optimum."""
    assert_a_budgeted_search_stays_valid(seed, budget, pure_python)


def _setting_6_96_run(pure_python: bool) -> SearchRun:
    """The exact search of paper Setting 6 at 96 NPUs (Llama-3 70B, micro-batch 1) up to PP 8, both schedules."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-96"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    return SearchRun(cm, SearchOptions(mode="exact", max_pipeline_stages=8, warmup_samples=0,
                                       schedules=("1f1b", "interleaved-1f1b"), pure_python=pure_python))


def _setting_6_96_walk(pure_python: bool, top: int, want, picks):
    """``(group index, run, group, splitter, counts, full run)`` of :func:`_setting_6_96_trees`; with
    ``picks``, only the trees it names are walked."""
    r = _setting_6_96_run(pure_python)
    for i, sg in enumerate(r.space.shape_groups()):
        sp = r.splitter(sg, alternate=False)
        for vec in r.space.count_vectors(sg):
            if not want(sg):
                break
            if picks is not None and (i, tuple(vec)) not in picks:
                continue
            full = sp.run(vec, math.inf, max_nodes=top + 1)
            if 50 <= full.counters[0] <= top and not full.aborted:
                yield i, r, sg, sp, vec, full


@functools.lru_cache(maxsize=None)
def _setting_6_96_picks(top: int) -> frozenset | None:
    """``(group index, counts)`` of the trees :func:`_setting_6_96_trees` yields, as the compiled walk finds
    them (both backends walk the same nodes: tests/unit/test_search_backends.py); None without it."""
    try:
        import poseidon_plugin._core._search  # noqa: F401
    except ImportError:
        return None
    if os.environ.get("POSEIDON_PURE_PYTHON", "") not in ("", "0"):
        return None
    return frozenset((i, tuple(vec)) for i, _r, _sg, _sp, vec, _full in
                     _setting_6_96_walk(False, top, lambda sg: True, None))


def _setting_6_96_trees(pure_python: bool, top: int = 3000, want=lambda sg: True):
    """``(run, group, splitter, counts, full run at tau = inf)`` of paper Setting 6 at 96 NPUs up to PP 8
    (one-chunk and interleaved shapes; the groups ``want`` accepts) whose whole tree takes 50 to ``top``
    nodes, walked in pipeline order (one-chunk: from the end). The pure-Python twin walks only the trees
    the compiled walk picked, where it is built: walking every tree up to ``top`` nodes was most of its
    time."""
    picks = _setting_6_96_picks(top) if pure_python else None
    for _i, *tree in _setting_6_96_walk(pure_python, top, want, picks):
        yield tuple(tree)


def test_a_stopped_tree_resumes_where_it_stopped(pure_python):
    """A walk stopped by its node budget and resumed (again and again, each below the best plan found so
    far) finds the plan one whole walk finds, and never starts over: a resumed run takes fewer nodes than
    a whole walk, and with the stop's, at most the whole walk's plus the path walked again (one-chunk
    shapes: the resumed path's nodes see the lower threshold, and the relaxation bound's rule per depth
    goes on from the stopped walk's counts; on interleaved ones the path walked again leaves its children
    no kept rows); a run that cannot resume (other counts, a threshold above the stopped one's) walks the
    tree afresh."""
    seen = {1: 0, 2: 0}
    # the pure-Python twin: two trees of each kind
    want = (lambda sg: seen[sg.virtual_stages] < 2) if pure_python else (lambda sg: True)
    for _r, sg, sp, vec, full in _setting_6_96_trees(pure_python, 300 if pure_python else 3000, want):
        n = full.counters[0]
        for budget in ((n // 4, n // 2) if pure_python else (sg.pp + 1, n // 3, n // 2)):
            tau, best, plan, runs, resume = math.inf, math.inf, None, 0, False
            while True:
                res = sp.run(vec, tau, max_nodes=budget, resume=resume)
                assert res.resumed == resume
                runs += 1
                if res.time_ms < best:
                    best, plan, tau = res.time_ms, (res.types, res.layers), res.time_ms
                if not res.aborted:
                    break
                resume = True
                assert runs <= n
            assert best == full.time_ms and plan == (full.types, full.layers)
            assert runs > 1
        stop = sp.run(vec, math.inf, max_nodes=n // 2)
        assert stop.aborted
        tau = stop.time_ms
        if tau < math.inf:
            # a threshold above the stopped run's last: it cannot resume
            again = sp.run(vec, tau * 1.5, resume=True)
            assert not again.resumed
            stop = sp.run(vec, math.inf, max_nodes=n // 2)
        rest = sp.run(vec, tau, resume=True)
        assert rest.resumed and not rest.aborted
        assert min(stop.time_ms, rest.time_ms) == full.time_ms
        assert rest.counters[0] < n
        if sg.virtual_stages == 1:
            assert stop.counters[0] + rest.counters[0] <= n + sg.pp + 1
        seen[sg.virtual_stages] += 1
        # other counts: the stopped walk is not theirs
        sp.run(vec, math.inf, max_nodes=n // 2)
        other = [c for c in (tuple(x + (i == j) - (i == k) for i, x in enumerate(vec))
                             for j in range(len(vec)) for k in range(len(vec)) if j != k) if min(c) >= 0]
        fresh = sp.run(other[0], math.inf, resume=True)
        assert not fresh.resumed
    assert seen[1] and seen[2]


def test_both_orders_of_an_interleaved_tree_find_its_optimum(pure_python):
    """An interleaved structure's tree walked in pipeline order and from both ends in turn (what the engine
    walks: ``SearchRun.splitter``) finds the same best time (paper Setting 6 at 96 NPUs up to PP 8), and
    the order changes the tree (non-vacuity: their node counts differ somewhere); a stopped walk in the
    second order resumes to the same answer."""
    seen = differ = 0
    for r, sg, _sp, vec, full in _setting_6_96_trees(pure_python, 300 if pure_python else 3000,
                                                      lambda sg: sg.virtual_stages > 1):
        walk = r.splitter(sg)
        alt = walk.run(vec, math.inf)
        assert not alt.aborted and alt.time_ms == full.time_ms
        differ += alt.counters[0] != full.counters[0]
        stop = walk.run(vec, math.inf, max_nodes=max(2, alt.counters[0] // 2))
        rest = walk.run(vec, stop.time_ms, resume=True)
        assert stop.aborted and rest.resumed and min(stop.time_ms, rest.time_ms) == full.time_ms
        seen += 1
        if pure_python and seen >= 2:
            break
    assert seen and differ


def test_one_chunk_groups_have_the_local_search_and_the_same_optimum(improve_early, pure_python, monkeypatch):
    """Paper Setting 6 at 96 NPUs, one-chunk (1F1B) up to PP 8: each group's first tree stops for the local
    search (once per group) and its walk resumes; the search proves the optimum that it proves without the
    local search."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.specs import load_cluster, load_model
    cm = CostModel(load_cluster("paper-setting-6-96"), load_model("llama3-70b"), micro_batch_sizes=(1,))
    opts = dict(mode="exact", max_pipeline_stages=8, schedules=("1f1b",), warmup_samples=0,
                pure_python=pure_python)
    r, res = run(cm, **opts)
    assert res.stats.complete
    keys = [key for who, key, _b, _a in improve_early if who is r]
    assert keys and len(keys) == len(set(keys)) and set(keys) == r.improved
    assert all(key[5] == 1 for key in keys)          # (tp, pp, dp, mbs, schedule, V)
    assert any(n > 1 for n in RESUMED)
    monkeypatch.setattr(SearchRun, "may_improve", lambda self, sg: False)
    improve_early.clear()
    _r, plain = run(cm, **opts)
    assert not improve_early and plain.stats.complete
    assert plain.plan.predicted_iteration_ms == res.plan.predicted_iteration_ms
