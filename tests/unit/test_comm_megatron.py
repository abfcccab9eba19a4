"""Structural tests of the ``megatron`` communication model (simulator/comm_megatron.py).

The programs (which calls megatron makes, in which order) are checked against the simulator's op
orders and for data-flow consistency; the DAG built from them is checked against a slow, independent
event-driven execution of the same programs, and against the ``dag`` model (closed forms, dominance).
"""

from __future__ import annotations

import random
from array import array

import pytest

from poseidon_plugin.simulator import Simulator, rank_order, simulate
from poseidon_plugin.simulator import comm_megatron as cm
from poseidon_plugin.simulator.core import make_kernel
from poseidon_plugin.simulator.graph import GraphBuilder, make_shape

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "interleaved-1f1b")


def _shapes():
    """A grid of shapes every schedule supports, small enough to enumerate."""
    out = []
    for pp in range(1, 6):
        for m in range(1, 9):
            for sched in ("gpipe", "1f1b", "eager-1f1b"):
                out.append((sched, pp, m, 1))
            if pp >= 2 and m % pp == 0:
                for v in (2, 3):
                    out.append(("interleaved-1f1b", pp, m, v))
    return out


SHAPES = _shapes()


def _random_instance(rng: random.Random, schedule: str | None = None):
    sched = schedule or rng.choice(SCHEDULES)
    inter = sched == "interleaved-1f1b"
    pp = rng.randint(2 if inter else 1, 6)
    v = rng.randint(2, 3) if inter else 1
    m = pp * rng.randint(1, 3) if inter else rng.randint(1, 10)
    f = [rng.uniform(1.0, 10.0) for _ in range(pp * v)]
    b = [rng.uniform(1.0, 20.0) for _ in range(pp * v)]
    send = [rng.uniform(0.0, 3.0) for _ in range(pp)]
    ar = [rng.uniform(0.0, 3.0) for _ in range(pp)]
    return sched, pp, m, v, f, b, send, ar


def _evaluate(sched, pp, m, v, f, b, send, ar, *, overlap=False, call=0.0, pure_python=None):
    shape = make_shape(sched, pp, m, v, "megatron")
    builder = GraphBuilder(layout=shape.layout)
    (cm.build_overlap if overlap else cm.build)(builder, shape)
    kernel = make_kernel(builder.freeze(shape), pure_python)
    params = array("d", [0.0]) * shape.layout.size
    params[shape.layout.extra(cm.P2P_CALL)] = call
    return kernel.evaluate(params, f, b, send, ar)


def _execute(progs, pp, v, f, b, send, ar, call):
    """Independent reference: run every rank's program with rendezvous semantics, event by event.

    A rank advances through its instructions; a post costs ``call`` and stamps its ops; a wait blocks
    until each waited op's peer op has been posted, and then until the later post plus the link time.
    Pairing: per (source, destination), the j-th send with the j-th receive.
    Returns (iteration time, per rank the list of payloads received before each compute).
    """
    queues: dict = {}
    for prog in progs:
        for instr in prog.instructions:
            if instr[0] == cm.POST:
                for op_id in instr[1]:
                    is_send, peer, payload = prog.ops[op_id]
                    key = (prog.rank, peer) if is_send else (peer, prog.rank)
                    queues.setdefault(key, ([], []))[0 if is_send else 1].append((prog.rank, op_id, payload))
    partner, payload_of = {}, {}
    for (src, _dst), (snd, rcv) in queues.items():
        assert len(snd) == len(rcv)
        for (sr, sop, pl), (rr, rop, _) in zip(snd, rcv):
            partner[(sr, sop)], partner[(rr, rop)] = (rr, rop), (sr, sop)
            kind = pl[0]
            link = src if kind == "F" else (src - 1) % pp
            payload_of[(sr, sop)] = payload_of[(rr, rop)] = (pl, send[link])
    post_time: dict = {}
    pc, clock = [0] * pp, [0.0] * pp
    received = [set() for _ in range(pp)]
    inputs_seen = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for prog in progs:
            r = prog.rank
            while pc[r] < len(prog.instructions):
                instr = prog.instructions[pc[r]]
                if instr[0] == cm.COMPUTE:
                    _, kind, chunk, _mb = instr
                    inputs_seen[r].append((instr[1:], frozenset(received[r])))
                    clock[r] += f[r * v + chunk] if kind == "F" else b[r * v + chunk]
                elif instr[0] == cm.POST:
                    clock[r] += call
                    for op_id in instr[1]:
                        post_time[(r, op_id)] = clock[r]
                else:
                    ops = instr[1]
                    if any(partner[(r, o)] not in post_time for o in ops):
                        break  # blocked on a peer that has not posted yet
                    for o in ops:
                        pl, t = payload_of[(r, o)]
                        clock[r] = max(clock[r], max(post_time[(r, o)], post_time[partner[(r, o)]]) + t)
                        if not prog.ops[o][0]:
                            received[r].add(pl)
                pc[r] += 1
                progress = True
    assert all(pc[p.rank] == len(p.instructions) for p in progs), "reference execution deadlocked"
    return max(clock[r] + ar[r] for r in range(pp)), inputs_seen


