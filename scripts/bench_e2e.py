"""End-to-end: Poseidon's plan against other plans, trained for real on deterministic emulated clusters.

    python scripts/bench_e2e.py            # every cluster of _e2e_runs.CLUSTERS (about half an hour on 2 cores)
    python scripts/bench_e2e.py --quick    # one 4-rank cluster, 4 plans (under 5 minutes)
    python scripts/bench_e2e.py --only "wan,mem" --json
    python scripts/bench_e2e.py --client megatron-lm   # Megatron-LM's own pretrain_gpt.py, same clusters and plans
    python scripts/bench_e2e.py --quick --recompute    # every job with full activation recomputation

For each emulated cluster (``--poseidon-emulate`` + ``--poseidon-emulate-model``: layers, embedding, head,
links and DP sync take the analytic times of a real model on the emulated devices, scaled; see
``emulation/harness.py``), ``poseidon-run`` trains ``scripts/pretrain_gpt.py``:

(a) with the plan Poseidon searches (profiling, search, apply: the whole flow; the plan is saved);
(b) with the best *uniform* split: even layers, devices in launch order, TP/PP/DP/mbs/schedule chosen by the
    same cost model (``search.baselines.best_uniform``);
(c) with the plan's runners-up (the search's alternatives, default placement);
(d) with random feasible 1F1B plans (seeded);

(b)-(d) are written as plan files, timed by the same cost model on the profile run (a) measured, and applied
with ``--poseidon-plan``. Runs are sequential. Per plan: predicted ms, measured ms (median of the schedule
call over the ``MEASURED_ITERS`` or more iterations after ``WARMUP_ITERS`` warm-up ones, from ``poseidon-run``'s
watch), error, the spread of the measured iterations, and two terms the prediction leaves out: the optimizer
step (script iteration minus schedule call) and the excess per micro-batch step ((measured - predicted) /
(M + pp - 1), the framework's per-micro-batch cost the profile does not see). Per cluster: Spearman's rank
correlation of predicted vs measured, and Poseidon's measured speed-up over (b) next to the predicted one.
Targets are printed beside the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _e2e_runs import (CLUSTERS, MEASURED_ITERS, MIN_ITERS, QUICK, WARMUP_ITERS, ClusterCase,  # noqa: E402
                       candidate_of, cost_model, emulation_state, launch, pin_host_factor, plan_key, random_plans,
                       scaled, uniform_plan, use_client)
from poseidon_plugin.plan import Plan  # noqa: E402
from poseidon_plugin.target import plan_as_run  # noqa: E402

TARGET_MEDIAN_ERR = 0.05
TARGET_MAX_ERR = 0.10
TARGET_FASTEST_WITHIN = 0.02
TARGET_SPEARMAN = 0.8
TARGET_SPEEDUP = 1.15
SPEEDUP_WHEN_RATIO = 1.3
RECOMPUTE_FLAGS = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan below 3 points."""
    if len(xs) < 3:
        return float("nan")

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def describe(plan: Plan) -> str:
    types = "/".join(plan.stage_types)
    experts = "" if (plan.ep, plan.etp) == (1, None) else f"EP{plan.ep} " + ("" if plan.etp is None else f"ETP{plan.etp} ")
    return (f"TP{plan.tp} PP{plan.pp} DP{plan.dp} {experts}mbs{plan.micro_batch_size} "
            f"{'int' if plan.virtual_stages > 1 else '1f1b'} {types} {'/'.join(map(str, plan.layers))}")


FIRST_RUN_LIMIT_S = 1800.0
"""Bound of the run that searches (its plan's time is not known before): against a hang, not a measure."""


def run_limit_s(plan: Plan, iters: int) -> float:
    """Bound of one run of a known plan: start-up (5 min) plus 3x its predicted iterations, at least 10
    min. A random plan at 3x SCALE can take 90 s an iteration: a fixed 10 min killed such runs."""
    return max(600.0, 300.0 + 3.0 * iters * plan.predicted_iteration_ms / 1e3)


