"""The relaxation bound of a node: the DAG over fractional completions, by row and column generation.

docs/SEARCH.md ("The relaxation bound") states it and says why it is valid. In short: at a node, every
completion gives each undecided rank one remaining type and a layer count within the node's caps, the
layers summing to ``left``; its time is the DAG's longest path, at least the cost of any path ``P`` of the
DAG, an affine function of the completion's parameters. For any weights ``lambda`` over a set of paths
(``lambda >= 0``, summing to 1) and any multiplier ``mu`` of the layer sum,

    T >= sum_P lambda_P cost_P  >=  const(lambda) + mu * left + min over assignments of
                                     sum_r min_l (cost_lambda(r, t_r, l) - mu * l)

(the inner minimum is an assignment problem, solved exactly: :func:`.assignment.assign_into`). That is
the bound; any ``lambda``, ``mu`` give a valid one. They are found by generating both sides of the
linear program ``min T, T >= cost_P(w) for P in paths, w in the hull of the assignments' points with
their layers summing to left``: its dual gives ``lambda`` and ``mu``; the assignment at them gives a new
point (column); the DAG at the program's point gives a new path (row: its critical path). The loop
stops once the bound reaches what cuts the node, or the DAG at the program's point is below it (no
bound of this kind can reach it then), or nothing new comes.

One source for both backends (Cython's pure-Python mode): typed by ``cython_core/relaxation_bound.pxd``,
compiled as ``poseidon_plugin._core.relaxation_bound`` (the base class of the compiled ``SplitSearch``);
uncompiled it runs as it is. Every buffer is set by ``SplitSearch.__init__``.
"""

from __future__ import annotations

import math

from poseidon_plugin.search.assignment import NEG_F
from poseidon_plugin.search.constants import (LP_BIG_MU, LP_EPS, LP_MAX, LP_PIVOTS, MIN_ALLREDUCE,
                                              MIN_BACKWARD, MIN_EMBEDDING_ALLREDUCE, MIN_EMBEDDING_BACKWARD,
                                              MIN_EMBEDDING_FORWARD, MIN_FORWARD, MIN_HEAD_ALLREDUCE,
                                              MIN_HEAD_BACKWARD, MIN_HEAD_FORWARD, N_TYPE_MINS)

from .structure_bounds import StructureBounds, chunk_layers

INF = math.inf


