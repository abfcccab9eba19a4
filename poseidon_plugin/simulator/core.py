"""The simulator: a cached DAG per plan shape, evaluated by the compiled (or pure-Python) kernel."""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ..backend import compiled
from ..errors import InputError
from . import _pydag
from .graph import ALLREDUCE, JOIN, Graph, build_graph, extra_params
from .schedules import FORWARD, peak_live_microbatches


def _compiled_kernel_class():
    core = compiled("_dag")
    return None if core is None else core.DagKernel


def kernel_name() -> str:
    """``"compiled"`` or ``"pure-python"``: the longest-path kernel new simulators use.

    ``POSEIDON_PURE_PYTHON=1`` forces the pure-Python reference; without a built extension it is the
    fallback too.
    """
    return "compiled" if _compiled_kernel_class() is not None else "pure-python"


def make_kernel(graph: Graph, pure_python: bool | None = None):
    """A kernel for ``graph``: compiled unless ``pure_python`` (default: the env switch) says otherwise."""
    cls = None if pure_python else _compiled_kernel_class()
    return (cls or _pydag.DagKernel)(graph)


GRAPH_CACHE_NODES = 600_000
"""Nodes the graph cache keeps at most (the most recent graph always stays): a frontier-scale megatron
graph (1F1B, pp 32, M 256: 47,169 nodes) holds ~0.5 kB per node as Python objects, and a long search
of a 1,024-device cluster builds dozens of them (the compiled kernels keep their own C arrays)."""


class _GraphCache:
    """``build_graph`` memoised per shape, least recently used first out once the cached graphs hold
    more than :data:`GRAPH_CACHE_NODES` nodes: shapes recur constantly during a search, and without a
    bound the cache grew past 1 GB on frontier-scale clusters."""

    def __init__(self):
        self._graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self._nodes = 0

    def __call__(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                 comm_model: str) -> Graph:
        key = (schedule, pp, micro_batches, virtual_stages, comm_model)
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        graph = build_graph(schedule, pp, micro_batches, virtual_stages, comm_model)
        self._graphs[key] = graph
        self._nodes += graph.n_nodes
        while self._nodes > GRAPH_CACHE_NODES and len(self._graphs) > 1:
            _key, old = self._graphs.popitem(last=False)
            self._nodes -= old.n_nodes
        return graph

    def cache_clear(self) -> None:
        self._graphs.clear()
        self._nodes = 0

    def __len__(self) -> int:
        return len(self._graphs)


cached_graph = _GraphCache()


@dataclass(frozen=True, slots=True, kw_only=True)
class StageResult:
    """What one pipeline rank does in the simulated iteration."""

    rank: int
    busy_ms: float        # forward + backward computation
    allreduce_ms: float   # its DP gradient all-reduce
    bubble_ms: float      # idle: iteration - busy - all-reduce
    peak_live_microbatches: int  # most (chunk, micro-batch) activations alive at once


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """The simulated iteration of one plan."""

    iteration_ms: float
    stages: tuple[StageResult, ...]
    critical_path: tuple[str, ...]   # node labels from the first node to the last sink
    kernel: str

    def to_json(self) -> dict:
        """The ``poseidon simulate --json`` document."""
        return {
            "iteration_ms": self.iteration_ms,
            "stages": [{"busy_ms": s.busy_ms, "bubble_ms": s.bubble_ms,
                        "peak_live_microbatches": s.peak_live_microbatches} for s in self.stages],
            "critical_path": list(self.critical_path),
        }


def node_name(label: tuple, virtual_stages: int) -> str:
    """Readable node label: ``F(rank=1,mb=3)``, ``B(rank=0,chunk=1,mb=2)``, ``allreduce(rank=2)``."""
    kind, rank, chunk, mb = label[:4]
    if kind == ALLREDUCE:
        return f"allreduce(rank={rank})"
    if kind in (FORWARD, "B"):
        if virtual_stages > 1:
            return f"{kind}(rank={rank},chunk={chunk},mb={mb})"
        return f"{kind}(rank={rank},mb={mb})"
    return f"{kind}(rank={rank},chunk={chunk},mb={mb})"


