"""The flags poseidon-run writes pass Megatron-LM's own argument parsing and validation.

``megatron.training.arguments`` ships only in the megatron-core 0.19.2 wheel, installed beside (not over)
the 0.16.1 the project runs on::

    pip install --no-deps --ignore-requires-python --target .cache/mcore019 megatron-core==0.19.2

The check runs in a subprocess with that directory first on ``sys.path``: Megatron-LM's ``parse_args``
reads the rewritten argv, ``validate_args`` applies every rule Megatron-LM checks at start-up, and
``core_transformer_config_from_args`` builds the TransformerConfig (which validates the layout against
the layer count). On Python 3.11 the wheel needs ``typing.override``; its schedules import triton at
module level, so the one module doing so is stubbed (nothing here runs a kernel), and the GPU
architecture query made with TP > 1 answers Hopper.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.runtime.apply import planned_flags
from poseidon_plugin.runtime.launcher import RANK_ENV_DEFAULTS
from poseidon_plugin.runtime.job_flags import read_job, rewrite
from poseidon_plugin.runtime.job_spec import model_spec
from poseidon_plugin.specs import parse_cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE019 = os.path.join(REPO, ".cache", "mcore019")
USER_ARGS = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--vocab-size", "512", "--train-iters", "3", "--lr", "1e-4",
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--global-batch-size", "16",
             # the user's own parallelism, which the plan replaces:
             "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
             "--decoder-first-pipeline-num-layers", "3", "--micro-batch-size", "4", "--no-overlap-p2p-communication"]

_CHECK = textwrap.dedent("""
    import json, os, sys, types, typing, typing_extensions
    typing.override = typing_extensions.override          # the 0.19 wheel targets Python >= 3.12
    stub = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")   # imports triton at top level
    stub.__getattr__ = lambda name: None
    sys.modules[stub.__name__] = stub
    from megatron.training import arguments
    arguments.get_device_arch_version = lambda: 9          # asks the GPU (Hopper here) with TP > 1
    results = []
    for case in json.load(open(sys.argv[1])):
        os.environ["WORLD_SIZE"], os.environ["RANK"] = str(case["world"]), "0"
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        args = arguments.parse_args()
        arguments.validate_args(args)
        config = arguments.core_transformer_config_from_args(args)
        results.append({"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
                        "dp": args.data_parallel_size, "vpp": args.virtual_pipeline_model_parallel_size,
                        "mbs": args.micro_batch_size, "gbs": args.global_batch_size,
                        "overlap": args.overlap_p2p_comm,
                        "layout": str(config.pipeline_model_parallel_layout)})
    print("RESULTS " + json.dumps(results))
""")


def _plan(tp: int, pp: int, dp: int, layers: tuple[int, ...], v: int = 1, overlap: bool | None = None):
    types = ["A2-2", "A2-4"]
    cluster = parse_cluster({"name": "c", "device_types": types,
                             "nodes": [{"device_type": t, "count": 1, "devices_per_node": 4} for t in types],
                             "links": "npu"})
    model = model_spec(read_job("pretrain_gpt.py", USER_ARGS), global_batch_size=16, name="m")
    stage_types = tuple(types[i * 2 // pp] for i in range(pp))
    cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=2, stage_types=stage_types, layers=layers,
                     schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    plan = CostModel(cluster, model).make_plan(cand)
    return plan if overlap is None else dataclasses.replace(plan, overlap_p2p_comm=overlap)


CASES = [
    dict(tp=1, pp=4, dp=1, layers=(1, 3, 3, 1)),
    dict(tp=2, pp=2, dp=1, layers=(5, 3)),
    dict(tp=1, pp=2, dp=2, layers=(2, 6)),
    dict(tp=1, pp=2, dp=1, layers=(1, 2, 3, 2), v=2),  # overlap on (Megatron-LM needs it at pp 2)
    dict(tp=1, pp=4, dp=1, layers=(1,) * 8, v=2, overlap=False),  # --no-overlap-p2p-communication
    dict(tp=1, pp=4, dp=1, layers=(1,) * 8, v=2, overlap=True),
]


@pytest.mark.skipif(not os.path.isdir(os.path.join(MCORE019, "megatron", "training")), reason=(
    "megatron.training is not installed; provide it with: pip install --no-deps --ignore-requires-python "
    "--target .cache/mcore019 megatron-core==0.19.2"))
def test_rewritten_flags_pass_megatron_validation(tmp_path):
    plans = [_plan(**case) for case in CASES]
    cases = [{"world": plan.world_size, "argv": rewrite(USER_ARGS, planned_flags(plan, "megatron", 16))}
             for plan in plans]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "check.py").write_text(_CHECK)
    env = dict(os.environ, PYTHONPATH=MCORE019, **RANK_ENV_DEFAULTS)  # what poseidon-run gives every rank
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(tmp_path / "cases.json")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    for plan, got in zip(plans, results):
        assert (got["tp"], got["pp"], got["dp"]) == (plan.tp, plan.pp, plan.dp)
        assert got["vpp"] == (plan.virtual_stages if plan.virtual_stages > 1 else None)
        assert (got["mbs"], got["gbs"]) == (plan.micro_batch_size, 16)
        assert got["layout"] == planned_flags(plan, "megatron", 16)[5]
        assert got["overlap"] == plan.overlap_p2p_comm  # the user's --no-overlap-p2p-communication is replaced