class RelaxationBound(StructureBounds):
    """The relaxation bound (:meth:`_relaxation_bound`) on top of :class:`~.structure_bounds.StructureBounds`."""

    # --- the bound ------------------------------------------------------------------------------

    def _relaxation_bound(self, a: int, b: int, left: int, lb, cap, capt, need: float) -> float:
        """A lower bound on every completion (below tau) of the node whose undecided ranks are ``[a, b)``
        with ``left`` layers, ``lb``/``cap``/``capt`` its propagated bounds; it stops once the bound
        reaches ``need``. ``-inf`` where it finds none (never a cut)."""
        nt, npar = self.nt, self.n_par
        best = -INF
        self._fill(lb, capt)                  # decided ranks exact, sends at their lower bounds
        for i in range(npar):
            self.lp_base[i] = self.params[i]
        for i in range(npar):
            self.lp_free[i] = 0
        for r in range(a, b):
            for c in range(self.v):
                self.lp_free[1 + r * self.v + c] = 1
                self.lp_free[1 + self.nv + r * self.v + c] = 1
            self.lp_free[1 + 2 * self.nv + self.pp + r] = 1
            for t in range(nt):
                self._lp_range(r, t, lb, cap, capt)
        scale = self.tau if self.tau > 0.0 else 1.0
        # the first path: the critical path of the DAG at the lower bounds (the node's own DAG bound)
        self._lp_add_path(0)
        n_paths = 1
        # the first columns: fewest and most layers (the program is feasible: the propagation kept
        # the node, so the lower bounds fit in left and the assignment capacity reaches it)
        self.lp_lam[0] = 1.0
        self._lp_weights(1)
        n_cols = 0
        for sign in range(2):
            mu = -LP_BIG_MU if sign == 0 else LP_BIG_MU
            if self._lp_oracle(a, b, mu) == INF:
                return -INF
            self._lp_add_column(n_cols, a, b, n_paths, scale)
            n_cols += 1
        for it in range(LP_MAX):
            if not self._lp_master(n_paths, n_cols, left):
                return best
            # the dual: lambda over the paths, mu of the layer sum; the bound at them
            total = 0.0
            for q in range(n_paths):
                x = -self.lp_dual[q]
                if x < 0.0:
                    x = 0.0
                self.lp_lam[q] = x
                total += x
            if total <= 0.0:
                return best
            for q in range(n_paths):
                self.lp_lam[q] /= total
            mu = self.lp_dual[n_paths + 1] * scale
            self._lp_weights(n_paths)
            got = self._lp_oracle(a, b, mu)
            if got == INF:
                return best
            value = self.lp_const + mu * left + got
            if value > best:
                best = value
            if best >= need:
                return best
            t_master = self.lp_value * scale
            added = 0
            # a new column where the bound is below the program's value (its reduced cost is their difference)
            if value < t_master - LP_EPS * scale and n_cols < LP_MAX:
                self._lp_add_column(n_cols, a, b, n_paths, scale)
                n_cols += 1
                added = 1
            # the DAG at the program's point: no bound of this kind reaches past it; its critical path is
            # a new row where it is longer than the program thinks
            for i in range(npar):
                x = 0.0
                for j in range(n_cols - added):
                    x += self.lp_theta[j] * self.lp_colp[j * npar + i]
                self.lp_point[i] = x
            dag = self.kernel.longest_into(self.lp_point)
            if dag < need:
                return best
            if dag > t_master + LP_EPS * scale and n_paths < LP_MAX:
                self._lp_add_path(n_paths)
                for j in range(n_cols):
                    self.lp_cost[n_paths * LP_MAX + j] = self._lp_path_cost(n_paths, j) / scale
                n_paths += 1
                added = 1
            if not added:
                return best
        return best

    # --- the pieces -----------------------------------------------------------------------------

    def _lp_range(self, r: int, t: int, lb, cap, capt) -> None:
        """Layer counts undecided rank ``r`` may hold on type ``t`` (every chunk within its lower bound
        and its caps, and within memory) into ``lp_lo`` / ``lp_hi``; ``lp_lo = -1``: the rank cannot take
        the type."""
        pp, v, nt = self.pp, self.v, self.nt
        i = r * nt + t
        self.lp_lo[i] = -1
        if self.remaining[t] <= 0:
            return
        lo = v
        hi = self.cap_rank[t * pp + r]
        for c in range(v):
            vs = c * pp + r
            x = v * lb[vs] - v + 1 + c
            if x > lo:
                lo = x
            ct = capt[vs * nt + t]
            if cap[vs] < ct:
                ct = cap[vs]
            if ct < lb[vs]:
                return
            x = v * ct + c
            if x < hi:
                hi = x
        if lo <= hi:
            self.lp_lo[i] = lo
            self.lp_hi[i] = hi

    def _lp_put_rank(self, out, off: int, r: int, t: int, l: int) -> None:
        """Rank ``r``'s forward, backward and all-reduce ms on type ``t`` with ``l`` layers into ``out``
        (from ``off``): :func:`~poseidon_plugin.stagecost.put_rank_times`' operations, the all-reduces at
        the type's cheapest free slot (the fill's ``type_mins``)."""
        pp, v, nv = self.pp, self.v, self.nv
        o = t * N_TYPE_MINS
        tm = self.type_mins
        total_ar = self.optimizer_fixed_ms[t]
        for c in range(v):
            n = chunk_layers(l, c, v)
            f = n * self.forward_ms[t] + self.step_forward_ms[t]
            bw = n * self.backward_ms[t] + self.step_backward_ms[t]
            total_ar += n * self.optimizer_ms[t]
            total_ar += n * tm[o + MIN_ALLREDUCE]
            if c == 0 and r == 0:
                f += tm[o + MIN_EMBEDDING_FORWARD]
                bw += tm[o + MIN_EMBEDDING_BACKWARD]
                total_ar += tm[o + MIN_EMBEDDING_ALLREDUCE]
            if c == v - 1 and r == pp - 1:
                f += tm[o + MIN_HEAD_FORWARD]
                bw += tm[o + MIN_HEAD_BACKWARD]
                total_ar += tm[o + MIN_HEAD_ALLREDUCE]
            out[off + 1 + r * v + c] = f
            out[off + 1 + nv + r * v + c] = bw
        out[off + 1 + 2 * nv + pp + r] = total_ar

    def _lp_rank_cost(self, r: int, t: int, l: int) -> float:
        """The weighted cost (``lp_weight``, per parameter) of rank ``r`` on type ``t`` with ``l`` layers."""
        pp, v, nv = self.pp, self.v, self.nv
        self._lp_put_rank(self.lp_rank, 0, r, t, l)
        x = 0.0
        for c in range(v):
            x += self.lp_weight[1 + r * v + c] * self.lp_rank[1 + r * v + c]
            x += self.lp_weight[1 + nv + r * v + c] * self.lp_rank[1 + nv + r * v + c]
        x += self.lp_weight[1 + 2 * nv + pp + r] * self.lp_rank[1 + 2 * nv + pp + r]
        return x

    def _lp_weights(self, n_paths: int) -> None:
        """``lp_weight``: per parameter, its weight ``sum_P lambda_P count_P``; ``lp_const``: the weighted
        cost of the parameters no undecided rank sets."""
        npar = self.n_par
        for i in range(npar):
            x = 0.0
            for q in range(n_paths):
                x += self.lp_lam[q] * self.lp_cnt[q * npar + i]
            self.lp_weight[i] = x
        x = 0.0
        for i in range(npar):
            if not self.lp_free[i]:
                x += self.lp_weight[i] * self.lp_base[i]
        self.lp_const = x

    def _lp_oracle(self, a: int, b: int, mu: float) -> float:
        """``min`` over the assignments of the remaining types to the ranks ``[a, b)`` (each type exactly
        its remaining ranks) of ``sum_r min_l (weighted cost - mu l)``, each rank's ``l`` within its range:
        the value (inf where no assignment exists), the types and layers in ``lp_new_t`` / ``lp_new_l``."""
        pp, nt = self.pp, self.nt
        n = b - a
        for t in range(nt):
            for i in range(n):
                self.assign_value[t * pp + i] = NEG_F
        for r in range(a, b):
            for t in range(nt):
                lo = self.lp_lo[r * nt + t]
                if lo < 0:
                    continue
                best = INF
                arg = lo
                for l in range(lo, self.lp_hi[r * nt + t] + 1):
                    x = self._lp_rank_cost(r, t, l) - mu * l
                    if x < best:
                        best = x
                        arg = l
                self.assign_value[t * pp + r - a] = -best
                self.lp_arg[r * nt + t] = arg
        got = self._assign(n)
        if got == -INF:
            return INF
        for i in range(n):
            t = self.assign_owner[i]
            self.lp_new_t[a + i] = t
            self.lp_new_l[a + i] = self.lp_arg[(a + i) * nt + t]
        return -got

    def _lp_add_path(self, q: int) -> None:
        """Path ``q``: the critical path of the kernel's last run (its counts per parameter)."""
        npar = self.n_par
        self.kernel.critical_into(self.params if q == 0 else self.lp_point, self.path_counts)
        for i in range(npar):
            self.lp_cnt[q * npar + i] = self.path_counts[i]

    def _lp_add_column(self, j: int, a: int, b: int, n_paths: int, scale: float) -> None:
        """Column ``j``: the oracle's last point (``lp_new_t``, ``lp_new_l`` on the ranks ``[a, b)``), its
        parameters, layers and (scaled) cost along every path."""
        npar = self.n_par
        off = j * npar
        for i in range(npar):
            self.lp_colp[off + i] = self.lp_base[i]
        total = 0
        for r in range(a, b):
            self._lp_put_rank(self.lp_colp, off, r, self.lp_new_t[r], self.lp_new_l[r])
            total += self.lp_new_l[r]
        self.lp_layers[j] = total
        for q in range(n_paths):
            self.lp_cost[q * LP_MAX + j] = self._lp_path_cost(q, j) / scale

    def _lp_path_cost(self, q: int, j: int) -> float:
        """Cost of path ``q`` at column ``j``'s parameters."""
        npar = self.n_par
        x = 0.0
        for i in range(npar):
            if self.lp_cnt[q * npar + i]:
                x += self.lp_cnt[q * npar + i] * self.lp_colp[j * npar + i]
        return x

    # --- the program ----------------------------------------------------------------------------

    def _lp_master(self, n_paths: int, n_cols: int, left: int) -> bool:
        """Solve ``min T`` over ``theta >= 0`` (one per column, summing to 1, their layers to ``left``) with
        ``T >= sum_j theta_j cost_P(j)`` for every path: dense simplex, two phases, Bland's rule. Sets
        ``lp_theta``, ``lp_value`` (scaled) and ``lp_dual`` (per row: the paths', then the convexity's and
        the layer sum's). False where it fails (the caller keeps the bound it has)."""
        m = n_paths + 2
        w = n_cols + 2 + n_paths + m          # theta, T, slacks, artificials, rhs
        col_t = n_cols
        art = n_cols + 1 + n_paths
        rhs = w - 1
        tab = self.lp_tab
        for i in range((m + 1) * w):
            tab[i] = 0.0
        for q in range(n_paths):
            for j in range(n_cols):
                tab[q * w + j] = self.lp_cost[q * LP_MAX + j]
            tab[q * w + col_t] = -1.0
            tab[q * w + n_cols + 1 + q] = 1.0
        for j in range(n_cols):
            tab[n_paths * w + j] = 1.0
            tab[(n_paths + 1) * w + j] = self.lp_layers[j]
        tab[n_paths * w + rhs] = 1.0
        tab[(n_paths + 1) * w + rhs] = left
        for i in range(m):
            tab[i * w + art + i] = 1.0
            self.lp_basis[i] = art + i
        # phase 1: minimise the artificials
        for j in range(w):
            x = 0.0
            if j < art or j == rhs:
                for i in range(m):
                    x -= tab[i * w + j]
            tab[m * w + j] = x
        if not self._lp_simplex(m, w, art):
            return False
        if tab[m * w + rhs] < -LP_EPS * (1.0 + left):
            return False                  # infeasible (the caller's columns always allow a point)
        for i in range(m):               # drive the artificials out where possible
            if self.lp_basis[i] >= art:
                for j in range(art):
                    if abs(tab[i * w + j]) > LP_EPS:
                        self._lp_pivot(m, w, i, j)
                        break
        # phase 2: minimise T (cost 1 on its column)
        kt = -1
        for i in range(m):
            if self.lp_basis[i] == col_t:
                kt = i
        for j in range(w):
            x = 1.0 if j == col_t else 0.0
            if kt >= 0:
                x -= tab[kt * w + j]
            tab[m * w + j] = x
        if not self._lp_simplex(m, w, art):
            return False
        kt = -1
        for i in range(m):
            if self.lp_basis[i] == col_t:
                kt = i
        self.lp_value = tab[kt * w + rhs] if kt >= 0 else 0.0
        for j in range(n_cols):
            self.lp_theta[j] = 0.0
        for i in range(m):
            if self.lp_basis[i] < n_cols and tab[i * w + rhs] > 0.0:
                self.lp_theta[self.lp_basis[i]] = tab[i * w + rhs]
        # duals y = c_B B^-1: B^-1 is the artificials' columns, c_B is 1 on T's row only
        for i in range(m):
            self.lp_dual[i] = tab[kt * w + art + i] if kt >= 0 else 0.0
        return True

    def _lp_simplex(self, m: int, w: int, art: int) -> bool:
        """Pivot the tableau ``lp_tab`` (``m`` rows, the objective row ``m``) to optimality, only columns
        before ``art`` entering, by Bland's rule; False after ``LP_PIVOTS`` pivots (or unbounded)."""
        tab = self.lp_tab
        rhs = w - 1
        for k in range(LP_PIVOTS):
            pc = -1
            for j in range(art):
                if tab[m * w + j] < -LP_EPS:
                    pc = j
                    break
            if pc < 0:
                return True
            pr = -1
            best = INF
            for i in range(m):
                x = tab[i * w + pc]
                if x > LP_EPS:
                    ratio = tab[i * w + rhs] / x
                    if ratio < best - LP_EPS or (ratio <= best + LP_EPS and pr >= 0
                                                 and self.lp_basis[i] < self.lp_basis[pr]):
                        best = ratio
                        pr = i
            if pr < 0:
                return False
            self._lp_pivot(m, w, pr, pc)
        return False

    def _lp_pivot(self, m: int, w: int, pr: int, pc: int) -> None:
        """One pivot of the tableau on row ``pr``, column ``pc`` (the objective row included)."""
        tab = self.lp_tab
        p = tab[pr * w + pc]
        for j in range(w):
            tab[pr * w + j] /= p
        for i in range(m + 1):
            if i == pr:
                continue
            f = tab[i * w + pc]
            if f != 0.0:
                for j in range(w):
                    tab[i * w + j] -= f * tab[pr * w + j]
        self.lp_basis[pr] = pc


__all__ = ["RelaxationBound"]
