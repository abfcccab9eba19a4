"""The race of a one-chunk tree's two branching orders (``SearchRun.race``): past ``RACE_AT`` nodes the
walk from the end and its pipeline-order twin take turns, each going on where it stopped, and the first
to end closes the structure. The answer is the optimum either order proves alone; the nodes stay within a
small multiple of the better order's."""

import math

import pytest

from poseidon_plugin.search import engine
from poseidon_plugin.search.counters import NODES
from poseidon_plugin.search.engine import SearchRun

from .test_search_exact import exact_and_exhaustive, random_problem
from .test_search_improve import _setting_6_96_trees
from .test_search_lookahead import assert_a_budgeted_search_stays_valid


@pytest.fixture
def races(monkeypatch):
    """Races from the first node on (``RACE_AT`` 4, equal shares), counted: ``[races, twin wins]``."""
    monkeypatch.setattr(engine, "RACE_AT", 4)
    monkeypatch.setattr(engine, "RACE_SHARE", 1)
    seen = [0, 0]
    original = SearchRun.race

    def counted(self, *args):
        before = self.races, self.twin_wins
        res = original(self, *args)
        seen[0] += self.races - before[0]
        seen[1] += self.twin_wins - before[1]
        return res

    monkeypatch.setattr(SearchRun, "race", counted)
    return seen


def test_raced_searches_equal_the_exhaustive_one(races, pure_python):
    """Tiny random problems with one-chunk schedules, every large-enough tree raced: ``--exact`` still
    equals ``--exhaustive`` (best time and runner-up), and both orders end races (non-vacuity). The pure
    backend runs every third seed (its time), a sample that holds races of both endings."""
    done = 0
    for seed in range(1, 60, 3) if pure_python else range(60):
        cm, schedules = random_problem(seed)
        if "interleaved-1f1b" in schedules:
            continue
        exact_and_exhaustive(cm, dict(schedules=schedules, top_k=2, warmup_samples=0, pure_python=pure_python))
        done += 1
    assert done and races[0] > 0 and 0 < races[1] < races[0]


def test_a_race_ends_with_the_better_order(pure_python, monkeypatch):
    """Paper Setting 6 at 96 NPUs, one-chunk trees of 50-3,000 nodes: the race finds the best time that
    each order finds alone, in at most three times the better order's nodes plus two opening legs (and
    the path each resumed leg walks again); where the twin ended it, the next race starts with it."""
    monkeypatch.setattr(engine, "RACE_AT", 16)
    monkeypatch.setattr(engine, "RACE_SHARE", 1)
    seen = twin = 0
    for r, sg, _sp, vec, full in _setting_6_96_trees(pure_python, 300 if pure_python else 3000,
                                                      lambda sg: sg.virtual_stages == 1):
        other = r.splitter(sg, backward=False).run(vec, math.inf)
        assert other.time_ms == full.time_ms and not other.aborted
        r._twins.pop(sg.key, None)
        r.race_leader = 0
        before = r.twin_wins
        res = r.race(sg, r.splitter(sg), vec, math.inf, 0, False)
        assert not res.aborted and res.time_ms == full.time_ms
        better = min(full.counters[NODES], other.counters[NODES])
        legs = 2 * math.ceil(math.log2(max(2, res.counters[NODES]))) + 2
        assert res.counters[NODES] <= 3 * better + 2 * engine.RACE_AT + legs * sg.pp
        if r.twin_wins > before:
            twin += 1
            assert r.race_leader == 1
        seen += 1
        if pure_python and seen >= 3:
            break
    assert seen and (pure_python or twin)


@pytest.mark.parametrize("budget", [5, 9, 40])
def test_a_raced_search_with_a_node_budget_stays_valid(races, budget, pure_python):
    """A node budget bounds both walks of a race together: the lower bound stays below the optimum, and a
    complete search proves it."""
    for seed in range(0, 60, 10):
        assert_a_budgeted_search_stays_valid(seed, budget, pure_python)
