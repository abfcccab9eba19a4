"""Lower bounds of the branch and bound: valid for every completion, on random structures.

Random cost tables (not tied to any hardware) stress the bounds harder than real presets: types with
very different speeds, memories and links. The brute force enumerates every type order and layer split.
"""

import math
import os
import random
from array import array

import pytest

from poseidon_plugin.search.constants import LP_KEEP, PATH_SLACK
from poseidon_plugin.search.evaluate import plan_fits, simulate_plan, spread
from poseidon_plugin.search.exhaustive import orders, rank_splits
from poseidon_plugin.search.shapes import RankOps, ShapeData, bound_paths, first_backward
from poseidon_plugin.search.splits import SplitSearch as PySplitSearch
from poseidon_plugin.search.tables import TypeTable
from poseidon_plugin.simulator import Simulator, rank_order

SCHEDULES = ["gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b"]
PURE_FORCED = os.environ.get("POSEIDON_PURE_PYTHON", "") not in ("", "0")
needs_compiled = pytest.mark.skipif(PURE_FORCED, reason="POSEIDON_PURE_PYTHON=1 forces the pure loop")


def random_table(rng, nt, dp, slots) -> TypeTable:
    s = max(slots)
    col = lambda lo, hi, n=nt: array("d", [rng.uniform(lo, hi) for _ in range(n)])  # noqa: E731
    fwd = col(0.5, 3.0)
    return TypeTable(
        tp=1, mbs=1, dp=dp, names=tuple(f"t{i}" for i in range(nt)), slots=array("i", slots),
        max_slots=s, forward_ms=fwd, backward_ms=array("d", [f * rng.uniform(1.2, 2.5) for f in fwd]),
        embedding_forward_ms=col(0, .5), embedding_backward_ms=col(0, .5), head_forward_ms=col(0, 2),
        head_backward_ms=col(0, 4), allreduce_ms=col(0, 1, nt * s),
        embedding_allreduce_ms=col(0, .5, nt * s), head_allreduce_ms=col(0, .5, nt * s),
        has_allreduce=array("i", [int(dp > 1)] * (nt * s)), send_same_ms=col(0, .5, nt * s),
        send_wrap_ms=col(0, .5, nt * s), send_cross_ms=col(.2, 1.5), layer_state_bytes=col(1, 1),
        layer_activation_bytes=col(.05, .4), embedding_state_bytes=col(0, 1),
        embedding_activation_bytes=col(0, .3), head_state_bytes=col(0, 1),
        head_activation_bytes=col(0, .5), usable_bytes=col(4, 14),
        # framework terms per (chunk, micro-batch) step and per stage: the bounds leave them out
        step_forward_ms=col(0, .3), step_backward_ms=col(0, .3), optimizer_ms=col(0, .2),
        optimizer_fixed_ms=col(0, 1))


def random_structure(seed: int, pure: bool):
    rng = random.Random(seed)
    nt = rng.choice([1, 2, 2, 3])
    pp = rng.choice([1, 2, 3, 4]) if nt < 3 else rng.choice([2, 3, 4])
    schedule = rng.choice(SCHEDULES) if pp > 1 else "1f1b"
    v = 2 if schedule == "interleaved-1f1b" else 1
    m = pp * rng.choice([1, 2, 3]) if v == 2 else rng.choice([1, 2, 3, 5, 8])
    layers = rng.randint(pp * v, pp * v + 7)
    counts = [0] * nt
    for _ in range(pp):
        counts[rng.randrange(nt)] += 1
    table = random_table(rng, nt, rng.choice([1, 2]), [max(1, c + rng.randint(0, 2)) for c in counts])
    return table, ShapeData(schedule, pp, m, v, pure), counts, layers


def propagate(ss, k, left, lb, cap, capt, parent=None):
    """``ss._propagate`` from scratch, or from the parent node's ``(lb, cap, capt)``."""
    if parent is None:
        return ss._propagate(k, left, lb, cap, capt, lb, cap, capt, False)
    return ss._propagate(k, left, lb, cap, capt, *parent, True)


def fill(ss, lb, capt=None):
    """``ss._fill`` with the node's per-type caps, or (None) caps every type meets."""
    if capt is None:
        capt = [ss.num_layers] * (ss.nv * ss.nt)
    ss._fill(lb, capt)


def brute_force(table, shape, counts, num_layers):
    """Every (time, types, layers) of the structure that fits memory."""
    params = array("d", [0.0]) * shape.n_params
    out = []
    for types in orders(counts):
        for ranks in rank_splits(num_layers, shape.pp, shape.virtual_stages):
            layers = spread(ranks, shape.pp, shape.virtual_stages)
            if plan_fits(table, shape, types, layers):
                out.append((simulate_plan(params, table, shape, types, layers), types, layers))
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp,m,v", [(1, 3, 1), (2, 4, 1), (3, 6, 1), (4, 4, 1), (4, 9, 1), (2, 4, 2),
                                    (3, 6, 2), (4, 8, 3), (4, 8, 2), (6, 12, 2), (3, 9, 3)])
def test_bound_paths_are_dag_paths(schedule, pp, m, v):
    """Every bound path is a path of the DAG: its cost never exceeds the longest path."""
    if (schedule == "interleaved-1f1b") != (v > 1) or (v > 1 and (pp < 2 or m % pp)):
        pytest.skip("shape not valid for this schedule")
    paths = bound_paths(schedule, pp, m, v)
    sim = Simulator(schedule, pp, m, v)
    rng = random.Random(pp * 100 + m)
    nv = pp * v
    for _ in range(20):
        fwd = [rng.uniform(0, 5) for _ in range(nv)]
        bwd = [rng.uniform(0, 9) for _ in range(nv)]
        send = [rng.uniform(0, 2) for _ in range(pp)]
        ar = [rng.uniform(0, 7) for _ in range(pp)]
        longest = sim.iteration_time(fwd, bwd, send, ar)
        best = 0.0
        for cost in _path_costs(paths, sim.params):
            assert cost <= longest * (1 + 1e-12) + 1e-12
            best = max(best, cost)
        assert best > 0.0


@pytest.mark.parametrize("schedule,pp,m,v,send", [
    ("1f1b", 4, 8, 1, 0.0), ("1f1b", 8, 16, 1, 0.0), ("eager-1f1b", 4, 8, 1, 0.3), ("gpipe", 4, 8, 1, 0.3),
    ("interleaved-1f1b", 4, 8, 2, 0.3), ("interleaved-1f1b", 8, 16, 2, 0.3),
    ("interleaved-1f1b", 4, 8, 3, 0.3)])
def test_bound_paths_are_tight_on_uniform_pipelines(schedule, pp, m, v, send):
    """On a pipeline of identical stages one of the bound paths is a longest path: the bounds lose
    nothing there. (Not for 1F1B with transfer costs: its steady state zigzags between neighbouring
    ranks and picks up two transfers per micro-batch, which no bound path follows.)"""
    paths = bound_paths(schedule, pp, m, v)
    sim = Simulator(schedule, pp, m, v)
    nv = pp * v
    longest = sim.iteration_time([1.0] * nv, [2.0] * nv, [send] * pp, [0.5] * pp)
    best = max(_path_costs(paths, sim.params))
    assert best == pytest.approx(longest, rel=1e-12)
    assert len(paths.owner) == paths.count and set(paths.owner) == set(range(pp))


def _path_costs(paths, p):
    """Each bound path's cost at the parameter vector ``p``."""
    return [sum(paths.term_coef[e] * p[paths.term_idx[e]] for e in range(paths.term_ptr[q], paths.term_ptr[q + 1]))
            for q in range(paths.count)]


@pytest.mark.parametrize("comm_model", ["dag", "megatron", "megatron-overlap"])
@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 2, 4, 1), ("1f1b", 4, 9, 1), ("eager-1f1b", 4, 8, 1),
                                             ("gpipe", 3, 6, 1), ("interleaved-1f1b", 4, 8, 2),
                                             ("interleaved-1f1b", 3, 6, 2)])
def test_the_tree_search_paths_are_dag_paths(comm_model, schedule, pp, m, v):
    """``ShapeData.search_paths`` (the bound paths and each rank's chain with its transfers:
    ``rank_chain_paths``) are paths of the comm model's DAG: on random weights none exceeds the longest
    path, and each plain bound path costs at most one of them (a row is replaced only by one that covers
    it); each owner is a rank."""
    shape = ShapeData(schedule, pp, m, v, pure_python=True, comm_model=comm_model)
    paths, plain = shape.search_paths, bound_paths(schedule, pp, m, v)
    assert all(0 <= r < pp for r in paths.owner) and len(paths.owner) == paths.count
    sim = Simulator(schedule, pp, m, v, comm_model)
    rng = random.Random(pp * 100 + m + v)
    nv = pp * v
    for _ in range(15):
        longest = sim.iteration_time([rng.uniform(0, 5) for _ in range(nv)], [rng.uniform(0, 9) for _ in range(nv)],
                                     [rng.uniform(0, 2) for _ in range(pp)], [rng.uniform(0, 7) for _ in range(pp)])
        costs = _path_costs(paths, sim.params)
        assert max(costs) <= longest * (1 + 1e-12) + 1e-12
        assert all(any(x <= y * (1 + 1e-12) + 1e-12 for y in costs) for x in _path_costs(plain, sim.params))


def test_rank_chain_paths_hold_the_steady_state_transfers_of_megatron_1f1b():
    """Under the Megatron comm model a 1F1B rank's blocking p2p calls sit between its own ops: on a
    pipeline of identical stages with transfer costs a longest path picks up a transfer per micro-batch
    (the plain bound paths, valid for every comm model, miss them: they stay strictly below), and a
    search path is one; under ``dag`` the chains add no path."""
    pp, m = 4, 8
    sim = Simulator("1f1b", pp, m, 1, "megatron")
    longest = sim.iteration_time([1.0] * pp, [2.0] * pp, [0.3] * pp, [0.5] * pp)
    shape = ShapeData("1f1b", pp, m, 1, pure_python=True, comm_model="megatron")
    plain = max(_path_costs(bound_paths("1f1b", pp, m, 1), sim.params))
    assert plain < longest * (1 - 1e-3)
    assert max(_path_costs(shape.search_paths, sim.params)) == pytest.approx(longest, rel=1e-12)
    dag = ShapeData("1f1b", pp, m, 1, pure_python=True, comm_model="dag")
    assert dag.search_paths.count == dag.paths.count


