"""Fidelity benchmark configurations and the measured-vs-simulated comparison (no torch here).

A configuration is a plain dict sent to every rank (``_fidelity_worker.py``): schedule, ``pp``, ``M``,
``V``, ``overlap`` (megatron's ``overlap_p2p_comm``), ``dp`` and the sleep lengths per (rank, chunk).
:func:`predict` turns the ranks' measurements into the simulator's stage-level input and evaluates it
with the ``dag`` and ``megatron`` comm models.
"""

from __future__ import annotations

import statistics

from poseidon_plugin.simulator import Simulator
from poseidon_plugin.simulator import comm_megatron

# Activation sent between stages: [seq, micro-batch, hidden] fp32 = 64 KiB.
SEQ, MBS, HIDDEN = 64, 1, 256


def _times(pp: int, v: int, base_ms: float, spread: float, pattern: int) -> list[list[float]]:
    """Per (rank, chunk) forward ms: heterogeneous, from ``base_ms`` up to ``spread * base_ms``.

    ``pattern`` picks where the slow stages sit (so that the slowest is not always the last).
    """
    n = pp * v
    if spread == 1.0 or n == 1:
        mult = [1.0] * n
    else:
        ramp = [1.0 + (spread - 1.0) * i / (n - 1) for i in range(n)]
        if pattern == 1:    # slow in the middle
            ramp = ramp[::2] + ramp[1::2][::-1]
        elif pattern == 2:  # slow first
            ramp = ramp[::-1]
        elif pattern == 3:  # zig-zag
            ramp = [ramp[(i * 3) % n] if n % 3 else ramp[(i * 5) % n] for i in range(n)]
        mult = ramp
    # Virtual stage vs = chunk * pp + rank holds multiplier mult[vs].
    return [[round(base_ms * mult[c * pp + r], 3) for c in range(v)] for r in range(pp)]


def config(name: str, schedule: str, pp: int, m: int, v: int = 1, *, overlap: bool = False, dp: int = 1,
           base_ms: float = 6.0, spread: float = 1.0, pattern: int = 0, b_ratio: float = 2.0) -> dict:
    """One benchmark configuration (sent as is to the ranks)."""
    f = _times(pp, v, base_ms, spread, pattern)
    b = [[round(x * b_ratio, 3) for x in row] for row in f]
    return {"name": name, "schedule": schedule, "pp": pp, "M": m, "V": v, "overlap": overlap, "dp": dp,
            "spread": spread, "f_ms": f, "b_ms": b, "seq": SEQ, "mbs": MBS, "hidden": HIDDEN}


def full_configs() -> list[dict]:
    """The benchmark set: 6 per megatron schedule variant; pp 2-8, M pp..4pp, V 1-2, spread 1-4x, DP 1-2.

    Sleeps are a few ms to ~50 ms; the configurations with 8 ranks get the longer ones, because their
    per-event process overheads (wake-ups, Python between calls) grow with the CPU contention.
    """
    c = config
    return [
        c("1f1b pp2 M2", "1f1b", 2, 2, base_ms=8.0),
        c("1f1b pp2 M8 dp2", "1f1b", 2, 8, dp=2, spread=2.0),
        c("1f1b pp4 M4", "1f1b", 4, 4, spread=4.0, pattern=1),
        c("1f1b pp4 M16", "1f1b", 4, 16, spread=3.0, pattern=3, base_ms=4.0),
        c("1f1b pp4 M8 dp2", "1f1b", 4, 8, dp=2, spread=2.0, pattern=2),
        c("1f1b pp8 M16", "1f1b", 8, 16, spread=4.0, pattern=1, base_ms=5.0),
        c("int pp2 M4 V2", "interleaved-1f1b", 2, 4, 2, spread=2.0),
        c("int pp2 M8 V2 dp2", "interleaved-1f1b", 2, 8, 2, dp=2, spread=4.0, pattern=3),
        c("int pp4 M8 V2", "interleaved-1f1b", 4, 8, 2, spread=3.0, pattern=1, base_ms=4.0),
        c("int pp4 M16 V2", "interleaved-1f1b", 4, 16, 2, spread=4.0, pattern=2, base_ms=3.0),
        c("int pp4 M4 V2 dp2", "interleaved-1f1b", 4, 4, 2, dp=2, base_ms=12.0),
        c("int pp8 M8 V2", "interleaved-1f1b", 8, 8, 2, spread=2.0, pattern=3, base_ms=6.0),
        c("int+ov pp2 M4 V2", "interleaved-1f1b", 2, 4, 2, overlap=True, spread=2.0),
        c("int+ov pp2 M8 V2 dp2", "interleaved-1f1b", 2, 8, 2, overlap=True, dp=2, spread=4.0, pattern=3),
        c("int+ov pp4 M8 V2", "interleaved-1f1b", 4, 8, 2, overlap=True, spread=3.0, pattern=1, base_ms=4.0),
        c("int+ov pp4 M16 V2", "interleaved-1f1b", 4, 16, 2, overlap=True, spread=4.0, pattern=2, base_ms=3.0),
        c("int+ov pp4 M4 V2 dp2", "interleaved-1f1b", 4, 4, 2, overlap=True, dp=2, base_ms=12.0),
        c("int+ov pp8 M8 V2", "interleaved-1f1b", 8, 8, 2, overlap=True, spread=2.0, pattern=3, base_ms=6.0),
    ]