def run_case(case: ClusterCase, *, quick: bool, iters: int, workdir: str, log) -> dict:
    """All plans of one cluster; the case's JSON record."""
    cache = os.path.join(workdir, "profiles")
    saved = os.path.join(workdir, "poseidon-plan.json")
    log(f"[{case.name}] (a) poseidon-run searches ({case.ranks} ranks, {case.emulate}, {case.model})")
    first = launch(case, iters=iters, cache_dir=cache, plan_file=None, save_plan=saved,
                   timeout_s=FIRST_RUN_LIMIT_S)
    if first.code != 0 or not os.path.exists(saved):
        return {"cluster": case.name, "error": f"poseidon-run exited {first.code}", "tail": first.tail}
    plan_a = Plan.load(saved)
    # the launcher names the job's profile <job>-<digest>-profile.json (one per devices / software)
    (profile,) = glob.glob(os.path.join(glob.escape(cache), f"{plan_a.model}-*-profile.json"))
    cm = cost_model(case, profile)
    plans: list[tuple[str, Plan]] = [("(a) poseidon", plan_a)]
    seen = {plan_key(plan_a)}
    uniform = uniform_plan(cm)
    uniform_note = ("no uniform split fits the devices' memory" if uniform is None
                    else "the uniform split is Poseidon's plan" if plan_key(uniform) in seen else "")
    if uniform is not None and plan_key(uniform) not in seen:
        plans.append(("(b) uniform", uniform))
        seen.add(plan_key(uniform))
    for i, alt in enumerate(plan_a.alternatives[: 1 if quick else 2]):
        plan = plan_as_run(cm, candidate_of(alt))
        if plan_key(plan) not in seen:
            plans.append((f"(c) runner-up {i + 1}", plan))
            seen.add(plan_key(plan))
    for i, plan in enumerate(random_plans(cm, 1 if quick else 2, seed=zlib.crc32(case.name.encode()), avoid=seen)):
        plans.append((f"(d) random {i + 1}", plan))
    rows = []
    for label, plan in plans:
        if plan is plan_a:
            result = first
        else:
            path = os.path.join(workdir, f"plan-{len(rows)}.json")
            plan.save(path)
            log(f"[{case.name}] {label}: {describe(plan)}")
            result = launch(case, iters=iters, cache_dir=cache, plan_file=path, save_plan=None,
                            timeout_s=run_limit_s(plan, iters))
        predicted = plan.predicted_iteration_ms
        measured = result.measured_ms
        steps = plan.micro_batches + plan.pp - 1
        row = {
            "label": label, "plan": describe(plan), "predicted_ms": predicted, "measured_ms": measured,
            "error": (predicted - measured) / measured if measured == measured else float("nan"),
            "spread": result.spread, "optimizer_ms": result.optimizer_ms,
            "excess_per_step_ms": (measured - predicted) / steps, "layers_as_planned": result.layers_as_planned,
            "iterations_ms": result.schedule_ms, "code": result.code, "wall_s": round(result.wall_s, 1),
            "load": round(result.load, 1),
        }
        if result.code != 0:
            row["tail"] = result.tail
        rows.append(row)
        log(f"[{case.name}] {label}: predicted {predicted:.0f} ms, measured {measured:.0f} ms "
            f"({row['error']:+.1%}), spread {result.spread:.1%}, {result.wall_s:.0f} s, load {result.load:.1f}")
    ok = [r for r in rows if r["measured_ms"] == r["measured_ms"]]
    excess = profile_excess(case, profile)
    record = {"cluster": case.name, "why": case.why, "emulate": case.emulate, "model": case.model,
              "ranks": case.ranks, "layers": case.layers, "global_batch": case.global_batch,
              "type_speed_ratio": case.type_speed_ratio(), "rows": rows, "profile_excess": excess,
              "uniform_note": uniform_note,
              "spearman": spearman([r["predicted_ms"] for r in ok], [r["measured_ms"] for r in ok])}
    a = rows[0]
    b = next((r for r in rows if r["label"].startswith("(b)")), None)
    record["speedup_vs_uniform"] = b["measured_ms"] / a["measured_ms"] if b else float("nan")
    # what the model promises for the same two plans: the most the measured speed-up can honestly reach
    record["speedup_predicted"] = b["predicted_ms"] / a["predicted_ms"] if b else float("nan")
    fastest = min(r["measured_ms"] for r in ok) if ok else float("nan")
    record["poseidon_vs_fastest"] = a["measured_ms"] / fastest - 1.0 if ok else float("nan")
    return record


