# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled twin of poseidon_plugin.simulator._pydag.DagKernel (same API, same results)."""

from libc.stdlib cimport malloc, free


cdef int* copy_ints(object seq) except NULL:
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
        self.nodes2 = NULL
        self.n_nodes = graph.n_nodes
        self.n_edges = graph.n_edges
        self.n_sinks = len(graph.sinks)
        self.n_params = graph.shape.layout.size
        self.pp = graph.shape.pp
        self.nv = graph.shape.pp * graph.shape.virtual_stages
        self.weight = copy_ints(graph.node_weight)
        self.ptr = copy_ints(graph.pred_ptr)
        self.src = copy_ints(graph.pred_src)
        self.ew = copy_ints(graph.pred_weight)
        self.sinks = copy_ints(graph.sinks)
        # one extra slot: the dummy predecessor (finish 0) of the packed form
        self.finish = <double*> malloc((self.n_nodes + 1) * sizeof(double))
        if self.finish == NULL:
            raise MemoryError()
        self.finish[self.n_nodes] = 0.0
        self._pack()

    cdef _pack(self):
        cdef int v, k, e
        for v in range(self.n_nodes):
            if self.ptr[v + 1] - self.ptr[v] > 2:
                return
        self.nodes2 = <Node2*> malloc((self.n_nodes if self.n_nodes > 0 else 1) * sizeof(Node2))
        if self.nodes2 == NULL:
            raise MemoryError()
        for v in range(self.n_nodes):
            self.nodes2[v].a = self.n_nodes
            self.nodes2[v].b = self.n_nodes
            self.nodes2[v].wa = 0
            self.nodes2[v].wb = 0
            self.nodes2[v].w = self.weight[v]
            k = 0
            for e in range(self.ptr[v], self.ptr[v + 1]):
                if k == 0:
                    self.nodes2[v].a = self.src[e]
                    self.nodes2[v].wa = self.ew[e]
                else:
                    self.nodes2[v].b = self.src[e]
                    self.nodes2[v].wb = self.ew[e]
                k += 1

    def __dealloc__(self):
        free(self.weight); free(self.ptr); free(self.src); free(self.ew); free(self.sinks)
        free(self.finish); free(self.nodes2)

    cdef double run(self, const double* params) noexcept nogil:
        cdef int v, e, e_end
        cdef double best, t
        cdef double* finish = self.finish
        cdef const int* ptr = self.ptr
        cdef const int* src = self.src
        cdef const int* ew = self.ew
        cdef const int* weight = self.weight
        cdef const Node2* nd = self.nodes2
        cdef double ta, tb
        if nd != NULL:
            for v in range(self.n_nodes):
                ta = finish[nd[v].a] + params[nd[v].wa]
                tb = finish[nd[v].b] + params[nd[v].wb]
                if tb > ta:
                    ta = tb
                finish[v] = ta + params[nd[v].w]
            return self._max_sink()
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
        return self._max_sink()

    cdef inline double _max_sink(self) noexcept nogil:
        cdef int v
        cdef double t, best = 0.0
        for v in range(self.n_sinks):
            t = self.finish[self.sinks[v]]
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


def topo_pack(int n, ptr, src, ew):
    """Compiled twin of ``poseidon_plugin.simulator.graph.topo_pack_py`` (same order, same arrays).

    Kahn's algorithm with a FIFO queue over a graph given as predecessor lists in builder order
    (``src[ptr[v]:ptr[v+1]]`` with weights ``ew``). Returns ``(order, pred_ptr, pred_src, pred_weight)``
    relabelled in topological order, or ``None`` when the graph has a cycle.
    """
    cdef int n_e = len(src)
    cdef int* cptr = copy_ints(ptr)
    cdef int* csrc = copy_ints(src)
    cdef int* indeg = <int*> malloc((n + 1) * sizeof(int))
    cdef int* sptr = <int*> malloc((n + 2) * sizeof(int))
    cdef int* succ = <int*> malloc((n_e + 1) * sizeof(int))
    cdef int* order = <int*> malloc((n + 1) * sizeof(int))
    cdef int* new_id = <int*> malloc((n + 1) * sizeof(int))
    cdef int v, e, s, head, tail, u, k
    try:
        if indeg == NULL or sptr == NULL or succ == NULL or order == NULL or new_id == NULL:
            raise MemoryError()
        for v in range(n + 2):
            sptr[v] = 0
        for v in range(n):
            indeg[v] = cptr[v + 1] - cptr[v]
            for e in range(cptr[v], cptr[v + 1]):
                sptr[csrc[e] + 2] += 1
        for v in range(n):
            sptr[v + 2] += sptr[v + 1]
        # successors of each node in (dst ascending, predecessor order), as the pure twin appends them
        for v in range(n):
            for e in range(cptr[v], cptr[v + 1]):
                s = csrc[e]
                succ[sptr[s + 1]] = v
                sptr[s + 1] += 1
        tail = 0
        for v in range(n):
            if indeg[v] == 0:
                order[tail] = v
                tail += 1
        head = 0
        while head < tail:
            u = order[head]
            head += 1
            for k in range(sptr[u], sptr[u + 1]):
                s = succ[k]
                indeg[s] -= 1
                if indeg[s] == 0:
                    order[tail] = s
                    tail += 1
        if tail != n:
            return None
        for k in range(n):
            new_id[order[k]] = k
        new_ptr = [0] * (n + 1)
        new_src = [0] * n_e
        new_w = [0] * n_e
        e = 0
        for k in range(n):
            v = order[k]
            for s in range(cptr[v], cptr[v + 1]):
                new_src[e] = new_id[csrc[s]]
                new_w[e] = ew[s]
                e += 1
            new_ptr[k + 1] = e
        return [order[k] for k in range(n)], new_ptr, new_src, new_w
    finally:
        free(cptr); free(csrc); free(indeg); free(sptr); free(succ); free(order); free(new_id)
