"""Specs: presets load and match the paper, bad files fail with clear messages, analytic profile sanity."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import yaml

from poseidon_plugin.errors import InputError, PoseidonError
from poseidon_plugin.specs import (CostConstants, LinkSpec, ModelSpec, ProfileEntry, ProfileSpec,
                                   analytic_profile, layer_activation_bytes, layer_forward_flops,
                                   layer_param_counts, list_presets, load_cluster, load_model,
                                   load_profile, merge_profiles, parse_cluster, parse_model,
                                   valid_tp_degrees, write_profile)
from poseidon_plugin.specs.analytic import analytic_entry, constants_for

# --- presets ------------------------------------------------------------------------------------

PAPER_DEVICES = {  # name: (memory GB, peak TFLOP/s), paper §6.1
    "A2-2": (64, 376), "A2-3": (64, 313), "A2-4": (32, 280),
    "A100-80G": (80, 312), "RTX-4090": (24, 330), "RTX-3090": (24, 71),
}
EXTRA_DEVICES = {"910A": (32, 256)}  # the frontier presets' 4th type (not in the paper)

PAPER_CLUSTERS = {  # preset: {type: devices}, paper §6.1 settings
    "paper-setting-1": {"A2-2": 8, "A2-3": 8},
    "paper-setting-2": {"A2-2": 16, "A2-3": 16},
    "paper-setting-3": {"A2-2": 16, "A2-3": 16, "A2-4": 16},
    "paper-setting-4": {"A2-2": 8, "A2-3": 16, "A2-4": 32},
    "paper-setting-5": {"A100-80G": 8, "RTX-4090": 16, "RTX-3090": 16},
    "paper-setting-6-96": {"A2-2": 16, "A2-3": 16, "A2-4": 64},
    "paper-setting-6-192": {"A2-2": 32, "A2-3": 32, "A2-4": 128},
    "paper-setting-6-288": {"A2-2": 48, "A2-3": 48, "A2-4": 192},
}
FRONTIER_CLUSTERS = {  # issue 12: four NPU generations by the thousand
    "frontier-1024": {"A2-2": 256, "A2-3": 256, "A2-4": 256, "910A": 256},
    "frontier-4096": {"A2-2": 1024, "A2-3": 1024, "A2-4": 1024, "910A": 1024},
}

# published total parameter counts (billions), embeddings and output layer included
MODEL_SIZES_B = {"llama3-8b": 8.03, "llama2-13b": 13.0, "llama-30b": 32.5, "llama3-70b": 70.6,
                 "mixtral-8x7b": 46.7, "llama3-405b": 405.9}


def test_list_presets_is_complete():
    presets = list_presets()
    assert set(presets["clusters"]) == set(PAPER_CLUSTERS) | set(FRONTIER_CLUSTERS)
    assert set(presets["models"]) == set(MODEL_SIZES_B)
    assert set(presets["devices"]) == set(PAPER_DEVICES) | set(EXTRA_DEVICES)


@pytest.mark.parametrize("name", sorted(PAPER_CLUSTERS))
def test_cluster_presets_match_paper(name):
    c = load_cluster(name)
    assert c.name == name
    assert {t: c.num_devices_of_type(t) for t in c.type_names} == PAPER_CLUSTERS[name]
    for t in c.device_types:
        assert (t.memory_gb, t.peak_tflops) == PAPER_DEVICES[t.name]
        assert c.devices_per_node(t.name) == 8
    npu = c.type_names[0].startswith("A2")
    expect = (1400, 200, 75) if npu else (256, 100, 75)
    assert (c.intra_node.bandwidth_gbps, c.inter_node.bandwidth_gbps,
            c.cross_type.bandwidth_gbps) == expect
    devs = c.devices()
    assert len(devs) == c.num_devices == sum(PAPER_CLUSTERS[name].values())
    assert [d.index for d in devs] == list(range(len(devs)))
    assert len({(d.node, d.local) for d in devs}) == len(devs)
    assert all(0 <= d.local < 8 for d in devs)
    # nodes are homogeneous
    by_node: dict[int, set] = {}
    for d in devs:
        by_node.setdefault(d.node, set()).add(d.device_type)
    assert all(len(v) == 1 for v in by_node.values())


@pytest.mark.parametrize("name", sorted(FRONTIER_CLUSTERS))
def test_frontier_cluster_presets(name):
    c = load_cluster(name)
    assert {t: c.num_devices_of_type(t) for t in c.type_names} == FRONTIER_CLUSTERS[name]
    for t in c.device_types:
        assert (t.memory_gb, t.peak_tflops) == {**PAPER_DEVICES, **EXTRA_DEVICES}[t.name]
        assert c.devices_per_node(t.name) == 8


@pytest.mark.parametrize("name", sorted(MODEL_SIZES_B))
def test_model_presets_have_published_sizes(name):
    m = load_model(name)
    sharded, replicated = layer_param_counts(m)
    total = m.num_layers * (sharded + replicated) + 2 * m.vocab_size * m.hidden_size + m.hidden_size
    assert total / 1e9 == pytest.approx(MODEL_SIZES_B[name], rel=0.01)
    assert m.global_batch_size >= 1 and m.seq_length >= 1


def test_cluster_round_trips_through_to_dict():
    c = load_cluster("paper-setting-5")
    again = parse_cluster(c.to_dict(), "copy")
    assert again == c


def test_model_round_trips_and_overrides():
    m = load_model("llama3-8b")
    assert parse_model(m.to_dict(), "copy") == m
    o = m.with_overrides(global_batch_size=64, seq_length=2048)
    assert (o.global_batch_size, o.seq_length, o.num_layers) == (64, 2048, m.num_layers)
    assert m.with_overrides() is m
    with pytest.raises(PoseidonError, match=r"--global-batch-size 0 is invalid: must be an integer >= 1"):
        m.with_overrides(global_batch_size=0)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(PoseidonError, match=r"--cluster 'nope' is neither a file nor a preset; "
                                            r"presets: frontier-1024, frontier-4096, paper-setting-1"):
        load_cluster("nope")
    with pytest.raises(PoseidonError, match=r"--model 'gpt5'.*llama3-70b"):
        load_model("gpt5")


# --- bad cluster / model files ------------------------------------------------------------------

GOOD_CLUSTER = {
    "name": "mine", "device_types": ["A2-2", {"name": "X1", "memory_gb": 40, "peak_tflops": 100}],
    "links": "npu", "nodes": [{"device_type": "A2-2", "count": 1}, {"device_type": "X1", "count": 2}],
}


def _with(doc, path, value):
    doc = json.loads(json.dumps(doc))
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    if value is KeyError:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return doc


@pytest.mark.parametrize("path, value, match", [
    (("nodes", 1, "count"), -2, r"nodes\[1\]\.count = -2 is invalid: must be an integer >= 1"),
    (("nodes", 0, "device_type"), "A2-9", r"nodes\[0\]\.device_type = 'A2-9' is not a declared device"),
    (("device_types", 1, "memory_gb"), "lots", r"device_types\[1\]\.memory_gb = 'lots' is invalid"),
    (("device_types", 0), "H100", r"device_types\[0\] = 'H100' is not a device preset; presets: A2-2"),
    (("links",), "fast", r"links = 'fast' is not a link preset; presets: npu, gpu"),
    (("links",), {"intra_node": {"bandwidth_gbps": 10}}, r"links\.inter_node: missing required field"),
    (("links",), {"intra_node": {"bandwidth_gbps": 0}, "inter_node": {"bandwidth_gbps": 1},
                  "cross_type": {"bandwidth_gbps": 1}}, r"bandwidth_gbps = 0 is invalid: must be a finite"),
    (("nodes",), KeyError, r"nodes: missing required field"),
    (("nodez",), [], r"nodez: unknown field; allowed fields: name, description"),
    (("constants",), {"compute_eficiency": 0.3}, r"constants\.compute_eficiency: unknown cost-model "
                                                 r"constant; allowed: compute_efficiency"),
    (("constants",), {"compute_efficiency": 1.5}, r"compute_efficiency = 1.5 is invalid"),
    (("nodes", 0, "devices_per_node"), True, r"devices_per_node = True is invalid"),
])
def test_bad_cluster_files_name_file_field_and_value(tmp_path, path, value, match):
    f = tmp_path / "bad-cluster.yaml"
    f.write_text(yaml.safe_dump(_with(GOOD_CLUSTER, path, value)))
    with pytest.raises(InputError, match=match) as info:
        load_cluster(str(f))
    assert "bad-cluster.yaml" in str(info.value)


def test_good_cluster_file_loads_with_overrides(tmp_path):
    doc = _with(GOOD_CLUSTER, ("device_types", 0), {"name": "A2-2", "efficiency": 0.3})
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(doc))
    c = load_cluster(f)
    t = c.device_type("A2-2")
    assert (t.memory_gb, t.peak_tflops, t.efficiency) == (64, 376, 0.3)   # preset fields kept
    assert c.num_devices == 24 and c.device_type("X1").memory_gb == 40


def test_malformed_yaml_names_the_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match=r"broken.yaml: malformed YAML"):
        load_cluster(str(f))


GOOD_MODEL = {"name": "m", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 512,
              "num_attention_heads": 8, "num_query_groups": 2, "vocab_size": 1000, "seq_length": 128,
              "global_batch_size": 16}


@pytest.mark.parametrize("key, value, match", [
    ("num_layers", 0, r"num_layers = 0 is invalid: must be an integer >= 1"),
    ("hidden_size", 250, r"hidden_size = 250 is invalid: must be a multiple of num_attention_heads"),
    ("num_query_groups", 3, r"num_query_groups = 3 is invalid: must divide num_attention_heads = 8"),
    ("dtype", "fp8", r"dtype = 'fp8' is invalid: must be one of bf16, fp16, fp32"),
    ("num_experts", 4, r"moe_top_k = 0 is invalid: a dense model has both 0"),
    ("distributed_optimizer", "yes", r"distributed_optimizer = 'yes' is invalid: must be true or false"),
    ("layers", 4, r"layers: unknown field"),
])
def test_bad_model_files(tmp_path, key, value, match):
    f = tmp_path / "bad-model.json"
    f.write_text(json.dumps({**GOOD_MODEL, key: value}))
    with pytest.raises(InputError, match=match) as info:
        load_model(str(f))
    assert "bad-model.json" in str(info.value)


def test_model_missing_field(tmp_path):
    doc = dict(GOOD_MODEL)
    del doc["vocab_size"]
    with pytest.raises(InputError, match=r"vocab_size: missing required field"):
        parse_model(doc, "m.yaml")


# --- profiles -----------------------------------------------------------------------------------

def _profile():
    return analytic_profile(load_cluster("paper-setting-1"), load_model("llama3-8b"),
                            micro_batch_sizes=(1, 2))


def test_profile_write_load_round_trip(tmp_path):
    p = _profile()
    path = tmp_path / "sub" / "profile.json"
    write_profile(path, p)
    assert os.listdir(path.parent) == ["profile.json"]    # no temp file left behind
    q = load_profile(path)
    assert q == p and q.entries == p.entries
    assert q.lookup("A2-3", 2, 1) == p.lookup("A2-3", 2, 1)
    assert q.tp_degrees("A2-2") == (1, 2, 4, 8) and q.micro_batch_sizes() == (1, 2)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format="other"), r"format = 'other' is invalid: must be 'poseidon-profile'"),
    (lambda d: d.update(version=7), r"version = 7 is not supported"),
    (lambda d: d["entries"][0].update(forward_ms=-1.0), r"entries\[0\]\.forward_ms = -1.0 is invalid"),
    (lambda d: d["entries"][0].update(tp="2"), r"entries\[0\]\.tp = '2' is invalid"),
    (lambda d: d["entries"][1].pop("send_bytes"), r"entries\[1\]\.send_bytes: missing required field"),
    (lambda d: d["entries"].append(dict(d["entries"][0])), r"duplicate profile entry for "
                                                            r"device_type='A2-2' tp=1 mbs=1"),
    (lambda d: d.update(dtype="int8"), r"dtype = 'int8' is invalid"),
])
def test_bad_profiles(tmp_path, mutate, match):
    doc = _profile().to_dict()
    mutate(doc)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=match):
        load_profile(f)


def test_profile_lookup_miss_and_merge():
    p = _profile()
    with pytest.raises(InputError, match=r"no entry for device_type='A2-2' tp=16 mbs=1; it has"):
        p.lookup("A2-2", 16, 1)
    a = ProfileSpec(model=p.model, seq_length=p.seq_length, dtype=p.dtype,
                    entries=tuple(e for e in p.entries if e.device_type == "A2-2"))
    b = ProfileSpec(model=p.model, seq_length=p.seq_length, dtype=p.dtype,
                    entries=tuple(e for e in p.entries if e.device_type == "A2-3"))
    assert set(merge_profiles([a, b]).entries) == set(p.entries)
    c = ProfileSpec(model=p.model, seq_length=1, dtype=p.dtype, entries=())
    with pytest.raises(InputError, match=r"cannot merge profiles: .* seq_length=1"):
        merge_profiles([a, c])


# --- analytic profile ---------------------------------------------------------------------------

def test_70b_layer_flops_match_closed_form():
    m = load_model("llama3-70b")
    s, h, f, kv = m.seq_length, 8192, 28672, 1024
    # 2 FLOPs per multiply-add over every matmul weight, plus the two s x s attention products
    closed = 2 * s * (h * (h + 2 * kv) + h * h + 3 * h * f) + 2 * 2 * s * s * h
    assert layer_forward_flops(m, 1) == pytest.approx(closed, rel=1e-12)
    assert layer_forward_flops(m, 4) == pytest.approx(4 * closed, rel=1e-12)
    # same count through the parameter route: 2 x tokens x matmul params + attention
    sharded, _ = layer_param_counts(m)
    assert layer_forward_flops(m, 1) == pytest.approx(2 * s * sharded + 4 * s * s * h, rel=1e-12)


def test_moe_flops_scale_with_top_k_not_experts():
    dense = load_model("llama3-8b")
    moe = load_model("mixtral-8x7b").with_overrides(seq_length=dense.seq_length)
    top1 = ModelSpec(**{**moe.to_dict(), "moe_top_k": 1})
    router = 2 * moe.seq_length * moe.hidden_size * moe.num_experts
    mlp = 2 * moe.seq_length * moe.hidden_size * moe.ffn_hidden_size * 3
    assert layer_forward_flops(moe, 1) - layer_forward_flops(top1, 1) == pytest.approx(mlp)
    assert layer_forward_flops(top1, 1) == pytest.approx(layer_forward_flops(dense, 1) + router)
    expert = 3 * moe.hidden_size * moe.ffn_hidden_size
    assert layer_param_counts(moe)[0] - layer_param_counts(dense)[0] == 7 * expert   # 8 experts vs 1
    assert layer_param_counts(moe)[1] - layer_param_counts(dense)[1] == moe.hidden_size * 8  # router


def test_valid_tp_degrees_follow_heads_and_nodes():
    c = load_cluster("paper-setting-3")
    assert valid_tp_degrees(c, load_model("llama-30b"), "A2-2") == (1, 2, 4)     # 52 heads
    assert valid_tp_degrees(c, load_model("llama3-70b"), "A2-4") == (1, 2, 4, 8)


@pytest.fixture(scope="module")
def npu70():
    c = load_cluster("paper-setting-6-96")
    m = load_model("llama3-70b")
    return c, m, constants_for(c, m)


def test_faster_device_is_faster(npu70):
    c, m, k = npu70
    times = {t: analytic_entry(c, m, t, 8, 1, k).forward_ms for t in ("A2-2", "A2-3", "A2-4")}
    assert times["A2-2"] < times["A2-3"] < times["A2-4"]


@pytest.mark.parametrize("mbs", [1, 2])
def test_larger_tp_less_compute_and_memory(npu70, mbs):
    c, m, k = npu70
    entries = [analytic_entry(c, m, "A2-2", tp, mbs, k) for tp in (1, 2, 4, 8)]
    for a, b in zip(entries, entries[1:]):
        assert b.forward_ms < a.forward_ms and b.backward_ms < a.backward_ms
        assert b.layer_params < a.layer_params and b.activation_bytes < a.activation_bytes
        assert b.send_bytes == a.send_bytes // 2 or a.tp == 1       # sequence-parallel split
    # pure compute part: with free links, time is exactly FLOPs / tp / (peak x efficiency)
    free = k.override({"link_efficiency": 1.0}, "test")
    c_free = dataclasses.replace(c, intra_node=LinkSpec(bandwidth_gbps=1e12, latency_us=0))
    e = analytic_entry(c_free, m, "A2-2", 4, mbs, free)
    expect = layer_forward_flops(m, mbs) / 4 / (376e12 * k.compute_efficiency) * 1e3
    assert e.forward_ms == pytest.approx(expect, rel=1e-6)
    assert e.backward_ms == pytest.approx(2 * expect, rel=1e-6)


def test_activation_memory_terms():
    m = load_model("llama3-8b")
    s, h, f = m.seq_length, m.hidden_size, m.ffn_hidden_size
    heads, kv = m.num_attention_heads, m.kv_size
    # tp=1: norm/linear inputs 4h, Q K V + attention output 2h + 2kv, softmax stats, SwiGLU 3f (bf16)
    expect = s * (4 * h * 2 + (2 * h + 2 * kv) * 2 + 4 * heads + 3 * f * 2)
    assert layer_activation_bytes(m, 1, 1) == expect
    # sequence parallel splits everything over TP
    assert layer_activation_bytes(m, 1, 4) == expect // 4
    no_sp = ModelSpec(**{**m.to_dict(), "sequence_parallel": False})
    assert layer_activation_bytes(no_sp, 1, 4) == s * 4 * h * 2 + (expect - s * 4 * h * 2) // 4
    # classic attention keeps the softmax output: grows with seq^2
    assert layer_activation_bytes(m, 1, 1, flash_attention=False) > expect + s * s * heads


def test_constants_override_layers(tmp_path):
    c = load_cluster("paper-setting-1")
    m = load_model("llama3-8b")
    base = analytic_profile(c, m, micro_batch_sizes=(1,), tp_degrees=[1]).lookup("A2-2", 1, 1)
    half = analytic_profile(c, m, micro_batch_sizes=(1,), tp_degrees=[1],
                            constants={"compute_efficiency": 0.25}).lookup("A2-2", 1, 1)
    assert half.forward_ms == pytest.approx(2 * base.forward_ms)   # tp=1: compute only
    doc = c.to_dict()
    doc["constants"] = {"compute_efficiency": 0.25}
    c2 = parse_cluster(doc, "c2")
    assert constants_for(c2, m).compute_efficiency == 0.25
    # the explicit argument beats the file
    assert constants_for(c2, m, {"compute_efficiency": 0.4}).compute_efficiency == 0.4
    assert isinstance(constants_for(c, m, CostConstants(memory_reserve_gb=1)), CostConstants)
    with pytest.raises(InputError, match=r"constants\.nope: unknown cost-model constant"):
        analytic_profile(c, m, constants={"nope": 1})


def test_analytic_rejects_bad_tp_and_mbs():
    c = load_cluster("paper-setting-3")
    m = load_model("llama-30b")
    with pytest.raises(InputError, match=r"tp_degrees for 'A2-2': \[8\] not allowed; allowed: \(1, 2, 4\)"):
        analytic_profile(c, m, tp_degrees=[8])
    with pytest.raises(InputError, match=r"micro_batch_sizes = \(0,\) is invalid"):
        analytic_profile(c, m, micro_batch_sizes=[0])


def test_profile_entry_defaults_are_zero_extras():
    e = ProfileEntry(device_type="X", tp=1, mbs=1, forward_ms=1.0, backward_ms=2.0, layer_params=10,
                     activation_bytes=5, send_bytes=4)
    assert e.head_forward_ms == 0.0 and e.embedding_params == 0 and e.key == ("X", 1, 1)


def test_profile_framework_fields_round_trip_and_old_files_load(tmp_path):
    import dataclasses

    from poseidon_plugin.specs.profile import FRAMEWORK_FIELDS

    p = _profile()
    values = dict(step_forward_ms=0.4, step_backward_ms=0.3, p2p_call_ms=0.125, optimizer_ms=0.2,
                  optimizer_fixed_ms=1.5, first_step_ms=14.0, last_step_ms=15.25)
    assert set(values) == set(FRAMEWORK_FIELDS)
    measured = dataclasses.replace(p, entries=tuple(dataclasses.replace(e, **values) for e in p.entries))
    write_profile(tmp_path / "new.json", measured)
    again = load_profile(tmp_path / "new.json")
    assert again.entries == measured.entries
    assert {k: getattr(again.entries[0], k) for k in values} == values
    # a file written before the framework fields: they read as 0
    doc = measured.to_dict()
    for entry in doc["entries"]:
        for name in FRAMEWORK_FIELDS:
            del entry[name]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_profile(tmp_path / "old.json")
    assert all(getattr(e, name) == 0.0 for e in old.entries for name in FRAMEWORK_FIELDS)
    doc["entries"][0]["step_forward_ms"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"entries\[0\]\.step_forward_ms = -1.0 is invalid"):
        load_profile(tmp_path / "bad.json")
    doc["entries"][0]["step_forward_ms"] = 0.4
    doc["entries"][0]["last_step_ms"] = "fast"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match=r"entries\[0\]\.last_step_ms"):
        load_profile(tmp_path / "bad.json")
