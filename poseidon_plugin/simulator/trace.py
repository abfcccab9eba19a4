"""Chrome trace-event export of a simulated iteration (opens in Perfetto or chrome://tracing)."""

from __future__ import annotations

from ..specs.fields import write_json_atomic  # noqa: F401  (re-exported: the one atomic JSON writer)
from .core import Simulator, node_name
from .graph import ALLREDUCE


def trace_events(sim: Simulator, forward_ms, backward_ms, send_ms, allreduce_ms) -> dict:
    """Trace-event JSON: one track per pipeline rank, a slice per F/B/all-reduce node."""
    finish = sim.finish_times(forward_ms, backward_ms, send_ms, allreduce_ms)
    g, p = sim.graph, sim.params
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "pipeline"}}]
    for r in range(sim.pp):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                       "args": {"name": f"pipeline rank {r}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r,
                       "args": {"sort_index": r}})
    for node in range(g.n_nodes):
        dur = p[g.node_weight[node]]
        rank = g.node_rank[node]
        if rank < 0 or dur <= 0.0:
            continue
        label = g.labels[node]
        kind, _r, chunk, mb = label[:4]
        if kind == ALLREDUCE:
            name, cat = "all-reduce", "allreduce"
        elif sim.virtual_stages > 1:
            name, cat = f"{kind} mb{mb} c{chunk}", kind
        else:
            name, cat = f"{kind} mb{mb}", kind
        events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": rank,
                       "ts": (finish[node] - dur) * 1000.0, "dur": dur * 1000.0,
                       "args": {"node": node_name(label, sim.virtual_stages)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
