"""The search driver: warm-up, best-first order over the space, branch and bound per structure.

``search(cost_model, SearchOptions(...)) -> SearchResult``. Outline (docs/SEARCH.md):

1. warm-up: simulate ``warmup_count`` random feasible plans to seed the leaderboard (paper §4.2.3;
   ``default`` mode only, unless asked);
2. order every shape group ``(tp, mbs, dp, schedule, V, pp)`` by a cheap throughput estimate;
3. per shape group: a bound check at the root with types and layers free (prunes the whole group),
   a greedy seed plan, then the branch and bound of each ranks-per-type structure with the threshold of
   its leaderboard key;
4. the best plan of the best key becomes the :class:`~poseidon_plugin.plan.Plan`; the next keys' best
   plans are its alternatives.
"""

from __future__ import annotations

import heapq
import importlib
import math
import random
import time
from array import array
from typing import Any, Callable

from ..backend import compiled
from ..costmodel import Candidate, CostModel
from ..errors import NoFeasiblePlanError
from ..plan import format_gap
from .counters import (BOUND_EVALS, COUNTER_NAMES, IMPROVED, N_COUNTERS, NODES, PRUNED_BOUND,
                       PRUNED_MEMORY, PRUNED_ORDER, PRUNED_PATH, PRUNED_RIDGE, SIM_CALLS)
from .evaluate import greedy_split, iterated_polish, plan_fits, simulate_plan, spread
from .evaluate import polish as polish_plan
from .leaderboard import Leaderboard
from .options import SearchOptions, SearchResult, SearchStats, TimeLimitError
from .seeds import assignment_seeds, relaxation_split
from .shapes import ShapeCache, ShapeData
from .shared_walk import raced_run, shared_run
from .space import SearchSpace, ShapeGroup
from .split_result import SplitResult

INF = math.inf
WARMUP_SHAPES = 16
SEED_SHAPES = 64
POLISH_EVALS = 10_000         # neighbours one local search of a best plan tries, at most
IMPROVE_AT = 8_192            # exact mode: a group's first tree past this many nodes stops for an
                             # iterated local search from the group's best plan (SearchRun.improve), then
                             # its walk resumes where it stopped, below the new threshold
IMPROVE_EVALS = 40_000        # ... which simulates at most this many plans ...
IMPROVE_PATIENCE = 8          # ... and stops after this many kicks in a row that found nothing better
LAZY_BOUNDS = 32             # memory-aware group bounds computed per lower_bound() call, at most
                             # (the per-position form: up to ~0.15 s each at frontier scale) ...
LAZY_S = 0.05                # ... and at most this many seconds of them
BOUND_RESERVE = 0.25         # ... except in this last share of --time-limit, kept back from the search
                             # for the bounds of the open groups when the clock cuts an exact search off;
LOOKAHEAD_AT = (2_048, 256)  # exact mode: the first structure whose tree passes this many nodes (one chunk
                             # per rank, interleaved: ~10x costlier nodes, the relaxation bound's) stops, and
LOOKAHEAD_NODES = 64         # ... the groups after it are searched with at most this many nodes per structure
LOOKAHEAD_TOTAL = 8_192      # ... and this many in all, in the next LOOKAHEAD_GROUPS groups at most (their
LOOKAHEAD_GROUPS = 256       # root checks cost time at frontier scale), for a better plan; then it is
                             # searched again (:meth:`SearchRun.look_ahead`)
RACE_AT = 8_192              # exact mode: a one-chunk tree decided from the end (docs/SEARCH.md, "Branching
RACE_SHARE = 2               # order") past this many nodes races its twin in pipeline order: the walk behind
                             # gets 1/RACE_SHARE of the leader's nodes, the first walk to end closes the
                             # structure (:meth:`SearchRun.race`)
RESUME_MIN_S = 0.5           # once they are computed, the search goes on where it was cut if at least
                             # this much of the reserve is left (with the same share kept back again)


def _pure_twin(name: str):
    """The uncompiled source of a compiled search module (``splits``, ``bounds``), imported on first use:
    a compiled search never needs it, and a fresh ``poseidon plan`` process would pay its import."""
    return importlib.import_module(f"{__package__}.{name}")


def use_pure_python(options: SearchOptions) -> bool:
    """Whether this search runs the pure-Python loop: ``POSEIDON_PURE_PYTHON=1`` forces it (as it does
    for every compiled piece), else ``options.pure_python``, else the compiled core when it is built."""
    if options.pure_python:
        return True
    return compiled("_dag") is None or compiled("_search") is None or compiled("assignment") is None


