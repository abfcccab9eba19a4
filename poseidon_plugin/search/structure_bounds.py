"""Lower bounds and layer caps inside one structure's tree (docs/SEARCH.md, "Lower bounds").

:class:`StructureBounds` is the bound half of :class:`~.splits.SplitSearch` (which adds the tree walk):
it reads the search state (``types``, ``remaining``, ``used``, ``counts``, ``tau``, the parameter
vector) and tightens the per-stage lower bounds ``lb`` and caps ``cap`` of the undecided ranks:

* :meth:`StructureBounds._propagate` -- memory caps, sum rules, then rounds of the path bounds and the
  type-aware capacity;
* :meth:`StructureBounds._path_caps` -- per bound path: prices (:meth:`_path_prices`), the mass cut
  (:meth:`_path_cuts`), the owner rank's caps per type (:meth:`_owner_caps`, with the placement bounds of
  :meth:`_others_fit`) and the stage caps they give (:meth:`_stage_caps`);
* :meth:`StructureBounds._unknown_mins` / :meth:`_send_lb` -- the smallest weights an undecided rank
  can have (the DAG bound's fill, :meth:`~.splits.SplitSearch._fill`);
* :meth:`StructureBounds._count_gain` / :meth:`_joint_gain` -- what every completion adds along the DAG
  bound's longest path.

``cython_core/_search.pyx`` (``poseidon_plugin._core._search``) is still a hand-kept compiled twin of
these methods and :mod:`.splits` (same operations, same order; tests/unit/test_search_twin.py compares
both field by field).
"""

from __future__ import annotations

import math

from ..backend import compiled
from ..stagecost import link_carries_data
from . import assignment
from .assignment import NEG
from .counters import PRUNED_MEMORY, PRUNED_PATH

# the one assignment solver, compiled where built (the same file: the same results)
best_assignment = (compiled("assignment") or assignment).best_assignment

INF = math.inf

# relative slack on the path bounds (sums in a different order than the kernel's): they prune only
# when the bound exceeds tau by more than float noise; the DAG bound is compared exactly (monotone)
PATH_SLACK = 1e-9
# relative margin of the placement bounds' shortcut (StructureBounds._others_fit): a bound known to be
# at most another (in exact arithmetic) is taken to fit only when the other fits by this much more
FIT_SLACK = 1e-12
PROPAGATION_ROUNDS = 3
# a node that inherits its parent's bounds starts near a fixpoint: one round of the path bounds on top
# of the parent's does nearly what two did from scratch, in less time (bench_search measures it); the
# roots (thousands of shape groups' checks) keep both rounds
INHERITED_ROUNDS = 2

# StructureBounds.mins: the smallest cost of each kind over the types an undecided rank may take
# (the same indices in poseidon_plugin._core._search, which exports MIN_NAMES)
MIN_NAMES = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
             "head_forward_ms", "head_backward_ms", "allreduce_ms", "embedding_allreduce_ms",
             "head_allreduce_ms", "send_ms")
MIN_FORWARD, MIN_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_EMBEDDING_BACKWARD, MIN_HEAD_FORWARD, \
    MIN_HEAD_BACKWARD, MIN_ALLREDUCE, MIN_EMBEDDING_ALLREDUCE, MIN_HEAD_ALLREDUCE, MIN_SEND = \
    range(len(MIN_NAMES))
N_MINS = len(MIN_NAMES)



def chunk_layers(total: int, chunk: int, v: int) -> int:
    """Layers of chunk ``chunk`` when a rank's ``total`` layers are spread evenly, earlier chunks first."""
    return (total + v - 1 - chunk) // v


