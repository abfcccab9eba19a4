"""MoE jobs: the expert layout (EP, expert TP) searched with megatron-core's rules, priced, and put in the plan.

The pricing checks compare one layout with another on the same group (what EP changes: the all-to-all over
the EP group's link, the expert weights and optimizer states split by EP and sharded over expert DP, the
expert-DP gradient sync); the searches compare ``--exact`` with ``--exhaustive`` on tiny MoE problems and
check that Mixtral on the paper's Setting 4 gets an EP > 1 plan because it is faster than the best without.
"""

import dataclasses
import random

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel, check_expert_layout, expert_layouts
from poseidon_plugin.errors import InputError, PoseidonError
from poseidon_plugin.plan import Plan, expert_args, megatron_args, mindspeed_args, parse_expert_args, render_table
from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.specs import LINK_INTER_NODE, LINK_INTRA_NODE, load_cluster, load_model
from poseidon_plugin.specs.analytic import all_to_all_ms, expert_params
from poseidon_plugin.specs.cluster import parse_cluster
from poseidon_plugin.specs.model import parse_model
from poseidon_plugin.specs.profile import parse_profile
from poseidon_plugin.target import TargetRuntime, search_plan


def moe_model(**changes):
    doc = {"name": "tiny-moe", "num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 2048,
           "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 32000, "seq_length": 2048,
           "global_batch_size": 8, "num_experts": 8, "moe_top_k": 2}
    doc.update(changes)
    return parse_model(doc)


def two_node_cluster(per_node=4):
    return parse_cluster({"name": "two", "device_types": ["A2-2"], "links": "npu",
                          "nodes": [{"device_type": "A2-2", "count": 2, "devices_per_node": per_node}]})


# --- the model spec ------------------------------------------------------------------------------

def test_moe_fields_read_and_round_trip():
    m = moe_model(moe_ffn_hidden_size=512, moe_shared_expert_size=1024, moe_capacity_factor=1.25,
                  moe_pad_to_capacity=True, moe_grouped_gemm=True)
    assert m.expert_ffn_hidden_size == 512
    assert parse_model(m.to_dict(), "again") == m
    assert moe_model().expert_ffn_hidden_size == 2048     # Megatron's default: the FFN size


@pytest.mark.parametrize("changes, match", [
    ({"num_experts": 0, "moe_top_k": 0, "moe_ffn_hidden_size": 512}, "invalid for a dense model"),
    ({"moe_pad_to_capacity": True}, "needs a moe_capacity_factor"),
    ({"num_experts": 0, "moe_top_k": 0, "moe_grouped_gemm": True}, r"moe_grouped_gemm = \S+ is invalid for a dense"),
    ({"moe_capacity_factor": -1.0}, "moe_capacity_factor"),
])
def test_bad_moe_fields_are_named(changes, match):
    with pytest.raises(InputError, match=match):
        moe_model(**changes)


def test_shared_experts_and_the_expert_size_change_the_parameters():
    base = moe_model()
    small = moe_model(moe_ffn_hidden_size=1024)
    shared = moe_model(moe_shared_expert_size=2048)
    assert expert_params(small) * 2 == expert_params(base)
    cm = CostModel(two_node_cluster(), base)
    assert CostModel(two_node_cluster(), shared).group("A2-2", 1, 1, 1).layer_state_bytes > \
        cm.group("A2-2", 1, 1, 1).layer_state_bytes


# --- megatron-core's rules -----------------------------------------------------------------------

