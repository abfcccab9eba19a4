"""What profiling changes in megatron-core's ``parallel_state``, as a patch table built per TP group.

The profiler builds a one-layer GPTModel on a TP group of its own, before (and apart from) the training's
``initialize_model_parallel``. The vocab-parallel loss and the TP layers read the group, its size and rank
from ``parallel_state``'s globals, and allocate through its global memory buffer; so for the duration of
each measurement those globals point at the profiling group (size and rank reset so that they are read
from it) and a buffer exists. ``revert()`` puts back exactly what was there.
"""

from __future__ import annotations

from typing import Any

from patches.table import Patch, PatchTable

_PS = "megatron.core.parallel_state"


def _buffer(original: Any) -> Any:
    if original is not None:
        return original  # the training's own buffer, kept
    from megatron.core.utils import GlobalMemoryBuffer

    return GlobalMemoryBuffer()


def table(tp_group: Any) -> PatchTable:
    """The rows that point ``parallel_state`` at ``tp_group`` (apply before building the model, revert after)."""
    return PatchTable("profiling", (
        Patch(target=f"{_PS}._TENSOR_MODEL_PARALLEL_GROUP", make=lambda original: tp_group, value=True),
        Patch(target=f"{_PS}._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", make=lambda original: None, value=True),
        Patch(target=f"{_PS}._MPU_TENSOR_MODEL_PARALLEL_RANK", make=lambda original: None, value=True),
        Patch(target=f"{_PS}._GLOBAL_MEMORY_BUFFER", make=_buffer, value=True),
    ))
