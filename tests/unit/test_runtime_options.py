"""``--poseidon-*`` options: extraction from anywhere on the command line, env fallback, validation, env round trip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import options
from poseidon_plugin.runtime.options import RuntimeOptions, parse, resolve, split_argv, to_env


@pytest.mark.parametrize(
    "argv, flags, rest",
    [
        (["--nproc-per-node", "4", "train.py", "--num-layers", "8"], {}, ["--nproc-per-node", "4", "train.py", "--num-layers", "8"]),
        (["--poseidon-dry-run", "train.py", "--lr", "1"], {"--poseidon-dry-run": "1"}, ["train.py", "--lr", "1"]),
        (["train.py", "--lr", "1", "--poseidon-emulate", "A2-2:2"], {"--poseidon-emulate": "A2-2:2"}, ["train.py", "--lr", "1"]),
        (["train.py", "--poseidon-timeout=30", "--x"], {"--poseidon-timeout": "30"}, ["train.py", "--x"]),
        (["--poseidon-keep=0", "t.py"], {"--poseidon-keep": "0"}, ["t.py"]),
        (["--poseidon-schedules", "1f1b", "--poseidon-keep", "t.py"], {"--poseidon-schedules": "1f1b", "--poseidon-keep": "1"}, ["t.py"]),
    ],
)
def test_split_takes_poseidon_options_anywhere(argv, flags, rest):
    assert split_argv(argv) == (flags, rest)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--poseidon-dryrun", "t.py"], r"unknown option --poseidon-dryrun; did you mean --poseidon-dry-run\?"),
        (["--poseidon-zzzzzz", "t.py"], r"unknown option --poseidon-zzzzzz; known: --poseidon-disable"),
        (["t.py", "--poseidon-plan"], r"--poseidon-plan needs a value, e.g. --poseidon-plan=FILE.json"),
        (["--poseidon-timeout", "--poseidon-keep", "t.py"], r"--poseidon-timeout needs a value"),
        (["--poseidon-keep", "t.py", "--poseidon-keep"], r"--poseidon-keep is given twice"),
    ],
)
def test_split_errors_name_the_flag(argv, match):
    with pytest.raises(PoseidonError, match=match):
        split_argv(argv)


def test_defaults():
    """Without flags or environment every option has its documented default (literal values, not the
    dataclass compared with itself)."""
    opts = resolve({}, {})
    assert (opts.disable, opts.dry_run, opts.plan, opts.save_plan, opts.cluster, opts.keep) == (
        False, False, None, None, None, False)
    assert (opts.profile_cache, opts.schedules, opts.micro_batch_sizes, opts.emulate, opts.emulate_model) == (
        "", (), (), None, None)
    assert (opts.search_mode, opts.flag_style, opts.search_time_limit, opts.search_workers) == (
        "exact", "auto", 30.0, 0)
    assert (opts.timeout, opts.profile_iters, opts.profile_warmup, opts.watch_iterations) == (600.0, 5, 2, 3)
    assert set(RuntimeOptions.__dataclass_fields__) == {
        "disable", "dry_run", "plan", "save_plan", "cluster", "profile_cache", "schedules", "keep", "search_mode",
        "search_time_limit", "search_workers", "emulate", "emulate_model", "micro_batch_sizes", "timeout", "profile_iters", "profile_warmup", "watch_iterations",
        "flag_style"}, "a new option needs its default checked here"


def test_command_line_wins_over_environment():
    opts = resolve({"--poseidon-timeout": "20"}, {"POSEIDON_TIMEOUT": "50", "POSEIDON_KEEP": "yes"})
    assert opts.timeout == 20.0
    assert opts.keep is True


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False), ("", False)])
def test_boolean_spellings(raw, value):
    assert resolve({}, {"POSEIDON_DRY_RUN": raw}).dry_run is value


def test_lists_are_parsed_deduplicated():
    opts = resolve({"--poseidon-micro-batch-sizes": "4,1, 2,1", "--poseidon-schedules": "1f1b, interleaved-1f1b,1f1b"}, {})
    assert opts.micro_batch_sizes == (1, 2, 4)
    assert opts.schedules == ("1f1b", "interleaved-1f1b")


@pytest.mark.parametrize(
    "cli, env, match",
    [
        ({"--poseidon-dry-run": "maybe"}, {}, r"--poseidon-dry-run='maybe' is not a boolean"),
        ({}, {"POSEIDON_KEEP": "2"}, r"POSEIDON_KEEP='2' is not a boolean"),
        ({"--poseidon-timeout": "soon"}, {}, r"--poseidon-timeout='soon' is not a number"),
        ({"--poseidon-timeout": "0.5"}, {}, r"--poseidon-timeout='0.5' is too small; it must be >= 1"),
        ({"--poseidon-timeout": "nan"}, {}, r"not a finite number"),
        ({}, {"POSEIDON_PROFILE_ITERS": "2.5"}, r"POSEIDON_PROFILE_ITERS='2.5' is not an integer"),
        ({"--poseidon-micro-batch-sizes": "1,0"}, {}, r"every value must be >= 1"),
        ({"--poseidon-flag-style": "deepspeed"}, {}, r"choose one of auto, megatron, mindspeed-layout, mindspeed, patch"),
        ({"--poseidon-plan": "/nonexistent/plan.json"}, {}, r"--poseidon-plan='/nonexistent/plan.json': no such file"),
        ({}, {"POSEIDON_CLUSTER": "/nonexistent.yaml"}, r"POSEIDON_CLUSTER='/nonexistent.yaml': no such file"),
    ],
)
def test_bad_values_name_flag_value_and_rule(cli, env, match):
    with pytest.raises(PoseidonError, match=match):
        resolve(cli, env)


@pytest.mark.parametrize("other", ["--poseidon-keep", "--poseidon-schedules", "--poseidon-micro-batch-sizes"])
def test_saved_plan_conflicts_with_search_options(tmp_path, other):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    value = {"--poseidon-keep": "1", "--poseidon-schedules": "1f1b", "--poseidon-micro-batch-sizes": "1"}[other]
    with pytest.raises(PoseidonError, match=rf"--poseidon-plan .* conflicts with {other}"):
        resolve({"--poseidon-plan": str(plan), other: value}, {})


def test_save_plan_must_differ_from_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with pytest.raises(PoseidonError, match="--poseidon-save-plan names the same file"):
        resolve({"--poseidon-plan": str(plan), "--poseidon-save-plan": str(plan)}, {})


@pytest.mark.parametrize(
    "cli",
    [
        {},
        {"--poseidon-dry-run": "1", "--poseidon-emulate": "A2-2:2,A2-4:2", "--poseidon-timeout": "42.5"},
        {"--poseidon-schedules": "1f1b", "--poseidon-micro-batch-sizes": "2,1", "--poseidon-keep": "1",
         "--poseidon-profile-cache": "cache/dir", "--poseidon-flag-style": "mindspeed", "--poseidon-watch-iterations": "0"},
    ],
)
def test_environment_round_trip(cli):
    """The launcher exports options as POSEIDON_* and every rank reads back the same options."""
    opts = resolve(cli, {})
    back = resolve({}, to_env(opts))
    for field in RuntimeOptions.__dataclass_fields__:
        if field in ("profile_cache", "save_plan"):
            continue
        assert getattr(back, field) == getattr(opts, field), field
    if opts.profile_cache:  # paths travel absolute: a rank may run elsewhere
        assert back.profile_cache == os.path.abspath(opts.profile_cache)


def test_parse_returns_rest_for_torchrun():
    opts, rest = parse(["--nnodes", "1", "--poseidon-dry-run", "x.py", "--a", "1"], {})
    assert opts.dry_run and rest == ["--nnodes", "1", "x.py", "--a", "1"]


def test_default_profile_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert options.default_profile_cache() == str(tmp_path / "poseidon" / "profiles")
    assert options.profile_cache_dir(RuntimeOptions()) == str(tmp_path / "poseidon" / "profiles")


def test_torch_free_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import poseidon_plugin.runtime.options, poseidon_plugin.runtime.job_flags, poseidon_plugin.emulation.harness\n"
        "import poseidon_plugin.patches.table\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_search_workers_flag_and_env():
    """--poseidon-search-workers N (0: the cores rank 0 may run on) by flag or env; below 0 is refused."""
    assert resolve({"--poseidon-search-workers": "4"}, {}).search_workers == 4
    assert resolve({}, {"POSEIDON_SEARCH_WORKERS": "1"}).search_workers == 1
    with pytest.raises(PoseidonError, match=r"--poseidon-search-workers='-1' is too small"):
        resolve({"--poseidon-search-workers": "-1"}, {})


def test_search_time_limit_default_flag_env_and_cap():
    """poseidon-run bounds its search by default (30 s), settable by flag or env, never past half the
    timeout (the ranks waiting for the plan would give up first)."""
    assert RuntimeOptions().search_time_limit == 30.0 and RuntimeOptions().search_budget_s == 30.0
    assert resolve({"--poseidon-search-time-limit": "5"}, {}).search_budget_s == 5.0
    assert resolve({}, {"POSEIDON_SEARCH_TIME_LIMIT": "7.5"}).search_budget_s == 7.5
    assert resolve({"--poseidon-search-time-limit": "500"}, {}).search_budget_s == 300.0      # timeout 600 / 2
    assert resolve({"--poseidon-timeout": "20"}, {}).search_budget_s == 10.0
    with pytest.raises(PoseidonError, match=r"--poseidon-search-time-limit='0' is too small"):
        resolve({"--poseidon-search-time-limit": "0"}, {})
    with pytest.raises(PoseidonError, match=r"POSEIDON_SEARCH_TIME_LIMIT='soon' is not a number"):
        resolve({}, {"POSEIDON_SEARCH_TIME_LIMIT": "soon"})
    # the launcher -> rank channel carries it
    opts = resolve({"--poseidon-search-time-limit": "12"}, {})
    assert resolve({}, to_env(opts)).search_budget_s == 12.0


def test_launch_budget_stops_the_search_and_the_table_says_not_proven():
    """The budget reaches the search as its time limit (an injected clock stands for the wall): the plan
    comes back on time, and the table rank 0 prints names the gap and the part not proven."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.plan import render_table
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.specs import load_cluster, load_model
    from poseidon_plugin.target import TargetRuntime, search_plan

    cm = CostModel(load_cluster("paper-setting-3"), load_model("llama-30b"), micro_batch_sizes=(1, 2))
    reads = iter(range(10 ** 9))
    budget = RuntimeOptions(search_time_limit=25.0).search_budget_s
    res = search_plan(cm, TargetRuntime(micro_batch_sizes=(1, 2)), SearchOptions(time_limit_s=budget),
                      clock=lambda: float(next(reads)))      # one second per read: 25 reads in all
    stats = res.plan.search_stats
    assert stats["complete"] is False and stats["gap"] > 0 and "time limit" in stats["unproven"]
    table = render_table(res.plan)
    assert "NOT proven optimal" in table and "gap " in table
