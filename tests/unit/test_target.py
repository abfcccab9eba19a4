"""The target runtime (``poseidon_plugin/target.py``): one definition for ``poseidon plan`` and ``poseidon-run``,
p2p overlap as a planned choice, the plan field and its Megatron flag."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from poseidon_plugin.cli import main
from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.errors import InputError, PoseidonError
from poseidon_plugin.plan import PLAN_SCHEMA_VERSION, Plan, megatron_args
from poseidon_plugin.runtime.apply import planned_flags
from poseidon_plugin.runtime.job_flags import flag_values, read_job, rewrite
from poseidon_plugin.runtime.options import RuntimeOptions
from poseidon_plugin.search import SearchOptions
from poseidon_plugin.search import cli as search_cli
from poseidon_plugin.specs import load_cluster, load_model
from poseidon_plugin.target import SearchVariant, TargetRuntime, search_plan

JOB_ARGS = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--global-batch-size", "128"]


def _cli_target(*argv: str) -> TargetRuntime:
    parser = argparse.ArgumentParser()
    search_cli.configure(parser)
    return TargetRuntime.from_cli(parser.parse_args(["--cluster", "c", "--model", "m", *argv]))


def _launcher_target(job_args=(), **options) -> TargetRuntime:
    return TargetRuntime.for_job(RuntimeOptions(**options), read_job("pretrain_gpt.py", [*JOB_ARGS, *job_args]),
                                 "megatron")


def test_plan_cli_and_launcher_share_one_target():
    target = _cli_target()
    assert target == _launcher_target()
    assert (target.comm_model, target.search_mode, target.p2p_overlap, target.micro_batch_sizes, target.schedules) == (
        "megatron", "exact", "auto", (1, 2, 4), ("1f1b", "interleaved-1f1b"))
    # the same knobs give the same target on both sides
    assert _cli_target("--search-mode", "default", "--micro-batch-size", "1,2", "--schedules", "1f1b") == \
        _launcher_target(search_mode="default", micro_batch_sizes=(1, 2), schedules=("1f1b",))
    assert _cli_target("--overlap-p2p-comm", "off") == _launcher_target(["--no-overlap-p2p-communication"])


def test_setting_1_same_plan_offline_and_at_launch(capsys):
    """``poseidon plan`` (paper Setting 1 / Llama-3 8B) and the launcher's target give one plan."""
    assert main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--json", "--no-progress"]) == 0
    offline = Plan.from_dict(json.loads(capsys.readouterr().out))
    target = _launcher_target()
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=target.micro_batch_sizes)
    launched = search_plan(cm, target, SearchOptions(time_limit_s=300.0)).plan  # as planning.plan_on_rank0
    assert launched.plan_hash() == offline.plan_hash()
    assert offline.schedule == "interleaved-1f1b" and offline.overlap_p2p_comm and offline.pp == 2
    assert offline.search_stats["comm_model"] == "megatron-overlap" and offline.search_stats["mode"] == "exact"
    assert "--no-overlap-p2p-communication" not in megatron_args(offline)  # Megatron-LM's default is on


@pytest.mark.parametrize("comm, overlap, schedules, expected", [
    ("megatron", "auto", ("1f1b", "interleaved-1f1b"),
     [("megatron-overlap", ("1f1b", "interleaved-1f1b"), True, 1), ("megatron", ("interleaved-1f1b",), False, 3)]),
    ("megatron", "on", ("1f1b", "interleaved-1f1b"), [("megatron-overlap", ("1f1b", "interleaved-1f1b"), True, 1)]),
    ("megatron", "off", ("1f1b", "interleaved-1f1b"),
     [("megatron", ("1f1b",), False, 1), ("megatron", ("interleaved-1f1b",), False, 3)]),
    ("megatron", "auto", ("1f1b",), [("megatron", ("1f1b",), False, 1)]),
    ("dag", "auto", ("1f1b", "interleaved-1f1b"), [("dag", ("1f1b", "interleaved-1f1b"), True, 1)]),
])
def test_variants_cover_each_overlap_setting(comm, overlap, schedules, expected):
    target = TargetRuntime(comm_model=comm, p2p_overlap=overlap, schedules=schedules)
    assert target.variants() == tuple(SearchVariant(comm_model=c, schedules=s, overlap=o, min_pp=m)
                                      for c, s, o, m in expected)


