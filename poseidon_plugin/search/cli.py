"""``poseidon plan``: search the fastest plan for a cluster and a model.

    poseidon plan --cluster PRESET|FILE --model PRESET|FILE [--global-batch-size N] [--seq-length N]
                  [--profile FILE] [--schedules 1f1b,interleaved-1f1b] [--search-mode exact|default|exhaustive]
                  [--comm-model megatron|megatron-overlap|dag] [--overlap-p2p-comm auto|on|off]
                  [--flag-style megatron|mindspeed|patch] [--workers N|auto] [--json] [--trace OUT.json]
                  [--output PLAN.json]

Plans for the same target runtime as ``poseidon-run`` (``poseidon_plugin/target.py``: Megatron's comm
model, its schedules, planned p2p overlap, micro-batch sizes 1,2,4, the proven optimum), so both give the
same plan for the same job. Prints the plan as a table (``--json``: the plan document), draws a progress
bar on stderr when the search takes more than a second, and fails with one line naming the constraint
when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from ..errors import InputError, PoseidonError
from ..simulator.graph import COMM_MODELS
from ..target import DEFAULT_MICRO_BATCH_SIZES, FLAG_STYLES, P2P_OVERLAP, SEARCH_MODES, TargetRuntime
from .options import SearchOptions


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give integers separated by commas, "
                                             "e.g. 1,2,4") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag}: give at least one value")
        return values
    return parse


def _workers(text: str) -> int:
    """``--workers``: ``auto`` (the cores this process may run on, at most MAX_AUTO_WORKERS) or N >= 1."""
    from .shared_walk import MAX_AUTO_WORKERS, auto_workers
    if text.strip() == "auto":
        return auto_workers()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes: give N >= 1, or auto (the "
                                         f"cores this process may run on, at most {MAX_AUTO_WORKERS})")
    return n


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` arguments."""
    parser.add_argument("--cluster", required=True, metavar="PRESET|FILE",
                        help="cluster preset (e.g. paper-setting-3) or YAML/JSON file")
    parser.add_argument("--model", required=True, metavar="PRESET|FILE",
                        help="model+job preset (e.g. llama-30b) or YAML/JSON file")
    parser.add_argument("--global-batch-size", type=int, metavar="N",
                        help="samples per iteration (overrides the model file; never changed by the search)")
    parser.add_argument("--seq-length", type=int, metavar="N", help="tokens per sample (overrides the model file)")
    parser.add_argument("--profile", metavar="FILE",
                        help="measured profile (poseidon-profile JSON); default: analytic profile")
    parser.add_argument("--flag-style", choices=FLAG_STYLES, default="megatron",
                        help="the stack that runs the plan, as poseidon-run's --poseidon-flag-style: megatron "
                             "(layout flag; 1f1b and interleaved), mindspeed (--num-layer-list) or patch "
                             "(1f1b only); default megatron")
    parser.add_argument("--schedules", type=_str_list, default=None, metavar="S1,S2",
                        help="pipeline schedules to consider (default: what the flag style runs, "
                             "1f1b,interleaved-1f1b for megatron; gpipe and eager-1f1b for study)")
    parser.add_argument("--virtual-stages", type=_int_list("--virtual-stages"), default=(2,),
                        metavar="V1,V2", help="chunks per rank tried with interleaved-1f1b (default 2)")
    parser.add_argument("--micro-batch-size", type=_int_list("--micro-batch-size"), metavar="B1,B2",
                        help="micro-batch sizes to try (default: "
                             f"{','.join(map(str, DEFAULT_MICRO_BATCH_SIZES))}, as poseidon-run profiles; with "
                             "--profile: what it covers)")
    parser.add_argument("--tp", type=_int_list("--tp"), metavar="T1,T2",
                        help="TP degrees to try (default: every valid power of two)")
    parser.add_argument("--ep", type=_int_list("--ep"), metavar="E1,E2",
                        help="MoE: expert-parallel sizes to try (default: every divisor of the experts that "
                             "megatron-core runs; 1 = experts TP-split, no expert parallelism)")
    parser.add_argument("--max-pp", type=int, metavar="N", help="largest pipeline size to try")
    parser.add_argument("--min-pp", type=int, metavar="N", help="smallest pipeline size to try")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--search-mode", choices=SEARCH_MODES, default="exact",
                      help="exact (default, as poseidon-run): only provably safe pruning, the true optimum "
                           "of the cost model; default: faster, also the paper's ridge rule; exhaustive: "
                           "every plan (small problems only)")
    mode.add_argument("--exact", action="store_true", help="same as --search-mode exact")
    mode.add_argument("--exhaustive", action="store_true", help="same as --search-mode exhaustive")
    parser.add_argument("--comm-model", choices=COMM_MODELS, default="megatron",
                        help="simulator communication model the plans are timed with: megatron (default: "
                             "Megatron's blocking p2p calls, what the plan runs on), megatron-overlap "
                             "(= megatron with --overlap-p2p-comm on), dag (the paper's fixed transfer "
                             "delays); see docs/FIDELITY.md")
    parser.add_argument("--overlap-p2p-comm", choices=P2P_OVERLAP, default="auto",
                        help="Megatron's overlap_p2p_comm for interleaved plans: auto (default) prices both "
                             "and plans the faster, on / off pin it (off: the job passes "
                             "--no-overlap-p2p-communication)")
    parser.add_argument("--gap", type=float, default=0.0, metavar="FRACTION",
                        help="stop once no plan can be faster by more than this fraction (e.g. 0.01: "
                             "within 1 %% of the optimum, proven; --exact too); default 0")
    parser.add_argument("--any-type-order", action="store_true",
                        help="default mode: let device types alternate along the pipeline (slower search; "
                             "--exact always does)")
    parser.add_argument("--top-k", type=int, default=3, metavar="K",
                        help="report the best plan and K-1 alternatives of other shapes (default 3)")
    parser.add_argument("--exact-alternatives", action="store_true",
                        help="prove the alternatives too (each the best of its shape; slower); without it "
                             "only the plan is proven (--exact) and alternatives are met on the way")
    parser.add_argument("--warmup-samples", type=int, default=None, metavar="N",
                        help="random plans simulated first to seed the bound (default: 500 with "
                             "--search-mode default, none with --exact, whose seeds give the first plan)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the warm-up sampler")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="stop after this long and print the best plan so far (marked not proven)")
    parser.add_argument("--workers", type=_workers, default="auto", metavar="N|auto",
                        help="processes a large search tree is walked by (the same plan with any number); "
                             "default auto: the cores this process may run on, at most 8")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--output", metavar="PLAN.json", help="also write the plan JSON to this file")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write the plan's simulated timeline as Chrome trace-event JSON (Perfetto)")
    parser.add_argument("--no-progress", action="store_true", help="never draw the progress bar")


