"""The target runtime: what will run the plan, and so what the search must plan for.

One definition shared by ``poseidon plan`` (:meth:`TargetRuntime.from_cli`) and ``poseidon-run``
(:meth:`TargetRuntime.for_job`), so that the same job gets the same plan offline and at launch, and
printed with the plan (:meth:`TargetRuntime.describe`). :func:`search_plan` is the one way both search.

Megatron-LM runs its interleaved schedule with ``overlap_p2p_comm`` unless the job passes
``--no-overlap-p2p-communication``, and refuses interleaved without overlap on fewer than three pipeline
ranks. Overlap changes the schedule's communication (and its time, docs/FIDELITY.md), so it is a planned
choice: with the ``megatron`` comm model interleaved candidates are priced both ways (one search per
variant, ``megatron-overlap`` and ``megatron``) and the faster plan is kept; the plan records the choice
(``Plan.overlap_p2p_comm``) and its Megatron flags carry it. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .errors import InputError, NoFeasiblePlanError
from .simulator.schedules import SCHEDULES

if TYPE_CHECKING:  # pragma: no cover
    from .costmodel import CostModel
    from .search.options import SearchOptions, SearchResult

INTERLEAVED = "interleaved-1f1b"
FLAG_STYLES = ("megatron", "mindspeed-layout", "mindspeed", "patch")
LAYOUT_STYLES = ("megatron", "mindspeed-layout")
"""Styles that hand Megatron ``--pipeline-model-parallel-layout`` (any uneven and virtual split)."""
COMM_MODELS = ("megatron", "dag")
P2P_OVERLAP = ("auto", "on", "off")
SEARCH_MODES = ("exact", "default", "exhaustive")
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4)
# Megatron-LM's validate_args: interleaved without overlap_p2p_comm needs pp > 2.
MIN_PP_INTERLEAVED_WITHOUT_OVERLAP = 3
NO_OVERLAP_FLAG = "--no-overlap-p2p-communication"
MIN_VARIANT_S = 1e-3
"""Time limit of a search variant that starts past the shared deadline (it returns its seed plan)."""
NARROW_SHARE = 0.1
"""Under a time limit, the share of what is left that a narrow variant gets when it runs before any plan
could cut it (:func:`search_plan`)."""
AGAIN_MIN_S = 0.5
"""A narrow variant the clock stopped searches again below the broad one's plan if this much is left."""
_STYLE_NAMES = {"megatron": "Megatron-LM / megatron-core (layout flag)",
                "mindspeed-layout": "MindSpeed-LLM (layout flag backport)",
                "mindspeed": "MindSpeed-LLM (--num-layer-list)",
                "patch": "megatron-core without layout flag (layer patches)"}


