"""Branch and bound over one *structure*: device type and layers of every (virtual) stage.

A structure fixes ``(tp, mbs, dp)`` (one :class:`~.tables.TypeTable`), the shape ``(schedule, pp, M, V)``
(one :class:`~.shapes.ShapeData`) and how many pipeline ranks use each device type. The search then
decides, rank by rank in pipeline order, each rank's device type and layers, and simulates every
complete plan that can still beat the threshold ``tau``. With ``V`` chunks per rank, a rank's layers
are spread over its chunks as evenly as possible, earlier chunks first (``chunk_layers``): virtual
stage ``vs = chunk x pp + rank`` holds ``(l + V - 1 - chunk) // V`` of the rank's ``l`` layers.

This module is the pure-Python reference of ``poseidon_plugin._core._search.SplitSearch``: same algorithm, same
floating-point operations in the same order, same counters. docs/SEARCH.md explains the bounds and why
each pruning rule is safe:

* **memory**: a rank gets at most the layers it can hold (the cost model's formula);
* **mass / path bounds** (exact-safe): per bound path, its cost is linear in the layers; the layers
  still to place cost at least their cheapest placement, which gives caps per stage and node cut-offs;
* **stage-level DAG bound** (exact-safe, the paper's Theorem 1 made tighter): the simulator's own DAG
  with every undecided stage at its smallest possible weights is a lower bound of every completion, by
  monotonicity of the longest path; children are tried in increasing layer count, so the first child
  whose bound reaches ``tau`` cuts all larger ones;
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

from .shapes import ShapeData
from .tables import TypeTable

INF = math.inf

# counters (same indices in poseidon_plugin._core._search)
NODES, BOUND_EVALS, SIM_CALLS, PRUNED_BOUND, PRUNED_PATH, PRUNED_MEMORY, PRUNED_RIDGE, \
    PRUNED_ORDER, IMPROVED = range(9)
COUNTER_NAMES = ("nodes", "bound_evals", "sim_calls", "pruned_bound", "pruned_path", "pruned_memory",
                 "pruned_ridge", "pruned_order", "improved")
N_COUNTERS = len(COUNTER_NAMES)

# relative slack on the path bounds (sums in a different order than the kernel's): they prune only
# when the bound exceeds tau by more than float noise; the DAG bound is compared exactly (monotone)
PATH_SLACK = 1e-9
PROPAGATION_ROUNDS = 3
CLOCK_EVERY = 1024          # nodes between two looks at the clock (time limit)


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitResult:
    """Outcome of one structure's search."""

    time_ms: float                 # best time found below the threshold (inf: none)
    types: tuple[int, ...]         # type index per rank (into the table), empty when none
    layers: tuple[int, ...]        # layers per virtual stage, empty when none
    counters: tuple[int, ...]      # COUNTER_NAMES
    aborted: bool = False          # stopped by the deadline: not proven optimal


def memory_need(t: int, r: int, chunk_layers, table: TypeTable, shape: ShapeData) -> float:
    """Peak bytes of rank ``r`` on type ``t`` (:meth:`CostModel.memory_per_stage`, same operations)."""
    pp, v = shape.pp, shape.virtual_stages
    state = 0.0
    chunk_act = 0.0
    for c in range(v):
        n = chunk_layers[c]
        s = n * table.state[t]
        a = n * table.act[t]
        if c == 0 and r == 0:
            s += table.emb_state[t]
            a += table.emb_act[t]
        if c == v - 1 and r == pp - 1:
            s += table.head_state[t]
            a += table.head_act[t]
        state += s
        if a > chunk_act:
            chunk_act = a
    return state + shape.live[r] * chunk_act


def chunk_layers(total: int, chunk: int, v: int) -> int:
    """Layers of chunk ``chunk`` when a rank's ``total`` layers are spread evenly, earlier chunks first."""
    return (total + v - 1 - chunk) // v


