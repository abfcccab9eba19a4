"""Cost model: stage-level input against hand computation, placement and links, memory, simulator feed."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import InputError
from poseidon_plugin.specs import (GIB, LINK_CROSS_TYPE, LINK_INTER_NODE, LINK_INTRA_NODE, ModelSpec,
                                   ProfileEntry, ProfileSpec, load_cluster, load_model, parse_cluster)

try:
    from poseidon_plugin.simulator import parse_stage_input, simulate
    HAVE_SIM = True
except ImportError:  # the simulator lands separately; these tests wait for it
    HAVE_SIM = False
needs_sim = pytest.mark.skipif(not HAVE_SIM, reason="poseidon_plugin.simulator is not importable yet")

# --- a small hand-made world: two device types, 4-device nodes, distinct links ------------------

CLUSTER = parse_cluster({
    "name": "toy",
    "device_types": [{"name": "X", "memory_gb": 16, "peak_tflops": 100},
                     {"name": "Y", "memory_gb": 8, "peak_tflops": 50}],
    "nodes": [{"device_type": "X", "count": 2, "devices_per_node": 4},
              {"device_type": "Y", "count": 2, "devices_per_node": 4}],
    "links": {"intra_node": {"bandwidth_gbps": 800, "latency_us": 2},
              "inter_node": {"bandwidth_gbps": 80, "latency_us": 10},
              "cross_type": {"bandwidth_gbps": 8, "latency_us": 100}},
    "constants": {"link_efficiency": 1.0, "memory_reserve_gb": 1.0, "memory_reserve_fraction": 0.0},
}, "toy.yaml")

MODEL = ModelSpec(name="toy-model", num_layers=12, hidden_size=256, ffn_hidden_size=512,
                  num_attention_heads=8, num_query_groups=8, vocab_size=1000, seq_length=128,
                  global_batch_size=16, distributed_optimizer=False)


def _entry(t: str, tp: int, mbs: int) -> ProfileEntry:
    speed = 1.0 if t == "X" else 2.0   # Y is twice as slow
    return ProfileEntry(device_type=t, tp=tp, mbs=mbs, forward_ms=speed * mbs / tp,
                        backward_ms=2 * speed * mbs / tp, layer_params=1_000_000 // tp,
                        activation_bytes=10_000_000 * mbs // tp, send_bytes=1_000_000 * mbs,
                        embedding_forward_ms=0.25, embedding_backward_ms=0.5, embedding_params=300_000,
                        embedding_activation_bytes=1000, head_forward_ms=1.5, head_backward_ms=3.0,
                        head_params=400_000, head_activation_bytes=5_000_000 * mbs)


PROFILE = ProfileSpec(model="toy-model", seq_length=128, dtype="bf16", source="measured",
                      entries=tuple(_entry(t, tp, mbs) for t in "XY" for tp in (1, 2) for mbs in (1, 2)))


@pytest.fixture
def cm() -> CostModel:
    return CostModel(CLUSTER, MODEL, PROFILE)


def _link_ms(kind: int, nbytes: float) -> float:
    bw_gbps, lat_us = {LINK_INTRA_NODE: (800, 2), LINK_INTER_NODE: (80, 10),
                       LINK_CROSS_TYPE: (8, 100)}[kind]
    return nbytes / (bw_gbps * 1e9 / 8 / 1e3) + lat_us / 1e3


def _ring_ms(kind: int, nbytes: float, dp: int) -> float:
    bw_gbps, lat_us = {LINK_INTRA_NODE: (800, 2), LINK_INTER_NODE: (80, 10)}[kind]
    return 2 * (dp - 1) / dp * nbytes / (bw_gbps * 1e9 / 8 / 1e3) + 2 * (dp - 1) * lat_us / 1e3


# --- stage-level input ------------------------------------------------------------------------

def test_stage_input_matches_hand_computation(cm):
    # tp=1, dp=2: stage 0 = X devices 0,1 (node 0), stage 1 = X 2,3 (node 0), stage 2 = Y 8,9 (node 2)
    cand = Candidate(tp=1, pp=3, dp=2, mbs=2, stage_types=("X", "X", "Y"), layers=(5, 4, 3))
    doc = cm.stage_input(cand)
    assert (doc["schedule"], doc["micro_batches"], doc["virtual_stages"], doc["data_parallel"]) == \
        ("1f1b", 4, 1, 2)
    st = doc["stages"]
    assert st[0]["forward_ms"] == [pytest.approx(5 * 2.0 + 0.25)]
    assert st[0]["backward_ms"] == [pytest.approx(5 * 4.0 + 0.5)]
    assert st[1]["forward_ms"] == [pytest.approx(4 * 2.0)]
    assert st[2]["forward_ms"] == [pytest.approx(3 * 4.0 + 1.5)]
    assert st[2]["backward_ms"] == [pytest.approx(3 * 8.0 + 3.0)]
    # 2 MB of activations: X->X inside node 0, X->Y across types, no wrap link without chunks
    assert st[0]["send_ms"] == pytest.approx(_link_ms(LINK_INTRA_NODE, 2_000_000))
    assert st[1]["send_ms"] == pytest.approx(_link_ms(LINK_CROSS_TYPE, 2_000_000))
    assert st[2]["send_ms"] == 0.0
    # DP sync inside one node: ring all-reduce of fp32 gradients (bf16 default), no dist. optimizer;
    # one all-reduce per layer (the paper's per-layer time x layers) plus one for the embedding/head
    assert st[0]["allreduce_ms"] == pytest.approx(5 * _ring_ms(LINK_INTRA_NODE, 4e6, 2)
                                                  + _ring_ms(LINK_INTRA_NODE, 4 * 3e5, 2))
    assert st[2]["allreduce_ms"] == pytest.approx(3 * _ring_ms(LINK_INTRA_NODE, 4e6, 2)
                                                  + _ring_ms(LINK_INTRA_NODE, 4 * 4e5, 2))


def test_distributed_optimizer_sync_is_reduce_scatter_plus_all_gather():
    cm = CostModel(CLUSTER, dataclasses.replace(MODEL, distributed_optimizer=True), PROFILE)
    gc = cm.group("X", 1, 1, 4)
    # (dp-1)/dp x params x (fp32 grad + bf16 param) bytes, over the intra-node link
    expect = 3 / 4 * 1e6 * (4 + 2) / (800e9 / 8 / 1e3) + 2 * 3 * 2e-3
    assert gc.allreduce_ms[LINK_INTRA_NODE] == pytest.approx(expect)
    assert cm.group("X", 1, 1, 1).allreduce_ms == (0.0, 0.0)


def test_interleaved_stage_input_is_virtual_stage_major(cm):
    cand = Candidate(tp=1, pp=2, dp=1, mbs=1, stage_types=("X", "Y"), layers=(1, 2, 3, 6),
                     schedule="interleaved-1f1b", virtual_stages=2)
    st = cm.stage_input(cand)["stages"]
    # rank 0 holds virtual stages 0 and 2 (1 and 3 layers), rank 1 holds 1 and 3 (2 and 6 layers)
    assert st[0]["forward_ms"] == [pytest.approx(1 + 0.25), pytest.approx(3.0)]
    assert st[1]["forward_ms"] == [pytest.approx(2 * 2.0), pytest.approx(6 * 2.0 + 1.5)]
    # the wrap link (rank 1 -> rank 0) carries data with chunks: across types here
    assert st[1]["send_ms"] == pytest.approx(_link_ms(LINK_CROSS_TYPE, 1_000_000))


@needs_sim
@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("eager-1f1b", 1),
                                         ("interleaved-1f1b", 2)])
def test_stage_input_feeds_the_simulator(schedule, v):
    cm = CostModel(load_cluster("paper-setting-3"), load_model("llama-30b"))
    pp = 4
    layers = (8, 7, 8, 7) * v if v > 1 else (15, 16, 16, 13)
    cand = Candidate(tp=4, pp=pp, dp=2, mbs=1, stage_types=("A2-2", "A2-3", "A2-4", "A2-4"),
                     layers=layers, schedule=schedule, virtual_stages=v)
    doc = cm.stage_input(cand)
    parsed = parse_stage_input(doc)
    assert parsed.pp == pp and parsed.micro_batches == 64
    res = simulate(doc)
    assert res.iteration_ms == pytest.approx(cm.iteration_ms(cand), rel=1e-12)
    busiest = max(sum(s["forward_ms"]) + sum(s["backward_ms"]) for s in doc["stages"])
    assert res.iteration_ms >= 64 * busiest


@needs_sim
def test_homogeneous_1f1b_closed_form():
    # one type, free links, no extras, dp=1: 1F1B iteration = (M + pp - 1)(F + B)
    doc = CLUSTER.to_dict()
    doc["links"] = {k: {"bandwidth_gbps": 1e15, "latency_us": 0} for k in
                    ("intra_node", "inter_node", "cross_type")}
    cluster = parse_cluster(doc, "free")
    entries = tuple(dataclasses.replace(e, embedding_forward_ms=0, embedding_backward_ms=0,
                                        head_forward_ms=0, head_backward_ms=0) for e in PROFILE.entries)
    cm = CostModel(cluster, MODEL, dataclasses.replace(PROFILE, entries=entries))
    for pp in (2, 3, 4):
        cand = Candidate(tp=1, pp=pp, dp=1, mbs=1, stage_types=("X",) * pp, layers=(12 // pp,) * pp)
        f, b = 12 // pp * 1.0, 12 // pp * 2.0
        assert cm.iteration_ms(cand) == pytest.approx((16 + pp - 1) * (f + b), rel=1e-9)


# --- placement and links ---------------------------------------------------------------------

def _check_placement(cm: CostModel, cand: Candidate):
    place = cm.placement(cand)
    used = [d.index for g in place.stage_devices for d in g]
    assert len(used) == len(set(used)) == cand.pp * cand.dp * cand.tp
    for t, g in zip(cand.stage_types, place.stage_devices):
        assert all(d.device_type == t for d in g)
        for r in range(cand.dp):
            assert len({d.node for d in g[r * cand.tp:(r + 1) * cand.tp]}) == 1   # TP inside a node
    return place


def test_placement_links(cm):
    # dp=1 tp=2: X stages at devices 0-1, 2-3 (node 0), 4-5 (node 1); Y at 8-9 (node 2)
    cand = Candidate(tp=2, pp=4, dp=1, mbs=1, stage_types=("X", "X", "X", "Y"), layers=(3,) * 4)
    place = _check_placement(cm, cand)
    assert [[(d.node, d.local) for d in g] for g in place.stage_devices] == \
        [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(1, 0), (1, 1)], [(2, 0), (2, 1)]]
    assert place.send_link == (LINK_INTRA_NODE, LINK_INTER_NODE, LINK_CROSS_TYPE, LINK_CROSS_TYPE)
    assert place.dp_link == (-1,) * 4


def test_dp_group_spanning_nodes_uses_inter_node_link(cm):
    # dp=3 tp=2 on 4-device nodes: X stage 0 = devices 0-5 spans nodes 0 and 1
    cand = Candidate(tp=2, pp=2, dp=3, mbs=1, stage_types=("X", "Y"), layers=(6, 6))
    m = dataclasses.replace(MODEL, global_batch_size=12)
    cm = CostModel(CLUSTER, m, PROFILE)
    place = _check_placement(cm, cand)
    assert place.dp_link == (LINK_INTER_NODE, LINK_INTER_NODE)
    gc = cm.group("X", 2, 1, 3)
    ar = cm.stage_input(cand)["stages"][0]["allreduce_ms"]
    assert ar == pytest.approx(6 * gc.allreduce_ms[LINK_INTER_NODE] + gc.embedding_allreduce_ms[1])
    assert gc.allreduce_ms[LINK_INTER_NODE] > gc.allreduce_ms[LINK_INTRA_NODE]


def test_explicit_placement_agrees_with_default(cm):
    cand = Candidate(tp=2, pp=3, dp=1, mbs=1, stage_types=("Y", "X", "X"), layers=(2, 5, 5))
    place = cm.placement(cand)
    explicit = dataclasses.replace(
        cand, devices=tuple(tuple((d.node, d.local) for d in g) for g in place.stage_devices))
    assert cm.placement(explicit) == place
    # a reversed order of X stages: same node, so still intra-node between them
    swapped = dataclasses.replace(explicit, devices=(explicit.devices[0], explicit.devices[2],
                                                     explicit.devices[1]))
    assert cm.placement(swapped).send_link[1] == LINK_INTRA_NODE
    with pytest.raises(InputError, match=r"devices\[0\]: \(0, 0\) is not a free Y device"):
        cm.placement(dataclasses.replace(explicit, devices=(((0, 0), (0, 1)),) + explicit.devices[1:]))


def test_slots_and_capacity(cm):
    assert cm.max_stages("X", 2, 1) == 4 and cm.max_stages("Y", 2, 2) == 2
    with pytest.raises(InputError, match=r"3 stages of 2x2 Y devices need 12 devices; the cluster has 8"):
        cm.stage_input(Candidate(tp=2, pp=3, dp=2, mbs=1, stage_types=("Y",) * 3, layers=(4, 4, 4)))
    assert cm.slot_indices(("X", "Y", "X", "Y", "Y")) == (0, 0, 1, 1, 2)


@pytest.mark.parametrize("setting", ["paper-setting-3", "paper-setting-5"])
def test_preset_links_order_intra_inter_cross(setting):
    cluster = load_cluster(setting)
    cm = CostModel(cluster, load_model("llama2-13b"))
    t = cluster.type_names[0]
    gc = cm.group(t, 2, 1, 2)
    assert gc.send_ms[LINK_INTRA_NODE] < gc.send_ms[LINK_INTER_NODE] < gc.send_ms[LINK_CROSS_TYPE]


# --- memory ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, dist, dp, per_param", [
    ("bf16", False, 4, 18.0), ("bf16", True, 4, 6 + 12 / 4),
    ("fp16", False, 2, 20.0), ("fp16", True, 2, 4 + 16 / 2),
    ("fp32", False, 2, 16.0), ("fp32", True, 8, 8 + 8 / 8),
])
def test_state_bytes_per_parameter(dtype, dist, dp, per_param):
    model = dataclasses.replace(MODEL, dtype=dtype, distributed_optimizer=dist)
    cm = CostModel(CLUSTER, model, dataclasses.replace(PROFILE, dtype=dtype))
    gc = cm.group("X", 1, 1, dp)
    assert gc.layer_state_bytes / 1_000_000 == pytest.approx(per_param)
    assert gc.head_state_bytes / 400_000 == pytest.approx(per_param)


def test_usable_memory_and_max_layers(cm):
    gc = cm.group("Y", 1, 1, 1)
    assert gc.usable_bytes == cm.usable_bytes("Y") == pytest.approx(8 * GIB - 1 * GIB)
    for live, first, last in itertools.product((1, 3, 8), (False, True), (False, True)):
        n = gc.max_layers(live, first, last)
        assert gc.stage_memory(n, live, first, last) <= gc.usable_bytes
        assert gc.stage_memory(n + 1, live, first, last) > gc.usable_bytes


@needs_sim
def test_stage_max_layers_matches_memory_per_stage(cm):
    gc = cm.group("Y", 1, 2, 1)
    for pp in (2, 3, 4):
        for r in range(pp):
            n = cm.stage_max_layers("Y", 1, 2, 1, "1f1b", pp, r)
            assert n == gc.max_layers(_live_1f1b(pp, 8, r), r == 0, r == pp - 1)
    # middle 1F1B stages: the earlier one keeps more micro-batches alive, so it holds fewer layers
    assert cm.stage_max_layers("Y", 1, 2, 1, "1f1b", 4, 1) < cm.stage_max_layers("Y", 1, 2, 1, "1f1b", 4, 2)


def _live_1f1b(pp, m, r):     # independent reference: Megatron warm-up + 1
    return min(pp - r, m)


@needs_sim
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_memory_per_stage_against_hand_formula(cm, schedule):
    cand = Candidate(tp=1, pp=3, dp=2, mbs=1, stage_types=("X", "X", "Y"), layers=(5, 4, 3),
                     schedule=schedule)
    mem = cm.memory_per_stage(cand)
    m = 8
    for r, layers in enumerate(cand.layers):
        gc = cm.group(cand.stage_types[r], 1, 1, 2)
        live = m if schedule == "gpipe" else _live_1f1b(3, m, r)
        state = layers * 18 * 1_000_000 + (18 * 300_000 if r == 0 else 0) + (18 * 400_000 if r == 2 else 0)
        act = layers * 10_000_000 + (1000 if r == 0 else 0) + (5_000_000 if r == 2 else 0)
        assert mem[r] == pytest.approx(state + live * act)
        assert gc.stage_memory(layers, live, r == 0, r == 2) == pytest.approx(mem[r])
    assert cm.fits(cand) == all(x <= cm.usable_bytes(t) for x, t in zip(mem, cand.stage_types))


@needs_sim
def test_interleaved_memory_uses_largest_chunk(cm):
    cand = Candidate(tp=1, pp=2, dp=1, mbs=1, stage_types=("X", "X"), layers=(1, 2, 5, 4),
                     schedule="interleaved-1f1b", virtual_stages=2)
    live = cm.peak_live("interleaved-1f1b", 2, 16, 2)
    mem = cm.memory_per_stage(cand)
    state0 = 6 * 18e6 + 18 * 300_000
    assert mem[0] == pytest.approx(state0 + live[0] * max(1e7 + 1000, 5e7))
    assert mem[1] == pytest.approx(6 * 18e6 + 18 * 400_000 + live[1] * max(2e7, 4e7 + 5e6))


@needs_sim
def test_memory_violation_reported():
    cm = CostModel(load_cluster("paper-setting-3"), load_model("llama-30b"))
    big = Candidate(tp=1, pp=2, dp=1, mbs=1, stage_types=("A2-4", "A2-4"), layers=(40, 20))
    bad = cm.memory_violations(big)
    assert bad and bad[0][0] == 0 and bad[0][1] > bad[0][2]
    assert not cm.fits(big)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, match", [
    ({"layers": (5, 4, 4)}, r"must be >= 1 each and sum to num_layers = 12"),
    ({"layers": (12, 0, 0)}, r"must be >= 1 each"),
    ({"stage_types": ("X", "Z", "X")}, r"stage type 'Z' is not profiled; known: X, Y"),
    ({"stage_types": ("X", "X")}, r"candidate has 2 stage types; pp = 3"),
    ({"dp": 3}, r"global_batch_size = 16 is not a multiple of dp x mbs = 3 x 1"),
    ({"schedule": "zero-bubble"}, r"candidate schedule 'zero-bubble' is unknown; allowed: gpipe"),
])
def test_bad_candidates(cm, change, match):
    base = Candidate(tp=1, pp=3, dp=1, mbs=1, stage_types=("X", "X", "Y"), layers=(5, 4, 3))
    with pytest.raises(InputError, match=match):
        cm.stage_input(dataclasses.replace(base, **change))


@pytest.mark.parametrize("change, match", [
    ({"seq_length": 256}, r"has seq_length=256 but the job has 128 \(--seq-length\); re-profile"),
    ({"model": "other"}, r"has model='other' but the job has 'toy-model'"),
])
def test_profile_must_match_the_job(change, match):
    with pytest.raises(InputError, match=match):
        CostModel(CLUSTER, MODEL, dataclasses.replace(PROFILE, **change))


def test_missing_profile_entry_is_clear(cm):
    with pytest.raises(InputError, match=r"no entry for device_type='X' tp=4 mbs=1"):
        cm.group("X", 4, 1, 1)


def test_tp_degrees_drop_what_does_not_fit_a_node():
    extra = tuple(_entry("X", 8, mbs) for mbs in (1, 2))     # X nodes hold 4 devices
    cm = CostModel(CLUSTER, MODEL, dataclasses.replace(PROFILE, entries=PROFILE.entries + extra))
    assert cm.tp_degrees("X") == (1, 2) and cm.micro_batch_sizes() == (1, 2)
    assert cm.device_types == ("X", "Y")


def test_group_records_are_cached(cm):
    assert cm.group("X", 2, 1, 2) is cm.group("X", 2, 1, 2)
    assert cm.micro_batches(2, 2) == 4 and cm.micro_batches(3, 1) is None


def test_random_candidates_keep_invariants():
    """Per-rank totals equal per-layer costs x layers + extras for random plans (independent sum)."""
    rng = random.Random(7)
    cm = CostModel(CLUSTER, MODEL, PROFILE)
    for _ in range(200):
        pp = rng.randint(1, 4)
        tp, dp, mbs = rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2))
        types = tuple(rng.choice("XY") for _ in range(pp))
        if any(types.count(t) > cm.max_stages(t, tp, dp) for t in "XY"):
            continue
        cuts = sorted(rng.sample(range(1, 12), pp - 1))
        layers = tuple(b - a for a, b in zip([0] + cuts, cuts + [12]))
        cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, stage_types=types, layers=layers)
        st = cm.stage_input(cand)["stages"]
        total_fwd = sum(s["forward_ms"][0] for s in st)
        speed = {"X": 1.0, "Y": 2.0}
        expect = sum(n * speed[t] * mbs / tp for n, t in zip(layers, types)) + 0.25 + 1.5
        assert total_fwd == pytest.approx(expect)
        assert all(s["send_ms"] >= 0 and s["allreduce_ms"] >= 0 for s in st)
        assert (dp == 1) == all(s["allreduce_ms"] == 0 for s in st)


# --- lazy devices -------------------------------------------------------------------------------

MIXED = parse_cluster({
    "name": "mixed",
    "device_types": [{"name": "X", "memory_gb": 16, "peak_tflops": 100},
                     {"name": "Y", "memory_gb": 8, "peak_tflops": 50}],
    "nodes": [{"device_type": "X", "count": 2, "devices_per_node": 4},
              {"device_type": "Y", "count": 3, "devices_per_node": 2},
              {"device_type": "X", "count": 1, "devices_per_node": 8},
              {"device_type": "Y", "count": 1, "devices_per_node": 4}],
    "links": "npu",
}, "mixed.yaml")


@pytest.mark.parametrize("cluster", [CLUSTER, MIXED, load_cluster("paper-setting-6-96")])
def test_type_devices_equal_the_listed_devices(cluster):
    """The lazy per-type sequence equals devices_of_type element by element, slices and negative
    indices included, and device_at finds every device by (node, local)."""
    every = cluster.devices()
    for t in cluster.type_names:
        lazy, listed = cluster.type_devices(t), cluster.devices_of_type(t)
        assert len(lazy) == len(listed)
        assert tuple(lazy) == listed
        assert lazy[-1] == listed[-1]
        for a, b in ((0, 3), (2, 7), (1, len(listed)), (5, 2)):
            assert lazy[a:b] == listed[a:b]
        n = len(listed)
        for a in range(n + 1):                 # spans across runs and node boundaries, empty ones too
            for b in range(a, n + 1):
                span = lazy.span(a, b)
                assert span == listed[a:b] and tuple(span) == listed[a:b] and len(span) == b - a
                assert span.positions() == tuple((d.node, d.local) for d in listed[a:b])
                if b > a:
                    assert span[0] == listed[a] and span[-1] == listed[b - 1]
        with pytest.raises(IndexError):
            lazy[len(listed)]
        with pytest.raises(IndexError):
            lazy.span(0, n + 1)
    for d in every:
        assert cluster.device_at(d.node, d.local) == d
    assert cluster.device_at(len({d.node for d in every}), 0) is None
    assert cluster.device_at(0, 99) is None


def test_cost_model_builds_no_device_list(monkeypatch):
    """CostModel and a plan on a huge cluster never enumerate every device."""
    cluster = parse_cluster({
        "name": "huge", "device_types": ["A2-2", "A2-3"], "links": "npu",
        "nodes": [{"device_type": "A2-2", "count": 50_000, "devices_per_node": 8},
                  {"device_type": "A2-3", "count": 50_000, "devices_per_node": 8}]}, "huge.yaml")
    monkeypatch.setattr(type(cluster), "iter_devices",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("devices enumerated")))
    model = load_model("llama3-8b")
    big = CostModel(cluster, model)
    assert big.num_devices("A2-3") == 400_000
    assert big.max_stages("A2-2", 8, 4) == 12_500
    cand = Candidate(tp=8, pp=2, dp=4, mbs=1, stage_types=("A2-2", "A2-3"), layers=(16, 16))
    place = big.placement(cand)
    assert place.stage_devices[1][0].index == 400_000 and place.stage_devices[1][0].node == 50_000
    assert big.make_plan(cand).stages[1].devices[-1] == (50_003, 7)


# --- the job's own step by stage position (first_step_ms / last_step_ms) ----------------------------

def _with_position_steps(first: float, last: float) -> CostModel:
    entries = tuple(dataclasses.replace(e, first_step_ms=first, last_step_ms=last) for e in PROFILE.entries)
    return CostModel(CLUSTER, MODEL, dataclasses.replace(PROFILE, entries=entries))


@pytest.mark.parametrize("cand", [
    Candidate(tp=1, pp=3, dp=2, mbs=2, stage_types=("X", "X", "Y"), layers=(5, 4, 3)),
    Candidate(tp=1, pp=2, dp=1, mbs=1, stage_types=("X", "Y"), layers=(1, 2, 3, 6),
              schedule="interleaved-1f1b", virtual_stages=2),
    Candidate(tp=2, pp=1, dp=1, mbs=1, stage_types=("Y",), layers=(12,)),
])
def test_position_steps_are_priced_on_the_first_and_last_virtual_stage_only(cm, cand):
    priced = _with_position_steps(first=7.0, last=11.0)
    base_f, base_b, base_send, base_ar = cm.stage_times(cand)
    f, b, send, ar = priced.stage_times(cand)
    first, last = 0, cand.pp * cand.virtual_stages - 1   # rank 0 chunk 0; last rank, last chunk
    extra = [0.0] * len(f)
    extra[first] += 7.0
    extra[last] += 11.0
    assert f == pytest.approx([x + e for x, e in zip(base_f, extra)])
    # forward only: backward, sends and the gradient sync are the same
    assert (b, send, ar) == (base_b, base_send, base_ar)


def test_position_steps_reach_the_search_tables_through_the_stage_extras():
    from poseidon_plugin.search.tables import type_table

    base = CostModel(CLUSTER, MODEL, PROFILE)
    priced = _with_position_steps(first=7.0, last=11.0)
    for name in "XY":
        gc, gp = base.group(name, 1, 1, 1), priced.group(name, 1, 1, 1)
        assert gp.embedding_forward_ms == pytest.approx(gc.embedding_forward_ms + 7.0)
        assert gp.head_forward_ms == pytest.approx(gc.head_forward_ms + 11.0)
        assert (gp.forward_ms, gp.step_forward_ms, gp.backward_ms) == (gc.forward_ms, gc.step_forward_ms,
                                                                      gc.backward_ms)
    table = type_table(priced, 1, 1, 1, ("X", "Y"))
    assert list(table.embedding_forward_ms) == pytest.approx([0.25 + 7.0, 0.25 + 7.0])
    assert list(table.head_forward_ms) == pytest.approx([1.5 + 11.0, 1.5 + 11.0])


# --- activation recomputation (Megatron's --recompute-granularity) ---------------------------------


def _recomputing(**fields) -> CostModel:
    return CostModel(CLUSTER, dataclasses.replace(MODEL, **fields), PROFILE)


def test_full_uniform_recomputation_runs_the_forward_again_and_keeps_each_layers_input(cm):
    plain = cm.group("X", 1, 2, 1)
    full = _recomputing(recompute="full", recompute_method="uniform", recompute_num_layers=2).group("X", 1, 2, 1)
    assert full.forward_ms == plain.forward_ms
    assert full.backward_ms == plain.backward_ms + plain.forward_ms
    assert full.layer_activation_bytes == 1_000_000 * 2                     # the layer's input (its send bytes)
    # one recomputed unit (2 layers) of one micro-batch exists again during a backward: off the usable memory
    assert full.usable_bytes == plain.usable_bytes - 2 * plain.layer_activation_bytes
    assert (full.embedding_activation_bytes, full.head_activation_bytes) == (
        plain.embedding_activation_bytes, plain.head_activation_bytes)


def test_full_block_recomputation_is_priced_by_bounds_on_time_and_memory(cm):
    plain = cm.group("X", 1, 1, 1)
    block = _recomputing(recompute="full", recompute_method="block", recompute_num_layers=1).group("X", 1, 1, 1)
    assert block.backward_ms == plain.backward_ms + plain.forward_ms         # every layer's forward again
    assert block.layer_activation_bytes == plain.layer_activation_bytes      # every layer's activations kept
    assert block.usable_bytes == plain.usable_bytes


def test_selective_recomputation_is_the_profiles_own(cm):
    # the profiler measures the layer with the job's selective recomputation: nothing is added on top
    selective = _recomputing(recompute="selective").group("X", 2, 1, 1)
    assert dataclasses.astuple(selective)[1:] == dataclasses.astuple(cm.group("X", 2, 1, 1))[1:]


@needs_sim
def test_a_recomputing_plan_is_slower_and_fits_more_layers(cm):
    full = _recomputing(recompute="full", recompute_method="uniform", recompute_num_layers=1)
    cand = Candidate(tp=1, pp=2, dp=1, mbs=1, schedule="1f1b", stage_types=("X", "Y"), layers=(8, 4))
    assert full.iteration_ms(cand) > cm.iteration_ms(cand)
    assert max(full.memory_per_stage(cand)) < max(cm.memory_per_stage(cand))
    assert full.max_layers("Y", 1, 1, 1, live=1) > cm.max_layers("Y", 1, 1, 1, live=1)


@pytest.mark.parametrize("fields, match", [
    ({"recompute": "some"}, r"recompute = 'some' is invalid: must be one of none, selective, full"),
    ({"recompute": "full"}, r"recompute = full needs recompute_method \(one of uniform, block\) and "
                            r"recompute_num_layers >= 1"),
    ({"recompute": "full", "recompute_method": "uniform"}, r"recompute_num_layers >= 1"),
    ({"recompute": "selective", "recompute_method": "uniform", "recompute_num_layers": 1},
     r"recompute_method and recompute_num_layers are for recompute = full only \(recompute = selective\)"),
])
def test_recompute_fields_are_validated(fields, match):
    with pytest.raises(InputError, match=match):
        dataclasses.replace(MODEL, **fields)
