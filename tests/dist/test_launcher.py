"""``poseidon-run`` end to end on CPU/gloo: emulated heterogeneous training, placement, faults, torchrun parity.

Each launch is a real ``python -m poseidon_plugin.runtime.launcher`` (what the ``poseidon-run`` entry point
calls) with torchrun underneath, bounded by a subprocess timeout. Option mistakes are checked in-process.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.plan import Plan  # noqa: E402
from poseidon_plugin.runtime import launcher  # noqa: E402
from poseidon_plugin.runtime.job_flags import read_job  # noqa: E402
from poseidon_plugin.runtime.placement import planned_layers  # noqa: E402
from poseidon_plugin.runtime.job_spec import model_spec  # noqa: E402
from poseidon_plugin.runtime.watch import ranges  # noqa: E402
from poseidon_plugin.specs import load_profile, parse_cluster  # noqa: E402
from tests.dist.conftest import REFERENCE_HOST, free_port, module_launches  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = "scripts/pretrain_gpt.py"
JOB = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
       "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
       "--hidden-dropout", "0", "--attention-dropout", "0"]
LAUNCH_TIMEOUT_S = 240
CACHE_TEST = "test_search_trains_then_second_launch_reuses_cache"


def poseidon_run(args: list[str], tmp_path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the launcher; (exit code, interleaved stdout+stderr)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "xdg"),
                    PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    for key in [k for k in full_env if k.startswith("POSEIDON_")]:
        del full_env[key]
    full_env.update(REFERENCE_HOST)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.runtime.launcher", *args], cwd=REPO,
                          env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    return proc.returncode, proc.stdout


def emulated_plan(path, nodes: list[tuple[str, int]], *, stage_types, layers, tp=1, dp=1, schedule="1f1b",
                  virtual_stages=1, job_args: list[str] = JOB) -> str:
    """A plan file for an emulated cluster (nodes in --poseidon-emulate order), as `poseidon plan` writes one
    for the job ``job_args``."""
    cluster = parse_cluster({
        "name": "emulated", "device_types": sorted({t for t, _ in nodes}),
        "nodes": [{"device_type": t, "count": 1, "devices_per_node": n} for t, n in nodes], "links": "npu"})
    job = read_job(SCRIPT, job_args)
    model = model_spec(job, global_batch_size=4, name="pretrain_gpt-8l-h32")
    cand = Candidate(tp=tp, pp=len(stage_types), dp=dp, mbs=1, stage_types=tuple(stage_types),
                     layers=tuple(layers), schedule=schedule, virtual_stages=virtual_stages)
    CostModel(cluster, model).make_plan(cand).save(path)
    return str(path)


def losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"^iteration \d+/\d+ \| lm loss ([-+\w.]+)", output, re.M)]


# --- mistakes caught before any process starts ---------------------------------------------------


@pytest.fixture
def files(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("name: c\ndevice_types: [A2-2]\nnodes: [{device_type: A2-2, count: 1, devices_per_node: 2}]\n"
                       "links: npu\n")
    bad_plan = tmp_path / "bad_plan.json"
    bad_plan.write_text('{"format": "poseidon-plan", "tp": 1}')
    big_plan = emulated_plan(tmp_path / "big.json", [("A2-2", 4)], stage_types=["A2-2"] * 4, layers=[2, 2, 2, 2])
    return {"cluster": str(cluster), "bad_plan": str(bad_plan), "big_plan": big_plan}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--poseidon-dryrun", SCRIPT, *JOB], r"unknown option --poseidon-dryrun; did you mean --poseidon-dry-run\?"),
        ([SCRIPT, *JOB, "--poseidon-timeout", "0"], r"--poseidon-timeout='0' is too small"),
        (["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:2"],
         r"--poseidon-emulate A2-2:2 declares 2 devices but the job has 4 ranks"),
        ([SCRIPT, *JOB, "--poseidon-emulate", "H100:1"], r"unknown device type 'H100'"),
        ([SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1", "--poseidon-cluster", "{cluster}"],
         r"--poseidon-emulate conflicts with --poseidon-cluster"),
        (["--nproc-per-node", "1", SCRIPT, *JOB, "--poseidon-cluster", "{cluster}"],
         r"declares 2 devices but the launch starts 1 ranks"),
        ([SCRIPT, "--lr", "0.1"], r"scripts/pretrain_gpt.py is not Megatron-shaped: its arguments lack --num-layers"),
        (["no/such/script.py", *JOB], r"training script 'no/such/script.py' does not exist"),
        (["--no-python", SCRIPT, *JOB], r"--no-python cannot be used with poseidon-run"),
        ([SCRIPT, *JOB, "--poseidon-schedules", "gpipe"], r"Megatron cannot run 'gpipe'"),
        ([SCRIPT, *JOB, "--poseidon-plan", "{bad_plan}"], r"bad_plan.json: missing required field"),
        (["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-plan", "{big_plan}"],
         r"needs 4 devices \(tp 1 x dp 1 x pp 4\) but the launch starts 2 ranks"),
    ],
)
def test_option_mistakes_exit_2_with_one_line(argv, match, files, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for key in [k for k in os.environ if k.startswith("POSEIDON_")]:
        monkeypatch.delenv(key)
    code = launcher.main([a.format(**files) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("poseidon-run: error: "), err
    assert re.search(match, err[0]), err[0]


def test_environment_variables_are_options_too(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("POSEIDON_EMULATE", "A2-2:3")
    assert launcher.main(["--nproc-per-node", "2", SCRIPT, *JOB]) == 2
    assert "POSEIDON_EMULATE=A2-2:3 declares 3 devices but the job has 2 ranks" in capsys.readouterr().err


# --- launches -------------------------------------------------------------------------------------


def test_disable_is_plain_torchrun(tmp_path):
    code, out = poseidon_run(["--nproc-per-node", "1", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:2"], tmp_path,
                             env={"POSEIDON_DISABLE": "1"})
    assert code == 0, out[-4000:]
    assert len(losses(out)) == 3
    # Poseidon speaks only through lines that start with its prefix; library warnings may quote file paths,
    # and the checkout may live in a folder named poseidon/, so look at line starts, not at the whole text.
    ours = [line for line in out.splitlines() if re.match(r"\s*(\[[^]]*\]:?\s*)?poseidon(\[rank \d+\])?:", line)]
    assert not ours, ours[:5]


def test_emulated_training_applies_saved_plan(tmp_path):
    """Stage 0 on an A2-4: launcher rank 2 must become global rank 0; every rank builds exactly its layers."""
    plan = emulated_plan(tmp_path / "plan.json", [("A2-2", 2), ("A2-4", 2)],
                         stage_types=["A2-4", "A2-2", "A2-2", "A2-4"], layers=[1, 3, 3, 1])
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:2,A2-4:2",
                              "--poseidon-plan", plan], tmp_path)
    assert code == 0, out[-6000:]
    found = losses(out)
    assert len(found) == 3 and all(math.isfinite(x) for x in found), out[-3000:]
    placed = dict(re.findall(r"poseidon\[rank (\d)\]: now global rank (\d): pipeline stage \d on", out))
    assert placed == {"2": "0", "0": "1", "1": "2", "3": "3"}, out[-3000:]
    built = re.findall(r"stage (\d) on (A2-\d) built layers ([\d,-]+) as planned", out)
    assert sorted(built) == [("0", "A2-4", "1"), ("1", "A2-2", "2-4"), ("2", "A2-2", "5-7"), ("3", "A2-4", "8")]
    # the saved plan was priced with the analytic profile of real NPUs: no false comparison on CPU
    assert re.search(r"poseidon: iteration 1: measured [\d.]+ ms \(no prediction for this run: the plan was "
                     r"priced with the analytic profile of real A2-4/A2-2 devices, and this run emulates them on "
                     r"CPU\)", out), out[-3000:]
    assert re.search(r"poseidon: watch: median of iteration 2: measured [\d.]+ ms \(step start to next step start: "
                     r"schedule, gradient sync, optimizer step\); not compared with the plan's [\d,.]+ ms", out)
    assert "off the prediction" not in out
    assert "--pipeline-model-parallel-layout 'Et|t*3|t*3|tL'" in out
    assert re.search(r"poseidon: overhead: Poseidon [\d.]+ s \(inventory [\d.]+ s .*apply [\d.]+ s \| placement [\d.]+ s"
                     r" \| hand-over [\d.]+ s\); start-up [\d.]+ s before it \(imports and process group: a plain "
                     r"torchrun run pays them too\)$", out, re.M), out[-3000:]


def _cache_launches(tmp_path) -> tuple[str, str, tuple[int, str], tuple[int, str]]:
    """The cache test's two launches, one after another, each on a rendezvous port of its own (they run beside
    the module's other launches): ``(profile cache, saved plan, searched launch, dry run reusing the cache)``."""
    cache, saved = str(tmp_path / "profiles"), str(tmp_path / "plan.json")
    first = poseidon_run(["--nproc-per-node", "4", "--master-port", str(free_port()), SCRIPT, *JOB,
                          "--poseidon-emulate", "A2-2:2,A2-4:2", "--poseidon-profile-cache", cache,
                          "--poseidon-micro-batch-sizes", "1,2", "--poseidon-save-plan", saved], tmp_path)
    if first[0] != 0:
        return cache, saved, first, (-1, "")
    # Same layer on the same device types: a smaller launch finds all its (TP 1) entries in the cache.
    again = poseidon_run(["--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT, *JOB,
                          "--poseidon-emulate", "A2-2:1,A2-4:1", "--poseidon-profile-cache", cache,
                          "--poseidon-micro-batch-sizes", "1,2", "--poseidon-dry-run"], tmp_path)
    return cache, saved, first, again


