# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of poseidon_plugin.simulator._pydag.DagKernel (same API, same results)."""

from libc.stdlib cimport malloc, free


cdef int* _copy_ints(object seq) except NULL:
    cdef Py_ssize_t n = len(seq)
    cdef int* out = <int*> malloc((n if n > 0 else 1) * sizeof(int))
    if out == NULL:
        raise MemoryError()
    cdef Py_ssize_t i
    for i in range(n):
        out[i] = seq[i]
    return out


cdef class DagKernel:
    """Evaluates a frozen Graph; the DP loop touches only C arrays."""

    def __cinit__(self, graph):
        self.weight = self.ptr = self.src = self.ew = self.sinks = NULL
        self.finish = NULL
        self.n_nodes = graph.n_nodes
        self.n_edges = graph.n_edges
        self.n_sinks = len(graph.sinks)
        self.n_params = graph.shape.layout.size
        self.pp = graph.shape.pp
        self.nv = graph.shape.pp * graph.shape.virtual_stages
        self.weight = _copy_ints(graph.node_weight)
        self.ptr = _copy_ints(graph.pred_ptr)
        self.src = _copy_ints(graph.pred_src)
        self.ew = _copy_ints(graph.pred_weight)
        self.sinks = _copy_ints(graph.sinks)
        self.finish = <double*> malloc((self.n_nodes if self.n_nodes > 0 else 1) * sizeof(double))
        if self.finish == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.weight); free(self.ptr); free(self.src); free(self.ew); free(self.sinks)
        free(self.finish)

    cdef double run(self, const double* params) noexcept nogil:
        cdef int v, e, e_end
        cdef double best, t
        cdef double* finish = self.finish
        cdef const int* ptr = self.ptr
        cdef const int* src = self.src
        cdef const int* ew = self.ew
        cdef const int* weight = self.weight
        e = 0
        for v in range(self.n_nodes):
            best = 0.0
            e_end = ptr[v + 1]
            while e < e_end:
                t = finish[src[e]] + params[ew[e]]
                if t > best:
                    best = t
                e += 1
            finish[v] = best + params[weight[v]]
        best = 0.0
        for v in range(self.n_sinks):
            t = finish[self.sinks[v]]
            if t > best:
                best = t
        return best

    def longest(self, double[::1] params not None):
        """Iteration time for the parameter vector ``params`` (array('d') or any float64 buffer)."""
        if params.shape[0] < self.n_params:
            raise ValueError(f"params has {params.shape[0]} entries, the graph needs {self.n_params}")
        return self.run(&params[0])

    def finish_times(self, double[::1] params not None):
        """Finish time of every node (topological order)."""
        self.longest(params)
        return [self.finish[v] for v in range(self.n_nodes)]

    def fill(self, double[::1] params not None, forward_ms, backward_ms, send_ms, allreduce_ms):
        """Write stage times into ``params`` following the ParamLayout (lengths already validated)."""
        cdef int i, nv = self.nv, pp = self.pp
        if params.shape[0] < self.n_params:
            raise ValueError(f"params has {params.shape[0]} entries, the graph needs {self.n_params}")
        for i in range(nv):
            params[1 + i] = forward_ms[i]
            params[1 + nv + i] = backward_ms[i]
        for i in range(pp):
            params[1 + 2 * nv + i] = send_ms[i]
            params[1 + 2 * nv + pp + i] = allreduce_ms[i]

    def evaluate(self, double[::1] params not None, forward_ms, backward_ms, send_ms, allreduce_ms):
        """``fill`` then ``longest``: the simulator's hot path."""
        self.fill(params, forward_ms, backward_ms, send_ms, allreduce_ms)
        return self.run(&params[0])
