# Types of poseidon_plugin/search/relaxation_bound.py, compiled as poseidon_plugin._core.relaxation_bound:
# the relaxation bound's scratch (set by SplitSearch.__init__) and its methods, on top of StructureBounds.
cimport cython
from poseidon_plugin._core.structure_bounds cimport StructureBounds, chunk_layers

cdef double INF, NEG_F, LP_EPS, LP_PRICE_SLACK, PATH_SLACK
cdef int LP_DUAL_PIVOTS, LP_KEEP, LP_MAX, LP_MAX_OPTIONS, LP_PIVOTS, N_TYPE_MINS
cdef int MIN_FORWARD, MIN_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_EMBEDDING_BACKWARD, MIN_HEAD_FORWARD
cdef int MIN_HEAD_BACKWARD, MIN_ALLREDUCE, MIN_EMBEDDING_ALLREDUCE, MIN_HEAD_ALLREDUCE

cdef class RelaxationBound(StructureBounds):
    cdef int n_par
    cdef int[::1] lp_free, lp_cnt, lp_basis, lp_nz, lp_lo, lp_hi
    cdef int[::1] lp_opt_r, lp_opt_t, lp_opt_l, lp_pool, lp_kept, lp_pool_used, lp_fixed, lp_fix_lo, lp_fix_hi
    cdef double[::1] lp_base, lp_weight, lp_point, lp_rank, lp_lam, lp_tab, lp_obj, lp_best_w, lp_fix_val
    cdef double[::1] lp_fix_min
    cdef double lp_const, lp_best_mu, lp_best_c
    cdef bint lp_have, lp_no_assignment
    cdef bint lp_ready
    cdef int lp_n_opt, lp_slack0, lp_art0, lp_w, lp_m, lp_layer_row

    @cython.locals(best=cython.double, scale=cython.double, mu=cython.double, total=cython.double,
                   x=cython.double, got=cython.double, value=cython.double, dag=cython.double,
                   n_paths=cython.int, n_opt=cython.int, n_lam=cython.int, q=cython.int, priced=cython.bint)
    cdef double _relaxation_bound(self, int k, int a, int b, int left, int[::1] lb, int[::1] cap, int[::1] capt,
                                  double need) noexcept
    @cython.locals(tab='double[::1]', obj='double[::1]', x=cython.double, n_opt=cython.int, n_types=cython.int,
                   hi=cython.int)
    cdef bint _lp_build(self, int a, int b, int left, int n_paths, double scale) noexcept nogil
    @cython.locals(tab='double[::1]', x=cython.double)
    cdef inline void _lp_path_row(self, int q, int off, double scale) noexcept nogil
    @cython.locals(x=cython.double)
    cdef inline double _lp_option_cost(self, int q, int j) noexcept nogil
    @cython.locals(tab='double[::1]', f=cython.double, basic=cython.int)
    cdef inline bint _lp_cut(self, int q, double scale) noexcept nogil
    @cython.locals(x=cython.double)
    cdef inline void _lp_objective(self) noexcept nogil
    cdef inline double _lp_value(self) noexcept nogil
    @cython.locals(x=cython.double)
    cdef inline void _lp_point(self) noexcept nogil
    @cython.locals(tab='double[::1]', obj='double[::1]', best=cython.double, x=cython.double, ratio=cython.double,
                   top=cython.double)
    cdef inline bint _lp_simplex(self) noexcept nogil
    @cython.locals(tab='double[::1]', obj='double[::1]', best=cython.double, x=cython.double, ratio=cython.double,
                   worst=cython.double, d=cython.double, piv=cython.double)
    cdef inline bint _lp_dual_simplex(self) noexcept nogil
    @cython.locals(tab='double[::1]', obj='double[::1]', nz='int[::1]', p=cython.double, f=cython.double,
                   x=cython.double, n=cython.int, e=cython.int, j=cython.int)
    cdef inline void _lp_pivot(self, int pr, int pc) noexcept nogil
    cdef inline void _lp_range(self, int r, int t, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    @cython.locals(f=cython.double, bw=cython.double, total_ar=cython.double, tm='double[::1]')
    cdef inline void _lp_put_rank(self, double[::1] out, int off, int r, int t, int l) noexcept nogil
    @cython.locals(x=cython.double)
    cdef inline double _lp_rank_cost(self, int r, int t, int l) noexcept nogil
    @cython.locals(x=cython.double)
    cdef inline void _lp_weights(self, int n_paths) noexcept nogil
    @cython.locals(got=cython.double, value=cython.double)
    cdef double _lp_price(self, int a, int b, int left, double mu, int n, double best, double need) noexcept nogil
    @cython.locals(x=cython.double, got=cython.double)
    cdef inline double _lp_oracle(self, int a, int b, double mu) noexcept nogil
    @cython.locals(best=cython.double, x=cython.double, lo=cython.int)
    cdef inline double _lp_rank_min(self, int r, int t, double mu) noexcept nogil
    cdef inline void _lp_add_path(self, int q) noexcept nogil
    @cython.locals(mu=cython.double, x=cython.double, got=cython.double, n=cython.int,
                   lo=cython.int, hi=cython.int, width=cython.int, limit=cython.double, low=cython.int,
                   l_min=cython.int, l_max=cython.int, y=cython.int)
    cdef void _lp_fix(self, int k, int r, int a, int b, int[::1] lb, int[::1] capt) noexcept nogil
    @cython.locals(x=cython.double, top=cython.double, arg=cython.int, off=cython.int)
    cdef inline bint _lp_take_kept(self, int k, int q_new, double value) noexcept nogil
    @cython.locals(kept=cython.int, dst=cython.int)
    cdef inline void _lp_keep(self, int k, int n) noexcept nogil
