"""The relaxation bound of a node: the DAG over fractional completions, by row generation.

docs/SEARCH.md ("The relaxation bound") states it and says why it is valid. In short: at a node, every
completion gives each undecided rank one remaining type and a layer count within the node's caps, the
layers summing to ``left``; its time is the DAG's longest path, at least the cost of any path ``P`` of the
DAG, an affine function of the completion's parameters (decided ranks exact, sends at the fill's lower
bounds, an undecided rank's all-reduces at its type's cheapest free slot). The program

    min T   over theta[r, t, l] >= 0 (rank r on type t with l layers): per rank summing to 1, per type
            to its remaining ranks, sum l theta = left;   T >= cost_P(theta) for every path P found

is a relaxation of the completions (each is a 0/1 theta), so its optimum is a lower bound; the bound
used is its Lagrangian value at the program's duals ``lambda`` (paths) and ``mu`` (layer sum),

    const(lambda) + mu * left + min over assignments of sum_r min_l (cost_lambda(r, t_r, l) - mu l)

(the inner minimum an assignment problem, solved exactly by :func:`.assignment.assign_into`), valid for
any ``lambda >= 0`` summing to 1 and any ``mu``, so the simplex's rounding never makes it invalid. Rows
come from the DAG: the first is the critical path of the DAG bound the parent took of the node (at the
root, of the DAG at its lower bounds); then the DAG is run at the program's solution (each undecided rank
a mix of its options) and its critical path becomes a new row (dual simplex from the solved tableau);
before that DAG run, a row the parent's program kept (its last duals' support) that the solution violates
is taken instead, with no run. The Lagrangian is priced where the program's value reaches what cuts the
node (it is at most that value, equal at the program's duals) and at the duals it stops with. It stops
once the bound reaches what cuts the node, once the DAG at the solution is below that (no bound of this
kind reaches past it), or when no new row comes. Where it does not cut, its best duals bound each undecided rank's
options (:meth:`_lp_fix`): the next rank's counts are cut before their DAG bounds, the other ranks'
bounds tightened for the children.

One source for both backends (Cython's pure-Python mode): typed by ``cython_core/relaxation_bound.pxd``,
compiled as ``poseidon_plugin._core.relaxation_bound`` (the base class of the compiled ``SplitSearch``);
uncompiled it runs as it is. Every buffer is set by ``SplitSearch.__init__``.
"""

from __future__ import annotations

import math

from poseidon_plugin.search.assignment import NEG_F
from poseidon_plugin.search.constants import (LP_DUAL_PIVOTS, LP_EPS, LP_KEEP, LP_MAX, LP_MAX_OPTIONS, LP_PIVOTS,
                                              LP_PRICE_SLACK,
                                              MIN_ALLREDUCE, MIN_BACKWARD, MIN_EMBEDDING_ALLREDUCE,
                                              MIN_EMBEDDING_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_FORWARD,
                                              MIN_HEAD_ALLREDUCE, MIN_HEAD_BACKWARD, MIN_HEAD_FORWARD, N_TYPE_MINS,
                                              PATH_SLACK)

from .structure_bounds import StructureBounds, chunk_layers

INF = math.inf


