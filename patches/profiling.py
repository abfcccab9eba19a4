"""What profiling changes in megatron-core's ``parallel_state``, as a patch table built per set of groups.

The profiler builds a one-layer GPTModel on process groups of its own, before (and apart from) the
training's ``initialize_model_parallel``. The vocab-parallel loss and the TP layers read the TP group, its
size and rank from ``parallel_state``'s globals, and allocate through its global memory buffer; a core
whose GPTModel takes no ``pg_collection`` (0.12) reads every group there. So for the duration of each
measurement those globals point at the profiling groups (cached sizes and ranks reset so that they are read
from the groups) and a buffer exists. Rows are made only for the globals the installed core has (feature
detection, not versions). ``revert()`` puts back exactly what was there.
"""

from __future__ import annotations

from typing import Any

from .table import Patch, PatchTable

_PS = "megatron.core.parallel_state"

# parallel_state global -> (field of the groups object, field used when it is absent). Expert groups:
# a profiled layer runs its experts on its own TP group (EP = 1), as the plan's profile assumes; the
# profiler's EP > 1 measurement passes EP groups of its own (``ep``, ``tp_ep``).
GROUP_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp", None),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp", None),
    "_CONTEXT_PARALLEL_GROUP": ("cp", None),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "pp"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("expt_tp", "tp"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp_ep", "tp"),
}
RANK_LISTS = {"_PIPELINE_GLOBAL_RANKS": "pp", "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
              "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp"}
# Cached sizes / ranks that would shadow the groups set here.
CACHED = ("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK",
          "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
          "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_MODEL_PARALLEL_RANK",
          "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE", "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
          "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK", "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE")


def _buffer(original: Any) -> Any:
    if original is not None:
        return original  # the training's own buffer, kept
    from megatron.core.utils import GlobalMemoryBuffer

    return GlobalMemoryBuffer()


def _value(value: Any):
    return lambda original: value


def table(groups: Any) -> PatchTable:
    """The rows that point ``parallel_state`` at ``groups`` (``.tp``, ``.pp``, ``.cp``, optional expert
    groups; a bare TP group is taken as ``.tp`` alone). Apply before building the model, revert after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not hasattr(groups, "tp"):
        groups = type("Groups", (), {"tp": groups})()
    rows = []
    for name, (attr, fallback) in GROUP_GLOBALS.items():
        group = getattr(groups, attr, None)
        if group is None and fallback is not None:
            group = getattr(groups, fallback, None)
        if group is not None and hasattr(parallel_state, name):
            rows.append(Patch(target=f"{_PS}.{name}", make=_value(group), value=True))
    for name, attr in RANK_LISTS.items():
        group = getattr(groups, attr, None)
        if isinstance(group, dist.ProcessGroup) and hasattr(parallel_state, name):
            rows.append(Patch(target=f"{_PS}.{name}", make=_value(dist.get_process_group_ranks(group)),
                              value=True))
    rows += [Patch(target=f"{_PS}.{name}", make=_value(None), value=True)
             for name in CACHED if hasattr(parallel_state, name)]
    rows.append(Patch(target=f"{_PS}._GLOBAL_MEMORY_BUFFER", make=_buffer, value=True))
    return PatchTable("profiling", tuple(rows))
