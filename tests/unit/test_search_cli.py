"""Search options validation, error messages, and ``poseidon plan`` (exit codes, JSON, trace)."""

import json
import subprocess
import sys

import pytest

from poseidon_plugin.cli import main
from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.errors import InputError, NoFeasiblePlanError
from poseidon_plugin.plan import Plan
from poseidon_plugin.search import SearchOptions, search
from poseidon_plugin.specs import load_cluster, load_model
from poseidon_plugin.specs.cluster import parse_cluster
from poseidon_plugin.specs.model import parse_model


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "fast"}, r"mode = 'fast' is invalid: must be one of default, exact, exhaustive"),
    ({"schedules": ("1f1b", "zb-v")}, r"--schedules: 'zb-v' is not a pipeline schedule; allowed: gpipe"),
    ({"schedules": ()}, r"--schedules \(\) is invalid: give at least one of"),
    ({"schedules": ("1f1b", "1f1b")}, r"lists a schedule twice"),
    ({"virtual_stages": (1,)}, r"--virtual-stages = \(1,\) is invalid: 1 is not an integer >= 2"),
    ({"micro_batch_sizes": (0,)}, r"--micro-batch-size = \(0,\) is invalid"),
    ({"tp_degrees": (3,)}, r"--tp 3 is invalid: TP degrees are powers of two"),
    ({"top_k": 0}, r"--top-k = \(0,\) is invalid: 0 is not an integer >= 1"),
    ({"warmup_samples": -1}, r"--warmup-samples -1 is invalid: must be an integer >= 0"),
    ({"time_limit_s": 0}, r"--time-limit 0 is invalid: must be a number of seconds > 0"),
    ({"max_pipeline_stages": 0}, r"--max-pp = \(0,\) is invalid"),
    ({"workers": 0}, r"--workers 0 is invalid: must be an integer >= 1"),
])
def test_option_validation_messages(kwargs, match):
    with pytest.raises(InputError, match=match):
        SearchOptions(**kwargs)


def test_the_warm_up_is_the_default_modes_unless_asked():
    """500 random plans in default mode, none with --exact (its seeds give the first plan) and in
    exhaustive mode; an explicit --warmup-samples holds in every mode, and is what the search reports."""
    assert SearchOptions().warmup_count == 500
    assert SearchOptions(mode="exact").warmup_count == 0
    assert SearchOptions(mode="exhaustive").warmup_count == 0
    assert SearchOptions(mode="exact", warmup_samples=7).warmup_count == 7
    assert SearchOptions(mode="default", warmup_samples=0).warmup_count == 0
    cm = tiny_cost_model()
    assert search(cm, SearchOptions(mode="exact")).stats.warmup_samples == 0
    assert search(cm, SearchOptions(mode="exact", warmup_samples=5)).stats.warmup_samples == 5


def tiny_cost_model(**model):
    cluster = parse_cluster({"name": "two", "device_types": ["A2-2", "A2-4"], "links": "npu",
                             "nodes": [{"device_type": "A2-2", "count": 1, "devices_per_node": 2},
                                       {"device_type": "A2-4", "count": 1, "devices_per_node": 2}]})
    doc = {"name": "tiny", "num_layers": 6, "hidden_size": 2048, "ffn_hidden_size": 8192,
           "num_attention_heads": 16, "vocab_size": 32000, "seq_length": 2048,
           "global_batch_size": 8, **model}
    return CostModel(cluster, parse_model(doc), micro_batch_sizes=(1, 2))


def test_unprofiled_tp_and_mbs_are_named():
    cm = tiny_cost_model()
    with pytest.raises(InputError, match=r"--tp 4 is not possible here: .* allow TP degrees 1, 2"):
        search(cm, SearchOptions(tp_degrees=(4,)))
    with pytest.raises(InputError, match=r"--micro-batch-size 8 is not covered by the profile"):
        search(cm, SearchOptions(micro_batch_sizes=(8,)))


