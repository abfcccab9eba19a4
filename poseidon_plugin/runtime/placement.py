"""Placement: make each pipeline stage run on the devices the plan chose, by renumbering the ranks.

Megatron derives a rank's pipeline stage and TP/DP position from its global rank (order tp-dp-pp), so
putting stage ``s`` on particular devices means giving the processes on those devices the global ranks
``plan.stages[s].ranks``. The launcher's numbering is arbitrary with respect to that, so after planning
the default process group is re-created with the plan's numbering (same store, a fresh prefix) and
``RANK`` / ``WORLD_SIZE`` are updated for the training script. Processes the plan does not use leave
the process group (the bootstrap keeps them until the job ends, ``elastic.py``). ``LOCAL_RANK`` is untouched: it is still the device this process drives.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from poseidon_plugin.plan import Plan
from poseidon_plugin.runtime.inventory import World


def planned_ranks(plan: Plan, world: World) -> dict[int, int]:
    """``{launcher rank: planned global rank}`` for every process the plan uses."""
    mapping: dict[int, int] = {}
    for stage in plan.stages:
        for global_rank, (node, local) in zip(stage.ranks, stage.devices):
            mapping[world.launcher_rank(node, local)] = global_rank
    return mapping


def stage_of(plan: Plan, global_rank: int) -> int:
    """Pipeline stage of a planned global rank (Megatron order: TP fastest, then DP, then PP)."""
    return global_rank // (plan.tp * plan.dp)


def planned_layers(plan: Plan, stage: int) -> list[int]:
    """Global 1-based layer numbers the stage must build (all its virtual chunks), as Megatron numbers them."""
    entry = plan.stages[stage]
    return [first + 1 + i for first, count in zip(entry.first_layers, entry.layers) for i in range(count)]


def regroup(new_rank: int | None, world_size: int, backend: str, timeout_s: float) -> None:
    """Re-create the default process group with this process as ``new_rank`` of ``world_size``.

    Uses the store of the launch (torchrun's) under a new prefix, so no new port or rendezvous is needed.
    ``new_rank=None``: this process is not part of the plan; it only leaves the old group.
    """
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    dist.destroy_process_group()
    if new_rank is None:
        return
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("poseidon/placed", store),
        rank=new_rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    os.environ["RANK"] = str(new_rank)
    os.environ["WORLD_SIZE"] = str(world_size)