def test_expert_layouts_follow_megatron_core():
    m = moe_model()
    # TP 2 x DP 2 = 4 ranks: EP x expert TP must divide them, EP the 8 experts, expert TP the TP
    assert expert_layouts(m, 2, 2) == ((1, None), (1, 1), (2, None), (2, 1), (4, 1))
    assert expert_layouts(m, 1, 8) == ((1, None), (2, None), (4, None), (8, None))
    # TP 4 x DP 2: every expert TP dividing TP is searched (4 = Megatron's default None, 2, 1), not only TP or 1
    assert expert_layouts(m, 4, 2) == ((1, None), (1, 2), (1, 1), (2, None), (2, 2), (2, 1), (4, 2), (4, 1),
                                       (8, 1))
    assert expert_layouts(parse_model({**m.to_dict(), "num_experts": 0, "moe_top_k": 0}), 2, 2) == ((1, None),)
    # EP > 1 with TP > 1 needs sequence parallelism
    assert expert_layouts(moe_model(sequence_parallel=False), 2, 2) == ((1, None), (1, 1))
    for ep, etp, match in ((3, None, "divide num_experts"), (4, None, "must divide a stage"),
                           (2, 4, "must divide TP")):
        with pytest.raises(InputError, match=match):
            check_expert_layout(m, 2, 2, ep, etp)
    with pytest.raises(InputError, match="--ep 3 is not possible"):
        expert_layouts(m, 2, 2, (3,))


# --- prices --------------------------------------------------------------------------------------

def test_expert_parallelism_splits_expert_state_and_syncs_on_expert_dp():
    m = moe_model()
    cm = CostModel(two_node_cluster(), m)
    none, ep4 = cm.group("A2-2", 1, 1, 4), cm.group("A2-2", 1, 1, 4, 4)
    per_param = cm.param_bytes + cm.grad_bytes
    experts = expert_params(m)
    # weights and grads of 3/4 of the experts leave each device; the optimizer states were sharded over DP 4,
    # are now over expert DP 1 (a quarter of the experts, whole)
    expected = (none.layer_state_bytes - experts * (per_param + cm.optimizer_bytes / 4)
                + experts / 4 * (per_param + cm.optimizer_bytes))
    assert ep4.layer_state_bytes == pytest.approx(expected)
    # expert DP 1: the experts' gradients do not sync any more, only the dense part's over DP 4
    assert ep4.allreduce_ms[LINK_INTRA_NODE] < none.allreduce_ms[LINK_INTRA_NODE]
    ep2 = cm.group("A2-2", 1, 1, 4, 2)
    assert ep4.allreduce_ms[LINK_INTRA_NODE] < ep2.allreduce_ms[LINK_INTRA_NODE] < none.allreduce_ms[LINK_INTRA_NODE]


def test_the_all_to_all_takes_the_ep_group_s_link():
    m = moe_model()
    cm = CostModel(two_node_cluster(per_node=4), m)
    assert cm.expert_link("A2-2", 1, 4) == LINK_INTRA_NODE      # a block of 4 devices: one node
    assert cm.expert_link("A2-2", 1, 8) == LINK_INTER_NODE      # 8: both nodes
    one, ep4, ep8 = (cm.group("A2-2", 1, 1, 8, ep) for ep in (1, 4, 8))
    # the dispatch + combine all-to-all blocks the layer, forward and backward, the inter-node one most
    assert one.forward_ms < ep4.forward_ms < ep8.forward_ms
    assert one.backward_ms < ep4.backward_ms < ep8.backward_ms
    # at TP 1 the layer gains exactly the dispatch and the combine: each device sends its tokens x top-2
    sent = 1 * 2048 * 2 * 1024 * 2
    for gc, ep, kind in ((ep4, 4, LINK_INTRA_NODE), (ep8, 8, LINK_INTER_NODE)):
        link = cm.cluster.link("A2-2", kind)
        a2a = all_to_all_ms(sent, ep, link.bytes_per_ms * cm.constants.link_efficiency, link.latency_ms)
        assert gc.forward_ms - one.forward_ms == pytest.approx(2 * a2a, rel=1e-12)
        assert gc.backward_ms - one.backward_ms == pytest.approx(2 * a2a, rel=1e-12)