@pytest.mark.parametrize("seed", range(80))
def test_lower_bounds_never_exceed_any_completion(seed):
    """At random prefixes of random structures, with tau just above the best completion: the node is
    not pruned, every completion that beats tau lies within the propagated [lb, cap], and the
    stage-level DAG bound is at most the best completion."""
    table, shape, counts, num_layers = random_structure(seed, pure=True)
    plans = brute_force(table, shape, counts, num_layers)
    if not plans:
        pytest.skip("nothing fits memory")
    rng = random.Random(seed)
    pp, v = shape.pp, shape.virtual_stages
    ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                       type_class=array("i", range(len(counts))))
    ss.run(counts, math.inf)            # initialises the state arrays and the kernel
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        k = rng.randrange(pp)                       # ranks 0..k-1 decided as in this plan
        completions = [p for p in plans if p[1][:k] == types[:k]
                       and all(p[2][c * pp + r] == layers[c * pp + r] for r in range(k) for c in range(v))]
        best = min(p[0] for p in completions)
        tau = best * (1 + 1e-9) + 1e-12
        ss.tau = tau
        ss.remaining = list(counts)
        ss.used = [0] * len(counts)
        ss.types = [-1] * pp
        ss.layers = [0] * (pp * v)
        for r in range(k):
            t = types[r]
            ss.types[r], ss.slot[r] = t, ss.used[t]
            ss.remaining[t] -= 1
            ss.used[t] += 1
            for c in range(v):
                ss.layers[c * pp + r] = layers[c * pp + r]
        left = num_layers - sum(ss.layers)
        lb, cap, capt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * len(counts))
        assert propagate(ss, k, left, lb, cap, capt)
        _assert_within([p for p in completions if p[0] < tau], range(k, pp), pp, v, lb, cap, capt)
        fill(ss, lb)
        assert ss.kernel.longest(ss.params) <= best


def _assert_within(completions, ranks, pp, v, lb, cap, capt):
    """Every completion ``(time, types, layers)`` keeps each stage of ``ranks`` within its propagated
    [lb, cap] and within the cap of the type it gives the rank."""
    nt = len(capt) // (pp * v)
    for _t_ms, typ, lay in completions:
        for r in ranks:
            for c in range(v):
                vs = c * pp + r
                assert lb[vs] <= lay[vs] <= cap[vs]
                assert lay[vs] <= capt[vs * nt + typ[r]]     # the cap of the type it takes


def _decide(ss, counts, types, layers, k, pp, v):
    """Search state with ranks 0..k-1 decided as in (types, layers); returns the layers left."""
    ss.remaining, ss.used = list(counts), [0] * len(counts)
    ss.types, ss.layers = [-1] * pp, [0] * (pp * v)
    for r in range(k):
        t = types[r]
        ss.types[r], ss.slot[r] = t, ss.used[t]
        ss.remaining[t] -= 1
        ss.used[t] += 1
        for c in range(v):
            ss.layers[c * pp + r] = layers[c * pp + r]
    return ss.num_layers - sum(ss.layers)


def _searched_structure(seed: int):
    """A seeded random structure, every plan of it (brute force) and a split search run on it:
    ``(plans, counts, pp, v, nt, rng, search)``, or None without a plan or with one rank."""
    table, shape, counts, num_layers = random_structure(seed, pure=True)
    plans = brute_force(table, shape, counts, num_layers)
    pp, v, nt = shape.pp, shape.virtual_stages, len(counts)
    if not plans or pp < 2:
        return None
    ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                       type_class=array("i", range(nt)))
    ss.run(counts, math.inf)
    return plans, counts, pp, v, nt, random.Random(seed), ss


def _inherited_case(seed: int) -> int | None:
    """A child node starts from its parent's propagated bounds (docs/SEARCH.md): at random prefixes,
    with tau just above the best completion of the parent, the child is not pruned, every completion
    that beats tau lies within its [lb, cap] and its type caps. Returns how many children it cut or
    bounded tighter somewhere than a fresh propagation (None: no case)."""
    found = _searched_structure(seed)
    if found is None:
        return None
    plans, counts, pp, v, nt, rng, ss = found
    tighter = 0
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        k = rng.randrange(1, pp)                    # the child decides rank k; its parent rank k-1
        parent_done = [p for p in plans if p[1][:k - 1] == types[:k - 1]
                       and all(p[2][c * pp + r] == layers[c * pp + r] for r in range(k - 1) for c in range(v))]
        ss.tau = min(p[0] for p in parent_done) * (1 + 1e-9) + 1e-12
        left = _decide(ss, counts, types, layers, k - 1, pp, v)
        plb, pcap, pcapt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        assert propagate(ss, k - 1, left, plb, pcap, pcapt)
        completions = [p for p in parent_done if p[1][k - 1] == types[k - 1]
                       and all(p[2][c * pp + k - 1] == layers[c * pp + k - 1] for c in range(v))]
        left = _decide(ss, counts, types, layers, k, pp, v)
        lb, cap, capt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        ok = propagate(ss, k, left, lb, cap, capt, (plb, pcap, pcapt))
        fresh = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        fresh_ok = propagate(ss, k, left, *fresh)
        beat = [p for p in completions if p[0] < ss.tau]
        if beat:
            assert ok
        if not ok:
            tighter += fresh_ok         # the inherited bounds cut the child, a fresh start does not
            continue
        _assert_within(beat, range(k, pp), pp, v, lb, cap, capt)
        if fresh_ok:
            tighter += any(lb[vs] > fresh[0][vs] or cap[vs] < fresh[1][vs]
                           for vs in (c * pp + r for r in range(k, pp) for c in range(v)))
    return tighter


@pytest.mark.parametrize("seed", range(80))
def test_inherited_bounds_never_exclude_a_completion(seed):
    if _inherited_case(seed) is None:
        pytest.skip("nothing fits memory, or one rank")


def test_inherited_bounds_are_tighter_somewhere():
    """Inheriting the parent's bounds is not idle on these problems: some child starts tighter than a
    fresh propagation would leave it."""
    assert sum(_inherited_case(seed) or 0 for seed in range(80, 100)) > 0


def _child_bound_case(seed: int) -> int | None:
    """The DAG bound of a child (rank k on a type with l layers) with the later ranks' lower bounds
    raised by the sum rule for that count (SplitSearch._child_lower_bounds): at random prefixes, with
    tau 5 % above the node's best completion, it never exceeds the best completion of a child that
    has one below tau. Returns how many children it priced above the plain (monotone) bound."""
    found = _searched_structure(seed)
    if found is None:
        return None
    plans, counts, pp, v, nt, rng, ss = found
    stronger = 0
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        k = rng.randrange(pp - 1)                   # ranks 0..k-1 decided, rank k next, a rank after it
        node = [p for p in plans if p[1][:k] == types[:k]
                and all(p[2][c * pp + r] == layers[c * pp + r] for r in range(k) for c in range(v))]
        ss.tau = min(p[0] for p in node) * 1.05
        left = _decide(ss, counts, types, layers, k, pp, v)
        lb, cap, capt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        assert propagate(ss, k, left, lb, cap, capt)
        s_cap = sum(cap[vs] for vs in range(pp * v) if vs % pp > k)
        children = {}
        for t_ms, typ, lay in node:
            if t_ms < ss.tau:
                key = (typ[k], sum(lay[c * pp + k] for c in range(v)))
                children[key] = min(children.get(key, math.inf), t_ms)
        for (t, l), best in children.items():
            ss.types[k], ss.slot[k] = t, ss.used[t]
            ss.remaining[t] -= 1
            ss.used[t] += 1
            for c in range(v):
                ss.layers[c * pp + k] = (l + v - 1 - c) // v
            out = [0] * (pp * v)
            if ss._child_lower_bounds(k + 1, pp, left - l, s_cap, lb, cap, out):
                fill(ss, out)
                raised = ss.kernel.longest(ss.params)
                assert raised <= best
                fill(ss, lb)
                stronger += raised > ss.kernel.longest(ss.params)
            ss.types[k] = -1
            ss.remaining[t] += 1
            ss.used[t] -= 1
            for c in range(v):
                ss.layers[c * pp + k] = 0
    return stronger


@pytest.mark.parametrize("seed", range(80))
def test_child_bound_never_exceeds_the_child_optimum(seed):
    if _child_bound_case(seed) is None:
        pytest.skip("nothing fits memory, or one rank")


def test_child_bound_is_stronger_somewhere():
    """The raised lower bounds price some children above the plain bound (where they can cut)."""
    assert sum(_child_bound_case(seed) or 0 for seed in range(80, 100)) > 0


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("backward", [False, True])
def test_structure_search_matches_brute_force(seed, backward, pure_python):
    if not pure_python and PURE_FORCED:
        pytest.skip("POSEIDON_PURE_PYTHON=1 forces the pure loop")
    table, shape, counts, num_layers = random_structure(1000 + seed, pure_python)
    plans = brute_force(table, shape, counts, num_layers)
    ref = min((p[0] for p in plans), default=math.inf)
    if pure_python:
        ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                           type_class=array("i", range(len(counts))), backward=backward)
    else:
        from poseidon_plugin._core._search import SplitSearch
        ss = SplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                         type_class=array("i", range(len(counts))), backward=backward)
    for tau in (math.inf, ref * (1 + 1e-7) if ref < math.inf else math.inf):
        res = ss.run(counts, tau)
        assert res.time_ms == ref
        if ref < math.inf:
            assert (res.time_ms, res.types, res.layers) in [(p[0], p[1], tuple(p[2])) for p in plans]


def test_from_the_end_the_front_rank_goes_first_where_its_memory_holds_the_average():
    """Ranks decided from the end start with rank 0 (whose paths hold every other rank's layers and its
    own on every micro-batch) where its memory holds at least the average rank's layers on one of the
    structure's types, then pp - 1, pp - 2, ..., 1; otherwise (memory keeps it short) they all go from
    the end. In pipeline order: 0, 1, ...."""
    from poseidon_plugin.search.constants import FRONT_FIRST
    seen = {}

    class Recording(PySplitSearch):
        def _children(self, k, r, *args):
            seen.setdefault(k, set()).add(r)
            return super()._children(k, r, *args)

    checked = {True: 0, False: 0}
    for seed in range(80):
        table, shape, counts, num_layers = random_structure(seed, True)
        pp = shape.pp
        if pp < 3:
            continue
        probe = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                              type_class=array("i", range(len(counts))))
        roomy = max(probe.cap_rank[t * pp] for t in range(len(counts)) if counts[t]) * pp >= num_layers
        front = FRONT_FIRST if roomy else 0
        for backward, order in ((True, list(range(front)) + list(range(pp - 1, front - 1, -1))),
                                (False, list(range(pp)))):
            seen.clear()
            ss = Recording(table, shape, num_layers, ridge=False, blocks=False,
                           type_class=array("i", range(len(counts))), backward=backward)
            if ss.run(counts, math.inf).time_ms < math.inf:      # the tree reached its leaves
                assert [seen[k] for k in range(pp)] == [{r} for r in order]
                if backward:
                    checked[roomy] += 1
    assert FRONT_FIRST == 1 and checked[True] >= 5 and checked[False] >= 1, checked


