"""The look-ahead (exact mode): the first structure whose tree passes ``LOOKAHEAD_AT`` nodes stops; the groups
after it are searched a little for a better plan; then that structure is searched again, below it
(docs/SEARCH.md, "The look-ahead").

The small problems of the suite rarely need 2,048 nodes, so these tests stop the first tree after 2: the
answers must stay those of the exhaustive reference, with the anytime guarantees (a valid lower bound,
resumes) of a search cut by a clock or a node budget.
"""

import pytest

from poseidon_plugin.search import SearchOptions, engine
from poseidon_plugin.search.engine import SearchRun

from .test_search_anytime import _cut_once, optimum, run
from .test_search_exact import exact_and_exhaustive, random_problem

SEEDS = range(40)


@pytest.fixture
def look_early(monkeypatch):
    """LOOKAHEAD_AT = 2 nodes; yields a list with one ``(best before, best after)`` per look-ahead."""
    monkeypatch.setattr(engine, "LOOKAHEAD_AT", (2, 2))
    seen = []
    original = SearchRun.look_ahead

    def counted(self):
        before = self.board.best_ms_all()
        original(self)
        seen.append((before, self.board.best_ms_all()))

    monkeypatch.setattr(SearchRun, "look_ahead", counted)
    return seen


def test_the_look_ahead_keeps_the_exact_optimum(look_early, pure_python):
    looked = 0
    for seed in SEEDS:
        cm, schedules = random_problem(seed)
        look_early.clear()
        exact_and_exhaustive(cm, dict(schedules=schedules, top_k=2, warmup_samples=0, pure_python=pure_python))
        assert len(look_early) <= 2     # once per search (exact_and_exhaustive runs two exact searches)
        looked += bool(look_early)
    assert looked >= len(SEEDS) // 2    # it did happen: this is not the plain search again


def test_the_look_ahead_finds_better_plans_somewhere(look_early):
    for seed in SEEDS:
        cm, schedules = random_problem(seed)
        run(cm, mode="exact", schedules=schedules, warmup_samples=0)
    assert any(after < before for before, after in look_early)


@pytest.mark.parametrize("seed", range(0, 40, 4))
@pytest.mark.parametrize("fraction", [0.8, 0.9])
def test_a_search_cut_near_its_look_ahead_stays_valid(look_early, seed, fraction, pure_python):
    """Cut by the clock (before, inside or after the look-ahead), resumed with what the reserve leaves: the
    lower bound never passes the optimum, and a search that completes proves it."""
    assert_a_cut_search_stays_valid(seed, fraction, pure_python)


@pytest.mark.parametrize("seed", range(0, 40, 4))
@pytest.mark.parametrize("budget", [1, 3, 6])
def test_a_node_budget_with_the_look_ahead(look_early, seed, budget, pure_python):
    """A test's node budget, below the look-ahead's cap (no look-ahead) or above it: the lower bound stays
    valid, and a complete search proves the optimum."""
    assert_a_budgeted_search_stays_valid(seed, budget, pure_python)
    if budget < 2:
        assert not look_early


def assert_a_cut_search_stays_valid(seed: int, fraction: float, pure_python: bool) -> None:
    """The search of random problem ``seed`` cut by the clock and resumed (``_cut_once``): a complete one
    proves the optimum; otherwise its gap is the plan's over its lower bound."""
    _r, res, best = _cut_once(seed, pure_python, fraction)
    if res.stats.complete:
        assert res.stats.lower_bound_ms == best == res.plan.predicted_iteration_ms
    else:
        assert res.stats.gap == pytest.approx(res.plan.predicted_iteration_ms / res.stats.lower_bound_ms - 1)


def assert_a_budgeted_search_stays_valid(seed: int, budget: int, pure_python: bool) -> None:
    """The search of random problem ``seed`` with a node budget: its lower bound stays below the optimum,
    and a complete one proves it."""
    cm, schedules = random_problem(seed)
    best = optimum(cm, schedules).plan.predicted_iteration_ms
    _r, res = run(cm, mode="exact", schedules=schedules, warmup_samples=4, pure_python=pure_python,
                  node_budget=budget)
    assert res.stats.lower_bound_ms <= best <= res.plan.predicted_iteration_ms
    if res.stats.complete:
        assert res.stats.lower_bound_ms == best


def test_default_mode_does_not_look_ahead():
    cm, schedules = random_problem(3)
    assert not SearchRun(cm, SearchOptions(mode="default", schedules=schedules)).lookahead
    assert SearchRun(cm, SearchOptions(mode="exact", schedules=schedules)).lookahead
