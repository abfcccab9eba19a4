"""The DAG simulator: closed forms, an independent reference, both kernels, errors, CLI."""

import json
import math
import random
import subprocess
import sys

import pytest

from poseidon_plugin.errors import InputError
from poseidon_plugin.simulator import (Simulator, build_graph, parse_stage_input,
                                       peak_live_microbatches, rank_order, simulate)
from poseidon_plugin.simulator.trace import trace_events

from . import reference_sim

SCHEDULES_V1 = ["gpipe", "1f1b", "eager-1f1b"]


def doc(schedule, fwd, bwd, send, ar, m, v=1, dp=1, **extra):
    pp = len(send)
    return {"schedule": schedule, "micro_batches": m, "virtual_stages": v, "data_parallel": dp,
            "stages": [{"forward_ms": fwd[r * v:(r + 1) * v], "backward_ms": bwd[r * v:(r + 1) * v],
                        "send_ms": send[r], "allreduce_ms": ar[r]} for r in range(pp)], **extra}


@pytest.mark.parametrize("schedule", SCHEDULES_V1)
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 5), (2, 2), (3, 7), (4, 8), (4, 2), (8, 32), (5, 3)])
def test_homogeneous_closed_form(schedule, pp, m, pure_python):
    f, b, ar = 3.0, 7.0, 2.5
    sim = Simulator(schedule, pp, m, pure_python=pure_python)
    t = sim.iteration_time([f] * pp, [b] * pp, [0.0] * pp, [ar] * pp)
    assert t == pytest.approx((m + pp - 1) * (f + b) + ar, rel=1e-12)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 6), (4, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_shrinks_by_v(pp, m, v, pure_python):
    f, b = 4.0, 8.0  # per layer-block; each chunk holds 1/V of it
    sim = Simulator("interleaved-1f1b", pp, m, v, pure_python=pure_python)
    t = sim.iteration_time([f / v] * (pp * v), [b / v] * (pp * v), [0.0] * pp, [0.0] * pp)
    bubble = t - m * (f + b)
    assert bubble == pytest.approx((pp - 1) * (f + b) / v, rel=1e-12)
    non_interleaved = Simulator("1f1b", pp, m, pure_python=pure_python).iteration_time(
        [f] * pp, [b] * pp, [0.0] * pp, [0.0] * pp)
    assert non_interleaved - m * (f + b) == pytest.approx(bubble * v, rel=1e-12)


def random_instance(rng, schedule):
    if schedule == "interleaved-1f1b":
        pp = rng.randint(2, 6)
        v = rng.randint(2, 3)
        m = pp * rng.randint(1, 4)
    else:
        pp = rng.randint(1, 7)
        v = 1
        m = rng.randint(1, 12)
    fwd = [rng.uniform(0.5, 20.0) for _ in range(pp * v)]
    bwd = [x * rng.uniform(1.0, 3.0) for x in fwd]
    send = [rng.choice([0.0, rng.uniform(0.0, 5.0)]) for _ in range(pp)]
    ar = [rng.uniform(0.0, 30.0) for _ in range(pp)]
    return pp, m, v, fwd, bwd, send, ar


@pytest.mark.parametrize("schedule", SCHEDULES_V1 + ["interleaved-1f1b"])
def test_matches_independent_reference(schedule, pure_python):
    rng = random.Random(f"reference-{schedule}")  # a str seed is replayable (hash() is salted per process)
    for _ in range(200):
        pp, m, v, fwd, bwd, send, ar = random_instance(rng, schedule)
        expected = reference_sim.simulate(schedule, pp, m, v, fwd, bwd, send, ar)
        got = Simulator(schedule, pp, m, v, pure_python=pure_python).iteration_time(fwd, bwd, send, ar)
        assert got == pytest.approx(expected, rel=1e-12), (pp, m, v)


@pytest.mark.parametrize("schedule", SCHEDULES_V1 + ["interleaved-1f1b"])
def test_compiled_and_pure_python_agree(schedule):
    from poseidon_plugin.simulator import kernel_name

    if kernel_name() != "compiled":
        pytest.skip("POSEIDON_PURE_PYTHON is set or the compiled core is not built")
    rng = random.Random(7)
    for _ in range(100):
        pp, m, v, fwd, bwd, send, ar = random_instance(rng, schedule)
        a = Simulator(schedule, pp, m, v, pure_python=False).run(fwd, bwd, send, ar)
        b = Simulator(schedule, pp, m, v, pure_python=True).run(fwd, bwd, send, ar)
        assert a.kernel == "compiled" and b.kernel == "pure-python"
        assert math.isclose(a.iteration_ms, b.iteration_ms, rel_tol=1e-9)
        assert a.critical_path == b.critical_path


def test_graph_reuse_gives_fresh_results(pure_python):
    rng = random.Random(3)
    sim = Simulator("1f1b", 4, 8, pure_python=pure_python)
    for _ in range(20):
        _pp, _m, _v, fwd, bwd, send, ar = random_instance(rng, "1f1b")
        fwd, bwd, send, ar = fwd[:1] * 4, bwd[:1] * 4, (send * 4)[:4], (ar * 4)[:4]
        fresh = Simulator("1f1b", 4, 8, pure_python=pure_python)
        fresh.graph  # the cached graph is shared; the kernel and params are not
        assert sim.iteration_time(fwd, bwd, send, ar) == fresh.iteration_time(fwd, bwd, send, ar)


@pytest.mark.parametrize("schedule", SCHEDULES_V1 + ["interleaved-1f1b"])
def test_data_parallel_replicas_match_coupled_reference(schedule, pure_python):
    """A stage-level input with ``data_parallel: dp`` is the time of dp replicas whose per-rank gradient
    all-reduce is one collective across them (the reference runs every replica); DP enters the cost only
    through the given all-reduce times, and the graph holds one pipeline whatever dp is."""
    rng = random.Random(f"dp-{schedule}")
    for _ in range(40):
        pp, m, v, fwd, bwd, send, ar = random_instance(rng, schedule)
        dp = rng.choice([1, 2, 3, 8])
        got = simulate(doc(schedule, fwd, bwd, send, ar, m, v, dp), pure_python=pure_python)
        expected = reference_sim.simulate_data_parallel(schedule, pp, m, v, fwd, bwd, send, ar, dp)
        assert got.iteration_ms == pytest.approx(expected, rel=1e-12), (pp, m, v, dp)
        assert len(got.stages) == pp
    # one pipeline's nodes: 2 * pp * M compute + pp all-reduce, whatever the DP degree
    assert build_graph("1f1b", 3, 6).n_nodes == 2 * 3 * 6 + 3


def test_critical_path_length_equals_iteration_time(pure_python):
    rng = random.Random(11)
    for schedule in SCHEDULES_V1 + ["interleaved-1f1b"]:
        pp, m, v, fwd, bwd, send, ar = random_instance(rng, schedule)
        sim = Simulator(schedule, pp, m, v, pure_python=pure_python)
        finish = sim.finish_times(fwd, bwd, send, ar)
        path = sim.critical_path(finish)
        g, p = sim.graph, sim.params
        total = 0.0
        for i, node in enumerate(path):
            total += p[g.node_weight[node]]
            if i:
                edges = range(g.pred_ptr[node], g.pred_ptr[node + 1])
                total += next(p[g.pred_weight[e]] for e in edges if g.pred_src[e] == path[i - 1])
        assert total == pytest.approx(sim.iteration_time(fwd, bwd, send, ar), rel=1e-9)
        assert g.labels[path[-1]][0] == "AR"


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 2), (1, 3), (6, 6)])
def test_peak_live_microbatches(pp, m):
    assert peak_live_microbatches("1f1b", pp, m) == [min(pp - r, m) for r in range(pp)]
    assert peak_live_microbatches("gpipe", pp, m) == [m] * pp
    assert peak_live_microbatches("eager-1f1b", pp, m) == [min(2 * (pp - r - 1) + 1, m) for r in range(pp)]