def style_schedules(flag_style: str) -> tuple[str, ...]:
    """Schedules the runtime executes in this flag style (a virtual split needs the layout flag).

    No style needs a smallest pipeline size of its own: ``mindspeed`` plans with PP = 1 simply carry no
    ``--num-layer-list`` (MindSpeed-LLM refuses the list without pipeline parallelism, and one stage has
    no split to express), so the search keeps its pure data-parallel plans (``runtime/mindspeed.py``).
    """
    return ("1f1b", INTERLEAVED) if flag_style in LAYOUT_STYLES else ("1f1b",)


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetRuntime:
    """What runs the plan: stack, comm model, schedules, p2p overlap, micro-batch candidates, search mode."""

    flag_style: str = "megatron"
    """How the plan reaches the training script, i.e. which stack runs it: ``megatron`` (Megatron-LM /
    megatron-core >= 0.13, ``--pipeline-model-parallel-layout``: any uneven and virtual split),
    ``mindspeed-layout`` (MindSpeed-LLM on a MindSpeed with the layout backport: the same flag),
    ``mindspeed`` (MindSpeed-LLM, ``--num-layer-list``: one chunk per rank) or ``patch`` (older
    megatron-core: layer patches). The last two run 1F1B only."""

    comm_model: str = "megatron"
    """Simulator communication model the plans are timed with: ``megatron`` (Megatron's blocking p2p
    calls; with overlap, ``megatron-overlap``: docs/FIDELITY.md) or ``dag`` (the paper's fixed transfer
    delays, which misranks interleaved plans on Megatron)."""

    schedules: tuple[str, ...] = ()
    """Pipeline schedules the search may choose; empty: every schedule the flag style runs."""

    virtual_stages: tuple[int, ...] = (2,)
    """Model chunks per rank tried with ``interleaved-1f1b``."""

    p2p_overlap: str = "auto"
    """``overlap_p2p_comm`` of interleaved plans: ``auto`` plans it (both priced, the faster kept),
    ``on`` / ``off`` pin it (``off``: the job passes ``--no-overlap-p2p-communication``)."""

    micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES
    """Candidate micro-batch sizes, profiled (analytic or measured) and searched where they divide the
    global batch."""

    search_mode: str = "exact"
    """``exact``: the proven optimum of the cost model; ``default``: the faster search that also uses the
    paper's ridge rule (docs/SEARCH.md); ``exhaustive``: every plan (small problems, for checking)."""

    dp_multiple: int = 1
    """The plan's DP must be a multiple of this: the job's context-parallel size, so that every plan is a
    whole number of Megatron's CP groups. The cost model prices the CP ranks of a replica as data-parallel
    ranks (an approximation: docs/MINDSPEED.md). Expert parallelism is searched (``Plan.ep``)."""

    def __post_init__(self) -> None:
        if self.flag_style not in FLAG_STYLES:
            raise InputError(f"flag style {self.flag_style!r} is invalid: choose one of {', '.join(FLAG_STYLES)}")
        if self.comm_model not in COMM_MODELS:
            raise InputError(f"--comm-model {self.comm_model!r} is invalid: choose one of "
                             f"{', '.join(COMM_MODELS)} (or megatron-overlap: megatron with p2p overlap on)")
        if self.p2p_overlap not in P2P_OVERLAP:
            raise InputError(f"p2p overlap {self.p2p_overlap!r} is invalid: choose one of {', '.join(P2P_OVERLAP)}")
        if isinstance(self.dp_multiple, bool) or not isinstance(self.dp_multiple, int) or self.dp_multiple < 1:
            raise InputError(f"dp_multiple = {self.dp_multiple!r} is invalid: must be an integer >= 1")
        if self.search_mode not in SEARCH_MODES:
            raise InputError(f"search mode {self.search_mode!r} is invalid: choose one of {', '.join(SEARCH_MODES)}")
        if not self.schedules:
            object.__setattr__(self, "schedules", style_schedules(self.flag_style))
        for schedule in self.schedules:
            if schedule not in SCHEDULES:
                raise InputError(f"--schedules: {schedule!r} is not a pipeline schedule; allowed: "
                                 f"{', '.join(SCHEDULES)}")
        if INTERLEAVED in self.schedules and self.flag_style not in LAYOUT_STYLES:
            raise InputError(f"--schedules {INTERLEAVED} cannot run with flag style {self.flag_style} (one chunk "
                             f"per rank); use --schedules 1f1b or a layout flag style "
                             f"({', '.join(LAYOUT_STYLES)})")
        if not self.micro_batch_sizes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                                             for m in self.micro_batch_sizes):
            raise InputError(f"micro-batch sizes {self.micro_batch_sizes!r} are invalid: give integers >= 1, "
                             f"e.g. 1,2,4")

    @classmethod
    def from_cli(cls, args: Any) -> "TargetRuntime":
        """The target of ``poseidon plan``'s parsed arguments (``search/cli.py``)."""
        comm, overlap = args.comm_model, args.overlap_p2p_comm
        if comm == "megatron-overlap":
            if overlap == "off":
                raise InputError("--comm-model megatron-overlap conflicts with --overlap-p2p-comm off; drop one")
            comm, overlap = "megatron", "on"
        mode = "exhaustive" if args.exhaustive else "exact" if args.exact else args.search_mode
        values: dict[str, Any] = {"flag_style": args.flag_style, "comm_model": comm, "p2p_overlap": overlap,
                                  "search_mode": mode, "virtual_stages": tuple(args.virtual_stages)}
        if args.schedules:
            values["schedules"] = tuple(args.schedules)
        if args.micro_batch_size:
            values["micro_batch_sizes"] = tuple(args.micro_batch_size)
        return cls(**values)

    @classmethod
    def for_job(cls, options: Any, job: Any, flag_style: str, dp_multiple: int = 1) -> "TargetRuntime":
        """The target of a ``poseidon-run`` launch: its ``RuntimeOptions``, the job's ``JobFlags``, the
        resolved flag style (``runtime/apply.py``) and the job's CP."""
        values: dict[str, Any] = {"flag_style": flag_style, "search_mode": options.search_mode,
                                  "p2p_overlap": "auto" if job.overlap_p2p_comm else "off",
                                  "dp_multiple": dp_multiple}
        if options.schedules:
            values["schedules"] = tuple(options.schedules)
        if options.micro_batch_sizes:
            values["micro_batch_sizes"] = tuple(options.micro_batch_sizes)
        return cls(**values)

    def describe(self, plan: Any = None) -> str:
        """One line for the plan table; with ``plan``, the overlap it chose."""
        overlap = self.p2p_overlap
        if plan is not None and plan.schedule == INTERLEAVED:
            overlap += f" (planned: {'on' if plan.overlap_p2p_comm else 'off'})"
        return (f"runtime: {_STYLE_NAMES[self.flag_style]}; comm model {self.comm_model}; schedules "
                f"{','.join(self.schedules)}; p2p overlap {overlap}; micro-batch sizes "
                f"{','.join(map(str, self.micro_batch_sizes))}; search {self.search_mode}")

    def variants(self) -> tuple["SearchVariant", ...]:
        """The searches that together cover the target's plans (one per p2p-overlap setting that matters)."""
        if INTERLEAVED not in self.schedules:
            return (SearchVariant(comm_model=self.comm_model, schedules=self.schedules, overlap=False),)
        others = tuple(s for s in self.schedules if s != INTERLEAVED)
        with_overlap = "megatron-overlap" if self.comm_model == "megatron" else self.comm_model
        out = []
        if self.p2p_overlap in ("auto", "on"):
            # 1F1B has no overlap variant (Megatron turns it off), so this search covers it too.
            out.append(SearchVariant(comm_model=with_overlap, schedules=self.schedules, overlap=True))
        elif others:
            out.append(SearchVariant(comm_model=self.comm_model, schedules=others, overlap=False))
        # dag has no overlap model: interleaved without overlap would only add plans Megatron may refuse
        if self.p2p_overlap == "off" or (self.p2p_overlap == "auto" and self.comm_model != "dag"):
            out.append(SearchVariant(comm_model=self.comm_model, schedules=(INTERLEAVED,), overlap=False,
                                     min_pp=MIN_PP_INTERLEAVED_WITHOUT_OVERLAP))
        return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchVariant:
    """One search of :func:`search_plan`: a comm model, the schedules it prices, the overlap it stands for."""

    comm_model: str
    """Simulator comm model of this search (``megatron-overlap`` prices interleaved with overlap)."""
    schedules: tuple[str, ...]
    """Schedules searched."""
    overlap: bool
    """``overlap_p2p_comm`` of the interleaved plans it finds."""
    min_pp: int = 1
    """Smallest pipeline size (Megatron-LM needs 3 for interleaved without overlap)."""

    @property
    def label(self) -> str:
        """The variant in words, for what a search left unproven: ``interleaved-1f1b without p2p overlap``."""
        if INTERLEAVED not in self.schedules:
            return ",".join(self.schedules)
        return f"{','.join(self.schedules)} {'with' if self.overlap else 'without'} p2p overlap"