class PathPrices:
    """One bound path priced at a node (:meth:`StructureBounds._path_prices`), per-layer slopes along it:

    ``base_cost``: the path at the lower bounds; ``min_slope`` / ``max_slope``: the cheapest and dearest
    undecided stage's slope (each at its cheapest remaining type); ``rank_min1`` / ``rank_min2``: the two
    smallest per-rank minima of those, ``rank_min_arg`` the rank of the first; per type (lists by type
    index) ``type_min1`` / ``type_min2`` / ``type_min_rank``: the same over each rank's cheapest chunk,
    and ``type_mean1`` / ``type_mean2`` / ``type_mean_rank`` over each rank's mean chunk slope;
    ``rank_lb_cost``: per rank, its lower-bound layers along the path as ``base_cost`` priced them.
    Computed lazily by the placement bounds (-1 until first needed): ``loss_sum`` / ``loss_sum_whole``
    (the rounding losses above the lower bounds / of whole counts), ``others_lb_cost`` and
    ``others_lb_layers`` (the other ranks' lower bounds, priced and counted)."""

    __slots__ = ("base_cost", "min_slope", "max_slope", "rank_min1", "rank_min2", "rank_min_arg",
                 "type_min1", "type_min2", "type_min_rank", "type_mean1", "type_mean2", "type_mean_rank",
                 "rank_lb_cost", "loss_sum", "loss_sum_whole", "others_lb_cost", "others_lb_layers")

    def __init__(self, *, base_cost, min_slope, max_slope, rank_min1, rank_min2, rank_min_arg, type_min1,
                 type_min2, type_min_rank, type_mean1, type_mean2, type_mean_rank, rank_lb_cost):
        self.base_cost, self.min_slope, self.max_slope = base_cost, min_slope, max_slope
        self.rank_min1, self.rank_min2, self.rank_min_arg = rank_min1, rank_min2, rank_min_arg
        self.type_min1, self.type_min2, self.type_min_rank = type_min1, type_min2, type_min_rank
        self.type_mean1, self.type_mean2, self.type_mean_rank = type_mean1, type_mean2, type_mean_rank
        self.rank_lb_cost = rank_lb_cost
        self.loss_sum = self.loss_sum_whole = self.others_lb_cost = -1.0
        self.others_lb_layers = 0


