"""Whole-group lower bounds of the plan search (docs/SEARCH.md, "Anytime answers"), used by the engine:

* :func:`fluid_cut` -- the shape-free bound of a whole shape group;
* :func:`pipeline_bound` / :func:`positional_bound` -- the shape-free and per-position bounds of a
  group or structure (anytime bounds, structure cuts), with the fill-and-drain paths of
  :func:`drain_coefficients`, :func:`double_drain_coefficients`, :func:`interleaved_drain_counts`,
  :func:`drain_path_terms`, :func:`blocking_waits` and :func:`rank_sync_terms`.

The bounds inside one structure's tree are :mod:`.structure_bounds`.
"""

from __future__ import annotations

import math

from poseidon_plugin.backend import compiled
from poseidon_plugin.search import assignment
from poseidon_plugin.search.assignment import NEG
from poseidon_plugin.search.shapes import RankOps
from poseidon_plugin.search.tables import TypeTable

# the one assignment solver, compiled where built (the same file: the same results)
best_assignment = (compiled("assignment") or assignment).best_assignment

INF = math.inf


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
                   target: float | None = None, comm_model: str | None = None, assign=None,
                   witness: list | None = None) -> float:
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
    ``target``: computed only up to just above it; ``assign``: its assignment solver; ``witness``: its
    relaxation's best assignment, :func:`positional_bound`)."""
    # per type one block of identical ranks (w, cap, n): O(types) where a list of pp ranks cost
    # O(pp log pp), for each of the many shape groups of a large cluster. The group may pick any pp.
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
                                          schedule, target, comm_model, assign, witness))
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
    out = []
    for r in range(pp):
        ops = RankOps(schedule, pp, micro_batches, 1, r)
        i, j = ops.first_backward_index(), ops.last_forward_index()
        out.append(((micro_batches - 1, j + 1 - micro_batches), (micro_batches - i, micro_batches - 1)))
    return out