@needs_compiled
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("ridge,blocks", [(False, False), (True, True), (True, False)])
def test_compiled_and_pure_loops_identical(seed, ridge, blocks):
    from poseidon_plugin._core._search import SplitSearch
    table, shape_py, counts, num_layers = random_structure(2000 + seed, True)
    shape_c = ShapeData(shape_py.schedule, shape_py.pp, shape_py.micro_batches,
                        shape_py.virtual_stages, False)
    cls = array("i", range(len(counts)))
    a = PySplitSearch(table, shape_py, num_layers, ridge=ridge, blocks=blocks, type_class=cls)
    b = SplitSearch(table, shape_c, num_layers, ridge=ridge, blocks=blocks, type_class=cls)
    for tau in (math.inf, 60.0, 1.0):
        assert a.run(counts, tau) == b.run(counts, tau)
        assert a.run(counts, tau, root_only=True) == b.run(counts, tau, root_only=True)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_first_backward_and_op_counts_match_the_schedules(schedule):
    """The bound paths assume, per rank: first op F(chunk 0, mb 0), last op B(chunk 0, mb M-1), M
    forwards and M backwards per chunk, and first_backward's prefix; all read off rank_order here."""
    for pp in range(1, 7):
        for m in range(1, 13):
            for v in ((2, 3) if schedule == "interleaved-1f1b" else (1,)):
                if v > 1 and (pp < 2 or m % pp):
                    continue
                for r in range(pp):
                    order = rank_order(schedule, pp, m, v, r)
                    assert order[0] == ("F", 0, 0) and order[-1] == ("B", 0, m - 1)
                    for c in range(v):
                        assert sum(1 for op in order if op[1] == c and op[0] == "F") == m
                        assert sum(1 for op in order if op[1] == c and op[0] == "B") == m
                    fb = next(i for i, op in enumerate(order) if op[0] == "B")
                    assert order[fb][2] == 0
                    before = [sum(1 for op in order[:fb] if op[1] == c) for c in range(v)]
                    assert first_backward(schedule, pp, m, v, r) == (before, order[fb][1])


class _ListedOps:
    """RankOps' methods read off the listed ops of rank_order (the reference)."""

    def __init__(self, schedule, pp, m, v, rank):
        self.ops = rank_order(schedule, pp, m, v, rank)
        self.pp = pp

    def __len__(self):
        return len(self.ops)

    def op(self, i):
        return self.ops[i]

    def forward_index(self, k):
        fwd = [i for i, op in enumerate(self.ops) if op[0] == "F"]
        return fwd[k]

    def first_backward_index(self):
        return next(i for i, op in enumerate(self.ops) if op[0] == "B")

    def last_forward_index(self):
        return max(i for i, op in enumerate(self.ops) if op[0] == "F")

    def counts(self, lo, hi):
        v = 1 + max(op[1] for op in self.ops)
        fc, bc = [0] * v, [0] * v
        for kind, c, _mb in self.ops[max(lo, 0):hi]:
            (fc if kind == "F" else bc)[c] += 1
        return fc, bc


def _small_shapes():
    for schedule in SCHEDULES:
        for pp in range(1, 7):
            for m in range(1, 13):
                for v in ((2, 3) if schedule == "interleaved-1f1b" else (1,)):
                    if v > 1 and (pp < 2 or m % pp):
                        continue
                    yield schedule, pp, m, v


def test_rank_ops_arithmetic_equals_the_listed_ops():
    """RankOps (ops by arithmetic) agrees with rank_order on every op, index and range count."""
    for schedule, pp, m, v in _small_shapes():
        for r in range(pp):
            fast, ref = RankOps(schedule, pp, m, v, r), _ListedOps(schedule, pp, m, v, r)
            n = len(ref)
            assert len(fast) == n
            assert [fast.op(i) for i in range(n)] == ref.ops
            assert fast.first_backward_index() == ref.first_backward_index()
            assert fast.last_forward_index() == ref.last_forward_index()
            for k in range(m * v):
                assert fast.forward_index(k) == ref.forward_index(k)
                # the backward of virtual micro-batch k (chunk V - 1 - c of the forward's (c, mb))
                c, mb = fast._unit(k)
                assert ref.ops[fast.backward_index(k)] == ("B", v - 1 - c, mb)
            for lo in range(0, n + 1, 3):
                for hi in range(lo, n + 1, 2):
                    assert fast.counts(lo, hi) == ref.counts(lo, hi), (schedule, pp, m, v, r, lo, hi)


def test_bound_paths_by_arithmetic_equal_those_of_the_listed_ops():
    """bound_paths over RankOps equals bound_paths over the listed ops, array by array."""
    for schedule, pp, m, v in _small_shapes():
        fast = bound_paths(schedule, pp, m, v)
        ref = bound_paths(schedule, pp, m, v, rank_ops=_ListedOps)
        for name in ("count", "coef_f", "coef_b", "coef_s", "coef_ar", "term_ptr", "term_idx",
                     "term_coef", "owner"):
            assert getattr(fast, name) == getattr(ref, name), (schedule, pp, m, v, name)


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 4), (3, 2), (3, 6), (4, 4), (4, 9), (5, 3)])
def test_fill_and_drain_terms_never_exceed_the_longest_path(comm_model, schedule, pp, m):
    """bounds.drain_coefficients: on random weights, every rank r and both pairs, S + kf F_r + kb B_r
    (S: every rank's forward and backward of one micro-batch) never exceeds the iteration time; on a
    uniform 1F1B pipeline without transfers the last rank's pair is the iteration time."""
    from poseidon_plugin.search.bounds import drain_coefficients
    coef = drain_coefficients(schedule, pp, m)
    assert len(coef) == pp
    sim = Simulator(schedule, pp, m, 1, comm_model)
    rng = random.Random(pp * 1000 + m * 10 + len(schedule))
    for _ in range(20):
        fwd = [rng.uniform(0, 5) for _ in range(pp)]
        bwd = [rng.uniform(0, 9) for _ in range(pp)]
        longest = sim.iteration_time(fwd, bwd, [rng.uniform(0, 2) for _ in range(pp)],
                                     [rng.uniform(0, 7) for _ in range(pp)])
        s = sum(fwd) + sum(bwd)
        for r in range(pp):
            for kf, kb in coef[r]:
                assert kf >= 0 and kb >= 0
                assert s + kf * fwd[r] + kb * bwd[r] <= longest * (1 + 1e-12)
    if schedule == "1f1b" and comm_model == "dag":
        longest = sim.iteration_time([1.0] * pp, [2.0] * pp, [0.0] * pp, [0.0] * pp)
        kf, kb = coef[pp - 1][1]
        assert 3.0 * pp + kf + 2.0 * kb == pytest.approx(longest, rel=1e-12)


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (3, 5), (4, 3), (5, 8)])
def test_fill_and_drain_paths_hold_their_sends_sync_and_blocking_waits(comm_model, schedule, pp, m):
    """bounds.drain_path_terms, checked per link: on random weights, both fill-and-drain paths of every
    rank r also hold every link's send twice and rank 0's all-reduce, and under megatron's blocking 1F1B
    the M - 1 transfers rank r waits for on each link to a neighbour; so S + kf F_r + kb B_r + 2 sum(sends)
    + AR_0 (+ (M - 1) (send_{r-1} + send_r)) never exceeds the iteration time. The bound prices each send
    at the piece's cheapest link, so this is the stronger statement."""
    from poseidon_plugin.search.bounds import BLOCKING_COMM_MODELS, drain_coefficients
    coef = drain_coefficients(schedule, pp, m)
    sim = Simulator(schedule, pp, m, 1, comm_model)
    rng = random.Random(pp * 1000 + m * 10 + len(schedule) + len(comm_model))
    for _ in range(20):
        fwd = [rng.uniform(0, 5) for _ in range(pp)]
        bwd = [rng.uniform(0, 9) for _ in range(pp)]
        send = [rng.uniform(0, 2) for _ in range(pp - 1)] + [0.0]     # V = 1: the last rank sends nothing
        ar = [rng.uniform(0, 7) for _ in range(pp)]
        longest = sim.iteration_time(fwd, bwd, send, ar)
        s = sum(fwd) + sum(bwd)
        for r in range(pp):
            waits = 0.0
            if comm_model in BLOCKING_COMM_MODELS and schedule == "1f1b":
                waits = (m - 1) * ((send[r - 1] if r > 0 else 0.0) + (send[r] if r < pp - 1 else 0.0))
            for kf, kb in coef[r]:
                got = s + kf * fwd[r] + kb * bwd[r] + 2 * sum(send) + ar[0] + waits
                assert got <= longest * (1 + 1e-12)


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 3), (5, 8), (4, 12), (6, 7)])
def test_the_path_through_the_later_ranks_twice_is_a_dag_path(comm_model, schedule, pp, m):
    """bounds.double_drain_coefficients: on random weights, for every rank r where it exists, S + kf F_r
    + kb B_r + L_r (L_r the later ranks' forwards and backwards), every link's send twice, rank 0's
    all-reduce and under megatron's blocking 1F1B min(kf, kb) - 1 waits on each link to a neighbour never
    exceed the iteration time; on 1F1B it exists where M exceeds rank r's warm-up by two, and on a
    uniform 1F1B pipeline of many micro-batches it beats both pairs of drain_coefficients on rank 0."""
    from poseidon_plugin.search.bounds import BLOCKING_COMM_MODELS, double_drain_coefficients, drain_coefficients
    double = double_drain_coefficients(drain_coefficients(schedule, pp, m))
    for r in range(pp):         # M - i forwards and j + 1 - M backwards of rank r's own order, i <= j
        ops = RankOps(schedule, pp, m, 1, r)
        i, j = ops.first_backward_index(), ops.last_forward_index()
        assert double[r] == ((m - i, j + 1 - m) if i <= j else None)
    sim = Simulator(schedule, pp, m, 1, comm_model)
    rng = random.Random(pp * 1000 + m * 10 + len(schedule) + len(comm_model) + 7)
    if schedule == "1f1b":
        # B(r, 0) comes before F(r, M-1) once M exceeds the w = pp - 1 - r warm-up forwards by two
        assert [double[r] is not None for r in range(pp)] == [m >= pp - r + 1 for r in range(pp)]
    for _ in range(30):
        fwd = [rng.uniform(0, 5) for _ in range(pp)]
        bwd = [rng.uniform(0, 9) for _ in range(pp)]
        send = [rng.uniform(0, 2) for _ in range(pp - 1)] + [0.0]
        ar = [rng.uniform(0, 7) for _ in range(pp)]
        longest = sim.iteration_time(fwd, bwd, send, ar)
        s = sum(fwd) + sum(bwd)
        for r in range(pp):
            if double[r] is None:
                continue
            kf, kb = double[r]
            assert kf >= 0 and kb >= 0
            waits = 0.0
            if comm_model in BLOCKING_COMM_MODELS and schedule == "1f1b":
                waits = max(0, min(kf, kb) - 1) * ((send[r - 1] if r > 0 else 0.0) + (send[r] if r < pp - 1 else 0.0))
            later = sum(fwd[r + 1:]) + sum(bwd[r + 1:])
            got = s + kf * fwd[r] + kb * bwd[r] + later + 2 * sum(send) + ar[0] + waits
            assert got <= longest * (1 + 1e-12)
    if schedule == "1f1b" and comm_model == "dag" and m >= 2 * pp:
        # later ranks 3x slower than rank 0: the path through them twice is the longer one
        fwd, bwd = [1.0] + [3.0] * (pp - 1), [2.0] + [6.0] * (pp - 1)
        s = sum(fwd) + sum(bwd)
        kf, kb = double[0]
        assert s + kf + 2 * kb + sum(fwd[1:]) + sum(bwd[1:]) > max(s + a + 2 * b for a, b in drain_coefficients(schedule, pp, m)[0])


