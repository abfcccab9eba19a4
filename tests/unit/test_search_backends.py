"""The structure search has one source (search/splits.py + search/structure_bounds.py), compiled
(``poseidon_plugin._core._search``) and run as it is (``POSEIDON_PURE_PYTHON=1``). Checked by results:

* ``--exact`` finds the ``--exhaustive`` optimum (search/exhaustive.py: every plan simulated through the
  cost model, nothing shared with the branch and bound) on random problems with a pinned pipeline of up
  to 8 ranks, up to 4 device types, with and without interleaving, on both backends;
* the two backends give the same plan, alternatives and statistics on those problems, and the same
  structure searches (time, types, layers, counters) on random structures;
* the compiled modules are built from the linked sources (no hand-kept twin), and the memory caps are
  the cost model's formula.

The one cost assembly (poseidon_plugin/stagecost.py) is checked against the simulator's ParamLayout here.
"""

import math
import os
import random
from array import array

import pytest

from poseidon_plugin import stagecost
from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.search.exhaustive import space_size
from poseidon_plugin.search.shapes import ShapeData
from poseidon_plugin.search.splits import SplitSearch as PySplitSearch
from poseidon_plugin.simulator.graph import ParamLayout
from poseidon_plugin.specs.cluster import parse_cluster
from poseidon_plugin.specs.model import parse_model

from .test_search_bounds import random_structure
from .test_search_exact import assert_backends_agree

PURE_FORCED = os.environ.get("POSEIDON_PURE_PYTHON", "") not in ("", "0")
needs_compiled = pytest.mark.skipif(PURE_FORCED, reason="POSEIDON_PURE_PYTHON=1 forces the pure loop")

DEVICES = ["A2-2", "A2-3", "A2-4", "A100-80G", "RTX-4090", "RTX-3090"]
SCHEDULES = [("1f1b",), ("interleaved-1f1b",), ("gpipe",), ("eager-1f1b",), ("1f1b", "interleaved-1f1b")]
MAX_PLANS = 2500           # the exhaustive reference simulates every plan: keep each problem small


def pinned_problem(seed: int):
    """A cluster of ``pp`` devices (5..8) of 2..4 types, a model of a few layers, the pipeline pinned to
    all of them (TP 1, DP 1, micro-batch 1): ``(cost model, options)`` whose plan space has at most
    MAX_PLANS plans (drawn again until it does)."""
    rng = random.Random(seed)
    while True:
        pp = rng.choice([5, 6, 7, 8])
        nt = rng.choice([2, 3, 4]) if pp < 8 else rng.choice([2, 2, 3])
        types = rng.sample(DEVICES, nt)
        per_type = [1] * nt
        for _ in range(pp - nt):
            per_type[rng.randrange(nt)] += 1
        schedules = SCHEDULES[seed % len(SCHEDULES)]
        v = 2 if "interleaved-1f1b" in schedules else 1
        cluster = parse_cluster({"name": f"pinned{seed}", "device_types": types,
                                 "links": rng.choice(["npu", "gpu"]),
                                 "nodes": [{"device_type": t, "count": n, "devices_per_node": 1}
                                           for t, n in zip(types, per_type)]})
        hidden = 1024 * rng.choice([1, 2])
        model = parse_model({
            "name": "tiny", "num_layers": pp * v + rng.randint(0, 2), "hidden_size": hidden,
            "ffn_hidden_size": 4 * hidden, "num_attention_heads": 8, "num_query_groups": 8,
            "vocab_size": 32000, "seq_length": rng.choice([1024, 2048]),
            "global_batch_size": pp * rng.choice([1, 2]), "distributed_optimizer": True})
        cm = CostModel(cluster, model, micro_batch_sizes=(1,))
        opts = dict(schedules=schedules, min_pipeline_stages=pp, max_pipeline_stages=pp, tp_degrees=(1,),
                    micro_batch_sizes=(1,), top_k=2, warmup_samples=seed % 3 * 4)
        if 0 < space_size(cm, SearchOptions(mode="exhaustive", **opts)) <= MAX_PLANS:
            return cm, opts


