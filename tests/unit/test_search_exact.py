"""The search: --exact finds the --exhaustive optimum on random small heterogeneous problems.

Both backends (compiled loop and its pure-Python twin, fixture ``pure_python``) run every instance; the
exhaustive reference simulates every plan of the space with no pruning at all.
"""

import dataclasses
import os
import random

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import InputError, NoFeasiblePlanError
from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.simulator import simulate
from poseidon_plugin.specs.cluster import parse_cluster
from poseidon_plugin.specs.model import parse_model

DEVICES = ["A2-2", "A2-3", "A2-4", "A100-80G", "RTX-4090", "RTX-3090"]
SCHEDULE_SETS = [("1f1b",), ("1f1b", "interleaved-1f1b"), ("gpipe", "eager-1f1b"),
                 ("eager-1f1b", "interleaved-1f1b"), ("1f1b", "gpipe")]


def random_problem(seed: int):
    """A tiny heterogeneous cluster and model whose whole plan space is enumerable."""
    rng = random.Random(seed)
    types = rng.sample(DEVICES, rng.choice([2, 2, 3]))
    nodes = [{"device_type": t, "count": rng.choice([1, 1, 2]), "devices_per_node": rng.choice([1, 2])}
             for t in types]
    cluster = parse_cluster({"name": f"rand{seed}", "device_types": types,
                             "links": rng.choice(["npu", "gpu"]), "nodes": nodes})
    heads = rng.choice([4, 8])
    hidden = 1024 * rng.choice([1, 2, 4])
    model = parse_model({
        "name": "tiny", "num_layers": rng.randint(3, 7), "hidden_size": hidden,
        "ffn_hidden_size": 4 * hidden, "num_attention_heads": heads, "num_query_groups": heads,
        "vocab_size": 32000, "seq_length": rng.choice([1024, 4096]),
        "global_batch_size": rng.choice([4, 8, 12, 16]),
        "distributed_optimizer": rng.choice([True, False])})
    cm = CostModel(cluster, model, micro_batch_sizes=(1, 2))
    schedules = SCHEDULE_SETS[seed % len(SCHEDULE_SETS)]
    return cm, schedules


def candidate(plan) -> Candidate:
    return Candidate(tp=plan.tp, pp=plan.pp, dp=plan.dp, mbs=plan.micro_batch_size,
                     stage_types=plan.stage_types, layers=plan.layers, schedule=plan.schedule,
                     virtual_stages=plan.virtual_stages)


def exact_and_exhaustive(cm, opts):
    """``(exact, exhaustive)`` results with the same options, their best and runner-up times checked
    equal. Every fixed seed below has feasible plans (a seed without any would compare nothing: it
    fails here instead of passing silently)."""
    ref = search(cm, SearchOptions(mode="exhaustive", **opts))
    assert ref.stats.simulator_calls > 0
    got = search(cm, SearchOptions(mode="exact", exact_alternatives=True, **opts))
    assert got.stats.complete
    assert got.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms
    assert ([a.predicted_iteration_ms for a in got.alternatives]
            == [a.predicted_iteration_ms for a in ref.alternatives])
    # without proven alternatives, the plan is still the optimum
    plan_only = search(cm, SearchOptions(mode="exact", **opts))
    assert plan_only.stats.complete
    assert plan_only.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms
    return got, ref