def _cheapest_link_waits(table, counts, pp, m, schedule, comm_model):
    """bounds.blocking_waits as it was: every wait at the piece's cheapest link, whatever the type."""
    from poseidon_plugin.search.bounds import BLOCKING_COMM_MODELS
    active = [t for t in range(len(counts)) if min(counts[t], pp) > 0]
    stride = table.max_slots
    sends = ([table.send_cross_ms[t] for t in active] if len(active) > 1 else [])
    sends += [table.send_same_ms[t * stride + j] for t in active for j in range(min(counts[t], pp) - 1)]
    send = min(sends, default=0.0) if comm_model in BLOCKING_COMM_MODELS and schedule == "1f1b" else 0.0
    return [[(m - 1) * ((r > 0) + (r < pp - 1)) * send] * len(active) for r in range(pp)]


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
def test_positional_bound_with_each_types_waits_below_every_plan(comm_model, monkeypatch):
    """bounds.blocking_waits prices rank r's blocking waits by the links its type can have (a link is
    priced by its sender: ``send_cross`` where the types differ, ``send_same`` of the sender's slot
    where they match), not at the piece's cheapest link: on random one-chunk structures (random
    per-type and per-slot links) the structure's positional bound, fill and drain and waits included,
    never exceeds any of its plans that fit memory (brute force, the kernel's time under ``comm_model``);
    and under megatron's blocking 1F1B it is above the bound with the cheapest link's waits on some."""
    from poseidon_plugin.search import bounds
    checked = raised = 0
    for seed in range(400):
        table, shape, counts, num_layers = random_structure(31000 + seed, True)
        if shape.virtual_stages > 1 or shape.pp < 2 or shape.schedule != "1f1b":
            continue
        shape = ShapeData(shape.schedule, shape.pp, shape.micro_batches, 1, True, comm_model)
        plans = brute_force(table, shape, counts, num_layers)
        if not plans:
            continue
        args = (table, counts, shape.micro_batches, shape.pp, 1, num_layers, shape.live)
        kw = dict(schedule=shape.schedule, comm_model=comm_model)
        got = bounds.positional_bound(*args, **kw)
        assert got <= min(p[0] for p in plans) * (1 + 1e-9)
        checked += 1
        with monkeypatch.context() as mp:
            mp.setattr(bounds, "blocking_waits", _cheapest_link_waits)
            before = bounds.positional_bound(*args, **kw)
        assert before <= got * (1 + 1e-12)
        raised += got > before * (1 + 1e-6)
    assert checked >= 40
    assert (raised > 0) == (comm_model == "megatron")


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
def test_positional_bound_with_each_ranks_own_sync_below_every_plan(comm_model, monkeypatch):
    """The fill-and-drain paths ending at rank r's own gradient sync and optimizer step instead of the
    tail up to rank 0's (bounds.rank_sync_terms; in the relaxation the earlier ranks' backwards leave S,
    at most their caps'): on random one-chunk structures with a DP sync, the structure's bound never
    exceeds any of its plans, and it is above the bound without those paths on some."""
    from poseidon_plugin.search import bounds
    checked = raised = 0
    for seed in range(600):
        rng = random.Random(52000 + seed)
        nt, pp = rng.choice([1, 2, 2, 3]), rng.choice([2, 3, 4, 5])
        schedule, m = rng.choice(["1f1b", "eager-1f1b", "gpipe"]), rng.choice([2, 4, 8])
        num_layers = rng.randint(pp, pp + 3)
        counts = [0] * nt
        for _ in range(pp):
            counts[rng.randrange(nt)] += 1
        table = random_table(rng, nt, 2, [max(1, c) for c in counts])
        shape = ShapeData(schedule, pp, m, 1, True, comm_model)
        args = (table, counts, m, pp, 1, num_layers, shape.live)
        kw = dict(schedule=schedule, comm_model=comm_model)
        got = bounds.positional_bound(*args, **kw)
        with monkeypatch.context() as mp:
            mp.setattr(bounds, "rank_sync_terms", lambda tb, c, n: ([0.0] * len(c), [0.0] * len(c)))
            before = bounds.positional_bound(*args, **kw)
        assert before <= got * (1 + 1e-12)
        if got > before * (1 + 1e-6):
            raised += 1
        elif seed % 4:
            continue                # the brute force on every raised structure and a quarter of the rest
        plans = brute_force(table, shape, counts, num_layers)
        if plans:
            assert got <= min(p[0] for p in plans) * (1 + 1e-9)
            checked += 1
    assert raised > 0 and checked >= 60


@pytest.mark.parametrize("comm_model", ["dag", "megatron"])
def test_positional_bound_with_the_double_path_below_every_plan(comm_model, monkeypatch):
    """The positional bound's path through the later ranks twice (bounds.double_drain_coefficients; in
    the relaxation T - 2 S + E_r >= (kf - 1) F_r + (kb - 1) B_r, S at least the relaxation's least S,
    E_r the earlier positions' work at most their caps'): on random one-chunk structures of every V = 1
    schedule, deeper and with more micro-batches than the other brute forces, the structure's bound
    never exceeds any of its plans that fit memory, and it is above the bound without that path on
    some."""
    from poseidon_plugin.search import bounds
    checked = raised = 0
    for seed in range(300):
        rng = random.Random(47000 + seed)
        nt = rng.choice([1, 2, 2, 3])
        pp = rng.choice([3, 4, 5])
        schedule = rng.choice(["1f1b", "1f1b", "eager-1f1b", "gpipe"])
        m = rng.choice([4, 8, 12])
        num_layers = rng.randint(pp, pp + 3)
        counts = [0] * nt
        for _ in range(pp):
            counts[rng.randrange(nt)] += 1
        table = random_table(rng, nt, rng.choice([1, 2]), [max(1, c) for c in counts])
        shape = ShapeData(schedule, pp, m, 1, True, comm_model)
        plans = brute_force(table, shape, counts, num_layers)
        if not plans:
            continue
        args = (table, counts, m, pp, 1, num_layers, shape.live)
        kw = dict(schedule=schedule, comm_model=comm_model)
        got = bounds.positional_bound(*args, **kw)
        assert got <= min(p[0] for p in plans) * (1 + 1e-9)
        checked += 1
        with monkeypatch.context() as mp:
            mp.setattr(bounds, "double_drain_coefficients", lambda coef: [None] * len(coef))
            before = bounds.positional_bound(*args, **kw)
        assert before <= got * (1 + 1e-12)
        raised += got > before * (1 + 1e-6)
    assert checked >= 150 and raised > 0


@pytest.mark.parametrize("comm_model", ["dag", "megatron", "megatron-overlap"])
@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 4, 2), (3, 6, 2), (4, 8, 2), (4, 4, 3), (3, 9, 3),
                                    (5, 10, 2), (4, 16, 2)])
def test_interleaved_fill_and_drain_path_never_exceeds_the_longest_path(comm_model, pp, m, v):
    """bounds.interleaved_drain_counts: on random weights, for every rank r the earlier ranks' chunk-0
    forward and backward, the later ranks' chunk V - 1, rank r's ops at its counts, every link crossed
    twice and rank 0's all-reduce never exceed the iteration time (a path of every comm model's DAG);
    rank r's counts hold all its M forwards per chunk and its last backward."""
    from poseidon_plugin.search.bounds import interleaved_drain_counts
    counts = interleaved_drain_counts("interleaved-1f1b", pp, m, v)
    sim = Simulator("interleaved-1f1b", pp, m, v, comm_model)
    rng = random.Random(pp * 1000 + m * 10 + v + len(comm_model))
    for r in range(pp):
        kf, kb = counts[r]
        assert kf == [m] * v and kb[0] >= 1 and all(0 <= x <= m for x in kb)
    for _ in range(30):
        fwd = [rng.uniform(0, 5) for _ in range(pp * v)]      # rank * V + chunk
        bwd = [rng.uniform(0, 9) for _ in range(pp * v)]
        send = [rng.uniform(0, 2) for _ in range(pp)]
        ar = [rng.uniform(0, 7) for _ in range(pp)]
        longest = sim.iteration_time(fwd, bwd, send, ar)
        for r in range(pp):
            kf, kb = counts[r]
            own = sum(kf[c] * fwd[r * v + c] + kb[c] * bwd[r * v + c] for c in range(v))
            others = (sum(fwd[i * v] + bwd[i * v] for i in range(r))
                      + sum(fwd[i * v + v - 1] + bwd[i * v + v - 1] for i in range(r + 1, pp)))
            assert own + others + 2 * sum(send[:pp - 1]) + ar[0] <= longest * (1 + 1e-12)


def test_placement_shortcut_never_changes_a_decision(monkeypatch):
    """StructureBounds._others_fit skips a pair of placement bounds (and their rounding losses) when
    the pair's mean-slope bound without its loss fits: the searches with and without the shortcut
    give the same plans and counters, and the shortcut does skip loss computations."""
    from poseidon_plugin.search import structure_bounds as bounds_mod
    calls = [0]
    gammas = bounds_mod.StructureBounds._rounding_losses

    def counted(self, *args):
        calls[0] += 1
        return gammas(self, *args)

    monkeypatch.setattr(bounds_mod.StructureBounds, "_rounding_losses", counted)
    seen = {True: 0, False: 0}
    structures = 0
    for seed in range(400):
        table, shape, counts, num_layers = random_structure(9000 + seed, True)
        if shape.virtual_stages == 1:
            continue
        structures += 1
        cls = array("i", range(len(counts)))
        results = {}
        for shortcut in (True, False):
            monkeypatch.setattr(bounds_mod, "FIT_SLACK", 1e-12 if shortcut else math.inf)
            ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False, type_class=cls)
            before = calls[0]
            results[shortcut] = [ss.run(counts, tau) for tau in (math.inf, 60.0, 20.0, 5.0)]
            seen[shortcut] += calls[0] - before
        for a, b in zip(results[True], results[False]):
            assert (a.time_ms, a.types, a.layers, a.counters) == (b.time_ms, b.types, b.layers, b.counters)
    assert structures >= 50
    assert seen[True] < seen[False], seen