def double_drain_coefficients(coef) -> list[tuple[int, int] | None]:
    """Per position ``r`` of a ``V = 1`` pipeline, ``(kf, kb)`` such that every plan takes ``T >= S +
    kf F_r + kb B_r + L_r`` (``L_r``: the later ranks' one micro-batch forward and backward), or None;
    ``coef``: :func:`drain_coefficients` of the shape. The DAG path *through the later ranks twice*:
    micro-batch 0 down every stage and back up to ``B(r, 0)`` (index ``i``), rank ``r``'s ops from
    there to its last forward ``F(r, M-1)`` (index ``j``; a path where ``i <= j``: ``M - i`` forwards,
    the first backward pair's ``kf``, and ``j + 1 - M`` backwards, the last forward pair's ``kb``), that
    micro-batch down the later stages and back up, ``B(r, M-1)``, the tail up to rank 0. Where an early
    rank of a deep pipeline is the slowest, this is the longest path: it holds the later ranks twice
    where the first backward path holds rank ``r``'s ``w`` warm-up backwards instead (random-16 of the
    public sweep: 1F1B, PP 25, M = 256, the slowest rank fourth; 1,100 ms of its 53,387 more)."""
    out = []
    for last_forward, first_backward in coef:
        kf, kb = first_backward[0], last_forward[1]
        out.append((kf, kb) if kf + kb >= 1 else None)      # i <= j
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
    spend outside the stages' forwards and backwards whatever the position's type: every link crossed
    twice (``2 (pp - 1)`` sends, each at least the cheapest link of the piece) and rank 0's gradient
    sync and optimizer step after its last backward. The transfers a blocking comm model makes rank
    ``r`` wait for depend on its type: :func:`blocking_waits`."""
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
    return [2 * (pp - 1) * send + ar0] * pp


def blocking_waits(table, counts, pp: int, micro_batches: int, schedule: str,
                   comm_model: str | None) -> list[list[float]]:
    """Per position ``r`` and active type (the order of ``counts``' types with a rank), the transfers
    rank ``r`` of that type waits for on both fill-and-drain paths under a blocking comm model
    (megatron's 1F1B; 0 otherwise): ``M - 1`` calls on the link to each neighbour it has. A link is
    priced by its sender (``send_cross`` of the sender's type where the types differ, ``send_same`` of
    the sender's slot where they match), so each call costs at least the least such price the piece
    allows: out of ``r`` the type's own ``send_cross`` (where another type is active) or its
    ``send_same`` slots (where it has two ranks); into ``r`` another active type's ``send_cross`` or
    the type's ``send_same`` slots. On a 3-type pipeline whose slow type's links cost 1.43 ms where
    the piece's cheapest is 0.86 (M = 256), that is 290 ms more on its positions."""
    active = [t for t in range(len(counts)) if min(counts[t], pp) > 0]
    stride = getattr(table, "max_slots", 0)
    if not (stride and pp > 1 and comm_model in BLOCKING_COMM_MODELS and schedule == "1f1b"):
        return [[0.0] * len(active) for _ in range(pp)]
    ins, outs = [], []
    for t in active:
        same = [table.send_same_ms[t * stride + j] for j in range(min(counts[t], pp) - 1)]
        cross_out = [table.send_cross_ms[t]] if len(active) > 1 else []
        cross_in = [table.send_cross_ms[u] for u in active if u != t]
        outs.append(min(same + cross_out, default=0.0))
        ins.append(min(same + cross_in, default=0.0))
    k = micro_batches - 1
    return [[k * ((ins[i] if r > 0 else 0.0) + (outs[i] if r < pp - 1 else 0.0)) for i in range(len(active))]
            for r in range(pp)]


def rank_sync_terms(table, counts, pp: int) -> tuple[list[float], list[float]]:
    """Per active type (the order of ``counts``' types with a rank), the least gradient sync and
    optimizer step a rank of that type pays after its last backward (``put_rank_times``): the fixed
    part (``optimizer_fixed_ms``) and the part per layer (``optimizer_ms`` and the least per-layer
    all-reduce of the slots it may take). The embedding's and the head's syncs are left out."""
    active = [t for t in range(len(counts)) if min(counts[t], pp) > 0]
    stride = getattr(table, "max_slots", 0)
    fixed = [_col(table, "optimizer_fixed_ms", t) for t in active]
    slope = [_col(table, "optimizer_ms", t)
             + (min((table.allreduce_ms[t * stride + j] if table.has_allreduce[t * stride + j] else 0.0)
                    for j in range(min(counts[t], pp))) if stride else 0.0) for t in active]
    return fixed, slope


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
                     target: float | None = None, comm_model: str | None = None, assign=None,
                     witness: list | None = None) -> float:
    """The work bound with each pipeline position's own memory cap (``live[r]``: the schedule's peak
    live micro-batches at position ``r``); a lower bound on every plan's time, or ``start`` when it is
    not larger. The statement and its proof: docs/SEARCH.md, "What `positional_bound` computes".
    ``schedule`` adds the fill and drain paths, ``comm_model`` the transfers a blocking model waits for,
    ``target`` stops just above that value, ``assign`` is the assignment solver
    (:func:`.assignment.best_assignment` by default; the compiled search passes its compiled build).
    ``witness`` (a list, exact counts): filled with ``[T, types, caps]``, the least ``T`` whose best
    assignment was found to hold the model, the device type it gives each position and that position's
    cap: the relaxation's own plan, which the engine turns into a seed (:func:`.seeds.relaxation_split`)."""
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
        double = double_drain_coefficients(coef)
        waits = blocking_waits(table, counts, pp, m, schedule, comm_model)
        ar_fixed, ar_slope = rank_sync_terms(table, counts, pp)
        synced = bool(getattr(table, "max_slots", 0))     # a table with per-slot columns
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
    sums = False        # caps_at sums the earlier positions' most work: a double path or own-sync pair reads it
    for r in range(pp):
        row = []
        for i, (w, _n, c, _s) in enumerate(types):
            e_f, e_b = ext[r][i]
            pairs = ()
            dbl = None
            if drain and ilv is None:
                t = active[i]
                pairs = tuple((terms[r] + waits[r][i] + kf * e_f + kb * e_b, False,
                               kf * table.forward_ms[t] + kb * table.backward_ms[t])
                              for kf, kb in coef[r])
                if double[r] is not None and min(double[r]) > 1:
                    # the path through the later ranks twice: with L_r = S - E_r - (F_r + B_r), T -
                    # 2 S + E_r >= (kf - 1) F_r + (kb - 1) B_r + its sends, sync and waits (the rank's
                    # calls between B(r, 0) and F(r, M-1): at least min(kf, kb) - 1 on each link)
                    kf, kb = double[r]
                    dbl = (terms[r] + waits[r][i] * (min(kf, kb) - 1) / (m - 1) + (kf - 1) * e_f + (kb - 1) * e_b,
                           (kf - 1) * table.forward_ms[t] + (kb - 1) * table.backward_ms[t])
                    sums = True
            if drain and ilv is None and synced and ar_fixed[i] + c[r] * ar_slope[i] > terms[r]:
                # the same two paths ending at rank r's own gradient sync and optimizer step (after
                # B(r, M-1)) instead of the tail up to rank 0's: T - S + (the earlier ranks' backward of
                # one micro-batch, at most their caps') >= kf F_r + kb B_r + AR_r (its sends dropped);
                # tighter than the pair's own only where AR_r at the memory cap exceeds terms[r]
                pairs += tuple((waits[r][i] + kf * e_f + kb * e_b + ar_fixed[i], True,
                                kf * table.forward_ms[t] + kb * table.backward_ms[t] + ar_slope[i])
                               for kf, kb in coef[r])
                sums = True
            row.append((w / m * slack, c[r], r * c_min + m * (e_f + e_b), pairs, dbl, e_f + e_b, e_b))
        fixed_caps.append(row)

    per_b = [table.backward_ms[t] for t in active]

    def caps_at(t_ms: float, y: float | None):
        """h[r][i]: most layers position r holds on type i at time t_ms and drain room y (< v: cannot)."""
        h = []
        # the double path's room: T - 2 S + E_r <= y - S_lb + E_r, S_lb = t_ms - y the least S (the
        # sequence of capacity), E_r the earlier positions' work: at most their caps' (h so far)
        e_sum = eb_sum = 0.0
        for r, row in enumerate(fixed_caps):
            out = []
            for i, (share, cap_r, paid, pairs, dbl, _e, _eb) in enumerate(row):
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
                    for taken, own_sync, sl in pairs:
                        # own_sync: a path that ends at rank r's own sync, with the earlier ranks'
                        # backwards out of S (at most their caps')
                        room = y + eb_sum - taken if own_sync else y - taken
                        if room < 0.0:
                            x = -1
                            break
                        if sl > 0.0:
                            z = int(room / sl * slack)
                            if z < x:
                                x = z
                    if dbl is not None and x >= 0:
                        taken, sl = dbl
                        room = 2.0 * y - t_ms + e_sum - taken
                        if room < 0.0:
                            x = -1
                        elif sl > 0.0:
                            z = int(room / sl * slack)
                            if z < x:
                                x = z
                out.append(x)
            h.append(out)
            if y is not None and sums:
                most = most_b = 0.0
                for i, x in enumerate(out):
                    if x >= v:
                        got = x * per_layer[i] + row[i][5]
                        if got > most:
                            most = got
                        got = x * per_b[i] + row[i][6]
                        if got > most_b:
                            most_b = got
                e_sum += most
                eb_sum += most_b
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
        if got is None:
            return 0
        if witness is not None and exact and got[0] >= num_layers and (not witness or t_ms < witness[0]):
            witness[:] = [t_ms, [active[i] for i in got[1]], [h[r][i] for r, i in enumerate(got[1])]]
        return got[0]

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