def profile_excess(case: ClusterCase, profile_path: str) -> dict:
    """How much the measured profile exceeds the emulation's deadlines (hooks, autograd, Python): per layer
    forward and backward, median over the profiled (type, TP, mbs), in ms and relative."""
    from poseidon_plugin.specs import load_profile

    state = emulation_state(case)
    fwd, bwd = [], []
    for e in load_profile(profile_path).entries:
        target = state.emulated_entry(e.device_type, e.tp, e.mbs)
        fwd.append((e.forward_ms - target["forward_ms"], e.forward_ms / target["forward_ms"] - 1.0))
        bwd.append((e.backward_ms - target["backward_ms"], e.backward_ms / target["backward_ms"] - 1.0))
    med = statistics.median
    return {"scale": state.scale, "forward_ms": med(x for x, _ in fwd), "forward_rel": med(r for _, r in fwd),
            "backward_ms": med(x for x, _ in bwd), "backward_rel": med(r for _, r in bwd)}


def render(records: list[dict], wall_s: float) -> str:
    out = []
    head = (f"{'plan':<18}{'layout':<44}{'pred ms':>9}{'meas ms':>9}{'err%':>7}{'spread%':>8}"
            f"{'opt ms':>8}{'xs/step':>8}{'load':>6}")
    errors = []
    for rec in records:
        out.append(f"== {rec['cluster']}: {rec.get('why', '')}  [{rec.get('emulate', '')} | {rec.get('model', '')}]")
        if "error" in rec:
            out.append(f"   ERROR {rec['error']}\n{rec.get('tail', '')}")
            continue
        out.append(head)
        out.append("-" * len(head))
        for r in rec["rows"]:
            errors.append(abs(r["error"]))
            flag = ("" if r["layers_as_planned"]
                    else "  (killed at the run's time limit)" if r.get("code") == 124 else "  (NOT as planned)")
            out.append(f"{r['label']:<18}{r['plan'][:43]:<44}{r['predicted_ms']:>9.0f}{r['measured_ms']:>9.0f}"
                       f"{100 * r['error']:>+7.1f}{100 * r['spread']:>8.1f}{r['optimizer_ms']:>8.0f}"
                       f"{r['excess_per_step_ms']:>8.1f}{r.get('load', float('nan')):>6.1f}{flag}")
        px = rec.get("profile_excess")
        if px:
            out.append(f"scale {px['scale']:.3g}; profiled layer over its deadline (median): forward "
                       f"+{px['forward_ms']:.2f} ms ({100 * px['forward_rel']:+.1f}%), backward +{px['backward_ms']:.2f} ms "
                       f"({100 * px['backward_rel']:+.1f}%)")
        ratio = rec["type_speed_ratio"]
        if not any(r["label"].startswith("(b)") for r in rec["rows"]):
            note = rec.get("uniform_note") or "no uniform split fits the devices' memory"
            out.append(f"(b) uniform: {note}")
        need = f"target >= {TARGET_SPEEDUP}x" if ratio >= SPEEDUP_WHEN_RATIO else "no target (types < 1.3x apart)"
        if rec["speedup_vs_uniform"] == rec["speedup_vs_uniform"]:
            speedup = (f"speed-up over uniform {rec['speedup_vs_uniform']:.2f}x, predicted "
                       f"{rec.get('speedup_predicted', float('nan')):.2f}x")
        else:   # no (b) row: the line above says why
            speedup = "speed-up over uniform: none measured (no (b) row)"
        out.append(f"Spearman {rec['spearman']:.2f} (target >= {TARGET_SPEARMAN}); Poseidon vs fastest measured "
                   f"{100 * rec['poseidon_vs_fastest']:+.1f}% (target <= +{100 * TARGET_FASTEST_WITHIN:.0f}%); "
                   f"{speedup} ({need}; types {ratio:.2f}x apart)")
        out.append("")
    if errors:
        out.append(f"all plans: |error| median {100 * statistics.median(errors):.1f}% "
                   f"(target <= {100 * TARGET_MEDIAN_ERR:.0f}%), max {100 * max(errors):.1f}% "
                   f"(target <= {100 * TARGET_MAX_ERR:.0f}%) over {len(errors)} plans")
    out.append(f"wall time {wall_s:.0f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 4-rank cluster, 4 plans")
    parser.add_argument("--only", default="", help="comma list of substrings of cluster names")
    parser.add_argument("--iters", type=int, default=MIN_ITERS,
                        help=f"training iterations per run (>= {MIN_ITERS}: {WARMUP_ITERS} warm-up, then at least "
                             f"{MEASURED_ITERS} timed; the watch cannot time a run's last one)")
    parser.add_argument("--client", choices=("poseidon", "megatron-lm"), default="poseidon",
                        help="the training script: scripts/pretrain_gpt.py, or Megatron-LM's own pretrain_gpt.py "
                             "(checkout in POSEIDON_MEGATRON_LM, default ../shared/megatron-lm/core_v0.16.1)")
    parser.add_argument("--scale-factor", type=float, default=1.0,
                        help="run each cluster at this many times its automatic emulation SCALE (given explicitly): "
                             "for a host whose CPU cannot keep the automatic deadlines (see docs/FIDELITY.md)")
    parser.add_argument("--recompute", action="store_true",
                        help="every job with full activation recomputation (" + " ".join(RECOMPUTE_FLAGS) + ")")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--render", metavar="JSON", help="print the table of a saved --json output and exit")
    args = parser.parse_args(argv)
    if args.iters < MIN_ITERS:
        parser.error(f"--iters {args.iters}: at least {MIN_ITERS} are needed ({WARMUP_ITERS} warm-up iterations, "
                     f"{MEASURED_ITERS} timed ones, and the last one, which the watch does not time)")
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            doc = json.load(f)
        print(render(doc["clusters"], doc["wall_s"]))
        return 0
    script = use_client(args.client)
    cases = [c for c in CLUSTERS if not args.quick or c.name in QUICK]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        cases = [c for c in cases if any(w in c.name for w in wanted)]
    if args.recompute:   # the job's flags: poseidon-run and this process's cost model both price it
        cases = [dataclasses.replace(c, extra=(*c.extra, *RECOMPUTE_FLAGS)) for c in cases]
    host = pin_host_factor()  # before any SCALE: every launch and this process's emulation_state use one factor
    if args.scale_factor != 1.0:
        if not 0.0 < args.scale_factor < math.inf:
            parser.error(f"--scale-factor {args.scale_factor}: give a positive number")
        cases = [scaled(c, args.scale_factor) for c in cases]
    log = (lambda line: print(line, file=sys.stderr, flush=True))
    log(f"client: {script}; host factor {host:g} (emulation.harness.host_factor)"
        + (f"; every job with {' '.join(RECOMPUTE_FLAGS)}" if args.recompute else ""))
    start = time.perf_counter()
    records = []
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="poseidon-e2e-") as workdir:
            records.append(run_case(case, quick=args.quick, iters=args.iters, workdir=workdir, log=log))
    wall = time.perf_counter() - start
    if args.json:
        print(json.dumps({"clusters": records, "wall_s": wall}, indent=1, default=str))
    else:
        print(render(records, wall))
    return 0


if __name__ == "__main__":
    sys.exit(main())