def test_fill_over_the_fitting_types_is_tighter_and_below_every_fitting_completion():
    """SplitSearch._fill with the node's per-type caps prices an undecided rank over the types whose
    caps hold its lower bounds: never below the fill over all types, above it somewhere, and never
    above a completion that gives each undecided rank such a type with at least its lower bounds."""
    raised = checked = 0
    for seed in range(300):
        table, shape, counts, num_layers = random_structure(7000 + seed, True)
        pp, v, nt = shape.pp, shape.virtual_stages, len(counts)
        rng = random.Random(seed)
        ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                           type_class=array("i", range(nt)))
        free = [t for t in range(nt) for _ in range(counts[t])]
        rng.shuffle(free)
        lb = [rng.randint(1, 3) for _ in range(pp * v)]
        capt = [rng.randint(0, 4) for _ in range(pp * v * nt)]
        undecided = [-1] * pp
        plain = ss.bound_params(counts, undecided, [0] * (pp * v), lb)
        tight = ss.bound_params(counts, undecided, [0] * (pp * v), lb, capt)
        assert all(x <= y for x, y in zip(plain, tight))
        raised += any(x < y for x, y in zip(plain, tight))
        # a completion: each rank a type of the shuffled pool that fits it (if every rank has one)
        types = []
        for r in range(pp):
            fit = [t for t in free if all(capt[(c * pp + r) * nt + t] >= lb[c * pp + r] for c in range(v))]
            if not fit:
                break
            types.append(fit[0])
            free.remove(fit[0])
        if len(types) < pp:
            continue
        checked += 1
        exact = ss.bound_params(counts, types, lb, lb)        # every rank decided, at its lower bounds
        for i in range(1, 1 + 2 * pp * v):                   # forward and backward ms
            assert tight[i] <= exact[i] + 1e-9, (seed, i)
    assert raised > 0 and checked > 50, (raised, checked)


def _decide_from_end(ss, counts, types, layers, b, pp, v):
    """Search state with ranks b..pp-1 decided as in (types, layers), as the backward order decides
    them (slots from the top of each type); the undecided ranks are [0, b). Returns the layers left."""
    ss.remaining, ss.used, ss.hi = list(counts), [0] * len(counts), list(counts)
    ss.types, ss.layers = [-1] * pp, [0] * (pp * v)
    ss.ub = b
    for r in range(pp - 1, b - 1, -1):
        t = types[r]
        ss.hi[t] -= 1
        ss.types[r], ss.slot[r] = t, ss.hi[t]
        ss.remaining[t] -= 1
        for c in range(v):
            ss.layers[c * pp + r] = layers[c * pp + r]
    return ss.num_layers - sum(ss.layers)


@pytest.mark.parametrize("seed", range(80))
def test_bounds_from_the_end_and_the_path_gain_never_exceed_a_completion(seed):
    """Ranks decided from the end (the backward order) or in pipeline order, at random depths of random
    structures, tau just above the best completion: the propagation over the undecided ranks keeps
    every completion that beats tau within [lb, cap] and its type caps, and the DAG bound plus the gain
    along its longest path (``_count_gain``: the remaining types at their counts, the extra layers at
    their least slope on that path) is at most the best completion."""
    case = _searched_structure(seed)
    if case is None:
        pytest.skip("no plan, or one rank")
    plans, counts, pp, v, nt, rng, ss = case
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        backward = rng.random() < 0.6
        if backward:
            b = rng.randrange(1, pp + 1)            # ranks b.. decided
            a = 0
            keep = range(b, pp)
            left = _decide_from_end(ss, counts, types, layers, b, pp, v)
        else:
            a = rng.randrange(pp)                   # ranks ..a-1 decided
            b = pp
            keep = range(a)
            ss.ub = pp
            ss.hi = list(counts)
            left = _decide(ss, counts, types, layers, a, pp, v)
        completions = [p for p in plans if all(p[1][r] == types[r] for r in keep)
                       and all(p[2][c * pp + r] == layers[c * pp + r] for r in keep for c in range(v))]
        best = min(p[0] for p in completions)
        tau = best * (1 + 1e-9) + 1e-12
        ss.tau = tau
        lb, cap, capt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        assert propagate(ss, a, left, lb, cap, capt)
        _assert_within([p for p in completions if p[0] < tau], range(a, b), pp, v, lb, cap, capt)
        ss._fill(lb, capt)
        val = ss.kernel.longest(ss.params)
        gain = ss._count_gain(a, b, lb, cap, capt, left - ss._lb_sum(a, b, lb), math.inf)
        assert gain >= 0.0
        assert val + gain <= best * (1 + 1e-9)


def _searches_with_and_without(method: str, off, seeds):
    """Per random structure of ``seeds`` and branching order: the search with its ``method`` and with
    ``off`` in its place, as ``(optimum, with, without)`` results."""
    for seed in seeds:
        case = _searched_structure(seed)
        if case is None:
            continue
        plans, counts, pp, v, nt, _rng, ss = case
        for backward in (False, True):
            got = []
            for replaced in (False, True):
                search = PySplitSearch(ss.table, ss.shape, ss.num_layers, ridge=False, blocks=False,
                                       type_class=array("i", range(nt)), backward=backward)
                if replaced:
                    setattr(search, method, off)
                got.append(search.run(counts, math.inf))
            yield min(p[0] for p in plans), got[0], got[1]


def _nodes_cut_by(method: str, off) -> int:
    """Nodes that the search's ``method`` cuts on the random structures (seeds 0-59, both branching
    orders): searched with it and with ``off`` in its place, both find the optimum, and the search with
    it visits a subset of the other's nodes (a cut subtree holds no plan below tau, so tau falls alike)."""
    from poseidon_plugin.search import splits
    cut = 0
    for best, on, without in _searches_with_and_without(method, off, range(60)):
        assert on.time_ms == without.time_ms == best
        assert on.counters[splits.NODES] <= without.counters[splits.NODES]
        cut += without.counters[splits.NODES] - on.counters[splits.NODES]
    return cut


def test_path_gain_cuts_nodes_the_dag_bound_keeps():
    """On random structures the gain along the bound's longest path cuts some children the DAG bound
    alone keeps (it is not vacuous), and the searches still find the same optimum."""
    assert _nodes_cut_by("_count_gain", lambda *a: 0.0) > 0


def test_joint_gain_cuts_nodes_the_separate_gain_keeps():
    """The joint bound of the gain (the layer sum relaxed, the type assignment exact) cuts children
    that the separate bounds keep, on some random structures, and the optimum stays the same."""
    assert _nodes_cut_by("_joint_gain", lambda *a: -math.inf) > 0


def test_links_to_decided_ranks_cut_nodes_the_plain_link_bound_keeps():
    """A link between an undecided rank and a decided one is priced by the types the undecided end can
    still take (`_any_link`: a cross-type link where the decided end's type has no rank left; without
    it such a link has no bound), and the gain charges each remaining type its own link to its decided
    neighbours: each cuts nodes on random structures that the search without it keeps, and the optimum
    stays the same."""
    for method, off in (("_any_link", lambda s, n, a, b: math.inf), ("_send_gain", lambda r, x, cnt: 0.0)):
        on, without = _nodes_with_and_without(method, off, range(200))
        assert on < without, (method, on, without)


def test_type_boundaries_cut_nodes_the_gain_keeps():
    """The links between two undecided ranks carry at least one type boundary fewer than the remaining
    types (``_boundary_gain``, one-chunk trees): with it the searches of random structures visit fewer
    nodes than without it, and find the same optimum."""
    on, without = _nodes_with_and_without("_boundary_gain", lambda a, b, cnt: 0.0, range(200))
    assert on < without, (on, without)


def test_type_boundaries_never_exceed_a_completion():
    """Ranks decided from the end at random depths of random one-chunk structures, random counts on the
    links between undecided ranks: what ``_boundary_gain`` adds is at most what every completion's own
    links there add over the fill's lower bounds along those counts; and it adds something in some cases."""
    positive = 0
    for seed in range(40):
        case = _searched_structure(seed)
        if case is None or case[3] != 1 or case[2] < 3:
            continue                                # no plan, interleaved, or no link between two undecided ranks
        plans, counts, pp, _v, nt, rng, ss = case
        for _ in range(6):
            _t, types, layers = rng.choice(plans)
            b = rng.randrange(2, pp + 1)            # ranks b.. decided, [0, b) undecided
            _decide_from_end(ss, counts, types, layers, b, pp, 1)
            lb = [1] * pp
            ss._fill(lb, [ss.num_layers] * (pp * nt))
            fill = list(ss.params)
            cnt = array("i", [0]) * len(ss.params)
            for r in range(b - 1):
                cnt[1 + 2 * pp + r] = rng.randint(0, 40)
            gain = ss._boundary_gain(0, b, cnt)
            positive += gain > 0.0
            completions = [p for p in plans
                           if all(p[1][r] == types[r] and p[2][r] == layers[r] for r in range(b, pp))]
            for _time, ctypes, clayers in completions:
                exact = ss.bound_params(counts, ctypes, clayers, lb)
                paid = sum(cnt[1 + 2 * pp + r] * (exact[1 + 2 * pp + r] - fill[1 + 2 * pp + r])
                           for r in range(b - 1))
                assert gain <= paid + 1e-9, (seed, gain, paid, ctypes)
                _decide_from_end(ss, counts, types, layers, b, pp, 1)
    assert positive > 0


def slow_type_structure(seed: int, pp: int):
    """A 1F1B pipeline of ``pp`` ranks over a fast, a middling and a slow type (one or two slow ranks,
    about four times slower: they hold one layer each and set the steady state), 16-32 micro-batches,
    layers for about four per fast rank and three per middling one, pure backend: the shape of the
    sweep's hard one-chunk proofs, scaled down. ``(table, shape, counts, num_layers)``."""
    rng = random.Random(seed)
    m = rng.choice([16, 24, 32])
    slow = rng.choice([1, 2])
    mid = rng.randint(1, pp - slow - 1)
    counts = [pp - slow - mid, mid, slow]
    num_layers = 4 * counts[0] + 3 * counts[1] + counts[2] - rng.randint(0, 2)
    nt, s = 3, max(counts)
    fwd = array("d", [1.0, rng.uniform(1.1, 1.3), rng.uniform(3.0, 4.5)])
    const = lambda x, n=nt: array("d", [x] * n)  # noqa: E731
    table = TypeTable(
        tp=1, mbs=1, dp=1, names=("fast", "mid", "slow"), slots=array("i", counts), max_slots=s,
        forward_ms=fwd, backward_ms=array("d", [f * 2.0 for f in fwd]), embedding_forward_ms=const(.1),
        embedding_backward_ms=const(.2), head_forward_ms=const(.5), head_backward_ms=const(1.0),
        allreduce_ms=const(0, nt * s), embedding_allreduce_ms=const(0, nt * s), head_allreduce_ms=const(0, nt * s),
        has_allreduce=array("i", [0] * (nt * s)),
        send_same_ms=array("d", [rng.uniform(.05, .2) for _ in range(nt * s)]), send_wrap_ms=const(.1, nt * s),
        send_cross_ms=array("d", [rng.uniform(.2, .4) for _ in range(nt)]), layer_state_bytes=const(1),
        layer_activation_bytes=const(.01), embedding_state_bytes=const(.5), embedding_activation_bytes=const(.01),
        head_state_bytes=const(.5), head_activation_bytes=const(.01), usable_bytes=const(40),
        step_forward_ms=const(0), step_backward_ms=const(0), optimizer_ms=const(0), optimizer_fixed_ms=const(0))
    return table, ShapeData("1f1b", pp, m, 1, True), counts, num_layers