PINNED = range(80)


@pytest.mark.parametrize("seed", PINNED)
def test_exact_equals_exhaustive_on_pinned_pipelines(seed, pure_python):
    cm, opts = pinned_problem(seed)
    ref = search(cm, SearchOptions(mode="exhaustive", **opts))
    got = search(cm, SearchOptions(mode="exact", exact_alternatives=True, pure_python=pure_python, **opts))
    assert got.stats.complete and got.stats.gap == 0.0
    assert got.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms
    assert ([a.predicted_iteration_ms for a in got.alternatives]
            == [a.predicted_iteration_ms for a in ref.alternatives])
    # the structure search did the work (not the warm-up alone)
    assert got.stats.nodes > 0


def test_pinned_problems_cover_the_brief():
    """The pinned problems reach 8 ranks, 4 device types and interleaved schedules."""
    problems = [pinned_problem(s) for s in PINNED]
    assert max(o["max_pipeline_stages"] for _cm, o in problems) == 8
    assert max(len(cm.cluster.device_types) for cm, _o in problems) == 4
    assert sum("interleaved-1f1b" in o["schedules"] for _cm, o in problems) >= 12


@needs_compiled
@pytest.mark.parametrize("seed", PINNED[::4])
def test_backends_give_the_same_results_on_pinned_pipelines(seed):
    """Compiled and uncompiled: the same plan, alternatives and statistics (all counters), in both modes."""
    cm, opts = pinned_problem(seed)
    for mode in ("exact", "default"):
        assert_backends_agree(cm, SearchOptions(mode=mode, **opts))


@needs_compiled
@pytest.mark.parametrize("seed", range(40))
def test_backends_give_the_same_structure_searches(seed):
    """Whole structure searches on random structures, both branching orders and the default mode's
    rules, several thresholds, a node budget: time, types, layers, counters, aborted, all equal; and the
    parameter vector of the DAG bound's fill, bit for bit."""
    from poseidon_plugin._core._search import SplitSearch
    table, shape_py, counts, num_layers = random_structure(4000 + seed, True)
    shape_c = ShapeData(shape_py.schedule, shape_py.pp, shape_py.micro_batches, shape_py.virtual_stages, False)
    cls = array("i", range(len(counts)))
    for ridge, blocks, backward in ((False, False, False), (False, False, True), (True, True, False)):
        a = PySplitSearch(table, shape_py, num_layers, ridge=ridge, blocks=blocks, type_class=cls,
                          backward=backward)
        b = SplitSearch(table, shape_c, num_layers, ridge=ridge, blocks=blocks, type_class=cls,
                        backward=backward)
        for tau in (math.inf, 60.0, 5.0):
            assert a.run(counts, tau) == b.run(counts, tau)
            assert a.run(counts, tau, root_only=True) == b.run(counts, tau, root_only=True)
        assert a.run(counts, math.inf, max_nodes=3) == b.run(counts, math.inf, max_nodes=3)
    rng = random.Random(seed)
    pp, v, nt = shape_py.pp, shape_py.virtual_stages, len(counts)
    for _ in range(5):
        types = [rng.choice([-1] + [t for t in range(nt) if counts[t]]) for _ in range(pp)]
        if any(types.count(t) > counts[t] for t in range(nt)):
            continue
        layers = [rng.randint(1, 3) if types[vs % pp] >= 0 else 0 for vs in range(pp * v)]
        lb = [rng.randint(1, 3) for _ in range(pp * v)]
        capt = [rng.randint(0, 4) for _ in range(pp * v * nt)]
        for caps in (None, capt):
            assert a.bound_params(counts, types, layers, lb, caps) == b.bound_params(counts, types, layers, lb, caps)


