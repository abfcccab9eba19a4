"""Layer identity on random uneven splits: numbers from megatron-core, types through MindSpeed's offset helper.

For each split (fixed seeds), every pipeline rank and chunk asks the installed core how many layers it
builds and where they start (``get_num_layers_to_build`` / ``get_transformer_layer_offset`` under
``patches.layer_assignment``), and asks MindSpeed-LLM's layer-type decision (a stand-in of the real one,
``tests/standins``) which global layer each local layer is and whether it is noop, dense or MoE, through
MindSpeed's offset helper under ``patches.mindspeed_offsets``. Both must equal what the plan says, on 0.16.1
(installed) and 0.12.2 (``.cache/mcore012``). Without ``patches.mindspeed_offsets`` the helper's even split gives
other layers (checked on one split). One subprocess per core: the ranks are set in ``parallel_state``
without process groups, as the split functions only read them there.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.dist.conftest import in_background, selected  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE012 = os.path.join(REPO, ".cache", "mcore012")
STANDINS = os.path.join(REPO, "tests", "standins")
SEEDS = range(40)


def random_case(seed: int) -> dict:
    """An uneven split with a DeepSeek-style layer mix: first-k dense, MoE every ``freq``, some noop layers."""
    rng = random.Random(seed)
    pp, vpp = rng.choice([2, 3, 4, 5]), rng.choice([1, 1, 2])
    layers = [rng.randint(1, 4) for _ in range(pp * vpp)]
    if len(set(layers)) == 1:
        layers[rng.randrange(len(layers))] += 1
    total = sum(layers)
    return {"layers": layers, "pp": pp, "first_k": rng.randint(0, total), "freq": rng.randint(1, 3),
            "noop": sorted(i for i in range(total) if rng.random() < 0.2)}


def planned_identity(case: dict) -> dict[str, list[list]]:
    """Per ``"rank/chunk"``: ``[global 1-based layer, kind]`` for each layer, straight from the plan."""
    layers, pp = case["layers"], case["pp"]
    out = {}
    for vs, count in enumerate(layers):
        start = sum(layers[:vs])
        out[f"{vs % pp}/{vs // pp}"] = [[g, _kind(case, g)] for g in range(start + 1, start + count + 1)]
    return out


def _kind(case: dict, g: int) -> str:
    if g - 1 in case["noop"]:
        return "noop"
    if case["first_k"] and case["freq"]:
        return "moe" if g - 1 >= case["first_k"] and (g - 1) % case["freq"] == 0 else "dense"
    return "moe"


_BODY = textwrap.dedent("""
    import json, sys, types
    import megatron.core
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import transformer_block, transformer_layer
    import mindspeed.core.transformer.transformer_block as ms_block
    import mindspeed_llm.core.transformer.transformer_block as llm_block
    from poseidon_plugin.patches import layer_assignment, mindspeed_offsets as ms_patch
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.megatron_model import transformer_config

    assert "tests/standins" in ms_block.__file__.replace("\\\\", "/"), ms_block.__file__

    def identity(case, patched):
        layers, pp = case["layers"], case["pp"]
        vpp = len(layers) // pp
        total = sum(layers)
        job = read_job("t.py", ["--num-layers", str(total), "--hidden-size", "32", "--num-attention-heads", "2",
                                "--seq-length", "8", "--vocab-size", "64"])
        config = transformer_config(job, tensor_parallel=1, pipeline_parallel=pp, on_cpu=True)
        args = types.SimpleNamespace(num_layers=total, num_experts=8, first_k_dense_replace=case["first_k"],
                                     moe_layer_freq=case["freq"], noop_layers=set(case["noop"]),
                                     schedules_method=None)
        tables = [layer_assignment.table(layers, pp)] + ([ms_patch.table(layers, pp)] if patched else [])
        for table in tables:
            table.apply()
        problems = [p for table in tables for p in table.verify()]
        swept = llm_block._get_layer_offset is ms_block._get_layer_offset
        core, standin = {}, {}
        try:
            ps.set_pipeline_model_parallel_world_size(pp)
            ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
            for rank in range(pp):
                ps.set_pipeline_model_parallel_rank(rank)
                for chunk in range(vpp):
                    ps.set_virtual_pipeline_model_parallel_rank(chunk if vpp > 1 else None)
                    count = transformer_block.get_num_layers_to_build(config)
                    offset = transformer_layer.get_transformer_layer_offset(config)
                    key = f"{rank}/{chunk}"
                    core[key] = [offset + i for i in range(1, count + 1)]
                    standin[key] = [list(llm_block.layer_kind(args, i)) for i in range(1, count + 1)]
            dualpipe = types.SimpleNamespace(num_layers=total, schedules_method="dualpipev",
                                             dualpipev_first_chunk=False)
            falls_through = ms_block._get_layer_offset(dualpipe) == total - pp * (total // pp // 2)
        finally:
            for table in reversed(tables):
                table.revert()
            ps.set_virtual_pipeline_model_parallel_world_size(None)
            ps.set_virtual_pipeline_model_parallel_rank(None)
        restored = not hasattr(ms_block._get_layer_offset, "__poseidon_patch__") and \\
            llm_block._get_layer_offset is ms_block._get_layer_offset
        return {"core": core, "standin": standin, "problems": problems, "swept": swept, "restored": restored,
                "falls_through": falls_through}

    cases = json.loads(sys.argv[1])
    out = {"version": megatron.core.__version__,
           "patched": [identity(case, True) for case in cases],
           "unpatched": identity({"layers": [3, 1], "pp": 2, "first_k": 0, "freq": 1, "noop": []}, False)}
    print("RESULT " + json.dumps(out), flush=True)
""")


def _run(stack: str | None) -> tuple[list[dict], dict]:
    cases = [random_case(seed) for seed in SEEDS]
    path = [STANDINS, REPO] if stack is None else [STANDINS, stack, REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _BODY, json.dumps(cases)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    return cases, json.loads(lines[-1][len("RESULT "):])


def _check(cases: list[dict], out: dict) -> None:
    assert len(out["patched"]) == len(cases)
    for case, got in zip(cases, out["patched"]):
        expected = planned_identity(case)
        assert got["problems"] == [] and got["swept"] and got["restored"], case
        assert got["core"] == {key: [g for g, _ in rows] for key, rows in expected.items()}, case
        assert got["standin"] == expected, case
        assert got["falls_through"], "dualpipev must keep MindSpeed's own offsets"
    # Without the MindSpeed table the helper numbers rank 1's layer of the 3/1 split as layer 3 (even split).
    unpatched = out["unpatched"]
    assert unpatched["core"]["1/0"] == [4]
    assert unpatched["standin"]["1/0"] == [[3, "moe"]]


INSTALLED_TEST = "test_layer_identity_on_installed_core"
CORE_012_TEST = "test_layer_identity_on_megatron_core_012"


@pytest.fixture(scope="module", autouse=True)
def identity_runs(request):
    """Both cores' interpreters, started together with the module's first test (they check no timing):
    stack -> the future of :func:`_run`'s results."""
    calls = {}
    if selected(request, INSTALLED_TEST):
        calls[None] = lambda: _run(None)
    if selected(request, CORE_012_TEST) and os.path.isdir(MCORE012):
        calls[MCORE012] = lambda: _run(MCORE012)
    with in_background(calls) as runs:
        yield runs


def test_layer_identity_on_installed_core(identity_runs):
    cases, out = identity_runs[None].result()
    assert not out["version"].startswith("0.12")
    _check(cases, out)


@pytest.mark.skipif(not os.path.isdir(MCORE012), reason=(
    "megatron-core 0.12.2 (MindSpeed-LLM's core) not provided; install it with: pip install --no-deps "
    "--target .cache/mcore012 megatron-core==0.12.2"))
def test_layer_identity_on_megatron_core_012(identity_runs):
    cases, out = identity_runs[MCORE012].result()
    assert out["version"].startswith("0.12"), out["version"]
    _check(cases, out)


def test_cases_cover_virtual_stages_noop_and_dense_moe_mixes():
    # The seeds are fixed; this says what they exercise, so a change of generator cannot hollow the test out.
    cases = [random_case(seed) for seed in SEEDS]
    assert any(len(c["layers"]) > c["pp"] for c in cases) and any(len(c["layers"]) == c["pp"] for c in cases)
    kinds = {kind for c in cases for rows in planned_identity(c).values() for _, kind in rows}
    assert kinds == {"noop", "dense", "moe"}
    assert all(len(set(c["layers"])) > 1 for c in cases)