class Simulator:
    """Simulates plans of one shape; build once, then evaluate many times with different times.

    ``forward_ms`` / ``backward_ms`` are flat sequences indexed ``rank * V + chunk``; ``send_ms`` and
    ``allreduce_ms`` have one entry per pipeline rank (see the README's stage-level format). The hot
    path (:meth:`iteration_time`) validates nothing: callers that take user data go through
    :func:`poseidon_plugin.simulator.simulate`, which does.
    """

    __slots__ = ("graph", "kernel", "params", "schedule", "pp", "micro_batches", "virtual_stages",
                 "comm_model")

    def __init__(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
                 comm_model: str = "dag", *, pure_python: bool | None = None):
        self.graph = cached_graph(schedule, pp, micro_batches, virtual_stages, comm_model)
        self.kernel = make_kernel(self.graph, pure_python)
        self.schedule, self.pp = schedule, pp
        self.micro_batches, self.virtual_stages, self.comm_model = micro_batches, virtual_stages, comm_model
        self.params = array("d", [0.0]) * self.graph.shape.layout.size
        for name, default, _doc in extra_params(comm_model):
            self.params[self.graph.shape.layout.extra(name)] = default

    @property
    def kernel_name(self) -> str:
        return "pure-python" if isinstance(self.kernel, _pydag.DagKernel) else "compiled"

    def set_extra(self, name: str, value: float) -> None:
        """Set a comm-model scalar parameter (e.g. a per-operation overhead) for later evaluations."""
        self.params[self.graph.shape.layout.extra(name)] = float(value)

    def iteration_time(self, forward_ms, backward_ms, send_ms, allreduce_ms) -> float:
        """Predicted iteration time (ms). Re-uses the graph; only the weights change."""
        return self.kernel.evaluate(self.params, forward_ms, backward_ms, send_ms, allreduce_ms)

    def evaluate_params(self) -> float:
        """Iteration time for the weights already in ``self.params`` (filled by the caller)."""
        return self.kernel.longest(self.params)

    def finish_times(self, forward_ms, backward_ms, send_ms, allreduce_ms) -> list:
        """Finish time of every node of ``self.graph`` (topological order)."""
        self.kernel.fill(self.params, forward_ms, backward_ms, send_ms, allreduce_ms)
        return self.kernel.finish_times(self.params)

    def run(self, forward_ms, backward_ms, send_ms, allreduce_ms) -> SimResult:
        """Full detail: iteration time, per-rank busy/bubble/peak live, and the critical path."""
        finish = self.finish_times(forward_ms, backward_ms, send_ms, allreduce_ms)
        g, v = self.graph, self.virtual_stages
        iteration = max((finish[s] for s in g.sinks), default=0.0)
        peaks = peak_live_microbatches(self.schedule, self.pp, self.micro_batches, v)
        stages = []
        for r in range(self.pp):
            busy = self.micro_batches * sum(forward_ms[r * v + c] + backward_ms[r * v + c]
                                            for c in range(v))
            stages.append(StageResult(rank=r, busy_ms=busy, allreduce_ms=float(allreduce_ms[r]),
                                      bubble_ms=max(0.0, iteration - busy - allreduce_ms[r]),
                                      peak_live_microbatches=peaks[r]))
        path = self.critical_path(finish)
        return SimResult(iteration_ms=iteration, stages=tuple(stages),
                         critical_path=tuple(node_name(g.labels[n], v) for n in path
                                             if g.labels[n][0] != JOIN),
                         kernel=self.kernel_name)

    def critical_path(self, finish) -> list[int]:
        """Node ids of one longest path, found by walking back along tight edges."""
        g, p = self.graph, self.params
        if not g.sinks:
            return []
        node = max(g.sinks, key=lambda s: finish[s])
        path = [node]
        tol = 1e-9 * max(1.0, finish[node])
        while True:
            start = finish[node] - p[g.node_weight[node]]
            prev = -1
            for e in range(g.pred_ptr[node], g.pred_ptr[node + 1]):
                src = g.pred_src[e]
                if abs(finish[src] + p[g.pred_weight[e]] - start) <= tol:
                    prev = src
                    break
            if prev < 0:
                break
            node = prev
            path.append(node)
        path.reverse()
        return path


def check_times(field: str, values, length: int) -> None:
    """Raise :class:`InputError` unless ``values`` holds ``length`` finite, non-negative numbers."""
    if not isinstance(values, (list, tuple)) or len(values) != length:
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else repr(values)
        raise InputError(f"{field} must be a list of {length} time(s) in ms (one per chunk), got {got}")
    for i, x in enumerate(values):
        check_time(f"{field}[{i}]", x)


def check_time(field: str, x) -> None:
    """Raise :class:`InputError` unless ``x`` is a finite number >= 0."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or math.isinf(x) or x < 0:
        raise InputError(f"{field}={x!r} must be a finite number of milliseconds >= 0")