@needs_compiled
@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_backends_give_the_same_group_bounds(seed):
    """search/bounds.py compiled (``poseidon_plugin._core.bounds``, the engine's) and as it is: every shape
    group's fluid cut and pipeline bound (without and with the per-position memory bound, the group's
    and each structure's, up to a target and not), and each structure's relaxation witness, equal."""
    from poseidon_plugin.search import bounds as py_bounds
    from poseidon_plugin.search.engine import SearchRun

    from .test_search_exact import random_problem
    cm, schedules = random_problem(seed)
    pure = SearchRun(cm, SearchOptions(mode="exact", schedules=schedules, pure_python=True))
    fast = SearchRun(cm, SearchOptions(mode="exact", schedules=schedules))
    assert pure.bounds is py_bounds and fast.bounds is not py_bounds
    checked = 0
    for sg in pure.space.shape_groups():
        a = pure.bound(sg, memory=False)
        assert a == fast.bound(sg, memory=False)
        assert pure.bound(sg) == fast.bound(sg)
        for tau in (a * 1.01, a * 1.5):
            assert pure.fluid_cut(sg, tau) == fast.fluid_cut(sg, tau)
            assert pure.bound(sg, target=tau) == fast.bound(sg, target=tau)
        for vec in pure.space.count_vectors(sg):
            wa, wb = [], []
            assert pure.bound(sg, vec, witness=wa) == fast.bound(sg, vec, witness=wb)
            assert wa == wb
            assert pure.bound(sg, vec, target=a * 1.2) == fast.bound(sg, vec, target=a * 1.2)
            checked += 1
    assert checked > 0


@needs_compiled
def test_the_compiled_search_is_built_from_the_sources():
    """No hand-kept twin: the compiled modules are the linked pure-Python-mode sources, built."""
    from poseidon_plugin import _core
    from poseidon_plugin import search as search_pkg
    from poseidon_plugin.backend import compiled
    here = os.path.dirname(_core.__file__)
    sources = os.path.dirname(search_pkg.__file__)
    for name, source in (("_search", "splits.py"), ("structure_bounds", "structure_bounds.py"),
                         ("assignment", "assignment.py"), ("bounds", "bounds.py")):
        link = os.path.join(here, name + ".py")
        assert os.path.realpath(link) == os.path.realpath(os.path.join(sources, source))
        assert compiled(name) is not None, name
    assert not os.path.exists(os.path.join(here, "_search.pyx"))


@pytest.mark.parametrize("seed", range(30))
def test_memory_caps_are_the_cost_models_formula(seed):
    """SplitSearch.cap_rank (its own loop over typed buffers) is the binary search on
    stagecost.memory_need, the cost model's formula."""
    table, shape, counts, num_layers = random_structure(6000 + seed, True)
    ss = PySplitSearch(table, shape, num_layers, ridge=False, blocks=False,
                       type_class=array("i", range(len(counts))))
    pp, v = shape.pp, shape.virtual_stages
    for t in range(len(counts)):
        for r in range(pp):
            fits = [n for n in range(num_layers + 1)
                    if stagecost.memory_need(t, r, [(n + v - 1 - c) // v for c in range(v)], table, shape)
                    <= table.usable_bytes[t]]
            assert ss.cap_rank[t * pp + r] == max(fits, default=0)


@pytest.mark.parametrize("pp,v", [(1, 1), (3, 1), (4, 2), (3, 3)])
def test_stagecost_indices_are_the_simulators(pp, v):
    layout = ParamLayout(pp=pp, virtual_stages=v)
    assert stagecost.base_params(pp, v) == layout.size
    for r in range(pp):
        assert stagecost.send_index(pp, v, r) == layout.send(r)
        assert stagecost.allreduce_index(pp, v, r) == layout.allreduce(r)
        for c in range(v):
            assert stagecost.forward_index(pp, v, r, c) == layout.forward(r, c)
            assert stagecost.backward_index(pp, v, r, c) == layout.backward(r, c)