@pytest.fixture(scope="module", autouse=True)
def cache_launches(request, tmp_path_factory):
    """The cache test's launches, started with the module's first test: they run beside the module's other
    launches (what the test checks is read from their output and files, no timing)."""
    with module_launches(request, tmp_path_factory, {CACHE_TEST: _cache_launches}) as launches:
        yield launches


def test_search_trains_then_second_launch_reuses_cache(cache_launches):
    """The real flow: probe, profile, search on rank 0, apply, train; every rank does what the plan says."""
    cache, saved, (code, out), (again_code, again) = cache_launches[CACHE_TEST].result()
    assert code == 0, out[-6000:]
    found = losses(out)
    assert len(found) == 3 and all(math.isfinite(x) for x in found), out[-3000:]
    configurations = re.search(r"profile: cache: reused 0 of (\d+) configurations", out)
    assert configurations and int(configurations.group(1)) == 2 * 2 * 2  # types x TP {1, 2} x mbs {1, 2}
    written = re.search(r"profile: cache: .* written to (\S+/pretrain_gpt-8l-h32-[0-9a-f]{12}-profile\.json)", out)
    assert written and os.path.dirname(written.group(1)) == cache, out[-3000:]
    profile = load_profile(written.group(1))
    assert profile.source == "measured" and len(profile.entries) == 8
    plan = Plan.load(saved)
    built = re.findall(r"stage (\d+) on (\S+) built layers ([\d,-]+) as planned", out)
    assert sorted(built) == sorted(
        (str(s.index), s.device_type, ranges(planned_layers(plan, s.index)))
        for s in plan.stages for _ in range(s.tp * s.dp))
    placed = re.findall(r"poseidon\[rank (\d)\]: now global rank (\d+): pipeline stage (\d+) on (\S+)", out)
    emulated = {"0": "A2-2", "1": "A2-2", "2": "A2-4", "3": "A2-4"}
    assert len(placed) == plan.world_size
    for launcher_rank, global_rank, stage, device_type in placed:  # each stage runs on its planned type
        assert plan.stages[int(stage)].device_type == device_type == emulated[launcher_rank]
        assert int(global_rank) in plan.stages[int(stage)].ranks
    assert len(re.findall(r"device is not used by the plan; waiting for the job to end", out)) == 4 - plan.world_size
    assert re.search(r"poseidon: iteration 1: measured [\d.]+ ms, predicted [\d.]+ ms", out)
    assert re.search(r"poseidon: overhead: .*probing [\d.]+ s \| profiling [\d.]+ s .*\| search [\d.]+ s", out)

    # Same layer on the same device types: a smaller launch found all its (TP 1) entries in the cache.
    assert again_code == 0, again[-6000:]
    assert "profile: cache: reused 4 of 4 configurations" in again
    assert "dry run: stopping before training" in again and "poseidon: command: scripts/pretrain_gpt.py" in again
    assert losses(again) == []


