"""The outcome of one structure's search (:meth:`~.splits.SplitSearch.run`, compiled or not)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitResult:
    """Outcome of one structure's search."""

    time_ms: float                 # best time found below the threshold (inf: none)
    types: tuple[int, ...]         # type index per rank (into the table), empty when none
    layers: tuple[int, ...]        # layers per virtual stage, empty when none
    counters: tuple[int, ...]      # COUNTER_NAMES
    aborted: bool = False          # stopped by the deadline: not proven optimal
    resumed: bool = False          # started where the last run of its counts stopped (SplitSearch.run)


__all__ = ["SplitResult"]
