#!/usr/bin/env python
"""Simulator fidelity against the real megatron-core schedules (issue 5).

Runs ``get_forward_backward_func()`` of megatron-core (1F1B; interleaved with and without
``overlap_p2p_comm``) on gloo/CPU ranks whose stage compute is a sleep of known length inside a
``torch.autograd.Function``, then feeds the profiled stage times and the measured point-to-point transfer
time to the simulator and compares. Prints, per configuration: measured iteration (median after
warm-up), predicted by the ``dag`` and ``megatron`` comm models, and their errors; then, per schedule
variant, the median and max |error|.

    python scripts/bench_fidelity.py            # full set (18 configurations, ~3 min on 2 cores)
    python scripts/bench_fidelity.py --quick    # 4 configurations
    python scripts/bench_fidelity.py --json     # one JSON document instead of the table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _fidelity_configs import (  # noqa: E402
    full_configs, measured_ms, predicted_ms, quick_configs, stage_input, variant)
from _fidelity_pool import FidelityPool, FidelityPoolError  # noqa: E402

MODELS = ("dag", "megatron")


def run_config(pool: FidelityPool, cfg: dict, iters: int, warmup: int, timeout_s: float) -> dict:
    """Measure one configuration on the pool and simulate every measured iteration; return a result row.

    Each iteration is simulated with its own profiled stage times and transfer time; the row reports
    the medians of the measured and predicted times and the median of the per-iteration errors.
    """
    job = dict(cfg, iters=iters, warmup=warmup)
    answers = pool.run(job, cfg["pp"] * cfg["dp"], timeout_s)
    measured = [measured_ms(answers, i) for i in range(iters)]
    docs = [stage_input(cfg, answers, i) for i in range(iters)]
    row = {"name": cfg["name"], "variant": variant(cfg), "pp": cfg["pp"], "M": cfg["M"], "V": cfg["V"],
           "dp": cfg["dp"], "spread": cfg["spread"], "measured_ms": statistics.median(measured),
           "iterations_ms": measured,
           "send_ms": statistics.median(statistics.fmean(s["send_ms"] for s in d["stages"]) for d in docs),
           "stage_inputs": docs}
    for model in MODELS:
        preds = [predicted_ms(cfg, answers, i, model) for i in range(iters)]
        row[f"{model}_ms"] = statistics.median(preds)
        row[f"{model}_err_pct"] = statistics.median(100.0 * (p - m) / m for p, m in zip(preds, measured))
    return row


def summary(rows: list[dict]) -> dict:
    """Per schedule variant and model: median and max |error| (%)."""
    out: dict = {}
    for var in sorted({r["variant"] for r in rows}):
        sel = [r for r in rows if r["variant"] == var]
        out[var] = {m: {"median_abs_err_pct": statistics.median(abs(r[f"{m}_err_pct"]) for r in sel),
                        "max_abs_err_pct": max(abs(r[f"{m}_err_pct"]) for r in sel), "n": len(sel)}
                    for m in MODELS}
    return out


def print_table(rows: list[dict], summ: dict) -> None:
    head = f"{'config':24} {'meas ms':>9} {'dag ms':>9} {'err%':>6} {'megatron':>9} {'err%':>6} {'send ms':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['name']:24} {r['measured_ms']:9.1f} {r['dag_ms']:9.1f} {r['dag_err_pct']:+6.1f} "
              f"{r['megatron_ms']:9.1f} {r['megatron_err_pct']:+6.1f} {r['send_ms']:8.3f}")
    print()
    print(f"{'schedule':22} {'n':>3}  {'dag med|err|':>12} {'max':>6}  {'megatron med|err|':>17} {'max':>6}")
    for var, s in summ.items():
        d, m = s["dag"], s["megatron"]
        print(f"{var:22} {d['n']:3d}  {d['median_abs_err_pct']:11.2f}% {d['max_abs_err_pct']:5.2f}%  "
              f"{m['median_abs_err_pct']:16.2f}% {m['max_abs_err_pct']:5.2f}%")
    print("target (not asserted; docs/FIDELITY.md): megatron median |error| <= 2 %, max <= 4 %, per schedule")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit code 2 on a bad flag, 1 when a run fails."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 small configurations")
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    ap.add_argument("--iters", type=int, default=None, help="measured iterations per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up iterations per configuration")
    ap.add_argument("--only", default=None, help="run only configurations whose name contains this")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one configuration may take")
    args = ap.parse_args(argv)
    iters = args.iters if args.iters is not None else (3 if args.quick else 7)
    if iters < 1 or args.warmup < 0:
        print(f"bench_fidelity: --iters {iters} must be >= 1 and --warmup {args.warmup} >= 0", file=sys.stderr)
        return 2
    cfgs = quick_configs() if args.quick else full_configs()
    if args.only:
        cfgs = [c for c in cfgs if args.only in c["name"]]
        if not cfgs:
            print(f"bench_fidelity: --only {args.only!r} matches no configuration", file=sys.stderr)
            return 2
    t_start = time.monotonic()
    rows = []
    with FidelityPool(max(c["pp"] * c["dp"] for c in cfgs)) as pool:
        for cfg in cfgs:
            try:
                rows.append(run_config(pool, cfg, iters, args.warmup, args.timeout))
            except FidelityPoolError as exc:
                print(f"bench_fidelity: {cfg['name']}: {exc}", file=sys.stderr)
                return 1
            r = rows[-1]
            print(f"  ran {r['name']:24} at {time.monotonic() - t_start:6.1f} s", file=sys.stderr)
    summ = summary(rows)
    if args.json:
        json.dump({"rows": rows, "summary": summ, "wall_s": time.monotonic() - t_start}, sys.stdout, indent=1)
        print()
    else:
        print_table(rows, summ)
        print(f"\nwall time {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
