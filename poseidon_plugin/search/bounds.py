"""Lower bounds and layer caps of the structure search (docs/SEARCH.md, "Lower bounds").

:class:`StructureBounds` is the bound half of :class:`~.splits.SplitSearch` (which adds the tree walk):
it reads the search state (``types``, ``remaining``, ``used``, ``counts``, ``tau``, the parameter
vector) and tightens the per-stage lower bounds ``lb`` and caps ``cap`` of the undecided ranks:

* :meth:`StructureBounds._propagate` -- memory caps, sum rules, then rounds of the path bounds and the
  type-aware capacity;
* :meth:`StructureBounds._path_caps` -- per bound path: prices (:meth:`_path_prices`), the mass cut
  (:meth:`_path_cuts`), the owner rank's caps per type (:meth:`_owner_caps`, with the placement bounds of
  :meth:`_others_fit`) and the stage caps they give (:meth:`_stage_caps`);
* :meth:`StructureBounds._unknown_mins` / :meth:`_send_lb` -- the smallest weights an undecided rank
  can have (the DAG bound's fill, :meth:`~.splits.SplitSearch._fill`);
* :func:`fluid_cut` -- the shape-free bound of a whole shape group;
* :func:`pipeline_bound` / :func:`positional_bound` -- the shape-free and per-position bounds of a
  group or structure (anytime bounds, structure cuts), with the fill-and-drain paths of
  :func:`drain_coefficients`, :func:`interleaved_drain_counts` and :func:`drain_path_terms`.

``cython_core/_search.pyx`` (``poseidon_plugin._core._search``) compiles the same methods (same operations, same order); the unit tests
compare both field by field.
"""

from __future__ import annotations

import math

from ..stagecost import link_carries_data
from ..backend import compiled
from . import assignment
from .assignment import NEG
from .counters import PRUNED_MEMORY, PRUNED_PATH
from .tables import TypeTable

# the one assignment solver, compiled where built (the same file: the same results)
best_assignment = (compiled("assignment") or assignment).best_assignment

INF = math.inf

# relative slack on the path bounds (sums in a different order than the kernel's): they prune only
# when the bound exceeds tau by more than float noise; the DAG bound is compared exactly (monotone)
PATH_SLACK = 1e-9
# relative margin of the placement bounds' shortcut (StructureBounds._others_fit): a bound known to be
# at most another (in exact arithmetic) is taken to fit only when the other fits by this much more
FIT_SLACK = 1e-12
PROPAGATION_ROUNDS = 3
# a node that inherits its parent's bounds starts near a fixpoint: one round of the path bounds on top
# of the parent's does nearly what two did from scratch (Setting 6 at 288 NPUs: 0.2 % more nodes,
# ~20 % less time); the roots (thousands of shape groups' checks) keep both rounds
INHERITED_ROUNDS = 2

# StructureBounds.mins: the smallest cost of each kind over the types an undecided rank may take
# (the same indices in poseidon_plugin._core._search, which exports MIN_NAMES)
MIN_NAMES = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
             "head_forward_ms", "head_backward_ms", "allreduce_ms", "embedding_allreduce_ms",
             "head_allreduce_ms", "send_ms")
MIN_FORWARD, MIN_BACKWARD, MIN_EMBEDDING_FORWARD, MIN_EMBEDDING_BACKWARD, MIN_HEAD_FORWARD, \
    MIN_HEAD_BACKWARD, MIN_ALLREDUCE, MIN_EMBEDDING_ALLREDUCE, MIN_HEAD_ALLREDUCE, MIN_SEND = \
    range(len(MIN_NAMES))
N_MINS = len(MIN_NAMES)



def chunk_layers(total: int, chunk: int, v: int) -> int:
    """Layers of chunk ``chunk`` when a rank's ``total`` layers are spread evenly, earlier chunks first."""
    return (total + v - 1 - chunk) // v


def fluid_cut(table: TypeTable, slots, micro_batches: int, pp: int, v: int, num_layers: int,
              tau: float) -> bool:
    """Shape-free bound of a shape group: each rank runs its M forwards and backwards one after
    another, so a rank of type t holds fewer than ``tau / (M (f_t + b_t))`` layers, and every rank
    holds at least V; True when the best ``pp`` ranks of the group cannot hold the model that way."""
    if tau == INF:
        return False
    blocks = []           # per type: (cap of each of its ranks, ranks); O(types), not O(pp)
    for t in range(len(slots)):
        x = tau * (1.0 + 1e-9) / (micro_batches * (table.forward_ms[t] + table.backward_ms[t]))
        if min(slots[t], pp) > 0:
            blocks.append((int(x), min(slots[t], pp)))
    total, left, smallest = _take(sorted(blocks, reverse=True), pp)
    if left > 0 or smallest < v:
        return True
    return total < num_layers


def _take(blocks, pp: int) -> tuple[int, int, int | None]:
    """The first ``pp`` ranks of ``blocks`` (``(value, ranks)`` in the order to take them): the sum of
    their values, how many of the ``pp`` were missing, and the last value taken (None: none)."""
    left, total, last = pp, 0, None
    for c, n in blocks:
        k = min(n, left)
        total += k * c
        left -= k
        last = c
        if left == 0:
            break
    return total, left, last


def _last_short_time(capacity, num_layers: int, lo: float, hi: float, rel: float) -> float | None:
    """Bisection on a monotone ``capacity(T)`` (layers the ranks can hold at iteration time T): a time
    ``lo`` whose capacity is still short of ``num_layers`` (so every plan takes longer), within ``rel`` of
    the first time that holds them; ``hi`` is doubled until it holds them. None: no finite time does."""
    while capacity(hi) < num_layers:
        lo, hi = hi, 2.0 * hi
        if hi > 1e18:
            return None
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if capacity(mid) >= num_layers:
            hi = mid
        else:
            lo = mid
        if hi - lo <= rel * hi:
            break
    return lo


def pipeline_bound(table: TypeTable, counts, micro_batches: int, pp: int, v: int,
                   num_layers: int, *, memory: bool = False, live=None, schedule: str | None = None,
                   target: float | None = None, comm_model: str | None = None, assign=None) -> float:
    """A lower bound on the iteration time of every plan of a shape group (``counts``: the most ranks
    of each type) or of a structure (``counts``: exact ranks per type); inf when ``pp`` ranks do not
    exist or cannot hold the model. Shape-free: the engine keeps it for every piece of the space it
    has not searched yet (the anytime lower bound, docs/SEARCH.md "Anytime answers").

    Bound path (b) of every rank ``r``: micro-batch 0's chunk-0 forwards on ranks ``< r``, rank ``r``'s
    ``M`` forwards and backwards of every chunk, the last micro-batch's chunk-0 backwards back up. With
    ``x_i = (f_i + b_i) l_i`` (one micro-batch, all chunks) and chunk 0 holding ``>= l_i / V`` layers,
    ``T >= (x_0 + ... + x_{r-1}) / V + M x_r`` for every ``r``. Any ``k`` of the ``x`` obey the same
    chain, so any ``k`` of them sum to at most ``U_k = T V (1 - q^k)``, ``q = 1 - 1 / (V M)``: the ``x``
    lie in the polymatroid of the concave ``U``. The layers ``sum w_i x_i`` (``w_i = 1 / (f_i + b_i)``)
    must reach ``num_layers``; their maximum over the polymatroid is ``(T / M) sum_k w_(k) q^k``
    (greedy, largest ``w`` first), hence the bound. Memory: each rank holds at most ``cap_i`` layers
    (the cost model's formula with one live micro-batch, never below the true cap); inf when the
    ``pp`` roomiest ranks cannot hold the model, and (``memory``) the larger of the bound above and
    the work bound with caps: ``l_i <= min(cap_i, w_i T / M)`` (rank ``i``'s own work fits in ``T``);
    with ``live`` also :func:`positional_bound` (given ``schedule``: with the fill and drain terms;
    ``target``: computed only up to just above it; ``assign``: its assignment solver)."""
    # per type one block of identical ranks (w, cap, n): O(types) where a list of pp ranks cost
    # O(pp log pp), for each of ~15,000 shape groups at frontier scale. The group may pick any pp.
    blocks = []
    for t in range(len(counts)):
        n = min(counts[t], pp)
        if n <= 0:
            continue
        per_layer = table.layer_state_bytes[t] + table.layer_activation_bytes[t] / v
        most = int(table.usable_bytes[t] / per_layer * (1.0 + 1e-9)) if per_layer > 0 else num_layers
        blocks.append((1.0 / (table.forward_ms[t] + table.backward_ms[t]), min(most, num_layers), n))
    if sum(n for _w, _c, n in blocks) < pp:
        return INF
    room, _left, _last = _take(sorted(((c, n) for _w, c, n in blocks), reverse=True), pp)  # pp roomiest
    if room < num_layers:
        return INF
    blocks.sort(reverse=True)
    q = 1.0 - 1.0 / (v * micro_batches)
    # sum_k w_(k) q^k over the pp ranks with the largest w, block by block (a geometric series: the
    # float error, ~1e-12 relative, is far below the 1e-9 the bound is lowered by)
    cap, k = 0.0, 0
    for w, _c, n in blocks:
        take = min(n, pp - k)
        cap += w * q ** k * (take if q == 1.0 else (1.0 - q ** take) / (1.0 - q))
        k += take
        if k == pp:
            break
    t_free = num_layers * micro_batches / cap
    if not memory:
        return t_free * (1.0 - 1e-9)
    # memory-capped work bound: every rank's M forwards and backwards fit in T (its path (b) without
    # the other ranks), so rank i holds at most min(cap_i, w_i T / M) layers; the best pp ranks must
    # hold the model. Capacity is monotone in T: bisection on it (a few types: cheap)
    per_type = {}
    for w, c, n in blocks:
        per_type[(w, c)] = per_type.get((w, c), 0) + n

    def capacity(t_ms: float) -> float:
        vals = sorted(((min(c, w * t_ms / micro_batches), n) for (w, c), n in per_type.items()),
                      reverse=True)
        left, total = pp, 0.0
        for val, n in vals:
            k = min(n, left)
            total += k * val
            left -= k
            if left == 0:
                break
        return total

    if capacity(t_free) >= num_layers:
        best = t_free          # the caps do not bind at the free bound: nothing to bisect
    else:
        lo = _last_short_time(capacity, num_layers, t_free, 2.0 * t_free, 1e-9)
        if lo is None:
            return INF
        best = lo
    if live is not None:
        best = max(best, positional_bound(table, counts, micro_batches, pp, v, num_layers, live, best,
                                          schedule, target, comm_model, assign))
    return best * (1.0 - 1e-9)