def test_best_variant_wins_and_each_plan_is_priced_as_it_runs():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    auto = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,))).plan
    results = {}
    for overlap in ("on", "off"):
        results[overlap] = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), p2p_overlap=overlap)).plan
    assert auto.predicted_iteration_ms == min(p.predicted_iteration_ms for p in results.values())
    off = results["off"]
    assert not off.overlap_p2p_comm and (off.schedule == "1f1b" or off.pp >= 3)
    from poseidon_plugin.costmodel import Candidate
    cand = Candidate(tp=off.tp, pp=off.pp, dp=off.dp, mbs=off.micro_batch_size, stage_types=off.stage_types,
                     layers=off.layers, schedule=off.schedule, virtual_stages=off.virtual_stages)
    assert cm.iteration_ms(cand, "megatron") == pytest.approx(off.predicted_iteration_ms)



class _TickClock:
    """Advances one unit per read (``jump``: by that much at every read after the first)."""

    def __init__(self, jump: float = 1.0):
        self.now, self.jump, self.reads = 0.0, jump, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads > 1:
            self.now += self.jump
        return self.now


def _recording_search(monkeypatch):
    import poseidon_plugin.search as search_pkg
    limits, real = [], search_pkg.search

    def recording(cm, opts, **kw):
        limits.append(opts.time_limit_s)
        return real(cm, opts, **kw)
    monkeypatch.setattr(search_pkg, "search", recording)
    return limits


def test_time_limit_left_by_one_variant_goes_to_the_next(monkeypatch):
    """The limit is shared by what is left: the first (narrow) variant gets NARROW_SHARE of it, the second
    the rest."""
    from poseidon_plugin.target import NARROW_SHARE
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    limits = _recording_search(monkeypatch)
    clock = _TickClock()
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=1e6), clock=clock)
    assert len(limits) == 2
    assert limits[0] == pytest.approx((1e6 - 1) * NARROW_SHARE)
    # the first search completed after a few reads: the second gets all the rest, not a half
    assert limits[0] < limits[1] < 1e6
    assert res.plan.search_stats["complete"] is True


def test_narrow_variant_searches_first_and_leaves_its_time_to_the_broad_one(monkeypatch):
    """Interleaved without overlap (one schedule) runs before the broad search, with NARROW_SHARE of the
    limit; the broad one then gets all the time left, and the result is the same plan as in the target's
    order."""
    import poseidon_plugin.search as search_pkg
    from poseidon_plugin.target import NARROW_SHARE
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    real, seen = search_pkg.search, []

    def recording(cm_, opts, **kw):
        seen.append((opts.schedules, opts.time_limit_s))
        return real(cm_, opts, **kw)
    monkeypatch.setattr(search_pkg, "search", recording)
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=1e6), clock=_TickClock())
    assert [s for s, _ in seen] == [("interleaved-1f1b",), ("1f1b", "interleaved-1f1b")]
    assert seen[0][1] == pytest.approx((1e6 - 1) * NARROW_SHARE) and seen[0][1] < seen[1][1] < 1e6
    monkeypatch.setattr(search_pkg, "search", real)
    each = [search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), p2p_overlap=o)).plan for o in ("on", "off")]
    assert res.plan.predicted_iteration_ms == min(p.predicted_iteration_ms for p in each)