class StructureBounds:
    """The bound methods of :class:`~.splits.SplitSearch` (see the module docstring)."""

    def _unknown_mins(self):
        """Smallest costs over the device types an undecided rank may still take (indices ``MIN_*``;
        0 where no type is left)."""
        t_ = self.table
        big = INF
        m = [big] * N_MINS
        # per remaining type, its own costs of MIN_NAMES[:MIN_SEND] (all-reduces: its free slots');
        # the minima over all of them are theirs, the transfers' are over the links still possible
        self.type_mins = tm = [None] * self.nt
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            tm[t] = own = [t_.forward_ms[t], t_.backward_ms[t], t_.embedding_forward_ms[t],
                           t_.embedding_backward_ms[t], t_.head_forward_ms[t], t_.head_backward_ms[t],
                           big, big, big]
            if t_.send_cross_ms[t] < m[MIN_SEND]:
                m[MIN_SEND] = t_.send_cross_ms[t]
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                has = t_.has_allreduce[i]
                for k, col in ((MIN_ALLREDUCE, t_.allreduce_ms),
                               (MIN_EMBEDDING_ALLREDUCE, t_.embedding_allreduce_ms),
                               (MIN_HEAD_ALLREDUCE, t_.head_allreduce_ms)):
                    x = col[i] if has else 0.0
                    if x < own[k]:
                        own[k] = x
                # links out of slot j: to slot j+1 of its type, or the wrap to slot 0
                if j + 1 < self.counts[t] and t_.send_same_ms[i] < m[MIN_SEND]:
                    m[MIN_SEND] = t_.send_same_ms[i]
                if j > 0 and t_.send_wrap_ms[i] < m[MIN_SEND]:
                    m[MIN_SEND] = t_.send_wrap_ms[i]
            for k in range(MIN_SEND):
                if own[k] < m[k]:
                    m[k] = own[k]
        return [0.0 if x == big else x for x in m]

    def _fits(self, r: int, t: int, lb, capt) -> bool:
        """Whether type ``t``'s caps ``capt`` hold the lower bounds ``lb`` of every chunk of rank ``r``."""
        pp, nt = self.pp, self.nt
        for c in range(self.v):
            vs = c * pp + r
            if capt[vs * nt + t] < lb[vs]:
                return False
        return True

    def _rank_mins(self, r: int, lb, capt, mins):
        """Smallest costs (``MIN_*`` up to the all-reduces) of undecided rank ``r`` over the remaining
        types whose per-type caps ``capt`` hold its lower bounds ``lb`` (every completion below tau
        gives the rank such a type); ``mins`` (all remaining types) when ``capt`` is None or no type
        fits (the propagation cuts such nodes)."""
        if capt is None:
            return mins
        out = None
        for x, own in enumerate(self.type_mins):
            if own is None or not self._fits(r, x, lb, capt):
                continue
            out = list(own) if out is None else [a if a < b else b for a, b in zip(out, own)]
        return mins if out is None else out

    def _send_lb(self, r: int, unknown_min: float) -> float:
        """Transfer ms of link ``r -> r+1``: exact when both ends are decided, else a lower bound."""
        pp, tb = self.pp, self.table
        if not link_carries_data(r, pp, self.v):
            return 0.0
        n = (r + 1) % pp
        t, u = self.types[r], self.types[n]
        if t < 0:
            return unknown_min
        i = t * self.stride + self.slot[r]
        if u >= 0:
            if t != u:
                return tb.send_cross_ms[t]
            return tb.send_wrap_ms[i] if n == 0 else tb.send_same_ms[i]
        best = INF
        if self.remaining[t] > 0:
            # n == 0 only when ranks are decided from the end: the wrap to the type's slot 0
            best = tb.send_wrap_ms[i] if n == 0 else tb.send_same_ms[i]
        if any(self.remaining[x] > 0 for x in range(self.nt) if x != t):
            if tb.send_cross_ms[t] < best:
                best = tb.send_cross_ms[t]
        return 0.0 if best == INF else best

    def _propagate(self, k: int, left: int, lb, cap, capt, parent=None) -> bool:
        """Initialise and tighten ``lb``/``cap`` of the undecided ranks' stages; ``False``: pruned.

        ``capt[vs * nt + t]`` is the cap of stage ``vs`` if its rank takes type ``t`` (-1: cannot).
        ``parent``: the parent node's ``(lb, cap, capt)``, where ranks ``k..`` start from (every
        completion here is one of the parent's, and tau has not risen since: docs/SEARCH.md).
        """
        pp, v, nt = self.pp, self.v, self.nt
        ctr = self.ctr
        for r in range(k, self.ub):
            best = -1
            for x in range(nt):
                cr = self.cap_rank[x * pp + r] if self.remaining[x] > 0 else -1
                # ridge space: once a type's layers have fallen, its later ranks hold at most that
                if self.ridge and self.down[x] and self.last[x] < cr:
                    cr = self.last[x]
                if cr < v:
                    cr = -1
                for c in range(v):
                    i = (c * pp + r) * nt + x
                    ct = chunk_layers(cr, c, v) if cr >= 0 else -1
                    capt[i] = ct if parent is None or ct < parent[2][i] else parent[2][i]
                if cr > best:
                    best = cr
            if best < v:
                ctr[PRUNED_MEMORY] += 1
                return False
            for c in range(v):
                vs = c * pp + r
                lb[vs] = 1
                cap[vs] = chunk_layers(best, c, v)
                if parent is not None:
                    if parent[0][vs] > 1:
                        lb[vs] = parent[0][vs]
                    if parent[1][vs] < cap[vs]:
                        cap[vs] = parent[1][vs]
        tau = self.tau
        rounds = PROPAGATION_ROUNDS if parent is None else INHERITED_ROUNDS
        for rnd in range(rounds):
            s_cap = s_lb = 0
            for r in range(k, self.ub):
                for c in range(v):
                    s_cap += cap[c * pp + r]
                    s_lb += lb[c * pp + r]
            if s_cap < left or s_lb > left:
                ctr[PRUNED_PATH] += 1
                return False
            for r in range(k, self.ub):
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
            if tau == INF or k == self.ub - 1 or rnd == rounds - 1:
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
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = tb.allreduce_ms[i] if tb.has_allreduce[i] else 0.0
                if x < ar:
                    ar = x
            out.append((t, tb.forward_ms[t], tb.backward_ms[t], 0.0 if ar == INF else ar))
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
            for r in range(k, self.ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    s_lb = 0
                    for c in range(v):
                        s_lb += lb[c * pp + r]
                    ecap[r * nt + t] = s - s_lb
                    efull[r * nt + t] = s
            # ranks by room on t, largest first (ties: lower rank first)
            order.append(sorted((r for r in range(k, self.ub) if ecap[r * nt + t] >= 0),
                                key=lambda r, t=t: -ecap[r * nt + t]))
            order_full.append(sorted((r for r in range(k, self.ub) if efull[r * nt + t] >= 0),
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
        for r in range(k, self.ub):
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
        for r in range(k, self.ub):
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

    # --- the bound paths (docs/SEARCH.md, "Mass and capacity reasoning") -----------------------

    def _path_caps(self, k: int, left: int, lb, cap, capt) -> int:
        """Tighten caps with the bound paths; -1: some path proves the node cannot beat ``tau``.

        Per path owned by an undecided rank: price its stages (:meth:`_path_prices`), cut the node if
        even the cheapest placement of the remaining layers reaches ``tau`` (:meth:`_path_cuts`), else
        cap the owner's layers per type (:meth:`_owner_caps`). Returns 1 when a cap changed, else 0.
        """
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        paths = self.shape.paths
        self._fill(lb, capt)
        slopes = self._type_slopes()
        limit = self.tau * (1.0 + PATH_SLACK)
        extra = left
        for r in range(k, self.ub):
            for c in range(v):
                extra -= lb[c * pp + r]
        K = self._type_room(k, lb, cap, capt, slopes)
        changed = 0
        alpha = [0.0] * nv
        rmt = [INF] * nt
        rsum = [0.0] * nt
        gam, gam0 = [0.0] * pp, [0.0] * pp     # per rank, see _gammas (above lb / whole count)
        for q in range(paths.count):
            if paths.owner[q] < k or paths.owner[q] >= self.ub:
                continue        # the owner is decided: no caps (below); the DAG bound covers its cut
            pr = self._path_prices(q, k, lb, slopes, alpha, rmt, rsum)
            if self._path_cuts(k, extra, limit, pr, alpha, lb, cap):
                return -1
            if pr.rank_min2 == INF:
                continue
            got = self._owner_caps(q, k, extra, limit, K, pr, alpha, gam, gam0, lb, cap, capt, slopes)
            if got < 0:
                return -1
            if got:
                changed = 1
        return changed

    def _path_prices(self, q: int, k: int, lb, slopes, alpha, rmt, rsum) -> "PathPrices":
        """Path ``q`` at the node: its cost at the lower bounds (``base``) and, per undecided stage,
        its per-layer slope at the cheapest remaining type (into ``alpha``); per type and per rank the
        smallest slopes the placement bounds of :meth:`_owner_caps` use."""
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        p = self.params
        paths = self.shape.paths
        cf = q * nv
        cr = q * pp
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
        rlb = [0.0] * pp              # per rank: its lb layers along the path, as priced in base
        for r in range(k, self.ub):
            rmin = INF
            s_lb = 0
            m_f, m_b, m_ar = self.fill_slopes[r]      # what the DAG fill priced its lb layers at
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
                # per-column minimum the DAG fill used (over the types that fit the rank)
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
        return PathPrices(base_cost=base, min_slope=a1, max_slope=amax, rank_min1=b1, rank_min2=b2,
                          rank_min_arg=argr, type_min1=mu1, type_min2=mu2, type_min_rank=marg,
                          type_mean1=nu1, type_mean2=nu2, type_mean_rank=narg, rank_lb_cost=rlb)

    def _path_cuts(self, k: int, extra: int, limit: float, pr: "PathPrices", alpha, lb, cap) -> bool:
        """Whether the path's cost at the lower bounds plus the cheapest placement of the ``extra``
        layers above them reaches the limit (the node is then cut)."""
        base = pr.base_cost
        if base + extra * pr.min_slope >= limit:
            return True
        if extra > 0 and base + extra * pr.max_slope >= limit:
            if base + self._knapsack(k, self.ub, extra, alpha, lb, cap) >= limit:
                return True
        return False

    def _owner_caps(self, q: int, k: int, extra: int, limit: float, K, pr: "PathPrices", alpha,
                    gam, gam0, lb, cap, capt, slopes) -> int:
        """Caps per type of the owner rank ``r`` of path ``q`` (into ``capt``), then of its stages
        (into ``cap``): -1 when no type can take the rank, 1 when a stage cap fell, else 0.

        The rank's ``d`` layers above its lower bounds cost, along the path, exactly their chunk-by-
        chunk slopes on the type (all its chunks share the type and the layers); the other
        ``extra - d`` layers at least the cheapest slope of another rank's stage (closed form, an upper
        start for ``d``), and at least their cheapest placement by type (:meth:`_others_fit`). The
        cap is the largest ``d`` whose cost stays below the limit. Only the owner is capped: the other
        ranks' slopes on the path are small.
        """
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        paths = self.shape.paths
        cf, cr = q * nv, q * pp
        base = pr.base_cost
        r = paths.owner[q]
        m = pr.rank_min2 if r == pr.rank_min_arg else pr.rank_min1
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
                if own < INF and self._others_fit(q, k, r, t, extra - d, own, rhs, K, pr, gam, gam0,
                                                  lb, slopes):
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
        return self._stage_caps(r, lb, cap, capt, slopes)

    def _others_fit(self, q: int, k: int, r: int, t: int, e: int, own: float, rhs: float, K,
                    pr: "PathPrices", gam, gam0, lb, slopes) -> bool:
        """Whether ``own`` plus each lower bound on the cost, along path ``q``, of the ``e`` layers
        above their lower bounds that the undecided ranks other than ``r`` (on type ``t``) take stays
        below ``rhs``. The placement bounds, in pairs (the answer is order-free):

        (i) each at the cheapest slope of a rank's stage, types in order up to their capacity ``K``;
        (ii) the same with a rank's mean chunk slope less its rounding loss (``V > 1``);
        (iii) the other ranks' whole layer counts, lower bounds included, placed the same way with
        whole capacities, less what ``base`` already priced of their lower bounds; (iv) (iii) with
        mean slopes (``V > 1``).

        A pair's mean-slope bound without its rounding loss is at least both bounds of the pair (a
        rank's cheapest chunk slope is at most its mean, the placement cost is monotone in the slopes,
        and the losses are >= 0): when it fits with ``FIT_SLACK`` to spare for float noise, so does
        the pair, and the losses (``_gammas``) are not computed. Either way the answer is the same.
        """
        pp, v = self.pp, self.v
        if pr.others_lb_cost < 0.0:
            # all the other ranks' layers placed by type, their lower bounds too (base priced those
            # at each stage's cheapest type: take them out)
            pr.others_lb_cost = 0.0
            pr.others_lb_layers = 0
            for j in range(k, self.ub):
                if j != r:
                    pr.others_lb_cost += pr.rank_lb_cost[j]
                    for c in range(v):
                        pr.others_lb_layers += lb[c * pp + j]
        # (iv) and (iii)
        fit = True
        pn = INF
        if v > 1:
            pn = self._phi(pr.others_lb_layers + e, r, t, self.kfull, pr.type_mean1, pr.type_mean2, pr.type_mean_rank, slopes)
        if v == 1 or not own + (pn - pr.others_lb_cost) < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if pr.loss_sum_whole < 0.0:
                    pr.loss_sum_whole = self._gammas(q, k, self.zero_lb, self.efull, gam0, slopes)
                fit = own + (pn - (pr.loss_sum_whole - gam0[r]) - pr.others_lb_cost) < rhs
            fit = fit and own + (self._phi(pr.others_lb_layers + e, r, t, self.kfull, pr.type_min1, pr.type_min2, pr.type_min_rank, slopes)
                                 - pr.others_lb_cost) < rhs
        if not fit:
            return False
        # (ii) and (i)
        pn = INF
        if v > 1:
            pn = self._phi(e, r, t, K, pr.type_mean1, pr.type_mean2, pr.type_mean_rank, slopes)
        if v == 1 or not own + pn < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if pr.loss_sum < 0.0:
                    pr.loss_sum = self._gammas(q, k, lb, self.ecap, gam, slopes)
                fit = own + (pn - (pr.loss_sum - gam[r])) < rhs
            fit = fit and own + self._phi(e, r, t, K, pr.type_min1, pr.type_min2, pr.type_min_rank, slopes) < rhs
        return fit

    def _stage_caps(self, r: int, lb, cap, capt, slopes) -> int:
        """Each stage of rank ``r``: its cap is the largest over the types that can still take the
        whole rank. -1 when none can, 1 when a cap fell, else 0."""
        pp, v, nt = self.pp, self.v, self.nt
        changed = 0
        for c in range(v):
            vs = c * pp + r
            top = -1
            for t, _ft, _bt, _at in slopes:
                if self._fits(r, t, lb, capt) and capt[vs * nt + t] > top:
                    top = capt[vs * nt + t]
            if top < lb[vs]:
                return -1
            if top < cap[vs]:
                cap[vs] = top
                changed = 1
        return changed

    def _count_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float = INF) -> float:
        """After a DAG bound run: how much more, along one of its longest paths, every completion
        below tau costs than the fill priced the undecided ranks ``[a, b)`` (docs/SEARCH.md, "The gain
        along the bound's longest path"): the larger of two lower bounds. (1) Apart: their
        lower-bound layers, each rank on a remaining type that fits it (``capt``), each type on
        exactly its remaining ranks, bounded by the Lagrangian relaxation of that assignment with the
        per-type mean costs as multipliers, plus the ``extra`` layers above the lower bounds at each
        stage's least slope along the path over those types (fractional, up to the caps). (2) Joint
        (:meth:`_joint_gain`): the two together, the layer sum relaxed with one multiplier and the
        type assignment solved exactly. Once a bound reaches ``need`` (what cuts the child) it is
        returned as it stands."""
        pp, v, nt, nv = self.pp, self.v, self.nt, self.nv
        cnt = self.kernel.critical_counts(self.params)
        tm = self.type_mins
        lam, lcnt = [0.0] * nt, [0] * nt
        crt = self.crt
        slope = self.jslope
        alpha = [0.0] * nv
        for r in range(a, b):
            na = cnt[1 + 2 * nv + pp + r]
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            m_f, m_b, m_a = self.fill_slopes[r]
            for t in range(nt):
                crt[r * nt + t] = INF
                if self.remaining[t] <= 0:
                    continue
                if not self._fits(r, t, lb, capt):
                    continue
                x = na * s_lb * (tm[t][MIN_ALLREDUCE] - m_a)
                for c in range(v):
                    vs = c * pp + r
                    nf, nb = cnt[1 + r * v + c], cnt[1 + nv + r * v + c]
                    x += lb[vs] * (nf * (tm[t][MIN_FORWARD] - m_f) + nb * (tm[t][MIN_BACKWARD] - m_b))
                crt[r * nt + t] = x
                lam[t] += x
                lcnt[t] += 1
            for c in range(v):
                vs = c * pp + r
                y = INF
                for t in range(nt):
                    if crt[r * nt + t] == INF:
                        continue
                    # one more layer of this stage on type t, along the path
                    x = (cnt[1 + r * v + c] * tm[t][MIN_FORWARD] + cnt[1 + nv + r * v + c] * tm[t][MIN_BACKWARD]
                         + na * tm[t][MIN_ALLREDUCE])
                    slope[vs * nt + t] = x
                    if x < y:
                        y = x
                alpha[vs] = y if y < INF else 0.0
        ll = self._knapsack(a, b, extra, alpha, lb, cap)   # the extra layers, cheapest first
        for t in range(nt):
            if lcnt[t] > 0:
                lam[t] /= lcnt[t]
        for r in range(a, b):
            m1 = INF
            for t in range(nt):
                x = crt[r * nt + t] - lam[t]
                if x < m1:
                    m1 = x
            ll += m1
        for t in range(nt):
            if self.remaining[t] > 0:
                ll += lam[t] * self.remaining[t]
        if ll < need:
            x = self._joint_gain(a, b, lb, cap, capt, extra, need)
            if x > ll:
                ll = x
        return ll if ll > 0.0 else 0.0

    def _joint_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float = INF) -> float:
        """The gain's second bound (docs/SEARCH.md): rank ``r`` of ``[a, b)`` on type ``t`` with ``e``
        layers above its lower bounds costs, along the path, ``crt[r, t] + sum_c slope[vs, t] e_c``
        (``e_c`` up to the stage's room on ``t``); every completion puts exactly ``extra`` such layers
        and each type on exactly its remaining ranks. Relaxing the layer sum with a multiplier ``mu``
        leaves, per rank and type, ``crt + sum_c min(0, slope - mu) room`` (each stage full or at its
        lower bound), and the exact best assignment of types to ranks of those costs plus ``mu extra``
        bounds every completion, for every ``mu``. The bound is concave in ``mu`` with its maximum at a
        slope: a bisection over the sorted distinct slopes by the sign of ``extra`` minus the room the
        best assignment fills (stopped once the bound reaches ``need``). ``crt`` and ``slope`` come
        from :meth:`_count_gain`; infinite when no assignment exists."""
        pp, v, nt = self.pp, self.v, self.nt
        crt, slope, room = self.crt, self.jslope, self.jroom
        mus = []
        for r in range(a, b):
            for t in range(nt):
                if crt[r * nt + t] == INF:
                    continue
                for c in range(v):
                    vs = c * pp + r
                    ct = capt[vs * nt + t]
                    if cap[vs] < ct:
                        ct = cap[vs]
                    room[vs * nt + t] = ct - lb[vs]
                    if ct > lb[vs]:
                        mus.append(slope[vs * nt + t])
        mus = sorted(set(mus))
        if not mus:
            return self._joint_at(a, b, 0.0, extra)
        best = -INF
        lo, hi = 0, len(mus) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            x = self._joint_at(a, b, mus[mid], extra)
            if x > best:
                best = x
            if best >= need:
                break
            if self.jslack > 0:
                lo = mid + 1
            else:
                hi = mid - 1
        return best

    def _joint_at(self, a: int, b: int, mu: float, extra: int) -> float:
        """:meth:`_joint_gain` at one multiplier ``mu``; sets ``jslack``: ``extra`` less the room the
        best assignment fills at ``mu`` (> 0: the bound rises with ``mu``)."""
        pp, v, nt, n = self.pp, self.v, self.nt, b - a
        crt, slope, room = self.crt, self.jslope, self.jroom
        value = [[NEG] * n for _ in range(nt)]
        for r in range(a, b):
            for t in range(nt):
                if crt[r * nt + t] == INF:
                    continue
                x = crt[r * nt + t]
                for c in range(v):
                    vs = c * pp + r
                    if slope[vs * nt + t] < mu:
                        x += (slope[vs * nt + t] - mu) * room[vs * nt + t]
                value[t][r - a] = -x
        got = best_assignment(value, [max(0, x) for x in self.remaining], n)
        if got is None:
            self.jslack = 0
            return INF
        filled = 0
        for i, t in enumerate(got[1]):
            for c in range(v):
                vs = c * pp + a + i
                if slope[vs * nt + t] <= mu:
                    filled += room[vs * nt + t]
        self.jslack = extra - filled
        return mu * extra - got[0]

    def _type_mass(self, k: int, left: int, lb, cap, capt) -> bool:
        """The undecided ranks, each on one remaining type, must be able to hold ``left`` layers."""
        return self._type_capacity(k, self.ub, lb, cap, capt) >= left

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

    def _type_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """Most layers ranks ``k..ub-1`` can hold, each on one remaining type: with exact counts the
        best assignment (-1 when none exists), else per type its ``n`` largest rank capacities."""
        pp, nt = self.pp, self.nt
        if self.exact_counts and k < ub:
            # the best assignment: at most the per-type sum below (where every type may count the
            # same roomy ranks), and -1 wherever that sum finds too few ranks for a type
            return self._assign_capacity(k, ub, lb, cap, capt)
        total = 0
        for t in range(nt):
            n = self.remaining[t]
            if n <= 0:
                continue
            vals = []
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    vals.append(s)
            vals.sort(reverse=True)
            total += sum(vals[:n])
        return total

    def _assign_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """With exact counts: the most layers ranks ``k..ub-1`` hold when each takes one remaining type
        and type ``t`` goes to exactly its ``remaining[t]`` of them (the best assignment, a transportation
        problem solved exactly by :func:`.assignment.best_assignment`); -1 when no assignment exists. At most
        the per-type sum above, where every type may count the same roomy ranks."""
        pp, nt = self.pp, self.nt
        value = [[NEG] * (ub - k) for _ in range(nt)]
        for t in range(nt):
            if self.remaining[t] <= 0:
                continue
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    value[t][r - k] = s
        got = best_assignment(value, [max(0, x) for x in self.remaining], ub - k)
        return -1 if got is None else got[0]

    def _knapsack(self, k: int, ub: int, extra: int, alpha, lb, cap) -> float:
        """Cheapest cost of ``extra`` more layers over the stages of ranks ``k..ub-1`` (fractional, by
        slope)."""
        pp, v = self.pp, self.v
        order = sorted((c * pp + r for r in range(k, ub) for c in range(v)), key=lambda vs: alpha[vs])
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
