"""A structure's tree walked by several processes (search/shared_walk.py, ``SearchOptions.workers``).

* the shared walk finds the plan the walk alone finds (time, device types, layers), on random
  structures, both branching orders, 2 and 3 processes, at thresholds where the tree finds the optimum
  and where it finds nothing; both backends;
* the processes split the tree: each searches fewer nodes than the walk alone, and together the depth's
  subtrees are searched once each (``SplitSearch.share`` run in turn in one process);
* a child that fails has its part searched again (the same plan); one that stops early leaves the walk
  not resumable;
* ``search()`` with workers finds the ``--exhaustive`` optimum, and ``poseidon plan --workers``
  validates its value.

Each test lowers SHARE_AT so that these small trees are shared at all, and counts the forks.
"""

import math
import os
from array import array

import pytest

from poseidon_plugin.errors import InputError
from poseidon_plugin.search import SearchOptions, engine, search, shared_walk
from poseidon_plugin.search.counters import N_COUNTERS, NODES
from poseidon_plugin.search.shapes import ShapeData
from poseidon_plugin.search.splits import SplitSearch as PySplitSearch

from .test_search_backends import pinned_problem
from .test_search_bounds import brute_force, random_structure

INF = math.inf


def share_early(monkeypatch) -> list:
    """Sharing and racing from the first nodes on (SHARE_AT 2, any depth; exact mode's look-ahead, local
    search and race after 4 nodes, raced walks in legs of 2); returns the list the forks are counted in."""
    monkeypatch.setattr(shared_walk, "SHARE_AT", 2)
    monkeypatch.setattr(shared_walk, "SHARE_MIN", 1)
    monkeypatch.setattr(engine, "IMPROVE_AT", 4)
    monkeypatch.setattr(engine, "LOOKAHEAD_AT", (4, 4))
    monkeypatch.setattr(engine, "RACE_AT", 4)
    monkeypatch.setattr(shared_walk, "RACE_LEG", 2)
    count = []
    real = os.fork

    def fork():
        count.append(1)
        return real()
    monkeypatch.setattr(os, "fork", fork)
    return count


@pytest.fixture
def forks(monkeypatch):
    """:func:`share_early`'s fork count."""
    return share_early(monkeypatch)


def _splitter(table, shape, counts, num_layers, pure: bool, backward: bool):
    cls = array("i", range(len(counts)))
    if pure:
        return PySplitSearch(table, shape, num_layers, ridge=False, blocks=False, type_class=cls, backward=backward)
    from poseidon_plugin._core._search import SplitSearch
    shape_c = ShapeData(shape.schedule, shape.pp, shape.micro_batches, shape.virtual_stages, False)
    return SplitSearch(table, shape_c, num_layers, ridge=False, blocks=False, type_class=cls, backward=backward)


def _case(seed: int):
    """A random structure of at least 3 ranks with a plan: ``(table, shape, counts, num_layers, best)``."""
    for trial in range(300):
        table, shape, counts, num_layers = random_structure(9000 + 37 * seed + trial, pure=True)
        if shape.pp >= 3:
            plans = brute_force(table, shape, counts, num_layers)
            if plans:
                return table, shape, counts, num_layers, min(p[0] for p in plans)
    raise AssertionError(f"no structure from seed {seed}")


@pytest.mark.parametrize("seed", range(16))
def test_a_shared_walk_finds_the_plan_of_the_walk_alone(seed, pure_python, forks):
    table, shape, counts, num_layers, best = _case(seed)
    backward = seed % 2 == 1
    for tau in (INF, best * 1.05, best * (1 + 1e-9), best):       # best: no plan below it
        alone = _splitter(table, shape, counts, num_layers, pure_python, backward).run(counts, tau)
        for workers in (2, 3):
            got = shared_walk.shared_run(_splitter(table, shape, counts, num_layers, pure_python, backward), counts,
                                         tau, workers=workers, shrink=1.0, deadline=INF, resume=False)
            assert not got.aborted
            assert (got.time_ms, got.types, got.layers) == (alone.time_ms, alone.types, alone.layers)
            if tau > best:
                assert got.time_ms == best