def test_a_measured_ep_entry_replaces_the_analytic_term():
    # the profiler's measured layer at EP 4 (expert TP = TP, inside a node) is the layer's time there;
    # an unmeasured EP, expert TP 1 and EP 8 (its group across the nodes) keep the analytic term
    m = moe_model()
    cluster = two_node_cluster(per_node=4)
    analytic = CostModel(cluster, m)
    base = analytic.profile
    entries = tuple(dataclasses.replace(e, expert_parallel=((4, 7.5, 11.25), (8, 9.0, 13.5))) for e in base.entries)
    measured = CostModel(cluster, m, dataclasses.replace(base, entries=entries, source="measured"))
    ep4 = measured.group("A2-2", 1, 1, 8, 4)
    assert (ep4.forward_ms, ep4.backward_ms) == (7.5, 11.25)
    assert analytic.group("A2-2", 1, 1, 8, 4).forward_ms != 7.5
    for args in ((1, 1, 8, 2), (1, 1, 8, 8), (2, 1, 4, 4, 1)):
        got, want = measured.group("A2-2", *args), analytic.group("A2-2", *args)
        assert (got.forward_ms, got.backward_ms) == (want.forward_ms, want.backward_ms), args
    # the field is data: it round-trips through the profile file and bad values are named
    doc = measured.profile.to_dict()
    assert parse_profile(doc).entries[0].expert_parallel == ((4, 7.5, 11.25), (8, 9.0, 13.5))
    doc["entries"][0]["expert_parallel"] = [{"ep": 4, "forward_ms": 0, "backward_ms": 1.0}]
    with pytest.raises(InputError, match=r"expert_parallel\[0\]"):
        parse_profile(doc)


def test_expert_tp_one_drops_the_mlp_collective():
    """EP 1 with expert TP 1 (experts whole on each TP rank, its own tokens): no MoE communication at all,
    faster than the profiled TP-split experts, with TP x the expert weights."""
    cm = CostModel(two_node_cluster(), moe_model())
    split, whole = cm.group("A2-2", 2, 1, 1), cm.group("A2-2", 2, 1, 1, 1, 1)
    assert whole.forward_ms < split.forward_ms and whole.layer_state_bytes > split.layer_state_bytes
    # expert TP < TP gives the experts data parallelism even at DP 1: their gradients sync
    assert whole.allreduce_ms[LINK_INTRA_NODE] > 0 == split.allreduce_ms[LINK_INTRA_NODE]
    cand = Candidate(tp=2, pp=2, dp=1, mbs=1, stage_types=("A2-2", "A2-2"), layers=(2, 2), ep=1, etp=1)
    assert all(ms > 0 for ms in cm.stage_times(cand)[3])


def test_load_imbalance_and_capacity_move_the_expert_gemms():
    cluster = two_node_cluster()
    balanced = CostModel(cluster, moe_model()).group("A2-2", 1, 1, 4, 4)
    skewed = CostModel(cluster, moe_model(), constants={"moe_load_imbalance": 1.5}).group("A2-2", 1, 1, 4, 4)
    capped = CostModel(cluster, moe_model(moe_capacity_factor=1.2),
                       constants={"moe_load_imbalance": 1.5}).group("A2-2", 1, 1, 4, 4)
    assert balanced.forward_ms < capped.forward_ms < skewed.forward_ms


# --- the search ----------------------------------------------------------------------------------

def random_moe_problem(seed: int) -> CostModel:
    rng = random.Random(seed)
    types = rng.sample(["A2-2", "A2-3", "A2-4", "RTX-4090"], 2)
    per_node = rng.choice([2, 4])
    nodes = [{"device_type": t, "count": rng.choice([1, 2]), "devices_per_node": per_node} for t in types]
    cluster = parse_cluster({"name": f"moe{seed}", "device_types": types, "links": rng.choice(["npu", "gpu"]),
                             "nodes": nodes})
    hidden = 1024 * rng.choice([1, 2])
    model = moe_model(num_layers=rng.randint(3, 5), hidden_size=hidden, ffn_hidden_size=rng.choice([1, 2]) * hidden,
                      num_experts=rng.choice([4, 8]), moe_top_k=2, seq_length=rng.choice([1024, 4096]),
                      global_batch_size=rng.choice([4, 8]), distributed_optimizer=rng.choice([True, False]))
    return CostModel(cluster, model, micro_batch_sizes=(1, 2))