def test_peak_live_interleaved_rank0():
    pp, m, v = 4, 8, 2
    peaks = peak_live_microbatches("interleaved-1f1b", pp, m, v)
    assert peaks[0] == (pp - 1) * 2 + (v - 1) * pp + 1
    assert peaks == sorted(peaks, reverse=True)


def test_orders_cover_every_op_once():
    for schedule, pp, m, v in [("1f1b", 4, 6, 1), ("eager-1f1b", 3, 9, 1), ("gpipe", 2, 3, 1),
                               ("interleaved-1f1b", 4, 8, 3)]:
        for r in range(pp):
            ops = rank_order(schedule, pp, m, v, r)
            expected = {(k, c, i) for k in "FB" for c in range(v) for i in range(m)}
            assert sorted(ops) == sorted(expected) and len(ops) == len(expected)
            assert ops == reference_sim.orders(schedule, pp, m, v)[r]


def test_simulate_result_fields(pure_python):
    d = doc("1f1b", [10.0, 10.0], [20.0, 20.0], [0.5, 0.0], [3.0, 3.0], m=4)
    res = simulate(d, pure_python=pure_python)
    out = res.to_json()
    assert set(out) == {"iteration_ms", "stages", "critical_path"}
    assert [s["peak_live_microbatches"] for s in out["stages"]] == [2, 1]
    for s in res.stages:
        assert s.busy_ms == pytest.approx(4 * 30.0)
        assert s.bubble_ms == pytest.approx(res.iteration_ms - s.busy_ms - s.allreduce_ms)