@pytest.mark.parametrize(("sched", "pp", "m", "v"), SHAPES)
def test_programs_run_the_schedule_order_and_build_a_dag(sched, pp, m, v):
    """Each program computes exactly the schedule's op order; every channel balances; no cycle."""
    shape = make_shape(sched, pp, m, v, "megatron")
    for overlap in (False, True):
        progs = cm.programs(shape, overlap=overlap)
        for prog in progs:
            computes = [i[1:] for i in prog.instructions if i[0] == cm.COMPUTE]
            assert computes == [tuple(op) for op in rank_order(sched, pp, m, v, prog.rank)]
        cm.match_ops(progs)  # raises on unbalanced channels
        builder = GraphBuilder(layout=shape.layout)
        cm.build_programs(builder, shape, progs)
        builder.freeze(shape)  # raises on a cycle (a deadlocking program)


@pytest.mark.parametrize(("sched", "pp", "m", "v"), [s for s in SHAPES if s[1] >= 3 or s[0] != "interleaved-1f1b"])
def test_every_compute_has_received_its_input(sched, pp, m, v):
    """Data flow: a forward runs after the previous virtual stage's output of that micro-batch arrived,
    a backward after the next virtual stage's gradient (pp = 2 interleaved aside: megatron sends both
    directions on one channel there, so pairing by order is not pairing by payload)."""
    shape = make_shape(sched, pp, m, v, "megatron")
    nvs = pp * v
    for overlap in (False, True):
        progs = cm.programs(shape, overlap=overlap)
        ones = [1.0] * nvs
        _, seen = _execute(progs, pp, v, ones, ones, [1.0] * pp, [0.0] * pp, 0.0)
        for r in range(pp):
            for (kind, chunk, mb), got in seen[r]:
                vs = chunk * pp + r
                if kind == "F" and vs > 0:
                    src = vs - 1
                    assert ("F", src // pp, mb) in got, (overlap, r, kind, chunk, mb)
                if kind == "B" and vs < nvs - 1:
                    src = vs + 1
                    assert ("B", src // pp, mb) in got, (overlap, r, kind, chunk, mb)


@pytest.mark.parametrize("overlap", [False, True])
def test_dag_equals_event_driven_reference(overlap, pure_python):
    """Longest path over the built DAG equals executing the programs with rendezvous semantics."""
    rng = random.Random(5 + overlap)
    for _ in range(150):
        sched, pp, m, v, f, b, send, ar = _random_instance(rng)
        call = rng.choice([0.0, rng.uniform(0.0, 1.0)])
        shape = make_shape(sched, pp, m, v, "megatron")
        ref, _ = _execute(cm.programs(shape, overlap=overlap), pp, v, f, b, send, ar, call)
        got = _evaluate(sched, pp, m, v, f, b, send, ar, overlap=overlap, call=call, pure_python=pure_python)
        assert got == pytest.approx(ref, rel=1e-9, abs=1e-9), (sched, pp, m, v)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "eager-1f1b"])
