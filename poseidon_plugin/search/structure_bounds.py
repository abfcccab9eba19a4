"""Lower bounds and layer caps inside one structure's tree (docs/SEARCH.md, "Lower bounds").

:class:`StructureBounds` is the bound half of :class:`~.splits.SplitSearch` (which adds the tree walk and
the search state): it reads that state (``types``, ``remaining``, ``used``, ``counts``, ``tau``, the
parameter vector) and tightens the per-stage lower bounds ``lb`` and caps ``cap`` of the undecided ranks:

* :meth:`StructureBounds._propagate` -- memory caps, sum rules, then rounds of the path bounds and the
  type-aware capacity;
* :meth:`StructureBounds._path_caps` -- per bound path: prices (:meth:`_path_prices`), the mass cut
  (:meth:`_path_cuts`), the owner rank's caps per type (:meth:`_owner_caps`, with the placement bounds of
  :meth:`_others_fit`) and the stage caps they give (:meth:`_stage_caps`);
* :meth:`StructureBounds._fill` -- the DAG bound's parameter vector: decided ranks exactly, undecided ones
  at the smallest weights they can have (:meth:`_unknown_mins`, :meth:`_rank_mins`, :meth:`_send_lb`);
* :meth:`StructureBounds._count_gain` / :meth:`_joint_gain` -- what every completion adds along the DAG
  bound's longest path.

One source for both backends: written in Cython's pure-Python mode, typed by
``cython_core/structure_bounds.pxd`` and compiled as ``poseidon_plugin._core.structure_bounds`` (the base
class of the compiled ``SplitSearch``); uncompiled (``POSEIDON_PURE_PYTHON=1``) it runs as it is. Every
array is a flat typed buffer (an ``array``; a ``memoryview`` of one where it is sliced): a stage ``vs`` of rank ``r`` is
``vs = c * pp + r``, a (stage, type) entry ``vs * nt + t``, a (rank, type) one ``r * nt + t``;
``n_left``: how many remaining types :meth:`StructureBounds._type_slopes` listed (slope index ``i``).
"""

from __future__ import annotations

import math
from array import array

from poseidon_plugin.search.assignment import NEG_F
from poseidon_plugin.search.constants import (FIT_SLACK, INHERITED_ROUNDS, MIN_ALLREDUCE, MIN_BACKWARD,
                                              MIN_EMBEDDING_ALLREDUCE, MIN_EMBEDDING_BACKWARD,
                                              MIN_EMBEDDING_FORWARD, MIN_FORWARD, MIN_HEAD_ALLREDUCE,
                                              MIN_HEAD_BACKWARD, MIN_HEAD_FORWARD, MIN_SEND, N_MINS,
                                              N_TYPE_MINS, PATH_SLACK, PROPAGATION_ROUNDS, STAGE_MIN_CUTS,
                                              STAGE_TRIAL)
from poseidon_plugin.search.counters import PRUNED_MEMORY, PRUNED_PATH

from .assignment import assign_into

INF = math.inf


def chunk_layers(total: int, chunk: int, v: int) -> int:
    """Layers of chunk ``chunk`` when a rank's ``total`` layers are spread evenly, earlier chunks first."""
    return (total + v - 1 - chunk) // v


def int_buffer(n: int, fill: int = 0):
    """A flat ``int`` buffer of ``n`` entries (at least one), each ``fill`` (an ``array``: wrap it in a
    ``memoryview`` where it is sliced, since slicing an ``array`` copies)."""
    return array("i", [fill]) * (n if n > 0 else 1)


def float_buffer(n: int, fill: float = 0.0):
    """A flat ``double`` buffer of ``n`` entries (at least one), each ``fill``."""
    return array("d", [fill]) * (n if n > 0 else 1)


def int_copy(seq):
    """A flat ``int`` buffer holding ``seq`` (one 0 when it is empty)."""
    return array("i", seq) if len(seq) else array("i", [0])


def float_copy(seq):
    """A flat ``double`` buffer holding ``seq`` (one 0.0 when it is empty)."""
    return array("d", seq) if len(seq) else array("d", [0.0])