BAD = [
    ({"schedule": "zb-h1"}, r"schedule='zb-h1' is unknown; allowed: gpipe, 1f1b"),
    ({"micro_batches": 0}, r"micro_batches=0 must be an integer >= 1"),
    ({"stages": []}, r"stages must be a non-empty list"),
    ({"bogus": 1}, r"unknown field 'bogus'"),
    ({"comm_model": "ns3"}, r"comm_model='ns3' is unknown"),
    ({"virtual_stages": 2}, r"virtual_stages=2 is only allowed with schedule='interleaved-1f1b'"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 5},
     r"micro_batches=5 is not a multiple of pp=2"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 1}, r"needs virtual_stages >= 2"),
]


@pytest.mark.parametrize("patch,match", BAD)
def test_bad_documents(patch, match):
    d = {**doc("1f1b", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], m=4), **patch}
    with pytest.raises(InputError, match=match):
        parse_stage_input(d)


@pytest.mark.parametrize("stage,match", [
    ({"forward_ms": [-1.0]}, r"stages\[0\].forward_ms\[0\]=-1.0 must be a finite number"),
    ({"backward_ms": [float("nan")]}, r"stages\[0\].backward_ms\[0\]=nan must be a finite"),
    ({"forward_ms": [1.0, 2.0]}, r"stages\[0\].forward_ms must be a list of 1 time\(s\).*got 2 entries"),
    ({"send_ms": "fast"}, r"stages\[0\].send_ms='fast' must be a finite number"),
    ({"allreduce_ms": float("inf")}, r"stages\[0\].allreduce_ms=inf"),
    ({"extra": 1}, r"stages\[0\]: unknown field 'extra'"),
])
def test_bad_stage_fields(stage, match):
    d = doc("1f1b", [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], m=4)
    d["stages"][0].update(stage)
    with pytest.raises(InputError, match=match):
        parse_stage_input(d)


def test_interleaved_needs_two_ranks():
    d = doc("interleaved-1f1b", [1.0, 1.0], [2.0, 2.0], [0.0], [0.0], m=2, v=2)
    with pytest.raises(InputError, match="needs at least 2 pipeline ranks, got 1"):
        parse_stage_input(d)


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "poseidon_plugin.cli", "simulate", *args],
                          capture_output=True, text=True, input=stdin, timeout=60)


