"""``--poseidon-emulate``: parsing, world-size check, the documented slow-down factors."""

from __future__ import annotations

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.emulation.harness import EmulatedNode, check_world, parse_emulate, slowdown_factors, types_by_rank
from poseidon_plugin.specs import device_presets

KNOWN = ("A2-2", "A2-3", "A2-4", "RTX-3090")


def test_parse_entries_in_order():
    nodes = parse_emulate(" A2-2:2, A2-4:2 ,", KNOWN)
    assert nodes == (EmulatedNode(device_type="A2-2", devices=2), EmulatedNode(device_type="A2-4", devices=2))
    assert types_by_rank(nodes) == ["A2-2", "A2-2", "A2-4", "A2-4"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("A2-2", r"entry 'A2-2' is not TYPE:COUNT; e.g. --poseidon-emulate A2-2:2,A2-4:2"),
        ("A2-2:two", r"COUNT 'two' is not an integer"),
        ("A2-2:0", r"COUNT must be >= 1"),
        ("H100:2", r"unknown device type 'H100'; known: A2-2, A2-3, A2-4, RTX-3090"),
        (" , ", r"names no device"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(PoseidonError, match=match):
        parse_emulate(text, KNOWN)


def test_world_size_must_match():
    nodes = parse_emulate("A2-2:2,A2-4:1", KNOWN)
    check_world(nodes, 3)
    with pytest.raises(PoseidonError, match=r"declares 3 devices but the job has 4 ranks.*--nproc-per-node 3"):
        check_world(nodes, 4)


def test_factors_are_peak_ratios():
    factors = slowdown_factors({"A2-2": 376.0, "A2-4": 280.0, "RTX-3090": 71.0})
    assert factors["A2-2"] == 1.0
    assert factors["A2-4"] == pytest.approx(376 / 280)
    assert factors["RTX-3090"] == pytest.approx(376 / 71)
    assert slowdown_factors({}) == {}


def test_paper_presets_are_emulatable():
    assert {"A2-2", "A2-3", "A2-4"} <= set(device_presets())
    parse_emulate("A2-2:1,A2-3:1,A2-4:1", device_presets())


# --- deterministic emulation: --poseidon-emulate-model ------------------------------------------------------

import subprocess  # noqa: E402
import sys  # noqa: E402

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.emulation import harness as emulation  # noqa: E402
from poseidon_plugin.specs import (LINK_CROSS_TYPE, LINK_INTER_NODE, LINK_INTRA_NODE, ModelSpec,  # noqa: E402
                                   ProfileEntry, ProfileSpec, analytic_entry, constants_for, load_model,
                                   model_presets)

MODELS = model_presets()
LINKS = tuple(emulation.link_families())


@pytest.mark.parametrize(
    "text, preset, scale, links",
    [
        ("llama3-8b", "llama3-8b", None, "npu"),
        ("llama3-8b:0.5", "llama3-8b", 0.5, "npu"),
        ("llama3-8b:auto:gpu", "llama3-8b", None, "gpu"),
        (" llama2-13b::npu-wan ", "llama2-13b", None, "npu-wan"),
    ],
)
def test_parse_emulate_model(text, preset, scale, links):
    spec = emulation.parse_emulate_model(text, MODELS, LINKS)
    assert (spec.preset, spec.scale, spec.links) == (preset, scale, links)


@pytest.mark.parametrize(
    "text, match",
    [
        ("", r"--poseidon-emulate-model '' is not PRESET\[:SCALE\[:LINKS\]\]"),
        ("gpt-5", r"unknown model preset 'gpt-5'; known: .*llama3-8b"),
        ("llama3-8b:fast", r"SCALE 'fast' is not a number or 'auto'"),
        ("llama3-8b:0", r"SCALE must be a finite number > 0"),
        ("llama3-8b:inf", r"SCALE must be a finite number > 0"),
        ("llama3-8b:1:infiniband", r"unknown link preset 'infiniband'; known: npu, gpu, npu-wan"),
        ("llama3-8b:1:npu:x", r"is not PRESET\[:SCALE\[:LINKS\]\]"),
    ],
)
def test_parse_emulate_model_errors(text, match):
    with pytest.raises(PoseidonError, match=match):
        emulation.parse_emulate_model(text, MODELS, LINKS)


def _state(emulate="A2-2:2,A2-4:2", model="llama3-8b:0.25", rank=2, layers=8, gbs=8):
    nodes = parse_emulate(emulate, device_presets())
    return emulation.deterministic_state(emulate=emulate, emulate_model=model, rank=rank,
                                         world_size=sum(n.devices for n in nodes), num_layers=layers,
                                         global_batch=gbs, micro_batch_size=1)


def test_links_scale_with_compute_and_memory_is_the_presets():
    state = _state()
    assert state.device_type == "A2-4" and state.scale == 0.25
    real, scaled = state.real_cluster, state.cluster
    for kind in ("intra_node", "inter_node", "cross_type"):
        assert getattr(scaled, kind).bandwidth_gbps == pytest.approx(getattr(real, kind).bandwidth_gbps / 0.25)
        assert getattr(scaled, kind).latency_us == pytest.approx(getattr(real, kind).latency_us * 0.25)
    assert real.cross_type.bandwidth_gbps == 75  # the npu family of devices.yaml
    assert state.memory_bytes() == 32 * 2**30 and state.memory_bytes("A2-2") == 64 * 2**30
    assert [n.devices_per_node for n in scaled.nodes] == [2, 2]


def test_targets_are_the_presets_analytic_times_times_scale():
    state = _state()
    model = load_model("llama3-8b")
    for device_type, tp, mbs in (("A2-4", 1, 1), ("A2-4", 2, 2), ("A2-2", 1, 4)):
        e = analytic_entry(state.real_cluster, model, device_type, tp, mbs, constants_for(state.real_cluster, model))
        state.device_type = device_type
        assert state.targets_ms("layer", tp, mbs) == pytest.approx((0.25 * e.forward_ms, 0.25 * e.backward_ms))
        assert state.targets_ms("head", tp, mbs) == pytest.approx((0.25 * e.head_forward_ms, 0.25 * e.head_backward_ms))
        assert state.targets_ms("embedding", tp, mbs) == pytest.approx(
            (0.25 * e.embedding_forward_ms, 0.25 * e.embedding_backward_ms))
    fast, slow = (_state(rank=r).targets_ms("layer", 1, 1)[0] for r in (0, 2))
    assert slow / fast == pytest.approx(376 / 280)  # compute-bound at TP 1: the peak ratio
    with pytest.raises(ValueError, match="unknown emulated part"):
        state.targets_ms("optimizer", 1, 1)


def test_profile_bytes_are_the_emulated_models():
    state = _state()
    model = load_model("llama3-8b")
    e = analytic_entry(state.real_cluster, model, "A2-4", 2, 1, constants_for(state.real_cluster, model))
    measured = {"device_type": "A2-4", "tp": 2, "mbs": 1, "forward_ms": 12.5, "backward_ms": 25.0,
                "layer_params": 10, "activation_bytes": 20, "send_bytes": 30, "head_forward_ms": 3.0}
    out = state.override_profile(measured)
    assert out["forward_ms"] == 12.5 and out["backward_ms"] == 25.0 and out["head_forward_ms"] == 3.0
    assert out["layer_params"] == e.layer_params and out["send_bytes"] == e.send_bytes == 4096 * 4096 * 2 // 2  # SP
    assert out["activation_bytes"] == e.activation_bytes and out["head_params"] == e.head_params
    assert emulation.override_profile_entry(measured) == measured  # nothing installed in this process
    assert emulation.profile_cache_tag() == ""


def test_cache_tag_names_everything_the_times_depend_on():
    tags = {_state(model=m).cache_tag() for m in ("llama3-8b:0.25", "llama3-8b:0.5", "llama2-13b:0.25",
                                                   "llama3-8b:0.25:gpu")}
    assert len(tags) == 4


def test_auto_scale_makes_the_ideal_iteration_the_documented_target(monkeypatch):
    monkeypatch.setattr(emulation.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    state = _state(model="llama3-8b", layers=8, gbs=8)
    model = load_model("llama3-8b")
    per_type = {}
    for t in ("A2-2", "A2-4"):
        e = analytic_entry(state.real_cluster, model, t, 1, 1, constants_for(state.real_cluster, model))
        per_type[t] = 8 * (e.forward_ms + e.backward_ms) + e.embedding_forward_ms + e.embedding_backward_ms \
            + e.head_forward_ms + e.head_backward_ms
    ideal = (2 * per_type["A2-2"] + 2 * per_type["A2-4"]) / 4 * 8 / 4
    nodes = parse_emulate("A2-2:2,A2-4:2", device_presets())

    def scale(gbs):
        return emulation.auto_scale(nodes, model, links="npu", num_layers=8, global_batch=gbs, micro_batch_size=1)

    assert scale(8) * ideal == pytest.approx(emulation.AUTO_ITERATION_MS)
    assert scale(16) == pytest.approx(scale(8) / 2)
    assert state.scale >= scale(8)  # then fitted to the host (fit_to_host): never shorter


def test_auto_scale_lengthens_the_iteration_when_ranks_outnumber_the_cores():
    nodes = emulation.parse_emulate("A2-2:4,A2-4:4", ["A2-2", "A2-4"])
    model = load_model("llama3-8b")

    def scale(cores):
        return emulation.auto_scale(nodes, model, links="npu", num_layers=8, global_batch=8, micro_batch_size=1,
                                    cores=cores)

    assert scale(4) == pytest.approx(scale(8))  # 8 ranks fit 4 cores at RANKS_PER_CORE = 2
    assert scale(2) == pytest.approx(2 * scale(4))
    assert scale(1) == pytest.approx(4 * scale(4))


def _fitted(emulate, model, cores, gbs=24, layers=24, host_factor=1.0):
    nodes = parse_emulate(emulate, device_presets())
    return emulation.deterministic_state(emulate=emulate, emulate_model=model, rank=0,
                                         world_size=sum(n.devices for n in nodes), num_layers=layers,
                                         global_batch=gbs, micro_batch_size=1, job_model=_job_model(gbs),
                                         cores=cores, host_factor=host_factor)


def test_host_layer_ms_grows_with_ranks_per_core_and_tp():
    def times(factor, forward_backward):
        return tuple(factor * t for t in forward_backward)

    assert emulation.host_layer_ms(2, 4, cores=2) == emulation.HOST_LAYER_MS[2]
    assert emulation.host_layer_ms(2, 4, cores=64) == emulation.HOST_LAYER_MS[2]  # never below the table
    assert emulation.host_layer_ms(2, 12, cores=2) == pytest.approx(times(3, emulation.HOST_LAYER_MS[2]))
    assert emulation.host_layer_ms(8, 4, cores=2) == pytest.approx(
        times(emulation.HOST_LAYER_MS_PER_DOUBLING, emulation.HOST_LAYER_MS[4]))


def _shortest(state, tp):
    entries = [analytic_entry(state.real_cluster, state.model, t, tp, 1, state.constants)
               for t in state.real_cluster.type_names]
    return min(e.forward_ms for e in entries), min(e.backward_ms for e in entries)


def _need(state, tp, ranks, cores, host_factor=1.0):
    cost = emulation.host_layer_ms(tp, ranks, cores, host_factor)
    return emulation.HOST_FIT * max(c / d for c, d in zip(cost, _shortest(state, tp)))


def test_automatic_scale_grows_until_the_cpu_keeps_the_deadlines_and_leaves_out_what_it_cannot():
    emulate, model = "A2-2:2,A2-4:2", "llama2-13b"  # the README's cluster
    base = emulation.auto_scale(parse_emulate(emulate, device_presets()), load_model(model), links="npu",
                                num_layers=8, global_batch=8, micro_batch_size=1, cores=2)
    state = _fitted(emulate, model, cores=2, gbs=8, layers=8)
    # TP 2's shortest deadline (A2-2) needs a longer scale than the iteration target, within MAX_FIT_GROWTH
    need = {tp: _need(state, tp, 4, 2) for tp in (1, 2)}
    assert base < need[2] <= emulation.MAX_FIT_GROWTH * base
    assert state.scale == pytest.approx(max(base, *need.values()))
    assert state.fit.tp_limit is None and state.fit.short == () and state.host_notes() == []
    # on a host twice as slow TP 2 would need more than that: left out, and the log names the SCALE including it
    slow = _fitted(emulate, model, cores=2, gbs=8, layers=8, host_factor=2.0)
    assert slow.fit.tp_limit == 1 and slow.allows_tp(1) and not slow.allows_tp(2)
    (tp, need2), = slow.fit.short
    assert tp == 2 and need2 == pytest.approx(_need(state, 2, 4, 2, 2.0)) and need2 > emulation.MAX_FIT_GROWTH * base
    assert slow.scale == pytest.approx(max(base, _need(state, 1, 4, 2, 2.0)))
    host, left_out = slow.host_notes()
    assert "2x slower" in host and emulation.HOST_FACTOR_ENV in host
    assert "TP 2" in left_out and "left out" in left_out and f"{model}:{need2:.3g}" in left_out
    # more than 2 ranks per core: the cost grows in proportion (12 ranks on 2 cores: 3x the table)
    crowded = _fitted("A2-2:4,A2-3:4,A2-4:4", "llama3-8b", cores=2, gbs=24, layers=24)
    roomy = _fitted("A2-2:4,A2-3:4,A2-4:4", "llama3-8b", cores=6, gbs=24, layers=24)
    assert dict(crowded.fit.short)[4] == pytest.approx(3 * dict(roomy.fit.short)[4])


def test_the_host_factor_is_the_loop_time_over_the_references_in_half_octaves():
    ref = emulation.HOST_LOOP_MS
    assert emulation.host_factor(0.5 * ref) == emulation.host_factor(ref) == 1.0  # a faster host keeps the table
    assert emulation.host_factor(1.15 * ref) == 1.0
    assert emulation.host_factor(1.3 * ref) == 1.414 and emulation.host_factor(1.6 * ref) == 1.414
    assert emulation.host_factor(2.1 * ref) == 2.0 and emulation.host_factor(2.9 * ref) == 2.828
    ticks = iter([0.0, 0.030, 1.0, 1.025, 2.0, 2.040])  # three runs: 30, 25, 40 ms -> the fastest
    assert emulation.host_loop_ms(clock=lambda: next(ticks), repeats=3) == pytest.approx(25.0)
    assert emulation.host_layer_ms(2, 4, cores=2, host_factor=1.414) == pytest.approx(
        tuple(1.414 * t for t in emulation.host_layer_ms(2, 4, cores=2)))


@pytest.mark.parametrize("text", ["0.5", "fast", "nan", "inf", "-2"])
def test_a_bad_host_factor_names_the_variable(text):
    with pytest.raises(PoseidonError, match=f"{emulation.HOST_FACTOR_ENV}={text!r} is not a number >= 1"):
        emulation.parse_host_factor(text)
    assert emulation.parse_host_factor(None) == emulation.parse_host_factor(" ") == 1.0
    assert emulation.parse_host_factor("1.414") == 1.414


def test_a_given_scale_is_kept_and_short_deadlines_are_warned_about():
    state = _fitted("A2-2:4,A2-4:4", "llama3-8b:0.25", cores=2, gbs=16, layers=16)
    assert state.scale == 0.25 and state.fit.tp_limit is None and state.allows_tp(4)
    assert {2, 4} <= {tp for tp, _need in state.fit.short}  # kept all the same, each warned about
    assert all("expect iterations above the prediction" in n for n in state.host_notes())
    slow = _fitted("A2-2:4,A2-4:4", "llama3-8b:0.25", cores=2, gbs=16, layers=16, host_factor=2.0)
    host, *short = slow.host_notes()
    assert slow.scale == 0.25 and "2x slower" in host and "short of time for it at the given SCALE" in host
    assert all("expect iterations above the prediction" in n for n in short)


def test_tp_degrees_the_job_cannot_use_are_not_fitted():
    job = ModelSpec(name="job", num_layers=16, hidden_size=64, ffn_hidden_size=256, num_attention_heads=2,
                    num_query_groups=2, vocab_size=512, seq_length=32, global_batch_size=16, dtype="fp32")
    state = emulation.deterministic_state(emulate="A2-2:4,A2-4:4", emulate_model="llama3-8b", rank=0, world_size=8,
                                          num_layers=16, global_batch=16, micro_batch_size=1, job_model=job, cores=2)
    assert state.fit.short and all(tp <= 2 for tp, _ in state.fit.short)  # TP 4 (2 heads) is not fitted


def _job_model(gbs=8):
    return ModelSpec(name="job", num_layers=8, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=4, vocab_size=512, seq_length=32, global_batch_size=gbs, dtype="fp32")


def _plan(state, *, stage_types, layers, tp=1, dp=1):
    job = _job_model()
    entries = tuple(ProfileEntry(**state.emulated_entry(t, tp, 1)) for t in sorted(set(stage_types)))
    profile = ProfileSpec(model="job", seq_length=32, dtype="fp32", entries=entries, source="measured")
    cm = CostModel(state.cluster, job, profile)
    cand = Candidate(tp=tp, pp=len(stage_types), dp=dp, mbs=1, stage_types=tuple(stage_types), layers=tuple(layers))
    return cm, cand, cm.make_plan(cand, comm_model="megatron")


def test_bind_plan_gives_the_cost_models_dp_sync_and_link_times():
    state = _state(emulate="A2-2:2,A2-2:2,A2-4:4", rank=4)
    cm, cand, plan = _plan(state, stage_types=("A2-2", "A2-4"), layers=(5, 3), dp=2)
    assert [s.devices for s in plan.stages] == [((0, 0), (0, 1)), ((2, 0), (2, 1))]
    state.bind_plan(plan, 2, _job_model())
    _f, _b, _s, allreduce = cm.stage_times(cand)
    assert state.sync_ms == pytest.approx(allreduce[1]) and state.sync_ms > 0
    link = state.cluster.link("A2-4", LINK_CROSS_TYPE)
    expected = 4096 * 4096 * 2 / (link.bytes_per_ms * state.constants.link_efficiency) + link.latency_ms
    assert state.p2p_ms(0, 1) == pytest.approx(expected)
    assert state.p2p_ms(0, 1) == pytest.approx(plan.stages[0].send_ms)  # what the planner charged
    assert state.p2p_ms(3, 1) < state.p2p_ms(0, 1)  # same node: intra-node link
    assert state.p2p_ms(99, 1) == 0.0  # not a rank of the plan


def test_a_recomputing_job_keeps_the_plain_layer_deadlines():
    """Under full recomputation the cost model prices a layer's backward with its forward again; the emulated
    layer replays that forward itself (held to the forward's deadline inside the backward), so binding the
    plan leaves the layer's deadlines the plain layer's. Added to the backward's deadline as well, the replay
    was held twice: the README example with --recompute-granularity full ran 13 % over its prediction."""
    import dataclasses

    state = _state(emulate="A2-2:2,A2-4:2", rank=2)
    cm, _cand, plan = _plan(state, stage_types=("A2-2", "A2-4"), layers=(5, 3), dp=2)
    before = state.targets_ms("layer", 1, 1)
    job = dataclasses.replace(_job_model(), recompute="full", recompute_method="uniform", recompute_num_layers=1)
    state.bind_plan(plan, 2, job)
    assert state.targets_ms("layer", 1, 1) == before
    recomputing = CostModel(state.cluster, job, cm.profile).group("A2-4", 1, 1, 2)
    assert recomputing.backward_ms == pytest.approx(before[0] + before[1])  # the plan's backward: both passes


def test_link_kinds():
    assert emulation.link_kind((0, "A2-2"), (0, "A2-2")) == LINK_INTRA_NODE
    assert emulation.link_kind((0, "A2-2"), (1, "A2-2")) == LINK_INTER_NODE
    assert emulation.link_kind((0, "A2-2"), (1, "A2-4")) == LINK_CROSS_TYPE


def test_deterministic_state_checks_the_world():
    with pytest.raises(PoseidonError, match="declares 4 devices but the job has 3 ranks"):
        emulation.deterministic_state(emulate="A2-2:2,A2-4:2", emulate_model="llama3-8b", rank=0, world_size=3,
                                      num_layers=8, global_batch=8, micro_batch_size=1)


def test_emulation_module_stays_torch_free():
    code = ("import sys; from poseidon_plugin.emulation import harness as emulation; "
            "emulation.deterministic_state(emulate='A2-2:1', emulate_model='llama3-8b', rank=0, world_size=1, "
            "num_layers=2, global_batch=2, micro_batch_size=1); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



# --- the option (runtime/options.py wiring) ---------------------------------------------------------------


def test_emulate_model_option_needs_emulate_and_round_trips():
    from poseidon_plugin.runtime import options

    with pytest.raises(PoseidonError, match=r"--poseidon-emulate-model llama3-8b needs --poseidon-emulate"):
        options.parse(["--poseidon-emulate-model", "llama3-8b"], {})
    opts, rest = options.parse(["--poseidon-emulate", "A2-2:1", "--poseidon-emulate-model=llama3-8b:0.5", "x.py"], {})
    assert opts.emulate_model == "llama3-8b:0.5" and rest == ["x.py"]
    assert options.resolve({}, options.to_env(opts)).emulate_model == "llama3-8b:0.5"


def test_plan_priced_under_another_emulation_is_refused_by_name():
    """Defect: a plan priced at emulation scale 0.81 ran silently at 1.61 (+78 % watch errors)."""
    import dataclasses

    import pytest

    from poseidon_plugin.costmodel import Candidate, CostModel
    from poseidon_plugin.errors import PoseidonError
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import model_spec
    from poseidon_plugin.runtime.precheck import check_plan_job
    from poseidon_plugin.specs import ProfileSpec, parse_cluster
    from poseidon_plugin.emulation import harness as emulation

    args = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "8"]
    flags = read_job("pretrain_gpt.py", args)
    state = emulation.deterministic_state(emulate="A2-2:2,A2-4:2", emulate_model="llama2-13b:0.81", rank=0,
                                          world_size=4, num_layers=8, global_batch=8, micro_batch_size=1)
    job = model_spec(flags, global_batch_size=8, name="m")
    from poseidon_plugin.specs import ProfileEntry

    entries = tuple(ProfileEntry(**state.emulated_entry(t, 1, 1)) for t in ("A2-2", "A2-4"))
    profile = ProfileSpec(model="m", seq_length=32, dtype=job.dtype, entries=entries,
                          software={"emulation": state.cache_tag()})
    plan = CostModel(state.cluster, job, profile).make_plan(
        Candidate(tp=1, pp=2, dp=2, mbs=1, stage_types=("A2-2", "A2-4"), layers=(4, 4)))
    assert dict(plan.priced_for)["emulation"] == "deterministic:llama2-13b:0.81:npu"
    check_plan_job(plan, "--poseidon-plan p.json", flags, 8, state.cache_tag())  # the same emulation runs
    for live, shown in (("deterministic:llama2-13b:1.61:npu", "deterministic:llama2-13b:1.61:npu"), ("", "none")):
        with pytest.raises(PoseidonError) as info:
            check_plan_job(plan, "--poseidon-plan p.json", flags, 8, live)
        assert str(info.value) == (
            f"--poseidon-plan p.json was priced for another model or job: emulation "
            f"deterministic:llama2-13b:0.81:npu (this job: {shown}, --poseidon-emulate-model MODEL:SCALE:LINKS); "
            f"its memory and time do not hold here: re-plan (drop --poseidon-plan), or run the job it was made for")
    # a plan priced without an emulation (analytic, or real devices) carries no tag and is not refused for it
    bare = dataclasses.replace(plan, priced_for=tuple(kv for kv in plan.priced_for if kv[0] != "emulation"))
    check_plan_job(bare, "--poseidon-plan p.json", flags, 8, "deterministic:llama2-13b:1.61:npu")
