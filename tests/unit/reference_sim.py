"""An independent, slow reference for the simulator: event-driven execution of each rank's op list.

It derives the op orders from the schedules' textual definitions (Megatron's loops written out with
modular arithmetic instead of the schedule table) and executes them op by op: an op starts when the
rank's previous op is done and its data dependency has arrived. No graph, no topological order.
"""

from __future__ import annotations


def orders(schedule, pp, m, v):
    out = []
    for r in range(pp):
        ops = []
        if schedule == "gpipe":
            ops = [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
        elif schedule in ("1f1b", "eager-1f1b"):
            w = min(pp - r - 1, m) if schedule == "1f1b" else min(2 * (pp - r - 1) + 1, m)
            f = list(range(m))
            ops = [("F", 0, i) for i in f[:w]]
            nf, nb = w, 0
            while nb < m:
                if nf < m:
                    if schedule == "1f1b":
                        ops += [("F", 0, nf), ("B", 0, nb)]
                    else:
                        ops += [("B", 0, nb), ("F", 0, nf)]
                    nf += 1
                else:
                    ops.append(("B", 0, nb))
                nb += 1
        else:  # interleaved, group size pp, m a multiple of pp
            total = m * v
            w = min((pp - r - 1) * 2 + (v - 1) * pp, total)

            def fwd(k):
                return ("F", (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp)

            def bwd(k):
                return ("B", v - 1 - (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp)

            ops = [fwd(k) for k in range(w)]
            for k in range(total - w):
                ops += [fwd(k + w), bwd(k)]
            ops += [bwd(k) for k in range(total - w, total)]
        out.append(ops)
    return out


def simulate(schedule, pp, m, v, fwd, bwd, send, ar):
    """Iteration time by executing ops in order; fwd/bwd indexed [rank*v+chunk]."""
    clock = rank_clocks(schedule, pp, m, v, fwd, bwd, send)
    return max(clock[r] + ar[r] for r in range(pp))


def simulate_data_parallel(schedule, pp, m, v, fwd, bwd, send, ar, dp):
    """``dp`` pipeline replicas run side by side; the gradient all-reduce of pipeline rank r is one
    collective over the r-th rank of every replica, so it starts when the slowest of them is done."""
    clocks = [rank_clocks(schedule, pp, m, v, fwd, bwd, send) for _ in range(dp)]
    return max(max(c[r] for c in clocks) + ar[r] for r in range(pp))


def rank_clocks(schedule, pp, m, v, fwd, bwd, send):
    """When each rank finishes its last compute op."""
    ords = orders(schedule, pp, m, v)
    done = {}
    pos = [0] * pp
    clock = [0.0] * pp
    nvs = pp * v
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(ords[r]):
                kind, c, mb = ords[r][pos[r]]
                vs = c * pp + r
                if kind == "F":
                    dep = ("F", vs - 1, mb) if vs > 0 else None
                    link = (vs - 1) % pp
                else:
                    dep = ("B", vs + 1, mb) if vs < nvs - 1 else ("F", vs, mb)
                    link = r
                if dep is not None and dep not in done:
                    break
                arrive = 0.0
                if dep is not None:
                    arrive = done[dep] + (send[link] if dep[1] != vs else 0.0)
                start = max(clock[r], arrive)
                clock[r] = start + (fwd if kind == "F" else bwd)[r * v + c]
                done[(kind, vs, mb)] = clock[r]
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(ords[r]) for r in range(pp)), "reference deadlocked"
    return clock
