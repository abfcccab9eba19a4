"""Per-shape data of the search: the simulator graph, peak live micro-batches and the bound paths.

A *shape* is ``(schedule, pp, M, V)``: everything the DAG depends on. The search evaluates thousands of
weight vectors per shape, so the graph is built once (the simulator caches it) and its kernel is re-run
with new weights (paper §5: "if the PP degree remains unchanged, the DAG does not need to be rebuilt").

Bound paths (docs/SEARCH.md, "Lower bounds"). Each is one concrete path of the shape's DAG, stored as
integer multiplicities of the stage weights it crosses, so its cost is a linear function of the layers::

    cost = sum_vs coef_f[vs] F[vs] + coef_b[vs] B[vs] + sum_r coef_s[r] send[r] + coef_ar[r] AR[r]

Per pipeline rank ``r`` (0-based, chunk 0 = virtual stage ``r``):

* ``head(r) + all ops of r + AR_r`` -- the forward of micro-batch 0 down the chunk-0 stages to ``r``,
  then rank ``r``'s whole op chain (every schedule starts a rank with F(chunk 0, mb 0) and ends it with
  B(chunk 0, mb M-1)), then its all-reduce;
* the same with the tail ``B(r-1, M-1) -> ... -> B(0, M-1) -> AR_0`` instead of ``AR_r`` (``r > 0``);
* the *round trip*: the forward of micro-batch 0 through every virtual stage, its backward back up to
  rank ``r``'s first backward op, the rest of rank ``r``'s chain, then the tail to ``AR_0``.

Nothing here imports torch.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain, compress
from operator import itemgetter
from typing import Mapping

from ..simulator.core import cached_graph, make_kernel
from ..simulator.graph import ParamLayout, extra_params
from ..simulator.schedules import BACKWARD, FORWARD, peak_live_microbatches, warmup_forwards


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundPaths:
    """Path multiplicities, flattened: path ``p`` uses ``coef_f[p*nv:(p+1)*nv]`` etc."""

    count: int          # number of paths
    coef_f: array       # 'i', count * nv: forward weight multiplicity per virtual stage
    coef_b: array       # 'i', count * nv: backward weight multiplicity per virtual stage
    coef_s: array       # 'i', count * pp: send (link r -> r+1) multiplicity per rank
    coef_ar: array      # 'i', count * pp: all-reduce multiplicity per rank
    term_ptr: array     # 'i', count + 1: path q's nonzero terms are term_ptr[q]:term_ptr[q+1]
    term_idx: array     # 'i': parameter index of the term (the simulator's ParamLayout)
    term_coef: array    # 'i': its multiplicity
    owner: array        # 'i', count: the rank whose whole op chain (or most of it) the path runs along


def first_backward(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                   rank: int) -> tuple[list[int], int]:
    """Forwards per chunk that ``rank`` runs before its first backward, and that backward's chunk.

    Read off :class:`RankOps` (the schedules' definitions without listing the ops);
    ``tests/unit/test_search_bounds.py`` checks it against ``rank_order`` on many shapes. The first backward is always of micro-batch 0.
    """
    ops = RankOps(schedule, pp, micro_batches, virtual_stages, rank)
    i = ops.first_backward_index()
    before, _bc = ops.counts(0, i)
    return before, ops.op(i)[1]


class RankOps:
    """The op order of one rank (:func:`~poseidon_plugin.simulator.schedules.rank_order`) by
    arithmetic: every schedule is ``w`` warm-up forwards, then ``total - w`` pairs (forward first, or
    backward first for ``eager-1f1b``), then the remaining backwards, and Megatron's interleaved table
    maps virtual micro-batch ``k`` to chunk ``(k // pp) % V`` and micro-batch ``k // (pp V) * pp +
    k % pp`` (``M`` is a multiple of ``pp``). Counting a range's ops per chunk is O(V) where listing the
    ops is O(M V): building the bound paths of a frontier-scale shape walked ~10^5 ops per rank.
    ``tests/unit/test_search_bounds.py`` checks every method against the listed ops."""

    __slots__ = ("pp", "m", "v", "total", "w", "bfirst")

    def __init__(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int, rank: int):
        self.pp, self.m, self.v = pp, micro_batches, virtual_stages
        self.total = micro_batches * virtual_stages
        self.w = warmup_forwards(schedule, pp, micro_batches, virtual_stages, rank)
        self.bfirst = schedule == "eager-1f1b"

    def __len__(self) -> int:
        return 2 * self.total

    def _unit(self, k: int) -> tuple[int, int]:
        """Virtual micro-batch ``k``: (chunk of its forward, micro-batch)."""
        pp, v = self.pp, self.v
        if v == 1:
            return 0, k
        return (k // pp) % v, k // (pp * v) * pp + k % pp

    def op(self, i: int) -> tuple[str, int, int]:
        """``rank_order(...)[i]``."""
        w, total = self.w, self.total
        if i < w:
            c, mb = self._unit(i)
            return FORWARD, c, mb
        if i < 2 * total - w:
            p, pos = divmod(i - w, 2)
            if (pos == 0) != self.bfirst:
                c, mb = self._unit(p + w)
                return FORWARD, c, mb
            c, mb = self._unit(p)
            return BACKWARD, self.v - 1 - c, mb
        c, mb = self._unit(i - total)
        return BACKWARD, self.v - 1 - c, mb

    def forward_index(self, k: int) -> int:
        """Index of the forward of virtual micro-batch ``k``."""
        if k < self.w:
            return k
        return self.w + 2 * (k - self.w) + (1 if self.bfirst else 0)

    def first_backward_index(self) -> int:
        if self.w >= self.total:
            return self.total
        return self.w if self.bfirst else self.w + 1

    def last_forward_index(self) -> int:
        return self.forward_index(self.total - 1)

    def backward_index(self, p: int) -> int:
        """Index of the backward of virtual micro-batch ``p``."""
        i = self.w + 2 * p + (0 if self.bfirst else 1)
        return i if i < 2 * self.total - self.w else p + self.total

    def _chunk_count(self, n: int, c: int) -> int:
        """Virtual micro-batches ``k < n`` whose forward runs chunk ``c``."""
        if self.v == 1:
            return n if n > 0 else 0
        pp, v = self.pp, self.v
        q, rest = divmod(n, pp * v)
        return q * pp + min(max(rest - c * pp, 0), pp)

    def counts(self, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """Forwards and backwards per chunk among ops ``lo <= i < hi``."""
        w, total, v = self.w, self.total, self.v
        lo, hi = max(lo, 0), min(hi, 2 * total)
        f_ranges, b_ranges = [], []
        if lo < hi:
            f_ranges.append((lo, min(hi, w)))                   # warm-up: forward of k = i
            a, b = max(lo, w), min(hi, 2 * total - w)          # pairs: forward of p + w, backward of p
            if a < b:
                sf, sb = (1, 0) if self.bfirst else (0, 1)    # offset of each kind inside a pair
                f_ranges.append((w + -(-(a - w - sf) // 2), w + -(-(b - w - sf) // 2)))
                b_ranges.append((-(-(a - w - sb) // 2), -(-(b - w - sb) // 2)))
            b_ranges.append((max(lo, 2 * total - w) - total, hi - total))   # cool-down: backward of i - total
        fc, bc = [0] * v, [0] * v
        for ranges, out, flip in ((f_ranges, fc, False), (b_ranges, bc, True)):
            for a, b in ranges:
                if a >= b:
                    continue
                for c in range(v):
                    n = self._chunk_count(b, c) - self._chunk_count(a, c)
                    out[v - 1 - c if flip else c] += n
        return fc, bc


def _two_trips(pp: int, v: int, r: int, ops):
    """The *two trips* path of rank ``r``: micro-batch 0 down every virtual stage and back up to rank
    ``r``'s first backward, rank ``r``'s ops up to its last forward, that micro-batch down the rest of
    the virtual stages and back up through all of them, then ``AR_0``. Heterogeneous 1F1B pipelines
    run on it: a slow block of ranks paces the steady state between the first and the last trip.
    None when rank ``r`` has no forward after its first backward (GPipe, or M = 1). ``ops``: a
    :class:`RankOps` (or the same methods over the listed ops)."""
    nv = pp * v
    i_b = ops.first_backward_index()
    i_f = ops.last_forward_index()
    _k, c_b, mb_b = ops.op(i_b)
    _k, c_f, mb_f = ops.op(i_f)
    if i_f < i_b or mb_f == mb_b:
        return None
    vstar, vlast = c_b * pp + r, c_f * pp + r
    rf, rb, rs, rar = [1] * nv, [0] * nv, [0] * pp, [0] * pp
    for vs in range(nv - 1):                    # micro-batch mb_b down every virtual stage
        rs[vs % pp] += 1
    rb[vstar:nv] = [1] * (nv - vstar)           # ... and back up to rank r's first backward
    for vs in range(vstar, nv - 1):
        rs[vs % pp] += 1
    fc, bc = ops.counts(i_b + 1, i_f + 1)       # rank r's chain up to its last forward
    for c in range(v):
        rf[c * pp + r] += fc[c]
        rb[c * pp + r] += bc[c]
    for vs in range(vlast + 1, nv):             # mb_f down the remaining virtual stages
        rf[vs] += 1
    for vs in range(vlast, nv - 1):
        rs[vs % pp] += 1
    for vs in range(nv):                        # ... and back up through all of them
        rb[vs] += 1
    for vs in range(nv - 1):
        rs[vs % pp] += 1
    rar[0] = 1
    return rf, rb, rs, rar


def _detour(pp: int, m: int, v: int, r: int, ops, last):
    """Interleaved only: rank ``r``'s ops up to its chunk-0 forward of micro-batch ``pp - 1``, that
    micro-batch down the chunk-0 stages to the last rank, the last rank's ops up to its first backward,
    the backward chain of micro-batch 0 back up to rank ``r``'s first backward, rank ``r``'s remaining
    ops, then the tail to ``AR_0``. None when the ops are not in that order."""
    if v < 2 or r == pp - 1 or m < pp:
        return None
    nv = pp * v
    i_b = ops.first_backward_index()
    i_f = ops.forward_index(pp - 1)             # virtual micro-batch pp - 1 = (chunk 0, mb pp - 1)
    j_f = last.forward_index(pp - 1)
    j_b = last.first_backward_index()
    _k, c_b, mb_b = ops.op(i_b)
    _k, c_l, mb_l = last.op(j_b)
    if not (i_f < i_b and j_f < j_b and mb_b == 0 and mb_l == 0 and c_l >= c_b):
        return None
    rf, rb, rs, rar = [0] * nv, [0] * nv, [0] * pp, [0] * pp
    for j in range(r):                          # head: micro-batch 0 down the chunk-0 stages to r
        rf[j] += 1
        rs[j] += 1
    fc, bc = ops.counts(0, i_f + 1)             # rank r up to F(chunk 0, mb pp-1)
    for c in range(v):
        rf[c * pp + r] += fc[c]
        rb[c * pp + r] += bc[c]
    for j in range(r + 1, pp):                  # that micro-batch down to the last rank
        rf[j] += 1
        rs[j - 1] += 1
    fc, bc = last.counts(j_f + 1, j_b + 1)      # the last rank up to its first backward
    for c in range(v):
        rf[c * pp + pp - 1] += fc[c]
        rb[c * pp + pp - 1] += bc[c]
    for vs in range(c_b * pp + r, c_l * pp + pp - 1):   # backward of mb 0 back up to rank r
        rb[vs] += 1
        rs[vs % pp] += 1
    fc, bc = ops.counts(i_b + 1, len(ops))      # the rest of rank r
    for c in range(v):
        rf[c * pp + r] += fc[c]
        rb[c * pp + r] += bc[c]
    for j in range(r):                          # tail to AR_0
        rb[j] += 1
        rs[j] += 1
    rar[0] = 1
    return rf, rb, rs, rar


def bound_paths(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                rank_ops=RankOps) -> BoundPaths:
    """The bound paths of a shape (see the module docstring).

    They rely on every schedule starting a rank with F(chunk 0, mb 0) and ending it with
    B(chunk 0, mb M-1), with M forwards and M backwards per chunk (checked by the unit tests).
    ``rank_ops(schedule, pp, M, V, rank)``: each rank's op order (the tests pass one over the listed
    ops of ``rank_order``).
    """
    v, m = virtual_stages, micro_batches
    nv = pp * v
    rows: list[tuple[list[int], list[int], list[int], list[int]]] = []
    owner = array("i")
    orders = [rank_ops(schedule, pp, m, v, r) for r in range(pp)]   # each rank's ops, in order
    for r in range(pp):
        own_chunks = [c * pp + r for c in range(v)]
        cf, cb, cs, car = [0] * nv, [0] * nv, [0] * pp, [0] * pp
        cf[0:r] = [1] * r                       # head: F(j, chunk 0, mb 0), j < r (vs j = rank j)
        cs[0:r] = [1] * r
        for vs in own_chunks:                   # all ops of rank r: M forwards, M backwards per chunk
            cf[vs] += m
            cb[vs] += m
        own_ar = car[:]
        own_ar[r] = 1
        rows.append((cf, cb, cs, own_ar))
        if r > 0:                               # ... then down the chunk-0 backwards to AR_0
            tb = cb[:]
            tb[0:r] = [1] * r
            ts = [x + 1 for x in cs[:r]] + cs[r:]
            tar = [0] * pp
            tar[0] = 1
            rows.append((cf, tb, ts, tar))
        # round trip of micro-batch 0 up to rank r's first backward, then the rest of rank r
        before, chunk_b = first_backward(schedule, pp, m, v, r)
        vstar = chunk_b * pp + r
        rf, rb, rs, rar = [1] * nv, [0] * nv, [0] * pp, [0] * pp
        for vs in range(nv - 1):                # forward chain through every virtual stage
            rs[vs % pp] += 1
        rb[vstar:nv] = [1] * (nv - vstar)       # backward chain up to rank r's first backward
        for vs in range(vstar, nv - 1):
            rs[vs % pp] += 1
        for c, vs in enumerate(own_chunks):     # rank r's ops after its first backward
            rf[vs] += m - before[c]
            rb[vs] += m - (1 if c == chunk_b else 0)
        for j in range(r):                      # tail to AR_0 (vstar >= r: no overlap)
            rb[j] += 1
            rs[j] += 1
        rar[0] = 1
        rows.append((rf, rb, rs, rar))
        two = _two_trips(pp, v, r, orders[r])
        if two is not None:
            rows.append(two)
        det = _detour(pp, m, v, r, orders[r], orders[pp - 1])
        if det is not None:
            rows.append(det)
        owner.extend([r] * (len(rows) - len(owner)))
    return _packed(rows, owner, pp, v)


def _packed(rows: list[tuple[list[int], list[int], list[int], list[int]]], owner: array, pp: int,
            v: int) -> BoundPaths:
    """:class:`BoundPaths` of ``rows`` (per path: forward and backward multiplicities per virtual stage,
    send and all-reduce multiplicities per rank) and their ``owner`` ranks."""
    nv = pp * v
    flat = [array("i", list(chain.from_iterable(row[i] for row in rows))) for i in range(4)]
    # sparse form for the path's cost: (parameter index, multiplicity) in parameter order, gathered
    # at C speed (compress / filter): a frontier shape has ~300 paths of ~400 entries each
    ptr, idx, coef = [0], [], []
    # parameter slot -> virtual stage (None: the same order, V = 1)
    perm = itemgetter(*[c * pp + r for r in range(pp) for c in range(v)]) if v > 1 else None
    slots = (range(1, 1 + nv), range(1 + nv, 1 + 2 * nv), range(1 + 2 * nv, 1 + 2 * nv + pp),
             range(1 + 2 * nv + pp, 1 + 2 * nv + 2 * pp))
    for row in rows:
        for part, (vec, where) in enumerate(zip(row, slots)):
            if perm is not None and part < 2:
                vec = perm(vec)
            idx.extend(compress(where, vec))
            coef.extend(filter(None, vec))      # the multiplicities are >= 0: the non-zero ones
        ptr.append(len(idx))
    return BoundPaths(count=len(rows), coef_f=flat[0], coef_b=flat[1], coef_s=flat[2], coef_ar=flat[3],
                      term_ptr=array("i", ptr), term_idx=array("i", idx), term_coef=array("i", coef),
                      owner=owner)


# rank_chain_paths: the weights of a balanced pipeline (every stage's forward and backward 30, a send 1, an
# all-reduce 10), the owner rank's stages a third heavier, then twice as heavy
CHAIN_STAGE_MS, CHAIN_SEND_MS, CHAIN_ALLREDUCE_MS = 30.0, 1.0, 10.0
CHAIN_OWNER_FACTORS = (4.0 / 3.0, 2.0)


def rank_chain_paths(kernel, template: array, pp: int, v: int) -> list[tuple[tuple[list[int], ...], int]]:
    """Concrete paths of the shape's DAG with their owners: per rank ``r``, the longest paths at the weights
    ``CHAIN_*`` with rank ``r``'s stages ``CHAIN_OWNER_FACTORS`` times the others' (a small scattered offset
    per weight, so that the longest path is the same on either kernel). Under the Megatron comm models a
    rank's blocking p2p calls sit on its own chain between its ops, so these paths cross a link on each
    micro-batch of the owner's steady state, where :func:`bound_paths`' rows (valid for every comm model)
    count the transfers of micro-batch 0 only (docs/SEARCH.md). Each ``(row, owner)``, a row as
    :func:`bound_paths`' ``rows``."""
    nv = pp * v
    out = []
    for r in range(pp):
        for factor in CHAIN_OWNER_FACTORS:
            params = array("d", template)
            for i in range(1, 1 + 2 * nv + 2 * pp):
                params[i] = 1e-6 * ((i * 2654435761) % 1000003) / 1000003   # scattered, below a send
            for q in range(pp):
                params[1 + 2 * nv + q] += CHAIN_SEND_MS
                params[1 + 2 * nv + pp + q] += CHAIN_ALLREDUCE_MS
                for c in range(v):
                    stage = CHAIN_STAGE_MS * (factor if q == r else 1.0)
                    params[1 + q * v + c] += stage
                    params[1 + nv + q * v + c] += stage
            kernel.longest(params)
            cnt = kernel.critical_counts(params)
            cf, cb = [0] * nv, [0] * nv
            for q in range(pp):
                for c in range(v):
                    cf[c * pp + q] = cnt[1 + q * v + c]
                    cb[c * pp + q] = cnt[1 + nv + q * v + c]
            # its owner: the rank with the most forwards and backwards on it (r, unless another rank's
            # chain is longer at these weights)
            own = max(range(pp), key=lambda q: (sum(cf[c * pp + q] + cb[c * pp + q] for c in range(v)), q == r))
            out.append(((cf, cb, list(cnt[1 + 2 * nv:1 + 2 * nv + pp]),
                         list(cnt[1 + 2 * nv + pp:1 + 2 * nv + 2 * pp])), own))
    return out


def _covered(row: tuple[list[int], ...], by: tuple[list[int], ...]) -> bool:
    """Whether every multiplicity of path ``row`` is at most that of path ``by``."""
    return all(x <= y for part, other in zip(row, by) for x, y in zip(part, other))


class ShapeData:
    """Graph kernel, peak live units and bound paths of one ``(schedule, pp, M, V)`` under a comm model.

    The parameter vector has the comm model's extra scalars at its end (``ParamLayout``); build every
    vector with :meth:`new_params` so that they exist and hold their defaults.

    The DAG is built on first use of :attr:`kernel`: most shapes are pruned by the path bounds at
    their root, which need only the paths, and building a graph costs far more than checking them;
    the paths are built on first use of :attr:`paths`.
    """

    __slots__ = ("schedule", "pp", "micro_batches", "virtual_stages", "nv", "_kernel", "n_params",
                 "live", "_paths", "_search_paths", "pure_python", "comm_model", "_template")

    def __init__(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                 pure_python: bool, comm_model: str = "dag", extras: Mapping[str, float] | None = None):
        self.schedule, self.pp = schedule, pp
        self.micro_batches, self.virtual_stages = micro_batches, virtual_stages
        self.nv = pp * virtual_stages
        self.pure_python = pure_python
        self._kernel = None
        self.comm_model = comm_model
        values = extras
        extras = extra_params(comm_model)
        layout = ParamLayout(pp=pp, virtual_stages=virtual_stages,
                             extra_names=tuple(name for name, _d, _doc in extras))
        self.n_params = layout.size
        self._template = array("d", [0.0]) * self.n_params
        for name, default, _doc in extras:
            # the cost model's values (CostModel.comm_extras: measured p2p_call_ms) where it has them
            self._template[layout.extra(name)] = (values or {}).get(name, default)
        self.live = array("i", peak_live_microbatches(schedule, pp, micro_batches, virtual_stages))
        self._paths = None
        self._search_paths = None

    @property
    def paths(self) -> BoundPaths:
        """The bound paths (:func:`bound_paths`), built on first use: the warm-up and the seeds simulate
        plans of many shapes whose groups never reach a tree search."""
        if self._paths is None:
            self._paths = bound_paths(self.schedule, self.pp, self.micro_batches, self.virtual_stages)
        return self._paths

    @property
    def search_paths(self) -> BoundPaths:
        """The tree search's bound paths: :attr:`paths`, and per rank its op chain with the transfers on it
        (:func:`rank_chain_paths`; it needs the DAG, which a tree search builds anyway), each replacing the
        rows of its owner that it covers (so a node prices about as many paths as before)."""
        if self._search_paths is None:
            base = self.paths
            pp, v, nv = self.pp, self.virtual_stages, self.nv
            rows = [(list(base.coef_f[q * nv:(q + 1) * nv]), list(base.coef_b[q * nv:(q + 1) * nv]),
                     list(base.coef_s[q * pp:(q + 1) * pp]), list(base.coef_ar[q * pp:(q + 1) * pp]))
                    for q in range(base.count)]
            owner = list(base.owner)
            for row, r in rank_chain_paths(self.kernel, self._template, pp, v):
                if row in rows:
                    continue
                # a row of the same owner that crosses nothing more (every multiplicity at most this
                # one's) costs at most this one's on any weights: it bounds nothing this one does not
                keep = [q for q in range(len(rows)) if owner[q] != r or not _covered(rows[q], row)]
                rows = [rows[q] for q in keep] + [row]
                owner = [owner[q] for q in keep] + [r]
            self._search_paths = _packed(rows, array("i", owner), pp, v)
        return self._search_paths

    @property
    def kernel(self):
        """The longest-path kernel of this shape's DAG (compiled unless ``pure_python``)."""
        if self._kernel is None:
            graph = cached_graph(self.schedule, self.pp, self.micro_batches, self.virtual_stages,
                                 self.comm_model)
            self._kernel = make_kernel(graph, self.pure_python)
        return self._kernel

    def new_params(self) -> array:
        """A fresh parameter vector ('d', ``n_params``): zeros, the comm model's extras at their defaults."""
        return array("d", self._template)

    @property
    def has_kernel(self) -> bool:
        """Whether the DAG has been built."""
        return self._kernel is not None

    @property
    def key(self) -> tuple[str, int, int, int]:
        """``(schedule, pp, M, V)``."""
        return (self.schedule, self.pp, self.micro_batches, self.virtual_stages)


class ShapeCache:
    """ShapeData per shape, built on first use (a search touches a few hundred shapes)."""

    def __init__(self, pure_python: bool, comm_model: str = "dag", extras: Mapping[str, float] | None = None):
        self.pure_python = pure_python
        self.comm_model = comm_model
        self.extras = dict(extras or {})
        self._shapes: dict[tuple, ShapeData] = {}

    def get(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> ShapeData:
        """The cached :class:`ShapeData` of a shape."""
        key = (schedule, pp, micro_batches, virtual_stages)
        data = self._shapes.get(key)
        if data is None:
            data = self._shapes[key] = ShapeData(schedule, pp, micro_batches, virtual_stages,
                                                 self.pure_python, self.comm_model, self.extras)
        return data

    def __len__(self) -> int:
        return len(self._shapes)
