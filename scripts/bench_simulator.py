#!/usr/bin/env python3
"""Benchmark the DAG simulator: µs per evaluation, compiled vs pure Python, with and without graph re-use.

"with re-use": the graph for the shape exists; an evaluation writes the stage times into the parameter
vector and runs the longest-path pass (``Simulator.iteration_time``). "kernel only": the pass alone on
weights already in place (what the compiled search loop calls). "no re-use": every evaluation builds the
graph and the kernel from scratch, then evaluates. Each figure is the median over repeated timing rounds.

Usage: python scripts/bench_simulator.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from array import array  # noqa: E402

from poseidon_plugin.simulator import Simulator, kernel_name  # noqa: E402
from poseidon_plugin.simulator.core import make_kernel  # noqa: E402
from poseidon_plugin.simulator.graph import build_graph  # noqa: E402

CONFIGS = [("1f1b", 8, 32, 1, "dag"), ("1f1b", 16, 64, 1, "dag"), ("1f1b", 32, 128, 1, "dag"),
           ("interleaved-1f1b", 8, 32, 2, "dag"), ("interleaved-1f1b", 16, 64, 2, "dag"),
           ("1f1b", 8, 32, 1, "megatron"), ("interleaved-1f1b", 8, 32, 2, "megatron")]


def per_call_us(fn, rounds: int, budget_s: float) -> float:
    """Median µs per call over ``rounds`` rounds, each sized to take about budget_s / rounds."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    n = max(1, int(budget_s / rounds / once))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def times_for(pp: int, v: int):
    fwd = [1.0 + 0.37 * (i % 5) for i in range(pp * v)]
    bwd = [2.0 * x for x in fwd]
    return fwd, bwd, [0.05] * pp, [3.0] * pp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.6, help="seconds per measured cell")
    args = ap.parse_args(argv)
    if kernel_name() != "compiled":
        print("the compiled core is not built (or POSEIDON_PURE_PYTHON is set): "
              "run `pip install -e .` first", file=sys.stderr)
        return 1
    header = (f"{'config':<44} {'nodes':>6} {'compiled µs':>11} {'µs/1k nodes':>11} {'kernel µs':>9} "
              f"{'no-reuse µs':>11} {'pure µs':>9} {'pure no-reuse':>13} {'speed-up':>8}")
    print(header)
    print("-" * len(header))
    for schedule, pp, m, v, comm in CONFIGS:
        t = times_for(pp, v)
        comp = Simulator(schedule, pp, m, v, comm, pure_python=False)
        pure = Simulator(schedule, pp, m, v, comm, pure_python=True)
        assert comp.iteration_time(*t) == pure.iteration_time(*t)
        n = comp.graph.n_nodes
        c_reuse = per_call_us(lambda: comp.iteration_time(*t), args.rounds, args.budget)
        c_kernel = per_call_us(comp.evaluate_params, args.rounds, args.budget)
        p_reuse = per_call_us(lambda: pure.iteration_time(*t), 3, args.budget)

        def fresh(pure_python):
            g = build_graph(schedule, pp, m, v, comm)
            k = make_kernel(g, pure_python)
            return k.evaluate(array("d", [0.0]) * g.shape.layout.size, *t)

        c_fresh = per_call_us(lambda: fresh(False), 3, args.budget)
        p_fresh = per_call_us(lambda: fresh(True), 3, args.budget)
        name = f"{schedule} pp={pp} M={m}" + (f" V={v}" if v > 1 else "") + (f" [{comm}]" if comm != "dag" else "")
        print(f"{name:<44} {n:>6} {c_reuse:>11.2f} {c_reuse / n * 1000:>11.2f} {c_kernel:>9.2f} "
              f"{c_fresh:>11.0f} {p_reuse:>9.0f} {p_fresh:>13.0f} {p_reuse / c_reuse:>7.0f}x")
    print("\ncompiled µs = Simulator.iteration_time (write times + longest path, graph re-used); "
          "kernel µs = longest path on weights in place;\nno-reuse = build graph + kernel each time; "
          "speed-up = pure / compiled, both with re-use.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
