"""Build the DAG of one pipeline's iteration (paper §4.1) as flat arrays the kernels evaluate.

The graph depends only on the *shape* of a plan — schedule, pipeline size ``pp``, micro-batches ``M``,
virtual stages ``V`` and the communication model — never on times. Times live in a parameter vector;
every node and every edge names the parameter index that holds its weight (index 0 is the constant 0).
Changing a plan's times therefore means refilling that vector and re-running the longest-path pass:
the graph is built once per shape and re-used (``Simulator`` caches it).

Pipelines of a plan are identical (paper §4.2.3): only one is built, and the DP all-reduce of each
pipeline rank depends on that rank's last backward. The cost is independent of the DP degree.

Parameter layout (``ParamLayout``)::

    0                         zero
    1 + r*V + c               forward ms of rank r, chunk c
    1 + pp*V + r*V + c        backward ms of rank r, chunk c
    1 + 2*pp*V + r            send ms of the link rank r -> rank r+1 (r = pp-1: wrap link to rank 0)
    1 + 2*pp*V + pp + r       DP all-reduce ms of rank r
    1 + 2*pp*V + 2*pp + i     extra scalar i declared by the communication model (``EXTRA_PARAMS``)

Nodes are stored in a topological order; a node has at most two predecessors (``GraphBuilder``
chains extra ones through zero-weight join nodes); node ``v`` has predecessors
``pred_src[pred_ptr[v]:pred_ptr[v+1]]`` with edge weights ``params[pred_weight[...]]``. A node's finish
time is ``params[node_weight[v]] + max(0, max over predecessors (finish[u] + edge weight))``; the
iteration time is the largest finish time over ``sinks``.

Communication models are modules ``poseidon_plugin.simulator.comm_<name>`` exposing
``build(builder: GraphBuilder, shape: Shape) -> None`` and optionally ``EXTRA_PARAMS`` (a tuple of
``(name, default_ms, description)``). ``dag`` (the paper's model: a transfer is a fixed delay on its
edge) is built in this module.
"""

from __future__ import annotations

import gc
import importlib
from dataclasses import dataclass, field

from ..errors import InputError
from .schedules import BACKWARD, FORWARD, rank_order, validate_shape

COMM_MODELS = ("dag", "megatron", "megatron-overlap")

