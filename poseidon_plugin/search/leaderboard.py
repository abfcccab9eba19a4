"""The leaderboard every search mode fills, and the :class:`SearchResult` built from it.

A *key* is ``(tp, pp, dp, mbs, schedule, V)`` (then ``(ep, expert TP)`` with expert parallelism): plans of one key differ only in device types and
layers. The board keeps the best plan of each key; the search reports the ``top_k`` best keys, the
best as the :class:`~poseidon_plugin.plan.Plan` and the next ones as its alternatives. The branch and
bound (:mod:`.engine`) also reads thresholds from it; the exhaustive reference (:mod:`.exhaustive`)
only offers plans and reads the ranking.
"""

from __future__ import annotations

import math
from typing import Callable

from ..costmodel import Candidate, CostModel, expert_key
from ..errors import NoFeasiblePlanError
from .options import SearchResult, SearchStats

INF = math.inf


def plan_key(cand: Candidate) -> tuple:
    """The leaderboard key of a candidate: ``(tp, pp, dp, mbs, schedule, V)`` and its expert layout
    (``ShapeGroup.key``)."""
    return (cand.tp, cand.pp, cand.dp, cand.mbs, cand.schedule, cand.virtual_stages) + expert_key(cand.tp, cand.ep,
                                                                                                  cand.etp)


class Leaderboard:
    """Best plan per key; the search reports the ``top_k`` best keys.

    With ``exact_alternatives`` the runners-up are proven: a key is searched until its best plan is
    known whenever that plan could enter the top-k. Without, only the best plan is proven and the
    runners-up are the best plans of other keys met on the way (a key is cut as soon as it cannot
    beat the overall best), which keeps the search as fast as for ``top_k = 1``.
    """

    def __init__(self, top_k: int, exact_alternatives: bool = True):
        self.top_k = top_k
        self.exact_alternatives = exact_alternatives
        self.best: dict[tuple, tuple[float, Candidate]] = {}   # key -> (ms, candidate)

    def threshold(self, key: tuple) -> float:
        """Times >= this cannot change what is reported (proven) for ``key``."""
        own = self.best.get(key, (INF, None))[0]
        if not self.exact_alternatives:
            return min((ms for ms, _c in self.best.values()), default=INF)
        others = sorted(ms for k, (ms, _c) in self.best.items() if k != key)
        kth = others[self.top_k - 1] if len(others) >= self.top_k else INF
        return min(own, kth)

    def best_ms(self, key: tuple) -> float:
        """The best time recorded for ``key`` (inf: none yet)."""
        return self.best.get(key, (INF, None))[0]

    def best_ms_all(self) -> float:
        """The best time over every key (inf: no plan yet)."""
        return min((ms for ms, _c in self.best.values()), default=INF)

    def offer(self, key: tuple, ms: float, make: Callable[[], Candidate] | Candidate) -> bool:
        """Record a plan of ``key``; True when it is that key's new best. ``make`` is the candidate
        or a function building it (called only when the plan is kept)."""
        if ms < self.best.get(key, (INF, None))[0]:
            self.best[key] = (ms, make() if callable(make) else make)
            return True
        return False

    def ranked(self) -> list[tuple[float, tuple, Candidate]]:
        """The top-k ``(ms, key, candidate)``, best first."""
        items = sorted((ms, key) for key, (ms, _c) in self.best.items())
        return [(ms, key, self.best[key][1]) for ms, key in items[:self.top_k]]

    def result(self, cm: CostModel, stats: SearchStats, comm_model: str = "dag") -> SearchResult:
        """The best plan (a :class:`~poseidon_plugin.plan.Plan` with ``stats``) and its runners-up;
        :class:`NoFeasiblePlanError` when the board is empty (the caller explains why first)."""
        ranked = self.ranked()
        if not ranked:
            raise NoFeasiblePlanError("no plan fits")
        alts = tuple(cm.summarize(cand, ms) for ms, _key, cand in ranked[1:])
        ms, _key, cand = ranked[0]
        plan = cm.make_plan(cand, ms, alternatives=alts, search_stats=stats.to_dict(),
                            comm_model=comm_model)
        return SearchResult(plan=plan, alternatives=alts, stats=stats)


__all__ = ["Leaderboard", "plan_key"]