class ProgressBar:
    """A one-line bar on stderr, drawn only when the search has run for more than a second."""

    def __init__(self, enabled: bool, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.drawn = False

    def __call__(self, fraction: float, message: str) -> None:
        if not self.enabled or time.monotonic() - self.t0 < 1.0:
            return
        width = 30
        done = int(round(width * max(0.0, min(1.0, fraction))))
        elapsed = time.monotonic() - self.t0
        self.stream.write(f"\rsearching [{'#' * done}{'.' * (width - done)}] {100 * fraction:5.1f}%  "
                          f"{message}  {elapsed:.0f}s ")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def options_from_args(args) -> SearchOptions:
    """The :class:`SearchOptions` of the parsed command line, for what the target runtime does not decide
    (:func:`poseidon_plugin.target.search_plan` sets mode, schedules, virtual stages and comm model)."""
    return SearchOptions(
        micro_batch_sizes=args.micro_batch_size if args.profile else None, tp_degrees=args.tp,
        expert_parallel=args.ep, max_pipeline_stages=args.max_pp, min_pipeline_stages=args.min_pp,
        top_k=args.top_k, warmup_samples=args.warmup_samples, seed=args.seed,
        time_limit_s=args.time_limit, gap=args.gap, type_blocks=not args.any_type_order,
        exact_alternatives=args.exact_alternatives, workers=args.workers)


def build_cost_model(args, target: TargetRuntime | None = None):
    """Load cluster, model (with the job overrides) and profile, and build the cost model (an analytic
    profile covers the target's micro-batch sizes)."""
    from ..costmodel import CostModel
    from ..specs import load_cluster, load_model, load_profile
    cluster = load_cluster(args.cluster)
    model = load_model(args.model).with_overrides(global_batch_size=args.global_batch_size,
                                                  seq_length=args.seq_length)
    profile = load_profile(args.profile) if args.profile else None
    kwargs = {}
    if profile is None:
        kwargs["micro_batch_sizes"] = (target or TargetRuntime.from_cli(args)).micro_batch_sizes
    return CostModel(cluster, model, profile, **kwargs)


def write_trace(cm, plan, path: str, comm_model: str | None = None) -> None:
    """Simulate the plan again (under the comm model it was priced with) and write its timeline as Chrome
    trace events."""
    if comm_model is None:
        comm_model = plan.search_stats.get("comm_model", "dag")
    from ..costmodel import Candidate
    from ..simulator import Simulator
    from ..simulator.trace import trace_events, write_json_atomic
    cand = Candidate(tp=plan.tp, pp=plan.pp, dp=plan.dp, mbs=plan.micro_batch_size,
                     stage_types=plan.stage_types, layers=plan.layers, schedule=plan.schedule,
                     virtual_stages=plan.virtual_stages, ep=plan.ep, etp=plan.etp)
    sim = Simulator(plan.schedule, plan.pp, plan.micro_batches, plan.virtual_stages, comm_model)
    try:
        write_json_atomic(path, trace_events(sim, *cm.stage_times(cand)))
    except OSError as exc:
        raise PoseidonError(f"--trace {path}: cannot write: {exc.strerror}") from None


def run(args) -> int:
    """Search and print the plan."""
    # --time-limit counts the loading too (100k+ device clusters), and for the console script the
    # interpreter's start-up (cli.main)
    start = getattr(args, "started", None) or time.monotonic()
    from ..plan import proof_line, render_table
    from ..target import search_plan
    for flag, value in (("--global-batch-size", args.global_batch_size), ("--seq-length", args.seq_length),
                        ("--max-pp", args.max_pp)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value} is invalid: must be an integer >= 1")
    target = TargetRuntime.from_cli(args)
    options = options_from_args(args)
    cm = build_cost_model(args, target)
    bar = ProgressBar(enabled=not args.no_progress)
    # no bar, no progress calls: each one computes the gap's lower bound (frontier-1024: 8 % of the search)
    options = dataclasses.replace(options, progress=bar if bar.enabled else None)
    if options.time_limit_s is not None:
        # what is left of it (a sliver when loading took it all: the search still returns a plan)
        left = options.time_limit_s - (time.monotonic() - start)
        options = dataclasses.replace(options, time_limit_s=max(1e-3, left))
    try:
        result = search_plan(cm, target, options)
    finally:
        bar.close()
    plan = result.plan
    if args.output:
        try:
            plan.save(args.output)
        except OSError as exc:
            raise PoseidonError(f"--output {args.output}: cannot write: {exc.strerror}") from None
    if args.trace:
        write_trace(cm, plan, args.trace)
    if args.json:
        print(plan.to_json())
        return 0
    print(render_table(plan, max_alternatives=max(0, args.top_k - 1), runtime=target.describe(plan)))
    if not plan.search_stats.get("complete", True):
        # the plan's stats, not the winning variant's: the proof covers every variant searched
        print(f"note: {proof_line(plan.search_stats, plan.predicted_iteration_ms)}", file=sys.stderr)
    if args.trace:
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
