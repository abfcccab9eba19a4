"""Megatron / MindSpeed patch tables used by ``poseidon-run`` (see ``patches/table.py`` for the rules).

Tables: ``layer_assignment`` (layers per pipeline stage on stacks without a layout flag), ``mindspeed``
(MindSpeed's even-split offset helper made to read the planned split: layer types on uneven splits), ``emulation``
(slow compute down per emulated device type, or hold it to a deadline), ``emulated_links`` (inter-stage
transfers and the DP sync of the deterministic emulation), ``watch`` (record built layers, time iterations),
``cpu_shim`` (CPU stand-ins for megatron-core's CUDA calls), ``profiling`` (``parallel_state`` pointed at
the profiling groups).
"""

from .table import Patch, PatchError, PatchTable, resolve

__all__ = ["Patch", "PatchError", "PatchTable", "resolve"]