def test_shared_walks_fork(forks):
    """Not vacuous: the walks above are shared (a fork per extra process), and their nodes are their
    processes' with the first leg's, so more than SHARE_AT."""
    shared = 0
    for seed in range(16):
        table, shape, counts, num_layers, _best = _case(seed)
        before = len(forks)
        got = shared_walk.shared_run(_splitter(table, shape, counts, num_layers, True, seed % 2 == 1), counts, INF,
                                     workers=3, shrink=1.0, deadline=INF, resume=False)
        if len(forks) - before == 2:
            shared += 1
            assert got.counters[NODES] > shared_walk.SHARE_AT
    assert shared >= 8


@pytest.mark.parametrize("seed", range(16))
def test_the_processes_split_the_tree(seed, forks):
    """Each share (``SplitSearch.share``, run in turn in one process, no plan below the threshold to find)
    searches part of the subtrees of the shared depth, and together they search each once: the nodes
    below that depth add up to the walk alone's."""
    table, shape, counts, num_layers, best = _case(seed)
    alone = _splitter(table, shape, counts, num_layers, True, False)
    alone.run(counts, best)                          # a proof: no plan below best, no threshold moves
    profile = alone.depth_profile()
    depth = next((k for k in range(1, len(profile)) if profile[k] >= 2), None)
    if depth is None:
        pytest.skip("a tree of one node per depth")
    totals = [0] * len(profile)
    for index in range(3):
        ss = _splitter(table, shape, counts, num_layers, True, False)
        ss.share(3, index, depth)
        res = ss.run(counts, best)
        assert res.time_ms == INF
        part = ss.depth_profile()
        assert part[:depth] == profile[:depth]       # the path to the shared depth is every process's
        for k in range(depth, len(profile)):
            totals[k] += part[k]
    assert totals[depth:] == profile[depth:]


def _fail(*_args):
    os._exit(1)


@pytest.mark.parametrize("raced", [False, True])
def test_a_failed_child_leaves_the_tree_to_the_parent(raced, forks, monkeypatch):
    """A child that exits without a result (a shared walk's, a race's): the parent searches the tree again,
    alone, and finds the walk alone's plan."""
    monkeypatch.setattr(shared_walk, "_race_child" if raced else "_child", _fail)
    for seed in range(6):
        table, shape, counts, num_layers = (_one_chunk_case if raced else _case)(seed)[:4]
        alone = _splitter(table, shape, counts, num_layers, True, raced).run(counts, INF)
        walk = _splitter(table, shape, counts, num_layers, True, raced)
        if raced:
            got, ended = shared_walk.raced_run(walk, _splitter(table, shape, counts, num_layers, True, False), counts,
                                               INF, shrink=1.0, deadline=INF, resume_lead=False, resume_other=False)
            assert ended == 0
        else:
            got = shared_walk.shared_run(walk, counts, INF, workers=2, shrink=1.0, deadline=INF, resume=False)
        assert (got.time_ms, got.types, got.layers, got.aborted) == (alone.time_ms, alone.types, alone.layers, False)
    assert len(forks) == 6 if raced else forks


def test_a_child_stopped_early_leaves_the_walk_not_resumable(forks, monkeypatch):
    """A child that stopped early (the clock) reports ``aborted``: the result is aborted and the walk's next
    run starts from the root (the child's part before the stop is not all searched)."""
    def stopped(_splitter, _vec, _limit, _deadline, _workers, _index, _depth, _tau, write_end):
        doc = ('{"time_ms": null, "path": [], "types": [], "layers": [], "counters": [%s], "aborted": true}'
               % ",".join(["0"] * N_COUNTERS))
        os.write(write_end, doc.encode())
        os._exit(0)
    monkeypatch.setattr(shared_walk, "_child", stopped)
    shared = 0
    for seed in range(6):
        table, shape, counts, num_layers, best = _case(seed)
        ss = _splitter(table, shape, counts, num_layers, True, False)
        before = len(forks)
        got = shared_walk.shared_run(ss, counts, INF, workers=2, shrink=1.0, deadline=INF, resume=False)
        if len(forks) > before:
            shared += 1
            assert got.aborted
            assert not ss.can_resume(counts, INF)
    assert shared > 0