def drain_coefficients(schedule: str, pp: int, micro_batches: int) -> list[tuple[tuple[int, int], ...]]:
    """Per position ``r`` of a ``V = 1`` pipeline, pairs ``(kf, kb)`` such that every plan takes ``T >=
    S + kf F_r + kb B_r`` (``S``: the sum over all ranks of one micro-batch's forward and backward,
    ``F_r`` / ``B_r``: rank ``r``'s per micro-batch; docs/SEARCH.md, "Fill and drain"). Two DAG paths,
    each through every stage once plus rank ``r``'s own ops:

    * *last forward*: micro-batch 0's forwards down to ``r``, rank ``r``'s ops up to its last forward
      (all ``M`` forwards, ``j + 1 - M`` backwards, ``j`` its index), that micro-batch down the later
      stages and back up, ``B(r, M-1)``, the tail up to rank 0: ``kf = M - 1``, ``kb = j + 1 - M``;
    * *first backward*: micro-batch 0 down every stage and back up to ``B(r, 0)`` (index ``i``: the
      ``i`` ops before it are forwards), rank ``r``'s ops from there to its last, ``B(r, M-1)`` (all
      ``M`` backwards, ``M - i`` more forwards), the tail: ``kf = M - i``, ``kb = M - 1``."""
    from .shapes import RankOps      # here: shapes imports the simulator, bounds stays light
    out = []
    for r in range(pp):
        ops = RankOps(schedule, pp, micro_batches, 1, r)
        i, j = ops.first_backward_index(), ops.last_forward_index()
        out.append(((micro_batches - 1, j + 1 - micro_batches), (micro_batches - i, micro_batches - 1)))
    return out


# comm models whose 1F1B programs block on every p2p call (docs/SEARCH.md, "Fill and drain")
BLOCKING_COMM_MODELS = ("megatron", "megatron-overlap")


