"""The search driver: warm-up, best-first order over the space, branch and bound per structure.

``search(cost_model, SearchOptions(...)) -> SearchResult``. Outline (docs/SEARCH.md):

1. warm-up: simulate ``warmup_samples`` random feasible plans to seed the leaderboard (paper §4.2.3);
2. order every shape group ``(tp, mbs, dp, schedule, V, pp)`` by a cheap throughput estimate;
3. per shape group: a bound check at the root with types and layers free (prunes the whole group),
   a greedy seed plan, then the branch and bound of each ranks-per-type structure with the threshold of
   its leaderboard key;
4. the best plan of the best key becomes the :class:`~poseidon_plugin.plan.Plan`; the next keys' best
   plans are its alternatives.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from typing import Any

from ..backend import compiled
from ..costmodel import Candidate, CostModel
from ..errors import NoFeasiblePlanError, PoseidonError
from .evaluate import greedy_split, plan_fits, simulate_plan, spread
from .options import SearchOptions, SearchResult, SearchStats
from .shapes import ShapeCache, ShapeData
from .space import SearchSpace, ShapeGroup
from .splits import (BOUND_EVALS, COUNTER_NAMES, IMPROVED, N_COUNTERS, NODES, PRUNED_BOUND,
                     PRUNED_MEMORY, PRUNED_ORDER, PRUNED_PATH, PRUNED_RIDGE, SIM_CALLS)
from .splits import SplitSearch as PySplitSearch

INF = math.inf
WARMUP_SHAPES = 16
SEED_SHAPES = 64


def use_pure_python(options: SearchOptions) -> bool:
    """Whether this search runs the pure-Python loop: ``POSEIDON_PURE_PYTHON=1`` forces it (as it does
    for every compiled piece), else ``options.pure_python``, else the compiled core when it is built."""
    if options.pure_python:
        return True
    return compiled("_dag") is None or compiled("_search") is None


class Leaderboard:
    """Best plan per key ``(tp, pp, dp, mbs, schedule, V)``; the search reports the ``top_k`` best keys.

    With ``exact_alternatives`` the runners-up are proven: a key is searched until its best plan is
    known whenever that plan could enter the top-k. Without, only the best plan is proven and the
    runners-up are the best plans of other keys met on the way (a key is cut as soon as it cannot
    beat the overall best), which keeps the search as fast as for ``top_k = 1``.
    """

    def __init__(self, top_k: int, exact_alternatives: bool = True):
        self.top_k = top_k
        self.exact_alternatives = exact_alternatives
        self.best: dict[tuple, tuple[float, Any]] = {}   # key -> (ms, entry)

    def threshold(self, key: tuple) -> float:
        """Times >= this cannot change what is reported (proven) for ``key``."""
        own = self.best.get(key, (INF, None))[0]
        if not self.exact_alternatives:
            return min((ms for ms, _e in self.best.values()), default=INF)
        others = sorted(ms for k, (ms, _e) in self.best.items() if k != key)
        kth = others[self.top_k - 1] if len(others) >= self.top_k else INF
        return min(own, kth)

    def offer(self, key: tuple, ms: float, entry: Any) -> bool:
        """Record a plan of ``key``; True when it is that key's new best."""
        if ms < self.best.get(key, (INF, None))[0]:
            self.best[key] = (ms, entry)
            return True
        return False

    def ranked(self) -> list[tuple[float, tuple, Any]]:
        """The top-k ``(ms, key, entry)``, best first."""
        items = sorted((ms, key, e) for key, (ms, e) in self.best.items())
        return items[:self.top_k]


