"""Where an exact search spends its work: nodes and CPU seconds per search variant, micro-batch size,
shape group and structure, for one instance of ``poseidon plan --exact`` (the target runtime's defaults).

    python scripts/bench_search_anatomy.py --cluster paper-setting-6-96 --model llama3-70b \\
        --global-batch-size 256 --seq-length 2048 [--top 15] [--time-limit S]

Every structure search (``SplitSearch.run``) of every variant is recorded: its shape group
``(tp, pp, dp, mbs, schedule, V)``, its ranks per device type, nodes, CPU seconds, the threshold it ran
with, the plan it found. Then the tables: per variant (p2p overlap on / off), per micro-batch size,
the costliest shape groups and structures, and the phases outside the trees (warm-up, seeds, bounds).
With ``--time-limit`` the search stops there (the tables then cover what it did).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from poseidon_plugin.costmodel import CostModel  # noqa: E402
from poseidon_plugin.search import SearchOptions  # noqa: E402
from poseidon_plugin.search import engine  # noqa: E402
from poseidon_plugin.search.counters import NODES  # noqa: E402
from poseidon_plugin.specs import load_cluster, load_model  # noqa: E402
from poseidon_plugin.target import TargetRuntime, search_plan  # noqa: E402


class Recorder:
    """Wraps ``SearchRun.splitter`` and the phases of :class:`~poseidon_plugin.search.engine.SearchRun`."""

    def __init__(self):
        self.runs: list[dict] = []          # one per structure search
        self.phases: collections.Counter = collections.Counter()    # (variant, phase) -> CPU s
        self.variant = "?"

    def install(self) -> None:
        rec = self
        make = engine.SearchRun.splitter

        def splitter(run, sg, **kwargs):
            inner = make(run, sg, **kwargs)
            return _Proxy(inner, rec, run, sg)
        engine.SearchRun.splitter = splitter
        for name in ("warmup", "seed", "polish", "search", "bound"):
            self._time(name)

    def _time(self, name: str) -> None:
        rec, original = self, getattr(engine.SearchRun, name)

        def timed(run, *args, **kwargs):
            t0 = time.process_time()
            try:
                return original(run, *args, **kwargs)
            finally:
                rec.phases[(run.options.comm_model, name)] += time.process_time() - t0
        setattr(engine.SearchRun, name, timed)


class _Proxy:
    def __init__(self, inner, rec: Recorder, run, sg):
        self.inner, self.rec, self.run_, self.sg = inner, rec, run, sg

    def run(self, counts, tau, **kwargs):
        t0 = time.process_time()
        res = self.inner.run(counts, tau, **kwargs)
        self.rec.runs.append({"variant": self.run_.options.comm_model, "key": self.sg.key,
                              "mbs": self.sg.group.mbs, "counts": tuple(counts), "types": self.sg.group.names,
                              "root": bool(kwargs.get("root_only")), "nodes": res.counters[NODES],
                              "cpu": time.process_time() - t0, "tau": tau, "found": res.time_ms})
        return res

    def __getattr__(self, name):
        return getattr(self.inner, name)


def table(title: str, rows: list[tuple], header: tuple[str, ...]) -> None:
    print()
    print(title)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--global-batch-size", type=int)
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--time-limit", type=float)
    ap.add_argument("--top", type=int, default=12, help="rows of the costliest groups and structures")
    args = ap.parse_args(argv)
    target = TargetRuntime()
    model = load_model(args.model).with_overrides(global_batch_size=args.global_batch_size,
                                                  seq_length=args.seq_length)
    cm = CostModel(load_cluster(args.cluster), model, micro_batch_sizes=target.micro_batch_sizes)
    rec = Recorder()
    rec.install()
    t0, c0 = time.perf_counter(), time.process_time()
    res = search_plan(cm, target, SearchOptions(time_limit_s=args.time_limit))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    plan, st = res.plan, res.plan.search_stats
    print(f"{args.cluster} {args.model} GBS {model.global_batch_size} seq {model.seq_length}: "
          f"{wall:.2f} s wall, {cpu:.2f} CPU s, {sum(r['nodes'] for r in rec.runs):,} nodes, "
          f"complete={st.get('complete')}, gap={st.get('gap')}")
    print(f"plan: {plan.predicted_iteration_ms:,.1f} ms TP{plan.tp} PP{plan.pp} DP{plan.dp} mbs{plan.micro_batch_size} "
          f"{plan.schedule} V{plan.virtual_stages} overlap={plan.overlap_p2p_comm} types {'/'.join(plan.stage_types)}")
    runs = [r for r in rec.runs if not r["root"]]
    roots = [r for r in rec.runs if r["root"]]

    def agg(key):
        out = collections.defaultdict(lambda: [0, 0, 0.0])
        for r in runs:
            a = out[key(r)]
            a[0] += 1
            a[1] += r["nodes"]
            a[2] += r["cpu"]
        return out

    by_variant = agg(lambda r: r["variant"])
    rows = []
    for v in sorted({r["variant"] for r in rec.runs} | {v for v, _p in rec.phases}):
        n, nodes, tree = by_variant.get(v, [0, 0, 0.0])
        rootn = sum(r["nodes"] for r in roots if r["variant"] == v)
        ph = {p: rec.phases[(v, p)] for p in ("search", "warmup", "seed", "polish", "bound")}
        rows.append((v, n, f"{nodes:,}", f"{rootn:,}", f"{tree:.2f}", f"{ph['warmup']:.2f}", f"{ph['seed']:.2f}",
                     f"{ph['polish']:.2f}", f"{ph['bound']:.2f}", f"{ph['search']:.2f}"))
    table("per search variant (megatron-overlap: interleaved with p2p overlap and 1F1B; megatron: interleaved "
          "without overlap, PP >= 3); CPU s", rows,
          ("variant", "structures", "tree nodes", "root nodes", "tree s", "warm-up s", "seeds s", "polish s",
           "bounds s", "whole s"))
    by_mbs = agg(lambda r: (r["variant"], r["mbs"]))
    table("per variant and micro-batch size", [(v, m, n, f"{nodes:,}", f"{c:.2f}")
                                                for (v, m), (n, nodes, c) in sorted(by_mbs.items())],
          ("variant", "mbs", "structures", "nodes", "tree s"))
    by_group = agg(lambda r: (r["variant"], r["key"]))
    top = sorted(by_group.items(), key=lambda kv: -kv[1][1])[:args.top]
    table(f"costliest shape groups (of {len(by_group)} searched), by nodes",
          [(v, f"TP{k[0]} PP{k[1]} DP{k[2]} mbs{k[3]} {k[4]} V{k[5]}", n, f"{nodes:,}", f"{c:.2f}")
           for (v, k), (n, nodes, c) in top], ("variant", "shape group", "structures", "nodes", "tree s"))
    top_s = sorted(runs, key=lambda r: -r["nodes"])[:args.top]
    table("costliest structures, by nodes (counts: ranks per device type)",
          [(r["variant"], f"TP{r['key'][0]} PP{r['key'][1]} DP{r['key'][2]} mbs{r['key'][3]} {r['key'][4]} "
            f"V{r['key'][5]}", " ".join(f"{t}x{c}" for t, c in zip(r["types"], r["counts"]) if c),
            f"{r['nodes']:,}", f"{r['cpu']:.2f}", f"{r['tau']:,.1f}",
            "-" if r["found"] == float("inf") else f"{r['found']:,.1f}") for r in top_s],
          ("variant", "shape group", "structure", "nodes", "s", "threshold ms", "found ms"))
    total = sum(r["nodes"] for r in runs) or 1
    share = sum(r["nodes"] for r in top_s) / total
    print(f"\nthe {len(top_s)} costliest structures hold {100 * share:.0f} % of the {total:,} tree nodes "
          f"({len(runs)} structures searched)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
