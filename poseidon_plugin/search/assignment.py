"""The assignment solver: device types to positions, each type at most its supply, the largest total.

A transportation problem (source -> type -> position -> sink, one unit per position), solved exactly by
successive shortest paths: each step adds one unit along the best augmenting path, with the positions'
reassignments compressed into type-to-type moves (Bellman-Ford over the types), so every step is optimal
for its flow value and the last one is optimal (docs/SEARCH.md, "The assignment solver").

Used by the memory-aware seeds (:mod:`.seeds`), the positional bound (:mod:`.group_bounds`) and the
structure bounds (:mod:`.structure_bounds`: capacity of the undecided ranks, the joint gain). This file
is compiled as ``poseidon_plugin._core.assignment`` (typed by ``cython_core/assignment.pxd``) and runs
as it is under ``POSEIDON_PURE_PYTHON=1``.
"""

from array import array

NEG = -(1 << 60)                  # value of a type at a position it cannot take
NEG_F = -1152921504606846976.0    # NEG as a float (exact: a power of two)


def assign_into(n, nt, stride, val, supply, owner, used, gain, via_t, via_r):
    """Types for ``n`` positions (type ``t`` at position ``r`` is worth ``val[t * stride + r]``,
    ``NEG_F``: not allowed), type ``t`` at most ``supply[t]`` times, maximising the sum: the best total
    (``-inf`` when no assignment exists), the type of each position in ``owner``. ``used``, ``gain``,
    ``via_t``, ``via_r``: scratch of ``nt`` entries."""
    total = 0.0
    for t in range(nt):
        used[t] = 0
    for r in range(n):
        owner[r] = -1
    for step in range(n):
        # gain[t]: best gain of reaching type t with one more unit (0 when t has spare supply)
        for t in range(nt):
            gain[t] = 0.0 if used[t] < supply[t] else NEG_F
            via_t[t] = -1
        for rnd in range(nt):
            changed = False
            for r in range(n):
                a = owner[r]
                if a < 0 or val[a * stride + r] == NEG_F:
                    continue
                for b in range(nt):
                    # move position r from type a to b: b's unit comes from a's freed one
                    if b == a or gain[b] == NEG_F or val[b * stride + r] == NEG_F:
                        continue
                    g = gain[b] + val[b * stride + r] - val[a * stride + r]
                    if g > gain[a]:
                        gain[a] = g
                        via_t[a] = b
                        via_r[a] = r
                        changed = True
            if not changed:
                break
        best = NEG_F
        at = -1
        ar = -1
        for r in range(n):
            if owner[r] >= 0:
                continue
            for t in range(nt):
                if gain[t] != NEG_F and val[t * stride + r] != NEG_F and gain[t] + val[t * stride + r] > best:
                    best = gain[t] + val[t * stride + r]
                    at = t
                    ar = r
        if at < 0:
            return -INF
        owner[ar] = at
        total += best
        # walk back: at took position ar, it may have handed one of its positions to the previous type
        seen = 0
        t = at
        while via_t[t] >= 0 and seen <= n:
            b = via_t[t]
            owner[via_r[t]] = b
            t = b
            seen += 1
        used[t] += 1
    return total


INF = float("inf")


def best_assignment(value, supply, pp):
    """Types for ``pp`` positions (type ``t`` at most ``supply[t]`` times) maximising ``sum value[t][r]``
    (``NEG``: type ``t`` cannot take position ``r``): ``(total, types)``, or None when no assignment
    exists. The total is an int when it is integral (the capacities: integers below 2**53 are exact in
    floats, so every comparison and sum is too)."""
    nt = len(supply)
    m = pp if pp > 0 else 1
    n_t = nt if nt > 0 else 1
    val = memoryview(array("d", [NEG_F]) * (n_t * m))
    sup = memoryview(array("i", [0]) * n_t)
    owner = memoryview(array("i", [0]) * m)
    for t in range(nt):
        row = value[t]
        for r in range(pp):
            x = row[r]
            if x != NEG:
                val[t * m + r] = x
        sup[t] = supply[t] if supply[t] < pp else pp
    total = assign_into(pp, nt, m, val, sup, owner, memoryview(array("i", [0]) * n_t),
                        memoryview(array("d", [0.0]) * n_t), memoryview(array("i", [0]) * n_t),
                        memoryview(array("i", [0]) * n_t))
    if total == -INF:
        return None
    return (int(total) if total == int(total) else total), [owner[r] for r in range(pp)]


__all__ = ["NEG", "NEG_F", "assign_into", "best_assignment"]
