"""Megatron / MindSpeed patch tables used by ``poseidon-run`` (see ``patches/table.py`` for the rules).

Tables: ``layer_assignment`` (layers per pipeline stage on stacks without a layout flag), ``emulation``
(slow compute down per emulated device type), ``watch`` (record built layers, time iterations),
``cpu_shim`` (CPU stand-ins for megatron-core's CUDA calls), ``profiling`` (``parallel_state`` pointed at
a profiling TP group).
"""

from patches.table import Patch, PatchError, PatchTable, resolve

__all__ = ["Patch", "PatchError", "PatchTable", "resolve"]