def test_no_plan_fits_memory_names_the_constraint():
    cm = tiny_cost_model(hidden_size=32768, ffn_hidden_size=131072, num_attention_heads=64,
                         distributed_optimizer=False)
    with pytest.raises(NoFeasiblePlanError, match=r"no plan fits memory: the smallest stage needs "
                                                  r"[0-9.]+ GB on A2-\d \(\d+ GB, [0-9.]+ GB usable\); "
                                                  r".*enable the distributed optimizer"):
        search(cm, SearchOptions())


def test_exhaustive_refuses_large_problems():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    with pytest.raises(InputError, match=r"--exhaustive would simulate [0-9,]+ plans, more than the "
                                         r"limit of 2,000,000; .*use --exact"):
        search(cm, SearchOptions(mode="exhaustive"))


def test_search_result_is_a_plan_with_stats():
    cm = tiny_cost_model()
    res = search(cm, SearchOptions(top_k=3))
    plan = res.plan
    assert isinstance(plan, Plan) and Plan.from_json(plan.to_json()) == plan
    assert sum(plan.layers) == 6 and plan.world_size <= 4
    assert len(res.alternatives) <= 2 and plan.alternatives == res.alternatives
    assert all(a.predicted_iteration_ms >= plan.predicted_iteration_ms for a in res.alternatives)
    stats = plan.search_stats
    assert stats["complete"] and stats["mode"] == "default"
    assert stats["simulator_calls"] >= 1 and set(stats["pruned"]) == {
        "shape_bound", "structure_bound", "stage_bound", "path_bound", "memory", "ridge", "order"}


def test_cli_plan_table_and_json(tmp_path, capsys):
    rc = main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b",
               "--schedules", "1f1b", "--micro-batch-size", "1", "--tp", "2,4", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Poseidon plan: llama3-8b on paper-setting-1" in out and "--num-layer-list" in out
    trace = tmp_path / "t.json"
    plan_file = tmp_path / "plan.json"
    rc = main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--schedules", "1f1b",
               "--micro-batch-size", "1", "--tp", "4", "--json", "--trace", str(trace),
               "--output", str(plan_file), "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    plan = Plan.from_dict(doc)
    assert plan.tp == 4 and Plan.load(plan_file) == plan
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e.get("tid") for e in events if e.get("ph") == "X"} == set(range(plan.pp))


@pytest.mark.parametrize("argv,match", [
    (["--schedules", "bogus"], "--schedules: 'bogus' is not a pipeline schedule"),
    (["--global-batch-size", "0"], "--global-batch-size 0 is invalid"),
    (["--tp", "3"], "--tp 3 is invalid: TP degrees are powers of two"),
    (["--model", "nope"], "--model 'nope' is neither a file nor a preset"),
    (["--exhaustive"], "--exhaustive would simulate"),
])
def test_cli_user_errors_exit_2_with_one_line(argv, match, capsys):
    base = {"--cluster": "paper-setting-1", "--model": "llama3-8b"}
    for flag in list(base):
        if flag in argv:
            base.pop(flag)
    args = ["plan", *[x for kv in base.items() for x in kv], *argv, "--no-progress"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_cli_refuses_a_bad_worker_count(value, capsys):
    """``--workers`` takes N >= 1 or auto: anything else is argparse's usage error naming the flag, exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--workers", value, "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"argument --workers: {value!r} is not a number of processes: give N >= 1, or auto" in err


def test_cli_workers_give_the_same_plan(capsys):
    """``--workers 1``, ``2`` and ``auto`` (the default): the same plan document but for the search's statistics."""
    docs = []
    for workers in ("1", "2", "auto"):
        assert main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--exact", "--json",
                     "--no-progress", "--workers", workers]) == 0
        doc = json.loads(capsys.readouterr().out)
        doc.pop("search_stats")
        docs.append(doc)
    assert docs[0] == docs[1] == docs[2]