@pytest.mark.parametrize("seed", range(12))
def test_exact_equals_exhaustive_on_small_moe_problems(seed):
    cm = random_moe_problem(seed)
    opts = {"schedules": ("1f1b", "interleaved-1f1b"), "warmup_samples": 4, "max_pipeline_stages": 3}
    ref = search(cm, SearchOptions(mode="exhaustive", **opts))
    got = search(cm, SearchOptions(mode="exact", exact_alternatives=True, **opts))
    assert got.stats.complete and got.stats.gap == 0.0
    assert got.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms
    assert [a.predicted_iteration_ms for a in got.alternatives] == [a.predicted_iteration_ms for a in ref.alternatives]


@pytest.mark.parametrize("seed", range(0, 12, 3))
def test_exact_equals_exhaustive_through_the_target_on_small_moe_problems(seed):
    """As ``poseidon plan --exact`` / ``--exhaustive`` run it: both p2p-overlap variants, the target's schedules."""
    from .test_search_target_exact import both

    exact, ref = both(random_moe_problem(seed))
    assert exact is not None and ref is not None
    assert exact.plan.predicted_iteration_ms == ref.plan.predicted_iteration_ms
    assert exact.plan.search_stats["complete"] is True and exact.plan.search_stats["gap"] == 0.0


def test_the_small_moe_problems_choose_expert_parallelism_somewhere():
    """The comparison above is not only between EP 1 plans: some best plans use EP > 1 or expert TP 1."""
    layouts = {(p.ep, p.etp) for p in (search(random_moe_problem(s), SearchOptions(
        mode="exact", schedules=("1f1b",), warmup_samples=4, max_pipeline_stages=3)).plan for s in range(12))}
    assert layouts - {(1, None)}


@pytest.fixture(scope="module")
def setting4():
    return CostModel(load_cluster("paper-setting-4"), load_model("mixtral-8x7b"))


def test_mixtral_on_setting_4_gets_expert_parallelism_because_it_is_faster(setting4):
    best = search_plan(setting4, TargetRuntime()).plan
    without = search_plan(setting4, TargetRuntime(), SearchOptions(expert_parallel=(1,))).plan
    assert best.ep > 1 and (without.ep, without.etp) == (1, None)
    assert best.predicted_iteration_ms < without.predicted_iteration_ms
    assert best.search_stats["complete"] is True
    flags = megatron_args(best)
    assert flags[flags.index("--expert-model-parallel-size") + 1] == str(best.ep)
    assert "--expert-model-parallel-size" in mindspeed_args(best)
    assert parse_expert_args(flags) == (best.ep, best.etp)
    assert f"experts: EP {best.ep}" in render_table(best)
    # re-priced from its candidate, the plan's time is the cost model's
    cand = Candidate(tp=best.tp, pp=best.pp, dp=best.dp, mbs=best.micro_batch_size, stage_types=best.stage_types,
                     layers=best.layers, schedule=best.schedule, virtual_stages=best.virtual_stages,
                     ep=best.ep, etp=best.etp)
    assert setting4.iteration_ms(cand, "megatron") == pytest.approx(best.predicted_iteration_ms, rel=1e-12)


# --- the plan ------------------------------------------------------------------------------------

def _moe_plan(ep=2, etp=1):
    cm = CostModel(two_node_cluster(), moe_model())
    return cm.make_plan(Candidate(tp=2, pp=2, dp=2, mbs=1, stage_types=("A2-2", "A2-2"), layers=(2, 2),
                                  ep=ep, etp=etp))


def test_plan_round_trips_its_expert_layout():
    plan = _moe_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan and (again.ep, again.etp) == (2, 1)
    assert parse_expert_args(megatron_args(plan)) == (2, 1)
    assert expert_args(plan) == ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                 "--moe-token-dispatcher-type", "alltoall"]
    # without expert parallelism nothing is written: a dense plan's document (and hash) has no ep / etp
    plain = _moe_plan(ep=1, etp=None)
    assert "ep" not in plain.to_dict() and "etp" not in plain.to_dict() and expert_args(plain) == []
    assert parse_expert_args(megatron_args(plain)) == (1, None)


@pytest.mark.parametrize("changes, match", [({"ep": 3}, "do not fit"), ({"etp": 2}, "equals tp"),
                                            ({"ep": 0}, "ep = 0 is invalid")])
def test_plan_refuses_an_expert_layout_megatron_cannot_run(changes, match):
    with pytest.raises(InputError, match=match):
        dataclasses.replace(_moe_plan(), **changes)


