"""``poseidon-run`` end to end on megatron-core 0.12.2 (MindSpeed-LLM's core, ``.cache/mcore012``), CPU/gloo.

Core 0.12 has no layout flag, so ``auto`` picks the ``patch`` style here (no MindSpeed installed) and the
split reaches megatron-core through the layer-assignment table; ``--poseidon-flag-style mindspeed`` renders
MindSpeed-LLM's ``--num-layer-list`` (``scripts/pretrain_gpt.py`` takes it as MindSpeed-LLM does) and, with
no MindSpeed-LLM to import, says once that it skips the adaptor steps; with a recording test double of
MindSpeed-LLM's adaptor on the path, ``auto`` picks that style and the adaptor sees the start-up order
(imported before megatron on the user's argv, repatched on the planned argv before Poseidon's tables).
Each launch is a real ``python -m poseidon_plugin.runtime.launcher`` with torchrun underneath,
``PYTHONPATH`` putting 0.12.2 first (as ``test_patches.py`` does), bounded by a subprocess timeout. Saved plans make the uneven splits
deterministic; the watch checks every rank's built layers against the plan.
"""

from __future__ import annotations

import json
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
from poseidon_plugin.runtime.apply import planned_flags  # noqa: E402
from poseidon_plugin.runtime.job_flags import read_job  # noqa: E402
from poseidon_plugin.runtime.placement import planned_layers  # noqa: E402
from poseidon_plugin.runtime.job_spec import model_spec  # noqa: E402
from poseidon_plugin.runtime.watch import ranges  # noqa: E402
from poseidon_plugin.specs import parse_cluster  # noqa: E402
from tests.dist.conftest import REFERENCE_HOST, free_port, in_background, selected  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE012 = os.path.join(REPO, ".cache", "mcore012")
SCRIPT = "scripts/pretrain_gpt.py"
JOB = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
       "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
       "--hidden-dropout", "0", "--attention-dropout", "0"]
EMULATE = [("A2-2", 2), ("A2-4", 2)]
LAUNCH_TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(not os.path.isdir(MCORE012), reason=(
    "megatron-core 0.12.2 (MindSpeed-LLM's core, no layout flag) not provided; install it with: pip install "
    "--no-deps --target .cache/mcore012 megatron-core==0.12.2"))


def poseidon_run(args: list[str], tmp_path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The launcher on core 0.12.2; (exit code, stdout+stderr)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "xdg"),
                PYTHONPATH=os.pathsep.join([MCORE012, REPO]))
    for key in [k for k in full if k.startswith("POSEIDON_")]:
        del full[key]
    env = {**full, **REFERENCE_HOST, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "poseidon_plugin.runtime.launcher", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LAUNCH_TIMEOUT_S)
    return proc.returncode, proc.stdout


def saved_plan(path, *, stage_types, layers, dp=1) -> Plan:
    """A plan for the emulated cluster, saved as ``poseidon plan`` writes one."""
    cluster = parse_cluster({"name": "emulated", "device_types": sorted({t for t, _ in EMULATE}),
                             "nodes": [{"device_type": t, "count": 1, "devices_per_node": n} for t, n in EMULATE],
                             "links": "npu"})
    model = model_spec(read_job(SCRIPT, JOB), global_batch_size=4, name="pretrain_gpt-8l-h32")
    cand = Candidate(tp=1, pp=len(stage_types), dp=dp, mbs=1, stage_types=tuple(stage_types), layers=tuple(layers),
                     schedule="1f1b", virtual_stages=1)
    plan = CostModel(cluster, model).make_plan(cand)
    plan.save(str(path))
    return plan


def command(out: str) -> str:
    """The training command line rank 0 logged (the plan table above it shows every style's flags)."""
    found = re.search(r"^poseidon: command: (.*)$", out, re.M)
    assert found, out[-3000:]
    return found.group(1)


def check_trained_as_planned(code: int, out: str, plan: Plan) -> None:
    assert code == 0, out[-6000:]
    found = [float(x) for x in re.findall(r"^iteration \d+/\d+ \| lm loss ([-+\w.]+)", out, re.M)]
    assert len(found) >= 3 and all(math.isfinite(x) for x in found), out[-3000:]
    built = re.findall(r"stage (\d+) on (\S+) built layers ([\d,-]+) as planned", out)
    assert sorted(built) == sorted((str(s.index), s.device_type, ranges(planned_layers(plan, s.index)))
                                   for s in plan.stages for _ in range(s.tp * s.dp)), out[-3000:]
    assert "is not patched" not in out and "Traceback" not in out


def test_auto_style_trains_an_uneven_split_on_core_012(tmp_path):
    """No layout flag and no MindSpeed: auto = patch; 1/3/3/1 over four emulated devices, slow and fast."""
    plan = saved_plan(tmp_path / "plan.json", stage_types=["A2-4", "A2-2", "A2-2", "A2-4"], layers=[1, 3, 3, 1])
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:2,A2-4:2",
                              "--poseidon-plan", str(tmp_path / "plan.json")], tmp_path)
    check_trained_as_planned(code, out, plan)
    line = command(out)
    assert "--pipeline-model-parallel-layout" not in line and "--num-layer-list" not in line
    assert "--pipeline-model-parallel-size 4" in line