class SearchRun:
    """State of one branch-and-bound search (``default`` and ``exact`` modes): the space, the shapes
    built so far, the :class:`~.leaderboard.Leaderboard`, the counters and the clock.

    ``SearchRun(cm, options).search()`` then ``.result()``; :func:`search` does both.
    """

    def __init__(self, cm: CostModel, options: SearchOptions, *, clock: Callable[[], float] | None = None,
                 node_budget: int | None = None, reserve: bool | None = None):
        """``clock`` (default ``time.monotonic``) is what ``time_limit_s`` is measured on; a test
        injects a counter to stop the search at a fixed point. ``node_budget``: stop each structure
        search after this many nodes (deterministic, for tests); the result is then incomplete.
        ``reserve``: keep BOUND_RESERVE of the limit for the bounds of the open pieces, and search on
        with what they leave (default: exact mode with a limit on the real clock; a test can ask for it
        on an injected clock)."""
        self.cm, self.options = cm, options
        self.clock = clock or time.monotonic
        # the limit counts from here: the space and its cost tables are part of the search's time
        self.deadline = INF if options.time_limit_s is None else self.clock() + options.time_limit_s
        # an exact search cut off by the clock spends the last BOUND_RESERVE of the limit on the
        # memory-aware bounds of the open shape groups (frontier-1024: ~800 groups, ~4 CPU s), not just
        # LAZY_BOUNDS of them, then searches on with what they leave (:meth:`resume`). By default on the
        # real clock only (an injected one stops the search where the test says, unless the test asks for
        # the reserve); default mode keeps all of its time for the plan
        self.bound_deadline = -INF
        if reserve is None:
            reserve = self.clock is time.monotonic and options.mode == "exact"
        if options.time_limit_s is not None and reserve:
            self.bound_deadline = self.deadline
            self.deadline -= BOUND_RESERVE * options.time_limit_s
        self.resumes = 0
        self.resume_at: dict[tuple, int] = {}   # a group the clock cut: its first structure not closed
        self.cut_walks: set[tuple] = set()       # ... and whose structure's walk it cut (its splitter kept)
        # exact mode: the first large tree is still to stop for :meth:`look_ahead` (False once it has, and
        # in default mode); the main loop's order and position, which the look-ahead goes on from
        self.lookahead = options.mode == "exact"
        self.improved: set[tuple] = set()     # groups whose best plan had its iterated local search
        self.order: list[ShapeGroup] = []
        self.at = 0
        self.node_budget = node_budget
        self.pure = use_pure_python(options)
        self.workers = options.workers       # processes a large tree's walk is shared among
        # the positional bound's assignment solver: the compiled one unless the search is pure
        self.assign = None
        # the whole-group bounds: compiled from the same source unless the search is pure
        self.bounds = (None if self.pure else compiled("bounds")) or _pure_twin("bounds")
        if not self.pure:
            self.assign = compiled("assignment").best_assignment
        self.space = SearchSpace(cm, options)
        self.shapes = ShapeCache(self.pure, options.comm_model, cm.comm_extras)
        self.board = Leaderboard(options.top_k,
                                 exact_alternatives=options.mode == "exhaustive" or options.exact_alternatives)
        self.ctr = [0] * N_COUNTERS
        self.pruned_shapes = 0
        self.pruned_structures = 0
        self.structures = 0
        self.sim_calls = 0
        self.t0 = time.perf_counter()
        # the compiled loop reads the real clock itself: an injected one stops only the engine
        self.split_deadline = self.deadline if self.clock is time.monotonic else INF
        # anytime lower bound (docs/SEARCH.md): every plan of a closed piece of the space (searched or
        # cut at a threshold) takes at least `floor`; the open pieces are bounded when asked
        self.floor = INF
        self.open_groups: list[tuple[float, bool, int]] = []   # heap: (bound, memory-aware, index)
        self.sgs: list[ShapeGroup] = []
        self.index: dict[tuple, int] = {}   # key -> position in sgs
        self.group_done: list[bool] = []
        self.partial = INF          # bound of the structures of the current group not yet closed
        self.complete = True
        self.stopped_by: str | None = None    # what stopped the search before its end (stats.unproven)
        self.proven = False             # not complete, but the open pieces' bounds reach the best plan
        self.ridge = options.mode == "default"
        self.blocks = options.mode == "default" and options.type_blocks
        self.gap = options.gap
        # a plan this fast is known to the caller (another search variant): nothing at or above it matters
        self.cutoff = INF if options.cutoff_ms is None or self.board.exact_alternatives else options.cutoff_ms
        self.shrink = 1.0 / (1.0 + self.gap)
        self.memory_blocked: list[tuple[float, str, float]] = []   # (need GB, type, usable GB)
        self._splitters: dict[tuple, Any] = {}   # seeded groups that passed their root check, and groups
                                                 # whose walk the clock cut (resumed in their turn)
        # a group's pipeline-order twin of its splitter, and the race of the structure it walks:
        # [counts, [nodes of the splitter's walk, of the twin's], the walk that leads] (:meth:`race`)
        self._twins: dict[tuple, Any] = {}
        self._races: dict[tuple, list] = {}
        self.races = 0                  # structures that raced their twin, and those the twin closed
        self.twin_wins = 0
        self.race_leader = 0            # the walk a race starts with: 0 from the end, 1 the twin

    # --- helpers ----------------------------------------------------------------------------

    def shape(self, sg: ShapeGroup) -> ShapeData:
        return self.shapes.get(sg.schedule, sg.pp, sg.group.micro_batches, sg.virtual_stages)

    def splitter(self, sg: ShapeGroup, alternate: bool | None = None, backward: bool | None = None):
        """The search of the group's structure trees (``SplitSearch``, compiled unless the search is pure);
        ``alternate``: the ranks decided from both ends in turn (default: interleaved shapes; docs/SEARCH.md,
        "Branching order"; the pipeline order where the ridge or block rules apply, in default mode);
        ``backward``: one-chunk ranks decided from the end (default), or in pipeline order (False: the
        twin a race walks, :meth:`race`)."""
        if alternate is None:
            alternate = sg.virtual_stages > 1
        g = sg.group
        table, shape = self.space.table(g), self.shape(sg)
        cls = self.space.type_classes(g)
        # one chunk per rank: decide the ranks from the last one, rank 0 first where its memory holds the
        # average rank's layers (docs/SEARCH.md, "Branching order"; the splitters keep the pipeline order
        # where the ridge or block rules apply)
        if backward is None:
            backward = sg.virtual_stages == 1
        if self.pure:
            return _pure_twin("splits").SplitSearch(table, shape, self.space.num_layers, ridge=self.ridge,
                                                    blocks=self.blocks, type_class=cls, gap=self.gap,
                                                    backward=backward, alternate=alternate)
        from poseidon_plugin._core._search import SplitSearch
        return SplitSearch(table, shape, self.space.num_layers, ridge=self.ridge, blocks=self.blocks,
                           type_class=cls, gap=self.gap, backward=backward, alternate=alternate)

    def offer(self, sg: ShapeGroup, ms: float, types, layers) -> None:
        self.board.offer(sg.key, ms, lambda: self.candidate(sg, types, layers))

    def polish_best(self) -> None:
        """:meth:`polish` the best plan so far."""
        if self.board.best:
            self.polish(self.sgs[self.index[min(self.board.best, key=self.board.best_ms)]])

    def polish(self, sg: ShapeGroup) -> None:
        """Local search (:func:`.evaluate.polish`) from the group's best plan; offers what it finds."""
        self._local_search(sg, polish_plan, max_evals=POLISH_EVALS)

    def _local_search(self, sg: ShapeGroup, search: Callable, **limits) -> None:
        """``search`` (a local search of :mod:`.evaluate`, with ``limits``) from the group's best plan;
        offers what it finds."""
        got = self.board.best.get(sg.key)
        if got is None or self.out_of_time():
            return
        ms0, cand = got
        types = [sg.group.names.index(name) for name in cand.stage_types]
        pp, v = sg.pp, sg.virtual_stages
        rank_layers = [sum(cand.layers[c * pp + r] for c in range(v)) for r in range(pp)]
        shape = self.shape(sg)
        ms, types, rank_layers, sims = search(shape.new_params(), self.space.table(sg.group), shape, types,
                                              rank_layers, ms0, stop=self.out_of_time, **limits)
        self.sim_calls += sims
        if ms < ms0:
            self.offer(sg, ms, types, spread(rank_layers, pp, v))

    def threshold(self, key: tuple) -> float:
        """The leaderboard's threshold for ``key``, or the caller's cutoff where lower."""
        return min(self.board.threshold(key), self.cutoff)

    def out_of_time(self) -> bool:
        if not self.complete:
            return True
        if self.clock() > self.deadline:
            self.complete = False
            self.stopped_by = "the time limit"
            return True
        return False

    def close(self, bound: float) -> None:
        """A piece of the space is closed: each of its plans takes at least ``bound``."""
        if bound < self.floor:
            self.floor = bound

    def lazy_budget(self) -> Callable[[int], bool]:
        """Whether to compute one more memory-aware bound, given how many of the ``LAZY_BOUNDS`` are
        left: in the reserve of an exact search the clock cut off, until the limit; otherwise while
        some are left and for at most ``LAZY_S`` (at frontier scale one takes up to ~0.15 s)."""
        # the reserve is measured on the search's clock; the LAZY_S cap on the real one (an injected
        # clock without a reserve stops the search where its test says, and no later)
        clock = self.clock if self.bound_deadline > -INF else time.monotonic
        now = clock()
        if not self.complete and self.bound_deadline > now:
            return lambda _left: clock() < self.bound_deadline
        until = now + LAZY_S
        return lambda left: left > 0 and clock() < until

    def lower_bound(self) -> float:
        """Proven lower bound on every plan of the space searched (default mode: of the default
        space): the best plan, the floor of the closed pieces, the bounds of the open ones."""
        lb = min(self.board.best_ms_all(), self.floor, self.partial)
        heap = self.open_groups
        # the open groups, cheapest bound first; the memory-aware bound is computed lazily, for the
        # groups that reach the top (a cheap bound is valid too, so the effort is capped: LAZY_BOUNDS,
        # or the reserve of a search the clock cut off)
        lazy, more = LAZY_BOUNDS, self.lazy_budget()
        while heap and heap[0][0] < lb:
            b, strong, i = heap[0]
            if self.group_done[i]:
                heapq.heappop(heap)        # closed: its floor is counted (a done group costs nothing)
            elif strong or not more(lazy):
                break
            else:
                lazy -= 1
                heapq.heapreplace(heap, (max(b, self.bound(self.sgs[i], memory=True,
                                                                target=self.board.best_ms_all())), True, i))
        if heap:
            lb = min(lb, heap[0][0])
        return lb

    def gap_now(self) -> float:
        """``best / lower bound - 1`` (inf without a plan or a positive bound)."""
        best, lb = self.board.best_ms_all(), self.lower_bound()
        if best == INF or lb <= 0:
            return INF
        return max(0.0, best / lb - 1.0)

    def proven_within_gap(self) -> bool:
        """With ``--gap F``: the best plan is proven within ``1 + F`` of every open piece."""
        return self.gap > 0 and self.board.best_ms_all() * self.shrink <= self.lower_bound()

    def bound(self, sg: ShapeGroup, counts=None, memory: bool = True, positional: bool | None = None,
              target: float | None = None, witness: list | None = None) -> float:
        """:func:`.bounds.pipeline_bound` of a shape group (``counts``: of one structure); ``positional``
        (default: ``memory``) adds the per-position memory caps (:func:`.bounds.positional_bound`, with
        the fill and drain terms of the schedule; ``target``: the caller needs no more than just above
        it; ``witness``: filled with the relaxation's best assignment, exact counts only)."""
        g = sg.group
        if counts is None:
            counts = [min(n, sg.pp) for n in g.slots]
        live = None
        if memory if positional is None else positional:
            live = CostModel.peak_live(sg.schedule, sg.pp, g.micro_batches, sg.virtual_stages)
        return self.bounds.pipeline_bound(self.space.table(g), counts, g.micro_batches, sg.pp,
                                          sg.virtual_stages, self.space.num_layers, memory=memory,
                                          live=live, schedule=sg.schedule, target=target,
                                          comm_model=self.options.comm_model, assign=self.assign,
                                          witness=witness)

    # --- phases -----------------------------------------------------------------------------

    def warmup(self, sgs: list[ShapeGroup]) -> int:
        """Simulate random feasible plans (paper: 500) to seed the leaderboard."""
        n = self.options.warmup_count
        if n == 0 or not sgs:
            return 0
        rng = random.Random(self.options.seed)
        done = tries = 0
        params_cache: dict[tuple, array] = {}
        while done < n and tries < 20 * n:
            tries += 1
            if tries % 16 == 0 and self.out_of_time():
                break
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
        per = sorted((tb.forward_ms[t] + tb.backward_ms[t], g.slots[t]) for t in range(len(g.names)))
        rate, left = 0.0, sg.pp
        for c, n in per:
            k = min(n, left)
            rate += k / c
            left -= k
        m = g.micro_batches
        bubble = (m + (sg.pp - 1) / sg.virtual_stages) / m
        return m * self.space.num_layers / rate * bubble

    def seed(self, sg: ShapeGroup, build: bool = True) -> None:
        """A greedy plan per contiguous type order of the fastest-first counts, and the memory-aware
        assignment seeds (:mod:`.seeds`): early incumbents. ``build=False``: the assignment seeds only
        when the shape's DAG is built already (a frontier-scale DAG costs ~1.7 s under the megatron
        comm models; the group's own turn builds it anyway)."""
        g = sg.group
        tb, shape = self.space.table(g), self.shape(sg)
        order = sorted(range(len(g.names)), key=lambda t: (tb.forward_ms[t] + tb.backward_ms[t]))
        counts = [0] * len(g.names)
        left = sg.pp
        for t in order:
            counts[t] = min(g.slots[t], left)
            left -= counts[t]
        params = shape.new_params()
        used = [t for t in order if counts[t]]
        by_memory = sorted(used, key=lambda t: -tb.usable_bytes[t])
        for seq_types in (used, by_memory, list(reversed(used))):
            types = [t for t in seq_types for _ in range(counts[t])]
            rank_layers = greedy_split(tb, shape, types, self.space.num_layers)
            if rank_layers is not None:
                self._try_seed(sg, params, tb, shape, types, rank_layers)
        # memory-aware orders: the types where their memory holds the most layers (search/seeds.py)
        if not (build or shape.has_kernel):
            return
        for types, rank_layers in assignment_seeds(tb, shape, g.slots, self.space.num_layers):
            if all(types.count(t) <= g.slots[t] for t in set(types)):
                self._try_seed(sg, params, tb, shape, types, rank_layers)

    def relaxation_seed(self, sg: ShapeGroup, witness: list) -> bool:
        """The plan of a structure's positional bound (its witness: a device type and a layer cap per
        position, :func:`.bounds.positional_bound`), within memory and down to the model's layers
        (:func:`.seeds.relaxation_split`): whether it beats the group's best plan so far. Where the
        bound is tight this is near the structure's optimum: on paper Setting 6 at 288 NPUs (seq 2048) it
        is the optimum, which the tree below the seeds' threshold found only after 3.7 M nodes."""
        g = sg.group
        tb, shape = self.space.table(g), self.shape(sg)
        _t, types, caps = witness
        rank_layers = relaxation_split(tb, shape, types, caps, self.space.num_layers)
        if rank_layers is None:
            return False
        before = self.board.best_ms(sg.key)
        self._try_seed(sg, shape.new_params(), tb, shape, types, rank_layers)
        return self.board.best_ms(sg.key) < before

    def _try_seed(self, sg: ShapeGroup, params, tb, shape: ShapeData, types, rank_layers) -> None:
        """Simulate a seed plan (per-rank layer counts spread over the chunks) and offer it if it fits."""
        layers = spread(rank_layers, sg.pp, sg.virtual_stages)
        if plan_fits(tb, shape, types, layers):
            ms = simulate_plan(params, tb, shape, types, layers)
            self.sim_calls += 1
            self.offer(sg, ms, types, layers)

    def may_improve(self, sg: ShapeGroup) -> bool:
        """Whether the group's next tree stops at IMPROVE_AT nodes for :meth:`improve`: exact mode, once
        per group (a tree that ends within IMPROVE_AT nodes has no local search)."""
        return self.options.mode == "exact" and sg.key not in self.improved

    def improve(self, sg: ShapeGroup) -> None:
        """Iterated local search (:func:`.evaluate.iterated_polish`) from the group's best plan; offers
        what it finds. On interleaved trees a weak incumbent costs the most: paper Setting 6 at 288
        NPUs (GBS 64, seq 1024) searched 417,511 of its tree's 505,242 nodes before it found the
        optimum, which the kicks reach in ~37,000 simulated plans (~0.9 s). One-chunk groups too: on
        frontier-4096 the PP 32 tree's local search and walk below tau take 38,746 nodes where the
        probes took 58,722 (docs/SEARCH.md)."""
        self.improved.add(sg.key)
        self._local_search(sg, iterated_polish, max_evals=IMPROVE_EVALS, patience=IMPROVE_PATIENCE)

    def add(self, counters) -> None:
        for i, c in enumerate(counters):
            self.ctr[i] += c

    def fluid_cut(self, sg: ShapeGroup, tau: float) -> bool:
        """The shape-free bound of :func:`.bounds.fluid_cut` for a shape group."""
        g = sg.group
        return self.bounds.fluid_cut(self.space.table(g), g.slots, g.micro_batches, sg.pp,
                                     sg.virtual_stages, self.space.num_layers, tau)

    def root_splitter(self, sg: ShapeGroup, cheap: float | None = None):
        """The group's structure search, or None when the fluid cut, the pipeline bound (``cheap``: its
        value, when the caller has it), the group's positional bound or the root bound (types and
        layers free) proves the group cannot beat its threshold. The splitter of a group that
        survives is kept: the seed phase checks the group before its own turn comes."""
        tau = self.threshold(sg.key) * self.shrink
        # the cheap bounds, then the per-position memory bound of the whole group (each type at most
        # its slots): at frontier scale it cuts nearly every group that reaches it, before the shape's
        # bound paths are built and before each structure's own positional bound
        if (self.fluid_cut(sg, tau) or (self.bound(sg, positional=False) if cheap is None else cheap) >= tau
                or self.bound(sg, target=tau) >= tau):
            self.close(tau)
            return None
        if self.out_of_time():          # building the shape's bound paths costs time at scale
            return None
        splitter = self._splitters.get(sg.key) or self.splitter(sg)
        # counts are upper limits here: no plan uses more than pp slots of a type
        root = splitter.run([min(n, sg.pp) for n in sg.group.slots], tau, root_only=True)
        self.add(root.counters)
        if root.time_ms == INF:
            self._splitters.pop(sg.key, None)
            self.close(tau)
            return None
        self._splitters[sg.key] = splitter
        return splitter

    def run_shape_group(self, sg: ShapeGroup) -> None:
        key = sg.key
        g = sg.group
        self.partial = self.bound(sg, positional=False)        # the group is open until its structures are closed
        splitter = self.root_splitter(sg, self.partial)
        self._splitters.pop(key, None)         # this is the group's turn (kept again if the clock cuts its walk)
        if splitter is None:
            if self.complete:
                self.pruned_shapes += 1
                self.partial = INF
            return
        vectors = self.space.count_vectors(sg)
        tb = self.space.table(g)
        vectors.sort(key=lambda vec: -sum(n / (tb.forward_ms[t] + tb.backward_ms[t]) for t, n in enumerate(vec)))
        # the per-position memory bound costs ~pp x types per step: computed below, only for the
        # structures the cheap bound does not cut
        bounds = [self.bound(sg, vec, positional=False) for vec in vectors]
        strong = [False] * len(vectors)     # bounds[i] is the memory-aware form
        seeded = False
        # resumed after the clock cut it (:meth:`resume`): the structures before are closed already, and
        # the walk of the one it cut goes on where it stopped (its splitter was kept)
        start = self.resume_at.pop(key, 0)
        for i in range(start, len(vectors)):
            vec = vectors[i]
            if self.out_of_time():
                self.resume_at[key] = i
                self.partial = self.open_structures_bound(sg, vectors, bounds, strong, i)
                return
            self.structures += 1
            tau = self.threshold(key) * self.shrink
            witness: list = []
            if bounds[i] < tau:
                # the memory-aware form is valid too, and the larger: it also bounds the structure
                # while open
                bounds[i], strong[i] = max(bounds[i], self.bound(sg, vec, target=tau, witness=witness)), True
            if bounds[i] < tau and not seeded:
                # the group's seeds, once a structure needs its tree: a seed may build the shape's
                # DAG (~1.7 s at frontier scale), and where every structure's bound reaches tau no
                # seed of the group can beat it. Not past the deadline, unless there is no plan yet
                seeded = True
                if key not in self.board.best and (not self.out_of_time() or not self.board.best):
                    self.seed(sg)
                    tau = self.threshold(key) * self.shrink
            # exact mode only: its trees are proofs that a tight incumbent shortens; default mode keeps
            # its (time-limited) search as it was
            if (self.options.mode == "exact" and bounds[i] < tau and witness
                    and self.relaxation_seed(sg, witness) and not self.out_of_time()):
                self.polish(sg)
                tau = self.threshold(key) * self.shrink
            if bounds[i] >= tau:
                self.pruned_structures += 1
                self.close(tau)
                continue
            cut = False
            # the structure the clock cut: on from the stopped walk where it can (SplitSearch.can_resume:
            # the same counts, a threshold no higher)
            resume = i == start and key in self.cut_walks
            self.cut_walks.discard(key)
            while True:
                # the first large tree stops for the look-ahead, a group's first large tree for the
                # local search from its best plan (:meth:`improve`); then it is searched again
                # (after the local search, from where its walk stopped)
                cap = LOOKAHEAD_AT[sg.virtual_stages > 1] if self.lookahead else 0
                if not cap and self.may_improve(sg):
                    cap = IMPROVE_AT         # resumed after the local search
                res = self.split(splitter, vec, tau, cap=cap, resume=resume, sg=sg)
                if not (res.aborted and self.stopped_at_cap(res, cap)):
                    break
                if res.time_ms < INF:
                    self.offer(sg, res.time_ms, res.types, res.layers)
                if self.lookahead:
                    # the groups after this one may hold a plan that cuts most of the tree
                    self.lookahead = False
                    self.look_ahead()
                else:
                    self.improve(sg)
                    resume = True        # where the stopped walk was: the tree before it is searched
                tau = self.threshold(key) * self.shrink
                cut = bounds[i] >= tau
                if cut:
                    break
            if cut:
                self.pruned_structures += 1
                self.close(tau)
                continue
            if res.counters[NODES] <= 1 and res.counters[IMPROVED] == 0:
                self.pruned_structures += 1
            if res.time_ms < INF:
                self.offer(sg, res.time_ms, res.types, res.layers)
            if res.aborted:
                self.complete = False
                self.stopped_by = ("the node budget" if self.node_budget and res.counters[NODES] >= self.node_budget
                                   else "the time limit")
                self.resume_at[key] = i
                self._splitters[key] = splitter      # its walk resumes where it stopped (resume)
                self.cut_walks.add(key)
                # this structure is open: its plans take at least its own bound (and a plan it found)
                self.partial = self.open_structures_bound(sg, vectors, bounds, strong, i)
                return
            # closed: every plan below tau was searched, and the loop lowered tau to best x shrink
            self.close(min(tau, res.time_ms * self.shrink))
        self.partial = INF

    def stopped_at_cap(self, res, cap: int) -> bool:
        """Whether an aborted structure search stopped at its ``cap`` of nodes (not the clock, not a test's
        node budget)."""
        if not (0 < cap <= res.counters[NODES]) or self.out_of_time():
            return False
        return not (self.node_budget and res.counters[NODES] >= self.node_budget)

    def look_ahead(self) -> None:
        """Exact mode, once, when the first structure's tree passes LOOKAHEAD_AT nodes: the next
        LOOKAHEAD_GROUPS groups in the main loop's order that pass their root check, each structure
        searched with at most LOOKAHEAD_NODES nodes below the threshold (LOOKAHEAD_TOTAL in all); the
        plans found are offered, the best polished. Only incumbents: each group is searched in full in
        its turn. The groups are ranked by their greedy seeds and an estimate; a group ranked late may
        hold the optimum in a small tree: on a random 128-device cluster of three types (llama3-70b, seq
        4096) the seeds stopped at 70,706 ms, the groups ranked first searched 230,000 nodes below that,
        and the optimum, 67,292 ms, lay in the 131st group's tree of 153 nodes."""
        start = self.ctr[NODES]
        for sg in self.order[self.at + 1:self.at + 1 + LOOKAHEAD_GROUPS]:
            if self.ctr[NODES] - start >= LOOKAHEAD_TOTAL or self.out_of_time():
                break
            splitter = self.root_splitter(sg)
            if splitter is not None:
                tau = self.threshold(sg.key) * self.shrink
                for vec in self.space.count_vectors(sg):
                    if self.ctr[NODES] - start >= LOOKAHEAD_TOTAL or self.out_of_time():
                        break
                    if self.bound(sg, vec, positional=False) >= tau:
                        continue
                    res = splitter.run(vec, tau, deadline=self.split_deadline, max_nodes=LOOKAHEAD_NODES)
                    self.add(res.counters)
                    if res.time_ms < INF:
                        self.offer(sg, res.time_ms, res.types, res.layers)
                        tau = self.threshold(sg.key) * self.shrink
        self.polish_best()

    def split(self, splitter, vec, tau: float, cap: int = 0, resume: bool = False, sg: ShapeGroup | None = None):
        """Search one structure's tree for its best plan below ``tau``; ``cap``: at most this many nodes
        (aborted past it); ``resume``: the walk goes on where the last one stopped (``SplitSearch.run``).
        Below ``tau`` alone: thresholds rising from the structure's bound to ``tau`` first (tried before)
        paid where the incumbent was weak; with a local search in every group (exact mode) they are
        proofs below the optimum that only add nodes, and default mode searched twice the nodes with
        them (docs/SEARCH.md, "The probes dropped"). ``sg``: a one-chunk tree of the group races its
        twin in pipeline order past RACE_AT nodes (:meth:`race`)."""
        budget = self.node_budget or 0
        if cap and (not budget or cap < budget):
            budget = cap
        if (sg is None or sg.virtual_stages > 1 or self.ridge or self.blocks
                or (budget and budget <= RACE_AT)):
            if self.workers > 1 and not budget:
                # a walk past SHARE_AT nodes goes on in several processes (search/shared_walk.py)
                res = shared_run(splitter, vec, tau, workers=self.workers, shrink=self.shrink,
                                 deadline=self.split_deadline, resume=resume)
            else:
                res = splitter.run(vec, tau, deadline=self.split_deadline, max_nodes=budget, resume=resume)
            self.add(res.counters)
            return res
        if self.workers > 1 and not budget:
            return self.parallel_race(sg, splitter, vec, tau, resume)
        return self.race(sg, splitter, vec, tau, budget, resume)

    def twin(self, sg: ShapeGroup):
        """The group's walk in pipeline order, a race's other walk (kept per group: a race resumes it)."""
        walk = self._twins.get(sg.key)
        if walk is None:
            walk = self._twins[sg.key] = self.splitter(sg, backward=False)
        return walk

    def parallel_race(self, sg: ShapeGroup, splitter, vec, tau: float, resume: bool):
        """:meth:`race` in two processes (``search/shared_walk.raced_run``): the leading walk goes alone for
        RACE_AT nodes, as in the race; then the other walk runs in a forked child beside it, both to their
        end below the best plan either found, and the first to end closes the structure (the next race
        leads with its order). The clock stops both; the leading walk resumes where it stopped."""
        self._races.pop(sg.key, None)       # a race in one process left for this one: its legs are not kept
        walks = (splitter, self.twin(sg))
        lead = self.race_leader
        first = walks[lead].run(vec, tau, deadline=self.split_deadline, max_nodes=RACE_AT,
                                resume=resume if lead == 0 else True)
        self.add(first.counters)
        if not first.aborted or first.counters[NODES] < RACE_AT:
            return first                    # ended alone, or the clock
        limit = min(tau, first.time_ms * self.shrink)
        res, ended = raced_run(walks[lead], walks[1 - lead], vec, limit, shrink=self.shrink,
                               deadline=self.split_deadline, resume_lead=True,
                               resume_other=resume if lead == 1 else True)
        self.add(res.counters)
        self.races += 1
        if not res.aborted:
            winner = lead if ended == 0 else 1 - lead
            self.twin_wins += winner
            self.race_leader = winner
        best = min((res.time_ms, res.types, res.layers), (first.time_ms, first.types, first.layers))
        return SplitResult(time_ms=best[0], types=best[1], layers=best[2],
                           counters=tuple(a + b for a, b in zip(first.counters, res.counters)),
                           aborted=res.aborted, resumed=first.resumed)

    def race(self, sg: ShapeGroup, splitter, vec, tau: float, budget: int, resume: bool):
        """:meth:`split` of a one-chunk tree, decided from the end, raced against its twin in pipeline
        order. Which order proves a structure in fewer nodes depends on the instance, by two orders of
        magnitude either way: from the end where memory keeps the early ranks short (frontier-4096), in
        pipeline order where it does not and the front's layers decide the bound (Setting 6 at 192 NPUs,
        GBS 64, seq 1024: 14,810 nodes against more than 4 million; docs/SEARCH.md, "Branching order").
        The leading walk goes alone for RACE_AT nodes; then the other walks until it has 1/RACE_SHARE of
        the leader's nodes, the leader as many again as it has, and so on, each walk going on where it
        stopped (``SplitSearch.run(resume=True)``) below the best plan either found. Both walks search
        the same plans, so the first to end has found the best plan below its threshold or proven there
        is none: the structure is closed, and the next race leads with that order. ``budget`` (> 0)
        bounds both walks' nodes together (a cap stops the race as it stops a walk, and the engine's
        resume goes on with both walks where they stopped); so does the clock."""
        key = sg.key
        state = self._races.get(key)
        if not (resume and state is not None and state[0] == tuple(vec)):
            state = self._races[key] = [tuple(vec), [0, 0], self.race_leader]
        nodes, lead = state[1], state[2]
        best, types, layers = INF, (), ()
        counters = [0] * N_COUNTERS
        ran = False                         # the splitter's walk went on in this call
        raced = False
        resumed = None                      # the first walk of this call went on where it had stopped
        while True:
            w = 1 - lead if nodes[lead] >= RACE_AT and nodes[1 - lead] < nodes[lead] // RACE_SHARE else lead
            leg = nodes[lead] // RACE_SHARE - nodes[w] if w != lead else max(RACE_AT, nodes[w])
            if budget:
                left = budget - counters[NODES]
                if left <= 0:
                    break
                leg = min(leg, left)
            limit = min(tau, best * self.shrink)
            if w == 1:
                walk = self.twin(sg)
                again = walk.can_resume(vec, limit)
            else:
                walk, again, ran = splitter, resume or ran, True
            res = walk.run(vec, limit, deadline=self.split_deadline, max_nodes=leg, resume=again)
            raced = raced or w != lead
            if resumed is None:
                resumed = res.resumed
            self.add(res.counters)
            for i in range(N_COUNTERS):
                counters[i] += res.counters[i]
            nodes[w] += res.counters[NODES]
            if res.time_ms < best:
                best, types, layers = res.time_ms, res.types, res.layers
            if not res.aborted:
                self._races.pop(key, None)
                if raced:
                    self.races += 1
                    self.twin_wins += w
                    self.race_leader = w    # the next race leads with the order that ended this one
                return SplitResult(time_ms=best, types=types, layers=layers, counters=tuple(counters),
                                   resumed=bool(resumed))
            if res.counters[NODES] < leg:
                break                       # the clock
        if raced:
            self.races += 1
        return SplitResult(time_ms=best, types=types, layers=layers, counters=tuple(counters), aborted=True,
                           resumed=bool(resumed))

    def open_structures_bound(self, sg: ShapeGroup, vectors, bounds: list[float], strong: list[bool],
                              start: int) -> float:
        """Bound of the structures ``start..`` of a group the clock left open: the memory-aware bound of
        the cheapest ones (cheapest first, as :meth:`lazy_budget` allows; the rest keep the cheap one)."""
        heap = [(bounds[i], i) for i in range(start, len(vectors))]
        heapq.heapify(heap)
        lazy, more = LAZY_BOUNDS, self.lazy_budget()
        while heap and not strong[heap[0][1]] and more(lazy):
            lazy -= 1
            b, i = heap[0]
            strong[i] = True
            heapq.heapreplace(heap, (max(b, self.bound(sg, vectors[i], target=self.board.best_ms_all())), i))
        return heap[0][0] if heap else INF

    def search(self) -> None:
        sgs = list(self.space.shape_groups())
        if not sgs:
            return
        sgs.sort(key=self.estimate)
        # every group is open until the main loop closes it; its pipeline bound bounds it meanwhile
        self.group_done = [False] * len(sgs)
        self.sgs = sgs
        self.open_groups = [(self.bound(sg, memory=False), False, i) for i, sg in enumerate(sgs)]
        heapq.heapify(self.open_groups)
        index = self.index = {sg.key: i for i, sg in enumerate(sgs)}
        # greedy seeds of the most promising groups, then search those with the best seeds first:
        # a tight incumbent early is what makes the bounds cut
        head = sgs[:SEED_SHAPES]
        alive = []
        for sg in head:
            if self.out_of_time():
                if self.board.best:
                    break
                # no plan yet: a greedy seed (one DAG build) is cheap next to returning nothing, so
                # the clock never stops the search before a plan is known where a seed fits
                if self.bound(sg, memory=False) < INF:
                    self.seed(sg)
                continue
            # a seed builds the group's DAG: only for groups the cheap bounds cannot cut already
            if self.root_splitter(sg) is not None:
                self.seed(sg, build=False)
                alive.append(sg)
            elif not self.complete and not self.board.best and self.bound(sg, memory=False) < INF:
                self.seed(sg)          # the clock ran out inside the root check
        if not self.complete and not self.board.best:
            # out of time with no plan: seed the other groups until one fits (a seed that does not fit
            # is refused before its DAG is built, ~0.3 ms)
            for sg in sgs[SEED_SHAPES:]:
                if self.board.best:
                    break
                if self.bound(sg, memory=False) < INF:
                    self.seed(sg)
        # the warm-up (paper §4.2.3) draws from the most promising groups still alive: every shape it
        # touches needs its DAG built, and random plans of hopeless shapes seed nothing useful. None
        # alive: every head group is cut (by the bounds, a cutoff, memory) or the clock ran out, and a
        # random plan of a cut group cannot matter (a search below another variant's plan spent 4 of
        # its 4.2 CPU s here on 16 such DAGs, paper Setting 1 at GBS 1024)
        self.warmup_done = self.warmup(alive[:WARMUP_SHAPES])
        # the best plan so far, improved by local search: a tighter threshold for every group
        self.polish_best()
        seeded = {sg.key: self.board.best_ms(sg.key) for sg in head}
        head.sort(key=lambda sg: seeded[sg.key])
        sgs = head + sgs[SEED_SHAPES:]
        at = self.main_loop(sgs, index, 0)
        while at < len(sgs) and self.resume():
            at = self.main_loop(sgs, index, at)
        if self.options.progress is not None:
            self.options.progress(1.0, f"{len(sgs)}/{len(sgs)} shapes  {self.gap_text()}")

    def main_loop(self, sgs: list[ShapeGroup], index: dict[tuple, int], start: int) -> int:
        """Branch and bound of the groups ``sgs[start:]`` in order; the index of the first group not
        closed when the clock or ``--gap`` stops it (``len(sgs)``: all searched)."""
        progress = self.options.progress
        last_report = time.perf_counter()
        for i in range(start, len(sgs)):
            sg = sgs[i]
            if self.out_of_time():
                return i
            if self.proven_within_gap():
                self.stopped_by = f"--gap {self.gap:g}"
                return i
            self.order, self.at = sgs, i
            self.run_shape_group(sg)
            if self.partial == INF:
                self.group_done[index[sg.key]] = True
            elif not self.complete:
                return i               # cut inside this group: a resume goes on from it
            if progress is not None and time.perf_counter() - last_report > 0.1:
                last_report = time.perf_counter()
                progress(i / len(sgs), f"{i}/{len(sgs)} shapes  {self.gap_text()}")
        return len(sgs)

    def resume(self) -> bool:
        """An exact search the clock cut off: compute the bounds of the open pieces (in the reserve,
        :meth:`lower_bound`), then, if at least RESUME_MIN_S of the limit is left and the gap is not
        closed, search on with that time (keeping BOUND_RESERVE of it back again)."""
        if self.complete or self.bound_deadline == -INF or self.proven_within_gap():
            return False
        lb = self.lower_bound()
        left = self.bound_deadline - self.clock()
        if lb >= self.board.best_ms_all():
            # the bounds of the open pieces reach the best plan: it is the proven optimum, though
            # some pieces were not searched (with --exact-alternatives the runners-up are not proven)
            self.proven = not self.board.exact_alternatives
            return False
        if left < RESUME_MIN_S:
            return False
        self.resumes += 1
        self.deadline = self.bound_deadline - BOUND_RESERVE * left
        if self.clock is time.monotonic:
            self.split_deadline = self.deadline
        self.complete = True
        self.polish_best()         # the tree may have found a better plan since
        return True

    def gap_text(self) -> str:
        """``best 277,445 ms, proven >= 270,100 ms, gap 2.7 %`` (progress lines)."""
        return gap_text(self.board.best_ms_all(), self.lower_bound())

    # --- result -----------------------------------------------------------------------------

    def candidate(self, sg: ShapeGroup, types, layers) -> Candidate:
        g = sg.group
        return Candidate(tp=g.tp, pp=sg.pp, dp=g.dp, mbs=g.mbs,
                         stage_types=tuple(g.names[t] for t in types), layers=tuple(layers),
                         schedule=sg.schedule, virtual_stages=sg.virtual_stages, ep=g.ep, etp=g.etp)

    def unproven(self) -> str:
        """The part of the space not proven (stats.unproven), for a plan above its lower bound."""
        open_groups = sum(1 for done in self.group_done if not done)
        where = f"{open_groups} of {len(self.sgs)} shape groups not searched to the end"
        if self.stopped_by is not None:
            return f"{self.stopped_by} stopped the search: {where}"
        if self.cutoff < INF:
            # every plan of this search at or above the cutoff is left unproven: another search has one
            return f"searched only below {self.cutoff:,.1f} ms, the plan of another search"
        return where

    def stats(self) -> SearchStats:
        c = self.ctr
        best, lb = self.board.best_ms_all(), self.lower_bound()
        # complete and gap say one thing: the plan equals its proven lower bound (however the search
        # got there: to its end, or the bounds of the pieces the clock left open reach it), or not
        proven = best < INF and lb >= best
        gap = 0.0 if proven else max(0.0, best / lb - 1.0) if 0 < lb < INF and best < INF else INF
        pruned = {"shape_bound": self.pruned_shapes, "structure_bound": self.pruned_structures,
                  "stage_bound": c[PRUNED_BOUND], "path_bound": c[PRUNED_PATH],
                  "memory": c[PRUNED_MEMORY], "ridge": c[PRUNED_RIDGE], "order": c[PRUNED_ORDER]}
        return SearchStats(
            mode=self.options.mode, kernel="pure-python" if self.pure else "compiled",
            wall_s=time.perf_counter() - self.t0, complete=proven, unproven=None if proven else self.unproven(),
            structures=self.structures,
            shapes=len(self.shapes), warmup_samples=getattr(self, "warmup_done", 0),
            simulator_calls=self.sim_calls + c[SIM_CALLS], bound_evaluations=c[BOUND_EVALS],
            nodes=c[NODES], pruned=pruned, comm_model=self.options.comm_model,
            alternatives_proven=self.board.exact_alternatives and self.complete,
            lower_bound_ms=lb, gap=gap)

    def result(self) -> SearchResult:
        """The best plan and its runners-up; an error naming the cause when there is none."""
        if not self.board.best and not self.complete:
            raise TimeLimitError(self.options.time_limit_s, self.lower_bound())
        if not self.board.best:
            from .diagnose import explain_infeasible
            raise NoFeasiblePlanError(explain_infeasible(self.cm, self.space))
        return self.board.result(self.cm, self.stats(), self.options.comm_model)


def gap_text(best: float, lb: float) -> str:
    """The anytime answer in words: best time, proven lower bound, gap."""
    if best == INF:
        return "no plan yet"
    if not 0 < lb < INF:
        return f"best {best:,.0f} ms, no lower bound yet"
    if lb >= best:
        return f"best {best:,.0f} ms, proven optimal"
    return f"best {best:,.0f} ms, proven >= {lb:,.0f} ms, gap {format_gap(best / lb - 1)}"


def search(cost_model: CostModel, options: SearchOptions | None = None, *,
           clock: Callable[[], float] | None = None) -> SearchResult:
    """Find the plan with the shortest simulated iteration time (see the module docstring).
    ``clock``: what ``time_limit_s`` is measured on (:class:`SearchRun`; tests inject one)."""
    options = options or SearchOptions()
    if options.mode == "exhaustive":
        from .exhaustive import exhaustive_search
        return exhaustive_search(cost_model, options)
    run = SearchRun(cost_model, options, clock=clock)
    run.search()
    return run.result()


__all__ = ["COUNTER_NAMES", "Leaderboard", "SearchRun", "gap_text", "search", "use_pure_python"]
