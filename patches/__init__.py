"""Megatron / MindSpeed patch tables used by ``poseidon-run`` (see ``patches/table.py`` for the rules).

Tables: ``layer_assignment`` (layers per pipeline stage on stacks without a layout flag), ``mindspeed_offsets``
(MindSpeed's even-split offset helper made to read the planned split: layer types on uneven splits),
``watch_hooks`` (record built layers, time iterations), ``profiling`` (``parallel_state`` pointed at the
profiling groups). The CPU emulation's tables (compute, links, the CPU shim, Megatron-LM's loop on CPU) live
with the emulation in ``poseidon_plugin/emulation/`` and are built on :mod:`.table` too.
"""

from .table import Patch, PatchError, PatchTable, resolve

__all__ = ["Patch", "PatchError", "PatchTable", "resolve"]
