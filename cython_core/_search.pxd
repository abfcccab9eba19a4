# Types of poseidon_plugin/search/splits.py, compiled as poseidon_plugin._core._search (the engine's
# fast path): the tree walk over the state and bounds of StructureBounds (structure_bounds.pxd).
cimport cython
from poseidon_plugin._core.relaxation_bound cimport RelaxationBound
from poseidon_plugin._core.structure_bounds cimport chunk_layers

cdef double INF, PATH_SLACK, SHARE_TIE
cdef int CLOCK_EVERY, N_MINS, N_TYPE_MINS, N_COUNTERS, LP_KEEP, LP_MAX, LP_MAX_OPTIONS, LP_MIN_UNDECIDED, FRONT_FIRST
cdef int LP_TRIAL, LP_MIN_CUTS, LP_ONE_CHUNK_CUTS, LP_SAMPLE
cdef int NODES, BOUND_EVALS, SIM_CALLS, PRUNED_BOUND, PRUNED_PATH, PRUNED_MEMORY, PRUNED_RIDGE
cdef int PRUNED_ORDER, IMPROVED

cdef class SplitSearch(RelaxationBound):
    cdef long long[::1] lp_depth_calls, lp_depth_cuts, lp_depth_skips
    # a walk shared among processes (share)
    cdef int share_count, share_index, share_depth
    cdef double[::1] share_tau
    cdef int[::1] best_path_t, best_path_l
    @cython.locals(h=cython.longlong, j=cython.int)
    cdef inline int _share_owner(self, int k) noexcept nogil
    cdef void _lp_alloc(self)
    cdef void _load_paths(self, object paths)
    cdef inline double _memory_need(self, int t, int r, int layers) noexcept nogil
    cdef inline int _rank_cap(self, int t, int r) noexcept nogil
    cdef inline int _reset(self, object counts) except -1
    cdef inline void _root_check(self) noexcept
    cdef void _stop(self, int k) noexcept
    @cython.locals(calls=cython.longlong, share=cython.int)
    cdef inline bint _lp_wanted(self, int k) noexcept nogil
    cdef inline int _type_allowed(self, int r, int t) noexcept nogil
    @cython.locals(lb='int[::1]', cap='int[::1]', capt='int[::1]', right=cython.bint)
    cdef inline void _node(self, int k, int left) noexcept
    cdef inline bint _child_lower_bounds(self, int a, int b, int rest, int s_cap, int[::1] lb, int[::1] cap,
                                  int[::1] out) noexcept nogil
    @cython.locals(lb2='int[::1]', fix_lo=cython.int, fix_hi=cython.int, fix_off=cython.int)
    cdef inline void _children(self, int k, int r, int a, int b, int left, int t, int[::1] lb, int[::1] cap,
                        int[::1] capt) noexcept