def quick_configs() -> list[dict]:
    """A small subset (one or two per schedule variant, at most 4 ranks)."""
    c = config
    return [
        c("1f1b pp4 M8", "1f1b", 4, 8, spread=3.0, pattern=1, base_ms=4.0),
        c("int pp2 M4 V2", "interleaved-1f1b", 2, 4, 2, spread=2.0),
        c("int pp4 M8 V2", "interleaved-1f1b", 4, 8, 2, spread=3.0, pattern=1, base_ms=4.0),
        c("int+ov pp4 M8 V2", "interleaved-1f1b", 4, 8, 2, overlap=True, spread=3.0, pattern=1, base_ms=4.0),
    ]


def variant(cfg: dict) -> str:
    """The schedule as megatron runs it: ``1f1b``, ``interleaved`` or ``interleaved+overlap``."""
    if cfg["schedule"] == "1f1b":
        return "1f1b"
    return "interleaved+overlap" if cfg["overlap"] else "interleaved"


def trimmed_mean(xs: list[float], cut: float = 0.15) -> float:
    """Mean without the lowest and highest ``cut`` fraction (at least one each from 5 values on)."""
    xs = sorted(xs)
    k = max(1, int(len(xs) * cut)) if len(xs) >= 5 else 0
    return statistics.fmean(xs[k:len(xs) - k])