def search_plan(cost_model: "CostModel", target: TargetRuntime, options: "SearchOptions | None" = None,
                *, clock: "Callable[[], float] | None" = None) -> "SearchResult":
    """The fastest plan for ``target``: one search per :meth:`TargetRuntime.variants`, the best kept.

    ``options`` carries everything the target does not decide (TP / PP / mbs limits, top-k, time limit,
    progress...); its mode, schedules, virtual stages and comm model are the target's. The time limit is
    shared among the variants: each gets an equal share of what is left when it starts, so a variant
    that finishes early hands its rest on (``clock``, default ``time.monotonic``: what the limit is
    measured on). Under a limit the narrower variants (fewer schedules: interleaved without overlap)
    search first, each with NARROW_SHARE of what is left: they are cheap or empty where the broad one is
    not (frontier-1024: memory leaves interleaved without overlap no plan), so the broad variant gets the
    time they leave; one the clock stopped searches again after the broad one, below its plan, with the
    time left (at least AGAIN_MIN_S), and keeps the higher of its two bounds. Without a limit, the
    target's order (broad first). Each later variant searches only below the best plan so far
    (``SearchOptions.cutoff_ms``). Raises the first variant's NoFeasiblePlanError (in the target's
    order) when none finds a plan.
    """
    from .search import SearchOptions, search
    from .search.options import TimeLimitError, round_gap

    base = dataclasses.replace(options or SearchOptions(), mode=target.search_mode,
                               virtual_stages=target.virtual_stages, dp_multiple=target.dp_multiple)
    # with a time limit, narrowest first (stable: equal widths keep the target's order); each later
    # one inherits the rest. Without one, the target's order (the broad variant first): every later
    # variant searches only below the best plan so far (SearchOptions.cutoff_ms), and the broad one's
    # is usually the best (paper Setting 6 at 288 NPUs: interleaved without overlap alone took 35 CPU s
    # with its own threshold, 8,858 ms, instead of the broad variant's 8,598)
    rank = {v: i for i, v in enumerate(target.variants())}      # the target's order breaks ties
    variants = tuple(rank)
    if base.time_limit_s is not None:
        variants = tuple(sorted(rank, key=lambda v: (len(v.schedules), rank[v])))
    clock = clock or time.monotonic
    deadline = None if base.time_limit_s is None else clock() + base.time_limit_s
    best = None
    errors: dict[int, NoFeasiblePlanError] = {}
    out_of_time = False           # a variant stopped before any plan: its bound still counts
    wall_s = 0.0
    nodes = 0                     # search-tree nodes of every variant (a plan's own stats count its variant's)
    bounds: list[tuple[float, str | None, SearchVariant]] = []   # each variant's proven lower bound (the
                                  # whole space's is their minimum) and the part it left unproven
    def attempt(index: int, variant: SearchVariant, min_pp: int, limit: float | None) -> bool:
        """Search ``variant`` below the best plan so far; whether it searched to its end."""
        nonlocal best, out_of_time, wall_s, nodes
        progress = base.progress
        if progress is not None and len(variants) > 1:
            progress = _scaled_progress(progress, index, len(variants))
        opts = dataclasses.replace(base, comm_model=variant.comm_model, schedules=variant.schedules,
                                   min_pipeline_stages=None if min_pp == 1 else min_pp, time_limit_s=limit,
                                   progress=progress,
                                   cutoff_ms=None if best is None else best[1].plan.predicted_iteration_ms)
        try:
            result = search(cost_model, opts, clock=clock)
        except NoFeasiblePlanError as exc:
            errors[rank[variant]] = exc
            return True
        except TimeLimitError as exc:
            out_of_time = True
            bounds.append((exc.lower_bound_ms, "the time limit stopped it before any plan", variant))
            return False
        wall_s += result.stats.wall_s
        nodes += result.stats.nodes
        bounds.append((float(result.stats.lower_bound_ms), result.stats.unproven, variant))
        ms = result.plan.predicted_iteration_ms
        if best is None or (ms, rank[variant]) < (best[1].plan.predicted_iteration_ms, rank[best[0]]):
            best = (variant, result)
        return bool(result.stats.complete)

    # under a limit a narrow variant that runs before any plan could cut it gets NARROW_SHARE of what is
    # left: where it is cheap (frontier-1024: nothing fits) that is plenty; where it is not, its own
    # threshold makes it expensive (Setting 6 at 288 NPUs, GBS 64, seq 1024: 37,911 nodes, 18.7 s alone,
    # 71 nodes and 0.5 s below the broad variant's plan), so the clock stops it, the broad variant gets
    # the time, and the narrow one searches again with the rest, below the broad one's plan
    again: list[tuple[int, SearchVariant, int]] = []
    for index, variant in enumerate(variants):
        min_pp = max(variant.min_pp, base.min_pipeline_stages or 1)
        if base.max_pipeline_stages is not None and min_pp > base.max_pipeline_stages:
            continue
        limit = None
        narrow = deadline is not None and best is None and index < len(variants) - 1
        if deadline is not None:
            # past the deadline a variant still gets a token limit: it then returns its seed plan
            share = 1.0 / (len(variants) - index)
            limit = max(MIN_VARIANT_S, (deadline - clock()) * (min(share, NARROW_SHARE) if narrow else share))
        if not attempt(index, variant, min_pp, limit) and narrow:
            again.append((index, variant, min_pp))
    for index, variant, min_pp in again:
        if best is None or deadline - clock() < AGAIN_MIN_S:
            break
        # its bound so far stays where the second search proves less
        (before,) = [b for b in bounds if b[2] is variant]
        bounds.remove(before)
        attempt(index, variant, min_pp, deadline - clock())
        after = [b for b in bounds if b[2] is variant]
        if after and after[0][0] < before[0]:
            bounds.remove(after[0])
            bounds.append(before)
    if best is None:
        if out_of_time:
            raise TimeLimitError(base.time_limit_s)
        if errors:
            raise errors[min(errors)]         # the broadest variant's reason
        raise NoFeasiblePlanError(f"no plan: interleaved without p2p overlap needs at least "
                                  f"{MIN_PP_INTERLEAVED_WITHOUT_OVERLAP} pipeline stages on Megatron-LM; allow a "
                                  f"larger --max-pp, add schedule 1f1b, or let the plan overlap p2p")
    variant, result = best
    overlap = variant.overlap and result.plan.schedule == INTERLEAVED
    stats = dict(result.plan.search_stats)
    if variant.comm_model == "megatron-overlap" and result.plan.schedule != INTERLEAVED:
        stats["comm_model"] = "megatron"  # Megatron overlaps p2p only when interleaved: the same timing
    if len(variants) > 1:
        stats["variants"] = len(variants)
        stats["wall_s"] = round(wall_s, 4)
        stats["nodes_total"] = nodes
        # proven optimal exactly when no variant's bound is below the plan (a variant searched below a
        # faster plan of another, or cut by the clock, is proven where its bound reaches the plan)
        best_ms = result.plan.predicted_iteration_ms
        lower = min(b for b, _why, _v in bounds)
        open_parts = [f"{v.label}: {why or 'not searched to the end'}" for b, why, v in bounds if b < best_ms]
        complete = not open_parts
        gap = 0.0 if complete else max(0.0, best_ms / lower - 1.0) if 0 < lower < math.inf else math.inf
        stats["complete"] = complete
        stats["lower_bound_ms"] = round(min(lower, best_ms), 3) if math.isfinite(lower) else None
        stats["gap"] = round_gap(gap)
        stats["unproven"] = "; ".join(open_parts) or None
    plan = dataclasses.replace(result.plan, overlap_p2p_comm=overlap, search_stats=stats)
    return dataclasses.replace(result, plan=plan)