def test_planning_core_imports_no_torch():
    code = ("import sys; import poseidon_plugin.search, poseidon_plugin.search.cli, "
            "poseidon_plugin.search.exhaustive; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_min_and_max_pp_pin_the_pipeline_size():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    for pp in (3, 4):
        result = search(cm, SearchOptions(min_pipeline_stages=pp, max_pipeline_stages=pp, top_k=3))
        assert result.plan.pp == pp
        assert all(alt.pp == pp for alt in result.alternatives)


def test_min_pp_above_max_pp_is_rejected():
    from poseidon_plugin.search.options import validate_options

    with pytest.raises(InputError, match="--min-pp 4 is larger than --max-pp 2"):
        validate_options(SearchOptions(min_pipeline_stages=4, max_pipeline_stages=2))


def test_cli_time_limit_counts_the_loading_and_still_returns_a_plan(capsys):
    """`poseidon plan --time-limit T` counts from the command's start: a limit the loading alone uses
    up leaves the search a sliver, and the command still prints a plan (not an invalid-limit error)."""
    rc = main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--schedules", "1f1b",
               "--time-limit", "1e-7", "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(captured.out)
    assert Plan.from_dict(doc).predicted_iteration_ms > 0
    assert doc["search_stats"]["complete"] is False


def test_console_time_limit_counts_from_the_process_start():
    """Run as the console script (``main()`` reading ``sys.argv``), ``--time-limit`` counts from the
    process's start: its age is the machine's uptime less the process's start time (field 22 of
    ``/proc/self/stat``, in clock ticks after boot), read from the files' contents; a command name with
    spaces and parentheses does not shift the fields; unreadable or implausible contents give 0."""
    from poseidon_plugin.cli import process_age_s

    fields = " ".join(["S"] + ["0"] * 18 + ["12000"] + ["0"] * 10)  # starttime: 12,000 ticks = 120 s
    stat = f"4242 (python (my job) x) {fields}".encode()
    assert process_age_s(stat, b"123.25 9999.0", 100) == pytest.approx(3.25)
    assert process_age_s(stat, b"119.0 1.0", 100) == 0.0    # started after "now": implausible
    assert process_age_s(stat, b"500.0 1.0", 100) == 0.0    # older than a minute: not a start-up
    assert process_age_s(b"garbage", b"1.0", 100) == 0.0
    age = process_age_s()  # this machine's own /proc, where it exists
    assert isinstance(age, float) and age >= 0.0


def test_console_main_takes_the_process_age_off_the_time_limit(monkeypatch, capsys):
    """``main()`` without argv takes the process's age off ``--time-limit``: with an age past the limit
    the search gets only a sliver (incomplete, still a plan); with an explicit argv it is not read. The
    commands' clock is frozen, so the limits the search receives are exact (no wall-clock window)."""
    import types

    import poseidon_plugin.cli as cli
    import poseidon_plugin.search.cli as search_cli
    import poseidon_plugin.target as target

    frozen = types.SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(cli, "time", frozen)
    monkeypatch.setattr(search_cli, "time", frozen)
    limits = []
    real_search = target.search_plan

    def recording_search(cm, runtime, options):
        limits.append(options.time_limit_s)
        return real_search(cm, runtime, options)

    monkeypatch.setattr(target, "search_plan", recording_search)
    argv = ["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--schedules", "1f1b",
            "--time-limit", "20", "--json", "--no-progress"]
    monkeypatch.setattr(cli, "process_age_s", lambda: 25.0)
    monkeypatch.setattr(sys, "argv", ["poseidon", *argv])
    assert cli.main() == 0
    assert json.loads(capsys.readouterr().out)["search_stats"]["complete"] is False
    assert cli.main(argv) == 0
    assert Plan.from_dict(json.loads(capsys.readouterr().out)).predicted_iteration_ms > 0
    assert limits == [1e-3, 20.0]  # 20 s less an age of 25 s: the 1 ms sliver; explicit argv: all 20 s


@pytest.mark.parametrize("argv", [["--no-progress"], []])
def test_a_search_without_a_bar_gets_no_progress_calls(monkeypatch, argv):
    """With ``--no-progress``, or stderr not a terminal (as under pytest), the search gets no progress
    callable: each call would compute the gap's lower bound for a bar nobody sees."""
    import poseidon_plugin.target as target

    seen = []
    real = target.search_plan

    def spy(cost_model, runtime, options=None, **kwargs):
        seen.append(options.progress)
        return real(cost_model, runtime, options, **kwargs)

    monkeypatch.setattr(target, "search_plan", spy)
    assert main(["plan", "--cluster", "paper-setting-1", "--model", "llama3-8b", "--json", *argv]) == 0
    assert seen == [None]