@pytest.mark.parametrize("seed", range(60))
def test_exact_equals_exhaustive(seed, pure_python):
    cm, schedules = random_problem(seed)
    opts = dict(schedules=schedules, top_k=2, warmup_samples=seed % 3 * 4, pure_python=pure_python)
    got, ref = exact_and_exhaustive(cm, opts)
    # the exact search simulates far fewer complete plans than the reference
    assert got.stats.simulator_calls <= ref.stats.simulator_calls + got.stats.warmup_samples + 3 * 64
    # the reported plan is the cost model's own prediction and fits memory
    cand = candidate(got.plan)
    assert cm.iteration_ms(cand) == got.plan.predicted_iteration_ms
    assert cm.fits(cand)
    # default mode searches a subset of the space (ridge, type blocks): never better than the optimum
    dflt = search(cm, SearchOptions(mode="default", **opts))
    assert dflt.plan.predicted_iteration_ms >= ref.plan.predicted_iteration_ms
    assert cm.fits(candidate(dflt.plan))


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_cutoff_keeps_the_optimum_below_it(seed, pure_python):
    """SearchOptions.cutoff_ms (another variant's plan): with the cutoff above the optimum the exact
    search still returns the optimum; at or below it, nothing faster than the cutoff is returned."""
    from poseidon_plugin.errors import NoFeasiblePlanError
    cm, schedules = random_problem(seed)
    opts = dict(schedules=schedules, top_k=2, warmup_samples=0, pure_python=pure_python)
    best = search(cm, SearchOptions(mode="exhaustive", **opts)).plan.predicted_iteration_ms
    got = search(cm, SearchOptions(mode="exact", cutoff_ms=best * 1.0001, **opts))
    assert got.stats.complete and got.plan.predicted_iteration_ms == best
    for cutoff in (best, best * 0.99):
        try:
            res = search(cm, SearchOptions(mode="exact", cutoff_ms=cutoff, **opts))
        except NoFeasiblePlanError:
            continue                 # no plan met at all: nothing below the cutoff either
        assert res.plan.predicted_iteration_ms >= best


@pytest.mark.skipif(os.environ.get("POSEIDON_PURE_PYTHON", "") not in ("", "0"),
                    reason="POSEIDON_PURE_PYTHON=1 forces the pure loop")
@pytest.mark.parametrize("seed", range(8))
def test_backends_agree_on_stats(seed):
    """The compiled loop and the uncompiled one take the same decisions (:func:`assert_backends_agree`)."""
    cm, schedules = random_problem(100 + seed)
    for mode in ("exact", "default"):
        assert_backends_agree(cm, SearchOptions(mode=mode, schedules=schedules, top_k=3, warmup_samples=20))


def assert_backends_agree(cm, options) -> None:
    """The same plan and alternatives on both backends, and every statistic equal (all counters, pruned
    per rule, structures, shapes, warm-up samples) but the wall time and the kernel's name -- which must
    say that each backend really ran."""
    compiled, pure = (search(cm, dataclasses.replace(options, pure_python=p)) for p in (False, True))
    assert (compiled.stats.kernel, pure.stats.kernel) == ("compiled", "pure-python")
    assert compiled.plan.plan_hash() == pure.plan.plan_hash()
    assert compiled.alternatives == pure.alternatives
    sa, sb = compiled.stats.to_dict(), pure.stats.to_dict()
    for d in (sa, sb):
        del d["wall_s"], d["kernel"]
    assert sa == sb
    assert sa["nodes"] > 0 and sa["simulator_calls"] > 0


def test_infeasible_problem_agrees():
    """When nothing fits, the exact and the exhaustive search both say so."""
    cm, schedules = random_problem(5)
    big = parse_model({"name": "huge", "num_layers": 4, "hidden_size": 65536, "ffn_hidden_size": 262144,
                       "num_attention_heads": 64, "vocab_size": 32000, "seq_length": 4096,
                       "global_batch_size": 8, "distributed_optimizer": False})
    cm = CostModel(cm.cluster, big, micro_batch_sizes=(1, 2))
    for mode in ("exact", "exhaustive"):
        with pytest.raises(NoFeasiblePlanError, match="no plan fits"):
            search(cm, SearchOptions(mode=mode, schedules=schedules))


def test_time_limit_returns_best_so_far():
    cm, schedules = random_problem(3)
    res = search(cm, SearchOptions(mode="exact", schedules=schedules, time_limit_s=1e-9,
                                   warmup_samples=20))
    assert not res.stats.complete
    assert res.plan.predicted_iteration_ms > 0


@pytest.mark.parametrize("comm_model,seed", [("megatron", s) for s in range(10)]
                         + [("megatron-overlap", s) for s in range(10, 15)])