def test_a_narrow_variant_the_clock_stopped_searches_again_below_the_broad_plan(monkeypatch):
    """Under a limit the narrow variant runs first; where the clock stops it (here: it reports itself
    incomplete, with a low bound), the broad one searches, then the narrow one again, below the broad
    one's plan, with the time left. Its second bound replaces the first where higher (the plan is then
    proven), else the first is kept."""
    import dataclasses

    import poseidon_plugin.search as search_pkg
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    real = search_pkg.search
    for stand_ins in ({1: 3.0}, {1: 3.0, 3: 2.0}):        # search number -> the bound it reports, incomplete
        seen = []

        def recording(cm_, opts, **kw):
            res = real(cm_, opts, **kw)
            seen.append((opts.schedules, opts.cutoff_ms, opts.time_limit_s, res.plan.predicted_iteration_ms))
            bound = stand_ins.get(len(seen))
            if bound is not None:           # the clock stopped it: incomplete, its bound far below its plan
                stats = dataclasses.replace(res.stats, complete=False, lower_bound_ms=bound, gap=1.0,
                                            unproven="the time limit")
                res = dataclasses.replace(res, stats=stats,
                                          plan=dataclasses.replace(res.plan, search_stats=stats.to_dict()))
            return res
        monkeypatch.setattr(search_pkg, "search", recording)
        res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=1e6),
                          clock=_TickClock())
        assert [x[0] for x in seen] == [("interleaved-1f1b",), ("1f1b", "interleaved-1f1b"), ("interleaved-1f1b",)]
        assert seen[0][1] is None and seen[1][1] == seen[0][3]
        assert seen[2][1] == min(seen[0][3], seen[1][3])         # below the best plan so far
        assert seen[0][2] < seen[1][2] and 0 < seen[2][2] < seen[1][2]
        stats = res.plan.search_stats
        if len(stand_ins) == 1:
            assert stats["complete"] is True and stats["gap"] == 0.0
        else:
            assert stats["complete"] is False and stats["lower_bound_ms"] == 3.0     # the first, higher bound


def test_without_a_limit_later_variants_search_below_the_best_plan_so_far(monkeypatch):
    """No time limit: the broad variant first, the narrow one with its plan as the cutoff; the result
    is the faster of the two variants' own optima."""
    import poseidon_plugin.search as search_pkg
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    real, seen = search_pkg.search, []

    def recording(cm_, opts, **kw):
        seen.append((opts.schedules, opts.cutoff_ms))
        res = real(cm_, opts, **kw)
        seen[-1] += (res.plan.predicted_iteration_ms,)
        return res
    monkeypatch.setattr(search_pkg, "search", recording)
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)))
    assert [s for s, *_ in seen] == [("1f1b", "interleaved-1f1b"), ("interleaved-1f1b",)]
    assert seen[0][1] is None and seen[1][1] == seen[0][2]
    monkeypatch.setattr(search_pkg, "search", real)
    each = [search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), p2p_overlap=o)).plan for o in ("on", "off")]
    assert res.plan.predicted_iteration_ms == min(p.predicted_iteration_ms for p in each)


def test_variants_past_the_deadline_still_return_a_plan(monkeypatch):
    """The setup ate the whole limit (every read of the clock is past the deadline): each variant gets
    the token limit and returns its greedy seed plan instead of failing."""
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    limits = _recording_search(monkeypatch)
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=5.0),
                      clock=_TickClock(jump=100.0))
    from poseidon_plugin.target import MIN_VARIANT_S
    assert limits == [MIN_VARIANT_S, MIN_VARIANT_S]
    stats = res.plan.search_stats
    assert stats["complete"] is False and stats["variants"] == 2
    assert res.plan.predicted_iteration_ms >= stats["lower_bound_ms"] > 0

def test_no_overlap_plan_renders_megatron_flag_and_launcher_rewrites_it():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    plan = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), p2p_overlap="off", schedules=("interleaved-1f1b",)),
                       SearchOptions(max_pipeline_stages=4)).plan
    assert plan.schedule == "interleaved-1f1b" and not plan.overlap_p2p_comm and plan.pp in (3, 4)
    flags = planned_flags(plan, "megatron", 128)
    assert "--no-overlap-p2p-communication" in flags
    with_overlap = dataclasses.replace(plan, overlap_p2p_comm=True)
    user = ["--lr", "1", "--no-overlap-p2p-communication", "--bf16"]
    assert rewrite(user, planned_flags(with_overlap, "megatron", 128))[:3] == ["--lr", "1", "--bf16"]
    assert "--no-overlap-p2p-communication" not in rewrite(user, planned_flags(with_overlap, "megatron", 128))
    assert flag_values(rewrite(user, flags))["--no-overlap-p2p-communication"] == ""
    with pytest.raises(PoseidonError, match="interleaved without p2p overlap only on >= 3 pipeline ranks, not pp = 2"):
        megatron_args(_pp2_without_overlap())


def _pp2_without_overlap() -> Plan:
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    plan = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), p2p_overlap="on"),
                       SearchOptions(max_pipeline_stages=2, min_pipeline_stages=2)).plan
    assert plan.schedule == "interleaved-1f1b"
    return dataclasses.replace(plan, overlap_p2p_comm=False)


