"""The compiled structure search (cython_core/_search.pyx) against its pure-Python reference
(search/splits.py + search/structure_bounds.py), field by field: the names it exports, the parameter vector
its DAG-bound fill assembles, and the results and counters of whole searches on fixed problems.

The one cost assembly (poseidon_plugin/stagecost.py) is checked against the cost model and the
simulator's ParamLayout here too.
"""

import math
import os
import random
from array import array

import pytest

from poseidon_plugin import stagecost
from poseidon_plugin.search import counters, structure_bounds, tables
from poseidon_plugin.search.shapes import ShapeData
from poseidon_plugin.search.splits import SplitSearch as PySplitSearch
from poseidon_plugin.simulator.graph import ParamLayout

from .test_search_bounds import random_structure

PURE_FORCED = os.environ.get("POSEIDON_PURE_PYTHON", "") not in ("", "0")
needs_compiled = pytest.mark.skipif(PURE_FORCED, reason="POSEIDON_PURE_PYTHON=1 forces the pure loop")


@needs_compiled
def test_twin_exports_the_same_names():
    from poseidon_plugin._core import _search
    assert _search.COUNTER_NAMES == counters.COUNTER_NAMES
    assert _search.MIN_NAMES == structure_bounds.MIN_NAMES
    assert set(_search.TABLE_COLUMNS) == set(tables.TYPE_COLUMNS) | set(tables.SLOT_COLUMNS)
    # every column the table has is one the twin copies (nothing read under another name)
    fields = set(tables.TypeTable.__dataclass_fields__) - {"tp", "mbs", "dp", "names", "slots", "max_slots"}
    assert fields == set(_search.TABLE_COLUMNS)


@needs_compiled
@pytest.mark.parametrize("seed", range(40))
def test_compiled_capacity_assignment_is_the_pure_one(seed):
    """The positional bound's compiled assignment solver gives the pure one's total and types on
    integral values (layer capacities, NEG where a type cannot take a position)."""
    import random
    from poseidon_plugin._core._search import best_capacity_assignment
    from poseidon_plugin.search.assignment import NEG, best_assignment
    rng = random.Random(seed)
    nt, n = rng.randint(1, 4), rng.randint(1, 40)
    supply = [rng.randint(0, n) for _ in range(nt)]
    value = [[NEG if rng.random() < 0.2 else rng.randint(0, 126) for _ in range(n)] for _ in range(nt)]
    assert best_capacity_assignment(value, supply, n) == best_assignment(value, supply, n)


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


def _random_prefix(rng, counts, pp, v, num_layers):
    """Types of a random decided prefix of ranks (-1 after it), their layers, and random lower bounds."""
    k = rng.randrange(pp + 1)
    left = list(counts)
    types = []
    for _ in range(pp):
        t = rng.choice([x for x in range(len(left)) if left[x] > 0])
        left[t] -= 1
        types.append(t)
    types = types[:k] + [-1] * (pp - k)
    layers = [0] * (pp * v)
    for r in range(k):
        for c in range(v):
            layers[c * pp + r] = rng.randint(1, max(1, num_layers // pp))
    lb = [rng.randint(1, 3) for _ in range(pp * v)]
    return types, layers, lb


@needs_compiled
@pytest.mark.parametrize("seed", range(12))
def test_bound_fill_is_the_same_vector(seed):
    """The DAG bound's parameter vector, for random decided prefixes, is bit for bit the same."""
    from poseidon_plugin._core._search import SplitSearch
    table, shape_py, counts, num_layers = random_structure(3000 + seed, True)
    shape_c = ShapeData(shape_py.schedule, shape_py.pp, shape_py.micro_batches,
                        shape_py.virtual_stages, False)
    cls = array("i", range(len(counts)))
    a = PySplitSearch(table, shape_py, num_layers, ridge=False, blocks=False, type_class=cls)
    b = SplitSearch(table, shape_c, num_layers, ridge=False, blocks=False, type_class=cls)
    rng = random.Random(seed)
    pp, v = shape_py.pp, shape_py.virtual_stages
    for _ in range(10):
        types, layers, lb = _random_prefix(rng, counts, pp, v, num_layers)
        # per-type caps: none, or random ones (some types fit an undecided rank's lower bounds,
        # some do not; the fill prices it over those that do)
        capt = [rng.randint(0, 4) for _ in range(pp * v * len(counts))]
        for caps in (None, capt):
            pa = a.bound_params(counts, types, layers, lb, caps)
            pb = b.bound_params(counts, types, layers, lb, caps)
            assert len(pa) == len(pb) == shape_py.n_params
            for i, (x, y) in enumerate(zip(pa, pb)):
                assert x == y, f"parameter {i}: pure {x!r} != compiled {y!r} (types {types}, capt {caps})"


@needs_compiled
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("ridge,blocks", [(False, False), (True, True)])
def test_searches_agree_field_by_field(seed, ridge, blocks):
    """Whole structure searches: time, types, layers, every counter by name, at several thresholds."""
    from poseidon_plugin._core._search import SplitSearch
    table, shape_py, counts, num_layers = random_structure(4000 + seed, True)
    shape_c = ShapeData(shape_py.schedule, shape_py.pp, shape_py.micro_batches,
                        shape_py.virtual_stages, False)
    cls = array("i", range(len(counts)))
    a = PySplitSearch(table, shape_py, num_layers, ridge=ridge, blocks=blocks, type_class=cls)
    b = SplitSearch(table, shape_c, num_layers, ridge=ridge, blocks=blocks, type_class=cls)
    for tau in (math.inf, 60.0, 5.0):
        ra, rb = a.run(counts, tau), b.run(counts, tau)
        assert (ra.time_ms, ra.types, ra.layers, ra.aborted) == (rb.time_ms, rb.types, rb.layers,
                                                                 rb.aborted)
        for name, x, y in zip(counters.COUNTER_NAMES, ra.counters, rb.counters):
            assert x == y, f"counter {name}: pure {x} != compiled {y}"
        assert len(ra.counters) == len(rb.counters) == counters.N_COUNTERS