# --- faults: every rank ends with one clear line, the job exits non-zero, nothing hangs -------------


def _error_lines(out: str) -> dict[str, str]:
    return dict(re.findall(r"^poseidon\[rank (\d)\]: error: (.*)$", out, re.M))


def test_rank_failing_in_profiling_stops_every_rank(tmp_path):
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1,A2-4:1"],
                             tmp_path, env={"POSEIDON_INJECT_FAULT": "profiling:1"})
    assert code == 1, out[-4000:]
    errors = _error_lines(out)
    assert set(errors) == {"0", "1"}, out[-4000:]
    for message in errors.values():
        assert re.fullmatch(r"profiling failed on rank 1: RuntimeError: injected fault in profiling "
                            r"\(POSEIDON_INJECT_FAULT\) \(at poseidon_plugin/runtime/collectives\.py:\d+ in _maybe_inject\)",
                            message), message
    # both exit with code 1 within one torchrun poll, so either may be seen first
    assert re.search(r"poseidon-run: rank [01] \(pid \d+ on \S+\) exited with code 1 first; then rank\(s\) \[[01]\]", out)


def test_rank_dying_in_profiling_does_not_hang_the_others(tmp_path):
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1,A2-4:1",
                              "--poseidon-timeout", "60"], tmp_path, env={"POSEIDON_INJECT_FAULT": "profiling:1:exit"})
    assert code != 0
    assert "poseidon[rank 1]: injected hard exit in profiling" in out
    assert re.search(r"poseidon\[rank 0\]: error: (profiling: lost contact with|stopped by the launcher: lost) "
                     r"rank 1 \(pid \d+ on \S+\): its process is gone", out), out[-4000:]


