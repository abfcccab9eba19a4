"""Inventory and link probing: what the job landed on, as a ClusterSpec the planner understands.

Every rank reports its host, local rank, device type and memory (all-gathered); ranks are grouped into
nodes (one host, one device type), and the nodes into the cluster spec's node groups. Device ``(node,
local)`` in a plan then names one launcher rank (:class:`World`).

Links are measured, not assumed: point-to-point ping-pong between one pair of ranks per link class that
exists (same node; different nodes of one type; different types) gives latency (small messages) and
bandwidth (large ones), and an all-reduce over every rank gives the collective bus bandwidth (logged). A
link class absent from the world never carries traffic; it gets the slowest measured link so that the
spec is complete. ``--poseidon-cluster FILE`` declares types, nodes and links instead (no probing).
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time

import torch
import torch.distributed as dist

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime.collectives import all_gather_json
from poseidon_plugin.runtime.devices import GIB, Device
from poseidon_plugin.runtime.world import RankInfo, World, world_from_declared  # noqa: F401  (inventory's names)
from poseidon_plugin.specs import LINK_NAMES, ClusterSpec, LinkSpec, parse_cluster

# Peak TFLOP/s only feeds the analytic profile, which a launch with measured profiles does not use; it
# is filled for readability of the plan (unknown device models get a neutral placeholder).
_KNOWN_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "4090": 330.0, "3090": 71.0}
_PLACEHOLDER_PEAK_TFLOPS = 100.0


def local_info(rank: int, local_rank: int, device: Device, *, declared_type: str | None,
               declared_memory: int | None, node_tag: str | None, agent: int = 0) -> RankInfo:
    """This rank's entry (declared/emulated type and memory win over detection)."""
    device_type = declared_type or device.name()
    return RankInfo(
        rank=rank,
        host=socket.gethostname(),
        local_rank=local_rank,
        device_type=device_type,
        device_kind=device.kind,
        memory_bytes=int(declared_memory if declared_memory is not None else device.total_memory()),
        node_tag=node_tag or device_type,
        agent=agent,
    )


def gather_world(info: RankInfo, device: torch.device) -> World:
    """All-gather every rank's RankInfo and group ranks into nodes (host and agent in rank order, then tags)."""
    infos = tuple(RankInfo(**doc) for doc in all_gather_json(dataclasses.asdict(info), device))
    groups: dict[tuple[str, int, str], list[RankInfo]] = {}
    for entry in infos:
        groups.setdefault((entry.host, entry.agent, entry.node_tag), []).append(entry)
    nodes = tuple(tuple(e.rank for e in sorted(members, key=lambda e: e.local_rank)) for members in groups.values())
    return World(ranks=infos, nodes=nodes)


def cluster_from_world(world: World, links: dict[str, LinkSpec], declared: ClusterSpec | None) -> ClusterSpec:
    """The ClusterSpec of the world: node groups from the nodes, types from the ranks, measured links."""
    types: dict[str, dict] = {}
    for info in world.ranks:
        entry = types.setdefault(info.device_type, {"name": info.device_type, "memory_gb": float("inf")})
        entry["memory_gb"] = min(entry["memory_gb"], info.memory_bytes / GIB)
    for name, entry in types.items():
        if declared is not None and name in declared.type_names:
            entry["peak_tflops"] = declared.device_type(name).peak_tflops
        else:
            entry["peak_tflops"] = next((v for k, v in _KNOWN_PEAK_TFLOPS.items() if k in name),
                                        _PLACEHOLDER_PEAK_TFLOPS)
    groups: list[dict] = []
    for index, node in enumerate(world.nodes):
        device_type, size = world.node_type(index), len(node)
        if groups and groups[-1]["device_type"] == device_type and groups[-1]["devices_per_node"] == size:
            groups[-1]["count"] += 1
        else:
            groups.append({"device_type": device_type, "count": 1, "devices_per_node": size})
    doc = {
        "name": declared.name if declared is not None else "detected",
        "device_types": list(types.values()),
        "nodes": groups,
        "links": {name: {"bandwidth_gbps": spec.bandwidth_gbps, "latency_us": spec.latency_us}
                  for name, spec in links.items()},
    }
    if declared is not None and declared.constants:
        doc["constants"] = dict(declared.constants)
    return parse_cluster(doc, "detected cluster")


# --- link probing ------------------------------------------------------------------------------


def probe_pairs(world: World) -> dict[str, tuple[int, int]]:
    """One representative launcher-rank pair per link class present in the world."""
    pairs: dict[str, tuple[int, int]] = {}
    for node in world.nodes:
        if len(node) >= 2:
            pairs.setdefault("intra_node", (node[0], node[1]))
    firsts = [node[0] for node in world.nodes]
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            same = world.ranks[a].device_type == world.ranks[b].device_type
            pairs.setdefault("inter_node" if same else "cross_type", (a, b))
    return {name: pairs[name] for name in LINK_NAMES if name in pairs}


def _ping_pong_ms(peer: int, leader: bool, nbytes: int, repeats: int, device: Device) -> list[float]:
    """Round-trip times (ms) of ``nbytes`` between this rank and ``peer`` (leader sends first)."""
    tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device.torch_device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if leader:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        device.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def probe_links(world: World, rank: int, device: Device, *, probe_bytes: int = 4 << 20) -> dict:
    """Measure each present link class and the all-reduce bus bandwidth; same result on every rank.

    Returns ``{"links": {class: {"bandwidth_gbps", "latency_us", "pair"}}, "allreduce_gbps": float}``.
    """
    mine: dict[str, dict] = {}
    for name, (a, b) in probe_pairs(world).items():
        if rank in (a, b):
            leader, peer = rank == a, b if rank == a else a
            _ping_pong_ms(peer, leader, 4, 3, device)  # connect + warm up
            small = statistics.median(_ping_pong_ms(peer, leader, 4, 20, device))
            large = statistics.median(_ping_pong_ms(peer, leader, probe_bytes, 5, device))
            latency_ms = small / 2
            transfer_ms = max(large / 2 - latency_ms, 1e-6)
            if leader:
                mine[name] = {
                    "bandwidth_gbps": probe_bytes * 8 / 1e9 / (transfer_ms / 1e3),
                    "latency_us": latency_ms * 1e3,
                    "pair": [a, b],
                }
        dist.barrier()
    tensor = torch.ones(probe_bytes // 4, dtype=torch.float32, device=device.torch_device)
    dist.all_reduce(tensor)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        device.synchronize()
        times.append(time.perf_counter() - start)
    world_size = dist.get_world_size()
    bus = 2 * (world_size - 1) / world_size * probe_bytes * 8 / 1e9 / max(statistics.median(times), 1e-9)
    links: dict[str, dict] = {}
    for part in all_gather_json(mine, device.torch_device):
        links.update(part)
    return {"links": links, "allreduce_gbps": bus}


def link_specs(measured: dict[str, dict]) -> dict[str, LinkSpec]:
    """LinkSpec per class; classes absent from the world take the slowest measured link."""
    specs = {name: LinkSpec(bandwidth_gbps=m["bandwidth_gbps"], latency_us=m["latency_us"])
             for name, m in measured.items()}
    if not specs:  # a single rank: nothing to measure, nothing will be sent
        specs = {"intra_node": LinkSpec(bandwidth_gbps=100.0, latency_us=10.0)}
    slowest = min(specs.values(), key=lambda s: s.bandwidth_gbps)
    return {name: specs.get(name, slowest) for name in LINK_NAMES}
