"""Branch and bound over one *structure*: device type and layers of every (virtual) stage.

A structure fixes ``(tp, mbs, dp)`` (one :class:`~.tables.TypeTable`), the shape ``(schedule, pp, M, V)``
(one :class:`~.shapes.ShapeData`) and how many pipeline ranks use each device type. The search then
decides, rank by rank (in pipeline order, or from the last rank with ``backward``), each rank's device
type and layers, and simulates every complete plan that can still beat the threshold ``tau``. With
``V`` chunks per rank, a rank's layers are spread over its chunks as evenly as possible, earlier
chunks first (``chunk_layers``): virtual stage ``vs = chunk x pp + rank`` holds
``(l + V - 1 - chunk) // V`` of the rank's ``l`` layers.

This module (the tree walk) and :mod:`.structure_bounds` (the lower bounds and caps) are the pure-Python
reference of ``poseidon_plugin._core._search.SplitSearch``: same algorithm, same floating-point operations in
the same order, same counters. docs/SEARCH.md explains the bounds and why each pruning rule is safe:

* **memory**: a rank gets at most the layers it can hold (the cost model's formula);
* **mass / path bounds** (exact-safe): per bound path, its cost is linear in the layers; the layers
  still to place cost at least their cheapest placement, which gives caps per stage and node cut-offs;
* **stage-level DAG bound** (exact-safe, the paper's Theorem 1 made tighter): the simulator's own DAG
  with every undecided stage at its smallest possible weights is a lower bound of every completion, by
  monotonicity of the longest path; children are tried in increasing layer count, so the first child
  whose bound reaches ``tau`` cuts all larger ones; a bound below ``tau`` is raised by what every
  completion adds along its longest path (``_count_gain``), which cuts that child only;
* **ridge** (default mode only, Theorem 2 with its Lemmas 5-6): per device type the ranks' layer
  counts rise then fall, and rise only where the earlier rank is at its memory cap;
* **order rules**: device types with identical costs are interchangeable (exact-safe symmetry breaking);
  ``blocks`` keeps each device type's ranks contiguous (default mode only).
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import dataclass

from ..stagecost import memory_need, put_rank_times, send_index
from .structure_bounds import (PATH_SLACK, MIN_ALLREDUCE, MIN_BACKWARD, MIN_EMBEDDING_ALLREDUCE, MIN_EMBEDDING_BACKWARD,
                     MIN_EMBEDDING_FORWARD, MIN_FORWARD, MIN_HEAD_ALLREDUCE, MIN_HEAD_BACKWARD,
                     MIN_HEAD_FORWARD, MIN_SEND, StructureBounds, chunk_layers)
from .counters import (BOUND_EVALS, COUNTER_NAMES, IMPROVED, N_COUNTERS, NODES, PRUNED_BOUND,
                       PRUNED_MEMORY, PRUNED_ORDER, PRUNED_PATH, PRUNED_RIDGE, SIM_CALLS)
from .shapes import ShapeData
from .tables import TypeTable

INF = math.inf
CLOCK_EVERY = 1024          # nodes between two looks at the clock (time limit)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitResult:
    """Outcome of one structure's search."""

    time_ms: float                 # best time found below the threshold (inf: none)
    types: tuple[int, ...]         # type index per rank (into the table), empty when none
    layers: tuple[int, ...]        # layers per virtual stage, empty when none
    counters: tuple[int, ...]      # COUNTER_NAMES
    aborted: bool = False          # stopped by the deadline: not proven optimal