def interleaved_drain_counts(schedule: str, pp: int, micro_batches: int,
                             v: int) -> list[tuple[list[int], list[int]]]:
    """Per position ``r`` of a ``V > 1`` pipeline (``M`` a multiple of ``pp``), the forwards and
    backwards per chunk ``(kf[c], kb[c])`` of rank ``r`` on its *fill and drain* path: micro-batch 0's
    chunk-0 forwards down to ``r``; rank ``r``'s ops from its first up to its last forward (chunk
    ``V - 1`` of the last micro-batch: every forward); that micro-batch's chunk ``V - 1`` forwards and
    backwards on the later ranks and back; rank ``r``'s ops from ``B(chunk V - 1, M - 1)`` to its last
    (``B(chunk 0, M - 1)``); the chunk-0 backwards of the last micro-batch back up to rank 0. So ``T >=
    sum_{i<r} (F_i0 + B_i0) + sum_{i>r} (F_i,V-1 + B_i,V-1) + sum_c (kf[c] F_rc + kb[c] B_rc)``
    (docs/SEARCH.md, "Fill and drain")."""
    from .shapes import RankOps      # here: shapes imports the simulator, bounds stays light
    out = []
    # virtual micro-batch of (chunk 0, micro-batch M - 1): its backward runs chunk V - 1
    p = (micro_batches // pp - 1) * pp * v + pp - 1
    for r in range(pp):
        ops = RankOps(schedule, pp, micro_batches, v, r)
        j = ops.last_forward_index()
        i = ops.backward_index(p)
        f1, b1 = ops.counts(0, j + 1)
        f2, b2 = ops.counts(i, len(ops))
        out.append(([a + b for a, b in zip(f1, f2)], [a + b for a, b in zip(b1, b2)]))
    return out


def drain_path_terms(table, counts, pp: int, v: int, micro_batches: int, schedule: str,
                     comm_model: str | None) -> list[float]:
    """Per position ``r``, the least time the two fill-and-drain paths of :func:`drain_coefficients`
    spend outside the stages' forwards and backwards: every link crossed twice (``2 (pp - 1)`` sends),
    rank 0's gradient sync and optimizer step after its last backward, and with a blocking comm model
    (megatron's 1F1B) the transfers rank ``r`` waits for between its own ops on the path: ``(M - 1)``
    calls to each neighbour it has. Each send at least the cheapest link of the piece."""
    active = [t for t in range(len(counts)) if min(counts[t], pp) > 0]
    stride = getattr(table, "max_slots", 0)
    sends = []
    if stride and pp > 1:
        if len(active) > 1:
            sends += [table.send_cross_ms[t] for t in active]
        sends += [table.send_same_ms[t * stride + j] for t in active for j in range(min(counts[t], pp) - 1)]
    send = min(sends) if sends else 0.0
    ar0 = 0.0
    if stride:
        # rank 0 is slot 0 of its type and holds at least V layers and the embedding
        ar0 = min(_col(table, "optimizer_fixed_ms", t) + v * _col(table, "optimizer_ms", t)
                  + ((v * table.allreduce_ms[t * stride] + table.embedding_allreduce_ms[t * stride])
                     if table.has_allreduce[t * stride] else 0.0) for t in active)
    out = []
    for r in range(pp):
        x = 2 * (pp - 1) * send + ar0
        if comm_model in BLOCKING_COMM_MODELS and schedule == "1f1b":
            x += (micro_batches - 1) * ((r > 0) + (r < pp - 1)) * send
        out.append(x)
    return out


def _col(table, name: str, t: int) -> float:
    """``table.<name>[t]``, 0 for a column a stand-in table of the tests leaves out."""
    col = getattr(table, name, None)
    return 0.0 if col is None else col[t]


def _cheapest_placement(per_layer, tops, lows, num_layers: int) -> float | None:
    """Least ``sum_i per_layer[i] x_i`` over ``lows[i] <= x_i <= sum(tops[i])`` with ``sum x_i =
    num_layers`` (cheapest types first); None when the caps cannot hold the layers or the lows exceed them."""
    cost, need = 0.0, num_layers
    for i, lo in enumerate(lows):
        if lo > sum(tops[i]):
            return None
        cost += lo * per_layer[i]
        need -= lo
    if need < 0:
        return None
    for i in sorted(range(len(per_layer)), key=lambda i: per_layer[i]):
        take = min(need, sum(tops[i]) - lows[i])
        cost += take * per_layer[i]
        need -= take
    return cost if need == 0 else None


def positional_bound(table: TypeTable, counts, micro_batches: int, pp: int, v: int, num_layers: int,
                     live, start: float = 0.0, schedule: str | None = None,
                     target: float | None = None, comm_model: str | None = None, assign=None) -> float:
    """The work bound with each pipeline position's own memory cap (``live[r]``: the schedule's peak
    live micro-batches at position ``r``, as the cost model's memory formula takes them); a lower
    bound on every plan's time, or ``start`` when it is not larger (docs/SEARCH.md "Anytime answers").

    A rank of type ``t`` at position ``r`` holding ``l`` layers needs at least ``l (s_t + live_r a_t /
    V)`` bytes (its largest chunk holds ``>= l / V`` layers), plus the embedding's state and
    activations at position 0 and the output layer's state at the last one (its activations too with
    ``V = 1``), so ``l <= cap_t(r)``; and bound path (b) of position ``r`` holds its ``M`` forwards and
    backwards after the chunk-0 forward of micro-batch 0 and before the chunk-0 backward of the last one
    on every earlier position (each chunk holds a layer), so ``r c_min + M (F + B) <= T`` with ``F + B >=
    (f_t + b_t) l`` plus the position's extras (embedding at 0, head at the last, every chunk's step
    cost; ``c_min``: the least ``f + b`` of the piece's types) and, ``l`` being an integer, ``l <=
    k_t(r, T)``. Every rank holds at least ``V`` layers, so a type whose cap at a position is below
    ``V`` cannot take it. The ranks must hold every layer: the bound is the smallest ``T`` where the best
    assignment of types to positions (at most ``n_t`` of type ``t``; exactly, when the counts add up
    to ``pp``) holds them with ``h_t(r) = min(cap_t(r), k_t(r, T))`` layers at position ``r``
    (bisection: capacity is monotone in ``T``), computed exactly (:func:`.assignment.best_assignment`) after
    two cheap upper bounds on it, ``sum_t (the n_t largest min(cap_t(r), k_t(0, T)))`` and ``sum_r
    max_t h_t(r)``, did not settle it.

    With ``schedule`` and ``V = 1`` also the fill and drain of the whole pipeline: ``T >= S + kf F_r +
    kb B_r`` for both pairs of :func:`drain_coefficients` at position ``r``, where ``S`` is one
    micro-batch's work on every rank (extras included). With ``Y = T - S`` (the room the drain leaves),
    ``h_t(r)`` is also at most ``floor((Y - kf e^f_t(r) - kb e^b_t(r)) / (kf f_t + kb b_t))``
    (``e``: the position's extras). ``S`` is at least ``S_min(Y)``, the cheapest placement of the model
    when each type's layers fit in its ``n_t`` largest caps ``h_t(r)`` at ``Y`` (with exact counts each
    of its ranks holds at least ``V``), plus the least extras; ``S_min`` does not rise with ``Y``, so
    from ``Y_0 = T - S_min(inf)`` every plan of time ``<= T`` has ``Y <= Y_{k+1} = T - S_min(Y_k)``
    (induction): the caps are taken at the limit of that decreasing sequence. Both paths also hold
    the sends, rank 0's sync and, under a blocking ``comm_model``, the transfers the rank waits for
    (:func:`drain_path_terms`). With ``schedule`` and ``V > 1`` the same with the interleaved path of
    :func:`interleaved_drain_counts`, ``Y = T - S_L / V`` (``S_L``: the layers' work). With
    ``target``: a value just above it as soon as the capacity there is short (the caller needs no
    more), else the bisection. ``assign``: the assignment solver, :func:`.assignment.best_assignment` by
    default (the compiled search passes its twin, which gives the same integral results)."""
    assign = assign or best_assignment
    slack = 1.0 + 1e-9
    m = micro_batches
    active = [t for t in range(len(counts)) if min(counts[t], pp) > 0]     # the order of types
    if not active:
        return INF
    exact = sum(min(counts[t], pp) for t in active) == pp
    types = []
    for t in active:
        n = min(counts[t], pp)
        s_t, a_t, use = table.layer_state_bytes[t], table.layer_activation_bytes[t] / v, table.usable_bytes[t]
        caps = []
        for r in range(pp):
            fixed = 0.0           # bytes the position needs whatever its layers: embedding, head
            if r == 0:
                fixed += _col(table, "embedding_state_bytes", t) + live[r] * _col(table, "embedding_activation_bytes", t)
            if r == pp - 1:
                fixed += _col(table, "head_state_bytes", t)
                if v == 1:
                    fixed += live[r] * _col(table, "head_activation_bytes", t)
            per = s_t + live[r] * a_t
            caps.append(min(num_layers, int((use - fixed) / per * slack)) if per > 0 else num_layers)
        types.append((1.0 / (table.forward_ms[t] + table.backward_ms[t]), n, caps,
                      sorted(caps, reverse=True)[:n]))
    # per position and type: the extra forward and backward ms it pays whatever its layers (every
    # chunk's step, the embedding at position 0, the head at the last)
    ext = [[(v * _col(table, "step_forward_ms", t)
             + (_col(table, "embedding_forward_ms", t) if r == 0 else 0.0)
             + (_col(table, "head_forward_ms", t) if r == pp - 1 else 0.0),
             v * _col(table, "step_backward_ms", t)
             + (_col(table, "embedding_backward_ms", t) if r == 0 else 0.0)
             + (_col(table, "head_backward_ms", t) if r == pp - 1 else 0.0)) for t in active] for r in range(pp)]

    # an earlier position's chunk-0 forward and backward on path (b) take at least this
    c_min = min(table.forward_ms[t] + table.backward_ms[t] for t in active)
    per_layer = [table.forward_ms[t] + table.backward_ms[t] for t in active]
    # the least embedding and head ms of the piece's types (each plan pays both once)
    emb = min(_col(table, "embedding_forward_ms", t) + _col(table, "embedding_backward_ms", t) for t in active)
    head = min(_col(table, "head_forward_ms", t) + _col(table, "head_backward_ms", t) for t in active)
    terms = drain_path_terms(table, counts, pp, v, m, schedule, comm_model) if schedule is not None else None
    drain = False             # V = 1: the pairs of drain_coefficients
    if schedule is not None and v == 1:
        drain = True
        coef = drain_coefficients(schedule, pp, m)
        # per type, its least per-layer slope over the positions (the larger pair of each)
        min_slope = [min(max(kf * table.forward_ms[t] + kb * table.backward_ms[t] for kf, kb in coef[r])
                         for r in range(pp)) for t in active]
        # the least extras every plan's S holds: the embedding, the head, each rank's step costs
        steps = [_col(table, "step_forward_ms", t) + _col(table, "step_backward_ms", t) for t in active]
        s_extra = (sum(n * x for (_w, n, _c, _s), x in zip(types, steps)) if exact else pp * min(steps)) + emb + head
    ilv = None
    if schedule is not None and v > 1 and pp > 1 and m % pp == 0:
        # the fill and drain path of interleaved_drain_counts: rank r's own ops at their counts, each
        # earlier rank's chunk 0 once (>= l_i / V layers), each later rank's chunk V - 1 once (>=
        # (l_i - V + 1) / V): T >= S_L / V + g_rt(l_r) - (V - 1) / V U_rt + fixed_r, S_L = sum_i (f_i +
        # b_i) l_i, U_rt at least sum_{i > r} (f_i + b_i) (the pp - 1 - r largest per-layer costs the
        # other ranks can have)
        counts_v = interleaved_drain_counts(schedule, pp, m, v)
        # per-layer costs the ranks can have, largest first (exact counts: each type n_t times)
        pool = sorted(((x, i) for i, ((_w, n, _c, _s), x) in enumerate(zip(types, per_layer))
                       for _ in range(n if exact else pp)), reverse=True)
        blocks = []         # per (r, i): (A, prefix sums a_0.. of one block of V layers, room shift)
        for r in range(pp):
            kf, kb = counts_v[r]
            fixed = terms[r] + (emb if r > 0 else 0.0) + (head if r < pp - 1 else 0.0)
            row = []
            for i, t in enumerate(active):
                f, b, w = table.forward_ms[t], table.backward_ms[t], per_layer[i]
                a = [kf[c] * f + kb[c] * b - w / v for c in range(v)]
                own = sum(kf[c] * _col(table, "step_forward_ms", t) + kb[c] * _col(table, "step_backward_ms", t)
                          for c in range(v))
                if r == 0:
                    own += kf[0] * _col(table, "embedding_forward_ms", t) + kb[0] * _col(table, "embedding_backward_ms", t)
                if r == pp - 1:
                    own += (kf[v - 1] * _col(table, "head_forward_ms", t)
                            + kb[v - 1] * _col(table, "head_backward_ms", t))
                # the pp - 1 - r largest costs of the others (one rank of type i is r itself)
                others, need, skipped = 0.0, pp - 1 - r, False
                for x, k in pool:
                    if need == 0:
                        break
                    if k == i and not skipped and exact:
                        skipped = True
                        continue
                    others += x
                    need -= 1
                shift = (v - 1) / v * others - fixed - own
                row.append((sum(a), [sum(a[:c]) for c in range(v)], shift) if min(a) > 0.0 else None)
            blocks.append(row)
        ilv = blocks
    lows = [n * v if exact else 0 for _w, n, _c, _s in types]

    def ilv_cap(r: int, i: int, y: float) -> int:
        """Most layers l with g_ri(l) <= the room: whole blocks of V layers, then chunk by chunk."""
        got = ilv[r][i]
        if got is None:
            return num_layers
        a_sum, prefix, shift = got
        room = y + shift
        if room < 0.0:
            return -1
        q = int(room / a_sum * slack)
        s_ = 0
        while s_ + 1 < v and q * a_sum + prefix[s_ + 1] <= room * slack:
            s_ += 1
        return q * v + s_

    # caps_at's constants per position and type: the per-layer share of the work room, the memory
    # cap, the work the position pays whatever its layers, and per drain pair (V = 1) the room its
    # extras and transfers take and its per-layer slope
    fixed_caps = []
    for r in range(pp):
        row = []
        for i, (w, _n, c, _s) in enumerate(types):
            e_f, e_b = ext[r][i]
            pairs = ()
            if drain and ilv is None:
                t = active[i]
                pairs = tuple((terms[r] + kf * e_f + kb * e_b, kf * table.forward_ms[t] + kb * table.backward_ms[t])
                              for kf, kb in coef[r])
            row.append((w / m * slack, c[r], r * c_min + m * (e_f + e_b), pairs))
        fixed_caps.append(row)

    def caps_at(t_ms: float, y: float | None):
        """h[r][i]: most layers position r holds on type i at time t_ms and drain room y (< v: cannot)."""
        h = []
        for r, row in enumerate(fixed_caps):
            out = []
            for i, (share, cap_r, paid, pairs) in enumerate(row):
                work = t_ms - paid
                x = int(share * work) if work > 0.0 else 0
                if x > cap_r:
                    x = cap_r
                if y is not None and ilv is not None:
                    z = ilv_cap(r, i, y)
                    if z < x:
                        x = z
                elif y is not None:
                    # each drain pair: kf F + kb B <= y, with F, B the layers' time plus the extras
                    for taken, sl in pairs:
                        room = y - taken
                        if room < 0.0:
                            x = -1
                            break
                        if sl > 0.0:
                            z = int(room / sl * slack)
                            if z < x:
                                x = z
                out.append(x)
            h.append(out)
        return h

    def s_min(h) -> float | None:
        """The cheapest one-micro-batch work of the model within the caps h (types by f + b, each
        within its n_t largest caps), extras included; None when the caps cannot hold the model."""
        tops = []
        for i, (_w, n, _c, _s) in enumerate(types):
            vals = sorted((row[i] for row in h if row[i] >= v), reverse=True)
            if exact and len(vals) < n:
                return None
            tops.append(vals[:n])
        got = _cheapest_placement(per_layer, tops, lows, num_layers)
        if got is None:
            return None
        # V = 1: the whole one-micro-batch work S; interleaved: S_L / V (its path's share of the others)
        return got + s_extra if drain else got / v

    def capacity(t_ms: float) -> float:
        # per type its n roomiest positions, each within the work of position 0 (k_t(0) >= k_t(r):
        # an upper bound on what the type's ranks hold, without sorting per T)
        ks = [int(w * t_ms / m * slack) for w, _n, _c, _top in types]
        y = None
        h = None
        if drain or ilv is not None:
            # the drain room: from T - S_min(caps without it) down its decreasing sequence
            h = caps_at(t_ms, None)
            s0 = s_min(h)
            if s0 is None:
                return 0
            y = t_ms - s0
            if y < 0.0:
                return 0          # not even one micro-batch through every rank fits
            if drain:
                # the drain term at each type's least slope over the positions (an upper bound too)
                ks = [k if sl <= 0.0 else min(k, int(y / sl * slack)) for k, sl in zip(ks, min_slope)]
        by_type = sum(sum(min(c, k) for c in top) for k, (_w, _n, _c, top) in zip(ks, types))
        if by_type < num_layers:
            return by_type
        if drain or ilv is not None:
            for _ in range(64):
                h = caps_at(t_ms, y)
                s1 = s_min(h)
                if s1 is None:
                    return 0
                y1 = t_ms - s1
                if y1 >= y:
                    break
                y = y1
                if y < 0.0:
                    return 0
        else:
            h = caps_at(t_ms, None)
        # every position at its own best type (integers): an upper bound on any assignment, cheap
        if sum(max(max(row), 0) for row in h) < num_layers:
            return 0
        # the best assignment of types to positions (at most n_t of type t; a type whose cap is below
        # V cannot take the position), exactly: a transportation problem (assignment.best_assignment,
        # successive shortest paths)
        got = assign([[row[i] if row[i] >= v else NEG for row in h] for i in range(len(types))],
                     [n for _w, n, _c, _s in types], pp)
        return 0 if got is None else got[0]

    if capacity(start) >= num_layers:
        return start
    if target is not None and start < target < INF:
        # the caller needs the bound only up to target: one step instead of a bisection; just above
        # target so that pipeline_bound's float margin (1 - 1e-9) keeps the result at or above it
        above = target * (1.0 + 2e-9)
        if capacity(above) < num_layers:
            return above
    lo = _last_short_time(capacity, num_layers, start, max(start, 1e-3) * 2.0, 1e-3)
    return INF if lo is None else lo   # lo stays a bound whatever the precision: a few steps suffice


class PathPrices:
    """One bound path priced at a node (:meth:`StructureBounds._path_prices`); the lazily computed
    parts of the placement bounds (``gsum``, ``gsum0``, ``lbo``, ``elb``: -1 until first needed)."""

    __slots__ = ("base", "a1", "amax", "b1", "b2", "argr", "mu1", "mu2", "marg", "nu1", "nu2", "narg",
                 "rlb", "gsum", "gsum0", "lbo", "elb")

    def __init__(self, *, base, a1, amax, b1, b2, argr, mu1, mu2, marg, nu1, nu2, narg, rlb):
        self.base, self.a1, self.amax, self.b1, self.b2, self.argr = base, a1, amax, b1, b2, argr
        self.mu1, self.mu2, self.marg, self.nu1, self.nu2, self.narg = mu1, mu2, marg, nu1, nu2, narg
        self.rlb = rlb
        self.gsum = self.gsum0 = self.lbo = -1.0
        self.elb = 0


class StructureBounds:
    """The bound methods of :class:`~.splits.SplitSearch` (see the module docstring)."""

    def _unknown_mins(self):
        """Smallest costs over the device types an undecided rank may still take (indices ``MIN_*``;
        0 where no type is left)."""
        t_ = self.table
        big = INF
        m = [big] * N_MINS
        # per remaining type, its own costs of MIN_NAMES[:MIN_SEND] (all-reduces: its free slots');
        # the minima over all of them are theirs, the transfers' are over the links still possible
        self.type_mins = tm = [None] * self.nt
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            tm[t] = own = [t_.forward_ms[t], t_.backward_ms[t], t_.embedding_forward_ms[t],
                           t_.embedding_backward_ms[t], t_.head_forward_ms[t], t_.head_backward_ms[t],
                           big, big, big]
            if t_.send_cross_ms[t] < m[MIN_SEND]:
                m[MIN_SEND] = t_.send_cross_ms[t]
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                has = t_.has_allreduce[i]
                for k, col in ((MIN_ALLREDUCE, t_.allreduce_ms),
                               (MIN_EMBEDDING_ALLREDUCE, t_.embedding_allreduce_ms),
                               (MIN_HEAD_ALLREDUCE, t_.head_allreduce_ms)):
                    x = col[i] if has else 0.0
                    if x < own[k]:
                        own[k] = x
                # links out of slot j: to slot j+1 of its type, or the wrap to slot 0
                if j + 1 < self.counts[t] and t_.send_same_ms[i] < m[MIN_SEND]:
                    m[MIN_SEND] = t_.send_same_ms[i]
                if j > 0 and t_.send_wrap_ms[i] < m[MIN_SEND]:
                    m[MIN_SEND] = t_.send_wrap_ms[i]
            for k in range(MIN_SEND):
                if own[k] < m[k]:
                    m[k] = own[k]
        return [0.0 if x == big else x for x in m]

    def _fits(self, r: int, t: int, lb, capt) -> bool:
        """Whether type ``t``'s caps ``capt`` hold the lower bounds ``lb`` of every chunk of rank ``r``."""
        pp, nt = self.pp, self.nt
        for c in range(self.v):
            vs = c * pp + r
            if capt[vs * nt + t] < lb[vs]:
                return False
        return True

    def _rank_mins(self, r: int, lb, capt, mins):
        """Smallest costs (``MIN_*`` up to the all-reduces) of undecided rank ``r`` over the remaining
        types whose per-type caps ``capt`` hold its lower bounds ``lb`` (every completion below tau
        gives the rank such a type); ``mins`` (all remaining types) when ``capt`` is None or no type
        fits (the propagation cuts such nodes)."""
        if capt is None:
            return mins
        out = None
        for x, own in enumerate(self.type_mins):
            if own is None or not self._fits(r, x, lb, capt):
                continue
            out = list(own) if out is None else [a if a < b else b for a, b in zip(out, own)]
        return mins if out is None else out

    def _send_lb(self, r: int, unknown_min: float) -> float:
        """Transfer ms of link ``r -> r+1``: exact when both ends are decided, else a lower bound."""
        pp, tb = self.pp, self.table
        if not link_carries_data(r, pp, self.v):
            return 0.0
        n = (r + 1) % pp
        t, u = self.types[r], self.types[n]
        if t < 0:
            return unknown_min
        i = t * self.stride + self.slot[r]
        if u >= 0:
            if t != u:
                return tb.send_cross_ms[t]
            return tb.send_wrap_ms[i] if n == 0 else tb.send_same_ms[i]
        best = INF
        if self.remaining[t] > 0:
            # n == 0 only when ranks are decided from the end: the wrap to the type's slot 0
            best = tb.send_wrap_ms[i] if n == 0 else tb.send_same_ms[i]
        if any(self.remaining[x] > 0 for x in range(self.nt) if x != t):
            if tb.send_cross_ms[t] < best:
                best = tb.send_cross_ms[t]
        return 0.0 if best == INF else best

    def _propagate(self, k: int, left: int, lb, cap, capt, parent=None) -> bool:
        """Initialise and tighten ``lb``/``cap`` of the undecided ranks' stages; ``False``: pruned.

        ``capt[vs * nt + t]`` is the cap of stage ``vs`` if its rank takes type ``t`` (-1: cannot).
        ``parent``: the parent node's ``(lb, cap, capt)``, where ranks ``k..`` start from (every
        completion here is one of the parent's, and tau has not risen since: docs/SEARCH.md).
        """
        pp, v, nt = self.pp, self.v, self.nt
        ctr = self.ctr
        for r in range(k, self.ub):
            best = -1
            for x in range(nt):
                cr = self.cap_rank[x * pp + r] if self.remaining[x] > 0 else -1
                # ridge space: once a type's layers have fallen, its later ranks hold at most that
                if self.ridge and self.down[x] and self.last[x] < cr:
                    cr = self.last[x]
                if cr < v:
                    cr = -1
                for c in range(v):
                    i = (c * pp + r) * nt + x
                    ct = chunk_layers(cr, c, v) if cr >= 0 else -1
                    capt[i] = ct if parent is None or ct < parent[2][i] else parent[2][i]
                if cr > best:
                    best = cr
            if best < v:
                ctr[PRUNED_MEMORY] += 1
                return False
            for c in range(v):
                vs = c * pp + r
                lb[vs] = 1
                cap[vs] = chunk_layers(best, c, v)
                if parent is not None:
                    if parent[0][vs] > 1:
                        lb[vs] = parent[0][vs]
                    if parent[1][vs] < cap[vs]:
                        cap[vs] = parent[1][vs]
        tau = self.tau
        rounds = PROPAGATION_ROUNDS if parent is None else INHERITED_ROUNDS
        for rnd in range(rounds):
            s_cap = s_lb = 0
            for r in range(k, self.ub):
                for c in range(v):
                    s_cap += cap[c * pp + r]
                    s_lb += lb[c * pp + r]
            if s_cap < left or s_lb > left:
                ctr[PRUNED_PATH] += 1
                return False
            for r in range(k, self.ub):
                for c in range(v):
                    vs = c * pp + r
                    nl = left - (s_cap - cap[vs])
                    nc = left - (s_lb - lb[vs])
                    if nl > lb[vs]:
                        lb[vs] = nl
                    if nc < cap[vs]:
                        cap[vs] = nc
                    if lb[vs] > cap[vs]:
                        ctr[PRUNED_PATH] += 1
                        return False
            if tau == INF or k == self.ub - 1 or rnd == rounds - 1:
                break
            changed = self._path_caps(k, left, lb, cap, capt)
            if changed >= 0 and not self._type_mass(k, left, lb, cap, capt):
                changed = -1
            if changed < 0:
                ctr[PRUNED_PATH] += 1
                return False
            if changed == 0:
                break
        return True

    def _type_slopes(self):
        """Per remaining type: per-layer forward, backward and (cheapest free slot) all-reduce ms."""
        tb = self.table
        out = []
        for t in range(self.nt):
            if self.remaining[t] <= 0:
                continue
            ar = INF
            for j in range(self.used[t], self.hi[t]):
                i = t * self.stride + j
                x = tb.allreduce_ms[i] if tb.has_allreduce[i] else 0.0
                if x < ar:
                    ar = x
            out.append((t, tb.forward_ms[t], tb.backward_ms[t], 0.0 if ar == INF else ar))
        return out

    def _type_room(self, k: int, lb, cap, capt, slopes):
        """``K[(r * nt + t2) * nt + t]``: most layers above their lower bounds that the undecided ranks
        other than ``r`` can hold on type ``t`` when ``r`` takes type ``t2`` (the ``n`` best of them,
        ``n`` = the type's remaining ranks); -1 when too few of them can host ``t``."""
        pp, v, nt = self.pp, self.v, self.nt
        ecap = self.ecap = [-1] * (pp * nt)
        efull = self.efull = [-1] * (pp * nt)
        order, order_full = [], []
        for t, _ft, _bt, _at in slopes:
            for r in range(k, self.ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    s_lb = 0
                    for c in range(v):
                        s_lb += lb[c * pp + r]
                    ecap[r * nt + t] = s - s_lb
                    efull[r * nt + t] = s
            # ranks by room on t, largest first (ties: lower rank first)
            order.append(sorted((r for r in range(k, self.ub) if ecap[r * nt + t] >= 0),
                                key=lambda r, t=t: -ecap[r * nt + t]))
            order_full.append(sorted((r for r in range(k, self.ub) if efull[r * nt + t] >= 0),
                                     key=lambda r, t=t: -efull[r * nt + t]))
        def top_sum(ranks, vals, t: int, r: int, n: int) -> int:
            total = got = 0
            for j in ranks:
                if got == n:
                    break
                if j != r:
                    total += vals[j * nt + t]
                    got += 1
            return -1 if got < n and self.exact_counts else total

        K = [0] * (pp * nt * nt)
        self.kfull = kfull = [0] * (pp * nt * nt)   # the same with whole capacities
        for r in range(k, self.ub):
            for t2, _f2, _b2, _a2 in slopes:
                for i, (t, _ft, _bt, _at) in enumerate(slopes):
                    n = self.remaining[t] - (1 if t == t2 else 0)
                    K[(r * nt + t2) * nt + t] = top_sum(order[i], ecap, t, r, n)
                    kfull[(r * nt + t2) * nt + t] = top_sum(order_full[i], efull, t, r, n)
        return K

    def _phi(self, e: int, r: int, t2: int, K, mu1, mu2, marg, slopes) -> float:
        """Cheapest cost of ``e`` more layers on the undecided ranks other than ``r`` (which takes
        ``t2``): the cheapest types first, each up to what its ranks can hold (``K``); inf if they
        cannot hold them."""
        nt = self.nt
        items = []
        for t, _ft, _bt, _at in slopes:
            kk = K[(r * nt + t2) * nt + t]
            if kk < 0:
                return INF
            items.append((mu2[t] if marg[t] == r else mu1[t], t, kk))
        items.sort()
        cost = 0.0
        for mu, _t, kk in items:
            if e <= 0:
                break
            if kk == 0:
                continue
            take = e if e < kk else kk
            cost += take * mu
            e -= take
        return cost if e <= 0 else INF

    def _gammas(self, q: int, k: int, lb, room_of, gam, slopes) -> float:
        """Per undecided rank ``r`` (into ``gam[r]``, max over its types): how far its cost along path
        ``q`` of ``d`` layers above its lower bounds ``lb`` can fall below ``beta d`` (``beta``: the
        mean of its chunk slopes), over the counts ``room_of[r * nt + t]`` it can hold (-1: not that
        type); returns their sum. Layer ``l + 1`` of a rank goes to chunk ``l mod V``, so when the
        lower bounds are spread like a rank's layers the cost gains ``V beta`` every ``V`` layers and
        only the first ``V - 1`` counts need a look; otherwise the bound ``chunk c holds at least
        (l - c) / V`` gives the shortfall. With ``lb`` all zero this is the shortfall of a rank's
        whole layer count."""
        pp, v, nt = self.pp, self.v, self.nt
        gsum = 0.0
        xs = [0.0] * v
        for r in range(k, self.ub):
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            even = True
            for c in range(v):
                if chunk_layers(s_lb, c, v) != lb[c * pp + r]:
                    even = False
            gmax = 0.0
            for t, ft, bt, at in slopes:
                room = room_of[r * nt + t]
                if room < 0:
                    continue
                beta = self._chunk_slopes(q, r, ft, bt, at, xs)
                g = 0.0
                if even:
                    acc = 0.0
                    for j in range(1, min(v - 1, room) + 1):
                        acc += xs[(s_lb + j - 1) % v]
                        if beta * j - acc > g:
                            g = beta * j - acc
                else:
                    w = 0.0
                    for c in range(v):
                        w += xs[c] * ((c + v * lb[c * pp + r]) / v)
                    if w - beta * s_lb > g:
                        g = w - beta * s_lb
                if g > gmax:
                    gmax = g
            gam[r] = gmax
            gsum += gmax
        return gsum

    def _chunk_slopes(self, q: int, r: int, ft: float, bt: float, at: float, xs) -> float:
        """Rank ``r``'s per-layer slope of each chunk along path ``q`` on a type (into ``xs``); their
        mean."""
        pp, v, nv = self.pp, self.v, self.nv
        paths = self.shape.paths
        cf, cr = q * nv, q * pp
        beta = 0.0
        for c in range(v):
            vs = c * pp + r
            xs[c] = paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + paths.coef_ar[cr + r] * at
            beta += xs[c]
        return beta / v

    # --- the bound paths (docs/SEARCH.md, "Mass and capacity reasoning") -----------------------

    def _path_caps(self, k: int, left: int, lb, cap, capt) -> int:
        """Tighten caps with the bound paths; -1: some path proves the node cannot beat ``tau``.

        Per path owned by an undecided rank: price its stages (:meth:`_path_prices`), cut the node if
        even the cheapest placement of the remaining layers reaches ``tau`` (:meth:`_path_cuts`), else
        cap the owner's layers per type (:meth:`_owner_caps`). Returns 1 when a cap changed, else 0.
        """
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        paths = self.shape.paths
        self._fill(lb, capt)
        slopes = self._type_slopes()
        limit = self.tau * (1.0 + PATH_SLACK)
        extra = left
        for r in range(k, self.ub):
            for c in range(v):
                extra -= lb[c * pp + r]
        K = self._type_room(k, lb, cap, capt, slopes)
        changed = 0
        alpha = [0.0] * nv
        rmt = [INF] * nt
        rsum = [0.0] * nt
        gam, gam0 = [0.0] * pp, [0.0] * pp     # per rank, see _gammas (above lb / whole count)
        for q in range(paths.count):
            if paths.owner[q] < k or paths.owner[q] >= self.ub:
                continue        # the owner is decided: no caps (below); the DAG bound covers its cut
            pr = self._path_prices(q, k, lb, slopes, alpha, rmt, rsum)
            if self._path_cuts(k, extra, limit, pr, alpha, lb, cap):
                return -1
            if pr.b2 == INF:
                continue
            got = self._owner_caps(q, k, extra, limit, K, pr, alpha, gam, gam0, lb, cap, capt, slopes)
            if got < 0:
                return -1
            if got:
                changed = 1
        return changed

    def _path_prices(self, q: int, k: int, lb, slopes, alpha, rmt, rsum) -> "PathPrices":
        """Path ``q`` at the node: its cost at the lower bounds (``base``) and, per undecided stage,
        its per-layer slope at the cheapest remaining type (into ``alpha``); per type and per rank the
        smallest slopes the placement bounds of :meth:`_owner_caps` use."""
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        p = self.params
        paths = self.shape.paths
        cf = q * nv
        cr = q * pp
        base = 0.0
        for e in range(paths.term_ptr[q], paths.term_ptr[q + 1]):
            base += paths.term_coef[e] * p[paths.term_idx[e]]
        # per-layer cost of each undecided stage in this path, at its cheapest possible type
        a1 = INF
        amax = 0.0
        lift = 0.0
        b1 = b2 = INF                 # the two smallest per-rank minima of alpha, and the argmin
        argr = -1
        mu1, mu2, marg = [INF] * nt, [INF] * nt, [-1] * nt     # the same per type
        # per type, over ranks: the two smallest mean chunk slopes (beta); a rank's d extra
        # layers cost at least beta d - gamma (chunk c gets at least (l - c) / V of its l layers)
        nu1, nu2, narg = [INF] * nt, [INF] * nt, [-1] * nt
        rlb = [0.0] * pp              # per rank: its lb layers along the path, as priced in base
        for r in range(k, self.ub):
            rmin = INF
            s_lb = 0
            m_f, m_b, m_ar = self.fill_slopes[r]      # what the DAG fill priced its lb layers at
            for t, _ft, _bt, _at in slopes:
                rmt[t] = INF
                rsum[t] = 0.0
            for c in range(v):
                vs = c * pp + r
                kf, kb, ka = paths.coef_f[cf + vs], paths.coef_b[cf + vs], paths.coef_ar[cr + r]
                a = INF
                for t, ft, bt, at in slopes:
                    x = kf * ft + kb * bt + ka * at
                    if x < a:
                        a = x
                    if x < rmt[t]:
                        rmt[t] = x
                    rsum[t] += x
                s_lb += lb[vs]
                alpha[vs] = a
                rlb[r] += lb[vs] * a
                # the stage's lb layers cost at least its cheapest type's slope, not the
                # per-column minimum the DAG fill used (over the types that fit the rank)
                lift += lb[vs] * (a - (kf * m_f + kb * m_b + ka * m_ar))
                if a < a1:
                    a1 = a
                if a > amax:
                    amax = a
                if a < rmin:
                    rmin = a
            if rmin < b1:
                b2, b1, argr = b1, rmin, r
            elif rmin < b2:
                b2 = rmin
            for t, _ft, _bt, _at in slopes:
                y = rmt[t]
                if y < mu1[t]:
                    mu2[t], mu1[t], marg[t] = mu1[t], y, r
                elif y < mu2[t]:
                    mu2[t] = y
                y = rsum[t] / v
                if y < nu1[t]:
                    nu2[t], nu1[t], narg[t] = nu1[t], y, r
                elif y < nu2[t]:
                    nu2[t] = y
        base += lift
        return PathPrices(base=base, a1=a1, amax=amax, b1=b1, b2=b2, argr=argr, mu1=mu1, mu2=mu2,
                          marg=marg, nu1=nu1, nu2=nu2, narg=narg, rlb=rlb)

    def _path_cuts(self, k: int, extra: int, limit: float, pr: "PathPrices", alpha, lb, cap) -> bool:
        """Whether the path's cost at the lower bounds plus the cheapest placement of the ``extra``
        layers above them reaches the limit (the node is then cut)."""
        base = pr.base
        if base + extra * pr.a1 >= limit:
            return True
        if extra > 0 and base + extra * pr.amax >= limit:
            if base + self._knapsack(k, self.ub, extra, alpha, lb, cap) >= limit:
                return True
        return False

    def _owner_caps(self, q: int, k: int, extra: int, limit: float, K, pr: "PathPrices", alpha,
                    gam, gam0, lb, cap, capt, slopes) -> int:
        """Caps per type of the owner rank ``r`` of path ``q`` (into ``capt``), then of its stages
        (into ``cap``): -1 when no type can take the rank, 1 when a stage cap fell, else 0.

        The rank's ``d`` layers above its lower bounds cost, along the path, exactly their chunk-by-
        chunk slopes on the type (all its chunks share the type and the layers); the other
        ``extra - d`` layers at least the cheapest slope of another rank's stage (closed form, an upper
        start for ``d``), and at least their cheapest placement by type (:meth:`_others_fit`). The
        cap is the largest ``d`` whose cost stays below the limit. Only the owner is capped: the other
        ranks' slopes on the path are small.
        """
        pp, v, nv, nt = self.pp, self.v, self.nv, self.nt
        paths = self.shape.paths
        cf, cr = q * nv, q * pp
        base = pr.base
        r = paths.owner[q]
        m = pr.b2 if r == pr.argr else pr.b1
        numer = limit - base - m * extra
        ka = paths.coef_ar[cr + r]
        s_lb = 0
        for c in range(v):
            s_lb += lb[c * pp + r]
        for t, ft, bt, at in slopes:
            ct_sum = 0
            for c in range(v):
                vs = c * pp + r
                ct = capt[vs * nt + t]
                if ct < lb[vs]:
                    ct_sum = -1
                    break
                ct_sum += ct
            if ct_sum < 0:
                continue
            xmin = INF
            extra_t = 0.0
            for c in range(v):
                vs = c * pp + r
                x = paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + ka * at
                # on type t the lb layers cost x each, alpha[vs] of it is in base
                extra_t += lb[vs] * (x - alpha[vs])
                if x < xmin:
                    xmin = x
            d = ct_sum - s_lb
            if d > extra:
                d = extra
            slope = xmin - m
            if slope > 0.0:
                room = (numer - extra_t) / slope
                if room < d + 1:
                    d = -1 if room <= 0.0 else math.ceil(room) - 1
            rhs = limit - base - extra_t
            while d >= 0:
                # the rank's own cost of d more layers, chunk by chunk (exact)
                own = 0.0
                for c in range(v):
                    vs = c * pp + r
                    n = chunk_layers(s_lb + d, c, v) - lb[vs]
                    if n < 0:
                        own = INF          # this count leaves a chunk below its lower bound
                        break
                    own += n * (paths.coef_f[cf + vs] * ft + paths.coef_b[cf + vs] * bt + ka * at)
                if own < INF and self._others_fit(q, k, r, t, extra - d, own, rhs, K, pr, gam, gam0,
                                                  lb, slopes):
                    break
                d -= 1
            if d < ct_sum - s_lb:
                u = s_lb + d if d >= 0 else -1
                for c in range(v):
                    vs = c * pp + r
                    ct = chunk_layers(u, c, v) if u >= 0 else -1
                    if ct < lb[vs]:
                        ct = lb[vs] - 1     # type t cannot take rank r
                    if ct < capt[vs * nt + t]:
                        capt[vs * nt + t] = ct
        return self._stage_caps(r, lb, cap, capt, slopes)

    def _others_fit(self, q: int, k: int, r: int, t: int, e: int, own: float, rhs: float, K,
                    pr: "PathPrices", gam, gam0, lb, slopes) -> bool:
        """Whether ``own`` plus each lower bound on the cost, along path ``q``, of the ``e`` layers
        above their lower bounds that the undecided ranks other than ``r`` (on type ``t``) take stays
        below ``rhs``. The placement bounds, in pairs (the answer is order-free):

        (i) each at the cheapest slope of a rank's stage, types in order up to their capacity ``K``;
        (ii) the same with a rank's mean chunk slope less its rounding loss (``V > 1``);
        (iii) the other ranks' whole layer counts, lower bounds included, placed the same way with
        whole capacities, less what ``base`` already priced of their lower bounds; (iv) (iii) with
        mean slopes (``V > 1``).

        A pair's mean-slope bound without its rounding loss is at least both bounds of the pair (a
        rank's cheapest chunk slope is at most its mean, the placement cost is monotone in the slopes,
        and the losses are >= 0): when it fits with ``FIT_SLACK`` to spare for float noise, so does
        the pair, and the losses (``_gammas``) are not computed. Either way the answer is the same.
        """
        pp, v = self.pp, self.v
        if pr.lbo < 0.0:
            # all the other ranks' layers placed by type, their lower bounds too (base priced those
            # at each stage's cheapest type: take them out)
            pr.lbo = 0.0
            pr.elb = 0
            for j in range(k, self.ub):
                if j != r:
                    pr.lbo += pr.rlb[j]
                    for c in range(v):
                        pr.elb += lb[c * pp + j]
        # (iv) and (iii)
        fit = True
        pn = INF
        if v > 1:
            pn = self._phi(pr.elb + e, r, t, self.kfull, pr.nu1, pr.nu2, pr.narg, slopes)
        if v == 1 or not own + (pn - pr.lbo) < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if pr.gsum0 < 0.0:
                    pr.gsum0 = self._gammas(q, k, self.zero_lb, self.efull, gam0, slopes)
                fit = own + (pn - (pr.gsum0 - gam0[r]) - pr.lbo) < rhs
            fit = fit and own + (self._phi(pr.elb + e, r, t, self.kfull, pr.mu1, pr.mu2, pr.marg, slopes)
                                 - pr.lbo) < rhs
        if not fit:
            return False
        # (ii) and (i)
        pn = INF
        if v > 1:
            pn = self._phi(e, r, t, K, pr.nu1, pr.nu2, pr.narg, slopes)
        if v == 1 or not own + pn < rhs - FIT_SLACK * (abs(rhs) + abs(own) + abs(pn)):
            if v > 1:
                if pr.gsum < 0.0:
                    pr.gsum = self._gammas(q, k, lb, self.ecap, gam, slopes)
                fit = own + (pn - (pr.gsum - gam[r])) < rhs
            fit = fit and own + self._phi(e, r, t, K, pr.mu1, pr.mu2, pr.marg, slopes) < rhs
        return fit

    def _stage_caps(self, r: int, lb, cap, capt, slopes) -> int:
        """Each stage of rank ``r``: its cap is the largest over the types that can still take the
        whole rank. -1 when none can, 1 when a cap fell, else 0."""
        pp, v, nt = self.pp, self.v, self.nt
        changed = 0
        for c in range(v):
            vs = c * pp + r
            top = -1
            for t, _ft, _bt, _at in slopes:
                if self._fits(r, t, lb, capt) and capt[vs * nt + t] > top:
                    top = capt[vs * nt + t]
            if top < lb[vs]:
                return -1
            if top < cap[vs]:
                cap[vs] = top
                changed = 1
        return changed

    def _count_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float = INF) -> float:
        """After a DAG bound run: how much more, along one of its longest paths, every completion
        below tau costs than the fill priced the undecided ranks ``[a, b)`` (docs/SEARCH.md, "The gain
        along the bound's longest path"): the larger of two lower bounds. (1) Apart: their
        lower-bound layers, each rank on a remaining type that fits it (``capt``), each type on
        exactly its remaining ranks, bounded by the Lagrangian relaxation of that assignment with the
        per-type mean costs as multipliers, plus the ``extra`` layers above the lower bounds at each
        stage's least slope along the path over those types (fractional, up to the caps). (2) Joint
        (:meth:`_joint_gain`): the two together, the layer sum relaxed with one multiplier and the
        type assignment solved exactly. Once a bound reaches ``need`` (what cuts the child) it is
        returned as it stands."""
        pp, v, nt, nv = self.pp, self.v, self.nt, self.nv
        cnt = self.kernel.critical_counts(self.params)
        tm = self.type_mins
        lam, lcnt = [0.0] * nt, [0] * nt
        crt = self.crt
        slope = self.jslope
        alpha = [0.0] * nv
        for r in range(a, b):
            na = cnt[1 + 2 * nv + pp + r]
            s_lb = 0
            for c in range(v):
                s_lb += lb[c * pp + r]
            m_f, m_b, m_a = self.fill_slopes[r]
            for t in range(nt):
                crt[r * nt + t] = INF
                if self.remaining[t] <= 0:
                    continue
                if not self._fits(r, t, lb, capt):
                    continue
                x = na * s_lb * (tm[t][MIN_ALLREDUCE] - m_a)
                for c in range(v):
                    vs = c * pp + r
                    nf, nb = cnt[1 + r * v + c], cnt[1 + nv + r * v + c]
                    x += lb[vs] * (nf * (tm[t][MIN_FORWARD] - m_f) + nb * (tm[t][MIN_BACKWARD] - m_b))
                crt[r * nt + t] = x
                lam[t] += x
                lcnt[t] += 1
            for c in range(v):
                vs = c * pp + r
                y = INF
                for t in range(nt):
                    if crt[r * nt + t] == INF:
                        continue
                    # one more layer of this stage on type t, along the path
                    x = (cnt[1 + r * v + c] * tm[t][MIN_FORWARD] + cnt[1 + nv + r * v + c] * tm[t][MIN_BACKWARD]
                         + na * tm[t][MIN_ALLREDUCE])
                    slope[vs * nt + t] = x
                    if x < y:
                        y = x
                alpha[vs] = y if y < INF else 0.0
        ll = self._knapsack(a, b, extra, alpha, lb, cap)   # the extra layers, cheapest first
        for t in range(nt):
            if lcnt[t] > 0:
                lam[t] /= lcnt[t]
        for r in range(a, b):
            m1 = INF
            for t in range(nt):
                x = crt[r * nt + t] - lam[t]
                if x < m1:
                    m1 = x
            ll += m1
        for t in range(nt):
            if self.remaining[t] > 0:
                ll += lam[t] * self.remaining[t]
        if ll < need:
            x = self._joint_gain(a, b, lb, cap, capt, extra, need)
            if x > ll:
                ll = x
        return ll if ll > 0.0 else 0.0

    def _joint_gain(self, a: int, b: int, lb, cap, capt, extra: int, need: float = INF) -> float:
        """The gain's second bound (docs/SEARCH.md): rank ``r`` of ``[a, b)`` on type ``t`` with ``e``
        layers above its lower bounds costs, along the path, ``crt[r, t] + sum_c slope[vs, t] e_c``
        (``e_c`` up to the stage's room on ``t``); every completion puts exactly ``extra`` such layers
        and each type on exactly its remaining ranks. Relaxing the layer sum with a multiplier ``mu``
        leaves, per rank and type, ``crt + sum_c min(0, slope - mu) room`` (each stage full or at its
        lower bound), and the exact best assignment of types to ranks of those costs plus ``mu extra``
        bounds every completion, for every ``mu``. The bound is concave in ``mu`` with its maximum at a
        slope: a bisection over the sorted distinct slopes by the sign of ``extra`` minus the room the
        best assignment fills (stopped once the bound reaches ``need``). ``crt`` and ``slope`` come
        from :meth:`_count_gain`; infinite when no assignment exists."""
        pp, v, nt = self.pp, self.v, self.nt
        crt, slope, room = self.crt, self.jslope, self.jroom
        mus = []
        for r in range(a, b):
            for t in range(nt):
                if crt[r * nt + t] == INF:
                    continue
                for c in range(v):
                    vs = c * pp + r
                    ct = capt[vs * nt + t]
                    if cap[vs] < ct:
                        ct = cap[vs]
                    room[vs * nt + t] = ct - lb[vs]
                    if ct > lb[vs]:
                        mus.append(slope[vs * nt + t])
        mus = sorted(set(mus))
        if not mus:
            return self._joint_at(a, b, 0.0, extra)
        best = -INF
        lo, hi = 0, len(mus) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            x = self._joint_at(a, b, mus[mid], extra)
            if x > best:
                best = x
            if best >= need:
                break
            if self.jslack > 0:
                lo = mid + 1
            else:
                hi = mid - 1
        return best

    def _joint_at(self, a: int, b: int, mu: float, extra: int) -> float:
        """:meth:`_joint_gain` at one multiplier ``mu``; sets ``jslack``: ``extra`` less the room the
        best assignment fills at ``mu`` (> 0: the bound rises with ``mu``)."""
        pp, v, nt, n = self.pp, self.v, self.nt, b - a
        crt, slope, room = self.crt, self.jslope, self.jroom
        value = [[NEG] * n for _ in range(nt)]
        for r in range(a, b):
            for t in range(nt):
                if crt[r * nt + t] == INF:
                    continue
                x = crt[r * nt + t]
                for c in range(v):
                    vs = c * pp + r
                    if slope[vs * nt + t] < mu:
                        x += (slope[vs * nt + t] - mu) * room[vs * nt + t]
                value[t][r - a] = -x
        got = best_assignment(value, [max(0, x) for x in self.remaining], n)
        if got is None:
            self.jslack = 0
            return INF
        filled = 0
        for i, t in enumerate(got[1]):
            for c in range(v):
                vs = c * pp + a + i
                if slope[vs * nt + t] <= mu:
                    filled += room[vs * nt + t]
        self.jslack = extra - filled
        return mu * extra - got[0]

    def _type_mass(self, k: int, left: int, lb, cap, capt) -> bool:
        """The undecided ranks, each on one remaining type, must be able to hold ``left`` layers."""
        return self._type_capacity(k, self.ub, lb, cap, capt) >= left

    def _rank_capacity(self, r: int, t: int, lb, cap, capt) -> int:
        """Most layers rank ``r`` holds on type ``t`` (its chunks' caps); -1 when a chunk's cap on ``t``
        is below its lower bound."""
        pp, v, nt = self.pp, self.v, self.nt
        s = 0
        for c in range(v):
            vs = c * pp + r
            ct = min(capt[vs * nt + t], cap[vs])
            if ct < lb[vs]:
                return -1
            s += ct
        return s

    def _type_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """Most layers ranks ``k..ub-1`` can hold, each on one remaining type: with exact counts the
        best assignment (-1 when none exists), else per type its ``n`` largest rank capacities."""
        pp, nt = self.pp, self.nt
        if self.exact_counts and k < ub:
            # the best assignment: at most the per-type sum below (where every type may count the
            # same roomy ranks), and -1 wherever that sum finds too few ranks for a type
            return self._assign_capacity(k, ub, lb, cap, capt)
        total = 0
        for t in range(nt):
            n = self.remaining[t]
            if n <= 0:
                continue
            vals = []
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    vals.append(s)
            vals.sort(reverse=True)
            total += sum(vals[:n])
        return total

    def _assign_capacity(self, k: int, ub: int, lb, cap, capt) -> int:
        """With exact counts: the most layers ranks ``k..ub-1`` hold when each takes one remaining type
        and type ``t`` goes to exactly its ``remaining[t]`` of them (the best assignment, a transportation
        problem solved exactly by :func:`.assignment.best_assignment`); -1 when no assignment exists. At most
        the per-type sum above, where every type may count the same roomy ranks."""
        pp, nt = self.pp, self.nt
        value = [[NEG] * (ub - k) for _ in range(nt)]
        for t in range(nt):
            if self.remaining[t] <= 0:
                continue
            for r in range(k, ub):
                s = self._rank_capacity(r, t, lb, cap, capt)
                if s >= 0:
                    value[t][r - k] = s
        got = best_assignment(value, [max(0, x) for x in self.remaining], ub - k)
        return -1 if got is None else got[0]

    def _knapsack(self, k: int, ub: int, extra: int, alpha, lb, cap) -> float:
        """Cheapest cost of ``extra`` more layers over the stages of ranks ``k..ub-1`` (fractional, by
        slope)."""
        pp, v = self.pp, self.v
        order = sorted((c * pp + r for r in range(k, ub) for c in range(v)), key=lambda vs: alpha[vs])
        cost = 0.0
        for vs in order:
            take = cap[vs] - lb[vs]
            if take > extra:
                take = extra
            cost += take * alpha[vs]
            extra -= take
            if extra <= 0:
                break
        return cost