def test_free_transfers_reduce_to_dag(schedule, pure_python):
    """With free transfers and calls, only the data flow orders ranks: megatron == dag."""
    rng = random.Random(11)
    for _ in range(100):
        sched, pp, m, v, f, b, _send, ar = _random_instance(rng, schedule)
        zero = [0.0] * pp
        dag = Simulator(sched, pp, m, v, "dag", pure_python=pure_python).iteration_time(f, b, zero, ar)
        meg = Simulator(sched, pp, m, v, "megatron", pure_python=pure_python).iteration_time(f, b, zero, ar)
        assert meg == pytest.approx(dag, rel=1e-12)


@pytest.mark.parametrize(("schedule", "pp", "m"), [("1f1b", 4, 8), ("1f1b", 3, 3), ("gpipe", 4, 6), ("1f1b", 1, 5)])
def test_homogeneous_closed_form(schedule, pp, m, pure_python):
    """Free transfers, equal stages: (M + pp - 1)(F + B) + all-reduce, as for the dag model."""
    f, b = 3.0, 7.0
    sim = Simulator(schedule, pp, m, 1, "megatron", pure_python=pure_python)
    assert sim.iteration_time([f] * pp, [b] * pp, [0.0] * pp, [2.0] * pp) == pytest.approx((m + pp - 1) * (f + b) + 2.0)


@pytest.mark.parametrize("pp", [3, 4, 6])
def test_homogeneous_1f1b_steady_step_pays_two_exchanges(pp, pure_python):
    """Equal stages, link time t: in the steady state every extra micro-batch adds F + B plus two
    blocking exchanges (send activation / receive gradient, then send gradient / receive activation)."""
    f, b, t = 3.0, 7.0, 0.5

    def it(model, m):
        sim = Simulator("1f1b", pp, m, 1, model, pure_python=pure_python)
        return sim.iteration_time([f] * pp, [b] * pp, [t] * pp, [0.0] * pp)

    for m in (pp, 2 * pp):
        assert it("megatron", m + 1) - it("megatron", m) == pytest.approx(f + b + 2 * t)


@pytest.mark.parametrize("overlap", [False, True])
def test_never_faster_than_dag(overlap):
    """Every dag edge is implied by a program edge of at least the same delay: megatron >= dag."""
    rng = random.Random(23 + overlap)
    for _ in range(300):
        sched, pp, m, v, f, b, send, ar = _random_instance(rng)
        dag = Simulator(sched, pp, m, v, "dag").iteration_time(f, b, send, ar)
        meg = _evaluate(sched, pp, m, v, f, b, send, ar, overlap=overlap, call=rng.uniform(0.0, 0.5))
        assert meg >= dag - 1e-9 * dag, (sched, pp, m, v)


def test_monotone_in_call_cost_and_transfer():
    """More per-call cost or a slower link never makes the iteration faster."""
    rng = random.Random(31)
    for _ in range(100):
        sched, pp, m, v, f, b, send, ar = _random_instance(rng)
        overlap = rng.random() < 0.5
        base = _evaluate(sched, pp, m, v, f, b, send, ar, overlap=overlap, call=0.1)
        assert _evaluate(sched, pp, m, v, f, b, send, ar, overlap=overlap, call=0.3) >= base - 1e-9
        slower = [s + rng.uniform(0.0, 1.0) for s in send]
        assert _evaluate(sched, pp, m, v, f, b, slower, ar, overlap=overlap, call=0.1) >= base - 1e-9


def test_interleaved_blocking_couples_neighbours_even_with_free_links():
    """Megatron's interleaved schedule without overlap: a rank cannot run ahead of a neighbour that has not
    posted the matching call, so uneven stages cost more than the dag model says even with free links."""
    pp, m, v = 4, 8, 2
    f = [1.0, 8.0, 1.0, 8.0, 8.0, 1.0, 8.0, 1.0]
    b = [2.0 * x for x in f]
    zero = [0.0] * pp
    dag = Simulator("interleaved-1f1b", pp, m, v, "dag").iteration_time(f, b, zero, zero)
    meg = Simulator("interleaved-1f1b", pp, m, v, "megatron").iteration_time(f, b, zero, zero)
    assert meg > dag * 1.01


