"""Pure-Python longest-path kernel: the reference twin of ``poseidon_plugin._core._dag.DagKernel``.

Same API and the same floating-point operations in the same order, so both give identical results.
"""

from __future__ import annotations


class DagKernel:
    """Evaluates a frozen :class:`~poseidon_plugin.simulator.graph.Graph` for given parameters."""

    def __init__(self, graph):
        self.n_nodes = graph.n_nodes
        self.n_params = graph.shape.layout.size
        self._weight = list(graph.node_weight)
        self._ptr = list(graph.pred_ptr)
        self._src = list(graph.pred_src)
        self._ew = list(graph.pred_weight)
        self._sinks = list(graph.sinks)
        self._pp = graph.shape.pp
        self._nv = graph.shape.pp * graph.shape.virtual_stages
        self._finish = None

    def finish_times(self, params) -> list:
        """Finish time of every node (topological order) for the parameter vector ``params``."""
        weight, ptr, src, ew = self._weight, self._ptr, self._src, self._ew
        finish = [0.0] * self.n_nodes
        for v in range(self.n_nodes):
            best = 0.0
            for e in range(ptr[v], ptr[v + 1]):
                t = finish[src[e]] + params[ew[e]]
                if t > best:
                    best = t
            finish[v] = best + params[weight[v]]
        self._finish = finish
        return finish

    def longest(self, params) -> float:
        """Iteration time: the largest finish time over the sink (all-reduce) nodes."""
        finish = self.finish_times(params)
        best = 0.0
        for s in self._sinks:
            if finish[s] > best:
                best = finish[s]
        return best

    def critical_counts(self, params) -> list[int]:
        """After :meth:`longest` on ``params``: how often each parameter index weighs on one longest
        path, walking back from the first latest sink along the first predecessor that gave each
        finish time (the compiled twin walks its packed form the same way; index 0 is not counted)."""
        finish, weight, ptr, src, ew = self._finish, self._weight, self._ptr, self._src, self._ew
        cnt = [0] * self.n_params
        v, best = -1, 0.0
        for s in self._sinks:
            if v < 0 or finish[s] > best:
                v, best = s, finish[s]
        while v >= 0:
            cnt[weight[v]] += 1
            best, best_e = -1.0, -1
            for e in range(ptr[v], ptr[v + 1]):
                t = finish[src[e]] + params[ew[e]]
                if t > best:
                    best, best_e = t, e
            if best_e < 0:
                break
            cnt[ew[best_e]] += 1
            v = src[best_e]
        cnt[0] = 0
        return cnt

    def longest_into(self, params) -> float:
        """:meth:`longest` (the compiled kernel's typed entry for the search, which calls it on its
        parameter buffer)."""
        return self.longest(params)

    def critical_into(self, params, cnt) -> None:
        """:meth:`critical_counts` written into ``cnt`` (the compiled kernel's typed entry)."""
        for i, x in enumerate(self.critical_counts(params)):
            cnt[i] = x

    def fill(self, params, forward_ms, backward_ms, send_ms, allreduce_ms) -> None:
        """Write stage times into ``params`` following the ParamLayout (lengths already validated)."""
        nv, pp = self._nv, self._pp
        for i in range(nv):
            params[1 + i] = forward_ms[i]
            params[1 + nv + i] = backward_ms[i]
        for r in range(pp):
            params[1 + 2 * nv + r] = send_ms[r]
            params[1 + 2 * nv + pp + r] = allreduce_ms[r]

    def evaluate(self, params, forward_ms, backward_ms, send_ms, allreduce_ms) -> float:
        """``fill`` then ``longest``: the simulator's hot path."""
        self.fill(params, forward_ms, backward_ms, send_ms, allreduce_ms)
        return self.longest(params)
