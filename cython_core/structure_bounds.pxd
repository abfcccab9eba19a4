# Types of poseidon_plugin/search/structure_bounds.py, compiled as poseidon_plugin._core.structure_bounds:
# the search state (set by SplitSearch.__init__, search/splits.py) and the bound methods, on flat
# typed buffers; the same names as the source's attributes (their meaning is said there).
cimport cython
from poseidon_plugin._core._dag cimport DagKernel
from poseidon_plugin._core.assignment cimport assign_into

cdef double INF, NEG_F, PATH_SLACK, FIT_SLACK
cdef int PROPAGATION_ROUNDS, INHERITED_ROUNDS, N_MINS, N_TYPE_MINS, PRUNED_MEMORY, PRUNED_PATH
cdef int STAGE_TRIAL, STAGE_MIN_CUTS
cdef int MIN_FORWARD, MIN_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_EMBEDDING_BACKWARD, MIN_HEAD_FORWARD
cdef int MIN_HEAD_BACKWARD, MIN_ALLREDUCE, MIN_EMBEDDING_ALLREDUCE, MIN_HEAD_ALLREDUCE, MIN_SEND

cpdef int chunk_layers(int total, int chunk, int v) noexcept nogil

cdef class StructureBounds:
    cdef DagKernel kernel
    cdef object table, shape
    cdef int nt, pp, v, nv, stride, num_layers, n_paths, ub, front
    cdef bint ridge, blocks, backward, alternate, exact_counts, have_best, aborted
    cdef double tau, shrink, best, deadline
    cdef long long max_nodes
    cdef long long[::1] ctr, depth_nodes
    cdef double[::1] params
    # the type table: per type, per slot (t * stride + slot)
    cdef double[::1] forward_ms, backward_ms, embedding_forward_ms, embedding_backward_ms
    cdef double[::1] head_forward_ms, head_backward_ms, step_forward_ms, step_backward_ms
    cdef double[::1] optimizer_ms, optimizer_fixed_ms, send_cross_ms, allreduce_ms
    cdef double[::1] embedding_allreduce_ms, head_allreduce_ms, send_same_ms, send_wrap_ms
    cdef int[::1] has_allreduce, type_class
    cdef double[::1] layer_state_bytes, layer_activation_bytes, embedding_state_bytes
    cdef double[::1] embedding_activation_bytes, head_state_bytes, head_activation_bytes, usable_bytes
    cdef int[::1] live, cap_rank
    # the bound paths
    cdef int[::1] coef_f, coef_b, coef_ar, term_ptr, term_idx, term_coef, path_owner, owner_in_coef, owner_out_coef
    # search state
    cdef int[::1] counts, remaining, used, hi, types, slot, layers, last, down, capped, node_a, node_b
    cdef int[::1] lbs, caps, capts, best_types, best_layers
    # the walk's path, and the stopped run's path to resume from
    cdef int[::1] path_t, path_l, resume_t, resume_l, resume_counts
    cdef int resume_depth
    cdef double resume_tau
    cdef bint resuming
    cdef bint gain_path
    # scratch: the fill
    cdef double[::1] mins, type_mins, rank_min_costs, fill_forward, fill_backward, fill_allreduce
    # scratch: the path bounds
    cdef int[::1] slope_type, rank_room_above, rank_room_whole, order_above, order_whole, n_above
    cdef int[::1] n_whole, room_above, room_whole, phi_type, stage_order, type_min_rank, type_mean_rank
    cdef int[::1] merged_order, merged_left
    cdef int[::1] rank_lb, lb_even, lb_start, zero_ranks, one_ranks, zero_lb, rank_values
    cdef double[::1] slope_forward, slope_backward, slope_allreduce, phi_slope, alpha, stage_slope
    cdef double[::1] chunk_slope, rank_type_min, rank_type_sum, type_min1, type_min2, type_mean1
    cdef double[::1] type_mean2, rank_lb_cost, loss_above, loss_whole
    cdef double base_cost, min_slope, max_slope, rank_min1, rank_min2, loss_sum, loss_sum_whole
    cdef double others_lb_cost, others_max_slope, others_max_stage
    cdef long long stage_calls, stage_cuts
    cdef int rank_min_arg, others_lb_layers, knap_sorted, knap_n, merged_sorted, merged_n
    # scratch: the gain and the assignments
    cdef int[::1] path_counts, type_gain_ranks, gain_room, assign_owner, assign_used
    cdef int[::1] assign_via_type, assign_via_rank, assign_capacity
    cdef double[::1] lb_gain, type_mean_gain, gain_slope, gain_mu, assign_value, assign_gain, boundary_least
    cdef int gain_slack

    cdef inline void _unknown_mins(self) noexcept nogil
    cdef inline bint _fits(self, int r, int t, int[::1] lb, int[::1] capt) noexcept nogil
    cdef inline bint _rank_mins(self, int r, int[::1] lb, int[::1] capt, double[::1] out) noexcept nogil
    cdef inline void _fill(self, int[::1] lb, int[::1] capt) noexcept nogil
    cdef inline double _send_lb(self, int r, double unknown_min) noexcept nogil
    cdef inline double _typed_link(self, int s, int n, int a, int b) noexcept nogil
    @cython.locals(best='double', val='double')
    cdef inline double _any_link(self, int s, int n, int a, int b) noexcept nogil
    cdef inline double _same_type_into(self, int u, int n) noexcept nogil
    @cython.locals(p='double[::1]', val='double', g='double')
    cdef inline double _send_gain(self, int r, int x, int[::1] cnt) noexcept nogil
    @cython.locals(p='double[::1]', val='double', g='double')
    cdef inline double _owner_link_gain(self, int q, int r, int t) noexcept nogil
    cdef inline bint _propagate(self, int k, int left, int[::1] lb, int[::1] cap, int[::1] capt,
                         int[::1] parent_lb, int[::1] parent_cap, int[::1] parent_capt,
                         bint inherit) noexcept nogil
    cdef inline int _type_slopes(self) noexcept nogil
    cdef inline void _type_room(self, int k, int[::1] lb, int[::1] cap, int[::1] capt, int n_left) noexcept nogil
    cdef inline int _top_sum(self, int[::1] order, int[::1] count, int[::1] vals, int t, int r, int n) noexcept nogil
    cdef inline double _placement_cost(self, int e, int r, int t2, int n_left, double[::1] slope1, double[::1] slope2,
                     int[::1] slope_rank, int[::1] room) noexcept nogil
    cdef inline double _rounding_losses(self, int k, int[::1] lb, int[::1] room_of, double[::1] gam, int n_left,
                        int[::1] rank_lb, int[::1] lb_even, int[::1] lb_start) noexcept nogil
    cdef inline int _path_caps(self, int k, int left, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    cdef inline void _path_prices(self, int q, int k, int[::1] lb, int n_left) noexcept nogil
    cdef inline bint _path_cuts(self, int k, int extra, double limit, int[::1] lb, int[::1] cap) noexcept nogil
    @cython.locals(d=cython.int)
    cdef inline int _owner_caps(self, int q, int k, int extra, double limit, int[::1] lb, int[::1] cap,
                         int[::1] capt, int n_left) noexcept nogil
    cdef inline bint _by_stage_fits(self, int k, int r, int t2, int e, double own, double rhs, int[::1] lb,
                                    int[::1] capt, int n_left) noexcept nogil
    @cython.locals(take=cython.int, cost='double', x='double')
    cdef inline double _others_by_stage(self, int k, int r, int t2, int e, int[::1] lb, int[::1] capt,
                                        int n_left) noexcept nogil
    @cython.locals(take=cython.int, cost='double')
    cdef inline double _others_knapsack(self, int k, int r, int e, int[::1] lb, int[::1] cap) noexcept nogil
    @cython.locals(fit=cython.bint)
    cdef inline bint _others_fit(self, int k, int r, int t, int e, double own, double rhs, int n_left,
                          int[::1] lb) noexcept nogil
    cdef inline int _stage_caps(self, int r, int[::1] lb, int[::1] cap, int[::1] capt, int n_left) noexcept nogil
    cdef inline double _count_gain(self, int a, int b, int[::1] lb, int[::1] cap, int[::1] capt, int extra,
                            double need) noexcept nogil
    @cython.locals(p='double[::1]', cross='double', x='double', g='double')
    cdef inline double _boundary_gain(self, int a, int b, int[::1] cnt) noexcept nogil
    cdef inline double _joint_gain(self, int a, int b, int[::1] lb, int[::1] cap, int[::1] capt, int extra,
                            double need) noexcept nogil
    cdef inline double _joint_at(self, int a, int b, double mu, int extra) noexcept nogil
    cdef inline int _lb_sum(self, int a, int b, int[::1] lb) noexcept nogil
    cdef inline bint _type_mass(self, int k, int left, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    cdef inline int _rank_capacity(self, int r, int t, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    cdef inline int _type_capacity(self, int k, int ub, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    cdef inline int _assign_capacity(self, int k, int ub, int[::1] lb, int[::1] cap, int[::1] capt) noexcept nogil
    cdef inline double _assign(self, int n) noexcept nogil
    cdef inline int _stages_by_slope(self, int k, int ub) noexcept nogil
    cdef inline double _knapsack(self, int k, int ub, int extra, int[::1] lb, int[::1] cap) noexcept nogil
