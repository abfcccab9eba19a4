"""Emulated heterogeneous clusters on CPU: ``--poseidon-emulate "A2-2:2,A2-4:2"``.

Torch-free. Lets the whole flow (detection, profiling, search, placement, uneven split) run for real on a
CPU-only machine. Each ``TYPE:COUNT`` entry is one emulated node of COUNT devices of a device type from the
specs presets (``poseidon_plugin/specs/presets/devices.yaml``) or from ``--poseidon-cluster``; launcher
ranks are handed out in order (entry one gets ranks 0..COUNT-1, and so on), so the counts must add up to
the world size.

What an emulated rank does differently (the documented factor):
- it reports the type's name and memory in the inventory;
- its compute is stretched by ``factor = max peak TFLOP/s among the emulated types / its type's peak``:
  the fastest type runs at the CPU's own speed, an A2-4 (280 TFLOP/s) next to an A2-2 (376) takes
  376/280 = 1.34x as long. The stretch is applied to every transformer layer's forward and backward, and to
  the embedding and output layer + loss, by sleeping ``(factor - 1) x`` the measured compute time right
  after it (``patches/emulation.py``). Profiling and training go through the same hooks, so the profile
  measures exactly the slowed-down compute the training will see;
- links are not emulated: the cost model gets what gloo measures on this machine (the transfers the
  training really pays).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from poseidon_plugin.errors import PoseidonError

FLAG = "--poseidon-emulate"


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulatedNode:
    """One ``TYPE:COUNT`` entry: an emulated node of ``devices`` devices of ``device_type``."""

    device_type: str
    devices: int


def parse_emulate(text: str, known_types: Sequence[str]) -> tuple[EmulatedNode, ...]:
    """Parse ``"A2-2:2,A2-4:2"``; PoseidonError naming the flag, the bad entry and the known types."""
    nodes = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, count = entry.rpartition(":")
        if not sep or not name:
            raise PoseidonError(f"{FLAG} entry {entry!r} is not TYPE:COUNT; e.g. {FLAG} A2-2:2,A2-4:2")
        try:
            devices = int(count)
        except ValueError:
            raise PoseidonError(f"{FLAG} entry {entry!r}: COUNT {count!r} is not an integer") from None
        if devices < 1:
            raise PoseidonError(f"{FLAG} entry {entry!r}: COUNT must be >= 1")
        if name not in known_types:
            raise PoseidonError(
                f"{FLAG} entry {entry!r}: unknown device type {name!r}; known: {', '.join(known_types)}"
            )
        nodes.append(EmulatedNode(device_type=name, devices=devices))
    if not nodes:
        raise PoseidonError(f"{FLAG} {text!r} names no device; e.g. {FLAG} A2-2:2,A2-4:2")
    return tuple(nodes)


def check_world(nodes: Sequence[EmulatedNode], world_size: int) -> None:
    """The emulated devices must be exactly the ranks: one rank per emulated device."""
    total = sum(node.devices for node in nodes)
    if total != world_size:
        spec = ",".join(f"{n.device_type}:{n.devices}" for n in nodes)
        raise PoseidonError(
            f"{FLAG} {spec} declares {total} devices but the job has {world_size} ranks; make the counts add "
            f"up to {world_size} (e.g. --nproc-per-node {total})"
        )


def types_by_rank(nodes: Sequence[EmulatedNode]) -> list[str]:
    """Device type of each launcher rank, in rank order."""
    return [node.device_type for node in nodes for _ in range(node.devices)]


def slowdown_factors(peak_tflops: Mapping[str, float]) -> dict[str, float]:
    """``{type: max peak / its peak}`` over the given types (the fastest gets 1.0)."""
    if not peak_tflops:
        return {}
    fastest = max(peak_tflops.values())
    return {name: fastest / peak for name, peak in peak_tflops.items()}