class RelaxationBound(StructureBounds):
    """The relaxation bound (:meth:`_relaxation_bound`) on top of :class:`~.structure_bounds.StructureBounds`."""

    # --- the bound ------------------------------------------------------------------------------

    def _relaxation_bound(self, k: int, a: int, b: int, left: int, lb, cap, capt, need: float) -> float:
        """A lower bound on every completion (below tau) of the node of depth ``k`` whose undecided ranks
        are ``[a, b)`` with ``left`` layers, ``lb``/``cap``/``capt`` its propagated bounds; it stops once
        the bound reaches ``need``. ``-inf`` where it finds none (never a cut)."""
        nt, npar, v = self.nt, self.n_par, self.v
        best = -INF
        self.lp_have = False
        self._fill(lb, capt)                  # decided ranks exact, sends at their lower bounds
        for i in range(npar):
            self.lp_base[i] = self.params[i]
            self.lp_free[i] = 0
        n_opt = 0
        for r in range(a, b):
            for c in range(v):
                self.lp_free[1 + r * v + c] = 1
                self.lp_free[1 + self.nv + r * v + c] = 1
            self.lp_free[1 + 2 * self.nv + self.pp + r] = 1
            for t in range(nt):
                self._lp_range(r, t, lb, cap, capt)
                if self.lp_lo[r * nt + t] >= 0:
                    n_opt += self.lp_hi[r * nt + t] - self.lp_lo[r * nt + t] + 1
        self.lp_kept[k] = 0
        if n_opt > LP_MAX_OPTIONS:
            return best
        scale = self.tau if self.tau > 0.0 else 1.0
        # the first row: the critical path of the DAG bound the parent took of this child (the gain's,
        # :meth:`_count_gain`: any path of the DAG is a valid row), else the DAG's at the lower bounds
        if k > 0 and self.gain_path:
            for i in range(npar):
                self.lp_cnt[i] = self.path_counts[i]
        else:
            self.kernel.longest_into(self.params)
            self._lp_add_path(0)
        self.gain_path = False
        n_paths = 1
        if not self._lp_build(a, b, left, n_paths, scale):
            return best
        for q in range(LP_KEEP):
            self.lp_pool_used[q] = 0
        n_lam = 0
        for it in range(LP_MAX):
            # the duals: lambda over the paths (their slacks' reduced costs), mu of the layer sum
            total = 0.0
            for q in range(n_paths):
                x = self.lp_obj[self.lp_slack0 + q]
                if x < 0.0:
                    x = 0.0
                self.lp_lam[q] = x
                total += x
            if total <= 0.0:
                break
            for q in range(n_paths):
                self.lp_lam[q] /= total
            n_lam = n_paths
            mu = -self.lp_obj[self.lp_art0] * scale
            # the Lagrangian value is at most the program's (equal at its duals, up to rounding): it is
            # priced where the program reaches what cuts, and at the last duals (for _lp_fix)
            priced = False
            if n_paths >= LP_MAX or self._lp_value() * scale >= need * (1.0 - LP_PRICE_SLACK):
                best = self._lp_price(a, b, left, mu, n_paths, best, need)
                priced = True
                if self.lp_no_assignment or best >= need or n_paths >= LP_MAX:
                    break
            self._lp_point()
            # a row the parent kept (any path of the DAG is a valid row at every node) that the program's
            # point violates is the new row, without a DAG run
            if not self._lp_take_kept(k, n_paths, self._lp_value() * scale * (1.0 + LP_EPS)):
                # the DAG at the program's point: no bound of this kind reaches past it; its critical
                # path is a new row where it is longer than the program thinks
                dag = self.kernel.longest_into(self.lp_point)
                if dag < need or dag <= self._lp_value() * scale * (1.0 + LP_EPS):
                    if not priced:
                        best = self._lp_price(a, b, left, mu, n_paths, best, need)
                    break
                self._lp_add_path(n_paths)
            if not self._lp_cut(n_paths, scale):
                if not priced:          # the duals before the row (lp_lam and the first n_lam rows are kept)
                    best = self._lp_price(a, b, left, mu, n_lam, best, need)
                break
            n_paths += 1
        self._lp_keep(k, n_lam)
        return best

    def _lp_price(self, a: int, b: int, left: int, mu: float, n: int, best: float, need: float) -> float:
        """The Lagrangian value at the duals ``lp_lam`` (over the first ``n`` paths) and ``mu``: the larger of
        it and ``best``; the duals of a better value below ``need`` are kept for :meth:`_lp_fix`.
        ``lp_no_assignment``: no assignment of the types exists (no value)."""
        self._lp_weights(n)
        got = self._lp_oracle(a, b, mu)
        self.lp_no_assignment = got == INF
        if got == INF:
            return best
        value = self.lp_const + mu * left + got
        if value > best:
            best = value
            if best < need:
                # the best duals while the program has not cut, for its options' bounds (_lp_fix)
                self.lp_have = True
                self.lp_best_mu = mu
                self.lp_best_c = self.lp_const + mu * left
                for i in range(self.n_par):
                    self.lp_best_w[i] = self.lp_weight[i]
        return best

    def _lp_fix(self, k: int, r: int, a: int, b: int, lb, capt) -> None:
        """What the node's program (depth ``k``, undecided ranks ``[a, b)``; it did not cut) says of each
        undecided rank's options: the Lagrangian value at its best duals with rank ``s`` fixed to type
        ``t`` and ``l`` layers, the other ranks' inner minimum an assignment with ``t`` taken once. It is a
        lower bound of every completion of the node that gives ``s`` that option, as valid as the node's.
        For rank ``r`` (decided next) the values go to ``lp_fix_val`` (``lp_fix_lo`` / ``lp_fix_hi``: the
        counts of each type held, ``-1``: none), where :meth:`_children` cuts a count before its DAG
        bound; for the others, the least and greatest count below tau of each type tighten ``lb`` and
        ``capt`` (every completion below tau keeps them; the node's children inherit them)."""
        nt, pp, v = self.nt, self.pp, self.v
        width = self.num_layers + 1
        self.lp_fixed[k] = 0
        if not self.lp_have:
            return
        mu = self.lp_best_mu
        limit = self.tau * (1.0 + PATH_SLACK)
        for i in range(self.n_par):
            self.lp_weight[i] = self.lp_best_w[i]
        for s in range(a, b):
            for u in range(nt):
                self.lp_fix_min[(s - a) * nt + u] = self._lp_rank_min(s, u, mu)
        for s in range(a, b):
            for u in range(nt):
                for i in range(b - a):
                    self.assign_value[u * pp + i] = NEG_F
            n = 0
            for s2 in range(a, b):
                if s2 == s:
                    continue
                for u in range(nt):
                    x = self.lp_fix_min[(s2 - a) * nt + u]
                    if x < INF:
                        self.assign_value[u * pp + n] = -x
                n += 1
            low = -1
            for t in range(nt):
                if s == r:
                    self.lp_fix_lo[k * nt + t] = -1
                lo = self.lp_lo[s * nt + t]
                if lo < 0:
                    continue
                self.remaining[t] -= 1
                got = self._assign(n)
                self.remaining[t] += 1
                if got == -INF:
                    continue
                hi = self.lp_hi[s * nt + t]
                if s == r:
                    self.lp_fix_lo[k * nt + t] = lo
                    self.lp_fix_hi[k * nt + t] = hi
                l_min = -1
                l_max = -1
                for l in range(lo, hi + 1):
                    x = self.lp_best_c + self._lp_rank_cost(s, t, l) - mu * l - got
                    if s == r:
                        self.lp_fix_val[(k * nt + t) * width + l] = x
                    if x < limit:
                        if l_min < 0:
                            l_min = l
                        l_max = l
                if l_min < 0:
                    continue
                if low < 0 or l_min < low:
                    low = l_min
                if s == r:
                    continue
                for c in range(v):
                    i = (c * pp + s) * nt + t
                    y = chunk_layers(l_max, c, v)
                    if capt[i] > y:
                        capt[i] = y
            if s != r and low >= 0:
                for c in range(v):
                    y = chunk_layers(low, c, v)
                    if lb[c * pp + s] < y:
                        lb[c * pp + s] = y
        self.lp_fixed[k] = 1

    def _lp_take_kept(self, k: int, q_new: int, value: float) -> bool:
        """Of the rows kept at depth ``k - 1`` (the parent's binding rows, or those of a former sibling of
        the parent where the parent solved no program) and not yet taken, the one whose cost at the
        program's point (``lp_point``) exceeds ``value`` the most becomes path ``q_new``: whether one
        does."""
        npar = self.n_par
        if k == 0:
            return False
        arg = -1
        top = value
        for q in range(self.lp_kept[k - 1]):
            if self.lp_pool_used[q]:
                continue
            off = ((k - 1) * LP_KEEP + q) * npar
            x = 0.0
            for i in range(npar):
                x += self.lp_pool[off + i] * self.lp_point[i]
            if x > top:
                top = x
                arg = q
        if arg < 0:
            return False
        self.lp_pool_used[arg] = 1
        off = ((k - 1) * LP_KEEP + arg) * npar
        for i in range(npar):
            self.lp_cnt[q_new * npar + i] = self.lp_pool[off + i]
        return True

    def _lp_keep(self, k: int, n: int) -> None:
        """Keep the rows of the last duals' support (``lambda > 0`` among the first ``n``) for the
        children of depth ``k``, at most LP_KEEP."""
        npar = self.n_par
        kept = 0
        dst = k * LP_KEEP * npar
        for q in range(n):
            if kept < LP_KEEP and self.lp_lam[q] > 0.0:
                for i in range(npar):
                    self.lp_pool[dst + kept * npar + i] = self.lp_cnt[q * npar + i]
                kept += 1
        self.lp_kept[k] = kept

    # --- the program ----------------------------------------------------------------------------

    def _lp_build(self, a: int, b: int, left: int, n_paths: int, scale: float) -> bool:
        """The program of the node, solved (two phases): ``min T`` over ``theta[r, t, l] >= 0`` (rank ``r`` on
        type ``t`` with ``l`` layers; per rank summing to 1, per type to its remaining ranks, their layers
        to ``left``) with ``T >= cost_P(theta)`` for the first ``n_paths`` paths. Columns: the options, T,
        a slack per path row (room for LP_MAX), the layer row's artificial, the right-hand side. Every first
        row has an artificial (phase 1 starts from them: ``lp_basis`` holds ``lp_art0 + i`` for row ``i``'s),
        but only the layer row's has a column: an artificial never enters, so no other artificial column
        is ever read, and a pivot updates each column from itself and the pivot column only, so dropping
        them changes no other entry (the layer row's gives ``mu``, its reduced cost). The
        options of a rank and type are the least and the greatest count of each residue mod ``V``: a count
        between two of one residue is their mix (every parameter is affine in the layers within a residue,
        ``chunk_layers``), so the program's value is the one over every count, with fewer columns."""
        nt, pp = self.nt, self.pp
        n_opt = 0
        for r in range(a, b):
            for t in range(nt):
                lo = self.lp_lo[r * nt + t]
                if lo < 0:
                    continue
                hi = self.lp_hi[r * nt + t]
                for l in range(lo, hi + 1):
                    if lo + self.v <= l <= hi - self.v:
                        continue
                    self.lp_opt_r[n_opt] = r
                    self.lp_opt_t[n_opt] = t
                    self.lp_opt_l[n_opt] = l
                    n_opt += 1
        self.lp_n_opt = n_opt
        n_types = 0
        for t in range(nt):
            if self.remaining[t] > 0:
                n_types += 1
        m = (b - a) + n_types + 1 + n_paths
        col_t = n_opt
        self.lp_slack0 = n_opt + 1
        self.lp_art0 = self.lp_slack0 + LP_MAX
        w = self.lp_art0 + 2
        self.lp_w = w
        self.lp_layer_row = (b - a) + n_types
        rhs = w - 1
        tab = self.lp_tab
        for i in range(m * w):
            tab[i] = 0.0
        for j in range(n_opt):
            r = self.lp_opt_r[j]
            t = self.lp_opt_t[j]
            tab[(r - a) * w + j] = 1.0
            k = 0
            for u in range(t):
                if self.remaining[u] > 0:
                    k += 1
            tab[((b - a) + k) * w + j] = 1.0
            tab[self.lp_layer_row * w + j] = self.lp_opt_l[j]
        for r in range(b - a):
            tab[r * w + rhs] = 1.0
        k = 0
        for t in range(nt):
            if self.remaining[t] > 0:
                tab[((b - a) + k) * w + rhs] = self.remaining[t]
                k += 1
        tab[self.lp_layer_row * w + rhs] = left
        for q in range(n_paths):
            row = self.lp_layer_row + 1 + q
            self._lp_path_row(q, row * w, scale)      # T - sum cost theta - s = const (>= 0)
        tab[self.lp_layer_row * w + self.lp_art0] = 1.0
        for i in range(m):
            self.lp_basis[i] = self.lp_art0 + i
        self.lp_m = m
        # phase 1: minimise the artificials
        obj = self.lp_obj
        for j in range(w):
            x = 0.0
            if j < self.lp_art0 or j == rhs:
                for i in range(m):
                    x -= tab[i * w + j]
            obj[j] = x
        if not self._lp_simplex():
            return False
        if obj[rhs] < -LP_EPS * (1.0 + left):
            return False
        for i in range(m):               # drive the artificials out where possible
            if self.lp_basis[i] >= self.lp_art0:
                for j in range(self.lp_art0):
                    if abs(tab[i * w + j]) > LP_EPS:
                        self._lp_pivot(i, j)
                        break
        # phase 2: minimise T (cost 1 on its column)
        self._lp_objective()
        return self._lp_simplex()

    def _lp_path_row(self, q: int, off: int, scale: float) -> None:
        """Path ``q``'s row in original coefficients at ``lp_tab[off:]``: ``T - sum_j cost_q(j) theta_j - s_q =
        const_q`` (scaled by ``scale``), ``const_q`` the cost of the parameters no undecided rank sets."""
        npar = self.n_par
        w = self.lp_w
        tab = self.lp_tab
        for j in range(w):
            tab[off + j] = 0.0
        x = 0.0
        for i in range(npar):
            if not self.lp_free[i] and self.lp_cnt[q * npar + i]:
                x += self.lp_cnt[q * npar + i] * self.lp_base[i]
        tab[off + w - 1] = x / scale
        for j in range(self.lp_n_opt):
            tab[off + j] = -self._lp_option_cost(q, j) / scale
        tab[off + self.lp_n_opt] = 1.0
        tab[off + self.lp_slack0 + q] = -1.0

    def _lp_option_cost(self, q: int, j: int) -> float:
        """Cost along path ``q`` of option ``j``'s parameters (its rank on its type with its layers)."""
        pp, v, nv, npar = self.pp, self.v, self.nv, self.n_par
        r = self.lp_opt_r[j]
        self._lp_put_rank(self.lp_rank, 0, r, self.lp_opt_t[j], self.lp_opt_l[j])
        x = 0.0
        for c in range(v):
            x += self.lp_cnt[q * npar + 1 + r * v + c] * self.lp_rank[1 + r * v + c]
            x += self.lp_cnt[q * npar + 1 + nv + r * v + c] * self.lp_rank[1 + nv + r * v + c]
        x += self.lp_cnt[q * npar + 1 + 2 * nv + pp + r] * self.lp_rank[1 + 2 * nv + pp + r]
        return x

    def _lp_cut(self, q: int, scale: float) -> bool:
        """Append path ``q``'s row to the solved program (its slack basic, negated so that the slack's
        coefficient is 1), express it in the current basis, and restore feasibility by dual simplex."""
        w, m = self.lp_w, self.lp_m
        tab = self.lp_tab
        off = m * w
        self._lp_path_row(q, off, scale)
        for j in range(w):
            tab[off + j] = -tab[off + j]
        for i in range(m):
            basic = self.lp_basis[i]
            if basic >= self.lp_art0:   # an artificial still basic: its unit column is 0 in the new row
                continue                # (and only the layer row's has a column)
            f = tab[off + basic]
            if f != 0.0:
                for j in range(w):
                    tab[off + j] -= f * tab[i * w + j]
        self.lp_basis[m] = self.lp_slack0 + q
        self.lp_m = m + 1
        return self._lp_dual_simplex()

    def _lp_objective(self) -> None:
        """The phase-2 objective row: reduced costs of ``min T`` in the current basis."""
        w, m = self.lp_w, self.lp_m
        kt = -1
        for i in range(m):
            if self.lp_basis[i] == self.lp_n_opt:
                kt = i
        for j in range(w):
            x = 1.0 if j == self.lp_n_opt else 0.0
            if kt >= 0:
                x -= self.lp_tab[kt * w + j]
            self.lp_obj[j] = x

    def _lp_value(self) -> float:
        """The program's optimum (scaled): T's value."""
        w = self.lp_w
        for i in range(self.lp_m):
            if self.lp_basis[i] == self.lp_n_opt:
                return self.lp_tab[i * w + w - 1]
        return 0.0

    def _lp_point(self) -> None:
        """``lp_point``: the parameters at the program's solution (each undecided rank the mix of its options)."""
        npar, w, pp, v, nv = self.n_par, self.lp_w, self.pp, self.v, self.nv
        for i in range(npar):
            self.lp_point[i] = 0.0 if self.lp_free[i] else self.lp_base[i]
        for i in range(self.lp_m):
            j = self.lp_basis[i]
            if j >= self.lp_n_opt:
                continue
            x = self.lp_tab[i * w + w - 1]
            if x <= 0.0:
                continue
            r = self.lp_opt_r[j]
            self._lp_put_rank(self.lp_rank, 0, r, self.lp_opt_t[j], self.lp_opt_l[j])
            for c in range(v):
                self.lp_point[1 + r * v + c] += x * self.lp_rank[1 + r * v + c]
                self.lp_point[1 + nv + r * v + c] += x * self.lp_rank[1 + nv + r * v + c]
            self.lp_point[1 + 2 * nv + pp + r] += x * self.lp_rank[1 + 2 * nv + pp + r]

    def _lp_simplex(self) -> bool:
        """Primal simplex on ``lp_tab`` / ``lp_obj`` to optimality, columns before the artificials entering:
        the most negative reduced cost enters (Dantzig's rule, far fewer pivots than Bland's), the least
        ratio leaves (ties to the least basic index); after half of ``LP_PIVOTS`` pivots the first negative
        column enters (Bland's rule: no cycling from there); False after ``LP_PIVOTS`` (or unbounded)."""
        tab, obj = self.lp_tab, self.lp_obj
        w, m = self.lp_w, self.lp_m
        rhs = w - 1
        for k in range(LP_PIVOTS):
            pc = -1
            top = -LP_EPS
            for j in range(self.lp_art0):
                if obj[j] < top:
                    pc = j
                    if k >= LP_PIVOTS // 2:
                        break
                    top = obj[j]
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
            self._lp_pivot(pr, pc)
        return False

    def _lp_dual_simplex(self) -> bool:
        """Dual simplex on a dual-feasible ``lp_tab`` (a row appended): the most negative right-hand side
        leaves, the entering column by the least ratio of reduced cost to its (negative) entry, ties
        (within ``LP_EPS``: the degenerate ratios of 0) to the entry largest in magnitude; False when
        infeasible or after ``LP_DUAL_PIVOTS`` pivots (degenerate pivots can cycle: docs/SEARCH.md)."""
        tab, obj = self.lp_tab, self.lp_obj
        w, m = self.lp_w, self.lp_m
        rhs = w - 1
        for k in range(LP_DUAL_PIVOTS):
            pr = -1
            worst = -LP_EPS
            for i in range(m):
                if tab[i * w + rhs] < worst:
                    worst = tab[i * w + rhs]
                    pr = i
            if pr < 0:
                return True
            pc = -1
            best = INF
            piv = 0.0
            for j in range(self.lp_art0):
                x = tab[pr * w + j]
                if x < -LP_EPS:
                    d = obj[j]
                    if d < 0.0:
                        d = 0.0
                    ratio = d / -x
                    if ratio < best - LP_EPS or (ratio <= best + LP_EPS and x < piv):
                        best = ratio
                        piv = x
                        pc = j
            if pc < 0:
                return False
            self._lp_pivot(pr, pc)
        return False

    def _lp_pivot(self, pr: int, pc: int) -> None:
        """One pivot of the tableau on row ``pr``, column ``pc`` (the objective row too). The other rows
        are updated on the pivot row's nonzero columns only (``lp_nz``): subtracting ``f * 0`` changes
        no entry but the sign of a zero, so the tableau is the dense update's."""
        tab, obj, nz = self.lp_tab, self.lp_obj, self.lp_nz
        w, m = self.lp_w, self.lp_m
        p = tab[pr * w + pc]
        n = 0
        for j in range(w):
            x = tab[pr * w + j] / p
            tab[pr * w + j] = x
            if x != 0.0:
                nz[n] = j
                n += 1
        for i in range(m):
            if i == pr:
                continue
            f = tab[i * w + pc]
            if f != 0.0:
                for e in range(n):
                    j = nz[e]
                    tab[i * w + j] -= f * tab[pr * w + j]
        f = obj[pc]
        if f != 0.0:
            for e in range(n):
                j = nz[e]
                obj[j] -= f * tab[pr * w + j]
        self.lp_basis[pr] = pc

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
        its remaining ranks) of ``sum_r min_l (weighted cost - mu l)`` (:meth:`_lp_rank_min`), each rank's
        ``l`` within its range: the value, inf where no assignment exists."""
        pp, nt = self.pp, self.nt
        n = b - a
        for t in range(nt):
            for i in range(n):
                self.assign_value[t * pp + i] = NEG_F
        for r in range(a, b):
            for t in range(nt):
                x = self._lp_rank_min(r, t, mu)
                if x < INF:
                    self.assign_value[t * pp + r - a] = -x
        got = self._assign(n)
        if got == -INF:
            return INF
        return -got

    def _lp_rank_min(self, r: int, t: int, mu: float) -> float:
        """``min_l`` of rank ``r``'s weighted cost on type ``t`` with ``l`` layers ``- mu l``, ``l`` within its
        range (``lp_lo`` / ``lp_hi``); inf where the rank cannot take the type."""
        nt = self.nt
        lo = self.lp_lo[r * nt + t]
        best = INF
        if lo < 0:
            return best
        for l in range(lo, self.lp_hi[r * nt + t] + 1):
            x = self._lp_rank_cost(r, t, l) - mu * l
            if x < best:
                best = x
        return best

    def _lp_add_path(self, q: int) -> None:
        """Path ``q``: the critical path of the kernel's last run (its counts per parameter; the run was
        on ``params`` for the first path, on ``lp_point`` for the others)."""
        npar = self.n_par
        self.kernel.critical_into(self.params if q == 0 else self.lp_point, self.path_counts)
        for i in range(npar):
            self.lp_cnt[q * npar + i] = self.path_counts[i]


__all__ = ["RelaxationBound"]