ALLREDUCE = "AR"
JOIN = "join"  # bookkeeping node added by GraphBuilder._binarize; not shown in critical paths


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """Where each time lives in the parameter vector (see the module docstring)."""

    pp: int
    virtual_stages: int
    extra_names: tuple[str, ...] = ()

    @property
    def base(self) -> int:
        """Index of the first extra (comm-model) parameter."""
        return 1 + 2 * self.pp * self.virtual_stages + 2 * self.pp

    @property
    def size(self) -> int:
        """Length of the parameter vector."""
        return self.base + len(self.extra_names)

    def forward(self, rank: int, chunk: int) -> int:
        return 1 + rank * self.virtual_stages + chunk

    def backward(self, rank: int, chunk: int) -> int:
        return 1 + self.pp * self.virtual_stages + rank * self.virtual_stages + chunk

    def send(self, rank: int) -> int:
        return 1 + 2 * self.pp * self.virtual_stages + rank

    def allreduce(self, rank: int) -> int:
        return 1 + 2 * self.pp * self.virtual_stages + self.pp + rank

    def extra(self, name: str) -> int:
        return self.base + self.extra_names.index(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """Everything the graph depends on, with each rank's op order already derived."""

    schedule: str
    pp: int
    micro_batches: int
    virtual_stages: int
    comm_model: str
    layout: ParamLayout
    orders: tuple[tuple[tuple[str, int, int], ...], ...]  # per rank: (kind, chunk, micro_batch)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """Megatron's numbering: chunk-major, so chunk c of rank r is virtual stage c*pp + r."""
        return chunk * self.pp + rank

    def rank_chunk(self, vstage: int) -> tuple[int, int]:
        """Inverse of :meth:`virtual_stage`."""
        return vstage % self.pp, vstage // self.pp

    @property
    def n_vstages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass(slots=True)
class GraphBuilder:
    """Collects labelled nodes and weighted edges, then freezes them into a topologically ordered Graph."""

    layout: ParamLayout
    labels: list = field(default_factory=list)        # per node: (kind, rank, chunk, micro_batch)
    weights: list = field(default_factory=list)       # per node: parameter index
    ranks: list = field(default_factory=list)         # per node: pipeline rank (-1: none)
    preds: list = field(default_factory=list)         # per node: list of (src, parameter index)
    index: dict = field(default_factory=dict)         # label -> node id
    sinks: list = field(default_factory=list)

    def add_node(self, label: tuple, weight: int, rank: int = -1) -> int:
        """Add a node; ``label`` must be unique (e.g. ``("F", rank, chunk, mb)``)."""
        if label in self.index:
            raise ValueError(f"duplicate DAG node {label}")
        node = len(self.labels)
        self.index[label] = node
        self.labels.append(label)
        self.weights.append(weight)
        self.ranks.append(rank)
        self.preds.append([])
        return node

    def add_edge(self, src: int, dst: int, weight: int = 0) -> None:
        """``dst`` may start only ``params[weight]`` after ``src`` finishes."""
        self.preds[dst].append((src, weight))

    def _binarize(self) -> None:
        """Give every node at most two predecessors by chaining zero-weight join nodes.

        ``max(a, b, c)`` becomes ``max(max(a, b), c)``: the same value bit for bit (adding the join's
        zero weight is exact), and the compiled kernel keeps its packed two-predecessor form.
        """
        for node in range(len(self.labels)):
            plist = self.preds[node]
            if len(plist) <= 2:
                continue
            acc = plist[0]
            for k, nxt in enumerate(plist[1:-1]):
                join = self.add_node((JOIN, node, k, -1), 0, -1)
                self.preds[join] = [acc, nxt]
                acc = (join, 0)
            self.preds[node] = [acc, plist[-1]]

    def freeze(self, shape: Shape) -> "Graph":
        """Topologically order the nodes (Kahn) and pack them into flat arrays."""
        self._binarize()
        n = len(self.labels)
        ptr = [0]
        src: list[int] = []
        ew: list[int] = []
        for plist in self.preds:
            for u, w in plist:
                src.append(u)
                ew.append(w)
            ptr.append(len(src))
        packed = _topo_pack()(n, ptr, src, ew)
        if packed is None:
            raise RuntimeError(
                f"schedule {shape.schedule!r} with pp={shape.pp}, M={shape.micro_batches}, "
                f"V={shape.virtual_stages} produced a cyclic dependency graph (a deadlocking order)")
        order, pred_ptr, pred_src, pred_weight = packed
        new_id = [0] * n
        for pos, v in enumerate(order):
            new_id[v] = pos
        weights, ranks, labels = self.weights, self.ranks, self.labels
        return Graph(
            shape=shape,
            node_weight=tuple([weights[v] for v in order]),
            node_rank=tuple([ranks[v] for v in order]),
            labels=tuple([labels[v] for v in order]),
            pred_ptr=tuple(pred_ptr),
            pred_src=tuple(pred_src),
            pred_weight=tuple(pred_weight),
            sinks=tuple(sorted(new_id[v] for v in self.sinks)),
        )


def topo_pack_py(n: int, ptr, src, ew):
    """Kahn's algorithm (FIFO) over predecessor lists in builder order; relabel in topological order.

    Returns ``(order, pred_ptr, pred_src, pred_weight)`` or ``None`` for a cyclic graph. The compiled
    twin ``poseidon_plugin._core._dag.topo_pack`` returns the same arrays.
    """
    succs: list[list[int]] = [[] for _ in range(n)]
    indeg = [ptr[v + 1] - ptr[v] for v in range(n)]
    for v in range(n):
        for e in range(ptr[v], ptr[v + 1]):
            succs[src[e]].append(v)
    order = [v for v in range(n) if indeg[v] == 0]
    for u in order:  # the list grows while it is walked: a FIFO queue
        for s in succs[u]:
            indeg[s] -= 1
            if indeg[s] == 0:
                order.append(s)
    if len(order) != n:
        return None
    new_id = [0] * n
    for pos, v in enumerate(order):
        new_id[v] = pos
    new_ptr = [0]
    new_src: list[int] = []
    new_w: list[int] = []
    for v in order:
        for e in range(ptr[v], ptr[v + 1]):
            new_src.append(new_id[src[e]])
            new_w.append(ew[e])
        new_ptr.append(len(new_src))
    return order, new_ptr, new_src, new_w


def _topo_pack():
    """The compiled ``topo_pack`` unless ``POSEIDON_PURE_PYTHON`` is set or the core is not built."""
    from ..backend import compiled

    core = compiled("_dag")
    return topo_pack_py if core is None else core.topo_pack


@dataclass(frozen=True, slots=True, kw_only=True)
class Graph:
    """A frozen, topologically ordered DAG in flat-array form (see the module docstring)."""

    shape: Shape
    node_weight: tuple[int, ...]
    node_rank: tuple[int, ...]
    labels: tuple[tuple, ...]
    pred_ptr: tuple[int, ...]
    pred_src: tuple[int, ...]
    pred_weight: tuple[int, ...]
    sinks: tuple[int, ...]

    @property
    def n_nodes(self) -> int:
        return len(self.node_weight)

    @property
    def n_edges(self) -> int:
        return len(self.pred_src)


def add_compute_chains(builder: GraphBuilder, shape: Shape) -> list[list[int]]:
    """Add every rank's F/B nodes chained in schedule order (zero-weight intra-stage edges).

    Returns the node ids per rank, in op order. Also adds each rank's DP all-reduce node after its
    last op and registers it as a sink.
    """
    lay = shape.layout
    chains = []
    for rank, ops in enumerate(shape.orders):
        ids = []
        for kind, chunk, mb in ops:
            w = lay.forward(rank, chunk) if kind == FORWARD else lay.backward(rank, chunk)
            node = builder.add_node((kind, rank, chunk, mb), w, rank)
            if ids:
                builder.add_edge(ids[-1], node)
            ids.append(node)
        ar = builder.add_node((ALLREDUCE, rank, -1, -1), lay.allreduce(rank), rank)
        builder.add_edge(ids[-1], ar)
        builder.sinks.append(ar)
        chains.append(ids)
    return chains


def add_dataflow_edges(builder: GraphBuilder, shape: Shape, transfer: bool = True) -> None:
    """Inter-stage edges: F(vs-1,m) -> F(vs,m), B(vs+1,m) -> B(vs,m), and F(last,m) -> B(last,m).

    With ``transfer`` the edge carries the send time of the link between the two ranks (the link
    ``rank(vs-1) -> rank(vs)`` is ``send[rank(vs-1)]``, the wrap link pp-1 -> 0 included); otherwise
    zero, for comm models that put transfers on nodes of their own.
    """
    lay = shape.layout
    idx = builder.index
    last = shape.n_vstages - 1
    for m in range(shape.micro_batches):
        for vs in range(1, shape.n_vstages):
            r_prev, c_prev = shape.rank_chunk(vs - 1)
            r, c = shape.rank_chunk(vs)
            w = lay.send(r_prev) if transfer else 0
            builder.add_edge(idx[(FORWARD, r_prev, c_prev, m)], idx[(FORWARD, r, c, m)], w)
            builder.add_edge(idx[(BACKWARD, r, c, m)], idx[(BACKWARD, r_prev, c_prev, m)], w)
        r, c = shape.rank_chunk(last)
        builder.add_edge(idx[(FORWARD, r, c, m)], idx[(BACKWARD, r, c, m)])


def build_dag(builder: GraphBuilder, shape: Shape) -> None:
    """The paper's model: compute nodes, intra-stage order, transfers as fixed edge delays."""
    add_compute_chains(builder, shape)
    add_dataflow_edges(builder, shape)


def comm_module(comm_model: str):
    """The module implementing ``comm_model`` (``None`` for the built-in ``dag``)."""
    if comm_model == "dag":
        return None
    if comm_model not in COMM_MODELS:
        raise InputError(f"comm_model={comm_model!r} is unknown; allowed: {', '.join(COMM_MODELS)}")
    # "megatron-overlap" (overlap_p2p_comm=True) is a variant built by the same module
    name = f"comm_{comm_model.split('-')[0]}"
    from ..backend import compiled

    core = compiled(name)     # the same source compiled (cython_core/comm_megatron.py), where built
    if core is not None:
        return core
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ModuleNotFoundError as exc:
        raise InputError(f"comm_model={comm_model!r} is not available in this build ({exc})") from None


def extra_params(comm_model: str) -> tuple[tuple[str, float, str], ...]:
    """The extra scalar parameters ``(name, default, description)`` a comm model reads."""
    mod = comm_module(comm_model)
    return tuple(getattr(mod, "EXTRA_PARAMS", ())) if mod is not None else ()


def make_shape(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
               comm_model: str = "dag") -> Shape:
    """Validate a plan shape and derive every rank's op order."""
    validate_shape(schedule, pp, micro_batches, virtual_stages)
    names = tuple(name for name, _default, _doc in extra_params(comm_model))
    layout = ParamLayout(pp=pp, virtual_stages=virtual_stages, extra_names=names)
    orders = tuple(tuple(rank_order(schedule, pp, micro_batches, virtual_stages, r)) for r in range(pp))
    return Shape(schedule=schedule, pp=pp, micro_batches=micro_batches,
                 virtual_stages=virtual_stages, comm_model=comm_model, layout=layout, orders=orders)


def build_graph(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
                comm_model: str = "dag") -> Graph:
    """Build the frozen DAG for one plan shape.

    The cyclic garbage collector is paused meanwhile: a build allocates a few objects per node and
    frees none (10^5 nodes at frontier scale or with 1,024 micro-batches), so the collector would walk
    the growing graph again and again for nothing (measured: a third to half of a large build)."""
    shape = make_shape(schedule, pp, micro_batches, virtual_stages, comm_model)
    builder = GraphBuilder(layout=shape.layout)
    mod = comm_module(comm_model)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        (build_dag if mod is None else mod.build)(builder, shape)
        return builder.freeze(shape)
    finally:
        if was_enabled:
            gc.enable()
