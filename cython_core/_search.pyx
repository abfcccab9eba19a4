# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of poseidon_plugin.search.splits.SplitSearch.

Same algorithm, the same floating-point operations in the same order, the same counters: the search
results of the two are identical (tests run both). Read splits.py for the commented reference; this
file mirrors it function by function. The hot loop builds no Python objects: it fills a C parameter
vector and calls the DAG kernel's ``run`` (poseidon_plugin._core._dag).
"""

from libc.math cimport ceil, fabs, INFINITY
from libc.stdlib cimport free, malloc
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC

from poseidon_plugin._core._dag cimport DagKernel, copy_ints
from poseidon_plugin._core.assignment cimport NEG_F as AS_NEG, assign_into

from array import array

from poseidon_plugin._core.assignment import best_assignment

cdef enum:
    N_MINS = 10

# counter indices, in the order of COUNTER_NAMES (tests compare it with search/counters.py)
cdef enum:
    NODES = 0
    BOUND_EVALS = 1
    SIM_CALLS = 2
    PRUNED_BOUND = 3
    PRUNED_PATH = 4
    PRUNED_MEMORY = 5
    PRUNED_RIDGE = 6
    PRUNED_ORDER = 7
    IMPROVED = 8

# what this twin assumes of the pure search; tests/unit/test_search_twin.py compares each with the
# pure side: counters (search/counters.py), the minima (search/structure_bounds.py MIN_NAMES), the TypeTable
# columns it copies (search/tables.py); SplitSearch.bound_params compares the assembly itself
COUNTER_NAMES = ("nodes", "bound_evals", "sim_calls", "pruned_bound", "pruned_path", "pruned_memory",
                 "pruned_ridge", "pruned_order", "improved")
MIN_NAMES = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
             "head_forward_ms", "head_backward_ms", "allreduce_ms", "embedding_allreduce_ms",
             "head_allreduce_ms", "send_ms")
TABLE_COLUMNS = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
                 "head_forward_ms", "head_backward_ms", "send_cross_ms", "layer_state_bytes",
                 "layer_activation_bytes", "embedding_state_bytes", "embedding_activation_bytes",
                 "head_state_bytes", "head_activation_bytes", "usable_bytes", "allreduce_ms",
                 "embedding_allreduce_ms", "head_allreduce_ms", "send_same_ms", "send_wrap_ms",
                 "has_allreduce", "step_forward_ms", "step_backward_ms", "optimizer_ms", "optimizer_fixed_ms")


cdef double PATH_SLACK = 1e-9
cdef double FIT_SLACK = 1e-12     # see search/structure_bounds.py FIT_SLACK
cdef long long CLOCK_EVERY = 1024


cdef double _monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9
cdef int PROPAGATION_ROUNDS = 3
cdef int INHERITED_ROUNDS = 2       # with the parent's bounds (see search/structure_bounds.py)


cdef double* _dcopy(object seq) except NULL:
    cdef Py_ssize_t n = len(seq), i
    cdef double* out = <double*> malloc((n if n > 0 else 1) * sizeof(double))
    if out == NULL:
        raise MemoryError()
    for i in range(n):
        out[i] = seq[i]
    return out


def _int_view(Py_ssize_t n):
    """A zeroed int buffer of ``n`` entries (at least one)."""
    return array("i", [0]) * (n if n > 0 else 1)


cdef int* _ialloc(Py_ssize_t n) except NULL:
    cdef int* out = <int*> malloc((n if n > 0 else 1) * sizeof(int))
    if out == NULL:
        raise MemoryError()
    return out


def best_capacity_assignment(value, supply, int n):
    """:func:`poseidon_plugin.search.assignment.best_assignment` (compiled): ``(total, types)`` or None."""
    return best_assignment(value, supply, n)


cdef class SplitSearch:
    """Exact (or ridge-pruned) search of one structure; see poseidon_plugin.search.splits."""

    def __cinit__(self, table, shape, int num_layers, *, bint ridge, bint blocks, type_class,
                  double gap=0.0, bint backward=False):
        cdef int t, r, c
        self.params = NULL
        self.forward_ms = self.backward_ms = self.embedding_forward_ms = self.embedding_backward_ms = self.head_forward_ms = self.head_backward_ms = NULL
        self.send_cross_ms = self.layer_state_bytes = self.layer_activation_bytes = self.embedding_state_bytes = self.embedding_activation_bytes = self.head_state_bytes = self.head_activation_bytes = NULL
        self.usable_bytes = self.allreduce_ms = self.embedding_allreduce_ms = self.head_allreduce_ms = self.send_same_ms = self.send_wrap_ms = NULL
        self.step_forward_ms = self.step_backward_ms = self.optimizer_ms = self.optimizer_fixed_ms = NULL
        self.has_allreduce = self.type_class = self.live = self.cap_rank = NULL
        self.coef_f = self.coef_b = self.coef_s = self.coef_ar = NULL
        self.term_ptr = self.term_idx = self.term_coef = self.owner = NULL
        self.counts = self.used = self.hi = self.types = self.slot = self.layers = NULL
        self.last = self.down = self.lbs = self.caps = self.work = self.order = NULL
        self.alpha = self.sf = self.sb = self.sa = NULL
        self.capts = self.vals = self.sl_t = NULL
        self.ecap = self.kroom = self.ordr = self.ordn = self.marg = self.ph_t = NULL
        self.mu1 = self.mu2 = self.rmt = self.ph_mu = NULL
        self.nu1 = self.nu2 = self.rsum = self.gam = self.xs = self.xall = self.rlb = self.gam0 = NULL
        self.zero_lb = NULL
        self.g_slb = self.g_even = self.g_start = self.z_slb = self.z_even = NULL
        self.efull = self.ordf = self.ordfn = self.kfull = NULL
        self.narg = NULL
        self.sl_f = self.sl_b = self.sl_a = NULL
        self.best_types = self.best_layers = NULL
        self.jroom = NULL
        self.jslope = self.jmu = NULL
        if shape.pure_python:
            raise TypeError("the compiled search needs the compiled DAG kernel (shape built with "
                            "pure_python=False)")
        self.kernel = None      # built on the first full search (root checks need no DAG)
        self.table_ref, self.shape_ref, self.type_class_ref = table, shape, type_class
        self.nt = len(table.names)
        self.pp = shape.pp
        self.v = shape.virtual_stages
        self.nv = self.pp * self.v
        self.stride = table.max_slots
        self.num_layers = num_layers
        self.ridge, self.blocks = ridge, blocks
        # decide ranks from the last one (exact search only: the ridge and block rules follow the
        # pipeline order)
        self.backward = backward and not ridge and not blocks
        self.shrink = 1.0 / (1.0 + gap)
        self.n_params = shape.n_params
        self.params = _dcopy(shape.new_params())   # comm-model extras at their defaults
        self.forward_ms = _dcopy(table.forward_ms)
        self.backward_ms = _dcopy(table.backward_ms)
        self.embedding_forward_ms = _dcopy(table.embedding_forward_ms)
        self.embedding_backward_ms = _dcopy(table.embedding_backward_ms)
        self.head_forward_ms = _dcopy(table.head_forward_ms)
        self.head_backward_ms = _dcopy(table.head_backward_ms)
        self.step_forward_ms = _dcopy(table.step_forward_ms)
        self.step_backward_ms = _dcopy(table.step_backward_ms)
        self.optimizer_ms = _dcopy(table.optimizer_ms)
        self.optimizer_fixed_ms = _dcopy(table.optimizer_fixed_ms)
        self.send_cross_ms = _dcopy(table.send_cross_ms)
        self.layer_state_bytes = _dcopy(table.layer_state_bytes)
        self.layer_activation_bytes = _dcopy(table.layer_activation_bytes)
        self.embedding_state_bytes = _dcopy(table.embedding_state_bytes)
        self.embedding_activation_bytes = _dcopy(table.embedding_activation_bytes)
        self.head_state_bytes = _dcopy(table.head_state_bytes)
        self.head_activation_bytes = _dcopy(table.head_activation_bytes)
        self.usable_bytes = _dcopy(table.usable_bytes)
        self.allreduce_ms = _dcopy(table.allreduce_ms)
        self.embedding_allreduce_ms = _dcopy(table.embedding_allreduce_ms)
        self.head_allreduce_ms = _dcopy(table.head_allreduce_ms)
        self.send_same_ms = _dcopy(table.send_same_ms)
        self.send_wrap_ms = _dcopy(table.send_wrap_ms)
        self.has_allreduce = copy_ints(table.has_allreduce)
        self.type_class = copy_ints(type_class)
        self.live = copy_ints(shape.live)
        paths = shape.paths
        self.n_paths = paths.count
        self.coef_f = copy_ints(paths.coef_f)
        self.coef_b = copy_ints(paths.coef_b)
        self.coef_s = copy_ints(paths.coef_s)
        self.coef_ar = copy_ints(paths.coef_ar)
        self.term_ptr = copy_ints(paths.term_ptr)
        self.term_idx = copy_ints(paths.term_idx)
        self.term_coef = copy_ints(paths.term_coef)
        self.owner = copy_ints(paths.owner)
        self.counts = _ialloc(self.nt)
        self.remaining = _int_view(self.nt)
        self.used = _ialloc(self.nt)
        self.hi = _ialloc(self.nt)
        self.lam = _dcopy([0.0] * self.nt)
        self.pcnt = _ialloc(self.n_params)
        self.lcnt = _ialloc(self.nt)
        self.crt = _dcopy([0.0] * (self.pp * self.nt))
        self.jslope = _dcopy([0.0] * (self.nv * self.nt))
        self.jroom = _ialloc(self.nv * self.nt)
        self.jmu = _dcopy([0.0] * (self.nv * self.nt))
        self.types = _ialloc(self.pp)
        self.slot = _ialloc(self.pp)
        self.layers = _ialloc(self.nv)
        self.last = _ialloc(self.nt)
        self.down = _ialloc(self.nt)
        self.capped = _ialloc(self.nt)
        self.lbs = _ialloc((self.pp + 1) * self.nv)
        self.caps = _ialloc((self.pp + 1) * self.nv)
        self.capts = _ialloc((self.pp + 1) * self.nv * self.nt)
        self.vals = _ialloc(self.pp)
        self.ecap = _ialloc(self.pp * self.nt)
        self.kroom = _ialloc(self.pp * self.nt * self.nt)
        self.ordr = _ialloc(self.nt * self.pp)
        self.ordn = _ialloc(self.nt)
        self.marg = _ialloc(self.nt)
        self.ph_t = _ialloc(self.nt)
        self.mu1 = _dcopy([0.0] * self.nt)
        self.mu2 = _dcopy([0.0] * self.nt)
        self.rmt = _dcopy([0.0] * self.nt)
        self.ph_mu = _dcopy([0.0] * self.nt)
        self.nu1 = _dcopy([0.0] * self.nt)
        self.nu2 = _dcopy([0.0] * self.nt)
        self.narg = _ialloc(self.nt)
        self.rsum = _dcopy([0.0] * self.nt)
        self.xs = _dcopy([0.0] * self.v)
        self.xall = _dcopy([0.0] * (self.nv * self.nt))
        self.efull = _ialloc(self.pp * self.nt)
        self.ordf = _ialloc(self.nt * self.pp)
        self.ordfn = _ialloc(self.nt)
        self.kfull = _ialloc(self.pp * self.nt * self.nt)
        self.rlb = _dcopy([0.0] * self.pp)
        self.tmin = _dcopy([0.0] * (self.nt * 9))
        self.fill_f = _dcopy([0.0] * self.pp)
        self.fill_b = _dcopy([0.0] * self.pp)
        self.fill_a = _dcopy([0.0] * self.pp)
        self.gam0 = _dcopy([0.0] * self.pp)
        self.g_slb = _ialloc(self.pp)
        self.g_even = _ialloc(self.pp)
        self.g_start = _ialloc(self.pp)
        self.z_slb = _ialloc(self.pp)
        self.z_even = _ialloc(self.pp)
        for r in range(self.pp):
            self.z_slb[r] = 0
            self.z_even[r] = 1
        self.zero_lb = _ialloc(self.nv)
        for c in range(self.nv):
            self.zero_lb[c] = 0
        self.gam = _dcopy([0.0] * self.pp)
        self.sl_t = _ialloc(self.nt)
        self.sl_f = _dcopy([0.0] * self.nt)
        self.sl_b = _dcopy([0.0] * self.nt)
        self.sl_a = _dcopy([0.0] * self.nt)
        self.work = _ialloc(self.v)
        self.order = _ialloc(self.nv)
        self.alpha = _dcopy([0.0] * self.nv)
        self.sf = _dcopy([0.0] * self.nv)
        self.sb = _dcopy([0.0] * self.nv)
        self.sa = _dcopy([0.0] * self.nv)
        self.best_types = _ialloc(self.pp)
        self.best_layers = _ialloc(self.nv)
        self.cap_rank = _ialloc(self.nt * self.pp)
        self.as_val = array("d", [0.0]) * (self.nt * self.pp)
        self.as_owner = _int_view(self.pp)
        self.as_used = _int_view(self.nt)
        self.as_gain = array("d", [0.0]) * self.nt
        self.as_via_t = _int_view(self.nt)
        self.as_via_r = _int_view(self.nt)
        for t in range(self.nt):
            for r in range(self.pp):
                self.cap_rank[t * self.pp + r] = self._rank_cap(t, r)

    def __dealloc__(self):
        free(self.step_forward_ms); free(self.step_backward_ms); free(self.optimizer_ms); free(self.optimizer_fixed_ms)
        free(self.params); free(self.forward_ms); free(self.backward_ms); free(self.embedding_forward_ms); free(self.embedding_backward_ms); free(self.head_forward_ms)
        free(self.head_backward_ms); free(self.send_cross_ms); free(self.layer_state_bytes); free(self.layer_activation_bytes); free(self.embedding_state_bytes); free(self.embedding_activation_bytes)
        free(self.head_state_bytes); free(self.head_activation_bytes); free(self.usable_bytes); free(self.allreduce_ms); free(self.embedding_allreduce_ms); free(self.head_allreduce_ms)
        free(self.send_same_ms); free(self.send_wrap_ms); free(self.has_allreduce); free(self.type_class); free(self.live); free(self.cap_rank)
        free(self.coef_f); free(self.coef_b); free(self.coef_s); free(self.coef_ar); free(self.term_ptr); free(self.term_idx); free(self.term_coef); free(self.owner); free(self.counts)
        free(self.used); free(self.hi); free(self.lam); free(self.lcnt); free(self.crt); free(self.pcnt); free(self.types); free(self.slot); free(self.layers); free(self.last); free(self.down); free(self.capped)
        free(self.lbs); free(self.capts); free(self.vals); free(self.sl_t); free(self.sl_f); free(self.sl_b); free(self.sl_a); free(self.caps); free(self.work); free(self.order); free(self.alpha); free(self.sf)
        free(self.sb); free(self.sa); free(self.best_types); free(self.best_layers)
        free(self.ecap); free(self.kroom); free(self.ordr); free(self.ordn); free(self.marg); free(self.ph_t)
        free(self.mu1); free(self.mu2); free(self.rmt); free(self.ph_mu)
        free(self.nu1); free(self.nu2); free(self.narg); free(self.rsum); free(self.gam); free(self.xs); free(self.xall); free(self.rlb); free(self.gam0); free(self.zero_lb)
        free(self.tmin); free(self.fill_f); free(self.fill_b); free(self.fill_a)
        free(self.g_slb); free(self.g_even); free(self.g_start); free(self.z_slb); free(self.z_even)
        free(self.efull); free(self.ordf); free(self.ordfn); free(self.kfull)
        free(self.jslope); free(self.jroom); free(self.jmu)

    # --- memory ---------------------------------------------------------------------------------

    cdef double _need(self, int t, int r, int* chunks) noexcept nogil:
        cdef double state = 0.0, chunk_act = 0.0, s, a
        cdef int c, n
        for c in range(self.v):
            n = chunks[c]
            s = n * self.layer_state_bytes[t]
            a = n * self.layer_activation_bytes[t]
            if c == 0 and r == 0:
                s += self.embedding_state_bytes[t]
                a += self.embedding_activation_bytes[t]
            if c == self.v - 1 and r == self.pp - 1:
                s += self.head_state_bytes[t]
                a += self.head_activation_bytes[t]
            state += s
            if a > chunk_act:
                chunk_act = a
        return state + self.live[r] * chunk_act

    cdef int _rank_cap(self, int t, int r) noexcept nogil:
        cdef int lo = 0, hi = self.num_layers, mid, c, v = self.v
        cdef double usable = self.usable_bytes[t]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            for c in range(v):
                self.work[c] = (mid + v - 1 - c) // v
            if self._need(t, r, self.work) > usable:
                hi = mid - 1
            else:
                lo = mid
        return lo

    # --- bounds ---------------------------------------------------------------------------------

    cdef void _unknown_mins(self) noexcept nogil:
        cdef int t, j, i
        cdef double x
        for i in range(N_MINS):
            self.mins[i] = INFINITY
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            self.tmin[t * 9 + 0] = self.forward_ms[t]
            self.tmin[t * 9 + 1] = self.backward_ms[t]
            self.tmin[t * 9 + 2] = self.embedding_forward_ms[t]
            self.tmin[t * 9 + 3] = self.embedding_backward_ms[t]
            self.tmin[t * 9 + 4] = self.head_forward_ms[t]
            self.tmin[t * 9 + 5] = self.head_backward_ms[t]
            self.tmin[t * 9 + 6] = INFINITY
            self.tmin[t * 9 + 7] = INFINITY
            self.tmin[t * 9 + 8] = INFINITY
            if self.send_cross_ms[t] < self.mins[9]:
                self.mins[9] = self.send_cross_ms[t]
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = self.allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < self.tmin[t * 9 + 6]:
                    self.tmin[t * 9 + 6] = x
                x = self.embedding_allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < self.tmin[t * 9 + 7]:
                    self.tmin[t * 9 + 7] = x
                x = self.head_allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < self.tmin[t * 9 + 8]:
                    self.tmin[t * 9 + 8] = x
                if j + 1 < self.counts[t] and self.send_same_ms[i] < self.mins[9]:
                    self.mins[9] = self.send_same_ms[i]
                if j > 0 and self.send_wrap_ms[i] < self.mins[9]:
                    self.mins[9] = self.send_wrap_ms[i]
            for i in range(9):          # the minima over all types are those of the types' own
                if self.tmin[t * 9 + i] < self.mins[i]:
                    self.mins[i] = self.tmin[t * 9 + i]
        for i in range(N_MINS):
            if self.mins[i] == INFINITY:
                self.mins[i] = 0.0

    cdef bint _fits(self, int r, int t, int* lb, int* capt) noexcept nogil:
        # whether type t's caps capt hold the lower bounds of every chunk of rank r
        cdef int c, vs
        for c in range(self.v):
            vs = c * self.pp + r
            if capt[vs * self.nt + t] < lb[vs]:
                return False
        return True

    cdef bint _rank_mins(self, int r, int* lb, int* capt, double* out) noexcept nogil:
        # see splits.SplitSearch._rank_mins: out[0:9] over the remaining types whose caps hold
        # rank r's lower bounds; False when none does
        cdef int nt = self.nt, x, i
        cdef bint found = False
        cdef double* m
        for x in range(nt):
            if self.remaining[x] <= 0 or not self._fits(r, x, lb, capt):
                continue
            m = self.tmin + x * 9
            for i in range(9):
                if not found or m[i] < out[i]:
                    out[i] = m[i]
            found = True
        return found

    cdef void _fill(self, int* lb, int* capt) noexcept nogil:
        # capt: the node's per-type caps (NULL: none); an undecided rank is priced over the remaining
        # types that can hold its lower bounds (see splits.SplitSearch._fill)
        cdef int pp = self.pp, v = self.v, nv = self.nv, r, t, i, c, vs, n, hasar
        cdef double total_ar, fw, bw, arr, efw, ebw, ear, hfw, hbw, har, f, b, sfw, sbw, opt
        cdef double rm[9]
        cdef double* p = self.params
        self._unknown_mins()
        for r in range(pp):
            t = self.types[r]
            total_ar = 0.0
            sfw = sbw = opt = 0.0     # undecided: framework terms left out (still a lower bound)
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
                fw = self.mins[0]
                bw = self.mins[1]
                arr = self.mins[6]
                efw = self.mins[2]
                ebw = self.mins[3]
                hfw = self.mins[4]
                hbw = self.mins[5]
                ear = self.mins[7]
                har = self.mins[8]
                if capt != NULL and self._rank_mins(r, lb, capt, rm):
                    fw = rm[0]
                    bw = rm[1]
                    efw = rm[2]
                    ebw = rm[3]
                    hfw = rm[4]
                    hbw = rm[5]
                    arr = rm[6]
                    ear = rm[7]
                    har = rm[8]
                self.fill_f[r] = fw
                self.fill_b[r] = bw
                self.fill_a[r] = arr
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
            p[1 + 2 * nv + r] = self._send_lb(r, self.mins[9])

    cdef double _send_lb(self, int r, double unknown_min) noexcept nogil:
        cdef int pp = self.pp, n, t, u, i, x
        cdef double best
        cdef bint other
        if pp == 1 or (self.v == 1 and r == pp - 1):
            return 0.0
        n = (r + 1) % pp
        t = self.types[r]
        u = self.types[n]
        if t < 0:
            return unknown_min
        i = t * self.stride + self.slot[r]
        if u >= 0:
            if t != u:
                return self.send_cross_ms[t]
            return self.send_wrap_ms[i] if n == 0 else self.send_same_ms[i]
        best = INFINITY
        if self.remaining[t] > 0:
            # n == 0 only when ranks are decided from the end: the wrap to the type's slot 0
            best = self.send_wrap_ms[i] if n == 0 else self.send_same_ms[i]
        other = False
        for x in range(self.nt):
            if x != t and self.remaining[x] > 0:
                other = True
                break
        if other and self.send_cross_ms[t] < best:
            best = self.send_cross_ms[t]
        return 0.0 if best == INFINITY else best

    cdef bint _propagate(self, int k, int left, int* lb, int* cap, int* capt, int* plb, int* pcap,
                         int* pcapt) noexcept nogil:
        # plb/pcap/pcapt: the parent node's bounds, where ranks k.. start from (NULL: none)
        cdef int pp = self.pp, v = self.v, nt = self.nt, vs, r, x, c, best, rnd, s_cap, s_lb, nl, nc
        cdef int changed, cr, i, ct, rounds
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
                    ct = (cr + v - 1 - c) // v if cr >= 0 else -1
                    if pcapt != NULL and pcapt[i] < ct:
                        ct = pcapt[i]
                    capt[i] = ct
                if cr > best:
                    best = cr
            if best < v:
                self.ctr[PRUNED_MEMORY] += 1
                return False
            for c in range(v):
                vs = c * pp + r
                lb[vs] = 1
                cap[vs] = (best + v - 1 - c) // v
                if plb != NULL:
                    if plb[vs] > 1:
                        lb[vs] = plb[vs]
                    if pcap[vs] < cap[vs]:
                        cap[vs] = pcap[vs]
        rounds = PROPAGATION_ROUNDS if plb == NULL else INHERITED_ROUNDS
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
            if self.tau == INFINITY or k == self.ub - 1 or rnd == rounds - 1:
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

    cdef int _type_slopes(self) noexcept nogil:
        # remaining types with their per-layer forward, backward and cheapest free-slot all-reduce ms
        cdef int t, j, i, n = 0
        cdef double ar, x
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            ar = INFINITY
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = self.allreduce_ms[i] if self.has_allreduce[i] else 0.0
                if x < ar:
                    ar = x
            self.sl_t[n] = t
            self.sl_f[n] = self.forward_ms[t]
            self.sl_b[n] = self.backward_ms[t]
            self.sl_a[n] = 0.0 if ar == INFINITY else ar
            n += 1
        return n

    cdef void _type_room(self, int k, int* lb, int* cap, int* capt, int ns) noexcept nogil:
        # kroom[(r * nt + t2) * nt + t]: see splits.SplitSearch._type_room
        cdef int pp = self.pp, v = self.v, nt = self.nt, i, i2, t, t2, r, c, vs, ct, s, s_lb, j, y, n
        for i in range(pp * nt):
            self.ecap[i] = -1
            self.efull[i] = -1
        for i in range(ns):
            t = self.sl_t[i]
            self.ordn[t] = 0
            self.ordfn[t] = 0
            for r in range(k, self.ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    s_lb = 0
                    for c in range(v):
                        s_lb += lb[c * pp + r]
                    self.efull[r * nt + t] = s
                    j = self.ordfn[t]
                    while j > 0 and self.efull[self.ordf[t * pp + j - 1] * nt + t] < s:
                        self.ordf[t * pp + j] = self.ordf[t * pp + j - 1]
                        j -= 1
                    self.ordf[t * pp + j] = r
                    self.ordfn[t] += 1
                    y = s - s_lb
                    self.ecap[r * nt + t] = y
                    # stable insertion, largest first
                    j = self.ordn[t]
                    while j > 0 and self.ecap[self.ordr[t * pp + j - 1] * nt + t] < y:
                        self.ordr[t * pp + j] = self.ordr[t * pp + j - 1]
                        j -= 1
                    self.ordr[t * pp + j] = r
                    self.ordn[t] += 1
        for r in range(k, self.ub):
            for i2 in range(ns):
                t2 = self.sl_t[i2]
                for i in range(ns):
                    t = self.sl_t[i]
                    n = self.remaining[t] - (1 if t == t2 else 0)
                    self.kroom[(r * nt + t2) * nt + t] = self._top_sum(self.ordr, self.ordn, self.ecap, t, r, n)
                    self.kfull[(r * nt + t2) * nt + t] = self._top_sum(self.ordf, self.ordfn, self.efull, t, r, n)

    cdef int _rank_capacity(self, int r, int t, int* lb, int* cap, int* capt) noexcept nogil:
        # most layers rank r holds on type t (its chunks' caps); -1 when a chunk's cap is below its lb
        cdef int c, vs, ct, s = 0
        for c in range(self.v):
            vs = c * self.pp + r
            ct = capt[vs * self.nt + t]
            if ct > cap[vs]:
                ct = cap[vs]
            if ct < lb[vs]:
                return -1
            s += ct
        return s

    cdef int _top_sum(self, int* order, int* count, int* vals, int t, int r, int n) noexcept nogil:
        # the n largest vals[j * nt + t] over ranks j != r (order: ranks by vals, largest first);
        # -1 when fewer than n ranks can host t and the counts are exact
        cdef int total = 0, got = 0, y, j
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

    cdef double _phi(self, int e, int r, int t2, int ns, double* mu1, double* mu2, int* marg, int* kt) noexcept nogil:
        # see splits.SplitSearch._phi
        cdef int nt = self.nt, i, j, t, kk, take, n = 0
        cdef double mu, cost = 0.0
        for i in range(ns):
            t = self.sl_t[i]
            if kt[(r * nt + t2) * nt + t] < 0:
                return INFINITY
            mu = mu2[t] if marg[t] == r else mu1[t]
            j = n
            while j > 0 and (self.ph_mu[j - 1] > mu or (self.ph_mu[j - 1] == mu and self.ph_t[j - 1] > t)):
                self.ph_mu[j] = self.ph_mu[j - 1]
                self.ph_t[j] = self.ph_t[j - 1]
                j -= 1
            self.ph_mu[j] = mu
            self.ph_t[j] = t
            n += 1
        for i in range(n):
            if e <= 0:
                break
            kk = kt[(r * nt + t2) * nt + self.ph_t[i]]
            if kk == 0:
                continue
            take = e if e < kk else kk
            cost += take * self.ph_mu[i]
            e -= take
        if e <= 0:
            return cost
        return INFINITY

    cdef double _gammas(self, int q, int k, int* lb, int* room_of, double* gam, int ns, int* slb,
                        int* even, int* start) noexcept nogil:
        # see splits.SplitSearch._gammas; slb/even/start: per rank its lb layers, whether they are
        # spread like a rank's layers, and s_lb mod V (the same for every path: _path_caps sets them)
        cdef int pp = self.pp, v = self.v, nt = self.nt, r, i, t, c, j, s_lb, top, x
        cdef double gsum = 0.0, gmax, g, beta, acc, w
        for r in range(k, self.ub):
            s_lb = slb[r]
            gmax = 0.0
            for i in range(ns):
                t = self.sl_t[i]
                if room_of[r * nt + t] < 0:
                    continue
                beta = 0.0
                for c in range(v):
                    # the slopes the path loop stored (same operations as splits.py's)
                    self.xs[c] = self.xall[(c * pp + r) * nt + i]
                    beta += self.xs[c]
                beta = beta / v
                g = 0.0
                if even[r]:
                    top = v - 1 if v - 1 < room_of[r * nt + t] else room_of[r * nt + t]
                    acc = 0.0
                    x = start[r]
                    for j in range(1, top + 1):
                        acc += self.xs[x]          # xs[(s_lb + j - 1) % v]
                        x += 1
                        if x == v:
                            x = 0
                        if beta * j - acc > g:
                            g = beta * j - acc
                else:
                    w = 0.0
                    for c in range(v):
                        w += self.xs[c] * ((<double> (c + v * lb[c * pp + r])) / v)
                    if w - beta * s_lb > g:
                        g = w - beta * s_lb
                if g > gmax:
                    gmax = g
            gam[r] = gmax
            gsum += gmax
        return gsum

    cdef int _path_caps(self, int k, int left, int* lb, int* cap, int* capt) noexcept nogil:
        cdef int pp = self.pp, v = self.v, nv = self.nv, nt = self.nt, vs, r, q, c, cf, cr
        cdef int changed = 0, ns, i, t, ct, top, kf, kb, ka, d
        cdef int extra = left, e
        cdef double limit = self.tau * (1.0 + PATH_SLACK), base, a, a1, amax, m, slope, room, x, y
        cdef double numer, lift, b1, b2, rmin, xmin, extra_t, rhs, gsum, own, lbo, gsum0, pn
        cdef int elb = 0
        cdef int n
        cdef int argr, s_lb, ct_sum, u, c2
        cdef bint fit
        cdef double* p = self.params
        self._fill(lb, capt)
        ns = self._type_slopes()
        for r in range(k, self.ub):
            for c in range(v):
                extra -= lb[c * pp + r]
        self._type_room(k, lb, cap, capt, ns)
        for r in range(k, self.ub):            # per rank, for _gammas (the same for every path)
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            self.g_slb[r] = s_lb
            self.g_start[r] = s_lb % v
            self.g_even[r] = 1
            for c in range(v):
                if (s_lb + v - 1 - c) // v != lb[c * pp + r]:
                    self.g_even[r] = 0
        for q in range(self.n_paths):
            cf = q * nv
            cr = q * pp
            if self.owner[q] < k or self.owner[q] >= self.ub:
                continue
            base = 0.0
            for e in range(self.term_ptr[q], self.term_ptr[q + 1]):
                base += self.term_coef[e] * p[self.term_idx[e]]
            a1 = INFINITY
            amax = 0.0
            lift = 0.0
            b1 = INFINITY
            b2 = INFINITY
            argr = -1
            for i in range(ns):
                t = self.sl_t[i]
                self.mu1[t] = INFINITY
                self.mu2[t] = INFINITY
                self.marg[t] = -1
                self.nu1[t] = INFINITY
                self.nu2[t] = INFINITY
                self.narg[t] = -1
            gsum = -1.0             # the gammas of this path: computed when first needed
            for r in range(k, self.ub):
                rmin = INFINITY
                self.rlb[r] = 0.0
                s_lb = 0
                for i in range(ns):
                    t = self.sl_t[i]
                    self.rmt[t] = INFINITY
                    self.rsum[t] = 0.0
                for c in range(v):
                    vs = c * pp + r
                    kf = self.coef_f[cf + vs]
                    kb = self.coef_b[cf + vs]
                    ka = self.coef_ar[cr + r]
                    s_lb += lb[vs]
                    if kf == 0 and kb == 0 and ka == 0:
                        # off the path: every slope is 0 (what the loop below computes, faster)
                        self.alpha[vs] = 0.0
                        a1 = 0.0
                        rmin = 0.0
                        for i in range(ns):
                            self.rmt[self.sl_t[i]] = 0.0
                            self.xall[vs * nt + i] = 0.0
                        continue
                    a = INFINITY
                    for i in range(ns):
                        x = kf * self.sl_f[i] + kb * self.sl_b[i] + ka * self.sl_a[i]
                        self.xall[vs * nt + i] = x
                        if x < a:
                            a = x
                        t = self.sl_t[i]
                        if x < self.rmt[t]:
                            self.rmt[t] = x
                        self.rsum[t] += x
                    self.alpha[vs] = a
                    self.rlb[r] += lb[vs] * a
                    lift += lb[vs] * (a - (kf * self.fill_f[r] + kb * self.fill_b[r] + ka * self.fill_a[r]))
                    if a < a1:
                        a1 = a
                    if a > amax:
                        amax = a
                    if a < rmin:
                        rmin = a
                if rmin < b1:
                    b2 = b1
                    b1 = rmin
                    argr = r
                elif rmin < b2:
                    b2 = rmin
                for i in range(ns):
                    t = self.sl_t[i]
                    y = self.rmt[t]
                    if y < self.mu1[t]:
                        self.mu2[t] = self.mu1[t]
                        self.mu1[t] = y
                        self.marg[t] = r
                    elif y < self.mu2[t]:
                        self.mu2[t] = y
                    y = self.rsum[t] / v
                    if y < self.nu1[t]:
                        self.nu2[t] = self.nu1[t]
                        self.nu1[t] = y
                        self.narg[t] = r
                    elif y < self.nu2[t]:
                        self.nu2[t] = y
            base += lift
            if base + extra * a1 >= limit:
                return -1
            if extra > 0 and base + extra * amax >= limit:
                if base + self._knapsack(k, self.ub, extra, lb, cap) >= limit:
                    return -1
            if b2 == INFINITY:
                continue
            r = self.owner[q]
            lbo = -1.0
            gsum0 = -1.0
            if r >= k and r < self.ub:
                m = b2 if r == argr else b1
                numer = limit - base - m * extra
                ka = self.coef_ar[cr + r]
                s_lb = 0
                for c in range(v):
                    s_lb += lb[c * pp + r]
                for i in range(ns):
                    t = self.sl_t[i]
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
                    xmin = INFINITY
                    extra_t = 0.0
                    for c in range(v):
                        vs = c * pp + r
                        x = self.coef_f[cf + vs] * self.sl_f[i] + self.coef_b[cf + vs] * self.sl_b[i] \
                            + ka * self.sl_a[i]
                        extra_t += lb[vs] * (x - self.alpha[vs])
                        if x < xmin:
                            xmin = x
                    d = ct_sum - s_lb
                    if d > extra:
                        d = extra
                    slope = xmin - m
                    if slope > 0.0:
                        room = (numer - extra_t) / slope
                        if room < d + 1:
                            if room <= 0.0:
                                d = -1
                            else:
                                d = <int> ceil(room) - 1
                    rhs = limit - base - extra_t
                    while d >= 0:
                        own = 0.0
                        for c in range(v):
                            vs = c * pp + r
                            n = (s_lb + d + v - 1 - c) // v - lb[vs]
                            if n < 0:
                                own = INFINITY
                                break
                            own += n * (self.coef_f[cf + vs] * self.sl_f[i] + self.coef_b[cf + vs] * self.sl_b[i]
                                        + ka * self.sl_a[i])
                        if own < INFINITY:
                            # the four placement bounds of splits.py (the d layers fit when own plus
                            # each stays below rhs: order-free), a pair at a time. Without its
                            # rounding loss, a pair's mean-slope bound is at least both of the pair
                            # (mu <= nu, gammas >= 0): when it fits, the pair fits, gammas unneeded
                            if lbo < 0.0:
                                lbo = 0.0
                                elb = 0
                                for c2 in range(k, self.ub):
                                    if c2 != r:
                                        lbo += self.rlb[c2]
                                        for c in range(v):
                                            elb += lb[c * pp + c2]
                            fit = True
                            pn = INFINITY
                            if v > 1:
                                pn = self._phi(elb + extra - d, r, t, ns, self.nu1, self.nu2, self.narg, self.kfull)
                            if v == 1 or not own + (pn - lbo) < rhs - FIT_SLACK * (fabs(rhs) + fabs(own) + fabs(pn)):
                                if v > 1:
                                    if gsum0 < 0.0:
                                        gsum0 = self._gammas(q, k, self.zero_lb, self.efull, self.gam0, ns,
                                                             self.z_slb, self.z_even, self.z_slb)
                                    fit = own + (pn - (gsum0 - self.gam0[r]) - lbo) < rhs
                                fit = fit and own + (self._phi(elb + extra - d, r, t, ns, self.mu1, self.mu2,
                                                               self.marg, self.kfull) - lbo) < rhs
                            if fit:
                                pn = INFINITY
                                if v > 1:
                                    pn = self._phi(extra - d, r, t, ns, self.nu1, self.nu2, self.narg, self.kroom)
                                if v == 1 or not own + pn < rhs - FIT_SLACK * (fabs(rhs) + fabs(own) + fabs(pn)):
                                    if v > 1:
                                        if gsum < 0.0:
                                            gsum = self._gammas(q, k, lb, self.ecap, self.gam, ns, self.g_slb,
                                                                self.g_even, self.g_start)
                                        fit = own + (pn - (gsum - self.gam[r])) < rhs
                                    fit = fit and own + self._phi(extra - d, r, t, ns, self.mu1, self.mu2,
                                                                  self.marg, self.kroom) < rhs
                            if fit:
                                break
                        d -= 1
                    if d < ct_sum - s_lb:
                        u = s_lb + d if d >= 0 else -1
                        for c in range(v):
                            vs = c * pp + r
                            if u >= 0:
                                ct = (u + v - 1 - c) // v
                            else:
                                ct = -1
                            if ct < lb[vs]:
                                ct = lb[vs] - 1
                            if ct < capt[vs * nt + t]:
                                capt[vs * nt + t] = ct
                for c in range(v):
                    vs = c * pp + r
                    top = -1
                    for i in range(ns):
                        t = self.sl_t[i]
                        if self._fits(r, t, lb, capt) and capt[vs * nt + t] > top:
                            top = capt[vs * nt + t]
                    if top < lb[vs]:
                        return -1
                    if top < cap[vs]:
                        cap[vs] = top
                        changed = 1
        return changed

    cdef double _count_gain(self, int a, int b, int* lb, int* cap, int* capt, int extra, double need) noexcept nogil:
        # After a DAG bound run: along its longest path (kernel.critical), how much more the
        # undecided ranks [a, b) cost at least than the fill priced them when the remaining types go
        # to exactly their counts (a Lagrangian bound of that assignment, multipliers the per-type
        # mean gains); every completion below tau is at least the bound plus this
        cdef int pp = self.pp, v = self.v, nt = self.nt, nv = self.nv, r, c, i, vs, t, nf, nb, na, s_lb
        cdef double x, m1, ll, y
        cdef int* cnt = self.pcnt
        self.kernel.critical(self.params, cnt)
        for t in range(nt):
            self.lam[t] = 0.0
            self.lcnt[t] = 0
        for r in range(a, b):
            na = cnt[1 + 2 * nv + pp + r]
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            for t in range(nt):
                self.crt[r * nt + t] = INFINITY
                if self.remaining[t] <= 0:
                    continue
                if not self._fits(r, t, lb, capt):
                    continue
                x = na * s_lb * (self.tmin[t * 9 + 6] - self.fill_a[r])
                for c in range(v):
                    vs = c * pp + r
                    nf = cnt[1 + r * v + c]
                    nb = cnt[1 + nv + r * v + c]
                    x += lb[vs] * (nf * (self.tmin[t * 9] - self.fill_f[r])
                                   + nb * (self.tmin[t * 9 + 1] - self.fill_b[r]))
                self.crt[r * nt + t] = x
                self.lam[t] += x
                self.lcnt[t] += 1
            # the extra layers: each costs, along the path, at least its stage's slope on the
            # cheapest type that fits the rank
            for c in range(v):
                vs = c * pp + r
                y = INFINITY
                for t in range(nt):
                    if self.crt[r * nt + t] == INFINITY:
                        continue
                    x = (cnt[1 + r * v + c] * self.tmin[t * 9] + cnt[1 + nv + r * v + c] * self.tmin[t * 9 + 1]
                         + na * self.tmin[t * 9 + 6])
                    self.jslope[vs * nt + t] = x
                    if x < y:
                        y = x
                self.alpha[vs] = y if y < INFINITY else 0.0
        ll = self._knapsack(a, b, extra, lb, cap)   # the extra layers, cheapest first
        for t in range(nt):
            if self.lcnt[t] > 0:
                self.lam[t] /= self.lcnt[t]
        for r in range(a, b):
            m1 = INFINITY
            for t in range(nt):
                x = self.crt[r * nt + t] - self.lam[t]
                if x < m1:
                    m1 = x
            ll += m1
        for t in range(nt):
            if self.remaining[t] > 0:
                ll += self.lam[t] * self.remaining[t]
        if ll < need:
            x = self._joint_gain(a, b, lb, cap, capt, extra, need)
            if x > ll:
                ll = x
        return ll if ll > 0.0 else 0.0   # (the extra part alone is >= 0)

    cdef double _joint_gain(self, int a, int b, int* lb, int* cap, int* capt, int extra, double need) noexcept nogil:
        # bounds.StructureBounds._joint_gain: the lower-bound and the extra layers together, the
        # layer sum relaxed with one multiplier mu (bisection over the sorted distinct slopes), the
        # type assignment exact
        cdef int pp = self.pp, v = self.v, nt = self.nt, r, t, c, vs, ct, nmu = 0, j, lo, hi, mid
        cdef double x, best
        for r in range(a, b):
            for t in range(nt):
                if self.crt[r * nt + t] == INFINITY:
                    continue
                for c in range(v):
                    vs = c * pp + r
                    ct = capt[vs * nt + t]
                    if cap[vs] < ct:
                        ct = cap[vs]
                    self.jroom[vs * nt + t] = ct - lb[vs]
                    if ct > lb[vs]:
                        # insert into the sorted distinct list
                        x = self.jslope[vs * nt + t]
                        j = nmu
                        while j > 0 and self.jmu[j - 1] > x:
                            j -= 1
                        if j > 0 and self.jmu[j - 1] == x:
                            continue
                        lo = nmu
                        while lo > j:
                            self.jmu[lo] = self.jmu[lo - 1]
                            lo -= 1
                        self.jmu[j] = x
                        nmu += 1
        if nmu == 0:
            return self._joint_at(a, b, 0.0, extra)
        best = -INFINITY
        lo = 0
        hi = nmu - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            x = self._joint_at(a, b, self.jmu[mid], extra)
            if x > best:
                best = x
            if best >= need:
                break
            if self.jslack > 0:
                lo = mid + 1
            else:
                hi = mid - 1
        return best

    cdef double _joint_at(self, int a, int b, double mu, int extra) noexcept nogil:
        # bounds.StructureBounds._joint_at: the joint bound at one multiplier; sets jslack
        cdef int pp = self.pp, v = self.v, nt = self.nt, n = b - a, r, t, c, vs, i, filled = 0
        cdef double x, got
        for t in range(nt):
            for i in range(n):
                self.as_val[t * pp + i] = AS_NEG
        for r in range(a, b):
            for t in range(nt):
                if self.crt[r * nt + t] == INFINITY:
                    continue
                x = self.crt[r * nt + t]
                for c in range(v):
                    vs = c * pp + r
                    if self.jslope[vs * nt + t] < mu:
                        x += (self.jslope[vs * nt + t] - mu) * self.jroom[vs * nt + t]
                self.as_val[t * pp + r - a] = -x
        got = self._assign(n)
        if got == -INFINITY:
            self.jslack = 0
            return INFINITY
        for i in range(n):
            t = self.as_owner[i]
            for c in range(v):
                vs = c * pp + a + i
                if self.jslope[vs * nt + t] <= mu:
                    filled += self.jroom[vs * nt + t]
        self.jslack = extra - filled
        return mu * extra - got

    cdef int _lb_sum(self, int a, int b, int* lb) noexcept nogil:
        cdef int r, c, s = 0
        for r in range(a, b):
            for c in range(self.v):
                s += lb[c * self.pp + r]
        return s

    cdef bint _type_mass(self, int k, int left, int* lb, int* cap, int* capt) noexcept nogil:
        return self._type_capacity(k, self.ub, lb, cap, capt) >= left

    cdef int _type_capacity(self, int k, int ub, int* lb, int* cap, int* capt) noexcept nogil:
        cdef int pp = self.pp, v = self.v, nt = self.nt, t, n, r, c, vs, ct, s, nvals, j, y, total = 0
        if self.exact_counts and k < ub:
            # with exact counts, the best assignment (at most the per-type sum below, where every
            # type may count the same roomy ranks; -1 where that sum finds too few ranks for a type)
            return self._assign_capacity(k, ub, lb, cap, capt)
        for t in range(nt):
            n = self.remaining[t]
            if n <= 0:
                continue
            nvals = 0
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    # insertion into a descending list
                    j = nvals
                    while j > 0 and self.vals[j - 1] < s:
                        self.vals[j] = self.vals[j - 1]
                        j -= 1
                    self.vals[j] = s
                    nvals += 1
            for y in range(n if n < nvals else nvals):
                total += self.vals[y]
        return total

    cdef int _assign_capacity(self, int k, int ub, int* lb, int* cap, int* capt) noexcept nogil:
        # see bounds.StructureBounds._assign_capacity: the best assignment of the remaining types
        # to ranks k..ub-1 (exact counts); -1 when none exists (integral values: exact in doubles)
        cdef int pp = self.pp, nt = self.nt, n = ub - k, r, t, s
        cdef double got
        for t in range(nt):
            for r in range(n):
                s = self._rank_capacity(k + r, t, lb, cap, capt) if self.remaining[t] > 0 else -1
                self.as_val[t * pp + r] = s if s >= 0 else AS_NEG
        got = self._assign(n)
        return -1 if got == -INFINITY else <int> got

    cdef double _assign(self, int n) noexcept nogil:
        # the best assignment of as_val (type t at position r: as_val[t * pp + r]) to n positions,
        # type t at most remaining[t] times: assignment.assign_into on the search's scratch
        return assign_into(n, self.nt, self.pp, self.as_val, self.remaining, self.as_owner,
                           self.as_used, self.as_gain, self.as_via_t, self.as_via_r)

    cdef double _knapsack(self, int k, int ub, int extra, int* lb, int* cap) noexcept nogil:
        # the extra layers over the stages of ranks k..ub-1 (self.alpha: their slopes)
        # stable insertion sort by slope, in the generation order of splits.py (rank, then chunk)
        cdef int n = 0, vs, j, take, x, r, c, pp = self.pp
        cdef double cost = 0.0
        for r in range(k, ub):
            for c in range(self.v):
                vs = c * pp + r
                j = n
                while j > 0 and self.alpha[self.order[j - 1]] > self.alpha[vs]:
                    self.order[j] = self.order[j - 1]
                    j -= 1
                self.order[j] = vs
                n += 1
        for j in range(n):
            x = self.order[j]
            take = cap[x] - lb[x]
            if take > extra:
                take = extra
            cost += take * self.alpha[x]
            extra -= take
            if extra <= 0:
                break
        return cost

    # --- search ---------------------------------------------------------------------------------

    cdef int _type_allowed(self, int r, int t) noexcept nogil:
        cdef int prev, x
        if self.remaining[t] <= 0:
            return -1
        if self.blocks and r > 0:
            prev = self.types[r - 1]
            if prev != t and (self.remaining[prev] > 0 or self.used[t] > 0):
                return PRUNED_ORDER
        if self.remaining[t] == self.counts[t]:
            for x in range(t):
                if (self.type_class[x] == self.type_class[t] and self.remaining[x] == self.counts[x]
                        and self.counts[x] == self.counts[t]):
                    return PRUNED_ORDER
        return 0

    cdef void _root_check(self) noexcept nogil:
        self.ctr[NODES] += 1
        if self._propagate(0, self.num_layers, self.lbs, self.caps, self.capts, NULL, NULL, NULL):
            self.best = 0.0

    cdef void _node(self, int k, int left) noexcept nogil:
        # depth k decides rank r: k in pipeline order, or pp - 1 - k from the end (backward); the
        # undecided ranks are [a, b)
        cdef int t, why, r, a, b
        cdef bint ok
        cdef int* lb = self.lbs + k * self.nv
        cdef int* cap = self.caps + k * self.nv
        if self.aborted:
            return
        self.ctr[NODES] += 1
        if (self.ctr[NODES] % CLOCK_EVERY == 0 and _monotonic() > self.deadline) or \
                self.ctr[NODES] == self.max_nodes:
            self.aborted = True
            return
        if self.backward:
            r = self.pp - 1 - k
            a = 0
            b = self.pp - k
        else:
            r = k
            a = k
            b = self.pp
        self.ub = b
        if k == 0:
            ok = self._propagate(a, left, lb, cap, self.capts, NULL, NULL, NULL)
        else:
            ok = self._propagate(a, left, lb, cap, self.capts + k * self.nv * self.nt, lb - self.nv,
                                 cap - self.nv, self.capts + (k - 1) * self.nv * self.nt)
        if not ok:
            return
        for t in range(self.nt):
            why = self._type_allowed(r, t)
            if why:
                if why > 0:
                    self.ctr[why] += 1
                continue
            self.types[r] = t
            if self.backward:
                self.hi[t] -= 1
                self.slot[r] = self.hi[t]
            else:
                self.slot[r] = self.used[t]
                self.used[t] += 1
            self.remaining[t] -= 1
            self._children(k, r, a, b, left, t, lb, cap, self.capts + k * self.nv * self.nt)
            self.types[r] = -1
            self.remaining[t] += 1
            if self.backward:
                self.hi[t] += 1
            else:
                self.used[t] -= 1

    cdef bint _child_lower_bounds(self, int a, int b, int rest, int s_cap, int* lb, int* cap, int* out) noexcept nogil:
        # see splits.SplitSearch._child_lower_bounds: the stages of ranks [a, b) hold rest layers
        cdef int vs, x
        cdef bint raised = False
        for vs in range(self.nv):
            out[vs] = lb[vs]
            if a <= vs % self.pp < b:
                x = rest - (s_cap - cap[vs])
                if x > lb[vs]:
                    out[vs] = x
                    raised = True
        return raised

    cdef void _children(self, int k, int r, int a, int b, int left, int t, int* lb, int* cap,
                        int* capt) noexcept nogil:
        # depth k, rank r, undecided ranks [a, b); the child's are [ca, cb)
        cdef int pp = self.pp, v = self.v, nv = self.nv, lo = v, hi = self.num_layers, mem, last, down, capped
        cdef int l, x, y, c, vs, ct, room, s_cap, s_lb, ca, cb
        cdef int* lb2
        cdef double val
        ca = a + 1 if r == a else a
        cb = b if r == a else b - 1
        for c in range(v):
            vs = c * pp + r
            x = v * lb[vs] - v + 1 + c
            if x > lo:
                lo = x
            ct = capt[vs * self.nt + t]
            x = v * (cap[vs] if cap[vs] < ct else ct) + c
            if x < hi:
                hi = x
        if k < pp - 1:
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
        if self.ridge and last > 0 and (down or not capped) and last < hi:
            x = lo - 1
            if last > x:
                x = last
            self.ctr[PRUNED_RIDGE] += hi - x
            hi = last
        # the DAG bound with the later ranks' lower bounds raised for each count (see splits.py)
        s_cap = 0
        if k < pp - 1:
            for vs in range(nv):
                if ca <= vs % pp < cb:
                    s_cap += cap[vs]
        s_lb = self._lb_sum(ca, cb, lb)   # the later ranks' layers at lb (the gain's extra layers: the rest)
        lb2 = lb + nv            # the child's lower bounds, scratch: its propagation overwrites them
        l = lo
        while l <= hi and not self.aborted:
            for c in range(v):
                self.layers[c * pp + r] = (l + v - 1 - c) // v
            if k < pp - 1 and self._child_lower_bounds(ca, cb, left - l, s_cap, lb, cap, lb2):
                self._fill(lb2, capt)
                self.ctr[BOUND_EVALS] += 1
                val = self.kernel.run(self.params)
                if val >= self.tau or val + self._count_gain(
                        ca, cb, lb2, cap, capt, left - l - self._lb_sum(ca, cb, lb2),
                        self.tau * (1.0 + PATH_SLACK) - val) >= self.tau * (1.0 + PATH_SLACK):
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
                val = self.kernel.run(self.params)
                if val >= self.tau:
                    self.ctr[PRUNED_BOUND] += hi - l + 1
                    break
                if k < pp - 1 and val + self._count_gain(ca, cb, lb, cap, capt, left - l - s_lb,
                                                         self.tau * (1.0 + PATH_SLACK) - val) \
                        >= self.tau * (1.0 + PATH_SLACK):
                    self.ctr[PRUNED_BOUND] += 1     # this count only: the gain is not monotone in it
                    l += 1
                    continue
            if k == pp - 1:
                self.ctr[IMPROVED] += 1
                self.best = val
                self.tau = val * self.shrink
                self.have_best = True
                for y in range(pp):
                    self.best_types[y] = self.types[y]
                for y in range(nv):
                    self.best_layers[y] = self.layers[y]
            else:
                self.last[t] = l
                self.down[t] = 1 if (down or (last > 0 and l < last)) else 0
                self.capped[t] = 1 if l == mem else 0
                self._node(k + 1, left - l)
                self.last[t] = last
                self.down[t] = down
                self.capped[t] = capped
            l += 1
        for c in range(v):
            self.layers[c * pp + r] = 0

    def bound_params(self, counts, types, layers, lb, capt=None):
        """The DAG bound's parameter vector with the ranks ``types[r] >= 0`` decided (``layers`` per
        virtual stage; 0: undecided, priced at ``lb``, over the types whose per-type caps ``capt``
        (``vs * nt + t``; None: none) hold it): what ``_fill`` writes. For the tests that compare
        this twin with splits.SplitSearch.bound_params field by field."""
        cdef int t, r, i
        for t in range(self.nt):
            self.counts[t] = counts[t]
            self.remaining[t] = counts[t]
            self.used[t] = 0
            self.hi[t] = counts[t]
        self.ub = self.pp
        for r in range(self.pp):
            t = types[r]
            self.types[r] = t
            self.slot[r] = 0
            if t >= 0:
                self.slot[r] = self.used[t]
                self.remaining[t] -= 1
                self.used[t] += 1
        for i in range(self.nv):
            self.layers[i] = layers[i]
            self.lbs[i] = lb[i]
        if capt is not None:
            for i in range(self.nv * self.nt):
                self.capts[i] = capt[i]
        self._fill(self.lbs, self.capts if capt is not None else NULL)
        for i in range(self.nv):
            self.layers[i] = 0
        return [self.params[i] for i in range(self.n_params)]

    def run(self, counts, double tau, *, bint root_only=False, double deadline=INFINITY,
            long long max_nodes=0):
        """Best plan with time ``< tau`` for ``counts`` ranks per type (``root_only``: bound check)."""
        from poseidon_plugin.search.splits import SplitResult
        cdef int t, total = 0, i
        for t in range(self.nt):
            self.counts[t] = counts[t]
            self.remaining[t] = counts[t]
            self.used[t] = 0
            self.hi[t] = counts[t]
            total += counts[t]
        self.ub = self.pp
        for i in range(self.pp):
            self.types[i] = -1
            self.slot[i] = 0
        for i in range(self.nv):
            self.layers[i] = 0
        for i in range(self.nt):
            self.last[i] = 0
            self.down[i] = 0
            self.capped[i] = 0
        for i in range(9):
            self.ctr[i] = 0
        self.tau = tau
        self.best = INFINITY
        self.have_best = False
        self.deadline = deadline
        self.max_nodes = max_nodes
        self.aborted = False
        self.exact_counts = total == self.pp
        if root_only and total >= self.pp:
            with nogil:
                self._root_check()
        elif total == self.pp:
            if self.kernel is None:
                self.kernel = <DagKernel?> self.shape_ref.kernel
            with nogil:
                self._node(0, self.num_layers)
        if self.have_best:
            types = tuple(self.best_types[i] for i in range(self.pp))
            layers = tuple(self.best_layers[i] for i in range(self.nv))
        else:
            types = layers = ()
        return SplitResult(time_ms=self.best, types=types, layers=layers,
                           counters=tuple(self.ctr[i] for i in range(9)), aborted=self.aborted)
