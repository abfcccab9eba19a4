"""The runtime's planning glue without processes: world -> cluster spec, plan checks, placement, the search call.

These modules import torch (they sit in the framework layer), hence tests/dist; nothing here starts a rank.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.errors import NoFeasiblePlanError, PoseidonError  # noqa: E402
from poseidon_plugin.runtime.inventory import (RankInfo, World, cluster_from_world, link_specs, probe_pairs,  # noqa: E402
                                               world_from_declared)
from poseidon_plugin.runtime.job_flags import read_job  # noqa: E402
from poseidon_plugin.runtime.placement import planned_layers, planned_ranks, stage_of  # noqa: E402
from poseidon_plugin.runtime.job_spec import model_spec  # noqa: E402
from poseidon_plugin.runtime.planning import plan_on_rank0  # noqa: E402
from poseidon_plugin.runtime.precheck import check_plan_fits  # noqa: E402
from poseidon_plugin.specs import GIB, LinkSpec, load_cluster, load_model, parse_cluster  # noqa: E402
from poseidon_plugin.target import TargetRuntime  # noqa: E402

JOB_ARGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--vocab-size", "512"]
JOB = read_job("pretrain_gpt.py", [*JOB_ARGS, "--global-batch-size", "8"])
LINKS = {"intra_node": {"bandwidth_gbps": 10.0, "latency_us": 50.0, "pair": [0, 1]},
         "cross_type": {"bandwidth_gbps": 5.0, "latency_us": 80.0, "pair": [0, 2]}}


def _world(layout: list[tuple[str, str, int]]) -> World:
    """``[(host, type, devices)]`` -> World (node = host x type, ranks in order)."""
    infos, nodes, rank = [], [], 0
    for host, device_type, count in layout:
        members = []
        for local in range(count):
            infos.append(RankInfo(rank=rank, host=host, local_rank=local, device_type=device_type,
                                  device_kind="emulated", memory_bytes=64 * GIB if device_type == "A2-2" else 32 * GIB,
                                  node_tag=device_type))
            members.append(rank)
            rank += 1
        nodes.append(tuple(members))
    return World(ranks=tuple(infos), nodes=tuple(nodes))


def test_cluster_from_world_groups_nodes_and_keeps_declared_peaks():
    world = _world([("h0", "A2-2", 2), ("h0", "A2-4", 2), ("h1", "A2-4", 2)])
    declared = parse_cluster({"name": "emu", "device_types": ["A2-2", "A2-4"],
                              "nodes": [{"device_type": "A2-2", "devices_per_node": 2},
                                        {"device_type": "A2-4", "count": 2, "devices_per_node": 2}],
                              "links": "npu"})
    cluster = cluster_from_world(world, link_specs(LINKS), declared)
    assert [(g.device_type, g.count, g.devices_per_node) for g in cluster.nodes] == [("A2-2", 1, 2), ("A2-4", 2, 2)]
    assert cluster.device_type("A2-4").peak_tflops == 280 and cluster.device_type("A2-4").memory_gb == 32
    assert cluster.intra_node == LinkSpec(bandwidth_gbps=10.0, latency_us=50.0)
    assert cluster.inter_node == cluster.cross_type == LinkSpec(bandwidth_gbps=5.0, latency_us=80.0)  # absent: slowest
    assert [(d.node, d.local) for d in cluster.devices()] == [(n, i) for n in range(3) for i in range(2)]


def test_probe_pairs_one_per_present_link_class():
    world = _world([("h0", "A2-2", 2), ("h1", "A2-2", 1), ("h1", "A2-4", 2)])
    assert probe_pairs(world) == {"intra_node": (0, 1), "inter_node": (0, 2), "cross_type": (0, 3)}
    assert probe_pairs(_world([("h0", "cpu", 1)])) == {}


def test_declared_nodes_must_sit_on_one_host():
    declared = parse_cluster({"name": "c", "device_types": ["A2-2"],
                              "nodes": [{"device_type": "A2-2", "count": 1, "devices_per_node": 2}], "links": "npu"})
    split = _world([("h0", "A2-2", 1), ("h1", "A2-2", 1)])
    with pytest.raises(PoseidonError, match=r"node 0 \(ranks 0..1\) spans hosts h0, h1"):
        world_from_declared(declared, split.ranks)
    with pytest.raises(PoseidonError, match="declares 2 devices but the job has 3 ranks"):
        world_from_declared(declared, _world([("h0", "A2-2", 3)]).ranks)
    assert world_from_declared(declared, _world([("h0", "A2-2", 2)]).ranks).nodes == ((0, 1),)


def _emulated_plan(stage_types, layers, dp=1):
    world = _world([("h", "A2-2", 2), ("h", "A2-4", 2)])
    cluster = cluster_from_world(world, link_specs(LINKS), None)
    model = model_spec(JOB, global_batch_size=8, name="m")
    cand = Candidate(tp=1, pp=len(stage_types), dp=dp, mbs=1, stage_types=tuple(stage_types), layers=tuple(layers))
    return world, CostModel(cluster, model).make_plan(cand)


def test_placement_maps_planned_devices_to_launcher_ranks():
    world, plan = _emulated_plan(["A2-4", "A2-2", "A2-2", "A2-4"], [1, 3, 3, 1])
    assert planned_ranks(plan, world) == {2: 0, 0: 1, 1: 2, 3: 3}
    assert [stage_of(plan, r) for r in range(4)] == [0, 1, 2, 3]
    assert [planned_layers(plan, s) for s in range(4)] == [[1], [2, 3, 4], [5, 6, 7], [8]]
    world, plan = _emulated_plan(["A2-2"], [8], dp=2)
    assert planned_ranks(plan, world) == {0: 0, 1: 1}  # the A2-4 ranks are not used


@pytest.mark.parametrize(
    "job_args, world_layout, match",
    [
        (["--num-layers", "6"], None, r"plan.json was priced for another model or job: num_layers 8 \(this job: 6, "
                                      r"--num-layers\); its memory and time do not hold here"),
        (["--seq-length", "64"], None, r"seq_length 32 \(this job: 64, --seq-length\)"),
        (["--global-batch-size", "16"], None, r"global_batch_size 8 \(this job: 16, --global-batch-size\)"),
        (["--hidden-size", "128"], None, r"hidden_size 64 \(this job: 128, --hidden-size\); ffn_hidden_size 256 "
                                         r"\(this job: 512, --ffn-hidden-size\)"),
        ([], [("h", "A2-2", 2), ("h", "A2-4", 1)], r"it needs 4 devices \(tp 1 x dp 1 x pp 4\) but the job has 3 ranks"),
        ([], [("h", "A2-2", 2), ("h", "A2-4", 1), ("h2", "A2-4", 1)],
         r"stage 3: device \(node 1, local 1\) does not exist here"),
        ([], [("h", "A2-4", 2), ("h", "A2-2", 2)], r"stage 0 runs on A2-4 but device \(node 1, local 0\) here is a A2-2"),
    ],
)
def test_plan_must_fit_job_and_world(job_args, world_layout, match):
    world, plan = _emulated_plan(["A2-4", "A2-2", "A2-2", "A2-4"], [1, 3, 3, 1])
    job = read_job("t.py", JOB_ARGS + job_args)
    gbs = job.global_batch_size or 8
    with pytest.raises(PoseidonError, match=match):
        check_plan_fits(plan, _world(world_layout) if world_layout else world, job, gbs, "plan.json")
    check_plan_fits(plan, world, JOB, 8, "plan.json")


@pytest.mark.parametrize("job_args, match", [
    (["--num-layers", "6"], r"it splits 8 layers but --num-layers is 6"),
    (["--seq-length", "64"], r"seq_length 32 but --seq-length is 64"),
    (["--global-batch-size", "16"], r"global_batch_size 8 but the job's global batch is 16"),
])
def test_plan_without_fingerprint_is_checked_field_by_field(job_args, match):
    """Plans written before schema 3 carry no priced_for: the shape the plan itself states is still checked."""
    world, plan = _emulated_plan(["A2-4", "A2-2", "A2-2", "A2-4"], [1, 3, 3, 1])
    plan = dataclasses.replace(plan, priced_for=())
    job = read_job("t.py", JOB_ARGS + job_args)
    with pytest.raises(PoseidonError, match=match):
        check_plan_fits(plan, world, job, job.global_batch_size or 8, "plan.json")


def test_search_call_and_keep():
    world = _world([("h", "A2-2", 2), ("h", "A2-4", 2)])
    cluster = cluster_from_world(world, link_specs(LINKS), None)
    model = model_spec(JOB, global_batch_size=8, name="m")
    cm = CostModel(cluster, model)
    plan = plan_on_rank0(cm, TargetRuntime(schedules=("1f1b",)), keep=None, time_limit_s=60)
    assert plan.schedule == "1f1b"
    check_plan_fits(plan, world, JOB, 8, "the searched plan")
    kept_job = read_job("t.py", ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                                 "--seq-length", "32", "--pipeline-model-parallel-size", "2",
                                 "--micro-batch-size", "2", "--global-batch-size", "8"])
    kept = plan_on_rank0(cm, TargetRuntime(schedules=("1f1b",)), keep=kept_job, time_limit_s=60)
    assert (kept.tp, kept.pp, kept.micro_batch_size) == (1, 2, 2)


def test_no_feasible_plan_is_a_user_error():
    world = _world([("h", "tiny", 2)])
    cluster = parse_cluster({"name": "tiny", "device_types": [{"name": "tiny", "memory_gb": 0.001, "peak_tflops": 1}],
                             "nodes": [{"device_type": "tiny", "count": 1, "devices_per_node": 2}], "links": "npu",
                             "constants": {"memory_reserve_gb": 0}})
    with pytest.raises(NoFeasiblePlanError):
        plan_on_rank0(CostModel(cluster, model_spec(JOB, global_batch_size=8, name="m")),
                      TargetRuntime(schedules=("1f1b",)), keep=None, time_limit_s=60)
    assert world.node_type(0) == "tiny"


def test_launcher_plans_as_poseidon_plan(capsys):
    """Paper Setting 1 / Llama-3 8B: the launcher's planning function (its target from the default options and
    the job's flags) gives the plan ``poseidon plan`` prints."""
    import json

    from poseidon_plugin.cli import main
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.runtime.options import RuntimeOptions

    assert main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--json", "--no-progress"]) == 0
    offline = Plan.from_dict(json.loads(capsys.readouterr().out))
    job = read_job("pretrain_gpt.py", ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                                       "--seq-length", "4096", "--global-batch-size", "128"])
    target = TargetRuntime.for_job(RuntimeOptions(), job, "megatron")
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=target.micro_batch_sizes)
    launched = plan_on_rank0(cm, target, keep=None, time_limit_s=300.0)
    assert launched.plan_hash() == offline.plan_hash()
    assert launched.overlap_p2p_comm and launched.schedule == "interleaved-1f1b"


