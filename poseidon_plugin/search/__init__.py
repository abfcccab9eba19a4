"""Pruned exact search over DP/TP/PP, device type per stage, uneven layers, micro-batch size and schedule.

Public API::

    from poseidon_plugin.search import SearchOptions, search
    result = search(cost_model, SearchOptions(mode="default"))   # or "exact", "exhaustive"
    result.plan           # poseidon_plugin.plan.Plan (best), with result.alternatives
    result.stats          # SearchStats: simulator calls, pruned branches per rule, wall time

docs/SEARCH.md explains the space, the bounds and which pruning is provably safe. ``poseidon plan`` is
in :mod:`.cli`. The hot loop (:mod:`.splits` + :mod:`.structure_bounds`, one source) is compiled as
``poseidon_plugin._core._search``; ``POSEIDON_PURE_PYTHON=1`` runs the same files uncompiled, with identical results.
"""

from .engine import search, use_pure_python
from .options import MODES, SearchOptions, SearchResult, SearchStats

__all__ = ["MODES", "SearchOptions", "SearchResult", "SearchStats", "search", "use_pure_python"]
