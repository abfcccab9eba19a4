# Compiled longest-path kernel over a frozen poseidon_plugin.simulator.graph.Graph.
# Other Cython modules (the search loop) cimport DagKernel and call run() without the GIL.

ctypedef struct Node2:
    # node v with at most two predecessors (the common case): finish = w + max(0, f[a] + wa, f[b] + wb);
    # a missing predecessor points at the dummy node n_nodes (finish 0) with weight index 0
    int v
    int a
    int b
    int wa
    int wb
    int w

# A malloc'ed C copy of a sequence of ints (at least one slot); the caller frees it.
cdef int* copy_ints(object seq) except NULL

cdef class DagKernel:
    cdef readonly int n_nodes
    cdef readonly int n_params
    cdef int n_edges
    cdef int n_sinks
    cdef int pp
    cdef int nv
    cdef int* weight
    cdef int* ptr
    cdef int* src
    cdef int* ew
    cdef int* sinks
    cdef double* finish
    cdef Node2* nodes2     # packed two-predecessor form, NULL when some node has more predecessors
    cdef int n_packed      # its length: the nodes not folded into their successor
    cdef int* fold_u       # per node: the predecessor it is folded onto (-1: not folded) ...
    cdef int* fold_w       # ... and the one weight index of its edge and itself
    cdef int* pk_of        # per node: its index in nodes2 (folded nodes: unset)

    # Longest path for the parameter vector params[0:n_params]; params[0] must be 0 and every entry
    # a time >= 0 (the packed form relies on it, see _pack).
    cdef double run(self, const double* params) noexcept nogil
    cdef double _max_sink(self) noexcept nogil
    cdef void critical(self, const double* params, int* cnt) noexcept nogil
    # run / critical on typed buffers (the search's entries; the pure kernel has methods of these names)
    cdef double longest_into(self, double[::1] params) noexcept nogil
    cdef void critical_into(self, double[::1] params, int[::1] cnt) noexcept nogil
    cdef _pack(self)
