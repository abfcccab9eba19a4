# Compiled twin of poseidon_plugin.search.splits.SplitSearch (same algorithm, counters and results).
# The search loop touches only C arrays and calls the DAG kernel (poseidon_plugin._core._dag) per bound.

from poseidon_plugin._core._dag cimport DagKernel

cdef class SplitSearch:
    cdef DagKernel kernel
    cdef object table_ref, shape_ref, type_class_ref
    cdef int nt, pp, v, nv, stride, num_layers, n_params, n_paths
    cdef bint ridge, blocks, backward
    cdef int ub          # the undecided ranks are [k, ub) at a node (see _node)
    cdef double* params
    # type table (per type) and slot arrays (per type * stride + slot)
    cdef double* forward_ms
    cdef double* backward_ms
    cdef double* embedding_forward_ms
    cdef double* embedding_backward_ms
    cdef double* head_forward_ms
    cdef double* head_backward_ms
    cdef double* send_cross_ms
    cdef double* layer_state_bytes
    cdef double* layer_activation_bytes
    cdef double* embedding_state_bytes
    cdef double* embedding_activation_bytes
    cdef double* head_state_bytes
    cdef double* head_activation_bytes
    cdef double* usable_bytes
    cdef double* step_forward_ms
    cdef double* step_backward_ms
    cdef double* optimizer_ms
    cdef double* optimizer_fixed_ms
    cdef double* allreduce_ms
    cdef double* embedding_allreduce_ms
    cdef double* head_allreduce_ms
    cdef double* send_same_ms
    cdef double* send_wrap_ms
    cdef int* has_allreduce
    cdef int* type_class
    cdef int* live
    cdef int* cap_rank
    # bound paths
    cdef int* coef_f
    cdef int* coef_b
    cdef int* coef_s
    cdef int* coef_ar
    cdef int* term_ptr
    cdef int* term_idx
    cdef int* term_coef
    cdef int* owner
    # search state
    cdef int* counts
    cdef int[::1] remaining
    cdef int* used       # per type: its ranks decided in pipeline order (their slots 0..used-1)
    cdef double* lam
    cdef int* pcnt
    cdef int* lcnt
    cdef double* crt     # pp * nt: the gain's lower-bound layers per (rank, type) over the fill
    cdef double* jslope  # nv * nt: the gain's slope per (stage, type) along the path
    cdef int* jroom      # nv * nt: the gain's room per (stage, type) above the lower bound
    cdef double* jmu     # nv * nt: the gain's multipliers (sorted distinct slopes)
    cdef int jslack
    cdef int* hi         # per type: its slots hi.. belong to ranks decided from the end
    cdef int* types
    cdef int* slot
    cdef int* layers
    cdef int* last
    cdef int* down
    cdef int* capped
    cdef int* lbs        # (pp + 1) * nv
    cdef int* caps       # (pp + 1) * nv
    cdef int* capts      # (pp + 1) * nv * nt: caps per (stage, type)
    cdef int* vals       # pp (scratch)
    cdef int* ecap       # pp * nt: layers a rank can take above its lower bounds per type (scratch)
    cdef int* kroom      # pp * nt * nt: see splits.SplitSearch._type_room (scratch)
    cdef int* ordr       # nt * pp: ranks by ecap, largest first, per type (scratch)
    cdef int* ordn       # nt
    cdef int* marg       # nt
    cdef int* ph_t       # nt
    cdef double* mu1     # nt
    cdef double* mu2     # nt
    cdef double* rmt     # nt
    cdef double* ph_mu   # nt
    cdef double* nu1     # nt
    cdef double* nu2     # nt
    cdef int* narg       # nt
    cdef double* rsum    # nt
    cdef double* gam     # pp
    cdef double* xs      # v
    cdef double* rlb
    cdef double* gam0
    cdef int* zero_lb    # nv zeros (_gammas of whole layer counts)
    cdef int* g_slb      # pp: per rank its lb layers (_gammas, set per _path_caps call)
    cdef int* g_even     # pp: whether they are spread like a rank's layers
    cdef int* g_start    # pp: their count mod V
    cdef int* z_slb      # pp zeros (the same for whole layer counts)
    cdef int* z_even     # pp ones
    cdef int* efull
    cdef int* ordf
    cdef int* ordfn
    cdef int* kfull
    cdef double* xall    # nv * nt: slope of each undecided stage per remaining type on the current path
    cdef int* sl_t       # remaining types and their per-layer slopes (scratch)
    cdef double* sl_f
    cdef double* sl_b
    cdef double* sl_a
    cdef bint exact_counts
    cdef double[::1] as_val  # nt * pp: the assignment's values (scratch of _assign)
    cdef int[::1] as_owner   # pp
    cdef int[::1] as_used    # nt
    cdef double[::1] as_gain # nt
    cdef int[::1] as_via_t   # nt
    cdef int[::1] as_via_r   # nt
    cdef int* work       # v (chunk layers scratch)
    cdef int* order      # nv (knapsack order scratch)
    cdef double* alpha   # nv
    cdef double* sf
    cdef double* sb
    cdef double* sa
    cdef double mins[10]
    cdef double* tmin    # nt * 9: per remaining type, the costs of MIN_NAMES[0:9] (free slots' smallest)
    cdef double* fill_f  # pp: the per-layer forward, backward, all-reduce ms _fill priced each
    cdef double* fill_b  #     undecided rank at (what _path_caps' lift takes out)
    cdef double* fill_a
    cdef long long ctr[9]
    cdef double tau
    cdef double shrink
    cdef double best
    cdef int* best_types
    cdef int* best_layers
    cdef bint have_best
    cdef double deadline
    cdef long long max_nodes
    cdef bint aborted

    cdef double _need(self, int t, int r, int* chunks) noexcept nogil
    cdef int _rank_cap(self, int t, int r) noexcept nogil
    cdef void _unknown_mins(self) noexcept nogil
    cdef bint _fits(self, int r, int t, int* lb, int* capt) noexcept nogil
    cdef bint _rank_mins(self, int r, int* lb, int* capt, double* out) noexcept nogil
    cdef void _fill(self, int* lb, int* capt) noexcept nogil
    cdef double _send_lb(self, int r, double unknown_min) noexcept nogil
    cdef bint _child_lower_bounds(self, int a, int b, int rest, int s_cap, int* lb, int* cap, int* out) noexcept nogil
    cdef bint _propagate(self, int k, int left, int* lb, int* cap, int* capt, int* plb, int* pcap,
                         int* pcapt) noexcept nogil
    cdef int _type_slopes(self) noexcept nogil
    cdef void _type_room(self, int k, int* lb, int* cap, int* capt, int ns) noexcept nogil
    cdef int _top_sum(self, int* order, int* count, int* vals, int t, int r, int n) noexcept nogil
    cdef int _rank_capacity(self, int r, int t, int* lb, int* cap, int* capt) noexcept nogil
    cdef double _phi(self, int e, int r, int t2, int ns, double* mu1, double* mu2, int* marg, int* kt) noexcept nogil
    cdef double _gammas(self, int q, int k, int* lb, int* room_of, double* gam, int ns, int* slb,
                        int* even, int* start) noexcept nogil
    cdef int _path_caps(self, int k, int left, int* lb, int* cap, int* capt) noexcept nogil
    cdef double _count_gain(self, int a, int b, int* lb, int* cap, int* capt, int extra, double need) noexcept nogil
    cdef int _lb_sum(self, int a, int b, int* lb) noexcept nogil
    cdef bint _type_mass(self, int k, int left, int* lb, int* cap, int* capt) noexcept nogil
    cdef int _type_capacity(self, int k, int ub, int* lb, int* cap, int* capt) noexcept nogil
    cdef int _assign_capacity(self, int k, int ub, int* lb, int* cap, int* capt) noexcept nogil
    cdef double _assign(self, int n) noexcept nogil
    cdef double _joint_gain(self, int a, int b, int* lb, int* cap, int* capt, int extra, double need) noexcept nogil
    cdef double _joint_at(self, int a, int b, double mu, int extra) noexcept nogil
    cdef double _knapsack(self, int k, int ub, int extra, int* lb, int* cap) noexcept nogil
    cdef int _type_allowed(self, int r, int t) noexcept nogil
    cdef void _node(self, int k, int left) noexcept nogil
    cdef void _children(self, int k, int r, int a, int b, int left, int t, int* lb, int* cap,
                        int* capt) noexcept nogil
    cdef void _root_check(self) noexcept nogil