def test_schema_1_plans_load_with_the_overlap_they_ran_with():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    for schedules in (("1f1b",), ("interleaved-1f1b",)):
        plan = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,), schedules=schedules, p2p_overlap="on")).plan
        doc = plan.to_dict()
        doc.pop("overlap_p2p_comm")
        doc.pop("priced_for")  # version 1 had neither
        doc["schema_version"] = 1
        # version 1 listed every rank and device (version 3 stores runs)
        doc["stages"] = [dict(d, ranks=list(s.ranks), devices=[list(x) for x in s.devices])
                         for d, s in zip(doc["stages"], plan.stages)]
        old = Plan.from_dict(doc)
        assert old.overlap_p2p_comm == (plan.schedule == "interleaved-1f1b")
        assert old.schema_version == PLAN_SCHEMA_VERSION and old.priced_for == ()
    doc = plan.to_dict()
    doc["schedule"], doc["virtual_stages"] = "1f1b", 1
    with pytest.raises(InputError, match="overlap_p2p_comm = true needs schedule 'interleaved-1f1b'"):
        Plan.from_dict(dict(doc, overlap_p2p_comm=True, layers=[16, 16],
                            stages=[dict(s, layers=[sum(s["layers"])], first_layers=[s["first_layers"][0]],
                                         forward_ms=[1.0], backward_ms=[1.0]) for s in doc["stages"]]))


@pytest.mark.parametrize("kwargs, match", [
    ({"flag_style": "mindspeed", "schedules": ("1f1b", "interleaved-1f1b")},
     "--schedules interleaved-1f1b cannot run with flag style mindspeed"),
    ({"comm_model": "megatron-overlap"}, "--comm-model 'megatron-overlap' is invalid"),
    ({"p2p_overlap": "maybe"}, "p2p overlap 'maybe' is invalid: choose one of auto, on, off"),
    ({"schedules": ("zb",)}, "--schedules: 'zb' is not a pipeline schedule"),
    ({"micro_batch_sizes": (0,)}, "micro-batch sizes \\(0,\\) are invalid"),
])
def test_target_errors_name_the_option(kwargs, match):
    with pytest.raises(InputError, match=match):
        TargetRuntime(**kwargs)


def test_cli_overlap_conflict_is_one_line(capsys):
    rc = main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--comm-model", "megatron-overlap",
               "--overlap-p2p-comm", "off", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--comm-model megatron-overlap conflicts with --overlap-p2p-comm off" in err
    assert len(err.strip().splitlines()) == 1


def test_table_prints_the_target(capsys):
    assert main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("runtime: Megatron-LM / megatron-core (layout flag); comm model megatron; schedules "
            "1f1b,interleaved-1f1b; p2p overlap auto (planned: on); micro-batch sizes 1,2,4; search exact") in out


def test_target_and_argv_modules_import_no_torch():
    import subprocess
    import sys

    code = "import sys; import poseidon_plugin.target, poseidon_plugin.argv; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_variant_out_of_time_without_a_plan_leaves_the_others_plan(monkeypatch):
    """One variant's time ran out before any plan: the other's plan is returned, flagged incomplete,
    and the lower bound covers the unfinished variant too."""
    import poseidon_plugin.search as search_pkg
    from poseidon_plugin.search.options import TimeLimitError
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    real, calls = search_pkg.search, []

    def second_runs_out(cm_, opts, **kw):
        calls.append(opts.comm_model)
        if len(calls) == 2:
            raise TimeLimitError(opts.time_limit_s, lower_bound_ms=1.0)
        return real(cm_, opts, **kw)
    monkeypatch.setattr(search_pkg, "search", second_runs_out)
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=300.0))
    stats = res.plan.search_stats
    assert len(calls) == 2 and stats["complete"] is False and stats["lower_bound_ms"] == 1.0
    assert stats["gap"] > 0  # complete and gap agree: the unfinished variant is named as the unproven part
    assert "the time limit stopped it before any plan" in stats["unproven"]
    assert "p2p overlap" in stats["unproven"] or "1f1b" in stats["unproven"]
    monkeypatch.setattr(search_pkg, "search", lambda cm_, opts, **kw: (_ for _ in ()).throw(
        TimeLimitError(opts.time_limit_s)))
    with pytest.raises(TimeLimitError, match="--time-limit 300 s ran out"):
        search_plan(cm, TargetRuntime(micro_batch_sizes=(1,)), SearchOptions(time_limit_s=300.0))


