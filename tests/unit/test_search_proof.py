"""``complete`` and ``gap`` say one thing everywhere they are reported: a plan equal to its proven lower
bound is complete (gap exactly 0); any other plan is not, its gap is above 0 (never rounded to 0) and
``unproven`` names the part not proven. Checked on the engine, the exhaustive reference, the target's
combined variants, the plan table and the CLI note (node budgets and injected clocks, no wall time)."""

import dataclasses
import math

import pytest

from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.plan import format_gap, proof_line, render_table
from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.search.engine import SearchRun
from poseidon_plugin.search.options import round_gap
from poseidon_plugin.specs import load_cluster, load_model
from poseidon_plugin.target import TargetRuntime, search_plan

from .test_search_exact import random_problem


def agree(stats: dict, best_ms: float) -> None:
    """The one rule, on a plan's ``search_stats``."""
    if stats["complete"]:
        assert stats["gap"] == 0.0 and stats["unproven"] is None
        assert stats["lower_bound_ms"] == pytest.approx(best_ms, abs=1e-3)   # JSON keeps 3 decimals
    else:
        assert stats["gap"] is None or stats["gap"] > 0.0
        assert stats["unproven"]


@pytest.mark.parametrize("seed", range(0, 40, 2))
@pytest.mark.parametrize("budget", [None, 1, 3])
def test_engine_complete_iff_plan_equals_its_bound(seed, budget):
    cm, schedules = random_problem(seed)
    run = SearchRun(cm, SearchOptions(mode="exact", schedules=schedules, warmup_samples=2), node_budget=budget)
    run.search()
    res = run.result()
    st = res.stats
    assert st.complete == (st.lower_bound_ms >= res.plan.predicted_iteration_ms)
    agree(res.plan.search_stats, res.plan.predicted_iteration_ms)
    if budget is None:
        assert st.complete


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_gap_option_is_not_complete_unless_proven(seed):
    """--gap stops once within the gap: complete only where the bound reaches the plan, else the
    unproven part names --gap."""
    cm, schedules = random_problem(seed)
    res = search(cm, SearchOptions(mode="exact", schedules=schedules, gap=0.3, warmup_samples=2))
    stats = res.plan.search_stats
    agree(stats, res.plan.predicted_iteration_ms)
    if not stats["complete"] and "--gap" not in stats["unproven"]:
        assert "shape groups" in stats["unproven"]


def test_clock_cut_reports_what_is_open():
    cm = CostModel(load_cluster("paper-setting-3"), load_model("llama-30b"), micro_batch_sizes=(1, 2))
    reads = iter(range(10 ** 9))
    run = SearchRun(cm, SearchOptions(mode="exact", time_limit_s=40.0), clock=lambda: float(next(reads)))
    run.search()
    res = run.result()
    stats = res.plan.search_stats
    agree(stats, res.plan.predicted_iteration_ms)
    if not stats["complete"]:
        assert stats["unproven"].startswith("the time limit stopped the search")


@pytest.mark.parametrize("seed", range(0, 12, 3))
def test_exhaustive_complete_has_gap_zero(seed):
    cm, schedules = random_problem(seed)
    res = search(cm, SearchOptions(mode="exhaustive", schedules=schedules))
    agree(res.plan.search_stats, res.plan.predicted_iteration_ms)
    assert res.stats.complete and res.stats.gap == 0.0


@pytest.mark.parametrize("seed", range(1, 30, 3))
def test_target_variants_combined(seed):
    """Both overlap variants: the second searches below the first's plan (cutoff) and is proven where
    its bound reaches the plan, so a finished search is complete with gap 0."""
    cm, _ = random_problem(seed)
    target = TargetRuntime(micro_batch_sizes=(1, 2))
    try:
        res = search_plan(cm, target, SearchOptions(warmup_samples=2))
    except Exception as exc:               # a tiny problem without any plan of these schedules
        assert "no plan" in str(exc).lower() or "fits" in str(exc).lower()
        return
    agree(res.plan.search_stats, res.plan.predicted_iteration_ms)
    assert res.plan.search_stats["complete"] is True


def test_tiny_gaps_are_not_rounded_to_zero():
    assert round_gap(3e-9) > 0.0 and round_gap(0.0) == 0.0 and round_gap(math.inf) is None
    assert format_gap(4.2e-5) == "0.0042 %" and format_gap(0.027) == "2.7 %" and format_gap(0.0) == "0 %"
    assert format_gap(None) == "n/a"


def test_plan_table_and_cli_line_agree():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    res = search(cm, SearchOptions(mode="exact", micro_batch_sizes=(1,)))
    plan = res.plan
    assert "proven optimal" in render_table(plan)
    open_plan = dataclasses.replace(plan, search_stats=dict(plan.search_stats, complete=False, gap=4e-5,
                                                            lower_bound_ms=plan.predicted_iteration_ms * (1 - 4e-5),
                                                            unproven="the time limit stopped the search: 3 of 9 "
                                                                     "shape groups not searched to the end"))
    line = proof_line(open_plan.search_stats, plan.predicted_iteration_ms)
    assert "NOT proven optimal" in line and "0.004 %" in line and "3 of 9 shape groups" in line
    assert line in render_table(open_plan)


class _Splitter:
    """A structure whose best plan takes ``best`` ms: records the thresholds and node caps it is searched
    with."""

    def __init__(self, best: float):
        self.best, self.calls = best, []

    def run(self, vec, tau, *, deadline, max_nodes, resume=False):
        from poseidon_plugin.search.counters import N_COUNTERS, NODES
        from poseidon_plugin.search.split_result import SplitResult
        self.calls.append((tau, max_nodes, resume))
        counters = [0] * N_COUNTERS
        counters[NODES] = 10
        if self.best < tau:
            return SplitResult(time_ms=self.best, types=(0,), layers=(1,), counters=tuple(counters))
        return SplitResult(time_ms=math.inf, types=(), layers=(), counters=tuple(counters))


@pytest.mark.parametrize("best", [99.0, 199.9, 250.0])
@pytest.mark.parametrize("budget, cap, nodes", [(None, 0, 0), (None, 64, 64), (32, 64, 32), (128, 64, 64)])
def test_split_searches_below_tau_once_within_its_cap(best, budget, cap, nodes):
    """SearchRun.split: one walk below tau itself (no lower thresholds first), at most the smaller of the
    cap and a test's node budget (0: none), resumed when asked; its counters are added to the run's."""
    from types import SimpleNamespace

    from poseidon_plugin.search.counters import N_COUNTERS
    run = SimpleNamespace(node_budget=budget, split_deadline=math.inf, ctr=[0] * N_COUNTERS, workers=1)
    run.add = lambda counters: SearchRun.add(run, counters)
    sp = _Splitter(best)
    res = SearchRun.split(run, sp, [1], 200.0, cap=cap, resume=True)
    assert sp.calls == [(200.0, nodes, True)]
    assert res.time_ms == (best if best < 200.0 else math.inf)
    assert run.ctr[0] == 10