def test_mindspeed_style_renders_num_layer_list_and_trains_on_core_012(tmp_path):
    """5/3 over two stages, two replicas each; the flag MindSpeed-LLM reads is on the command line."""
    plan = saved_plan(tmp_path / "plan.json", stage_types=["A2-4", "A2-2"], layers=[5, 3], dp=2)
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:2,A2-4:2",
                              "--poseidon-plan", str(tmp_path / "plan.json"), "--poseidon-flag-style", "mindspeed",
                              "--pipeline-num-transformer-layers", "[[4],[4]]"], tmp_path)
    check_trained_as_planned(code, out, plan)
    line = command(out)
    assert "--num-layer-list 5,3" in line and "--pipeline-num-transformer-layers" not in line
    assert "poseidon: flag style mindspeed: dropped --pipeline-num-transformer-layers" in out
    assert len(re.findall(r"MindSpeed-LLM \(mindspeed_llm\) is not installed; skipping its adaptor", out)) == 1


def test_mindspeed_style_refuses_noop_layers_before_starting(tmp_path):
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1,A2-4:1",
                              "--poseidon-flag-style", "mindspeed", "--noop-layers", "7"], tmp_path)
    assert code == 2
    assert re.search(r"^poseidon-run: error: --noop-layers '7' conflicts with Poseidon's split: .*drop --noop-layers$",
                     out, re.M), out[-2000:]


_RECORDING_ADAPTOR = '''
"""Test double of mindspeed_llm.tasks.megatron_adaptor_v2: records what poseidon-run does, and when."""
import json, os, sys

def _record(event, **data):
    with open(os.environ["ADAPTOR_LOG"] + f".{os.environ.get('RANK', '0')}", "a") as f:
        f.write(json.dumps({"event": event, **data}) + "\\n")

def _layer_table_applied():
    module = sys.modules.get("megatron.core.transformer.transformer_block")
    return module is not None and hasattr(module.get_num_layers_to_build, "__poseidon_patch__")

_record("import", megatron=sorted(m for m in sys.modules if m.split(".")[0] == "megatron"), argv=sys.argv[1:])

def repatch(config):
    _record("repatch", config=config, argv=sys.argv[1:], ours_applied=_layer_table_applied())
'''


ADAPTOR_TEST = "test_profiling_search_and_start_up_order_with_an_adaptor_on_core_012"


def _adaptor_launch(tmp_path) -> tuple[int, str]:
    """The adaptor test's launch (on a --master-port of its own: it runs beside the module's other launches)."""
    package = tmp_path / "adaptor" / "mindspeed_llm"
    (package / "tasks").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tasks" / "__init__.py").write_text("")
    (package / "tasks" / "megatron_adaptor_v2.py").write_text(_RECORDING_ADAPTOR)
    env = {"PYTHONPATH": os.pathsep.join([MCORE012, REPO, str(tmp_path / "adaptor")]),
           "ADAPTOR_LOG": str(tmp_path / "adaptor.log")}
    return poseidon_run(["--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT, *JOB,
                         "--poseidon-emulate", "A2-2:1,A2-4:1", "--poseidon-micro-batch-sizes", "1",
                         "--poseidon-profile-iters", "2", "--poseidon-profile-warmup", "1",
                         "--poseidon-save-plan", str(tmp_path / "plan.json")], tmp_path, env=env)


@pytest.fixture(scope="module", autouse=True)
def adaptor_launch(request, tmp_path_factory):
    """The adaptor test's launch, started with the module's first test (what it checks is read from its output
    and the adaptor's records, no timing): ``(folder, future of (exit code, output))``."""
    calls = {}
    tmp = None
    if selected(request, ADAPTOR_TEST) and os.path.isdir(MCORE012):
        tmp = tmp_path_factory.mktemp("adaptor")
        calls[ADAPTOR_TEST] = lambda: _adaptor_launch(tmp)
    with in_background(calls) as launches:
        yield tmp, launches.get(ADAPTOR_TEST)


def test_profiling_search_and_start_up_order_with_an_adaptor_on_core_012(adaptor_launch):
    """The whole flow without a saved plan (probe, profile on 0.12.2, search, apply, train), with a recording
    adaptor on the path so that ``auto`` picks the mindspeed style: the adaptor is imported before any megatron
    module with the user's argv, then repatched with the planned argv before Poseidon's layer table."""
    tmp_path, launch = adaptor_launch
    saved = tmp_path / "plan.json"
    code, out = launch.result()
    assert code == 0, out[-6000:]
    measured = re.search(r"profile: cache: reused 0 of (\d+) configurations", out)
    assert measured and int(measured.group(1)) >= 2, out[-3000:]
    plan = Plan.load(str(saved))
    assert plan.profile_source == "measured" and plan.schedule == "1f1b"
    check_trained_as_planned(code, out, plan)
    planned = planned_flags(plan, "mindspeed", 4)
    assert command(out).endswith(" ".join(planned)) and "skipping its adaptor" not in out
    assert ("--num-layer-list" in planned) == (plan.pp > 1)
    for rank in (0, 1):  # every launcher rank, used by the plan or not, goes through the same start-up
        events = [json.loads(line) for line in (tmp_path / f"adaptor.log.{rank}").read_text().splitlines()]
        assert [e["event"] for e in events] == ["import", "repatch"], events
        imported, repatched = events
        assert imported["megatron"] == [] and imported["argv"] == JOB
        assert repatched["argv"][-len(planned):] == planned
        assert repatched["config"]["pipeline_model_parallel_size"] == plan.pp
        assert repatched["ours_applied"] is False