def test_search_forks_its_walks_inside_rank_0(tmp_path, monkeypatch):
    """Rank 0 searches inside a process with torch, a gloo group and busy threads: with two workers (the
    sharing lowered to the first nodes, the forks counted) its walks fork, and the plan is one process's."""
    import threading

    import torch
    import torch.distributed as dist

    from ..unit.test_search_shared import share_early

    forks = share_early(monkeypatch)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    stop = threading.Event()

    def busy():
        x = torch.ones(64, 64)
        while not stop.is_set():
            x = (x @ x).clamp(max=1.0)
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        job = read_job("pretrain_gpt.py", ["--num-layers", "24", *JOB_ARGS[2:], "--global-batch-size", "8"])
        world = _world([("h", "A2-2", 4), ("h", "A2-4", 4), ("h", "A2-3", 4)])
        cm = CostModel(cluster_from_world(world, link_specs(LINKS), None), model_spec(job, global_batch_size=8, name="m"))
        target = TargetRuntime(schedules=("1f1b", "interleaved-1f1b"))
        alone = plan_on_rank0(cm, target, keep=None, time_limit_s=120, workers=1)
        shared = plan_on_rank0(cm, target, keep=None, time_limit_s=120, workers=2)
    finally:
        stop.set()
        thread.join()
        dist.destroy_process_group()
    assert forks
    assert shared.plan_hash() == alone.plan_hash()