class SplitSearch:
    """Exact (or ridge-pruned) search of one structure; re-usable with different counts and ``tau``."""

    def __init__(self, table: TypeTable, shape: ShapeData, num_layers: int, *, ridge: bool,
                 blocks: bool, type_class: array, gap: float = 0.0):
        self.table, self.shape, self.num_layers = table, shape, num_layers
        self.ridge, self.blocks = ridge, blocks
        # relative optimality gap: a plan must beat best / (1 + gap) to be worth searching for
        self.shrink = 1.0 / (1.0 + gap)
        self.type_class = type_class                     # identical types share a class id
        self.nt = len(table.names)
        pp, v = shape.pp, shape.virtual_stages
        self.pp, self.v, self.nv = pp, v, pp * v
        self.stride = table.max_slots
        self.params = shape.new_params()
        self.zero_lb = [0] * self.nv
        self.kernel = None
        # memory: most layers rank r holds on type t (all chunks; < V when the rank cannot be used)
        self.cap_rank = array("i", [0]) * (self.nt * pp)
        for t in range(self.nt):
            for r in range(pp):
                self.cap_rank[t * pp + r] = self._rank_cap(t, r)

    def _rank_cap(self, t: int, r: int) -> int:
        """Most layers rank ``r`` on type ``t`` can hold (binary search on the cost model's formula)."""
        v, usable = self.v, self.table.usable[t]
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
            deadline: float = INF) -> SplitResult:
        """Best plan with time ``< tau`` for ``counts`` ranks per type (``root_only``: bound check only).

        ``deadline`` (``time.monotonic()`` seconds) stops the search early: ``aborted`` is then set and
        the result is the best found so far.
        """
        pp, nv, nt = self.pp, self.nv, self.nt
        self.counts = list(counts)
        self.remaining = list(counts)
        self.used = [0] * nt
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

    def _unknown_mins(self):
        """Smallest per-layer costs over the device types an undecided rank may still take."""
        t_ = self.table
        big = INF
        m = [big] * 10   # fwd, bwd, emb_fwd, emb_bwd, head_fwd, head_bwd, ar, ar_emb, ar_head, send
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            for i, col in enumerate((t_.fwd, t_.bwd, t_.emb_fwd, t_.emb_bwd, t_.head_fwd, t_.head_bwd)):
                if col[t] < m[i]:
                    m[i] = col[t]
            if t_.send_cross[t] < m[9]:
                m[9] = t_.send_cross[t]
            for j in range(self.used[t], self.counts[t]):
                i = t * self.stride + j
                ar = t_.ar[i] if t_.has_ar[i] else 0.0
                ae = t_.ar_emb[i] if t_.has_ar[i] else 0.0
                ah = t_.ar_head[i] if t_.has_ar[i] else 0.0
                if ar < m[6]:
                    m[6] = ar
                if ae < m[7]:
                    m[7] = ae
                if ah < m[8]:
                    m[8] = ah
                # links out of slot j: to slot j+1 of its type, or the wrap to slot 0
                if j + 1 < self.counts[t] and t_.send_same[i] < m[9]:
                    m[9] = t_.send_same[i]
                if j > 0 and t_.send_wrap[i] < m[9]:
                    m[9] = t_.send_wrap[i]
        return [0.0 if x == big else x for x in m]

    def _fill(self, lb) -> None:
        """Parameter vector: decided values exactly as CostModel.stage_times, undecided at lower bounds."""
        pp, v, nv = self.pp, self.v, self.nv
        tb, p, types, layers = self.table, self.params, self.types, self.layers
        mins = self._unknown_mins()
        self.mins = mins
        for r in range(pp):
            t = types[r]
            total_ar = 0.0
            if t >= 0:
                i = t * self.stride + self.slot[r]
                hasar = tb.has_ar[i]
                fw, bw, ar = tb.fwd[t], tb.bwd[t], tb.ar[i]
                efw, ebw, ear = tb.emb_fwd[t], tb.emb_bwd[t], tb.ar_emb[i]
                hfw, hbw, har = tb.head_fwd[t], tb.head_bwd[t], tb.ar_head[i]
            else:
                hasar = 1
                fw, bw, ar, efw, ebw, hfw, hbw = mins[0], mins[1], mins[6], mins[2], mins[3], mins[4], \
                    mins[5]
                ear, har = mins[7], mins[8]
            for c in range(v):
                vs = c * pp + r
                n = layers[vs] or lb[vs]
                f = n * fw
                b = n * bw
                if hasar:
                    total_ar += n * ar
                if c == 0 and r == 0:
                    f += efw
                    b += ebw
                    if hasar:
                        total_ar += ear
                if c == v - 1 and r == pp - 1:
                    f += hfw
                    b += hbw
                    if hasar:
                        total_ar += har
                p[1 + r * v + c] = f
                p[1 + nv + r * v + c] = b
            p[1 + 2 * nv + pp + r] = total_ar
            p[1 + 2 * nv + r] = self._send_lb(r, mins[9])

    def _send_lb(self, r: int, unknown_min: float) -> float:
        """Transfer ms of link ``r -> r+1``: exact when both ends are decided, else a lower bound."""
        pp, tb = self.pp, self.table
        if pp == 1 or (self.v == 1 and r == pp - 1):
            return 0.0
        n = (r + 1) % pp
        t, u = self.types[r], self.types[n]
        if t < 0:
            return unknown_min
        i = t * self.stride + self.slot[r]
        if u >= 0:
            if t != u:
                return tb.send_cross[t]
            return tb.send_wrap[i] if n == 0 else tb.send_same[i]
        best = INF
        if self.remaining[t] > 0:
            best = tb.send_same[i]
        if any(self.remaining[x] > 0 for x in range(self.nt) if x != t):
            if tb.send_cross[t] < best:
                best = tb.send_cross[t]
        return 0.0 if best == INF else best

    def _propagate(self, k: int, left: int, lb, cap, capt) -> bool:
        """Initialise and tighten ``lb``/``cap`` of the undecided ranks' stages; ``False``: pruned.

        ``capt[vs * nt + t]`` is the cap of stage ``vs`` if its rank takes type ``t`` (-1: cannot).
        """
        pp, v, nt = self.pp, self.v, self.nt
        ctr = self.ctr
        for r in range(k, pp):
            best = -1
            for x in range(nt):
                cr = self.cap_rank[x * pp + r] if self.remaining[x] > 0 else -1
                # ridge space: once a type's layers have fallen, its later ranks hold at most that
                if self.ridge and self.down[x] and self.last[x] < cr:
                    cr = self.last[x]
                if cr < v:
                    cr = -1
                for c in range(v):
                    capt[(c * pp + r) * nt + x] = chunk_layers(cr, c, v) if cr >= 0 else -1
                if cr > best:
                    best = cr
            if best < v:
                ctr[PRUNED_MEMORY] += 1
                return False
            for c in range(v):
                lb[c * pp + r] = 1
                cap[c * pp + r] = chunk_layers(best, c, v)
        tau = self.tau
        for rnd in range(PROPAGATION_ROUNDS):
            s_cap = s_lb = 0
            for r in range(k, pp):
                for c in range(v):
                    s_cap += cap[c * pp + r]
                    s_lb += lb[c * pp + r]
            if s_cap < left or s_lb > left:
                ctr[PRUNED_PATH] += 1
                return False
            for r in range(k, pp):
                for c in range(v):
                    vs = c * pp + r
                    nl = left - (s_cap - cap[vs])
                    nc = left - (s_lb - lb[vs])
                    if nl > lb[vs]:
                        lb[vs] = nl
                    if nc < cap[vs]:
                        cap[vs] = nc
                    if lb[vs] > cap[vs]:
                        ctr[PRUNED_PATH] += 1
                        return False
            if tau == INF or k == pp - 1 or rnd == PROPAGATION_ROUNDS - 1:
                break
            changed = self._path_caps(k, left, lb, cap, capt)
            if changed >= 0 and not self._type_mass(k, left, lb, cap, capt):
                changed = -1
            if changed < 0:
                ctr[PRUNED_PATH] += 1
                return False
            if changed == 0:
                break
        return True

    def _type_slopes(self):
        """Per remaining type: per-layer forward, backward and (cheapest free slot) all-reduce ms."""
        tb = self.table
        out = []
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            ar = INF
            for j in range(self.used[t], self.counts[t]):
                i = t * self.stride + j
                x = tb.ar[i] if tb.has_ar[i] else 0.0
                if x < ar:
                    ar = x
            out.append((t, tb.fwd[t], tb.bwd[t], 0.0 if ar == INF else ar))
        return out

    def _type_room(self, k: int, lb, cap, capt, slopes):
        """``K[(r * nt + t2) * nt + t]``: most layers above their lower bounds that the undecided ranks
        other than ``r`` can hold on type ``t`` when ``r`` takes type ``t2`` (the ``n`` best of them,
        ``n`` = the type's remaining ranks); -1 when too few of them can host ``t``."""
        pp, v, nt = self.pp, self.v, self.nt
        ecap = self.ecap = [-1] * (pp * nt)
        efull = self.efull = [-1] * (pp * nt)
        order, order_full = [], []
        for t, _ft, _bt, _at in slopes:
            for r in range(k, pp):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    s_lb = 0
                    for c in range(v):
                        s_lb += lb[c * pp + r]
                    ecap[r * nt + t] = s - s_lb
                    efull[r * nt + t] = s
            # ranks by room on t, largest first (ties: lower rank first)
            order.append(sorted((r for r in range(k, pp) if ecap[r * nt + t] >= 0),
                                key=lambda r, t=t: -ecap[r * nt + t]))
            order_full.append(sorted((r for r in range(k, pp) if efull[r * nt + t] >= 0),
                                     key=lambda r, t=t: -efull[r * nt + t]))
        def top_sum(ranks, vals, t: int, r: int, n: int) -> int:
            total = got = 0
            for j in ranks:
                if got == n:
                    break
                if j != r:
                    total += vals[j * nt + t]
                    got += 1
            return -1 if got < n and self.exact_counts else total

        K = [0] * (pp * nt * nt)
        self.kfull = kfull = [0] * (pp * nt * nt)   # the same with whole capacities
        for r in range(k, pp):
            for t2, _f2, _b2, _a2 in slopes:
                for i, (t, _ft, _bt, _at) in enumerate(slopes):
                    n = self.remaining[t] - (1 if t == t2 else 0)
                    K[(r * nt + t2) * nt + t] = top_sum(order[i], ecap, t, r, n)
                    kfull[(r * nt + t2) * nt + t] = top_sum(order_full[i], efull, t, r, n)
        return K

    def _phi(self, e: int, r: int, t2: int, K, mu1, mu2, marg, slopes) -> float:
        """Cheapest cost of ``e`` more layers on the undecided ranks other than ``r`` (which takes
        ``t2``): the cheapest types first, each up to what its ranks can hold (``K``); inf if they
        cannot hold them."""
        nt = self.nt
        items = []
        for t, _ft, _bt, _at in slopes:
            kk = K[(r * nt + t2) * nt + t]
            if kk < 0:
                return INF
            items.append((mu2[t] if marg[t] == r else mu1[t], t, kk))
        items.sort()
        cost = 0.0
        for mu, _t, kk in items:
            if e <= 0:
                break
            if kk == 0:
                continue
            take = e if e < kk else kk
            cost += take * mu
            e -= take
        return cost if e <= 0 else INF

    def _gammas(self, q: int, k: int, lb, room_of, gam, slopes) -> float:
        """Per undecided rank ``r`` (into ``gam[r]``, max over its types): how far its cost along path
        ``q`` of ``d`` layers above its lower bounds ``lb`` can fall below ``beta d`` (``beta``: the
        mean of its chunk slopes), over the counts ``room_of[r * nt + t]`` it can hold (-1: not that
        type); returns their sum. Layer ``l + 1`` of a rank goes to chunk ``l mod V``, so when the
        lower bounds are spread like a rank's layers the cost gains ``V beta`` every ``V`` layers and
        only the first ``V - 1`` counts need a look; otherwise the bound ``chunk c holds at least
        (l - c) / V`` gives the shortfall. With ``lb`` all zero this is the shortfall of a rank's
        whole layer count."""
        pp, v, nt = self.pp, self.v, self.nt
        gsum = 0.0
        xs = [0.0] * v
        for r in range(k, pp):
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            even = True
            for c in range(v):
                if chunk_layers(s_lb, c, v) != lb[c * pp + r]:
                    even = False
            gmax = 0.0
            for t, ft, bt, at in slopes:
                room = room_of[r * nt + t]
                if room < 0:
                    continue
                beta = self._chunk_slopes(q, r, ft, bt, at, xs)
                g = 0.0
                if even:
                    acc = 0.0
                    for j in range(1, min(v - 1, room) + 1):
                        acc += xs[(s_lb + j - 1) % v]
                        if beta * j - acc > g:
                            g = beta * j - acc
                else:
                    w = 0.0
                    for c in range(v):
                        w += xs[c] * ((c + v * lb[c * pp + r]) / v)
                    if w - beta * s_lb > g:
                        g = w - beta * s_lb
                if g > gmax:
                    gmax = g
            gam[r] = gmax
            gsum += gmax
        return gsum

    def _chunk_slopes(self, q: int, r: int, ft: float, bt: float, at: float, xs) -> float:
        """Rank ``r``'s per-layer slope of each chunk along path ``q`` on a type (into ``xs``); their
        mean."""
        pp, v, nv = self.pp, self.v, self.nv
        paths = self.shape.paths
        cf, cr = q * nv, q * pp
        beta = 0.0
        for c in range(v):
            vs = c * pp + r
            xs[c] = paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + paths.coef_ar[cr + r] * at
            beta += xs[c]
        return beta / v

    def _path_caps(self, k: int, left: int, lb, cap, capt) -> int:
        """Tighten caps with the bound paths; -1: some path proves the node cannot beat ``tau``."""
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        p = self.params
        paths = self.shape.paths
        self._fill(lb)
        slopes = self._type_slopes()
        limit = self.tau * (1.0 + PATH_SLACK)
        extra = left
        for r in range(k, pp):
            for c in range(v):
                extra -= lb[c * pp + r]
        K = self._type_room(k, lb, cap, capt, slopes)
        changed = 0
        alpha = [0.0] * nv
        m_f, m_b, m_ar = self.mins[0], self.mins[1], self.mins[6]
        rmt = [INF] * nt
        rsum = [0.0] * nt
        gam, gam0 = [0.0] * pp, [0.0] * pp     # per rank, see _gammas (above lb / whole count)
        for q in range(paths.count):
            cf = q * nv
            cr = q * pp
            if paths.owner[q] < k:
                continue        # the owner is decided: no caps (below); the DAG bound covers its cut
            base = 0.0
            for e in range(paths.term_ptr[q], paths.term_ptr[q + 1]):
                base += paths.term_coef[e] * p[paths.term_idx[e]]
            # per-layer cost of each undecided stage in this path, at its cheapest possible type
            a1 = INF
            amax = 0.0
            lift = 0.0
            b1 = b2 = INF                 # the two smallest per-rank minima of alpha, and the argmin
            argr = -1
            mu1, mu2, marg = [INF] * nt, [INF] * nt, [-1] * nt     # the same per type
            # per type, over ranks: the two smallest mean chunk slopes (beta); a rank's d extra
            # layers cost at least beta d - gamma (chunk c gets at least (l - c) / V of its l layers)
            nu1, nu2, narg = [INF] * nt, [INF] * nt, [-1] * nt
            gsum = -1.0              # the gammas of this path: computed when first needed
            rlb = [0.0] * pp              # per rank: its lb layers along the path, as priced in base
            for r in range(k, pp):
                rmin = INF
                s_lb = 0
                for t, _ft, _bt, _at in slopes:
                    rmt[t] = INF
                    rsum[t] = 0.0
                for c in range(v):
                    vs = c * pp + r
                    kf, kb, ka = paths.coef_f[cf + vs], paths.coef_b[cf + vs], paths.coef_ar[cr + r]
                    a = INF
                    for t, ft, bt, at in slopes:
                        x = kf * ft + kb * bt + ka * at
                        if x < a:
                            a = x
                        if x < rmt[t]:
                            rmt[t] = x
                        rsum[t] += x
                    s_lb += lb[vs]
                    alpha[vs] = a
                    rlb[r] += lb[vs] * a
                    # the stage's lb layers cost at least its cheapest type's slope, not the
                    # per-column minimum the DAG fill used
                    lift += lb[vs] * (a - (kf * m_f + kb * m_b + ka * m_ar))
                    if a < a1:
                        a1 = a
                    if a > amax:
                        amax = a
                    if a < rmin:
                        rmin = a
                if rmin < b1:
                    b2, b1, argr = b1, rmin, r
                elif rmin < b2:
                    b2 = rmin
                for t, _ft, _bt, _at in slopes:
                    y = rmt[t]
                    if y < mu1[t]:
                        mu2[t], mu1[t], marg[t] = mu1[t], y, r
                    elif y < mu2[t]:
                        mu2[t] = y
                    y = rsum[t] / v
                    if y < nu1[t]:
                        nu2[t], nu1[t], narg[t] = nu1[t], y, r
                    elif y < nu2[t]:
                        nu2[t] = y
            base += lift
            if base + extra * a1 >= limit:
                return -1
            if extra > 0 and base + extra * amax >= limit:
                if base + self._knapsack(k, extra, alpha, lb, cap) >= limit:
                    return -1
            if b2 == INF:
                continue
            # caps per (rank, type): the rank's D layers above its lower bounds cost at least its
            # cheapest chunk slope on that type each (all its chunks share the type and the layers);
            # the other extra layers at least the cheapest slope of another rank's stage (closed
            # form), and at least their cheapest placement by type (the scan below)
            # (only for the path's owner rank: the other ranks' slopes on it are small)
            lbo = gsum0 = -1.0
            elb = 0
            for r in range(paths.owner[q], paths.owner[q] + 1 if paths.owner[q] >= k else 0):
                m = b2 if r == argr else b1
                numer = limit - base - m * extra
                ka = paths.coef_ar[cr + r]
                s_lb = 0
                for c in range(v):
                    s_lb += lb[c * pp + r]
                for t, ft, bt, at in slopes:
                    ct_sum = 0
                    for c in range(v):
                        vs = c * pp + r
                        ct = capt[vs * nt + t]
                        if ct < lb[vs]:
                            ct_sum = -1
                            break
                        ct_sum += ct
                    if ct_sum < 0:
                        continue
                    xmin = INF
                    extra_t = 0.0
                    for c in range(v):
                        vs = c * pp + r
                        x = paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + ka * at
                        # on type t the lb layers cost x each, alpha[vs] of it is in base
                        extra_t += lb[vs] * (x - alpha[vs])
                        if x < xmin:
                            xmin = x
                    d = ct_sum - s_lb
                    if d > extra:
                        d = extra
                    slope = xmin - m
                    if slope > 0.0:
                        room = (numer - extra_t) / slope
                        if room < d + 1:
                            d = -1 if room <= 0.0 else math.ceil(room) - 1
                    rhs = limit - base - extra_t
                    while d >= 0:
                        # the rank's own cost of d more layers, chunk by chunk (exact)
                        own = 0.0
                        for c in range(v):
                            vs = c * pp + r
                            n = chunk_layers(s_lb + d, c, v) - lb[vs]
                            if n < 0:
                                own = INF          # this count leaves a chunk below its lower bound
                                break
                            own += n * (paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + ka * at)
                        if own < INF:
                            y = self._phi(extra - d, r, t, K, mu1, mu2, marg, slopes)
                            if v > 1 and own + y < rhs:
                                if gsum < 0.0:
                                    gsum = self._gammas(q, k, lb, self.ecap, gam, slopes)
                                g = self._phi(extra - d, r, t, K, nu1, nu2, narg, slopes) \
                                    - (gsum - gam[r])
                                if g > y:
                                    y = g
                            if own + y < rhs:
                                # all the other ranks' layers placed by type, their lower bounds too
                                # (base priced those at each stage's cheapest type: take them out)
                                if lbo < 0.0:
                                    lbo = 0.0
                                    elb = 0
                                    for j in range(k, pp):
                                        if j != r:
                                            lbo += rlb[j]
                                            for c in range(v):
                                                elb += lb[c * pp + j]
                                g = self._phi(elb + extra - d, r, t, self.kfull, mu1, mu2, marg, slopes) - lbo
                                if g > y:
                                    y = g
                                if v > 1 and own + y < rhs:
                                    if gsum0 < 0.0:
                                        gsum0 = self._gammas(q, k, self.zero_lb, self.efull, gam0, slopes)
                                    g = self._phi(elb + extra - d, r, t, self.kfull, nu1, nu2, narg, slopes) \
                                        - (gsum0 - gam0[r]) - lbo
                                    if g > y:
                                        y = g
                            if own + y < rhs:
                                break
                        d -= 1
                    if d < ct_sum - s_lb:
                        u = s_lb + d if d >= 0 else -1
                        for c in range(v):
                            vs = c * pp + r
                            ct = chunk_layers(u, c, v) if u >= 0 else -1
                            if ct < lb[vs]:
                                ct = lb[vs] - 1     # type t cannot take rank r
                            if ct < capt[vs * nt + t]:
                                capt[vs * nt + t] = ct
                # each stage's cap: the largest over the types that can still take the whole rank
                for c in range(v):
                    vs = c * pp + r
                    top = -1
                    for t, _ft, _bt, _at in slopes:
                        ok = True
                        for c2 in range(v):
                            vs2 = c2 * pp + r
                            if capt[vs2 * nt + t] < lb[vs2]:
                                ok = False
                                break
                        if ok and capt[vs * nt + t] > top:
                            top = capt[vs * nt + t]
                    if top < lb[vs]:
                        return -1
                    if top < cap[vs]:
                        cap[vs] = top
                        changed = 1
        return changed

    def _type_mass(self, k: int, left: int, lb, cap, capt) -> bool:
        """The undecided ranks, each on one remaining type, must be able to hold ``left`` layers."""
        return self._type_capacity(k, lb, cap, capt) >= left

    def _rank_capacity(self, r: int, t: int, lb, cap, capt) -> int:
        """Most layers rank ``r`` holds on type ``t`` (its chunks' caps); -1 when a chunk's cap on ``t``
        is below its lower bound."""
        pp, v, nt = self.pp, self.v, self.nt
        s = 0
        for c in range(v):
            vs = c * pp + r
            ct = min(capt[vs * nt + t], cap[vs])
            if ct < lb[vs]:
                return -1
            s += ct
        return s

    def _type_capacity(self, k: int, lb, cap, capt) -> int:
        """Most layers ranks ``k..pp-1`` can hold, each on one remaining type (per type its ``n``
        largest rank capacities); -1 when fewer ranks can host a type than ranks of it remain."""
        pp, nt = self.pp, self.nt
        exact = self.exact_counts
        total = 0
        for t in range(nt):
            n = self.remaining[t]
            if n <= 0:
                continue
            vals = []
            for r in range(k, pp):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    vals.append(s)
            if exact and len(vals) < n:
                return -1             # fewer ranks can host the type than ranks of that type
            vals.sort(reverse=True)
            total += sum(vals[:n])
        return total

    def _knapsack(self, k: int, extra: int, alpha, lb, cap) -> float:
        """Cheapest cost of ``extra`` more layers over the undecided stages (fractional, by slope)."""
        pp, v = self.pp, self.v
        order = sorted((c * pp + r for r in range(k, pp) for c in range(v)), key=lambda vs: alpha[vs])
        cost = 0.0
        for vs in order:
            take = cap[vs] - lb[vs]
            if take > extra:
                take = extra
            cost += take * alpha[vs]
            extra -= take
            if extra <= 0:
                break
        return cost

    def _type_allowed(self, r: int, t: int) -> int:
        """0 if rank ``r`` may take type ``t`` now; else the counter that rejects it."""
        if self.remaining[t] <= 0:
            return -1
        if self.blocks and r > 0:
            prev = self.types[r - 1]
            if prev != t and (self.remaining[prev] > 0 or self.used[t] > 0):
                return PRUNED_ORDER
        if self.used[t] == 0:
            # symmetry: among interchangeable types with equal counts, first uses go in index order
            for x in range(t):
                if (self.type_class[x] == self.type_class[t] and self.used[x] == 0
                        and self.counts[x] == self.counts[t]):
                    return PRUNED_ORDER
        return 0

    def _node(self, k: int, left: int) -> None:
        """Decide rank ``k`` (type and layers) with ``left`` layers for ranks ``k..pp-1``."""
        ctr = self.ctr
        if self.aborted:
            return
        ctr[NODES] += 1
        if ctr[NODES] % CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
            self.aborted = True
            return
        lb, cap = self.lb[k], self.cap[k]
        if not self._propagate(k, left, lb, cap, self.capt[k]):
            return
        for t in range(self.nt):
            why = self._type_allowed(k, t)
            if why:
                if why > 0:
                    ctr[why] += 1
                continue
            self.types[k] = t
            self.slot[k] = self.used[t]
            self.remaining[t] -= 1
            self.used[t] += 1
            self._children(k, left, t, lb, cap, self.capt[k])
            self.types[k] = -1
            self.remaining[t] += 1
            self.used[t] -= 1

    def _children(self, k: int, left: int, t: int, lb, cap, capt) -> None:
        """Try rank ``k`` on type ``t`` with increasing layer counts."""
        pp, v = self.pp, self.v
        ctr = self.ctr
        lo, hi = v, self.num_layers
        for c in range(v):                 # chunk c of l layers is within [lb, cap] of its stage
            vs = c * pp + k
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
            room = self._type_capacity(k + 1, lb, cap, capt)
            if room < 0:
                ctr[PRUNED_PATH] += 1
                return
            if left - room > lo:
                lo = left - room
        mem = self.cap_rank[t * pp + k]
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
        l = lo
        while l <= hi and not self.aborted:
            for c in range(v):
                self.layers[c * pp + k] = chunk_layers(l, c, v)
            self._fill(lb)
            ctr[SIM_CALLS if k == pp - 1 else BOUND_EVALS] += 1
            val = self.kernel.longest(self.params)
            if val >= self.tau:
                ctr[PRUNED_BOUND] += hi - l + 1
                break
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
            self.layers[c * pp + k] = 0