def test_cli_table_json_and_trace(tmp_path):
    d = doc("interleaved-1f1b", [1.0, 2.0, 1.5, 1.0], [2.0, 4.0, 3.0, 2.0], [0.2, 0.1], [1.0, 1.0],
            m=4, v=2)
    path = tmp_path / "in.json"
    path.write_text(json.dumps(d))
    table = run_cli(str(path))
    assert table.returncode == 0, table.stderr
    assert "iteration time:" in table.stdout and "critical path" in table.stdout
    out = run_cli(str(path), "--json", "--trace", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["iteration_ms"] == pytest.approx(simulate(d).iteration_ms)
    trace = json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 2 * 2 * 4 * 2 + 2  # F and B per (rank, chunk, mb) + one all-reduce per rank
    assert {e["tid"] for e in slices} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(res["iteration_ms"] * 1000.0)


@pytest.mark.parametrize("text,match", [
    ("{not json", "malformed JSON"),
    ('{"schedule": "1f1b", "micro_batches": 2, "stages": [{"forward_ms": [NaN], "backward_ms": [1],'
     ' "send_ms": 0, "allreduce_ms": 0}]}', "NaN is not a valid time"),
    ('[1, 2]', "must be a JSON object"),
])
def test_cli_bad_input_one_line_exit_2(text, match):
    out = run_cli("-", stdin=text)
    assert out.returncode == 2
    assert match in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_cli_missing_file():
    out = run_cli("/nonexistent/plan.json")
    assert out.returncode == 2 and "cannot read stage-level input" in out.stderr


def test_trace_events_function():
    sim = Simulator("gpipe", 2, 2)
    tr = trace_events(sim, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0])
    names = {e["name"] for e in tr["traceEvents"] if e["ph"] == "X"}
    assert names == {"F mb0", "F mb1", "B mb0", "B mb1"}  # zero-length all-reduce slices are omitted


def test_megatron_overlap_is_a_registered_comm_model(pure_python):
    from array import array

    from poseidon_plugin.simulator import comm_megatron
    from poseidon_plugin.simulator.core import make_kernel
    from poseidon_plugin.simulator.graph import GraphBuilder, make_shape

    fwd, bwd, send, ar = [1.0, 2.0, 1.5, 1.0, 1.2, 0.8], [2.0, 4.0, 3.0, 2.0, 2.5, 1.5], [0.3] * 3, [1.0] * 3
    sim = Simulator("interleaved-1f1b", 3, 6, 2, comm_model="megatron-overlap", pure_python=pure_python)
    shape = make_shape("interleaved-1f1b", 3, 6, 2, "megatron")
    builder = GraphBuilder(layout=shape.layout)
    comm_megatron.build_overlap(builder, shape)
    direct = make_kernel(builder.freeze(shape), pure_python)
    expected = direct.evaluate(array("d", [0.0]) * shape.layout.size, fwd, bwd, send, ar)
    assert sim.iteration_time(fwd, bwd, send, ar) == expected
    d = doc("interleaved-1f1b", fwd, bwd, send, ar, m=6, v=2, comm_model="megatron-overlap", p2p_call_ms=0.05)
    dag = doc("interleaved-1f1b", fwd, bwd, send, ar, m=6, v=2)
    assert (simulate(d, pure_python=pure_python).iteration_ms
            >= simulate(dag, pure_python=pure_python).iteration_ms)


@pytest.mark.parametrize("shape", [("1f1b", 4, 6, 1, "dag"), ("interleaved-1f1b", 3, 6, 2, "dag"),
                                   ("interleaved-1f1b", 4, 8, 2, "megatron"), ("eager-1f1b", 5, 7, 1, "megatron")])
def test_topological_packing_twins_agree(shape, monkeypatch):
    pytest.importorskip("poseidon_plugin._core._dag", reason="compiled core not built")
    from poseidon_plugin.simulator.graph import build_graph

    compiled = build_graph(*shape)
    monkeypatch.setenv("POSEIDON_PURE_PYTHON", "1")
    assert build_graph(*shape) == compiled
    g = compiled
    for v in range(g.n_nodes):  # every predecessor comes first: a topological order
        assert all(g.pred_src[e] < v for e in range(g.pred_ptr[v], g.pred_ptr[v + 1]))