class _Run:
    """State of one search call."""

    def __init__(self, cm: CostModel, options: SearchOptions):
        self.cm, self.options = cm, options
        self.pure = use_pure_python(options)
        self.space = SearchSpace(cm, options)
        self.shapes = ShapeCache(self.pure, options.comm_model)
        self.board = Leaderboard(options.top_k,
                                 exact_alternatives=options.mode == "exhaustive" or options.exact_alternatives)
        self.ctr = [0] * N_COUNTERS
        self.pruned_shapes = 0
        self.pruned_structures = 0
        self.structures = 0
        self.sim_calls = 0
        self.t0 = time.perf_counter()
        self.deadline = INF if options.time_limit_s is None else time.monotonic() + options.time_limit_s
        self.complete = True
        self.ridge = options.mode == "default"
        self.blocks = options.mode == "default" and options.type_blocks
        self.gap = options.gap if options.mode == "default" else 0.0
        self.shrink = 1.0 / (1.0 + self.gap)
        self.memory_blocked: list[tuple[float, str, float]] = []   # (need GB, type, usable GB)
        self._splitters: dict[tuple, Any] = {}   # seeded groups that passed their root check

    # --- helpers ----------------------------------------------------------------------------

    def shape(self, sg: ShapeGroup) -> ShapeData:
        return self.shapes.get(sg.schedule, sg.pp, sg.group.micro_batches, sg.virtual_stages)

    def splitter(self, sg: ShapeGroup):
        g = sg.group
        table, shape = self.space.table(g), self.shape(sg)
        cls = self.space.type_classes(g)
        if self.pure:
            return PySplitSearch(table, shape, self.space.num_layers, ridge=self.ridge,
                                 blocks=self.blocks, type_class=cls, gap=self.gap)
        from poseidon_plugin._core._search import SplitSearch
        return SplitSearch(table, shape, self.space.num_layers, ridge=self.ridge, blocks=self.blocks,
                           type_class=cls, gap=self.gap)

    def offer(self, sg: ShapeGroup, ms: float, types, layers) -> None:
        self.board.offer(sg.key, ms, (sg, tuple(types), tuple(layers)))

    def out_of_time(self) -> bool:
        if time.monotonic() > self.deadline:
            self.complete = False
            return True
        return False

    # --- phases -----------------------------------------------------------------------------

    def warmup(self, sgs: list[ShapeGroup]) -> int:
        """Simulate random feasible plans (paper: 500) to seed the leaderboard."""
        n = self.options.warmup_samples
        if n == 0 or not sgs:
            return 0
        rng = random.Random(self.options.seed)
        done = tries = 0
        params_cache: dict[tuple, array] = {}
        while done < n and tries < 20 * n:
            tries += 1
            sg = rng.choice(sgs)
            g = sg.group
            table, shape = self.space.table(g), self.shape(sg)
            types = []
            left = list(g.slots)
            for _ in range(sg.pp):
                choices = [t for t in range(len(left)) if left[t] > 0]
                t = rng.choice(choices)
                left[t] -= 1
                types.append(t)
            # layers per rank, then spread over its chunks: the plan space (docs/SEARCH.md); random
            # per-chunk counts would offer plans outside it, which --exhaustive never sees
            v = sg.virtual_stages
            rank_layers = [v] * sg.pp
            for _ in range(self.space.num_layers - shape.nv):
                rank_layers[rng.randrange(sg.pp)] += 1
            layers = spread(rank_layers, sg.pp, v)
            if not plan_fits(table, shape, types, layers):
                continue
            params = params_cache.setdefault(shape.key, shape.new_params())
            ms = simulate_plan(params, table, shape, types, layers)
            self.sim_calls += 1
            done += 1
            self.offer(sg, ms, types, layers)
        return done

    def estimate(self, sg: ShapeGroup) -> float:
        """Cheap optimistic time: fastest devices first, perfectly balanced, 1F1B bubble."""
        g = sg.group
        tb = self.space.table(g)
        per = sorted((tb.fwd[t] + tb.bwd[t], g.slots[t]) for t in range(len(g.names)))
        rate, left = 0.0, sg.pp
        for c, n in per:
            k = min(n, left)
            rate += k / c
            left -= k
        m = g.micro_batches
        bubble = (m + (sg.pp - 1) / sg.virtual_stages) / m
        return m * self.space.num_layers / rate * bubble

    def seed(self, sg: ShapeGroup) -> None:
        """A greedy plan per contiguous type order of the fastest-first counts (an early incumbent)."""
        g = sg.group
        tb, shape = self.space.table(g), self.shape(sg)
        order = sorted(range(len(g.names)), key=lambda t: (tb.fwd[t] + tb.bwd[t]))
        counts = [0] * len(g.names)
        left = sg.pp
        for t in order:
            counts[t] = min(g.slots[t], left)
            left -= counts[t]
        params = shape.new_params()
        used = [t for t in order if counts[t]]
        by_memory = sorted(used, key=lambda t: -tb.usable[t])
        for seq_types in (used, by_memory, list(reversed(used))):
            types = [t for t in seq_types for _ in range(counts[t])]
            rank_layers = greedy_split(tb, shape, types, self.space.num_layers)
            if rank_layers is None:
                continue
            layers = spread(rank_layers, sg.pp, sg.virtual_stages)
            if not plan_fits(tb, shape, types, layers):
                continue
            ms = simulate_plan(params, tb, shape, types, layers)
            self.sim_calls += 1
            self.offer(sg, ms, types, layers)

    def add(self, counters) -> None:
        for i, c in enumerate(counters):
            self.ctr[i] += c

    def fluid_cut(self, sg: ShapeGroup, tau: float) -> bool:
        """Cheap shape-free bound: each rank runs its M forwards and backwards one after another, so
        a rank of type t holds fewer than ``tau / (M (f_t + b_t))`` layers, and every rank holds at
        least V; True when the best pp ranks of the group cannot hold the model that way."""
        if tau == INF:
            return False
        g = sg.group
        tb = self.space.table(g)
        caps = []
        for t in range(len(g.names)):
            x = tau * (1.0 + 1e-9) / (g.micro_batches * (tb.fwd[t] + tb.bwd[t]))
            caps.extend([int(x)] * min(g.slots[t], sg.pp))
        caps.sort(reverse=True)
        if len(caps) < sg.pp or caps[sg.pp - 1] < sg.virtual_stages:
            return True
        return sum(caps[:sg.pp]) < self.space.num_layers

    def root_splitter(self, sg: ShapeGroup):
        """The group's structure search, or None when the fluid cut or the root bound (types and
        layers free) proves the group cannot beat its threshold. The splitter of a group that
        survives is kept: the seed phase checks the group before its own turn comes."""
        tau = self.board.threshold(sg.key) * self.shrink
        if self.fluid_cut(sg, tau):
            return None
        splitter = self._splitters.get(sg.key) or self.splitter(sg)
        root = splitter.run(sg.group.slots, tau, root_only=True)
        self.add(root.counters)
        if root.time_ms == INF:
            self._splitters.pop(sg.key, None)
            return None
        self._splitters[sg.key] = splitter
        return splitter

    def run_shape_group(self, sg: ShapeGroup) -> None:
        key = sg.key
        g = sg.group
        splitter = self.root_splitter(sg)
        self._splitters.pop(key, None)         # this is the group's turn: no later use
        if splitter is None:
            self.pruned_shapes += 1
            return
        if sg.key not in self.board.best:
            self.seed(sg)
        vectors = self.space.count_vectors(sg)
        tb = self.space.table(g)
        vectors.sort(key=lambda vec: -sum(n / (tb.fwd[t] + tb.bwd[t]) for t, n in enumerate(vec)))
        for vec in vectors:
            self.structures += 1
            res = splitter.run(vec, self.board.threshold(key) * self.shrink, deadline=self.deadline)
            self.add(res.counters)
            if res.aborted:
                self.complete = False
            if res.counters[NODES] <= 1 and res.counters[IMPROVED] == 0:
                self.pruned_structures += 1
            if res.time_ms < INF:
                self.offer(sg, res.time_ms, res.types, res.layers)
            if res.aborted:
                return

    def search(self) -> None:
        sgs = list(self.space.shape_groups())
        if not sgs:
            return
        sgs.sort(key=self.estimate)
        # greedy seeds of the most promising groups, then search those with the best seeds first:
        # a tight incumbent early is what makes the bounds cut
        head = sgs[:SEED_SHAPES]
        alive = []
        for sg in head:
            # a seed builds the group's DAG: only for groups the cheap bounds cannot cut already
            if self.root_splitter(sg) is not None:
                self.seed(sg)
                alive.append(sg)
        # the warm-up (paper §4.2.3) draws from the most promising groups still alive: every shape it
        # touches needs its DAG built, and random plans of hopeless shapes seed nothing useful
        self.warmup_done = self.warmup((alive or sgs)[:WARMUP_SHAPES])
        seeded = {sg.key: self.board.best.get(sg.key, (INF, None))[0] for sg in head}
        head.sort(key=lambda sg: seeded[sg.key])
        sgs = head + sgs[SEED_SHAPES:]
        progress = self.options.progress
        last_report = time.perf_counter()
        for i, sg in enumerate(sgs):
            if self.out_of_time():
                break
            self.run_shape_group(sg)
            if progress is not None and time.perf_counter() - last_report > 0.1:
                last_report = time.perf_counter()
                progress(i / len(sgs), f"{i}/{len(sgs)} shapes")
        if progress is not None:
            progress(1.0, f"{len(sgs)}/{len(sgs)} shapes")

    # --- result -----------------------------------------------------------------------------

    def candidate(self, sg: ShapeGroup, types, layers) -> Candidate:
        g = sg.group
        return Candidate(tp=g.tp, pp=sg.pp, dp=g.dp, mbs=g.mbs,
                         stage_types=tuple(g.names[t] for t in types), layers=tuple(layers),
                         schedule=sg.schedule, virtual_stages=sg.virtual_stages)

    def stats(self) -> SearchStats:
        c = self.ctr
        pruned = {"shape_bound": self.pruned_shapes, "structure_bound": self.pruned_structures,
                  "stage_bound": c[PRUNED_BOUND], "path_bound": c[PRUNED_PATH],
                  "memory": c[PRUNED_MEMORY], "ridge": c[PRUNED_RIDGE], "order": c[PRUNED_ORDER]}
        return SearchStats(
            mode=self.options.mode, kernel="pure-python" if self.pure else "compiled",
            wall_s=time.perf_counter() - self.t0, complete=self.complete, structures=self.structures,
            shapes=len(self.shapes), warmup_samples=getattr(self, "warmup_done", 0),
            simulator_calls=self.sim_calls + c[SIM_CALLS], bound_evaluations=c[BOUND_EVALS],
            nodes=c[NODES], pruned=pruned, comm_model=self.options.comm_model,
            alternatives_proven=self.board.exact_alternatives and self.complete)

    def result(self) -> SearchResult:
        ranked = self.board.ranked()
        if not ranked and not self.complete:
            raise PoseidonError(f"--time-limit {self.options.time_limit_s:g} s ran out before any plan "
                                "was found; raise it")
        if not ranked:
            from .diagnose import explain_infeasible
            raise NoFeasiblePlanError(explain_infeasible(self.cm, self.space))
        stats = self.stats()
        cm = self.cm
        alts = []
        for ms, _key, (sg, types, layers) in ranked[1:]:
            alts.append(cm.summarize(self.candidate(sg, types, layers), ms))
        ms, _key, (sg, types, layers) = ranked[0]
        plan = cm.make_plan(self.candidate(sg, types, layers), ms, alternatives=alts,
                            search_stats=stats.to_dict(), comm_model=self.options.comm_model)
        return SearchResult(plan=plan, alternatives=tuple(alts), stats=stats)


def search(cost_model: CostModel, options: SearchOptions | None = None) -> SearchResult:
    """Find the plan with the shortest simulated iteration time (see the module docstring)."""
    options = options or SearchOptions()
    if options.mode == "exhaustive":
        from .exhaustive import exhaustive_search
        return exhaustive_search(cost_model, options)
    run = _Run(cost_model, options)
    run.search()
    return run.result()


__all__ = ["COUNTER_NAMES", "Leaderboard", "search", "use_pure_python"]