def test_saved_plan_that_does_not_match_the_world(tmp_path):
    """Declared devices are known before launch: the mismatch costs one line and no rank start-up."""
    plan = emulated_plan(tmp_path / "plan.json", [("A2-4", 1), ("A2-2", 1)], stage_types=["A2-4", "A2-2"],
                         layers=[4, 4])
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1,A2-4:1",
                              "--poseidon-plan", plan], tmp_path)
    assert code == 2, out[-4000:]
    assert out.strip() == (f"poseidon-run: error: --poseidon-plan {plan} does not match this job: stage 0 runs on "
                           f"A2-4 but device (node 0, local 0) here is a A2-2; re-plan (drop --poseidon-plan) or "
                           f"fix the plan file"), out[-4000:]


def test_no_plan_fits_memory(tmp_path):
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("name: tiny\ndevice_types:\n  - {name: small, memory_gb: 0.000001, peak_tflops: 100}\n"
                       "nodes: [{device_type: small, count: 1, devices_per_node: 2}]\nlinks: npu\n"
                       "constants: {memory_reserve_gb: 0}\n")
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-cluster", str(cluster)], tmp_path)
    assert code == 2, out[-4000:]
    errors = _error_lines(out)
    assert set(errors) == {"0", "1"} and len(set(errors.values())) == 1, out[-4000:]
    assert re.search(r"search failed on rank 0: .*memory", errors["0"]), errors["0"]
