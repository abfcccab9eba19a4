"""Plan schema: JSON round trip, validation, content hash, flag renderers and parsers, torch-free core."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import InputError, PoseidonError
from poseidon_plugin.plan import (PLAN_SCHEMA_VERSION, Plan, megatron_args, megatron_layout,
                                  mindspeed_args, parse_megatron_args, parse_megatron_layout,
                                  parse_mindspeed_args, render_table)
from poseidon_plugin.specs import load_cluster, load_model

try:
    import poseidon_plugin.simulator  # noqa: F401
    HAVE_SIM = True
except ImportError:
    HAVE_SIM = False
needs_sim = pytest.mark.skipif(not HAVE_SIM, reason="poseidon_plugin.simulator is not importable yet")


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))


CANDIDATES = {
    "1f1b": Candidate(tp=2, pp=4, dp=2, mbs=1, stage_types=("A2-2", "A2-2", "A2-3", "A2-3"),
                      layers=(7, 9, 9, 7)),
    "interleaved": Candidate(tp=2, pp=4, dp=1, mbs=2, stage_types=("A2-3", "A2-2", "A2-2", "A2-3"),
                             layers=(3, 5, 6, 4, 2, 4, 4, 4), schedule="interleaved-1f1b",
                             virtual_stages=2),
    "single-stage": Candidate(tp=8, pp=1, dp=1, mbs=4, stage_types=("A2-3",), layers=(32,)),
}


def _plan(cm, name, **kw) -> Plan:
    cand = CANDIDATES[name]
    return cm.make_plan(cand, 1234.5678, **kw)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_json_round_trip_is_exact(cm, name):
    alt = cm.summarize(CANDIDATES["1f1b"], 2000.25)
    p = _plan(cm, name, alternatives=[alt], search_stats={"simulator_calls": 17, "wall_s": 0.1 + 0.2,
                                                          "pruned": {"lower_bound": 3, "ridge": 4}})
    q = Plan.from_json(p.to_json())
    assert q == p
    assert q.to_json() == p.to_json()
    assert Plan.from_json(p.to_json(indent=None)) == p
    assert q.search_stats["wall_s"] == 0.1 + 0.2          # floats survive bit for bit


def test_plan_fields_from_candidate(cm):
    p = _plan(cm, "interleaved")
    assert (p.tp, p.pp, p.dp, p.micro_batch_size, p.micro_batches) == (2, 4, 1, 2, 64)
    assert p.num_layers == 32 and p.world_size == 8 and p.schema_version == PLAN_SCHEMA_VERSION
    s1 = p.stages[1]
    assert s1.layers == (5, 4) and s1.first_layers == (3, 20)     # vs 1 and vs 5 (3+5+6+4+2)
    assert s1.ranks == (2, 3) and s1.device_type == "A2-2"
    assert s1.devices == ((0, 0), (0, 1))                         # first A2-2 slot
    assert p.stages[0].devices == ((1, 0), (1, 1))                # first A2-3 slot (node 1)
    assert p.tokens_per_s == pytest.approx(128 * 4096 / 1.2345678)
    assert p.profile_source == "analytic"


def test_hash_is_stable_and_ignores_search_stats(cm):
    a = _plan(cm, "1f1b", search_stats={"wall_s": 1.0})
    b = _plan(cm, "1f1b", search_stats={"wall_s": 9.0})
    assert a.plan_hash() == b.plan_hash() == Plan.from_json(a.to_json()).plan_hash()
    assert len(a.plan_hash()) == 64
    other = cm.make_plan(Candidate(**{**_fields(CANDIDATES["1f1b"]), "layers": (8, 8, 8, 8)}), 1234.5678)
    assert other.plan_hash() != a.plan_hash()


def _fields(c):
    return {k: getattr(c, k) for k in c.__slots__}


def test_save_and_load(tmp_path, cm):
    p = _plan(cm, "1f1b")
    path = tmp_path / "plan.json"
    p.save(path)
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]
    assert Plan.load(path) == p


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(schema_version=99), r"schema_version = 99 is not supported"),
    (lambda d: d.update(format="x"), r"format = 'x' is invalid"),
    (lambda d: d.update(tp=0), r"tp = 0 is invalid: must be an integer >= 1"),
    (lambda d: d.update(schedule="zb"), r"schedule = 'zb' is invalid: must be one of gpipe"),
    (lambda d: d.update(virtual_stages=2), r"virtual_stages = 2 does not match schedule = '1f1b'"),
    (lambda d: d.update(micro_batches=5), r"micro_batches x dp x micro_batch_size = 5 x 2 x 1 must "
                                          r"equal global_batch_size = 128"),
    (lambda d: d.update(layers=[7, 9, 9]), r"layers has 3 entries; need pp x virtual_stages = 4"),
    (lambda d: d["stages"][1].update(layers=[8]), r"stages\[1\]: layers = \[8\] disagrees"),
    (lambda d: d["stages"][1].update(ranks=[[0, 3]]), r"stages\[1\]: ranks = \[0, 1, 2, 3\] must be 4..7"),
    (lambda d: d["stages"][2].update(devices=d["stages"][0]["devices"]), r"device \[0, 0\] is used by two"),
    (lambda d: d["stages"][0].update(first_layers=[1]), r"first_layers = \[1\] must be \[0\]"),
    (lambda d: d["stages"][0].update(send_ms=-1), r"send_ms = -1 is invalid: must be a finite number"),
    (lambda d: d["stages"][0].pop("memory_bytes"), r"stages\[0\]: missing required field 'memory_bytes'"),
    (lambda d: d.update(colour="red"), r"unknown field 'colour'"),
    (lambda d: d.update(stages=d["stages"][:3]), r"stages has 3 entries; need pp = 4"),
])
def test_invalid_plans_are_rejected_clearly(cm, mutate, match):
    doc = _plan(cm, "1f1b").to_dict()
    mutate(doc)
    with pytest.raises(InputError, match=match):
        Plan.from_json(json.dumps(doc), "plan.json")


def test_nan_and_malformed_json_rejected(cm):
    text = _plan(cm, "1f1b").to_json().replace('"predicted_iteration_ms": 1234.5678',
                                                '"predicted_iteration_ms": NaN')
    with pytest.raises(InputError, match=r"NaN is not allowed"):
        Plan.from_json(text)
    with pytest.raises(InputError, match=r"plan.json: malformed JSON"):
        Plan.from_json("{", "plan.json")


# --- flags -------------------------------------------------------------------------------------

def test_layout_example_from_megatron_docs():
    assert megatron_layout([3, 5, 6, 4, 2]) == "Et*3|t*5|t*6|t*4|t*2L"
    assert megatron_layout([1, 1]) == "Et|tL"
    assert parse_megatron_layout("Et*3|t*5|t*6|t*4|t*2L", 5) == (3, 5, 6, 4, 2)
    assert parse_megatron_layout("Ettt|(tt|)*2,tL", 2) == (3, 2, 2, 1)   # megatron's own sugar


def test_megatron_and_mindspeed_flags(cm):
    p = _plan(cm, "1f1b")
    args = megatron_args(p)
    assert args == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                    "--pipeline-model-parallel-layout", "Et*7|t*9|t*9|t*7L", "--micro-batch-size", "1"]
    assert "--num-layers-per-virtual-pipeline-stage" not in args
    assert parse_megatron_args(args) == (2, 4, (7, 9, 9, 7), 1)
    ms = mindspeed_args(p)
    assert ms[ms.index("--num-layer-list") + 1] == "7,9,9,7"
    assert parse_mindspeed_args(ms) == (2, 4, (7, 9, 9, 7), 1)


def test_mindspeed_flags_leave_the_layer_list_out_at_pp_1(cm):
    cand = Candidate(tp=1, pp=1, dp=8, mbs=1, stage_types=("A2-2",), layers=(cm.model.num_layers,))
    ms = mindspeed_args(cm.make_plan(cand))
    assert "--num-layer-list" not in ms  # MindSpeed-LLM refuses the list without pipeline parallelism
    assert parse_mindspeed_args([*ms, "--num-layers", str(cm.model.num_layers)]).layers == (cm.model.num_layers,)


def test_interleaved_renders_megatron_only(cm):
    p = _plan(cm, "interleaved")
    args = megatron_args(p)
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Et*3|t*5|t*6|t*4|t*2|t*4|t*4|t*4L"
    assert parse_megatron_args(args).layers == p.layers
    with pytest.raises(PoseidonError, match=r"--num-layer-list cannot express virtual_stages = 2"):
        mindspeed_args(p)


def test_schedules_megatron_cannot_run(cm):
    cand = Candidate(**{**_fields(CANDIDATES["1f1b"]), "schedule": "eager-1f1b"})
    p = cm.make_plan(cand, 100.0)
    with pytest.raises(PoseidonError, match=r"schedule 'eager-1f1b' has no Megatron equivalent"):
        megatron_args(p)
    assert "Megatron:      n/a" in render_table(p)


@pytest.mark.parametrize("argv, match", [
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*3|t*2|tL"],
     r"has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-layout", "t*3|EtL", "--pipeline-model-parallel-size", "2"],
     r"E must open stage 0"),
    (["--pipeline-model-parallel-layout=Et*3x|tL", "--pipeline-model-parallel-size=2"], r"stage 0 has 'x'"),
    (["--tensor-model-parallel-size", "two", "--pipeline-model-parallel-layout", "EtL"],
     r"--tensor-model-parallel-size 'two' is invalid"),
])
def test_bad_megatron_flags(argv, match):
    with pytest.raises(InputError, match=match):
        parse_megatron_args(argv)


def test_bad_mindspeed_flags():
    with pytest.raises(InputError, match=r"--num-layer-list '3,x' is invalid"):
        parse_mindspeed_args(["--pipeline-model-parallel-size", "2", "--num-layer-list", "3,x"])
    with pytest.raises(InputError, match=r"must list 3 integers >= 1"):
        parse_mindspeed_args(["--pipeline-model-parallel-size", "3", "--num-layer-list", "3,4"])


@settings(max_examples=150, deadline=None)
@given(pp=st.integers(1, 8), v=st.integers(1, 3), data=st.data())
def test_layout_render_parse_round_trip(pp, v, data):
    layers = tuple(data.draw(st.lists(st.integers(1, 12), min_size=pp * v, max_size=pp * v)))
    assert parse_megatron_layout(megatron_layout(layers), pp) == layers
    text = megatron_layout(layers)
    assert text.count("|") == pp * v - 1 and text.startswith("E") and text.endswith("L")


# --- table and import hygiene -------------------------------------------------------------------

def test_render_table_shows_every_stage(cm):
    p = _plan(cm, "1f1b", alternatives=[cm.summarize(CANDIDATES["1f1b"], 2000.0)],
              search_stats={"simulator_calls": 5})
    text = render_table(p)
    lines = text.splitlines()
    assert lines[0].startswith("Poseidon plan: llama3-8b on paper-setting-1")
    assert "TP 2  PP 4  DP 2" in lines[1] and "1,234.6 ms" in lines[2]
    rows = [ln for ln in lines if ln.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [r.split()[1] for r in rows] == ["A2-2", "A2-2", "A2-3", "A2-3"]
    assert "--pipeline-model-parallel-layout Et*7|t*9|t*9|t*7L" in text
    assert "--num-layer-list 7,9,9,7" in text and "simulator_calls=5" in text
    assert "alternatives (each the best plan of its parallel shape):" in text
    unproven = render_table(replace(p, search_stats={"alternatives_proven": False}))
    assert "alternatives (best plans of other shapes met during the search, not proven" in unproven


def test_planning_core_does_not_import_torch():
    code = ("import sys; import poseidon_plugin.specs, poseidon_plugin.costmodel, poseidon_plugin.plan; "
            "from poseidon_plugin.costmodel import CostModel, Candidate; "
            "from poseidon_plugin.specs import load_cluster, load_model; "
            "cm = CostModel(load_cluster('paper-setting-1'), load_model('llama3-8b')); "
            "c = Candidate(tp=2, pp=2, dp=2, mbs=1, stage_types=('A2-2', 'A2-3'), layers=(16, 16)); "
            "cm.make_plan(c, 1.0).to_json(); "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_plan_is_a_leaf_and_schedules_are_defined_once():
    """plan.py imports no cost model (the cost model builds plans), and every module names the one
    tuple of schedules of simulator/schedules.py."""
    code = ("import sys; import poseidon_plugin.plan; "
            "sys.exit(1 if 'poseidon_plugin.costmodel' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    from poseidon_plugin import costmodel, plan
    from poseidon_plugin.simulator import schedules
    assert plan.SCHEDULES is schedules.SCHEDULES and costmodel.SCHEDULES is schedules.SCHEDULES
    assert plan.MEGATRON_SCHEDULES is schedules.MEGATRON_SCHEDULES


# --- schema 3: ranks and devices as runs -------------------------------------------------------

def _listed(doc: dict, plan: Plan, version: int) -> dict:
    """A schema-1/2 document of ``plan``: every rank and device listed."""
    doc = dict(doc, schema_version=version)
    doc["stages"] = [dict(d, ranks=list(s.ranks), devices=[list(x) for x in s.devices])
                     for d, s in zip(doc["stages"], plan.stages)]
    if version == 1:
        doc.pop("overlap_p2p_comm")
    return doc


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_schema_3_stores_runs_and_reads_versions_1_and_2(cm, name):
    p = _plan(cm, name)
    doc = p.to_dict()
    assert doc["schema_version"] == PLAN_SCHEMA_VERSION == 3
    for st, stage in zip(doc["stages"], p.stages):
        assert st["ranks"] == [[stage.ranks[0], stage.ranks[-1]]]
        assert all(len(run) == 4 for run in st["devices"])
    for version in (1, 2):
        old = json.dumps(_listed(doc, p, version))
        assert Plan.from_json(old) == p            # upgraded on load: the same plan, version 3
        assert Plan.from_json(old).to_json() == p.to_json()


def test_device_runs_round_trip_any_order():
    """Runs keep the order of the devices: blocks of whole nodes, partial nodes, gaps, reversals."""
    from poseidon_plugin.plan import _device_runs, _expand_devices, _expand_ranks, _rank_runs
    rng = random.Random(5)
    cases = [tuple((n, x) for n in range(3, 7) for x in range(8)),          # whole nodes: one block
             tuple((n, x) for n in range(2) for x in range(2, 5)),         # the same locals per node
             ((0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (3, 4), (2, 5), (2, 6))]
    for _ in range(30):
        cases.append(tuple((rng.randrange(6), rng.randrange(8)) for _ in range(rng.randrange(1, 12))))
    for devices in cases:
        runs = _device_runs(devices)
        assert _expand_devices("plan", json.loads(json.dumps(runs)), [1 << 20, 1 << 20]) == devices
    assert _device_runs(cases[0]) == [[3, 6, 0, 7]]
    assert _device_runs(cases[1]) == [[0, 1, 2, 4]]
    for ranks in ((4, 5, 6, 7), (0,), (3, 4, 9, 10, 2)):
        assert _expand_ranks("plan", _rank_runs(ranks), [1 << 20, 1 << 20]) == ranks


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d["stages"][1].update(ranks=[4, 5, 6, 7]), r"ranks run = 4 is invalid: must be \[first, last\]"),
    (lambda d: d["stages"][1].update(ranks=[[7, 4]]), r"ranks run = \[7, 4\] is invalid"),
    (lambda d: d["stages"][1].update(devices=[[0, 1, 0]]), r"devices run = \[0, 1, 0\] is invalid"),
    (lambda d: d["stages"][1].update(devices=[[0, 1, 0, -1]]), r"devices run = \[0, 1, 0, -1\] is invalid"),
    (lambda d: d["stages"][1].update(devices=[[0, 10 ** 9, 0, 7]]), r"devices expand to more than 1,048,576"),
    (lambda d: d["stages"][1].update(devices="0-3"), r"devices = '0-3' is invalid: must be a list"),
    (lambda d: d.update(schema_version=4), r"schema_version = 4 is not supported: this Poseidon reads "
                                           r"versions 1, 2, 3"),
])
def test_bad_runs_are_rejected_clearly(cm, mutate, match):
    doc = _plan(cm, "1f1b").to_dict()
    mutate(doc)
    with pytest.raises(InputError, match=match):
        Plan.from_json(json.dumps(doc), "plan.json")


def test_plan_json_stays_small_at_scale():
    """100,000 devices: the plan lists no device one by one (schema 3), and reads back equal."""
    from poseidon_plugin.specs import parse_cluster
    cluster = parse_cluster({
        "name": "huge", "device_types": ["A2-2", "A2-3"], "links": "npu",
        "nodes": [{"device_type": "A2-2", "count": 6_250, "devices_per_node": 8},
                  {"device_type": "A2-3", "count": 6_250, "devices_per_node": 8}]}, "huge.yaml")
    big = CostModel(cluster, replace(load_model("llama3-8b"), global_batch_size=3125))
    cand = Candidate(tp=8, pp=4, dp=3125, mbs=1, stage_types=("A2-2", "A2-2", "A2-3", "A2-3"),
                     layers=(8, 8, 8, 8))
    p = big.make_plan(cand, 1000.0)
    assert p.world_size == 100_000
    text = p.to_json()
    assert len(text) < 20_000
    assert Plan.from_json(text) == p