def plan_as_run(cost_model: "CostModel", cand: Any, target: TargetRuntime | None = None) -> Any:
    """The plan of one candidate priced as ``target`` (default: Megatron-LM's) will run it, for plans not
    found by :func:`search_plan` (a hand-made split, a runner-up, a baseline): under each of the target's
    :meth:`~TargetRuntime.variants` that covers the candidate (an interleaved plan with p2p overlap, or
    without it from its ``min_pp`` stages), the faster kept. The plan records the overlap it runs with
    (``Plan.overlap_p2p_comm``), which its Megatron flags carry."""
    target = target or TargetRuntime()
    if cand.schedule != INTERLEAVED:
        return cost_model.make_plan(cand, comm_model=target.comm_model)
    priced = [(cost_model.iteration_ms(cand, v.comm_model), not v.overlap, v) for v in target.variants()
              if INTERLEAVED in v.schedules and cand.pp >= v.min_pp]
    if not priced:
        raise InputError(f"interleaved without p2p overlap needs at least {MIN_PP_INTERLEAVED_WITHOUT_OVERLAP} "
                         f"pipeline stages on Megatron-LM (this plan has {cand.pp}); let it overlap p2p")
    ms, _no_overlap, variant = min(priced, key=lambda p: p[:2])
    plan = cost_model.make_plan(cand, ms, comm_model=variant.comm_model)
    return dataclasses.replace(plan, overlap_p2p_comm=variant.overlap)


def _scaled_progress(progress, index: int, count: int):
    def report(fraction: float, message: str) -> None:
        progress((index + fraction) / count, f"{message} [search {index + 1}/{count}]")
    return report