# --- the job's flags -----------------------------------------------------------------------------

JOB = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--num-experts", "4", "--moe-router-topk", "2"]


def test_job_flags_read_the_moe_flags():
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import model_spec

    job = read_job("pretrain_gpt.py", JOB + ["--moe-ffn-hidden-size", "96", "--moe-shared-expert-intermediate-size",
                                             "128", "--moe-expert-capacity-factor", "1.5",
                                             "--moe-pad-expert-input-to-capacity", "--expert-model-parallel-size", "2",
                                             "--moe-grouped-gemm"])
    spec = model_spec(job, global_batch_size=8, name="job")
    assert spec.moe_grouped_gemm   # carried: the measured profile is keyed on it (profiler.cache_key)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size, spec.moe_shared_expert_size,
            spec.moe_capacity_factor, spec.moe_pad_to_capacity) == (4, 2, 96, 128, 1.5, True)
    assert job.expert_parallel == 2


@pytest.mark.parametrize("extra, match", [(["--moe-layer-freq", "2"], "--moe-layer-freq '2' is not supported"),
                                          (["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity"),
                                          (["--moe-expert-capacity-factor", "x"], "is not a number")])
def test_job_flags_refuse_what_the_planner_cannot_price(extra, match):
    from poseidon_plugin.runtime.job_flags import read_job

    with pytest.raises(PoseidonError, match=match):
        read_job("pretrain_gpt.py", JOB + extra)


# --- the deterministic emulation -----------------------------------------------------------------

def test_the_deterministic_emulation_times_the_plan_s_all_to_all_in_each_moe_layer():
    """Bound to an EP plan, an emulated rank's MoE layer deadline grows by what the cost model added for the
    expert layout (the all-to-all blocks the layer), so the emulated job runs what was predicted."""
    from poseidon_plugin.emulation import harness as emulation
    from poseidon_plugin.specs import ModelSpec, ProfileEntry, ProfileSpec

    state = emulation.deterministic_state(emulate="A2-2:2,A2-4:2", emulate_model="mixtral-8x7b:0.25", rank=2,
                                          world_size=4, num_layers=4, global_batch=8, micro_batch_size=1)
    job = ModelSpec(name="job", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                    num_query_groups=4, vocab_size=512, seq_length=32, global_batch_size=8, dtype="fp32",
                    num_experts=4, moe_top_k=2)
    entries = tuple(ProfileEntry(**state.emulated_entry(t, 1, 1)) for t in ("A2-2", "A2-4"))
    cm = CostModel(state.cluster, job, ProfileSpec(model="job", seq_length=32, dtype="fp32", entries=entries,
                                                   source="measured"))
    before = state.targets_ms("layer", 1, 1)
    plan = cm.make_plan(Candidate(tp=1, pp=2, dp=2, mbs=1, stage_types=("A2-2", "A2-4"), layers=(2, 2), ep=2),
                        comm_model="megatron")
    state.bind_plan(plan, 2, job)
    group = cm.group("A2-4", 1, 1, 2, 2)
    extra = (group.forward_ms - entries[1].forward_ms, group.backward_ms - entries[1].backward_ms)
    assert extra[0] > 0 and extra[1] > 0
    after = state.targets_ms("layer", 1, 1)
    assert after == pytest.approx((before[0] + extra[0], before[1] + extra[1]), rel=1e-12)
    # the planned stage time is the emulated one: layers x the deadline
    assert plan.stages[1].forward_ms[0] == pytest.approx(2 * after[0] + state.targets_ms("head", 1, 1)[0], rel=1e-9)


def test_moe_without_sequence_parallelism_plans_tp_1_only():
    """megatron-core's MoE layer refuses to train with TP > 1 and no sequence parallelism (moe_layer.py)."""
    from poseidon_plugin.specs import valid_tp_degrees

    cluster = two_node_cluster()
    assert valid_tp_degrees(cluster, moe_model(), "A2-2") == (1, 2, 4)
    assert valid_tp_degrees(cluster, moe_model(sequence_parallel=False), "A2-2") == (1,)