@pytest.mark.parametrize("args, multiple", [([], 1), (["--context-parallel-size", "2"], 2),
                                            (["--context-parallel-size", "2", "--expert-model-parallel-size", "3"], 2),
                                            (["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
                                             1)])
def test_context_parallelism_sets_the_dp_multiple(args, multiple):
    """A plan must be a whole number of the job's CP groups: its DP is a multiple of CP. The user's EP and
    expert TP set nothing: the plan's expert layout replaces them (``Plan.ep``)."""
    from poseidon_plugin.runtime.mindspeed import dp_multiple

    assert dp_multiple(args) == multiple


def test_planned_dp_is_a_multiple_of_the_target_s_dp_multiple():
    from poseidon_plugin.search.exhaustive import exhaustive_search

    cm = CostModel(load_cluster("paper-setting-2"), load_model("llama2-13b"), micro_batch_sizes=(1,))
    target = TargetRuntime(micro_batch_sizes=(1,), schedules=("1f1b",))
    free = search_plan(cm, target).plan
    constrained = search_plan(cm, dataclasses.replace(target, dp_multiple=8)).plan
    assert free.dp == 4 and constrained.dp == 8  # the constraint binds, and costs time
    assert constrained.predicted_iteration_ms > free.predicted_iteration_ms
    assert all(alt.dp % 8 == 0 for alt in constrained.alternatives)
    small = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"), micro_batch_sizes=(1,))
    opts = SearchOptions(schedules=("1f1b",), micro_batch_sizes=(1,), dp_multiple=8, max_pipeline_stages=2)
    exact = search_plan(small, TargetRuntime(micro_batch_sizes=(1,), schedules=("1f1b",), dp_multiple=8), opts).plan
    oracle = exhaustive_search(small, dataclasses.replace(opts, mode="exhaustive", comm_model="megatron")).plan
    assert oracle.dp % 8 == 0
    assert oracle.predicted_iteration_ms == pytest.approx(exact.predicted_iteration_ms, rel=1e-12)


def test_plan_as_run_prices_interleaved_as_megatron_runs_it():
    from poseidon_plugin.costmodel import Candidate
    from poseidon_plugin.target import MIN_PP_INTERLEAVED_WITHOUT_OVERLAP, plan_as_run

    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    types = cm.device_types

    def cand(pp, schedule="interleaved-1f1b"):
        v = 2 if schedule == "interleaved-1f1b" else 1
        per = cm.model.num_layers // (pp * v)
        layers = [per] * (pp * v)
        layers[-1] += cm.model.num_layers - per * pp * v
        return Candidate(tp=1, pp=pp, dp=1, mbs=1, stage_types=tuple(types[r % len(types)] for r in range(pp)),
                         layers=tuple(layers), schedule=schedule, virtual_stages=v)

    two = cand(2)  # Megatron-LM refuses interleaved without overlap below 3 stages: overlap, priced so
    plan = plan_as_run(cm, two)
    assert plan.overlap_p2p_comm is True
    assert plan.predicted_iteration_ms == pytest.approx(cm.iteration_ms(two, "megatron-overlap"))
    with pytest.raises(InputError, match="at least 3 pipeline stages"):
        plan_as_run(cm, two, TargetRuntime(p2p_overlap="off"))
    four = cand(4)
    assert four.pp >= MIN_PP_INTERLEAVED_WITHOUT_OVERLAP
    on, off = cm.iteration_ms(four, "megatron-overlap"), cm.iteration_ms(four, "megatron")
    auto = plan_as_run(cm, four)
    assert auto.predicted_iteration_ms == pytest.approx(min(on, off))
    assert auto.overlap_p2p_comm == (on <= off)
    pinned = plan_as_run(cm, four, TargetRuntime(p2p_overlap="off"))
    assert pinned.overlap_p2p_comm is False and pinned.predicted_iteration_ms == pytest.approx(off)
    plain = plan_as_run(cm, cand(2, "1f1b"))
    assert plain.overlap_p2p_comm is False
    assert plain.predicted_iteration_ms == pytest.approx(cm.iteration_ms(cand(2, "1f1b"), "megatron"))
