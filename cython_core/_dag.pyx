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
        self.fold_u = self.fold_w = self.pk_of = NULL
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
        # The packed form: nodes with at most two predecessors, in topological order. A node v with
        # one predecessor u, one successor x over a weight-0 edge, and one nonzero weight (its own or
        # its edge's) is folded into x: x reads f[u] + w instead of f[v] + 0, the same float sum
        # (f[v] = f[u] + w exactly: the other weight is params[0] = 0 and, every parameter being a
        # time >= 0, the dummy's 0 never wins). The Megatron p2p graphs have thousands of such
        # nodes (posts and waits); finish_times fills the folded ones in after a run.
        cdef int v, k, e, u, w, s, n = self.n_nodes
        cdef int* succ_n = NULL
        cdef int* succ_e = NULL
        cdef bint* is_sink = NULL
        for v in range(n):
            if self.ptr[v + 1] - self.ptr[v] > 2:
                return
        self.fold_u = <int*> malloc((n if n > 0 else 1) * sizeof(int))
        self.fold_w = <int*> malloc((n if n > 0 else 1) * sizeof(int))
        self.nodes2 = <Node2*> malloc((n if n > 0 else 1) * sizeof(Node2))
        self.pk_of = <int*> malloc((n if n > 0 else 1) * sizeof(int))
        succ_n = <int*> malloc((n if n > 0 else 1) * sizeof(int))
        succ_e = <int*> malloc((n if n > 0 else 1) * sizeof(int))
        is_sink = <bint*> malloc((n if n > 0 else 1) * sizeof(bint))
        try:
            if self.nodes2 == NULL or self.pk_of == NULL or self.fold_u == NULL or self.fold_w == NULL or succ_n == NULL \
                    or succ_e == NULL or is_sink == NULL:
                raise MemoryError()
            for v in range(n):
                succ_n[v] = 0
                is_sink[v] = False
                self.fold_u[v] = -1
            for v in range(self.n_sinks):
                is_sink[self.sinks[v]] = True
            for v in range(n):
                for e in range(self.ptr[v], self.ptr[v + 1]):
                    succ_n[self.src[e]] += 1
                    succ_e[self.src[e]] = e
            for v in range(n):
                if self.ptr[v + 1] - self.ptr[v] != 1 or succ_n[v] != 1 or is_sink[v] \
                        or self.ew[succ_e[v]] != 0:
                    continue
                e = self.ptr[v]
                u = self.src[e]
                if self.fold_u[u] >= 0:      # u is folded itself: its weight and v's would be two
                    continue
                if self.ew[e] == 0:
                    w = self.weight[v]
                elif self.weight[v] == 0:
                    w = self.ew[e]
                else:
                    continue
                self.fold_u[v] = u
                self.fold_w[v] = w
            k = 0
            for v in range(n):
                if self.fold_u[v] >= 0:
                    continue
                self.nodes2[k].v = v
                self.pk_of[v] = k
                self.nodes2[k].a = n
                self.nodes2[k].b = n
                self.nodes2[k].wa = 0
                self.nodes2[k].wb = 0
                self.nodes2[k].w = self.weight[v]
                for e in range(self.ptr[v], self.ptr[v + 1]):
                    s = self.src[e]
                    w = self.ew[e]
                    if self.fold_u[s] >= 0:  # a folded predecessor (over a weight-0 edge)
                        w = self.fold_w[s]
                        s = self.fold_u[s]
                    if e == self.ptr[v]:
                        self.nodes2[k].a = s
                        self.nodes2[k].wa = w
                    else:
                        self.nodes2[k].b = s
                        self.nodes2[k].wb = w
                k += 1
            self.n_packed = k
        finally:
            free(succ_n); free(succ_e); free(is_sink)

    def __dealloc__(self):
        free(self.weight); free(self.ptr); free(self.src); free(self.ew); free(self.sinks)
        free(self.finish); free(self.nodes2); free(self.fold_u); free(self.fold_w); free(self.pk_of)

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
            for v in range(self.n_packed):
                ta = finish[nd[v].a] + params[nd[v].wa]
                tb = finish[nd[v].b] + params[nd[v].wb]
                if tb > ta:
                    ta = tb
                finish[nd[v].v] = ta + params[nd[v].w]
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

    cdef void critical(self, const double* params, int* cnt) noexcept nogil:
        # After run(params): how often each parameter index weighs on one longest path (into
        # cnt[0:n_params]; index 0 not counted), walking back from the first latest sink along the
        # first predecessor that gave each finish time (the pure twin's walk over the unpacked graph
        # meets the same nodes: a folded node adds its one weight on the edge it was folded into)
        cdef int v, e, k, u, best_e, i
        cdef double best, t, ta, tb
        cdef const Node2* nd = self.nodes2
        for i in range(self.n_params):
            cnt[i] = 0
        v = -1
        best = 0.0
        for i in range(self.n_sinks):
            t = self.finish[self.sinks[i]]
            if v < 0 or t > best:
                best = t
                v = self.sinks[i]
        while v >= 0 and v < self.n_nodes:
            if nd != NULL:
                k = self.pk_of[v]
                cnt[nd[k].w] += 1
                ta = self.finish[nd[k].a] + params[nd[k].wa]
                tb = self.finish[nd[k].b] + params[nd[k].wb]
                if tb > ta:
                    cnt[nd[k].wb] += 1
                    v = nd[k].b
                else:
                    cnt[nd[k].wa] += 1
                    v = nd[k].a
            else:
                cnt[self.weight[v]] += 1
                best = -1.0
                best_e = -1
                for e in range(self.ptr[v], self.ptr[v + 1]):
                    t = self.finish[self.src[e]] + params[self.ew[e]]
                    if t > best:
                        best = t
                        best_e = e
                if best_e < 0:
                    break
                cnt[self.ew[best_e]] += 1
                v = self.src[best_e]
        cnt[0] = 0

    cdef double longest_into(self, double[::1] params) noexcept nogil:
        return self.run(&params[0])

    cdef void critical_into(self, double[::1] params, int[::1] cnt) noexcept nogil:
        self.critical(&params[0], &cnt[0])

    def longest(self, double[::1] params not None):
        """Iteration time for the parameter vector ``params`` (array('d') or any float64 buffer)."""
        if params.shape[0] < self.n_params:
            raise ValueError(f"params has {params.shape[0]} entries, the graph needs {self.n_params}")
        return self.run(&params[0])

    def finish_times(self, double[::1] params not None):
        """Finish time of every node (topological order)."""
        cdef int v
        self.longest(params)
        if self.nodes2 != NULL:
            for v in range(self.n_nodes):      # the folded nodes (see _pack), in order
                if self.fold_u[v] >= 0:
                    self.finish[v] = self.finish[self.fold_u[v]] + params[self.fold_w[v]]
        return [self.finish[v] for v in range(self.n_nodes)]

    def critical_counts(self, double[::1] params not None):
        """After ``longest(params)``: see ``critical`` (the pure twin's ``critical``)."""
        cdef int* cnt = <int*> malloc((self.n_params if self.n_params > 0 else 1) * sizeof(int))
        if cnt == NULL:
            raise MemoryError()
        try:
            self.critical(&params[0], cnt)
            return [cnt[i] for i in range(self.n_params)]
        finally:
            free(cnt)

    @property
    def packed_nodes(self):
        """Nodes the packed loop evaluates (the others are folded into their successor; -1: no
        packed form)."""
        return self.n_packed if self.nodes2 != NULL else -1

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