@pytest.mark.parametrize("seed", range(8))
def test_owner_caps_never_exclude_a_completion_of_a_slow_type_pipeline(seed, monkeypatch):
    """On the slow-type pipelines (where the owner caps' links and per-stage slopes cut: below), ranks
    decided from the end at random depths, tau just above the best completion: every completion that
    beats tau stays within the propagated [lb, cap] and its type caps, and the search at that tau finds
    the brute force's optimum (the placement by stage kept on throughout)."""
    from poseidon_plugin.search import structure_bounds
    monkeypatch.setattr(structure_bounds, "STAGE_TRIAL", 10 ** 9)
    table, shape, counts, num_layers = slow_type_structure(seed, 5)
    plans = brute_force(table, shape, counts, num_layers)
    assert plans
    pp, nt = shape.pp, len(counts)
    ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False, type_class=array("i", range(nt)),
                       backward=True)
    best = min(p[0] for p in plans)
    assert ss.run(counts, best * (1 + 1e-9)).time_ms == best
    rng = random.Random(seed)
    for _ in range(8):
        _t, types, layers = rng.choice(plans)
        b = rng.randrange(1, pp + 1)
        left = _decide_from_end(ss, counts, types, layers, b, pp, 1)
        completions = [p for p in plans if all(p[1][r] == types[r] and p[2][r] == layers[r] for r in range(b, pp))]
        ss.tau = min(p[0] for p in completions) * (1 + 1e-9) + 1e-12
        lb, cap, capt = [0] * pp, [0] * pp, [0] * (pp * nt)
        assert propagate(ss, 0, left, lb, cap, capt)
        _assert_within([p for p in completions if p[0] < ss.tau], range(b), pp, 1, lb, cap, capt)


def test_owner_caps_see_the_owners_links_and_each_ranks_slope(monkeypatch):
    """An undecided rank's own path caps it per type (``_owner_caps``): priced with the links that
    type pays into and out of the rank (``_owner_link_gain``: a cross-type or a same-type link, once
    per micro-batch on the owner's steady state), with the other ranks' layers at each stage's own
    slope within its room (``_others_knapsack``: the owner's path weighs its upstream ranks once and
    its downstream ranks twice, and the placement bounds price a type's layers at its cheapest rank),
    and at each stage's slope on each type within the type's room (``_others_by_stage``). Each cuts
    nodes that the search without it keeps, proving the optimum of slow-type pipelines, and every
    search finds the same optimum (the placement by stage kept on throughout: its rule is tested below)."""
    from poseidon_plugin.search import splits, structure_bounds
    monkeypatch.setattr(structure_bounds, "STAGE_TRIAL", 10 ** 9)

    def search(structure):
        table, shape, _counts, num_layers = structure
        return PySplitSearch(table, shape, num_layers, ridge=False, blocks=False, type_class=array("i", range(3)),
                             backward=True)

    # per structure: its optimum, and the nodes that prove it with every bound on
    structures = [slow_type_structure(seed, 5 + seed % 3) for seed in range(10, 22)]
    proofs = []
    for structure in structures:
        counts = structure[2]
        best = search(structure).run(counts, math.inf).time_ms
        res = search(structure).run(counts, best * (1 + 1e-9))
        assert res.time_ms == best
        proofs.append((best, res.counters[splits.NODES]))
    for method, off in (("_owner_link_gain", lambda q, r, t: 0.0),
                        ("_others_knapsack", lambda k, r, e, lb, cap: 0.0),
                        ("_others_by_stage", lambda k, r, t2, e, lb, capt, n_left: -math.inf)):
        without = 0
        for structure, (best, _nodes) in zip(structures, proofs):
            ss = search(structure)
            setattr(ss, method, off)
            res = ss.run(structure[2], best * (1 + 1e-9))
            assert res.time_ms == best
            without += res.counters[splits.NODES]
        assert sum(nodes for _best, nodes in proofs) < without, (method, without)


def test_the_placement_by_stage_is_kept_while_it_rejects_counts(monkeypatch):
    """After ``STAGE_TRIAL`` calls a structure search computes the owner caps' placement by stage only
    while it rejects at least one count in ``STAGE_MIN_CUTS``: proving a slow-type pipeline's optimum
    keeps it past the trial; where no rate is enough (``STAGE_MIN_CUTS`` 0) it stops at the trial,
    and the search still proves the same optimum."""
    from poseidon_plugin.search import structure_bounds
    table, shape, counts, num_layers = slow_type_structure(11, 6)

    def search():
        return PySplitSearch(table, shape, num_layers, ridge=False, blocks=False, type_class=array("i", range(3)),
                             backward=True)

    best = search().run(counts, math.inf).time_ms
    kept = search()
    assert kept.run(counts, best * (1 + 1e-9)).time_ms == best
    calls, cuts = kept.stage_stats()
    assert calls > structure_bounds.STAGE_TRIAL and cuts * structure_bounds.STAGE_MIN_CUTS >= calls
    monkeypatch.setattr(structure_bounds, "STAGE_MIN_CUTS", 0)
    stopped = search()
    assert stopped.run(counts, best * (1 + 1e-9)).time_ms == best
    assert stopped.stage_stats()[0] == structure_bounds.STAGE_TRIAL


def _nodes_with_and_without(method: str, off, seeds) -> tuple[int, int]:
    """Nodes of the searches of the random structures (``seeds``, both branching orders) with the
    search's ``method`` and with ``off`` in its place; both find the optimum. (Not a subset structure by
    structure: the gain is taken along the bound's own longest path, which a tighter fill can move.)"""
    from poseidon_plugin.search import splits
    totals = [0, 0]
    for best, on, without in _searches_with_and_without(method, off, seeds):
        assert on.time_ms == without.time_ms == best
        totals[0] += on.counters[splits.NODES]
        totals[1] += without.counters[splits.NODES]
    return totals[0], totals[1]


@pytest.mark.parametrize("seed", range(40))
def test_links_to_decided_ranks_never_exceed_a_completion(seed):
    """Ranks decided from the end at random depths: the fill's lower bound of the link from the last
    undecided rank into the first decided one is at most that link in every completion, and the gain's
    link terms per type are at most what a completion giving the rank that type pays on the path."""
    case = _searched_structure(seed)
    if case is None:
        pytest.skip("no plan, or one rank")
    plans, counts, pp, v, nt, rng, ss = case
    nv = pp * v
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        b = rng.randrange(1, pp)                    # ranks b.. decided, [0, b) undecided
        _decide_from_end(ss, counts, types, layers, b, pp, v)
        completions = [p for p in plans if all(p[1][r] == types[r] for r in range(b, pp))
                       and all(p[2][c * pp + r] == layers[c * pp + r] for r in range(b, pp) for c in range(v))]
        lb = [1] * nv
        ss._fill(lb, [ss.num_layers] * (nv * nt))
        link = ss.params[1 + 2 * nv + b - 1]
        cnt = array("i", [0]) * len(ss.params)
        cnt[1 + 2 * nv + b - 1] = 1
        for _time, ctypes, clayers in completions:
            exact = ss.bound_params(counts, ctypes, clayers, lb)
            assert link <= exact[1 + 2 * nv + b - 1] + 1e-12
            _decide_from_end(ss, counts, types, layers, b, pp, v)
            ss._fill(lb, [ss.num_layers] * (nv * nt))
            assert ss.params[1 + 2 * nv + b - 1] + ss._send_gain(b - 1, ctypes[b - 1], cnt) \
                <= exact[1 + 2 * nv + b - 1] + 1e-12


@pytest.mark.parametrize("comm_model", ["dag", "megatron", "megatron-overlap"])
@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 3, 5, 1), ("gpipe", 4, 3, 1), ("eager-1f1b", 2, 4, 1),
                                             ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 3, 6, 2)])
def test_critical_counts_are_a_longest_path_in_both_kernels(comm_model, schedule, pp, m, v):
    """``critical_counts`` after a run: the parameters it counts sum to the longest path, and the
    compiled kernel (packed, folded nodes) counts exactly what the pure twin counts on the unpacked
    graph."""
    from poseidon_plugin.simulator.core import cached_graph, make_kernel
    if comm_model == "megatron-overlap" and v == 1:
        pytest.skip("overlap is for interleaved schedules")
    graph = cached_graph(schedule, pp, m, v, comm_model)
    kernels = [make_kernel(graph, True)] + ([] if PURE_FORCED else [make_kernel(graph, False)])
    rng = random.Random(pp * 100 + m)
    for _ in range(20):
        params = array("d", [0.0] + [rng.uniform(0.0, 3.0) for _ in range(kernels[0].n_params - 1)])
        got = []
        for kern in kernels:
            longest = kern.longest(params)
            cnt = kern.critical_counts(params)
            assert sum(c * x for c, x in zip(cnt, params)) == pytest.approx(longest, rel=1e-12)
            got.append(cnt)
        assert all(g == got[0] for g in got)