def test_stage_level_document_takes_the_call_cost():
    """``"comm_model": "megatron"`` and its ``p2p_call_ms`` field go through ``simulate(doc)``."""
    doc = {"schedule": "1f1b", "micro_batches": 4, "comm_model": "megatron",
           "stages": [{"forward_ms": [2.0], "backward_ms": [4.0], "send_ms": 0.5, "allreduce_ms": 1.0}] * 3}
    base = simulate(doc).iteration_ms
    with_cost = simulate(dict(doc, p2p_call_ms=0.25)).iteration_ms
    assert with_cost > base
    sim = Simulator("1f1b", 3, 4, 1, "megatron")
    sim.set_extra(cm.P2P_CALL, 0.25)
    assert sim.iteration_time([2.0] * 3, [4.0] * 3, [0.5] * 3, [1.0] * 3) == pytest.approx(with_cost)


@pytest.mark.parametrize("comm_model", ["megatron", "megatron-overlap"])
def test_the_compiled_twin_builds_the_same_graphs(comm_model):
    """``graph.build_graph`` runs the compiled ``comm_megatron`` where it is built (the same source,
    ``cython_core/comm_megatron.py``): every node, edge, weight and label as the source run uncompiled,
    on every small shape and on two large ones (1,024 micro-batches; interleaved at PP 16)."""
    import importlib
    from importlib.machinery import EXTENSION_SUFFIXES

    core = importlib.import_module("poseidon_plugin._core.comm_megatron")
    if not core.__file__.endswith(tuple(EXTENSION_SUFFIXES)):
        pytest.fail("the compiled core is not built: run `pip install -e .` "
                    "(or `python setup.py build_ext --inplace`) first")
    shapes = [(*s, comm_model) for s in SHAPES] + [("1f1b", 12, 1024, 1, comm_model),
                                                   ("interleaved-1f1b", 16, 64, 2, comm_model)]
    for shape_args in shapes:
        shape = make_shape(*shape_args)
        graphs = []
        for module in (cm, core):
            builder = GraphBuilder(layout=shape.layout)
            module.build(builder, shape)
            graphs.append(builder.freeze(shape))
        assert graphs[0] == graphs[1], shape_args


@pytest.mark.parametrize("enabled", [True, False])
def test_a_graph_build_leaves_the_garbage_collector_as_it_found_it(enabled):
    """``build_graph`` pauses the cyclic collector while it allocates the graph, then restores it."""
    import gc

    from poseidon_plugin.simulator.graph import build_graph

    before = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        graph = build_graph("1f1b", 3, 4, 1, "megatron")
        assert graph.n_nodes > 0
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if before else gc.disable)()


@pytest.mark.parametrize("comm_model", ["dag", "megatron", "megatron-overlap"])
def test_a_graph_build_leaves_no_cyclic_garbage(comm_model, pure_python, monkeypatch):
    """What a build allocates and does not keep is freed as it goes (reference counts), on both backends.
    Compiled, a reference cycle through ``build_programs``' closure scope kept the whole build's state
    alive until the collector walked it (8,467 objects here; ~850,000, 0.4 s, after a 1F1B build with
    1,024 micro-batches)."""
    import gc

    from poseidon_plugin.backend import PURE_ENV
    from poseidon_plugin.simulator.graph import build_graph

    if pure_python:
        monkeypatch.setenv(PURE_ENV, "1")
    before = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1), ("eager-1f1b", 1)):
            graph = build_graph(schedule, 4, 8, v, comm_model)
            assert graph.n_nodes > 0
            assert gc.collect() == 0, (schedule, comm_model)
    finally:
        (gc.enable if before else gc.disable)()