def test_exact_equals_exhaustive_megatron_comm(comm_model, seed, pure_python):
    """With Megatron's p2p models (extra parameters at the end of the vector) the bounds, taken from
    dag paths, stay valid: --exact still finds the exhaustive optimum, and the plan's time is the cost
    model's prediction under the same comm model. The warm-up samples only plans of the space."""
    cm, schedules = random_problem(300 + seed)
    opts = dict(schedules=schedules, top_k=2, warmup_samples=seed % 3 * 100, pure_python=pure_python,
                comm_model=comm_model)
    got, _ref = exact_and_exhaustive(cm, opts)
    assert got.stats.to_dict()["comm_model"] == comm_model
    cand = candidate(got.plan)
    assert cm.iteration_ms(cand, comm_model) == got.plan.predicted_iteration_ms
    # the stage-level document names the comm model and simulates to the same time
    doc = cm.stage_input(cand, comm_model)
    assert doc["comm_model"] == comm_model and "comm_model" not in cm.stage_input(cand)
    assert simulate(doc).iteration_ms == pytest.approx(got.plan.predicted_iteration_ms, rel=1e-12)
    # Megatron's models are never faster than dag (why the dag-derived bounds remain lower bounds)
    assert cm.iteration_ms(cand) <= got.plan.predicted_iteration_ms


def test_comm_model_option_is_validated():
    with pytest.raises(InputError, match="--comm-model 'nccl'.*dag, megatron"):
        SearchOptions(comm_model="nccl")


def with_framework_costs(cm: CostModel, seed: int) -> CostModel:
    """The problem's cost model with a measured-like profile: per type, a framework cost per micro-batch
    step, a p2p call's CPU cost and an optimizer step (per layer and fixed), up to a layer's time."""
    import dataclasses

    rng = random.Random(seed)
    scale = {t: rng.uniform(0.0, 0.6) for t in cm.profile.device_types()}
    entries = tuple(dataclasses.replace(
        e, step_forward_ms=scale[e.device_type] * e.forward_ms, step_backward_ms=rng.uniform(0, 0.4) * e.forward_ms,
        optimizer_ms=rng.uniform(0, 0.3) * e.forward_ms, optimizer_fixed_ms=rng.uniform(0, 3) * e.forward_ms,
        p2p_call_ms=rng.uniform(0, 0.2) * e.forward_ms)
        for e in cm.profile.entries)
    profile = dataclasses.replace(cm.profile, entries=entries, source="measured")
    return CostModel(cm.cluster, cm.model, profile)


@pytest.mark.parametrize("comm_model,seed", [("dag", s) for s in range(12)]
                         + [("megatron", s) for s in range(12, 18)] + [("megatron-overlap", s) for s in range(18, 22)])
def test_exact_equals_exhaustive_with_framework_costs(comm_model, seed, pure_python):
    """Per-step framework costs and the optimizer step (constants per group) leave the bounds valid: --exact
    still finds the exhaustive optimum, whose time is the cost model's prediction including them."""
    cm, schedules = random_problem(500 + seed)
    cm = with_framework_costs(cm, seed)
    opts = dict(schedules=schedules, top_k=2, warmup_samples=seed % 3 * 10, pure_python=pure_python,
                comm_model=comm_model)
    assert cm.comm_extras["p2p_call_ms"] > 0
    got, _ref = exact_and_exhaustive(cm, opts)
    cand = candidate(got.plan)
    assert cm.iteration_ms(cand, comm_model) == got.plan.predicted_iteration_ms
    doc = cm.stage_input(cand, comm_model)   # the simulator's input carries the measured p2p call cost
    assert doc.get("p2p_call_ms", 0.0) == (cm.comm_extras["p2p_call_ms"] if comm_model != "dag" else 0.0)
    # the extras are in the stage times: every chunk pays a step, every rank its optimizer step
    fwd, bwd, _send, ar = cm.stage_times(cand)
    for r in range(cand.pp):
        gc = cm.group(cand.stage_types[r], cand.tp, cand.mbs, cand.dp)
        for c, n in enumerate(cand.chunk_layers(r)):
            assert fwd[r * cand.virtual_stages + c] >= n * gc.forward_ms + gc.step_forward_ms
        optimizer = gc.optimizer_fixed_ms + sum(cand.chunk_layers(r)) * gc.optimizer_ms
        assert optimizer > 0
        assert ar[r] == pytest.approx(optimizer) if cand.dp == 1 else ar[r] > optimizer
