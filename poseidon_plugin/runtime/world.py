"""The world: the launcher ranks arranged as a cluster spec's devices (torch-free).

``runtime/inventory.py`` gathers it from the ranks; ``runtime/precheck.py`` builds the one a declared cluster
will form before any rank starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.specs import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    """What one launcher rank reports about itself."""

    rank: int
    host: str
    local_rank: int
    device_type: str
    """Device type name used in specs and plans (detected name, emulated or declared type)."""
    device_kind: str
    """``cuda`` / ``npu`` / ``cpu`` / ``emulated``."""
    memory_bytes: int
    node_tag: str
    """Ranks of one host and agent with the same tag form one node (the type, or the emulated node's index)."""
    agent: int = 0
    """torchrun's ``GROUP_RANK``: two agents on one host are two nodes (TP and the intra-node probe stay
    inside one agent's ranks)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """The launcher ranks arranged as the cluster spec's devices: ``nodes[node][local]`` = launcher rank."""

    ranks: tuple[RankInfo, ...]
    nodes: tuple[tuple[int, ...], ...]

    def launcher_rank(self, node: int, local: int) -> int:
        """The launcher rank hosting device ``(node, local)``; PoseidonError if there is none."""
        if not 0 <= node < len(self.nodes) or not 0 <= local < len(self.nodes[node]):
            raise PoseidonError(
                f"device (node {node}, local {local}) does not exist here: this job has "
                f"{len(self.nodes)} node(s) of sizes {[len(n) for n in self.nodes]}"
            )
        return self.nodes[node][local]

    def node_type(self, node: int) -> str:
        """Device type of a node."""
        return self.ranks[self.nodes[node][0]].device_type


def world_from_declared(cluster: ClusterSpec, infos: Sequence[RankInfo]) -> World:
    """Launcher rank ``i`` is the declared cluster's device ``i``; a declared node must sit on one host."""
    devices = cluster.devices()
    if len(devices) != len(infos):
        raise PoseidonError(
            f"--poseidon-cluster {cluster.source} declares {len(devices)} devices but the job has {len(infos)} "
            f"ranks; declare exactly one device per rank"
        )
    nodes: list[list[int]] = []
    for dev in devices:
        if dev.node == len(nodes):
            nodes.append([])
        nodes[dev.node].append(dev.index)
    for index, members in enumerate(nodes):
        hosts = sorted({f"{infos[r].host} (agent {infos[r].agent})" if len({i.agent for i in infos}) > 1
                        else infos[r].host for r in members})
        if len(hosts) > 1:
            raise PoseidonError(
                f"--poseidon-cluster {cluster.source}: node {index} (ranks {members[0]}..{members[-1]}) spans "
                f"hosts {', '.join(hosts)}; a node's devices must be on one host (check devices_per_node)"
            )
    return World(ranks=tuple(infos), nodes=tuple(tuple(n) for n in nodes))