def _relaxation_case(seed: int) -> int | None:
    """The relaxation bound (``RelaxationBound._relaxation_bound``, docs/SEARCH.md): ranks decided from the
    end or in pipeline order at random depths of random structures, tau just above the best completion:
    the bound never exceeds the best completion, whatever it is asked to reach. Returns how many nodes
    it bounded above their DAG bound (None: no case)."""
    case = _searched_structure(seed)
    if case is None:
        return None
    plans, counts, pp, v, nt, rng, ss = case
    ss._lp_alloc()                      # (the search allocates it on the first node that needs it)
    above = 0
    for _ in range(6):
        _t, types, layers = rng.choice(plans)
        if rng.random() < 0.5:
            b = rng.randrange(1, pp + 1)
            a = 0
            keep = range(b, pp)
            left = _decide_from_end(ss, counts, types, layers, b, pp, v)
        else:
            a = rng.randrange(pp)
            b = pp
            keep = range(a)
            ss.ub = pp
            ss.hi = list(counts)
            left = _decide(ss, counts, types, layers, a, pp, v)
        completions = [p for p in plans if all(p[1][r] == types[r] for r in keep)
                       and all(p[2][c * pp + r] == layers[c * pp + r] for r in keep for c in range(v))]
        best = min(p[0] for p in completions)
        ss.tau = best * (1 + 1e-9) + 1e-12
        lb, cap, capt = [0] * (pp * v), [0] * (pp * v), [0] * (pp * v * nt)
        assert propagate(ss, a, left, lb, cap, capt)
        ss._fill(lb, capt)
        dag = ss.kernel.longest(ss.params)
        k = pp - (b - a)                 # the node's depth: its parent's kept rows are those of k - 1
        for need in (ss.tau * (1 + 1e-9), best * 1.05, best * 2.0):
            if k > 0:
                _plant_rows(ss, k - 1, rng)
            got = ss._relaxation_bound(k, a, b, left, lb, cap, capt, need)
            assert got <= best * (1 + 1e-9) + 1e-9, (seed, need, got, best)
            above += got > dag * (1 + 1e-9)
            _assert_kept_rows_are_paths(ss, k, rng)
            if got < need:
                _assert_fixed_bounds_hold(ss, k, rng.randrange(a, b), a, b, completions, got, lb, cap, capt)
    return above


FIXED = {"checked": 0, "stronger": 0, "tightened": 0}
"""What :func:`_assert_fixed_bounds_hold` saw: children's bounds checked, and above their node's bound."""


def _assert_fixed_bounds_hold(ss, k, r, a, b, completions, node_bound, lb, cap, capt):
    """``_lp_fix``: the node's program with rank ``r`` fixed to a type and a layer count never exceeds the
    best completion of the node that gives ``r`` that type and count; the bounds it tightens for the
    other ranks keep every completion below tau."""
    pp, v, nt = ss.pp, ss.v, ss.nt
    lb2, capt2 = array("i", lb), array("i", capt)
    ss._lp_fix(k, r, a, b, lb2, capt2)
    if not ss.lp_fixed[k]:
        return
    below = [p for p in completions if p[0] < ss.tau * (1 + PATH_SLACK)]
    assert below                        # tau is just above the best completion
    _assert_within(below, [s for s in range(a, b) if s != r], pp, v, lb2, cap, capt2)
    FIXED["tightened"] += lb2 != array("i", lb) or capt2 != array("i", capt)
    width = ss.num_layers + 1
    for t in range(nt):
        lo, hi = ss.lp_fix_lo[k * nt + t], ss.lp_fix_hi[k * nt + t]
        for l in range(lo, hi + 1) if lo >= 0 else ():
            bound = ss.lp_fix_val[(k * nt + t) * width + l]
            assert bound >= node_bound - 1e-9 * (1 + abs(node_bound))      # a restriction of the node's
            times = [p[0] for p in completions
                     if p[1][r] == t and sum(p[2][c * pp + r] for c in range(v)) == l]
            if times:
                assert bound <= min(times) * (1 + 1e-9) + 1e-9, (k, r, t, l, bound, min(times))
                FIXED["checked"] += 1
                FIXED["stronger"] += bound > node_bound * (1 + 1e-9)


def _plant_rows(ss, k, rng):
    """Rows kept at depth ``k`` as a parent would leave them, here any DAG paths: the critical paths of
    the DAG at random parameters (the node takes those its program's point violates)."""
    npar = ss.n_par
    n = rng.randrange(LP_KEEP + 1)
    for q in range(n):
        params = array("d", [0.0] + [rng.uniform(0.0, 3.0) for _ in range(npar - 1)])
        cnt = ss.kernel.critical_counts(params)
        for i in range(npar):
            ss.lp_pool[(k * LP_KEEP + q) * npar + i] = cnt[i]
    ss.lp_kept[k] = n


def _assert_kept_rows_are_paths(ss, k, rng):
    """What a node keeps for its children are rows of its program: DAG paths (at any parameters no
    longer than the longest path), at most LP_KEEP."""
    npar = ss.n_par
    assert 0 <= ss.lp_kept[k] <= LP_KEEP
    params = array("d", [0.0] + [rng.uniform(0.0, 3.0) for _ in range(npar - 1)])
    longest = ss.kernel.longest(params)
    for q in range(ss.lp_kept[k]):
        cnt = ss.lp_pool[(k * LP_KEEP + q) * npar:(k * LP_KEEP + q + 1) * npar]
        assert any(cnt)
        assert sum(c * x for c, x in zip(cnt, params)) <= longest * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(80))
def test_relaxation_bound_never_exceeds_a_completion(seed):
    if _relaxation_case(seed) is None:
        pytest.skip("no plan, or one rank")


def test_the_fixed_bounds_are_above_their_nodes_bound_and_tighten_somewhere():
    """Not vacuous: the bounds of fixed options from a node's program (``_lp_fix``) are checked against
    completions, some are above the node's own bound, and some tighten the other ranks' bounds."""
    for seed in range(80):
        _relaxation_case(seed)
    assert FIXED["checked"] > 0 and FIXED["stronger"] > 0 and FIXED["tightened"] > 0


def test_relaxation_bound_is_above_the_dag_bound_somewhere():
    """Not vacuous: on some random nodes the relaxation bound is above the node's own DAG bound."""
    assert sum(_relaxation_case(seed) or 0 for seed in range(40)) > 0


def _interleaved_structure(first_seed: int):
    """The first random structure from ``first_seed`` on that is interleaved, has at least 3 ranks and a
    plan: ``(table, shape, counts, num_layers, best)``, ``best`` its optimum by brute force."""
    for trial in range(200):
        table, shape, counts, num_layers = random_structure(first_seed + trial, pure=True)
        if shape.virtual_stages > 1 and shape.pp >= 3:
            plans = brute_force(table, shape, counts, num_layers)
            if plans:
                return table, shape, counts, num_layers, min(p[0] for p in plans)
    raise AssertionError(f"no interleaved structure with a plan from seed {first_seed}")


def _search_at_its_optimum(watched, table, shape, counts, num_layers, best, **options) -> None:
    """Search the structure with the pure ``SplitSearch`` subclass ``watched`` just above its optimum
    ``best``: it finds it."""
    ss = watched(table, shape, num_layers, ridge=False, blocks=False, type_class=array("i", range(len(counts))),
                 **options)
    assert ss.run(counts, best * (1 + 1e-7)).time_ms == best


def _inheritance_case(seed: int) -> int:
    """A node's program takes the rows that bound its parent's program (``lambda > 0``, docs/SEARCH.md)
    where its point violates them, before running the DAG: searching an interleaved structure at its
    optimum, the result is the brute force's, and every row taken is one the parent kept, violated at the
    program's point. Returns how many rows were taken."""
    rng = random.Random(seed)
    table, shape, counts, num_layers, best = _interleaved_structure(5000 + 200 * seed)
    taken = []

    class Watched(PySplitSearch):
        def _lp_take_kept(self, k, q_new, value):
            npar = self.n_par
            kept = [list(self.lp_pool[((k - 1) * LP_KEEP + q) * npar:((k - 1) * LP_KEEP + q + 1) * npar])
                    for q in range(self.lp_kept[k - 1])] if k > 0 else []
            used = list(self.lp_pool_used)
            took = PySplitSearch._lp_take_kept(self, k, q_new, value)
            if took:
                row = list(self.lp_cnt[q_new * npar:(q_new + 1) * npar])
                flipped = [q for q in range(LP_KEEP) if self.lp_pool_used[q] != used[q]]
                assert len(flipped) == 1 and flipped[0] < len(kept) and not used[flipped[0]]
                assert row == kept[flipped[0]]
                assert sum(c * x for c, x in zip(row, self.lp_point)) > value
                taken.append(flipped[0])
            return took

    _search_at_its_optimum(Watched, table, shape, counts, num_layers, best, backward=rng.random() < 0.5)
    return len(taken)


@pytest.mark.parametrize("seed", range(12))
def test_a_child_takes_only_violated_rows_its_parent_kept(seed):
    _inheritance_case(seed)


def test_children_take_rows_their_parent_kept_somewhere():
    """Not vacuous: some programs of those searches take rows their parent kept."""
    assert sum(_inheritance_case(seed) for seed in range(12)) > 0



def test_the_dual_simplex_breaks_degenerate_ties_to_the_largest_entry():
    """Two entering columns at the ratio 0 (reduced costs 0, the degenerate case that cycles): the one
    whose entry in the leaving row is the largest in magnitude enters, not the first."""
    case = _searched_structure(5)
    assert case is not None
    ss = case[6]
    ss._lp_alloc()
    # rows: the appended cut (right-hand side -1) and a feasible row; columns 0-3, then the right-hand
    # side (no artificial columns: lp_art0 = 4)
    m, w = 2, 5
    ss.lp_m, ss.lp_w, ss.lp_art0 = m, w, 4
    tab = [-0.5, -2.0, 1.0, 0.0, -1.0,
           0.0, 0.0, 0.0, 1.0, 1.0]
    for i, x in enumerate(tab):
        ss.lp_tab[i] = x
    for j, x in enumerate([0.0, 0.0, 1.0, 0.0, 0.0]):
        ss.lp_obj[j] = x
    ss.lp_basis[0], ss.lp_basis[1] = 2, 3
    assert ss._lp_dual_simplex()
    assert ss.lp_basis[0] == 1
    assert ss.lp_tab[w - 1] == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(5, 10))
def test_the_pivot_updates_the_nonzero_columns_as_the_dense_update_would(seed):
    """``_lp_pivot`` subtracts the pivot row on its nonzero columns only: the tableau and the objective
    row are those of the dense update (zeros equal whatever their sign)."""
    case = _searched_structure(seed)
    assert case is not None, seed       # these seeds have plans (the search's scratch is what is used)
    ss, rng = case[6], case[5]
    ss._lp_alloc()
    m, w = 7, 23
    ss.lp_m, ss.lp_w = m, w
    tab = [rng.choice((0.0, 0.0, rng.uniform(-3.0, 3.0))) for _ in range(m * w)]
    obj = [rng.choice((0.0, rng.uniform(-3.0, 3.0))) for _ in range(w)]
    pr, pc = rng.randrange(m), rng.randrange(w)
    tab[pr * w + pc] = rng.uniform(0.5, 2.0)
    for i, x in enumerate(tab):
        ss.lp_tab[i] = x
    for j, x in enumerate(obj):
        ss.lp_obj[j] = x
    row = [x / tab[pr * w + pc] for x in tab[pr * w:(pr + 1) * w]]
    dense = [row[j] if i == pr else tab[i * w + j] - tab[i * w + pc] * row[j] for i in range(m) for j in range(w)]
    dense_obj = [obj[j] - obj[pc] * row[j] for j in range(w)]
    ss._lp_pivot(pr, pc)
    assert list(ss.lp_tab[:m * w]) == dense
    assert list(ss.lp_obj[:w]) == dense_obj
    assert ss.lp_basis[pr] == pc