def test_topo_pack_detects_cycles():
    from poseidon_plugin.simulator.graph import topo_pack_py

    assert topo_pack_py(2, [0, 1, 2], [1, 0], [0, 0]) is None
    cy = pytest.importorskip("poseidon_plugin._core._dag", reason="compiled core not built")
    assert cy.topo_pack(2, [0, 1, 2], [1, 0], [0, 0]) is None


def _peak_by_walking(schedule, pp, m, v):
    peaks = []
    for rank in range(pp):
        live = peak = 0
        for kind, _chunk, _mb in rank_order(schedule, pp, m, v, rank):
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def test_peak_live_formula_equals_walking_the_ops():
    """The O(pp) formula of peak_live_microbatches equals counting live units along rank_order."""
    shapes = []
    for pp in (1, 2, 3, 4, 5, 8):
        for m in (1, 2, 3, 5, 8, 16):
            for sched in ("gpipe", "1f1b", "eager-1f1b"):
                shapes.append((sched, pp, m, 1))
            if pp >= 2:
                for v in (2, 3, 4):
                    for mm in (pp, 2 * pp, 3 * pp):
                        shapes.append(("interleaved-1f1b", pp, mm, v))
    for sched, pp, m, v in shapes:
        assert peak_live_microbatches(sched, pp, m, v) == _peak_by_walking(sched, pp, m, v), (sched, pp, m, v)


def test_graph_cache_keeps_at_most_its_node_budget(monkeypatch):
    """cached_graph: the same shape returns the same graph while cached; past GRAPH_CACHE_NODES the
    least recently used graphs leave (the newest always stays) and a shape asked for again is rebuilt
    equal."""
    from poseidon_plugin.simulator import core
    cache = core._GraphCache()
    first = cache("1f1b", 4, 8, 1, "dag")
    assert cache("1f1b", 4, 8, 1, "dag") is first
    monkeypatch.setattr(core, "GRAPH_CACHE_NODES", first.n_nodes + 1)
    second = cache("1f1b", 4, 12, 1, "dag")           # over the budget: the older graph leaves
    assert len(cache) == 1 and cache("1f1b", 4, 12, 1, "dag") is second
    again = cache("1f1b", 4, 8, 1, "dag")
    assert again is not first and again == first and len(cache) == 1
    monkeypatch.setattr(core, "GRAPH_CACHE_NODES", 1)  # a graph larger than the budget still stays
    assert cache("gpipe", 3, 6, 1, "megatron") is cache("gpipe", 3, 6, 1, "megatron")
    cache.cache_clear()
    assert len(cache) == 0


@pytest.mark.parametrize("comm_model", ["dag", "megatron", "megatron-overlap"])
@pytest.mark.parametrize("schedule,pp,m,v", [("1f1b", 4, 8, 1), ("1f1b", 3, 7, 1), ("gpipe", 3, 4, 1),
                                             ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 3, 6, 3)])
def test_compiled_kernel_folds_nodes_and_gives_the_same_finish_times(comm_model, schedule, pp, m, v):
    """The compiled kernel's packed form folds a node with one predecessor and one successor into that
    successor (_dag.pyx _pack): the Megatron p2p graphs lose many nodes, and the longest path and every
    node's finish time stay bit for bit those of the pure twin."""
    from poseidon_plugin.simulator import kernel_name
    from poseidon_plugin.simulator._pydag import DagKernel as PyKernel
    from poseidon_plugin.simulator.core import cached_graph

    if kernel_name() != "compiled":
        pytest.skip("POSEIDON_PURE_PYTHON is set or the compiled core is not built")
    from array import array

    from poseidon_plugin._core._dag import DagKernel
    g = cached_graph(schedule, pp, m, v, comm_model)
    a, b = DagKernel(g), PyKernel(g)
    if comm_model != "dag":
        assert 0 < a.packed_nodes < g.n_nodes
    rng = random.Random(f"{comm_model}-{schedule}-{pp}-{m}-{v}")
    for _ in range(20):
        params = array("d", [0.0] + [rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(a.n_params - 1)])
        assert a.longest(params) == b.longest(params)
        assert a.finish_times(params) == b.finish_times(params)