class StructureBounds:
    """The bound methods of :class:`~.splits.SplitSearch` (see the module docstring); its attributes
    are declared and set there."""

    # --- the DAG bound's fill -------------------------------------------------------------------

    def _unknown_mins(self) -> None:
        """Smallest costs over the device types an undecided rank may still take, into ``mins``
        (indices ``MIN_*``; 0 where no type is left); per remaining type its own costs of
        ``MIN_NAMES[:MIN_SEND]`` into ``type_mins[t * N_TYPE_MINS + k]`` (all-reduces: its free slots')."""
        mins, tm = self.mins, self.type_mins
        for i in range(N_MINS):
            mins[i] = INF
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            o = t * N_TYPE_MINS
            tm[o + MIN_FORWARD] = self.forward_ms[t]
            tm[o + MIN_BACKWARD] = self.backward_ms[t]
            tm[o + MIN_EMBEDDING_FORWARD] = self.embedding_forward_ms[t]
            tm[o + MIN_EMBEDDING_BACKWARD] = self.embedding_backward_ms[t]
            tm[o + MIN_HEAD_FORWARD] = self.head_forward_ms[t]
            tm[o + MIN_HEAD_BACKWARD] = self.head_backward_ms[t]
            tm[o + MIN_ALLREDUCE] = INF
            tm[o + MIN_EMBEDDING_ALLREDUCE] = INF
            tm[o + MIN_HEAD_ALLREDUCE] = INF
            if self.send_cross_ms[t] < mins[MIN_SEND]:
                mins[MIN_SEND] = self.send_cross_ms[t]
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = self.allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < tm[o + MIN_ALLREDUCE]:
                    tm[o + MIN_ALLREDUCE] = x
                x = self.embedding_allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < tm[o + MIN_EMBEDDING_ALLREDUCE]:
                    tm[o + MIN_EMBEDDING_ALLREDUCE] = x
                x = self.head_allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < tm[o + MIN_HEAD_ALLREDUCE]:
                    tm[o + MIN_HEAD_ALLREDUCE] = x
                # links out of slot j: to slot j+1 of its type, or the wrap to slot 0
                if j + 1 < self.counts[t] and self.send_same_ms[i] < mins[MIN_SEND]:
                    mins[MIN_SEND] = self.send_same_ms[i]
                if j > 0 and self.send_wrap_ms[i] < mins[MIN_SEND]:
                    mins[MIN_SEND] = self.send_wrap_ms[i]
            for i in range(N_TYPE_MINS):   # the minima over all types are those of the types' own
                if tm[o + i] < mins[i]:
                    mins[i] = tm[o + i]
        for i in range(N_MINS):
            if mins[i] == INF:
                mins[i] = 0.0

    def _fits(self, r: int, t: int, lb, capt) -> bool:
        """Whether type ``t``'s caps ``capt`` hold the lower bounds ``lb`` of every chunk of rank ``r``."""
        for c in range(self.v):
            vs = c * self.pp + r
            if capt[vs * self.nt + t] < lb[vs]:
                return False
        return True

    def _rank_mins(self, r: int, lb, capt, out) -> bool:
        """Smallest costs (``MIN_*`` up to the all-reduces, into ``out``) of undecided rank ``r`` over the
        remaining types whose per-type caps ``capt`` hold its lower bounds ``lb`` (every completion below
        tau gives the rank such a type); False when no type fits (the propagation cuts such nodes)."""
        found = False
        for x in range(self.nt):
            if self.remaining[x] <= 0 or not self._fits(r, x, lb, capt):
                continue
            o = x * N_TYPE_MINS
            for i in range(N_TYPE_MINS):
                if not found or self.type_mins[o + i] < out[i]:
                    out[i] = self.type_mins[o + i]
            found = True
        return found

    def _fill(self, lb, capt) -> None:
        """Parameter vector: decided ranks exactly as :meth:`CostModel.stage_times` (the operations of
        :func:`~poseidon_plugin.stagecost.put_rank_times`, in its order), undecided ones at lower bounds:
        layers at ``lb``, costs at the minimum over the types they may still take: with the node's
        per-type caps ``capt``, only the types that can hold the rank's lower bounds (:meth:`_rank_mins`).
        An undecided rank's framework terms are left out (still a lower bound: stagecost)."""
        pp, v, nv = self.pp, self.v, self.nv
        p, mins, rm = self.params, self.mins, self.rank_min_costs
        self._unknown_mins()
        for r in range(pp):
            t = self.types[r]
            total_ar = 0.0
            sfw = 0.0
            sbw = 0.0
            opt = 0.0
            if t >= 0:
                total_ar = self.optimizer_fixed_ms[t]
                sfw = self.step_forward_ms[t]
                sbw = self.step_backward_ms[t]
                opt = self.optimizer_ms[t]
                i = t * self.stride + self.slot[r]
                hasar = self.has_allreduce[i]
                fw = self.forward_ms[t]
                bw = self.backward_ms[t]
                arr = self.allreduce_ms[i]
                efw = self.embedding_forward_ms[t]
                ebw = self.embedding_backward_ms[t]
                ear = self.embedding_allreduce_ms[i]
                hfw = self.head_forward_ms[t]
                hbw = self.head_backward_ms[t]
                har = self.head_allreduce_ms[i]
            else:
                hasar = 1
                if not self._rank_mins(r, lb, capt, rm):
                    for i in range(N_TYPE_MINS):
                        rm[i] = mins[i]
                fw = rm[MIN_FORWARD]
                bw = rm[MIN_BACKWARD]
                efw = rm[MIN_EMBEDDING_FORWARD]
                ebw = rm[MIN_EMBEDDING_BACKWARD]
                hfw = rm[MIN_HEAD_FORWARD]
                hbw = rm[MIN_HEAD_BACKWARD]
                arr = rm[MIN_ALLREDUCE]
                ear = rm[MIN_EMBEDDING_ALLREDUCE]
                har = rm[MIN_HEAD_ALLREDUCE]
                self.fill_forward[r] = fw
                self.fill_backward[r] = bw
                self.fill_allreduce[r] = arr
            for c in range(v):
                vs = c * pp + r
                n = self.layers[vs] if self.layers[vs] else lb[vs]
                f = n * fw + sfw
                b = n * bw + sbw
                total_ar += n * opt
                if hasar:
                    total_ar += n * arr
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
            p[1 + 2 * nv + r] = self._send_lb(r, mins[MIN_SEND])

    def _send_lb(self, r: int, unknown_min: float) -> float:
        """Transfer ms of link ``r -> r+1``: exact when both ends are decided, else a lower bound
        (none on a link that carries no data: :func:`~poseidon_plugin.stagecost.link_carries_data`)."""
        pp = self.pp
        if pp == 1 or (self.v == 1 and r == pp - 1):
            return 0.0
        n = (r + 1) % pp
        t = self.types[r]
        u = self.types[n]
        if t >= 0 and u >= 0:
            return self._typed_link(r, n, t, u)
        if t < 0 and u < 0:
            return unknown_min
        # Where the sender cannot be of the receiver's type the link is a cross-type one: on the
        # bound's longest path it weighs once per micro-batch when the receiver is the bottleneck.
        best = self._any_link(r, n, t, u)
        return 0.0 if best == INF else best

    def _typed_link(self, s: int, n: int, a: int, b: int) -> float:
        """Least transfer ms of link ``s -> n`` when ``s`` is of type ``a`` and ``n`` of type ``b``: a
        cross-type link is priced by the sender's type; a same-type one is the link out of ``s``'s slot
        when ``s`` is decided (the wrap when ``n`` is rank 0), else out of one of ``a``'s free slots
        (:meth:`_same_type_into`; INF when none is free)."""
        if a != b:
            return self.send_cross_ms[a]
        if self.types[s] >= 0:
            i = a * self.stride + self.slot[s]
            return self.send_wrap_ms[i] if n == 0 else self.send_same_ms[i]
        return self._same_type_into(a, n)

    def _any_link(self, s: int, n: int, a: int, b: int) -> float:
        """Least transfer ms of link ``s -> n`` when one end's type is given (``a`` of the sender or
        ``b`` of the receiver) and the other end (``-1``) is undecided: the least over the types it may
        still take. A given end that is undecided itself holds one rank of its type."""
        k = s if a >= 0 else n
        c = a if a >= 0 else b
        best = INF
        for x in range(self.nt):
            need = 1 if (x == c and self.types[k] < 0) else 0
            if self.remaining[x] > need:
                val = self._typed_link(s, n, c, x) if a >= 0 else self._typed_link(s, n, x, c)
                if val < best:
                    best = val
        return best

    def _same_type_into(self, u: int, n: int) -> float:
        """Least transfer ms of a link into rank ``n`` of type ``u`` from an undecided rank that takes
        type ``u`` too, out of one of its free slots: to the next slot, or the wrap to slot 0 when
        ``n`` is rank 0 (INF when no slot of ``u`` is free)."""
        best = INF
        if self.remaining[u] > 0:
            for j in range(self.used[u], self.hi[u]):
                i = u * self.stride + j
                if n == 0:
                    if j > 0 and self.send_wrap_ms[i] < best:
                        best = self.send_wrap_ms[i]
                elif j + 1 < self.counts[u] and self.send_same_ms[i] < best:
                    best = self.send_same_ms[i]
        return best

    def _send_gain(self, r: int, x: int, cnt) -> float:
        """How much more than the fill's lower bounds the links between undecided rank ``r`` and its
        decided neighbours cost along the path of ``cnt`` when ``r`` takes type ``x`` (a cross-type
        link, or a same-type one)."""
        pp, nv = self.pp, self.nv
        p = self.params
        g = 0.0
        if pp == 1:
            return g
        if self.v > 1 or r < pp - 1:           # the link r -> r + 1 (-> 0: the wrap, interleaved only)
            n = (r + 1) % pp
            u = self.types[n]
            e = 1 + 2 * nv + r
            if u >= 0 and cnt[e] > 0:
                val = self._typed_link(r, n, x, u)
                if val < INF and val > p[e]:
                    g += cnt[e] * (val - p[e])
        if self.v > 1 or r > 0:                # the link r - 1 -> r
            q = (r + pp - 1) % pp
            t = self.types[q]
            e = 1 + 2 * nv + q
            if t >= 0 and cnt[e] > 0:
                val = self._typed_link(q, r, t, x)
                if val > p[e]:
                    g += cnt[e] * (val - p[e])
        return g

    def _owner_link_gain(self, q: int, r: int, t: int) -> float:
        """How much more than the fill's lower bounds the two links of undecided rank ``r``, the owner
        of path ``q``, cost along it when ``r`` takes type ``t``: the link out of ``r`` is one out of a
        type-``t`` rank into its neighbour, the link into ``r`` one out of its neighbour (each neighbour
        decided: exactly; undecided: the least over the types it may take). A slow type's links weigh
        once per micro-batch on its own steady state."""
        pp, nv = self.pp, self.nv
        p = self.params
        g = 0.0
        if pp == 1:
            return g
        if self.owner_out_coef[q] > 0 and (self.v > 1 or r < pp - 1):      # the link r -> r + 1
            n = (r + 1) % pp
            u = self.types[n]
            e = 1 + 2 * nv + r
            val = self._typed_link(r, n, t, u) if u >= 0 else self._any_link(r, n, t, -1)
            if val < INF and val > p[e]:
                g += self.owner_out_coef[q] * (val - p[e])
        if self.owner_in_coef[q] > 0 and (self.v > 1 or r > 0):            # the link r - 1 -> r
            s = (r + pp - 1) % pp
            w = self.types[s]
            e = 1 + 2 * nv + s
            val = self._typed_link(s, r, w, t) if w >= 0 else self._any_link(s, r, -1, t)
            if val < INF and val > p[e]:
                g += self.owner_in_coef[q] * (val - p[e])
        return g

    # --- propagation ----------------------------------------------------------------------------

    def _propagate(self, k: int, left: int, lb, cap, capt, parent_lb, parent_cap, parent_capt,
                   inherit: bool) -> bool:
        """Initialise and tighten ``lb``/``cap`` of the undecided ranks' stages; ``False``: pruned.

        ``capt[vs * nt + t]`` is the cap of stage ``vs`` if its rank takes type ``t`` (-1: cannot).
        With ``inherit``, ranks ``k..`` start from the parent node's ``parent_lb``, ``parent_cap``,
        ``parent_capt`` (every completion here is one of the parent's, and tau has not risen since:
        docs/SEARCH.md); else those are not read.
        """
        pp, v, nt = self.pp, self.v, self.nt
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
                    if inherit and parent_capt[i] < ct:
                        ct = parent_capt[i]
                    capt[i] = ct
                if cr > best:
                    best = cr
            if best < v:
                self.ctr[PRUNED_MEMORY] += 1
                return False
            for c in range(v):
                vs = c * pp + r
                lb[vs] = 1
                cap[vs] = chunk_layers(best, c, v)
                if inherit:
                    if parent_lb[vs] > 1:
                        lb[vs] = parent_lb[vs]
                    if parent_cap[vs] < cap[vs]:
                        cap[vs] = parent_cap[vs]
        rounds = INHERITED_ROUNDS if inherit else PROPAGATION_ROUNDS
        for rnd in range(rounds):
            s_cap = 0
            s_lb = 0
            for r in range(k, self.ub):
                for c in range(v):
                    s_cap += cap[c * pp + r]
                    s_lb += lb[c * pp + r]
            if s_cap < left or s_lb > left:
                self.ctr[PRUNED_PATH] += 1
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
                        self.ctr[PRUNED_PATH] += 1
                        return False
            if self.tau == INF or k == self.ub - 1 or rnd == rounds - 1:
                break
            changed = self._path_caps(k, left, lb, cap, capt)
            if changed >= 0 and not self._type_mass(k, left, lb, cap, capt):
                changed = -1
            if changed < 0:
                self.ctr[PRUNED_PATH] += 1
                return False
            if changed == 0:
                break
        return True

    def _type_slopes(self) -> int:
        """The remaining types (into ``slope_type``) with their per-layer forward, backward and cheapest
        free-slot all-reduce ms (``slope_forward``, ``slope_backward``, ``slope_allreduce``): how many."""
        n = 0
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            ar = INF
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = self.allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < ar:
                    ar = x
            self.slope_type[n] = t
            self.slope_forward[n] = self.forward_ms[t]
            self.slope_backward[n] = self.backward_ms[t]
            self.slope_allreduce[n] = 0.0 if ar == INF else ar
            n += 1
        return n

    def _type_room(self, k: int, lb, cap, capt, n_left: int) -> None:
        """``room_above[(r * nt + t2) * nt + t]``: most layers above their lower bounds that the
        undecided ranks other than ``r`` can hold on type ``t`` when ``r`` takes type ``t2`` (the ``n``
        best of them, ``n`` = the type's remaining ranks); -1 when too few of them can host ``t``.
        ``room_whole``: the same with whole capacities. Per (rank, type) into ``rank_room_above`` and
        ``rank_room_whole`` (-1: the rank cannot take the type), and per type the ranks by each,
        largest first (ties: lower rank first), into ``order_above`` / ``order_whole``."""
        pp, v, nt = self.pp, self.v, self.nt
        above, whole = self.rank_room_above, self.rank_room_whole
        for i in range(pp * nt):
            above[i] = -1
            whole[i] = -1
        for i in range(n_left):
            t = self.slope_type[i]
            self.n_above[t] = 0
            self.n_whole[t] = 0
            for r in range(k, self.ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    s_lb = 0
                    for c in range(v):
                        s_lb += lb[c * pp + r]
                    whole[r * nt + t] = s
                    j = self.n_whole[t]       # stable insertion, largest first
                    while j > 0 and whole[self.order_whole[t * pp + j - 1] * nt + t] < s:
                        self.order_whole[t * pp + j] = self.order_whole[t * pp + j - 1]
                        j -= 1
                    self.order_whole[t * pp + j] = r
                    self.n_whole[t] += 1
                    y = s - s_lb
                    above[r * nt + t] = y
                    j = self.n_above[t]
                    while j > 0 and above[self.order_above[t * pp + j - 1] * nt + t] < y:
                        self.order_above[t * pp + j] = self.order_above[t * pp + j - 1]
                        j -= 1
                    self.order_above[t * pp + j] = r
                    self.n_above[t] += 1
        for r in range(k, self.ub):
            for i2 in range(n_left):
                t2 = self.slope_type[i2]
                for i in range(n_left):
                    t = self.slope_type[i]
                    n = self.remaining[t] - (1 if t == t2 else 0)
                    self.room_above[(r * nt + t2) * nt + t] = self._top_sum(self.order_above, self.n_above,
                                                                            above, t, r, n)
                    self.room_whole[(r * nt + t2) * nt + t] = self._top_sum(self.order_whole, self.n_whole,
                                                                            whole, t, r, n)

    def _top_sum(self, order, count, vals, t: int, r: int, n: int) -> int:
        """The ``n`` largest ``vals[j * nt + t]`` over ranks ``j != r`` (``order``: per type the ranks by
        ``vals``, largest first, ``count`` of them); -1 when fewer than ``n`` ranks can host ``t`` and
        the counts are exact."""
        total = 0
        got = 0
        for y in range(count[t]):
            if got == n:
                break
            j = order[t * self.pp + y]
            if j != r:
                total += vals[j * self.nt + t]
                got += 1
        if got < n and self.exact_counts:
            return -1
        return total

    def _placement_cost(self, e: int, r: int, t2: int, n_left: int, slope1, slope2, slope_rank, room) -> float:
        """Cheapest cost of ``e`` more layers on the undecided ranks other than ``r`` (which takes
        ``t2``): the cheapest types first (per type its smallest slope ``slope1``, or ``slope2`` when
        ``slope_rank`` is ``r``), each up to what its ranks can hold (``room``, as ``room_above``); inf
        if they cannot hold them."""
        nt = self.nt
        n = 0
        for i in range(n_left):
            t = self.slope_type[i]
            if room[(r * nt + t2) * nt + t] < 0:
                return INF
            mu = slope2[t] if slope_rank[t] == r else slope1[t]
            j = n                  # insertion by (slope, type)
            while j > 0 and (self.phi_slope[j - 1] > mu or (self.phi_slope[j - 1] == mu and self.phi_type[j - 1] > t)):
                self.phi_slope[j] = self.phi_slope[j - 1]
                self.phi_type[j] = self.phi_type[j - 1]
                j -= 1
            self.phi_slope[j] = mu
            self.phi_type[j] = t
            n += 1
        cost = 0.0
        for i in range(n):
            if e <= 0:
                break
            kk = room[(r * nt + t2) * nt + self.phi_type[i]]
            if kk == 0:
                continue
            take = e if e < kk else kk
            cost += take * self.phi_slope[i]
            e -= take
        if e <= 0:
            return cost
        return INF

    def _rounding_losses(self, k: int, lb, room_of, gam, n_left: int, rank_lb, lb_even, lb_start) -> float:
        """Per undecided rank ``r`` (into ``gam[r]``, max over its types): how far its cost along the
        current path of ``d`` layers above its lower bounds ``lb`` can fall below ``beta d`` (``beta``:
        the mean of its chunk slopes, as :meth:`_path_prices` stored them), over the counts
        ``room_of[r * nt + t]`` it can hold (-1: not that type); returns their sum. ``rank_lb``,
        ``lb_even``, ``lb_start``: per rank its lower-bound layers, whether they are spread like a
        rank's layers, and their count mod V. docs/SEARCH.md ("Mass and capacity reasoning") says why."""
        pp, v, nt = self.pp, self.v, self.nt
        xs = self.chunk_slope
        gsum = 0.0
        for r in range(k, self.ub):
            s_lb = rank_lb[r]
            gmax = 0.0
            for i in range(n_left):
                t = self.slope_type[i]
                if room_of[r * nt + t] < 0:
                    continue
                beta = 0.0
                for c in range(v):
                    xs[c] = self.stage_slope[(c * pp + r) * nt + i]
                    beta += xs[c]
                beta = beta / v
                g = 0.0
                if lb_even[r]:
                    top = v - 1 if v - 1 < room_of[r * nt + t] else room_of[r * nt + t]
                    acc = 0.0
                    x = lb_start[r]
                    for j in range(1, top + 1):
                        acc += xs[x]          # xs[(s_lb + j - 1) % v]
                        x += 1
                        if x == v:
                            x = 0
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

    # --- the bound paths (docs/SEARCH.md, "Mass and capacity reasoning") -----------------------

    def _path_caps(self, k: int, left: int, lb, cap, capt) -> int:
        """Tighten caps with the bound paths; -1: some path proves the node cannot beat ``tau``.

        Per path owned by an undecided rank: price its stages (:meth:`_path_prices`), cut the node if
        even the cheapest placement of the remaining layers reaches ``tau`` (:meth:`_path_cuts`), else
        cap the owner's layers per type (:meth:`_owner_caps`). Returns 1 when a cap changed, else 0.
        """
        pp, v = self.pp, self.v
        changed = 0
        limit = self.tau * (1.0 + PATH_SLACK)
        self._fill(lb, capt)
        n_left = self._type_slopes()
        extra = left
        for r in range(k, self.ub):
            for c in range(v):
                extra -= lb[c * pp + r]
        self._type_room(k, lb, cap, capt, n_left)
        for r in range(k, self.ub):            # per rank, for _rounding_losses (the same for every path)
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            self.rank_lb[r] = s_lb
            self.lb_start[r] = s_lb % v
            self.lb_even[r] = 1
            for c in range(v):
                if chunk_layers(s_lb, c, v) != lb[c * pp + r]:
                    self.lb_even[r] = 0
        for q in range(self.n_paths):
            if self.path_owner[q] < k or self.path_owner[q] >= self.ub:
                continue        # the owner is decided: no caps (below); the DAG bound covers its cut
            self._path_prices(q, k, lb, n_left)
            if self._path_cuts(k, extra, limit, lb, cap):
                return -1
            if self.rank_min2 == INF:
                continue
            got = self._owner_caps(q, k, extra, limit, lb, cap, capt, n_left)
            if got < 0:
                return -1
            if got:
                changed = 1
        return changed

    def _path_prices(self, q: int, k: int, lb, n_left: int) -> None:
        """Path ``q`` at the node, per-layer slopes along it (into the search's scratch):
        ``base_cost``: the path at the lower bounds; per undecided stage its slope at the cheapest
        remaining type (``alpha``) and per type (``stage_slope[vs * nt + i]``, ``i``: the slope index);
        ``min_slope`` / ``max_slope``: the cheapest and dearest of ``alpha``; ``rank_min1`` /
        ``rank_min2``: the two smallest per-rank minima of it, ``rank_min_arg`` the rank of the first;
        per type ``type_min1`` / ``type_min2`` / ``type_min_rank``: the same over each rank's cheapest
        chunk, and ``type_mean1`` / ``type_mean2`` / ``type_mean_rank`` over each rank's mean chunk
        slope; ``rank_lb_cost``: per rank, its lower-bound layers along the path as ``base_cost``
        priced them. Resets the placement bounds' lazy sums (-1: not yet computed)."""
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        p = self.params
        cf = q * nv
        cr = q * pp
        base = 0.0
        for e in range(self.term_ptr[q], self.term_ptr[q + 1]):
            base += self.term_coef[e] * p[self.term_idx[e]]
        a1 = INF
        amax = 0.0
        omax = 0.0                          # the dearest slopes of the ranks other than the path's owner
        smax = 0.0
        owner = self.path_owner[q]
        lift = 0.0
        b1 = INF
        b2 = INF
        argr = -1
        for i in range(n_left):
            t = self.slope_type[i]
            self.type_min1[t] = INF
            self.type_min2[t] = INF
            self.type_min_rank[t] = -1
            self.type_mean1[t] = INF
            self.type_mean2[t] = INF
            self.type_mean_rank[t] = -1
        for r in range(k, self.ub):
            rmin = INF
            self.rank_lb_cost[r] = 0.0
            for i in range(n_left):
                t = self.slope_type[i]
                self.rank_type_min[t] = INF
                self.rank_type_sum[t] = 0.0
            for c in range(v):
                vs = c * pp + r
                kf = self.coef_f[cf + vs]
                kb = self.coef_b[cf + vs]
                ka = self.coef_ar[cr + r]
                if kf == 0 and kb == 0 and ka == 0:
                    # off the path: every slope is 0 (what the loop below computes, faster)
                    self.alpha[vs] = 0.0
                    a1 = 0.0
                    rmin = 0.0
                    for i in range(n_left):
                        self.rank_type_min[self.slope_type[i]] = 0.0
                        self.stage_slope[vs * nt + i] = 0.0
                    continue
                a = INF
                for i in range(n_left):
                    x = kf * self.slope_forward[i] + kb * self.slope_backward[i] + ka * self.slope_allreduce[i]
                    self.stage_slope[vs * nt + i] = x
                    if x > smax and r != owner:
                        smax = x
                    if x < a:
                        a = x
                    t = self.slope_type[i]
                    if x < self.rank_type_min[t]:
                        self.rank_type_min[t] = x
                    self.rank_type_sum[t] += x
                self.alpha[vs] = a
                self.rank_lb_cost[r] += lb[vs] * a
                # the stage's lb layers cost at least its cheapest type's slope, not the per-column
                # minimum the DAG fill used (over the types that fit the rank)
                lift += lb[vs] * (a - (kf * self.fill_forward[r] + kb * self.fill_backward[r]
                                       + ka * self.fill_allreduce[r]))
                if a < a1:
                    a1 = a
                if a > amax:
                    amax = a
                if a > omax and r != owner:
                    omax = a
                if a < rmin:
                    rmin = a
            if rmin < b1:
                b2 = b1
                b1 = rmin
                argr = r
            elif rmin < b2:
                b2 = rmin
            for i in range(n_left):
                t = self.slope_type[i]
                y = self.rank_type_min[t]
                if y < self.type_min1[t]:
                    self.type_min2[t] = self.type_min1[t]
                    self.type_min1[t] = y
                    self.type_min_rank[t] = r
                elif y < self.type_min2[t]:
                    self.type_min2[t] = y
                y = self.rank_type_sum[t] / v
                if y < self.type_mean1[t]:
                    self.type_mean2[t] = self.type_mean1[t]
                    self.type_mean1[t] = y
                    self.type_mean_rank[t] = r
                elif y < self.type_mean2[t]:
                    self.type_mean2[t] = y
        self.base_cost = base + lift
        self.min_slope = a1
        self.max_slope = amax
        self.others_max_slope = omax
        self.others_max_stage = smax
        self.rank_min1 = b1
        self.rank_min2 = b2
        self.rank_min_arg = argr
        self.loss_sum = -1.0
        self.loss_sum_whole = -1.0
        self.others_lb_cost = -1.0
        self.others_lb_layers = 0
        self.knap_sorted = 0
        self.merged_sorted = 0

    def _path_cuts(self, k: int, extra: int, limit: float, lb, cap) -> bool:
        """Whether the path's cost at the lower bounds plus the cheapest placement of the ``extra``
        layers above them reaches the limit (the node is then cut)."""
        base = self.base_cost
        if base + extra * self.min_slope >= limit:
            return True
        if extra > 0 and base + extra * self.max_slope >= limit:
            if base + self._knapsack(k, self.ub, extra, lb, cap) >= limit:
                return True
        return False

    def _owner_caps(self, q: int, k: int, extra: int, limit: float, lb, cap, capt, n_left: int) -> int:
        """Caps per type of the owner rank ``r`` of path ``q`` (into ``capt``), then of its stages
        (into ``cap``): -1 when no type can take the rank, 1 when a stage cap fell, else 0.

        The rank's ``d`` layers above its lower bounds cost, along the path, exactly their chunk-by-
        chunk slopes on the type; the other ``extra - d`` layers at least the cheapest slope of another
        rank's stage (closed form, an upper start for ``d``), and at least their cheapest placement by
        type (:meth:`_others_fit`). The cap is the largest ``d`` whose cost stays below the limit.
        """
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        cf = q * nv
        cr = q * pp
        base = self.base_cost
        r = self.path_owner[q]
        m = self.rank_min2 if r == self.rank_min_arg else self.rank_min1
        numer = limit - base - m * extra
        ka = self.coef_ar[cr + r]
        s_lb = 0
        for c in range(v):
            s_lb += lb[c * pp + r]
        for i in range(n_left):
            t = self.slope_type[i]
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
                x = self.coef_f[cf + vs] * self.slope_forward[i] + self.coef_b[cf + vs] * self.slope_backward[i] \
                    + ka * self.slope_allreduce[i]
                # on type t the lb layers cost x each, alpha[vs] of it is in base
                extra_t += lb[vs] * (x - self.alpha[vs])
                if x < xmin:
                    xmin = x
            extra_t += self._owner_link_gain(q, r, t)
            d = ct_sum - s_lb
            if d > extra:
                d = extra
            slope = xmin - m
            if slope > 0.0:
                room = (numer - extra_t) / slope
                if room <= 0.0:
                    d = -1
                else:
                    while d >= room:     # the largest count below room
                        d -= 1
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
                    own += n * (self.coef_f[cf + vs] * self.slope_forward[i]
                                + self.coef_b[cf + vs] * self.slope_backward[i] + ka * self.slope_allreduce[i])
                # one-chunk trees also place the others' layers stage by stage (their owner paths weigh
                # upstream and downstream ranks differently); on interleaved trees, whose nodes take
                # the relaxation bound, they cut too few nodes to pay for themselves; neither is computed
                # where even its dearest slope leaves the rank room (frontier-scale trees, most ranks)
                if own < INF and self._others_fit(k, r, t, extra - d, own, rhs, n_left, lb) \
                        and (v > 1 or own + (extra - d) * self.others_max_slope < rhs
                             or own + self._others_knapsack(k, r, extra - d, lb, cap) < rhs) \
                        and (v > 1 or own + (self.others_lb_layers + extra - d) * self.others_max_stage
                             - self.others_lb_cost < rhs
                             or self._by_stage_fits(k, r, t, self.others_lb_layers + extra - d, own, rhs, lb,
                                                    capt, n_left)):
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
        return self._stage_caps(r, lb, cap, capt, n_left)

    def _others_fit(self, k: int, r: int, t: int, e: int, own: float, rhs: float, n_left: int, lb) -> bool:
        """Whether ``own`` plus each lower bound on the cost, along the current path, of the ``e``
        layers above their lower bounds that the undecided ranks other than ``r`` (on type ``t``) take
        stays below ``rhs``: the four placement bounds of docs/SEARCH.md ("Mass and capacity
        reasoning"; "The placement bounds a pair at a time"), a
        pair at a time; (iii) and (iv) with whole layer counts (``room_whole``), (i) and (ii) above the
        lower bounds (``room_above``). A pair's mean-slope bound without its rounding loss is at least
        both bounds of the pair: when it fits with ``FIT_SLACK`` to spare, so does the pair, and the
        losses (:meth:`_rounding_losses`) are not computed. Either way the answer is the same."""
        pp, v = self.pp, self.v
        if self.others_lb_cost < 0.0:
            # all the other ranks' layers placed by type, their lower bounds too (base priced those
            # at each stage's cheapest type: take them out)
            self.others_lb_cost = 0.0
            self.others_lb_layers = 0
            for j in range(k, self.ub):
                if j != r:
                    self.others_lb_cost += self.rank_lb_cost[j]
                    for c in range(v):
                        self.others_lb_layers += lb[c * pp + j]
        lbo = self.others_lb_cost
        # (iv) and (iii)
        fit = True
        pn = INF
        if v > 1:
            pn = self._placement_cost(self.others_lb_layers + e, r, t, n_left, self.type_mean1, self.type_mean2,
                           self.type_mean_rank, self.room_whole)
        if v == 1 or not own + (pn - lbo) < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if self.loss_sum_whole < 0.0:
                    self.loss_sum_whole = self._rounding_losses(k, self.zero_lb, self.rank_room_whole, self.loss_whole,
                                                       n_left, self.zero_ranks, self.one_ranks, self.zero_ranks)
                fit = own + (pn - (self.loss_sum_whole - self.loss_whole[r]) - lbo) < rhs
            fit = fit and own + (self._placement_cost(self.others_lb_layers + e, r, t, n_left, self.type_min1,
                                                      self.type_min2, self.type_min_rank, self.room_whole)
                                 - lbo) < rhs
        if not fit:
            return False
        # (ii) and (i)
        pn = INF
        if v > 1:
            pn = self._placement_cost(e, r, t, n_left, self.type_mean1, self.type_mean2, self.type_mean_rank,
                                      self.room_above)
        if v == 1 or not own + pn < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if self.loss_sum < 0.0:
                    self.loss_sum = self._rounding_losses(k, lb, self.rank_room_above, self.loss_above, n_left,
                                                 self.rank_lb, self.lb_even, self.lb_start)
                fit = own + (pn - (self.loss_sum - self.loss_above[r])) < rhs
            fit = fit and own + self._placement_cost(e, r, t, n_left, self.type_min1, self.type_min2,
                                                     self.type_min_rank, self.room_above) < rhs
        return fit

    def _stage_caps(self, r: int, lb, cap, capt, n_left: int) -> int:
        """Each stage of rank ``r``: its cap is the largest over the types that can still take the
        whole rank. -1 when none can, 1 when a cap fell, else 0."""
        pp, v, nt = self.pp, self.v, self.nt
        changed = 0
        for c in range(v):
            vs = c * pp + r
            top = -1
            for i in range(n_left):
                t = self.slope_type[i]
                if self._fits(r, t, lb, capt) and capt[vs * nt + t] > top:
                    top = capt[vs * nt + t]
            if top < lb[vs]:
                return -1
            if top < cap[vs]:
                cap[vs] = top
                changed = 1
        return changed

    # --- the gain along the DAG bound's longest path --------------------------------------------

    def _count_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float) -> float:
        """After a DAG bound run: how much more, along one of its longest paths, every completion
        below tau costs than the fill priced the undecided ranks ``[a, b)`` (docs/SEARCH.md, "gain along
        the bound's longest path"): the larger of two lower bounds, (1) apart (a Lagrangian
        bound of the type assignment, multipliers the per-type mean costs, plus the ``extra`` layers
        above the lower bounds at each stage's least slope) and (2) joint (:meth:`_joint_gain`), plus the
        type boundaries among the undecided ranks (:meth:`_boundary_gain`). Once a bound reaches ``need``
        (what cuts the child) it is returned as it stands."""
        pp, v, nt, nv = self.pp, self.v, self.nt, self.nv
        cnt = self.path_counts
        tm = self.type_mins
        self.kernel.critical_into(self.params, cnt)
        self.gain_path = True
        for t in range(nt):
            self.type_mean_gain[t] = 0.0
            self.type_gain_ranks[t] = 0
        for r in range(a, b):
            na = cnt[1 + 2 * nv + pp + r]
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            for t in range(nt):
                self.lb_gain[r * nt + t] = INF
                if self.remaining[t] <= 0:
                    continue
                if not self._fits(r, t, lb, capt):
                    continue
                o = t * N_TYPE_MINS
                x = na * s_lb * (tm[o + MIN_ALLREDUCE] - self.fill_allreduce[r])
                for c in range(v):
                    vs = c * pp + r
                    nf = cnt[1 + r * v + c]
                    nb = cnt[1 + nv + r * v + c]
                    x += lb[vs] * (nf * (tm[o + MIN_FORWARD] - self.fill_forward[r])
                                   + nb * (tm[o + MIN_BACKWARD] - self.fill_backward[r]))
                x += self._send_gain(r, t, cnt)
                self.lb_gain[r * nt + t] = x
                self.type_mean_gain[t] += x
                self.type_gain_ranks[t] += 1
            # the extra layers: each costs, along the path, at least its stage's slope on the
            # cheapest type that fits the rank
            for c in range(v):
                vs = c * pp + r
                y = INF
                for t in range(nt):
                    if self.lb_gain[r * nt + t] == INF:
                        continue
                    o = t * N_TYPE_MINS
                    x = (cnt[1 + r * v + c] * tm[o + MIN_FORWARD] + cnt[1 + nv + r * v + c] * tm[o + MIN_BACKWARD]
                         + na * tm[o + MIN_ALLREDUCE])
                    self.gain_slope[vs * nt + t] = x
                    if x < y:
                        y = x
                self.alpha[vs] = y if y < INF else 0.0
        ll = self._knapsack(a, b, extra, lb, cap)   # the extra layers, cheapest first
        for t in range(nt):
            if self.type_gain_ranks[t] > 0:
                self.type_mean_gain[t] /= self.type_gain_ranks[t]
        for r in range(a, b):
            m1 = INF
            for t in range(nt):
                x = self.lb_gain[r * nt + t] - self.type_mean_gain[t]
                if x < m1:
                    m1 = x
            ll += m1
        for t in range(nt):
            if self.remaining[t] > 0:
                ll += self.type_mean_gain[t] * self.remaining[t]
        if ll < need:
            x = self._joint_gain(a, b, lb, cap, capt, extra, need)
            if x > ll:
                ll = x
        if ll < 0.0:
            ll = 0.0                     # (the extra part alone is >= 0)
        if ll < need:
            ll += self._boundary_gain(a, b, cnt)
        return ll

    def _boundary_gain(self, a: int, b: int, cnt) -> float:
        """One-chunk trees, exact counts: what the links between two undecided ranks of ``[a, b)`` add along
        the path of ``cnt`` (apart from the ranks' own costs and their links to decided ranks, which the
        gain prices): the ``m + 1`` remaining types hold these ranks, so at least ``m`` of those links join
        two types, each at least the cheapest cross-type send of a remaining type; the ``m`` links the
        path weighs least carry them."""
        nv = self.nv
        p = self.params
        if self.v > 1 or not self.exact_counts:
            return 0.0
        m = -1
        cross = INF
        for t in range(self.nt):
            if self.remaining[t] > 0:
                m += 1
                if self.send_cross_ms[t] < cross:
                    cross = self.send_cross_ms[t]
        if m <= 0 or b - a < 2:
            return 0.0
        for i in range(m):
            self.boundary_least[i] = INF
        for r in range(a, b - 1):
            e = 1 + 2 * nv + r
            x = cnt[e] * (cross - p[e]) if cross > p[e] else 0.0
            i = m - 1                   # insertion into the m least, ascending
            if x >= self.boundary_least[i]:
                continue
            while i > 0 and self.boundary_least[i - 1] > x:
                self.boundary_least[i] = self.boundary_least[i - 1]
                i -= 1
            self.boundary_least[i] = x
        g = 0.0
        for i in range(m):
            g += self.boundary_least[i]
        return g

    def _joint_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float) -> float:
        """The gain's second bound (docs/SEARCH.md, "the joint gain"): per rank and type its
        lower-bound layers' gain ``lb_gain`` plus the room above them at ``gain_slope``, the layer sum
        relaxed with one multiplier ``mu`` and the type assignment solved exactly; the bound is concave
        in ``mu`` with its maximum at a slope: a bisection over the sorted distinct slopes (stopped once
        the bound reaches ``need``). Infinite when no assignment exists."""
        pp, v, nt = self.pp, self.v, self.nt
        nmu = 0
        for r in range(a, b):
            for t in range(nt):
                if self.lb_gain[r * nt + t] == INF:
                    continue
                for c in range(v):
                    vs = c * pp + r
                    ct = capt[vs * nt + t]
                    if cap[vs] < ct:
                        ct = cap[vs]
                    self.gain_room[vs * nt + t] = ct - lb[vs]
                    if ct > lb[vs]:
                        # insert into the sorted distinct list
                        x = self.gain_slope[vs * nt + t]
                        j = nmu
                        while j > 0 and self.gain_mu[j - 1] > x:
                            j -= 1
                        if j > 0 and self.gain_mu[j - 1] == x:
                            continue
                        lo = nmu
                        while lo > j:
                            self.gain_mu[lo] = self.gain_mu[lo - 1]
                            lo -= 1
                        self.gain_mu[j] = x
                        nmu += 1
        if nmu == 0:
            return self._joint_at(a, b, 0.0, extra)
        best = -INF
        lo = 0
        hi = nmu - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            x = self._joint_at(a, b, self.gain_mu[mid], extra)
            if x > best:
                best = x
            if best >= need:
                break
            if self.gain_slack > 0:
                lo = mid + 1
            else:
                hi = mid - 1
        return best

    def _joint_at(self, a: int, b: int, mu: float, extra: int) -> float:
        """:meth:`_joint_gain` at one multiplier ``mu``; sets ``gain_slack``: ``extra`` less the room
        the best assignment fills at ``mu`` (> 0: the bound rises with ``mu``)."""
        pp, v, nt = self.pp, self.v, self.nt
        n = b - a
        filled = 0
        for t in range(nt):
            for i in range(n):
                self.assign_value[t * pp + i] = NEG_F
        for r in range(a, b):
            for t in range(nt):
                if self.lb_gain[r * nt + t] == INF:
                    continue
                x = self.lb_gain[r * nt + t]
                for c in range(v):
                    vs = c * pp + r
                    if self.gain_slope[vs * nt + t] < mu:
                        x += (self.gain_slope[vs * nt + t] - mu) * self.gain_room[vs * nt + t]
                self.assign_value[t * pp + r - a] = -x
        got = self._assign(n)
        if got == -INF:
            self.gain_slack = 0
            return INF
        for i in range(n):
            t = self.assign_owner[i]
            for c in range(v):
                vs = c * pp + a + i
                if self.gain_slope[vs * nt + t] <= mu:
                    filled += self.gain_room[vs * nt + t]
        self.gain_slack = extra - filled
        return mu * extra - got

    # --- capacities -----------------------------------------------------------------------------

    def _lb_sum(self, a: int, b: int, lb) -> int:
        """Layers of the ranks ``[a, b)`` at their lower bounds."""
        s = 0
        for r in range(a, b):
            for c in range(self.v):
                s += lb[c * self.pp + r]
        return s

    def _type_mass(self, k: int, left: int, lb, cap, capt) -> bool:
        """The undecided ranks, each on one remaining type, must be able to hold ``left`` layers."""
        return self._type_capacity(k, self.ub, lb, cap, capt) >= left

    def _rank_capacity(self, r: int, t: int, lb, cap, capt) -> int:
        """Most layers rank ``r`` holds on type ``t`` (its chunks' caps); -1 when a chunk's cap on ``t``
        is below its lower bound."""
        s = 0
        for c in range(self.v):
            vs = c * self.pp + r
            ct = capt[vs * self.nt + t]
            if ct > cap[vs]:
                ct = cap[vs]
            if ct < lb[vs]:
                return -1
            s += ct
        return s

    def _type_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """Most layers ranks ``k..ub-1`` can hold, each on one remaining type: with exact counts the
        best assignment (:meth:`_assign_capacity`; -1 when none exists), else per type its ``n``
        largest rank capacities."""
        if self.exact_counts and k < ub:
            return self._assign_capacity(k, ub, lb, cap, capt)
        total = 0
        for t in range(self.nt):
            n = self.remaining[t]
            if n <= 0:
                continue
            nvals = 0
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    j = nvals              # insertion into a descending list
                    while j > 0 and self.rank_values[j - 1] < s:
                        self.rank_values[j] = self.rank_values[j - 1]
                        j -= 1
                    self.rank_values[j] = s
                    nvals += 1
            for y in range(n if n < nvals else nvals):
                total += self.rank_values[y]
        return total

    def _assign_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """With exact counts: the most layers ranks ``k..ub-1`` hold when each takes one remaining type
        and type ``t`` goes to exactly its ``remaining[t]`` of them (the best assignment, a transportation
        problem solved exactly by :func:`.assignment.assign_into`); -1 when no assignment exists. At most
        the per-type sum of :meth:`_type_capacity`, where every type may count the same roomy ranks."""
        pp = self.pp
        n = ub - k
        for t in range(self.nt):
            for r in range(n):
                s = self._rank_capacity(k + r, t, lb, cap, capt) if self.remaining[t] > 0 else -1
                self.assign_value[t * pp + r] = s if s >= 0 else NEG_F
                self.assign_capacity[t * pp + r] = s
        if self._assign(n) == -INF:
            return -1
        total = 0           # the assignment's total, in integers
        for r in range(n):
            total += self.assign_capacity[self.assign_owner[r] * pp + r]
        return total

    def _assign(self, n: int) -> float:
        """The best assignment of ``assign_value`` (type ``t`` at position ``r``: ``[t * pp + r]``) to ``n``
        positions, type ``t`` at most ``remaining[t]`` times: :func:`.assignment.assign_into` on the
        search's scratch; its types in ``assign_owner``."""
        return assign_into(n, self.nt, self.pp, self.assign_value, self.remaining, self.assign_owner,
                           self.assign_used, self.assign_gain, self.assign_via_type, self.assign_via_rank)

    def _others_knapsack(self, k: int, r: int, e: int, lb, cap) -> float:
        """Cheapest cost along the current path of ``e`` more layers on the undecided ranks other than
        ``r``: each stage at its own slope ``alpha`` and within its room ``cap - lb`` (fractional,
        cheapest first). The placement bounds price a type's layers at its cheapest rank's slope; where
        one rank weighs once on the path and the others twice (a 1F1B steady state's upstream and
        downstream ranks), this one sees that most layers go to the dearer ranks."""
        pp = self.pp
        if not self.knap_sorted:
            self.knap_n = self._stages_by_slope(k, self.ub)
            self.knap_sorted = 1
        cost = 0.0
        for i in range(self.knap_n):
            if e <= 0:
                break
            x = self.stage_order[i]
            if x % pp == r:
                continue
            take = cap[x] - lb[x]
            if take > e:
                take = e
            cost += take * self.alpha[x]
            e -= take
        return cost

    def _by_stage_fits(self, k: int, r: int, t2: int, e: int, own: float, rhs: float, lb, capt,
                       n_left: int) -> bool:
        """Whether ``own`` plus :meth:`_others_by_stage` stays below ``rhs``; a structure search keeps
        computing it after ``STAGE_TRIAL`` calls only while it rejects at least one count in
        ``STAGE_MIN_CUTS`` (its sort costs more than the bounds it sits beside: on trees where it never
        rejects a count, such as frontier-scale ones, it only costs)."""
        if self.stage_calls >= STAGE_TRIAL and self.stage_cuts * STAGE_MIN_CUTS < self.stage_calls:
            return True
        self.stage_calls += 1
        if own + self._others_by_stage(k, r, t2, e, lb, capt, n_left) < rhs:
            return True
        self.stage_cuts += 1
        return False

    def _others_by_stage(self, k: int, r: int, t2: int, e: int, lb, capt, n_left: int) -> float:
        """Cheapest cost along the current path of the ``e`` layers (lower bounds included) of the
        undecided ranks other than ``r`` (which takes ``t2``), less their lower bounds as the path's
        base priced them: each layer on a stage and a type at that stage's slope on that type, within
        the type's cap on the stage (none where it cannot take the rank's lower bound) and what the
        type's ranks can hold (``room_whole``); inf if they cannot hold them. The placement bounds
        price a type's layers at its cheapest rank's slope and the knapsack each stage at its cheapest
        type's; here a type's layers pay their own slope on the ranks that can take them (a stage may
        take several types: a relaxation, so a bound)."""
        pp, v, nt = self.pp, self.v, self.nt
        if not self.merged_sorted:
            n = 0
            for j in range(k, self.ub):
                for c in range(v):
                    vs = c * pp + j
                    for i in range(n_left):
                        x = self.stage_slope[vs * nt + i]
                        u = vs * nt + i
                        m = n
                        while m > 0 and self.stage_slope[self.merged_order[m - 1]] > x:
                            self.merged_order[m] = self.merged_order[m - 1]
                            m -= 1
                        self.merged_order[m] = u
                        n += 1
            self.merged_n = n
            self.merged_sorted = 1
        for i in range(n_left):
            t = self.slope_type[i]
            self.merged_left[t] = self.room_whole[(r * nt + t2) * nt + t]
            if self.merged_left[t] < 0:
                return INF
        cost = 0.0
        for m in range(self.merged_n):
            if e <= 0:
                break
            u = self.merged_order[m]
            vs = u // nt
            if vs % pp == r:
                continue
            t = self.slope_type[u % nt]
            take = capt[vs * nt + t]
            if take < lb[vs]:
                continue                    # type t cannot take this rank
            if take > self.merged_left[t]:
                take = self.merged_left[t]
            if take > e:
                take = e
            if take <= 0:
                continue
            cost += take * self.stage_slope[u]
            self.merged_left[t] -= take
            e -= take
        if e > 0:
            return INF
        return cost - self.others_lb_cost

    def _stages_by_slope(self, k: int, ub: int) -> int:
        """The stages of ranks ``k..ub-1`` into ``stage_order`` by their slope ``alpha``, cheapest first
        (stable: by rank, then chunk); how many."""
        pp = self.pp
        n = 0
        for r in range(k, ub):
            for c in range(self.v):
                vs = c * pp + r
                j = n
                while j > 0 and self.alpha[self.stage_order[j - 1]] > self.alpha[vs]:
                    self.stage_order[j] = self.stage_order[j - 1]
                    j -= 1
                self.stage_order[j] = vs
                n += 1
        return n

    def _knapsack(self, k: int, ub: int, extra: int, lb, cap) -> float:
        """Cheapest cost of ``extra`` more layers over the stages of ranks ``k..ub-1`` at the slopes
        ``alpha`` (fractional: cheapest first, a stable order by slope over rank, then chunk)."""
        cost = 0.0
        n = self._stages_by_slope(k, ub)
        self.knap_sorted = 0                # this call's order now: the owner caps' (lazy) one is sorted again
        for j in range(n):
            x = self.stage_order[j]
            take = cap[x] - lb[x]
            if take > extra:
                take = extra
            cost += take * self.alpha[x]
            extra -= take
            if extra <= 0:
                break
        return cost


__all__ = ["INF", "StructureBounds", "chunk_layers", "float_buffer", "float_copy", "int_buffer", "int_copy"]