def _options_case(seed: int) -> int:
    """The program's columns (``RelaxationBound._lp_build``, docs/SEARCH.md) are, per rank and type, the
    least and greatest layer counts of each residue mod V, and every count between them has the
    parameters of a mix of its residue's two (the same point, layers and sums, so the same program
    value): searching an interleaved structure at its optimum finds the brute force's. Returns how many
    counts the programs left out."""
    table, shape, counts, num_layers, best = _interleaved_structure(7000 + 200 * seed)
    left_out = []

    class Watched(PySplitSearch):
        def _lp_build(self, a, b, left, n_paths, scale):
            ok = PySplitSearch._lp_build(self, a, b, left, n_paths, scale)
            nt, v, npar = self.nt, self.v, self.n_par
            options = {(self.lp_opt_r[j], self.lp_opt_t[j], self.lp_opt_l[j]) for j in range(self.lp_n_opt)}
            assert len(options) == self.lp_n_opt
            for r in range(a, b):
                for t in range(nt):
                    lo, hi = self.lp_lo[r * nt + t], self.lp_hi[r * nt + t]
                    if lo < 0:
                        assert not any(o[0] == r and o[1] == t for o in options)
                        continue
                    for l in range(lo, hi + 1):
                        ends = l < lo + v or l > hi - v
                        assert ((r, t, l) in options) == ends, (r, t, l, lo, hi)
                        if ends:
                            continue
                        down = lo + (l - lo) % v                  # its residue's least and greatest
                        up = hi - (hi - l) % v
                        got, p0, p1 = array("d", [0.0] * npar), array("d", [0.0] * npar), array("d", [0.0] * npar)
                        self._lp_put_rank(got, 0, r, t, l)
                        self._lp_put_rank(p0, 0, r, t, down)
                        self._lp_put_rank(p1, 0, r, t, up)
                        w = (l - down) / (up - down)
                        for i in range(npar):
                            assert got[i] == pytest.approx((1 - w) * p0[i] + w * p1[i], rel=1e-12, abs=1e-12)
                        left_out.append((r, t, l))
            return ok

    _search_at_its_optimum(Watched, table, shape, counts, num_layers, best)
    return len(left_out)


@pytest.mark.parametrize("seed", range(8))
def test_the_programs_options_are_the_extremes_of_each_residue(seed):
    _options_case(seed)


def test_the_programs_leave_counts_out_somewhere():
    """Not vacuous: some programs of those searches leave counts out (a range wider than 2 V)."""
    assert sum(_options_case(seed) for seed in range(8)) > 0


def _layer_dual_case(seed: int) -> int:
    """The layer row's dual ``mu`` (``_relaxation_bound``) is read from the one artificial column the
    tableau keeps (``_lp_build``: the others are never read, so they are not carried): at the programs of
    a search of an interleaved structure, solved again with ``left`` moved by -1e-4 and +1e-4, ``mu`` lies
    between the two slopes of the program's value (convex in ``left``: its duals are its subgradients),
    one side where the other is infeasible. Returns how many programs had both sides and a nonzero
    ``mu``."""
    table, shape, counts, num_layers, best = _interleaved_structure(9000 + 200 * seed)
    checked = []

    class Watched(PySplitSearch):
        probing = False

        def _lp_build(self, a, b, left, n_paths, scale):
            ok = PySplitSearch._lp_build(self, a, b, left, n_paths, scale)
            if not ok or self.probing:
                return ok
            mu, value = -self.lp_obj[self.lp_art0] * scale, self._lp_value() * scale
            self.probing = True
            slopes = []
            for d in (-1e-4, 1e-4):
                moved = PySplitSearch._lp_build(self, a, b, left + d, n_paths, scale)
                slopes.append((self._lp_value() * scale - value) / d if moved else None)
            assert PySplitSearch._lp_build(self, a, b, left, n_paths, scale)      # the program as it was
            assert self._lp_value() * scale == value and -self.lp_obj[self.lp_art0] * scale == mu
            self.probing = False
            tol = 1e-6 * scale
            down, up = slopes
            assert down is None or mu >= down - tol, (mu, down, up)
            assert up is None or mu <= up + tol, (mu, down, up)
            if None not in slopes and abs(mu) > tol:
                checked.append(mu)
            return ok

    _search_at_its_optimum(Watched, table, shape, counts, num_layers, best)
    return len(checked)


@pytest.mark.parametrize("seed", range(12))
def test_the_layer_rows_dual_is_a_slope_of_the_programs_value(seed):
    _layer_dual_case(seed)


def test_the_layer_rows_dual_is_checked_somewhere():
    """Not vacuous: programs of those searches are feasible on both sides, with a nonzero ``mu``."""
    assert sum(_layer_dual_case(seed) for seed in range(12)) > 0


def test_the_primal_simplex_enters_the_most_negative_column_then_falls_back_to_blands_rule(monkeypatch):
    """``min -x0 - 3 x1`` with ``x0 + x1 + s = 4``: the most negative reduced cost (x1) enters and one pivot
    is optimal; past half of LP_PIVOTS (here from the first pivot) the first negative column (x0)
    enters instead, Bland's rule."""
    from poseidon_plugin.search import relaxation_bound
    case = _searched_structure(5)
    assert case is not None
    ss = case[6]
    ss._lp_alloc()

    def load():
        m, w = 1, 4                     # columns x0, x1, s, then the right-hand side (lp_art0 = 3)
        ss.lp_m, ss.lp_w, ss.lp_art0 = m, w, 3
        for i, x in enumerate([1.0, 1.0, 1.0, 4.0]):
            ss.lp_tab[i] = x
        for j, x in enumerate([-1.0, -3.0, 0.0, 0.0]):
            ss.lp_obj[j] = x
        ss.lp_basis[0] = 2

    pivots = []
    monkeypatch.setattr(ss, "_lp_pivot", lambda pr, pc: (pivots.append(pc), PySplitSearch._lp_pivot(ss, pr, pc)))
    load()
    assert ss._lp_simplex()
    assert pivots == [1]
    assert ss.lp_basis[0] == 1 and ss.lp_tab[3] == 4.0
    assert ss.lp_obj[3] == 12.0 and min(ss.lp_obj[:3]) >= 0.0
    load()
    monkeypatch.setattr(relaxation_bound, "LP_PIVOTS", 1)
    assert not ss._lp_simplex()         # one pivot allowed, not yet optimal
    assert pivots == [1, 0] and ss.lp_basis[0] == 0


def test_each_depth_keeps_the_relaxation_bound_by_its_own_cuts_and_samples_it_when_off():
    """The rule (docs/SEARCH.md, "Per depth, and sampled when off"): a depth computes the bound for its first
    LP_TRIAL nodes, then while it cuts at least LP_ONE_CHUNK_CUTS in LP_MIN_CUTS of them there (one-chunk
    trees), whatever the other depths do; below that, one node in LP_SAMPLE of the depth still computes
    it, so that its later cuts can turn it on again. A run starts every depth afresh, a resumed walk goes
    on with the stopped walk's counts."""
    from poseidon_plugin.search.constants import LP_MIN_CUTS, LP_ONE_CHUNK_CUTS, LP_SAMPLE, LP_TRIAL
    plans, counts, pp, v, _nt, _rng, ss = next(c for c in map(_searched_structure, range(40))
                                               if c is not None and c[3] == 1 and c[2] >= 3)
    assert all(ss._lp_wanted(k) for k in range(pp + 1))              # the trial
    k = 2
    ss.lp_depth_calls[k] = LP_TRIAL
    ss.lp_depth_cuts[k] = (LP_TRIAL * LP_ONE_CHUNK_CUTS + LP_MIN_CUTS - 1) // LP_MIN_CUTS - 1   # one too few
    wanted = [ss._lp_wanted(k) for _ in range(3 * LP_SAMPLE)]
    assert wanted == ([False] * (LP_SAMPLE - 1) + [True]) * 3             # off but sampled
    assert ss._lp_wanted(k - 1) and ss._lp_wanted(k + 1)                 # the other depths: their own trial
    ss.lp_depth_cuts[k] += 1                                             # the samples cut: on again
    assert all(ss._lp_wanted(k) for _ in range(3 * LP_SAMPLE))
    ss.run(counts, math.inf)                  # a run starts every depth afresh (no bound below tau = inf)
    assert not any(ss.lp_depth_calls) and not any(ss.lp_depth_cuts) and not any(ss.lp_depth_skips)
    tau = max(p[0] for p in plans) * 2.0      # every plan below it: the walk stops at its budget
    assert ss.run(counts, tau, max_nodes=3).aborted
    assert ss.lp_depth_calls[0] == 1          # the root's program
    for i in range(pp + 1):
        ss.lp_depth_calls[i] += 1000
    res = ss.run(counts, tau, resume=True)
    assert res.resumed and ss.lp_depth_calls[0] == 1001     # the stopped walk's counts go on
    ss.run(counts, tau)
    assert ss.lp_depth_calls[0] == 1


def test_one_chunk_trees_take_the_relaxation_bound_while_it_cuts(monkeypatch):
    """One-chunk (1F1B) trees are bounded by the relaxation bound too (docs/SEARCH.md, kept while it cuts
    LP_ONE_CHUNK_CUTS nodes in LP_MIN_CUTS): on paper Setting 6 at 96 NPUs up to PP 8, every one-chunk
    tree finds the same plan with it as without it (the pure twin with the bound switched off), never in
    more nodes, in fewer somewhere (non-vacuity); the compiled walk takes the pure one's nodes."""
    from poseidon_plugin.search import splits

    from .test_search_improve import _setting_6_96_trees

    def one_chunk(pure):
        return [(full, sp, vec)
                for _r, _sg, sp, vec, full in _setting_6_96_trees(pure, 300, lambda sg: sg.virtual_stages == 1)]

    with_bound = one_chunk(True)
    compiled = [] if PURE_FORCED else one_chunk(False)
    monkeypatch.setattr(splits, "LP_MIN_UNDECIDED", 10 ** 9)     # no node has that many ranks undecided
    fewer = 0
    assert with_bound
    for i, (res, sp, vec) in enumerate(with_bound):
        off = sp.run(vec, math.inf)
        assert not res.aborted and (res.time_ms, res.types, res.layers) == (off.time_ms, off.types, off.layers)
        assert res.counters[0] <= off.counters[0]
        fewer += res.counters[0] < off.counters[0]
        if compiled:
            assert compiled[i][0].counters == res.counters
    assert fewer
