"""Search options and results: what ``search()`` takes and returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import InputError, PoseidonError
from ..simulator.graph import COMM_MODELS
from ..simulator.schedules import SCHEDULES

MODES = ("default", "exact", "exhaustive")
DEFAULT_WARMUP = 500
"""Warm-up plans of ``default`` mode (the paper's 500)."""
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    """How to search. Defaults plan for Megatron-LM (1F1B and interleaved 1F1B)."""

    mode: str = "default"
    """``default``: exact-safe pruning plus the ridge rule and contiguous device-type blocks (both rest
    on assumptions, docs/SEARCH.md); ``exact``: only provably safe pruning, so the result is the true
    optimum of the cost model over the whole space; ``exhaustive``: simulate every plan (small
    problems only: a reference for checking)."""

    gap: float = 0.0
    """Stop once no other plan can be faster by more than this fraction (0.01: the result is provably
    within 1 % of the optimum -- of the whole space in ``exact`` mode, of the default space in
    ``default`` mode). 0: no slack."""

    type_blocks: bool = True
    """``default`` mode only: each device type's ranks form one contiguous block of the pipeline."""

    schedules: tuple[str, ...] = MEGATRON_SCHEDULES
    """Pipeline schedules to consider (the target runtime must execute them)."""

    virtual_stages: tuple[int, ...] = (2,)
    """Model chunks per rank tried with ``interleaved-1f1b`` (each >= 2)."""

    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batch sizes to try; ``None``: every size the profile covers."""

    tp_degrees: tuple[int, ...] | None = None
    """TP degrees to try; ``None``: every power of two that fits a node and divides heads/KV groups."""

    expert_parallel: tuple[int, ...] | None = None
    """MoE models: expert-parallel sizes to try; ``None``: every divisor of the experts megatron-core can run
    (``costmodel.expert_layouts``). A dense model has only EP 1 (another size is an error naming ``--ep``)."""

    dp_multiple: int = 1
    """DP degrees must be multiples of this: with context parallelism CP the plan's DP replicas hold
    Megatron's CP groups, so Megatron's data-parallel size is DP / CP (``runtime/mindspeed.model_parallel_world``).
    1: any DP."""

    max_pipeline_stages: int | None = None
    """Upper limit on PP; ``None``: up to the number of layers."""

    min_pipeline_stages: int | None = None
    """Lower limit on PP; ``None``: 1. With ``max_pipeline_stages`` equal, PP is pinned
    (``poseidon-run --poseidon-keep``)."""

    top_k: int = 3
    """Plans to report: the best and up to ``top_k - 1`` runners-up, each the best of a different
    ``(tp, pp, dp, mbs, schedule, V)``."""

    exact_alternatives: bool = False
    """Also prove the runners-up (each the best of its key); slower. ``exhaustive`` always does.
    Otherwise only the plan is proven (in ``exact`` mode) and the runners-up are the best plans of
    other keys met on the way."""

    warmup_samples: int | None = None
    """Random feasible plans simulated first to seed the best time (paper §4.2.3); ``None``: the mode's
    default, :data:`DEFAULT_WARMUP` in ``default`` mode and none in ``exact`` and ``exhaustive`` mode
    (their seeds give the first plan, and a proof's time is not spent on random DAGs: see
    :attr:`warmup_count`)."""

    seed: int = 0
    """Seed of the warm-up sampler (results do not depend on it, only the work done)."""

    time_limit_s: float | None = None
    """Stop after this many seconds and return the best plan so far (``stats.complete`` is then
    false: the plan is not proven optimal); ``None``: no limit."""

    cutoff_ms: float | None = None
    """A plan this fast is known elsewhere (another search of the same target, ``target.search_plan``):
    plans at or above it need not be found, so the search proves only that none of its plans is
    faster; without one below it, its result is whatever it met (or no plan). Ignored with
    ``exact_alternatives`` (each key's runner-up must then be proven). ``None``: no cutoff."""

    max_exhaustive_plans: int = 2_000_000
    """``exhaustive`` refuses problems with more plans than this."""

    comm_model: str = "dag"
    """Simulator communication model the plans are timed with: ``dag`` (the paper's fixed edge delays),
    ``megatron`` (Megatron's blocking rendezvous p2p, docs/FIDELITY.md) or ``megatron-overlap``. Every
    model's extra parameters take the cost model's values (``CostModel.comm_extras``: the profile's
    ``p2p_call_ms``) or their defaults. The bounds stay valid for all (docs/SEARCH.md)."""

    workers: int = 1
    """Processes a structure's tree is walked by, once it passes ``SHARE_AT`` nodes (``search/shared_walk.py``:
    each takes some of its subtrees; the plan is the one a single process finds). 1: one process. The CLI
    and ``poseidon-run`` default to the cores the process may run on (``shared_walk.auto_workers``)."""

    pure_python: bool | None = None
    """Force (``True``) or forbid (``False``) the pure-Python search loop; ``None``: the environment
    (``POSEIDON_PURE_PYTHON=1``) decides."""

    progress: Callable[[float, str], None] | None = field(default=None, compare=False)
    """Called now and then with (fraction done, message) -- the CLI draws a progress bar with it."""

    @property
    def warmup_count(self) -> int:
        """The warm-up plans this search simulates: ``warmup_samples``, or the mode's default. Exact mode
        draws none by default: on the public sweep (``bench_search.py --sweep``) the warm-up cost a third
        of the median instance's time (random plans of the most promising groups, each shape's DAG
        built for them) and changed no plan; its greedy, assignment and relaxation seeds set the
        threshold (docs/SEARCH.md, "Warm-up and the group's positional bound")."""
        if self.warmup_samples is not None:
            return self.warmup_samples
        return DEFAULT_WARMUP if self.mode == "default" else 0

    def __post_init__(self) -> None:
        validate_options(self)


def _ints(name: str, values: Any, minimum: int, what: str) -> None:
    if not isinstance(values, tuple) or not values:
        raise InputError(f"{name} = {values!r} is invalid: must be a non-empty tuple of {what}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
            raise InputError(f"{name} = {values!r} is invalid: {x!r} is not {what}")


def validate_options(o: SearchOptions) -> None:
    """Raise :class:`InputError` naming the option, the value and what is allowed."""
    if o.mode not in MODES:
        raise InputError(f"mode = {o.mode!r} is invalid: must be one of {', '.join(MODES)}")
    if not isinstance(o.schedules, tuple) or not o.schedules:
        raise InputError(f"--schedules {o.schedules!r} is invalid: give at least one of "
                         f"{', '.join(SCHEDULES)}")
    for s in o.schedules:
        if s not in SCHEDULES:
            raise InputError(f"--schedules: {s!r} is not a pipeline schedule; allowed: "
                             f"{', '.join(SCHEDULES)} (Megatron-LM runs {', '.join(MEGATRON_SCHEDULES)})")
    if len(set(o.schedules)) != len(o.schedules):
        raise InputError(f"--schedules {','.join(o.schedules)} lists a schedule twice")
    _ints("--virtual-stages", o.virtual_stages, 2, "an integer >= 2 (chunks per rank)")
    if o.micro_batch_sizes is not None:
        _ints("--micro-batch-size", o.micro_batch_sizes, 1, "an integer >= 1")
    if o.tp_degrees is not None:
        _ints("--tp", o.tp_degrees, 1, "a power of two >= 1")
        for tp in o.tp_degrees:
            if tp & (tp - 1):
                raise InputError(f"--tp {tp} is invalid: TP degrees are powers of two (1, 2, 4, 8)")
    if o.expert_parallel is not None:
        _ints("--ep", o.expert_parallel, 1, "an integer >= 1 (expert-parallel size)")
    if o.max_pipeline_stages is not None:
        _ints("--max-pp", (o.max_pipeline_stages,), 1, "an integer >= 1")
    if o.min_pipeline_stages is not None:
        _ints("--min-pp", (o.min_pipeline_stages,), 1, "an integer >= 1")
        if o.max_pipeline_stages is not None and o.min_pipeline_stages > o.max_pipeline_stages:
            raise InputError(f"--min-pp {o.min_pipeline_stages} is larger than --max-pp "
                             f"{o.max_pipeline_stages}; allow at least one pipeline size")
    _ints("--top-k", (o.top_k,), 1, "an integer >= 1")
    w = o.warmup_samples
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
        raise InputError(f"--warmup-samples {o.warmup_samples!r} is invalid: must be an integer >= 0")
    if isinstance(o.seed, bool) or not isinstance(o.seed, int):
        raise InputError(f"--seed {o.seed!r} is invalid: must be an integer")
    if o.time_limit_s is not None:
        t = o.time_limit_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise InputError(f"--time-limit {t!r} is invalid: must be a number of seconds > 0")
    _ints("max_exhaustive_plans", (o.max_exhaustive_plans,), 1, "an integer >= 1")
    g = o.gap
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or not 0 <= g < 1:
        raise InputError(f"--gap {g!r} is invalid: must be a fraction in [0, 1), e.g. 0.01 for 1 %")
    if not isinstance(o.exact_alternatives, bool):
        raise InputError(f"exact_alternatives = {o.exact_alternatives!r} is invalid: must be true or false")
    if not isinstance(o.type_blocks, bool):
        raise InputError(f"type_blocks = {o.type_blocks!r} is invalid: must be true or false")
    if not isinstance(o.comm_model, str) or o.comm_model not in COMM_MODELS:
        raise InputError(f"--comm-model {o.comm_model!r} is invalid: must be one of {', '.join(COMM_MODELS)} "
                         f"(megatron when the plan runs on Megatron-LM)")
    if isinstance(o.dp_multiple, bool) or not isinstance(o.dp_multiple, int) or o.dp_multiple < 1:
        raise InputError(f"dp_multiple = {o.dp_multiple!r} is invalid: must be an integer >= 1")
    if isinstance(o.workers, bool) or not isinstance(o.workers, int) or o.workers < 1:
        raise InputError(f"--workers {o.workers!r} is invalid: must be an integer >= 1 (processes the search "
                         f"may use), or auto")
    if o.pure_python is not None and not isinstance(o.pure_python, bool):
        raise InputError(f"pure_python = {o.pure_python!r} is invalid: must be true, false or None")


class TimeLimitError(PoseidonError):
    """``--time-limit`` ran out before any plan was found; ``lower_bound_ms``: the proven bound on every
    plan of the space at that point (0: none), so a caller combining searches keeps its bound valid."""

    def __init__(self, limit_s: float, lower_bound_ms: float = 0.0):
        super().__init__(f"--time-limit {limit_s:g} s ran out before any plan was found; raise it")
        self.lower_bound_ms = lower_bound_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchStats:
    """What the search did (numbers go into ``Plan.search_stats``)."""

    mode: str
    kernel: str                     # "compiled" | "pure-python"
    wall_s: float
    complete: bool                  # true: proven optimal, the plan equals its proven lower bound
                                    # (searched to the end, or the bounds of the pieces the time limit
                                    # left open reach it); false: gap > 0 and ``unproven`` says why
    structures: int                 # (tp, mbs, dp, schedule, V, pp, ranks per type) considered
    shapes: int                     # distinct DAG shapes built
    warmup_samples: int
    simulator_calls: int            # complete plans simulated (warm-up + seeds + leaves)
    bound_evaluations: int          # DAG evaluations of partial plans (lower bounds)
    nodes: int                      # search-tree nodes
    pruned: Mapping[str, int]       # branches cut, per rule
    comm_model: str = "dag"         # simulator communication model the times come from
    alternatives_proven: bool = False   # each runner-up is proven the best plan of its shape
    lower_bound_ms: float = 0.0     # proven: no plan of the space searched is faster (docs/SEARCH.md)
    gap: float = math.inf           # best / lower_bound_ms - 1 (0 exactly when complete)
    unproven: str | None = None     # not complete: the part of the space not proven, and what stopped it

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for ``Plan.search_stats`` and ``--json``."""
        return {"mode": self.mode, "kernel": self.kernel, "wall_s": round(self.wall_s, 4),
                "complete": self.complete, "structures": self.structures, "shapes": self.shapes,
                "warmup_samples": self.warmup_samples, "simulator_calls": self.simulator_calls,
                "bound_evaluations": self.bound_evaluations, "nodes": self.nodes,
                "pruned": dict(self.pruned), "comm_model": self.comm_model,
                "alternatives_proven": self.alternatives_proven,
                "lower_bound_ms": round(self.lower_bound_ms, 3) if math.isfinite(self.lower_bound_ms) else None,
                "gap": round_gap(self.gap), "unproven": self.unproven}


def round_gap(gap: float) -> float | None:
    """A gap for JSON: 6 significant digits, never rounded to 0 unless it is 0 (a plan above its bound
    must not read as proven); None without a bound."""
    if not math.isfinite(gap):
        return None
    return float(f"{gap:.6g}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    """The best plan, the runners-up and the search statistics."""

    plan: Any                       # poseidon_plugin.plan.Plan
    alternatives: tuple[Any, ...]   # PlanSummary, best first (also in plan.alternatives)
    stats: SearchStats
