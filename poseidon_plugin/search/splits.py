"""Branch and bound over one *structure*: device type and layers of every (virtual) stage.

A structure fixes ``(tp, mbs, dp)`` (one :class:`~.tables.TypeTable`), the shape ``(schedule, pp, M, V)``
(one :class:`~.shapes.ShapeData`) and how many pipeline ranks use each device type. The search then
decides, rank by rank (in pipeline order, with ``backward`` from the last one, rank 0 first where its
memory holds the average rank's layers, or with ``alternate`` from both ends in turn), each rank's device
type and layers, and simulates every complete plan that can still beat the threshold ``tau``. With
``V`` chunks per rank, a rank's layers are spread over its chunks as evenly as possible, earlier
chunks first (``chunk_layers``): virtual stage ``vs = chunk x pp + rank`` holds
``(l + V - 1 - chunk) // V`` of the rank's ``l`` layers.

This module (the tree walk) and :mod:`.structure_bounds` (the lower bounds and caps) are one source for
both backends: written in Cython's pure-Python mode, typed by ``cython_core/_search.pxd`` and compiled as
``poseidon_plugin._core._search`` (the engine's fast path); uncompiled (``POSEIDON_PURE_PYTHON=1``) the
same file runs as it is. docs/SEARCH.md explains the bounds and why each pruning rule is safe:

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

from poseidon_plugin.search.constants import (CLOCK_EVERY, FRONT_FIRST, LP_KEEP, LP_MAX, LP_MAX_OPTIONS, LP_MIN_CUTS,
                                              LP_MIN_UNDECIDED, LP_ONE_CHUNK_CUTS, LP_SAMPLE, LP_TRIAL,
                                              N_MINS, N_TYPE_MINS, PATH_SLACK, SHARE_TIE)
from poseidon_plugin.search.counters import (BOUND_EVALS, COUNTER_NAMES, IMPROVED, N_COUNTERS, NODES,
                                             PRUNED_BOUND, PRUNED_MEMORY, PRUNED_ORDER, PRUNED_PATH,
                                             PRUNED_RIDGE, SIM_CALLS)
from poseidon_plugin.search.split_result import SplitResult

from .relaxation_bound import RelaxationBound
from .structure_bounds import chunk_layers, float_buffer, float_copy, int_buffer, int_copy

INF = math.inf


class SplitSearch(RelaxationBound):
    """Exact (or ridge-pruned) search of one structure; re-usable with different counts and ``tau``.

    The bounds and caps are the methods of :class:`~.structure_bounds.StructureBounds`; this class holds
    the search state and walks the tree (:meth:`_node`, :meth:`_children`).
    """

    def __init__(self, table, shape, num_layers: int, *, ridge: bool, blocks: bool, type_class,
                 gap: float = 0.0, backward: bool = False, alternate: bool = False):
        if shape.pure_python and __name__ == "poseidon_plugin._core._search":
            raise TypeError("the compiled search needs the compiled DAG kernel (shape built with "
                            "pure_python=False)")
        self.table, self.shape = table, shape
        self.num_layers = num_layers
        self.ridge, self.blocks = ridge, blocks
        # decide the ranks from the last one, or from both ends in turn (the ridge and block rules follow
        # the pipeline order)
        self.backward = backward and not ridge and not blocks
        self.alternate = alternate and not self.backward and not ridge and not blocks
        # relative optimality gap: a plan must beat best / (1 + gap) to be worth searching for
        self.shrink = 1.0 / (1.0 + gap)
        nt = self.nt = len(table.names)
        pp = self.pp = shape.pp
        v = self.v = shape.virtual_stages
        nv = self.nv = pp * v
        self.stride = table.max_slots
        self.ub = pp                                     # the undecided ranks are [k, ub) at a node
        self.front = 0                                   # from the end: the front ranks decided first (run)
        self.kernel = None                               # built on the first full search
        self.params = float_copy(shape.new_params())     # comm-model extras at their defaults
        # the type table (per type; per slot: t * stride + slot)
        self.forward_ms = float_copy(table.forward_ms)
        self.backward_ms = float_copy(table.backward_ms)
        self.embedding_forward_ms = float_copy(table.embedding_forward_ms)
        self.embedding_backward_ms = float_copy(table.embedding_backward_ms)
        self.head_forward_ms = float_copy(table.head_forward_ms)
        self.head_backward_ms = float_copy(table.head_backward_ms)
        self.step_forward_ms = float_copy(table.step_forward_ms)
        self.step_backward_ms = float_copy(table.step_backward_ms)
        self.optimizer_ms = float_copy(table.optimizer_ms)
        self.optimizer_fixed_ms = float_copy(table.optimizer_fixed_ms)
        self.send_cross_ms = float_copy(table.send_cross_ms)
        self.allreduce_ms = float_copy(table.allreduce_ms)
        self.embedding_allreduce_ms = float_copy(table.embedding_allreduce_ms)
        self.head_allreduce_ms = float_copy(table.head_allreduce_ms)
        self.send_same_ms = float_copy(table.send_same_ms)
        self.send_wrap_ms = float_copy(table.send_wrap_ms)
        self.has_allreduce = int_copy(table.has_allreduce)
        self.type_class = int_copy(type_class)           # identical types share a class id
        self._load_paths(shape.paths)    # the tree's first full search loads shape.search_paths (run)
        # search state
        self.counts = int_buffer(nt)
        self.remaining = int_buffer(nt)
        self.used = int_buffer(nt)     # per type: its ranks decided in pipeline order (slots 0..used-1)
        self.hi = int_buffer(nt)       # per type: its slots hi.. belong to ranks decided from the end
        self.types = int_buffer(pp)
        self.slot = int_buffer(pp)
        self.layers = int_buffer(nv)
        self.last = int_buffer(nt)     # ridge: layers of the type's previous rank
        self.down = int_buffer(nt)     # ridge: the type's sequence already falls
        self.capped = int_buffer(nt)   # ridge: the type's previous rank is full
        self.lbs = memoryview(int_buffer((pp + 1) * nv))    # per depth: the stages' lower bounds ...
        self.caps = memoryview(int_buffer((pp + 1) * nv))   # ... caps, and caps per (stage, type)
        self.capts = memoryview(int_buffer((pp + 1) * nv * nt))
        self.ctr = array("q", [0]) * N_COUNTERS
        self.best_types = int_buffer(pp)
        self.best_layers = int_buffer(nv)
        self.node_a = int_buffer(pp + 1)   # per depth: the node's undecided ranks [node_a, node_b)
        self.node_b = int_buffer(pp + 1)
        self.depth_nodes = array("q", [0]) * (pp + 1)   # nodes per depth of the last run (diagnostics)
        self.lp_depth_calls = array("q", [0]) * (pp + 1)   # relaxation bounds per depth, nodes they cut,
        self.lp_depth_cuts = array("q", [0]) * (pp + 1)    # and nodes the rule left without one
        self.lp_depth_skips = array("q", [0]) * (pp + 1)
        # the walk's path (per depth: the type and layers of the child being searched) and, where a run
        # stopped at its node budget or deadline, its path then, to resume from (run(resume=True))
        self.path_t = int_buffer(pp)
        self.path_l = int_buffer(pp)
        self.resume_t = int_buffer(pp)
        self.resume_l = int_buffer(pp)
        self.resume_counts = int_buffer(nt)
        self.resume_depth = -1
        self.resume_tau = 0.0
        self.resuming = False
        # a walk shared among processes (:meth:`share`): each subtree at depth share_depth belongs to one
        # process, by its path, and each searches below the best plan any of them has found (share_tau)
        self.share_count = 1
        self.share_index = 0
        self.share_depth = -1
        self.share_tau = float_buffer(1)
        self.best_path_t = int_buffer(pp)    # the best plan's decisions in the walk's order (best_path)
        self.best_path_l = int_buffer(pp)
        # the fill's scratch (StructureBounds._fill)
        self.mins = float_buffer(N_MINS)
        self.type_mins = float_buffer(nt * N_TYPE_MINS)
        self.rank_min_costs = float_buffer(N_TYPE_MINS)
        self.fill_forward = float_buffer(pp)     # the per-layer forward, backward, all-reduce ms the
        self.fill_backward = float_buffer(pp)    # fill priced each undecided rank at
        self.fill_allreduce = float_buffer(pp)
        # the path bounds' scratch (StructureBounds._path_caps and what it calls)
        self.slope_type = int_buffer(nt)
        self.slope_forward = float_buffer(nt)
        self.slope_backward = float_buffer(nt)
        self.slope_allreduce = float_buffer(nt)
        self.rank_room_above = int_buffer(pp * nt)
        self.rank_room_whole = int_buffer(pp * nt)
        self.order_above = int_buffer(nt * pp)
        self.order_whole = int_buffer(nt * pp)
        self.n_above = int_buffer(nt)
        self.n_whole = int_buffer(nt)
        self.room_above = int_buffer(pp * nt * nt)
        self.room_whole = int_buffer(pp * nt * nt)
        self.phi_type = int_buffer(nt)
        self.phi_slope = float_buffer(nt)
        self.alpha = float_buffer(nv)
        self.stage_slope = float_buffer(nv * nt)
        self.stage_order = int_buffer(nv)
        self.merged_order = int_buffer(nv * nt)
        self.merged_left = int_buffer(nt)
        self.chunk_slope = float_buffer(v)
        self.rank_type_min = float_buffer(nt)
        self.rank_type_sum = float_buffer(nt)
        self.type_min1 = float_buffer(nt)
        self.type_min2 = float_buffer(nt)
        self.type_min_rank = int_buffer(nt)
        self.type_mean1 = float_buffer(nt)
        self.type_mean2 = float_buffer(nt)
        self.type_mean_rank = int_buffer(nt)
        self.rank_lb_cost = float_buffer(pp)
        self.loss_above = float_buffer(pp)
        self.loss_whole = float_buffer(pp)
        self.rank_lb = int_buffer(pp)
        self.lb_even = int_buffer(pp)
        self.lb_start = int_buffer(pp)
        self.zero_ranks = int_buffer(pp)
        self.one_ranks = int_buffer(pp, 1)
        self.zero_lb = int_buffer(nv)
        self.rank_values = int_buffer(pp)
        # the gain's scratch (StructureBounds._count_gain, _joint_gain)
        self.path_counts = int_buffer(shape.n_params)
        self.lb_gain = float_buffer(pp * nt)
        self.type_mean_gain = float_buffer(nt)
        self.type_gain_ranks = int_buffer(nt)
        self.gain_slope = float_buffer(nv * nt)
        self.gain_room = int_buffer(nv * nt)
        self.gain_mu = float_buffer(nv * nt)
        self.gain_slack = 0
        self.gain_path = False      # path_counts holds a path of the DAG (the last gain's)
        self.assign_value = float_buffer(nt * pp)
        self.boundary_least = float_buffer(nt)
        self.assign_capacity = int_buffer(nt * pp)
        self.assign_owner = int_buffer(pp)
        self.assign_used = int_buffer(nt)
        self.assign_gain = float_buffer(nt)
        self.assign_via_type = int_buffer(nt)
        self.assign_via_rank = int_buffer(nt)
        # the relaxation bound's scratch (RelaxationBound), allocated on its first use (_lp_alloc): most
        # searches (root checks, one-chunk shapes) never need it
        self.n_par = shape.n_params
        self.lp_ready = False
        self.lp_no_assignment = False
        self.lp_const = 0.0
        self.lp_n_opt = self.lp_slack0 = self.lp_art0 = self.lp_w = self.lp_m = 0
        self.lp_layer_row = 0
        self.stage_calls = 0         # placements by stage computed in this run, and counts they rejected
        self.stage_cuts = 0
        # memory: most layers rank r holds on type t (all chunks; < V when the rank cannot be used)
        self.live = int_copy(shape.live)
        self.layer_state_bytes = float_copy(table.layer_state_bytes)
        self.layer_activation_bytes = float_copy(table.layer_activation_bytes)
        self.embedding_state_bytes = float_copy(table.embedding_state_bytes)
        self.embedding_activation_bytes = float_copy(table.embedding_activation_bytes)
        self.head_state_bytes = float_copy(table.head_state_bytes)
        self.head_activation_bytes = float_copy(table.head_activation_bytes)
        self.usable_bytes = float_copy(table.usable_bytes)
        self.cap_rank = int_buffer(nt * pp)
        for t in range(nt):
            for r in range(pp):
                self.cap_rank[t * pp + r] = self._rank_cap(t, r)

    def _load_paths(self, paths) -> None:
        """The bound paths the bounds read (``BoundPaths``)."""
        self.n_paths = paths.count
        self.coef_f = int_copy(paths.coef_f)
        self.coef_b = int_copy(paths.coef_b)
        self.coef_ar = int_copy(paths.coef_ar)
        self.term_ptr = int_copy(paths.term_ptr)
        self.term_idx = int_copy(paths.term_idx)
        self.term_coef = int_copy(paths.term_coef)
        self.path_owner = int_copy(paths.owner)
        # per path, how often it crosses the two links of its owner rank (into it, out of it)
        self.owner_in_coef = int_buffer(max(1, paths.count))
        self.owner_out_coef = int_buffer(max(1, paths.count))
        pp, nv = self.pp, self.nv
        for q in range(paths.count):
            r = self.path_owner[q]
            e_in = 1 + 2 * nv + (r + pp - 1) % pp
            e_out = 1 + 2 * nv + r
            for e in range(self.term_ptr[q], self.term_ptr[q + 1]):
                if pp > 1 and self.term_idx[e] == e_in:
                    self.owner_in_coef[q] += self.term_coef[e]
                if pp > 1 and self.term_idx[e] == e_out:
                    self.owner_out_coef[q] += self.term_coef[e]

    def _lp_alloc(self) -> None:
        """The relaxation bound's scratch: per parameter; per path row; the program's tableau."""
        pp, nt = self.pp, self.nt
        npar = self.n_par
        self.lp_base = float_buffer(npar)
        self.lp_free = int_buffer(npar)
        self.lp_weight = float_buffer(npar)
        self.lp_point = float_buffer(npar)
        self.lp_rank = float_buffer(npar)
        self.lp_cnt = int_buffer(LP_MAX * npar)
        self.lp_lam = float_buffer(LP_MAX)
        self.lp_pool = int_buffer(pp * LP_KEEP * npar)
        self.lp_kept = int_buffer(pp)
        self.lp_pool_used = int_buffer(LP_KEEP)
        self.lp_best_w = float_buffer(npar)
        self.lp_fix_min = float_buffer(pp * nt)
        self.lp_fixed = int_buffer(pp)
        self.lp_fix_lo = int_buffer(pp * nt)
        self.lp_fix_hi = int_buffer(pp * nt)
        self.lp_fix_val = float_buffer(pp * nt * (self.num_layers + 1))
        self.lp_lo = int_buffer(pp * nt)
        self.lp_hi = int_buffer(pp * nt)
        self.lp_opt_r = int_buffer(LP_MAX_OPTIONS)
        self.lp_opt_t = int_buffer(LP_MAX_OPTIONS)
        self.lp_opt_l = int_buffer(LP_MAX_OPTIONS)
        rows = pp + nt + 1 + LP_MAX
        width = LP_MAX_OPTIONS + 1 + LP_MAX + 2
        self.lp_tab = float_buffer(rows * width)
        self.lp_obj = float_buffer(width)
        self.lp_nz = int_buffer(width)
        self.lp_basis = int_buffer(rows)
        self.lp_ready = True

    # --- memory ---------------------------------------------------------------------------------

    def _memory_need(self, t: int, r: int, layers: int) -> float:
        """Peak bytes of rank ``r`` on type ``t`` holding ``layers`` layers spread over its chunks: the
        operations of :func:`~poseidon_plugin.stagecost.rank_memory`, in its order."""
        v = self.v
        state = 0.0
        chunk_act = 0.0
        for c in range(v):
            n = chunk_layers(layers, c, v)
            s = n * self.layer_state_bytes[t]
            a = n * self.layer_activation_bytes[t]
            if c == 0 and r == 0:
                s += self.embedding_state_bytes[t]
                a += self.embedding_activation_bytes[t]
            if c == v - 1 and r == self.pp - 1:
                s += self.head_state_bytes[t]
                a += self.head_activation_bytes[t]
            state += s
            if a > chunk_act:
                chunk_act = a
        return state + self.live[r] * chunk_act

    def _rank_cap(self, t: int, r: int) -> int:
        """Most layers rank ``r`` on type ``t`` can hold (binary search on the memory formula)."""
        lo = 0
        hi = self.num_layers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._memory_need(t, r, mid) > self.usable_bytes[t]:
                hi = mid - 1
            else:
                lo = mid
        return lo

    # --- search ---------------------------------------------------------------------------------

    def _reset(self, counts) -> int:
        """The state of a fresh search for ``counts`` ranks per type; their sum."""
        total = 0
        for t in range(self.nt):
            self.counts[t] = counts[t]
            self.remaining[t] = counts[t]
            self.used[t] = 0
            self.hi[t] = counts[t]
            self.last[t] = 0
            self.down[t] = 0
            self.capped[t] = 0
            total += counts[t]
        self.ub = self.pp
        self.node_a[0] = 0
        self.node_b[0] = self.pp
        for r in range(self.pp):
            self.types[r] = -1
            self.slot[r] = 0
        for i in range(self.nv):
            self.layers[i] = 0
        for i in range(N_COUNTERS):
            self.ctr[i] = 0
        for i in range(self.pp + 1):
            self.depth_nodes[i] = 0
        self.stage_calls = 0
        self.stage_cuts = 0
        if self.lp_ready:
            for i in range(self.pp):
                self.lp_kept[i] = 0
        self.exact_counts = total == self.pp
        # from the end, rank 0 goes first where its memory holds at least the average rank's layers: then
        # its paths (every other rank twice, itself on ~M - pp + 1 micro-batches) are the ones to close
        # early; where memory keeps it below the average (frontier-scale 1F1B) its layers are nearly forced
        # and the tail decides the bound (docs/SEARCH.md, "Branching order")
        self.front = 0
        if self.backward:
            top = 0
            for t in range(self.nt):
                if counts[t] > 0 and self.cap_rank[t * self.pp] > top:
                    top = self.cap_rank[t * self.pp]
            if top * self.pp >= self.num_layers:
                self.front = FRONT_FIRST
        return total

    def run(self, counts, tau: float, *, root_only: bool = False,
            deadline: float = INF, max_nodes: int = 0, resume: bool = False) -> SplitResult:
        """Best plan with time ``< tau`` for ``counts`` ranks per type (``root_only``: bound check only).

        ``deadline`` (``time.monotonic()`` seconds) or ``max_nodes`` (> 0: a node budget, the same in
        both backends) stops the search early: ``aborted`` is then set and the result is the best
        found so far. ``resume``: where the last run of these counts stopped that way at a threshold
        ``>= tau``, this one starts where it stopped (:meth:`can_resume`): the tree before its path was
        searched below a threshold at least this one, so only the rest is searched (``resumed`` is set).
        """
        resumed = resume and self.can_resume(counts, tau)
        total = self._reset(counts)
        if not resumed:                 # a resumed walk goes on with the stopped one's rule per depth
            for i in range(self.pp + 1):
                self.lp_depth_calls[i] = 0
                self.lp_depth_cuts[i] = 0
                self.lp_depth_skips[i] = 0
        self.resuming = resumed
        self.tau = tau
        self.best = INF
        self.have_best = False
        self.deadline = deadline
        self.max_nodes = max_nodes
        self.aborted = False
        # root_only accepts counts that are upper limits (a type's free slots): the bounds only ask
        # which types may still appear, never how many
        if root_only and total >= self.pp:
            self._root_check()
        elif total == self.pp:
            if self.kernel is None:
                self.kernel = self.shape.kernel
                self._load_paths(self.shape.search_paths)
            self._node(0, self.num_layers)
        self.resuming = False
        if not self.aborted and not root_only:
            self.resume_depth = -1
        types = layers = ()
        if self.have_best:
            types = tuple([self.best_types[i] for i in range(self.pp)])
            layers = tuple([self.best_layers[i] for i in range(self.nv)])
        return SplitResult(time_ms=self.best, types=types, layers=layers,
                           counters=tuple([self.ctr[i] for i in range(N_COUNTERS)]), aborted=self.aborted,
                           resumed=resumed)

    def share(self, count: int, index: int, depth: int, tau_buffer=None) -> None:
        """Share the next walks among ``count`` processes, this one ``index``: a node of depth ``depth``
        belongs to one process, by its path (the decisions above it: the same in every process that
        reaches it, whatever its threshold), and the others skip it. The processes read and lower
        ``tau_buffer[0]`` (a double in memory they share), the least threshold any of them has reached,
        so a node one of them never reaches is cut for all. ``depth = -1``: each process walks the whole
        tree (two walks raced, ``shared_walk.raced_run``), the threshold still shared. ``share(1, 0, -1)``:
        one process again."""
        self.share_count = count
        self.share_index = index
        self.share_depth = depth
        if tau_buffer is None:
            tau_buffer = float_buffer(1)
            tau_buffer[0] = INF
        self.share_tau = tau_buffer

    def best_path(self) -> tuple:
        """The last run's best plan as the walk decided it: ``(type, layers)`` per depth. Of two plans, the
        walk alone meets first the one whose path is the lesser (each depth tries its types, then its
        counts, in increasing order): of equal plans from several processes, that one is the walk's."""
        if not self.have_best:
            return ()
        return tuple([(self.best_path_t[k], self.best_path_l[k]) for k in range(self.pp)])

    def forget(self) -> None:
        """Drop the stopped walk's path: the next run searches its tree from the root (a shared walk that
        stopped early: the other processes' parts of the tree before the path are not all searched)."""
        self.resume_depth = -1

    def can_resume(self, counts, tau: float) -> bool:
        """Whether the last run stopped early on ``counts`` at a threshold ``>= tau``: every plan below
        ``tau`` in the tree before its path was found (and the better ones lowered the threshold) or cut."""
        if self.resume_depth < 0 or tau > self.resume_tau:
            return False
        for t in range(self.nt):
            if counts[t] != self.resume_counts[t]:
                return False
        return True

    def _stop(self, k: int) -> None:
        """Stop the walk at the node of depth ``k`` (not yet searched) and keep its path for a resumed run;
        a resumed run that stops before it reaches its old path's node keeps that path (it is further)."""
        self.aborted = True
        if not self.resuming:
            for j in range(k):
                self.resume_t[j] = self.path_t[j]
                self.resume_l[j] = self.path_l[j]
            for t in range(self.nt):
                self.resume_counts[t] = self.counts[t]
            self.resume_depth = k
        self.resume_tau = self.tau

    def stage_stats(self) -> tuple[int, int]:
        """Placements by stage computed in the last run, and the counts they rejected."""
        return self.stage_calls, self.stage_cuts

    def depth_profile(self) -> list[int]:
        """Nodes per depth of the last :meth:`run` (depth ``k``: ``k`` ranks decided)."""
        return [self.depth_nodes[i] for i in range(self.pp + 1)]

    def _root_check(self) -> None:
        """Path and mass bounds at the root only (no DAG needed): ``best = 0`` when not pruned."""
        nv = self.nv
        self.ctr[NODES] += 1
        lb = self.lbs[0:nv]
        cap = self.caps[0:nv]
        capt = self.capts[0:nv * self.nt]
        if self._propagate(0, self.num_layers, lb, cap, capt, lb, cap, capt, False):
            self.best = 0.0

    def bound_params(self, counts, types, layers, lb, capt=None) -> list[float]:
        """The DAG bound's parameter vector with the ranks ``types[r] >= 0`` decided (``layers`` per
        virtual stage; 0: undecided, priced at ``lb``, over the types whose per-type caps ``capt``
        (``vs * nt + t``; None: every remaining type) hold it): what :meth:`_fill` writes."""
        nv, nt = self.nv, self.nt
        self._reset(counts)
        for r in range(self.pp):
            t = types[r]
            if t >= 0:
                self.types[r] = t
                self.slot[r] = self.used[t]
                self.remaining[t] -= 1
                self.used[t] += 1
        for i in range(nv):
            self.layers[i] = layers[i]
            self.lbs[i] = lb[i]
        for i in range(nv * nt):
            self.capts[i] = self.num_layers if capt is None else capt[i]
        self._fill(self.lbs[0:nv], self.capts[0:nv * nt])
        for i in range(nv):
            self.layers[i] = 0
        return [self.params[i] for i in range(len(self.params))]

    def _lp_wanted(self, k: int) -> bool:
        """Whether the node of depth ``k`` computes the relaxation bound: its first LP_TRIAL nodes of the
        depth do; later ones while it cuts at least one in LP_MIN_CUTS nodes of the depth (LP_ONE_CHUNK_CUTS
        in LP_MIN_CUTS on one-chunk trees); below that, one node in LP_SAMPLE still does, so that a depth
        whose first nodes were cut less often than its later ones turns it on again."""
        calls = self.lp_depth_calls[k]
        share = 1 if self.v > 1 else LP_ONE_CHUNK_CUTS
        if calls < LP_TRIAL or self.lp_depth_cuts[k] * LP_MIN_CUTS >= calls * share:
            return True
        self.lp_depth_skips[k] += 1
        return self.lp_depth_skips[k] % LP_SAMPLE == 0

    def _share_owner(self, k: int) -> int:
        """The process (of ``share_count``) that searches the node of depth ``k`` on the walk's path: by
        the path's decisions alone, mixed so that the siblings of a node go to the processes in turn."""
        h = 0
        for j in range(k):
            h = (h * 40503 + self.path_t[j] * 257 + self.path_l[j]) % 1000000007
        return h % self.share_count

    def _type_allowed(self, r: int, t: int) -> int:
        """0 if rank ``r`` may take type ``t`` now; else the counter that rejects it (-1: none)."""
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
        """Decide the rank of depth ``k`` (type and layers) with ``left`` layers for the undecided ranks
        ``[node_a[k], node_b[k])``: the first of them in pipeline order, with ``backward`` the first while
        it is one of the ``front`` ranks, then the last."""
        nv, nt = self.nv, self.nt
        if self.aborted:
            return
        if k == self.share_depth and self._share_owner(k) != self.share_index:
            return                          # a shared walk: another process searches this subtree (share)
        if self.share_count > 1 and self.share_tau[0] < self.tau:
            self.tau = self.share_tau[0]
        self.ctr[NODES] += 1
        self.depth_nodes[k] += 1
        if (self.ctr[NODES] % CLOCK_EVERY == 0 and time.monotonic() > self.deadline) or \
                self.ctr[NODES] == self.max_nodes:
            self._stop(k)
            return
        if self.resuming and k == self.resume_depth:
            self.resuming = False           # the node the stopped run had not searched: in full
        a = self.node_a[k]
        b = self.node_b[k]
        right = self.backward and not (a < self.front and b - a > 1)
        if self.alternate and k % 2 == 1 and b - a > 1:
            right = True                    # from both ends in turn: the front at even depths, the end at odd
        r = b - 1 if right else a
        self.ub = b
        lb = self.lbs[k * nv:(k + 1) * nv]
        cap = self.caps[k * nv:(k + 1) * nv]
        capt = self.capts[k * nv * nt:(k + 1) * nv * nt]
        if k == 0:
            ok = self._propagate(a, left, lb, cap, capt, lb, cap, capt, False)
        else:
            ok = self._propagate(a, left, lb, cap, capt, self.lbs[(k - 1) * nv:k * nv],
                                 self.caps[(k - 1) * nv:k * nv], self.capts[(k - 1) * nv * nt:k * nv * nt], True)
        if not ok:
            return
        if self.lp_ready:
            self.lp_fixed[k] = 0
        if (self.tau < INF and self.exact_counts and b - a >= LP_MIN_UNDECIDED and not self.resuming
                and self._lp_wanted(k)):
            # the relaxation bound (docs/SEARCH.md): every completion's DAG over fractional types and
            # layers. Interleaved critical paths switch ranks with the chunk phases, which no bound path
            # sees; one-chunk trees have the fill-and-drain paths, but each bounds the layers alone,
            # and the program bounds them together. It costs a program per node, so each depth keeps it
            # while it cuts at least one of the depth's nodes in LP_MIN_CUTS (after LP_TRIAL), on one-chunk
            # trees LP_ONE_CHUNK_CUTS in LP_MIN_CUTS (their DAG bounds cost less, and where the program cuts
            # fewer it costs more than it saves), and samples it below that (_lp_wanted); not on the path
            # a resumed walk walks again to its stop (the stopped walk's nodes); the same decisions on both
            # backends
            limit = self.tau * (1.0 + PATH_SLACK)
            if not self.lp_ready:
                self._lp_alloc()
            self.lp_depth_calls[k] += 1
            if self._relaxation_bound(k, a, b, left, lb, cap, capt, limit) >= limit:
                self.lp_depth_cuts[k] += 1
                self.ctr[PRUNED_PATH] += 1
                return
            self._lp_fix(k, r, a, b, lb, capt)   # its options' bounds: the next rank's counts, the others' caps
        for t in range(nt):
            if self.resuming:               # the types before the stopped run's were searched
                if t < self.resume_t[k]:
                    continue
                if t > self.resume_t[k]:
                    self.resuming = False
            why = self._type_allowed(r, t)
            if why:
                if why > 0:
                    self.ctr[why] += 1
                continue
            self.types[r] = t
            if right:
                self.hi[t] -= 1
                self.slot[r] = self.hi[t]
            else:
                self.slot[r] = self.used[t]
                self.used[t] += 1
            self.remaining[t] -= 1
            self._children(k, r, a, b, left, t, lb, cap, capt)
            self.types[r] = -1
            self.remaining[t] += 1
            if right:
                self.hi[t] += 1
            else:
                self.used[t] -= 1

    def _child_lower_bounds(self, a: int, b: int, rest: int, s_cap: int, lb, cap, out) -> bool:
        """Lower bounds of the stages of ranks ``[a, b)`` when they hold ``rest`` layers (``s_cap``: the
        sum of their caps): ``lb`` raised by the sum rule, into ``out``; whether any rose."""
        raised = False
        for vs in range(self.nv):
            out[vs] = lb[vs]
            if a <= vs % self.pp < b:
                x = rest - (s_cap - cap[vs])
                if x > lb[vs]:
                    out[vs] = x
                    raised = True
        return raised

    def _children(self, k: int, r: int, a: int, b: int, left: int, t: int, lb, cap, capt) -> None:
        """Try rank ``r`` (depth ``k``, undecided ranks ``[a, b)``) on type ``t`` with increasing layer
        counts; the child's undecided ranks are ``[ca, cb)``."""
        pp, v, nv = self.pp, self.v, self.nv
        ca = a + 1 if r == a else a
        cb = b if r == a else b - 1
        self.node_a[k + 1] = ca
        self.node_b[k + 1] = cb
        lo = v
        hi = self.num_layers
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
                self.ctr[PRUNED_PATH] += 1
                return
            if left - room > lo:
                lo = left - room
        mem = self.cap_rank[t * pp + r]
        if mem < hi:
            x = lo - 1
            if mem > x:
                x = mem
            self.ctr[PRUNED_MEMORY] += hi - x
            hi = mem
        if k == pp - 1:
            if left < lo or left > hi:
                return
            lo = left
            hi = left
        last = self.last[t]
        down = self.down[t]
        capped = self.capped[t]
        # ridge (Theorem 2 and Lemma 5-6 of the paper): along a type's ranks the layers only rise
        # where the earlier rank is at its memory cap, and never again once they have fallen
        if self.ridge and last > 0 and (down or not capped) and last < hi:
            x = lo - 1
            if last > x:
                x = last
            self.ctr[PRUNED_RIDGE] += hi - x
            hi = last
        # with l layers here the later ranks hold left - l, each stage at most its cap: a stage holds at
        # least left - l - (the other stages' caps). Where that raises a lower bound the DAG bound is
        # taken with it (valid for this count only: it falls as l rises, so it never ends the loop);
        # elsewhere with lb, monotone in l, and its first cut ends the loop
        s_cap = 0
        if k < pp - 1:
            for vs in range(nv):
                if ca <= vs % pp < cb:
                    s_cap += cap[vs]
        s_lb = self._lb_sum(ca, cb, lb)   # the later ranks' layers at lb (the gain's extra layers: the rest)
        lb2 = self.lbs[(k + 1) * nv:(k + 2) * nv]   # the child's lower bounds, scratch: its propagation overwrites them
        # the node's program's bound with this rank fixed (_lp_fix): a count it puts at tau or above is cut
        # before its DAG bound (this count only: not monotone in it)
        fix_lo = -1
        fix_hi = -1
        fix_off = 0
        if self.lp_ready and self.lp_fixed[k]:
            fix_lo = self.lp_fix_lo[k * self.nt + t]
            fix_hi = self.lp_fix_hi[k * self.nt + t]
            fix_off = (k * self.nt + t) * (self.num_layers + 1)
        l = lo
        if self.resuming:                   # the counts before the stopped run's were searched
            if self.resume_l[k] > hi:
                self.resuming = False
                return
            if self.resume_l[k] > lo:
                l = self.resume_l[k]
        while l <= hi and not self.aborted:
            if self.resuming and l > self.resume_l[k]:
                self.resuming = False
            if fix_lo <= l <= fix_hi and self.lp_fix_val[fix_off + l] >= self.tau * (1.0 + PATH_SLACK):
                self.ctr[PRUNED_PATH] += 1
                l += 1
                continue
            for c in range(v):
                self.layers[c * pp + r] = chunk_layers(l, c, v)
            if k < pp - 1 and self._child_lower_bounds(ca, cb, left - l, s_cap, lb, cap, lb2):
                self._fill(lb2, capt)
                self.ctr[BOUND_EVALS] += 1
                val = self.kernel.longest_into(self.params)
                limit = self.tau * (1.0 + PATH_SLACK)
                if val >= self.tau or val + self._count_gain(
                        ca, cb, lb2, cap, capt, left - l - self._lb_sum(ca, cb, lb2), limit - val) >= limit:
                    self.ctr[PRUNED_BOUND] += 1
                    l += 1
                    continue
                val = 0.0
            else:
                self._fill(lb, capt)
                if k == pp - 1:
                    self.ctr[SIM_CALLS] += 1
                else:
                    self.ctr[BOUND_EVALS] += 1
                val = self.kernel.longest_into(self.params)
                if val >= self.tau:
                    self.ctr[PRUNED_BOUND] += hi - l + 1
                    break
                limit = self.tau * (1.0 + PATH_SLACK)
                if k < pp - 1 and val + self._count_gain(ca, cb, lb, cap, capt, left - l - s_lb,
                                                         limit - val) >= limit:
                    self.ctr[PRUNED_BOUND] += 1      # this count only: the gain is not monotone in it
                    l += 1
                    continue
            if k == pp - 1:
                self.ctr[IMPROVED] += 1
                self.best = val
                self.tau = val * self.shrink
                self.have_best = True
                for y in range(k):
                    self.best_path_t[y] = self.path_t[y]
                    self.best_path_l[y] = self.path_l[y]
                self.best_path_t[k] = t
                self.best_path_l[k] = l
                if self.share_count > 1 and self.tau * (1.0 + SHARE_TIE) < self.share_tau[0]:
                    # the other processes search below it; SHARE_TIE lets them find a plan as fast whose
                    # path is the lesser (best_path), as the walk alone would
                    self.share_tau[0] = self.tau * (1.0 + SHARE_TIE)
                for y in range(pp):
                    self.best_types[y] = self.types[y]
                for y in range(nv):
                    self.best_layers[y] = self.layers[y]
            else:
                self.last[t] = l
                self.down[t] = 1 if (down or (last > 0 and l < last)) else 0
                self.capped[t] = 1 if l == mem else 0
                self.path_t[k] = t
                self.path_l[k] = l
                self._node(k + 1, left - l)
                self.last[t] = last
                self.down[t] = down
                self.capped[t] = capped
            l += 1
        for c in range(v):
            self.layers[c * pp + r] = 0


__all__ = ["COUNTER_NAMES", "SplitResult", "SplitSearch", "chunk_layers"]