class SplitSearch(StructureBounds):
    """Exact (or ridge-pruned) search of one structure; re-usable with different counts and ``tau``.

    The bounds and caps are the methods of :class:`~.structure_bounds.StructureBounds`; this class walks the
    tree (:meth:`_node`, :meth:`_children`) and fills the DAG bound's parameter vector (:meth:`_fill`).
    """

    def __init__(self, table: TypeTable, shape: ShapeData, num_layers: int, *, ridge: bool,
                 blocks: bool, type_class: array, gap: float = 0.0, backward: bool = False):
        self.table, self.shape, self.num_layers = table, shape, num_layers
        self.ridge, self.blocks = ridge, blocks
        # decide the ranks from the last one (the ridge and block rules follow the pipeline order)
        self.backward = backward and not ridge and not blocks
        self.ub = shape.pp                               # the undecided ranks are [k, ub) at a node
        # relative optimality gap: a plan must beat best / (1 + gap) to be worth searching for
        self.shrink = 1.0 / (1.0 + gap)
        self.type_class = type_class                     # identical types share a class id
        self.nt = len(table.names)
        pp, v = shape.pp, shape.virtual_stages
        self.pp, self.v, self.nv = pp, v, pp * v
        self.stride = table.max_slots
        self.params = shape.new_params()
        self.zero_lb = [0] * self.nv
        # the gain's scratch: per (rank, type) its lower-bound layers' cost over the fill's; per
        # (stage, type) its slope along the path and its room above the lower bound
        self.crt = [0.0] * (pp * self.nt)
        self.jslope = [0.0] * (self.nv * self.nt)
        self.jroom = [0] * (self.nv * self.nt)
        self.jslack = 0
        self.kernel = None
        # memory: most layers rank r holds on type t (all chunks; < V when the rank cannot be used)
        self.cap_rank = array("i", [0]) * (self.nt * pp)
        for t in range(self.nt):
            for r in range(pp):
                self.cap_rank[t * pp + r] = self._rank_cap(t, r)

    def _rank_cap(self, t: int, r: int) -> int:
        """Most layers rank ``r`` on type ``t`` can hold (binary search on the cost model's formula)."""
        v, usable = self.v, self.table.usable_bytes[t]
        chunks = [0] * v
        lo, hi = 0, self.num_layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            for c in range(v):
                chunks[c] = chunk_layers(mid, c, v)
            if memory_need(t, r, chunks, self.table, self.shape) > usable:
                hi = mid - 1
            else:
                lo = mid
        return lo

    # --- search ---------------------------------------------------------------------------------

    def run(self, counts, tau: float, *, root_only: bool = False,
            deadline: float = INF, max_nodes: int = 0) -> SplitResult:
        """Best plan with time ``< tau`` for ``counts`` ranks per type (``root_only``: bound check only).

        ``deadline`` (``time.monotonic()`` seconds) or ``max_nodes`` (> 0: a node budget, the same in
        both backends) stops the search early: ``aborted`` is then set and the result is the best
        found so far.
        """
        pp, nv, nt = self.pp, self.nv, self.nt
        self.counts = list(counts)
        self.remaining = list(counts)
        self.used = [0] * nt        # per type: its ranks decided in pipeline order (slots 0..used-1)
        self.hi = list(counts)      # per type: its slots hi.. belong to ranks decided from the end
        self.ub = pp
        self.types = [-1] * pp
        self.slot = [0] * pp
        self.layers = [0] * nv
        self.last = [0] * nt                             # ridge: layers of the type's previous rank
        self.down = [0] * nt                             # ridge: the type's sequence already falls
        self.capped = [0] * nt                           # ridge: the type's previous rank is full
        self.lb = [[0] * nv for _ in range(pp + 1)]
        self.cap = [[0] * nv for _ in range(pp + 1)]
        self.capt = [[0] * (nv * nt) for _ in range(pp + 1)]
        self.exact_counts = sum(counts) == pp
        self.ctr = [0] * N_COUNTERS
        self.tau = tau
        self.best_types: tuple[int, ...] = ()
        self.best_layers: tuple[int, ...] = ()
        self.best = INF
        self.deadline = deadline
        self.max_nodes = max_nodes
        self.aborted = False
        # root_only accepts counts that are upper limits (a type's free slots): the bounds only ask
        # which types may still appear, never how many
        if root_only and sum(counts) >= pp:
            self._root_check()
        elif sum(counts) == pp:
            if self.kernel is None:
                self.kernel = self.shape.kernel
            self._node(0, self.num_layers)
        return SplitResult(time_ms=self.best, types=self.best_types, layers=self.best_layers,
                           counters=tuple(self.ctr), aborted=self.aborted)

    def _root_check(self) -> None:
        """Path and mass bounds at the root only (no DAG needed): ``best = 0`` when not pruned."""
        self.ctr[NODES] += 1
        if self._propagate(0, self.num_layers, self.lb[0], self.cap[0], self.capt[0]):
            self.best = 0.0

    def _fill(self, lb, capt=None) -> None:
        """Parameter vector: decided ranks exactly as :meth:`CostModel.stage_times` (the same
        :func:`~poseidon_plugin.stagecost.put_rank_times`), undecided ones at lower bounds: layers at
        ``lb``, costs at the minimum over the types they may still take: with the node's per-type
        caps ``capt``, only the types that can hold the rank's lower bounds (:meth:`_rank_mins`)."""
        pp, v = self.pp, self.v
        tb, p, types, layers = self.table, self.params, self.types, self.layers
        mins = self._unknown_mins()
        self.mins = mins
        self.fill_slopes = fs = [(0.0, 0.0, 0.0)] * pp
        for r in range(pp):
            t = types[r]
            if t >= 0:
                tb.put_rank_times(p, pp, v, r, layers, lb, t, t * self.stride + self.slot[r])
            else:   # framework terms left out: still a lower bound (stagecost)
                m = self._rank_mins(r, lb, capt, mins)
                put_rank_times(p, pp, v, r, layers, lb, m[MIN_FORWARD], m[MIN_BACKWARD],
                               m[MIN_ALLREDUCE], m[MIN_EMBEDDING_FORWARD],
                               m[MIN_EMBEDDING_BACKWARD], m[MIN_EMBEDDING_ALLREDUCE],
                               m[MIN_HEAD_FORWARD], m[MIN_HEAD_BACKWARD],
                               m[MIN_HEAD_ALLREDUCE], 1)
                fs[r] = (m[MIN_FORWARD], m[MIN_BACKWARD], m[MIN_ALLREDUCE])
            p[send_index(pp, v, r)] = self._send_lb(r, mins[MIN_SEND])

    def bound_params(self, counts, types, layers, lb, capt=None) -> list[float]:
        """The DAG bound's parameter vector with the ranks ``types[r] >= 0`` decided (``layers`` per
        virtual stage; 0: undecided, priced at ``lb``, over the types whose per-type caps ``capt``
        (``vs * nt + t``; None: none) hold it): what :meth:`_fill` writes. The compiled twin has the
        same method; tests compare the two field by field."""
        nt = self.nt
        self.counts, self.remaining, self.used = list(counts), list(counts), [0] * nt
        self.hi, self.ub = list(counts), self.pp
        self.types, self.slot = [-1] * self.pp, [0] * self.pp
        for r, t in enumerate(types):
            if t >= 0:
                self.types[r], self.slot[r] = t, self.used[t]
                self.remaining[t] -= 1
                self.used[t] += 1
        self.layers = list(layers)
        self._fill(list(lb), None if capt is None else list(capt))
        self.layers = [0] * self.nv
        return list(self.params)

    def _lb_sum(self, a: int, b: int, lb) -> int:
        """Layers of the ranks ``[a, b)`` at their lower bounds."""
        s = 0
        for r in range(a, b):
            for c in range(self.v):
                s += lb[c * self.pp + r]
        return s

    def _type_allowed(self, r: int, t: int) -> int:
        """0 if rank ``r`` may take type ``t`` now; else the counter that rejects it."""
        if self.remaining[t] <= 0:
            return -1
        if self.blocks and r > 0:
            prev = self.types[r - 1]
            if prev != t and (self.remaining[prev] > 0 or self.used[t] > 0):
                return PRUNED_ORDER
        if self.remaining[t] == self.counts[t]:
            # symmetry: among interchangeable types with equal counts, first uses go in index order
            # (in the order ranks are decided)
            for x in range(t):
                if (self.type_class[x] == self.type_class[t] and self.remaining[x] == self.counts[x]
                        and self.counts[x] == self.counts[t]):
                    return PRUNED_ORDER
        return 0

    def _node(self, k: int, left: int) -> None:
        """Decide the rank of depth ``k`` (type and layers) with ``left`` layers for the undecided ranks:
        rank ``k`` of ``[k, pp)`` in pipeline order, or rank ``pp - 1 - k`` of ``[0, pp - k)`` from
        the end (``backward``)."""
        ctr = self.ctr
        if self.aborted:
            return
        ctr[NODES] += 1
        if (ctr[NODES] % CLOCK_EVERY == 0 and time.monotonic() > self.deadline) or \
                ctr[NODES] == self.max_nodes:
            self.aborted = True
            return
        if self.backward:
            r, a, b = self.pp - 1 - k, 0, self.pp - k
        else:
            r, a, b = k, k, self.pp
        self.ub = b
        lb, cap = self.lb[k], self.cap[k]
        parent = (self.lb[k - 1], self.cap[k - 1], self.capt[k - 1]) if k > 0 else None
        if not self._propagate(a, left, lb, cap, self.capt[k], parent):
            return
        for t in range(self.nt):
            why = self._type_allowed(r, t)
            if why:
                if why > 0:
                    ctr[why] += 1
                continue
            self.types[r] = t
            if self.backward:
                self.hi[t] -= 1
                self.slot[r] = self.hi[t]
            else:
                self.slot[r] = self.used[t]
                self.used[t] += 1
            self.remaining[t] -= 1
            self._children(k, r, a, b, left, t, lb, cap, self.capt[k])
            self.types[r] = -1
            self.remaining[t] += 1
            if self.backward:
                self.hi[t] += 1
            else:
                self.used[t] -= 1

    def _child_lower_bounds(self, a: int, b: int, rest: int, s_cap: int, lb, cap, out) -> bool:
        """Lower bounds of the stages of ranks ``[a, b)`` when they hold ``rest`` layers (``s_cap``: the
        sum of their caps): ``lb`` raised by the sum rule, into ``out``; whether any rose."""
        pp = self.pp
        raised = False
        for vs in range(self.nv):
            out[vs] = lb[vs]
            if a <= vs % pp < b:
                x = rest - (s_cap - cap[vs])
                if x > lb[vs]:
                    out[vs] = x
                    raised = True
        return raised

    def _children(self, k: int, r: int, a: int, b: int, left: int, t: int, lb, cap, capt) -> None:
        """Try rank ``r`` (depth ``k``, undecided ranks ``[a, b)``) on type ``t`` with increasing layer
        counts; the child's undecided ranks are ``[ca, cb)``."""
        pp, v = self.pp, self.v
        ctr = self.ctr
        ca, cb = (a + 1, b) if r == a else (a, b - 1)
        lo, hi = v, self.num_layers
        for c in range(v):                 # chunk c of l layers is within [lb, cap] of its stage
            vs = c * pp + r
            x = v * lb[vs] - v + 1 + c
            if x > lo:
                lo = x
            ct = capt[vs * self.nt + t]        # the stage's cap on this type (propagation)
            x = v * (cap[vs] if cap[vs] < ct else ct) + c
            if x < hi:
                hi = x
        if k < pp - 1:
            # the later ranks hold at most this many (the node's caps, counts after this choice):
            # rank k takes the rest
            room = self._type_capacity(ca, cb, lb, cap, capt)
            if room < 0:
                ctr[PRUNED_PATH] += 1
                return
            if left - room > lo:
                lo = left - room
        mem = self.cap_rank[t * pp + r]
        if mem < hi:
            ctr[PRUNED_MEMORY] += hi - max(mem, lo - 1)
            hi = mem
        if k == pp - 1:
            if left < lo or left > hi:
                return
            lo = hi = left
        last, down, capped = self.last[t], self.down[t], self.capped[t]
        # ridge (Theorem 2 and Lemma 5-6 of the paper): along a type's ranks the layers only rise
        # where the earlier rank is at its memory cap, and never again once they have fallen
        if self.ridge and last > 0 and (down or not capped) and last < hi:
            ctr[PRUNED_RIDGE] += hi - max(last, lo - 1)
            hi = last
        # with l layers here the later ranks hold left - l, each stage at most its cap: a stage holds at
        # least left - l - (the other stages' caps). Where that raises a lower bound the DAG bound is
        # taken with it (valid for this count only: it falls as l rises, so it never ends the loop);
        # elsewhere with lb, monotone in l, and its first cut ends the loop
        s_cap = 0
        if k < pp - 1:
            for vs in range(self.nv):
                if ca <= vs % pp < cb:
                    s_cap += cap[vs]
        s_lb = self._lb_sum(ca, cb, lb)   # the later ranks' layers at lb (the gain's extra layers: the rest)
        lb2 = self.lb[k + 1]          # the child's lower bounds, scratch: its propagation overwrites them
        l = lo
        while l <= hi and not self.aborted:
            for c in range(v):
                self.layers[c * pp + r] = chunk_layers(l, c, v)
            if k < pp - 1 and self._child_lower_bounds(ca, cb, left - l, s_cap, lb, cap, lb2):
                self._fill(lb2, capt)
                ctr[BOUND_EVALS] += 1
                val = self.kernel.longest(self.params)
                if val >= self.tau or val + self._count_gain(
                        ca, cb, lb2, cap, capt, left - l - self._lb_sum(ca, cb, lb2),
                        self.tau * (1.0 + PATH_SLACK) - val) >= self.tau * (1.0 + PATH_SLACK):
                    ctr[PRUNED_BOUND] += 1
                    l += 1
                    continue
                val = 0.0
            else:
                self._fill(lb, capt)
                ctr[SIM_CALLS if k == pp - 1 else BOUND_EVALS] += 1
                val = self.kernel.longest(self.params)
                if val >= self.tau:
                    ctr[PRUNED_BOUND] += hi - l + 1
                    break
                if k < pp - 1 and val + self._count_gain(ca, cb, lb, cap, capt, left - l - s_lb,
                                                         self.tau * (1.0 + PATH_SLACK) - val) \
                        >= self.tau * (1.0 + PATH_SLACK):
                    ctr[PRUNED_BOUND] += 1      # this count only: the gain is not monotone in it
                    l += 1
                    continue
            if k == pp - 1:
                ctr[IMPROVED] += 1
                self.best = val
                self.tau = val * self.shrink
                self.best_types = tuple(self.types)
                self.best_layers = tuple(self.layers)
            else:
                self.last[t] = l
                self.down[t] = 1 if (down or (last > 0 and l < last)) else 0
                self.capped[t] = 1 if l == mem else 0
                self._node(k + 1, left - l)
                self.last[t], self.down[t], self.capped[t] = last, down, capped
            l += 1
        for c in range(v):
            self.layers[c * pp + r] = 0


__all__ = ["BOUND_EVALS", "COUNTER_NAMES", "IMPROVED", "N_COUNTERS", "NODES", "PRUNED_BOUND",
           "PRUNED_MEMORY", "PRUNED_ORDER", "PRUNED_PATH", "PRUNED_RIDGE", "SIM_CALLS", "SplitResult",
           "SplitSearch", "chunk_layers"]
