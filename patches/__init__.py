"""Megatron / MindSpeed patch tables used by ``poseidon-run`` (see ``patches/table.py`` for the rules).

Tables: ``layer_assignment`` (layers per pipeline stage on stacks without a layout flag), ``emulation``
(slow compute down per emulated device type, or hold it to a deadline), ``emulated_links`` (inter-stage
transfers and the DP sync of the deterministic emulation), ``watch`` (record built layers, time iterations).
"""

from .table import Patch, PatchError, PatchTable, resolve

__all__ = ["Patch", "PatchError", "PatchTable", "resolve"]
