# Compiled longest-path kernel over a frozen poseidon_plugin.simulator.graph.Graph.
# Other Cython modules (the search loop) cimport DagKernel and call run() without the GIL.

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

    # Longest path for the parameter vector params[0:n_params]; params[0] must be 0.
    cdef double run(self, const double* params) noexcept nogil