def stage_input(cfg: dict, answers: list[dict], it: int, replica: int | None = None) -> dict:
    """The simulator's stage-level document for measured iteration ``it`` of DP replica ``replica``
    (``None``: averaged over the replicas).

    Stage times are what a profiler of everything a rank does outside its p2p calls sees in that
    iteration: the sleep actually slept per (rank, chunk), plus the rank's mean framework overhead per
    compute call (``forward_step`` / ``backward_step`` duration minus the sleep inside), plus the
    schedule's own bookkeeping between calls, per op. ``p2p_call_ms`` is the mean posting time of the
    schedule's p2p calls in that iteration (entry of ``_communicate`` to ops issued), which the
    ``megatron`` model charges to the calling rank. ``send_ms`` is the one-way ping-pong time of the
    activation through megatron's own ``P2PCommunicator`` minus the posting time of the ping-pong's own
    calls, pooled over every link and every measured iteration of the configuration (all links are
    loopback; on a shared machine single ping-pongs vary several-fold, and a machine-wide stall of
    seconds during one ping-pong is cut off by the trimmed mean). ``allreduce_ms`` is the duration
    of ``finalize_model_grads``.
    """
    pp, v = cfg["pp"], cfg["V"]
    by_stage: dict[int, list[dict]] = {}
    for a in answers:
        by_stage.setdefault(a["pp_rank"], []).append(a)
    if replica is not None:
        by_stage = {r: [a for a in reps if a["dp_rank"] == replica] for r, reps in by_stage.items()}
        answers = [a for a in answers if a["dp_rank"] == replica] + [a for a in answers if a["dp_rank"] != replica]
    one_way = trimmed_mean([t for a in answers for x in a["iters"] for t in x["xfer_ms"]])
    post_pingpong = trimmed_mean([x["post_pingpong_ms"] for a in answers for x in a["iters"]
                                  if x["post_pingpong_ms"] is not None])
    post = statistics.fmean(a["iters"][it]["post_ms"] for reps in by_stage.values() for a in reps)
    stages = []
    for r in range(pp):
        reps = [a["iters"][it] for a in by_stage[r]]
        gap = statistics.fmean(x["gap_ms"] for x in reps)
        over_f = statistics.fmean(x["op_f_ms"] - statistics.fmean(x["inner_f_ms"]) for x in reps) + gap
        over_b = statistics.fmean(x["op_b_ms"] - statistics.fmean(x["inner_b_ms"]) for x in reps) + gap
        fwd = [statistics.fmean(x["inner_f_ms"][c] for x in reps) + over_f for c in range(v)]
        bwd = [statistics.fmean(x["inner_b_ms"][c] for x in reps) + over_b for c in range(v)]
        stages.append({"forward_ms": fwd, "backward_ms": bwd, "send_ms": max(0.0, one_way - post_pingpong),
                       "allreduce_ms": statistics.fmean(a["allreduce_ms"] for a in by_stage[r])})
    return {"schedule": cfg["schedule"], "micro_batches": cfg["M"], "virtual_stages": v,
            "data_parallel": cfg["dp"], "comm_model": "megatron", "p2p_call_ms": post, "stages": stages}


def predicted_ms(cfg: dict, answers: list[dict], it: int, comm_model: str) -> float:
    """Predicted duration of iteration ``it``: with DP replicas, the slowest replica's.

    Replicas run the same plan but not the same noise; the gradient all-reduce at the end waits for the
    slowest, so each replica is simulated with its own profiled times and the longest one is the
    iteration (the simulator itself, planning, treats replicas as identical: paper §4.2.3).
    """
    return max(predict(stage_input(cfg, answers, it, replica), comm_model, overlap=cfg["overlap"])
               for replica in range(cfg["dp"]))


def measured_ms(answers: list[dict], it: int) -> float:
    """Measured duration (ms) of iteration ``it``.

    An iteration runs from the start of the first pipeline stage (the latest over DP replicas) to the
    latest end over all ranks, on the machine-wide monotonic clock. The first stage's start, not the
    earliest rank's: ranks leave the preceding gloo barrier up to a few ms apart, and the other stages
    only wait for the first one's output anyway.
    """
    firsts = [a for a in answers if a["pp_rank"] == 0]
    end = max(a["iters"][it]["t1"] for a in answers)
    return (end - max(a["iters"][it]["t0"] for a in firsts)) * 1000.0


def _flat(doc: dict):
    st = doc["stages"]
    return ([x for s in st for x in s["forward_ms"]], [x for s in st for x in s["backward_ms"]],
            [s["send_ms"] for s in st], [s["allreduce_ms"] for s in st])


def predict(doc: dict, comm_model: str, overlap: bool = False) -> float:
    """Simulated iteration ms for a stage-level document under ``comm_model`` (``overlap``: megatron's
    ``overlap_p2p_comm`` variant of the ``megatron`` model).

    The document's ``send_ms`` excludes the per-call posting cost; ``dag`` has no such term, so it gets
    it back on every transfer (its send time is the full one-way ping-pong time).
    """
    pp, m, v = len(doc["stages"]), doc["micro_batches"], doc["virtual_stages"]
    fwd, bwd, send, ar = _flat(doc)
    call = doc.get("p2p_call_ms", 0.0)
    if comm_model == "dag":
        return Simulator(doc["schedule"], pp, m, v, "dag").iteration_time(fwd, bwd, [s + call for s in send], ar)
    sim = Simulator(doc["schedule"], pp, m, v, "megatron-overlap" if overlap else "megatron")
    sim.set_extra(comm_megatron.P2P_CALL, call)
    return sim.iteration_time(fwd, bwd, send, ar)