@pytest.mark.parametrize("seed", range(0, 80, 3))
def test_search_with_workers_finds_the_exhaustive_optimum(seed, pure_python, forks):
    cm, opts = pinned_problem(seed)
    ref = search(cm, SearchOptions(mode="exhaustive", **opts))
    alone = search(cm, SearchOptions(mode="exact", pure_python=pure_python, **opts))
    for mode in ("exact", "default"):
        got = search(cm, SearchOptions(mode=mode, workers=2, pure_python=pure_python, **opts))
        one = alone if mode == "exact" else search(cm, SearchOptions(mode=mode, pure_python=pure_python, **opts))
        assert got.plan.predicted_iteration_ms == one.plan.predicted_iteration_ms
        assert (got.plan.stage_types, got.plan.layers) == (one.plan.stage_types, one.plan.layers)
    assert alone.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms


def test_searches_with_workers_fork(forks):
    """Not vacuous: whole searches fork in both modes (the pinned problems above). Exact mode shares the
    walks of interleaved trees once the look-ahead and the group's local search are done (after
    LOOKAHEAD_AT and IMPROVE_AT nodes, here lowered) and races one-chunk trees in two processes (past
    RACE_AT); default mode shares every walk."""
    forked = {("exact", True): 0, ("exact", False): 0, ("default", True): 0, ("default", False): 0}
    for seed in range(0, 80, 3):       # every schedule set of the pinned problems
        cm, opts = pinned_problem(seed)
        interleaved = "interleaved-1f1b" in opts["schedules"]
        for mode in ("exact", "default"):
            before = len(forks)
            search(cm, SearchOptions(mode=mode, workers=2, **opts))
            forked[mode, interleaved] += len(forks) > before
    assert min(forked.values()) >= 2, forked


def _one_chunk_case(seed: int):
    """A random one-chunk structure of at least 3 ranks with a plan: ``(table, shape, counts, num_layers,
    plans)``, every plan by brute force."""
    for trial in range(400):
        table, shape, counts, num_layers = random_structure(11000 + 41 * seed + trial, pure=True)
        if shape.pp >= 3 and shape.virtual_stages == 1:
            plans = brute_force(table, shape, counts, num_layers)
            if plans:
                return table, shape, counts, num_layers, plans
    raise AssertionError(f"no one-chunk structure from seed {seed}")


@pytest.mark.parametrize("seed", range(12))
def test_a_raced_pair_finds_the_plan_of_the_walk_alone(seed, pure_python, forks):
    """The walk from the end here, the one in pipeline order in a child (``raced_run``): the optimum (its
    plan where no other plan is as fast), and the walk that ended named."""
    table, shape, counts, num_layers, plans = _one_chunk_case(seed)
    best = min(p[0] for p in plans)
    for tau in (INF, best * 1.05, best):
        alone = _splitter(table, shape, counts, num_layers, pure_python, True).run(counts, tau)
        lead = _splitter(table, shape, counts, num_layers, pure_python, True)
        other = _splitter(table, shape, counts, num_layers, pure_python, False)
        got, ended = shared_walk.raced_run(lead, other, counts, tau, shrink=1.0, deadline=INF, resume_lead=False,
                                           resume_other=False)
        assert not got.aborted and ended in (0, 1)
        assert got.time_ms == alone.time_ms
        if sum(p[0] == best for p in plans) == 1 or tau <= best:
            assert (got.types, got.layers) == (alone.types, alone.layers)
