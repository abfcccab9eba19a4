"""A tiny MoE job (4 experts, top-2) through ``poseidon-run`` on 4 emulated CPU ranks of two types with EP 2.

The plan's expert layout reaches the script (``--expert-model-parallel-size 2 --moe-token-dispatcher-type
alltoall``), every rank builds its planned layers and half of the experts, and the job trains on gloo (the
all-to-all dispatcher through the CPU shim's MoE rows, ``emulation/cpu_shim_patch.py``)."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.dist.test_launcher import SCRIPT, poseidon_run  # noqa: E402

MOE_JOB = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
           "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--mock-data",
           "--pipeline-model-parallel-size", "2"]


def test_tiny_moe_job_trains_with_expert_parallelism_on_two_emulated_types(tmp_path):
    # --poseidon-keep pins the job's TP, PP, micro-batch and EP 2; the search places it on the two types
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *MOE_JOB, "--expert-model-parallel-size", "2",
                              "--poseidon-keep", "--poseidon-emulate", "A2-2:2,A2-4:2"], tmp_path)
    assert code == 0, out[-4000:]
    command = next(line for line in out.splitlines() if line.startswith("poseidon: command:"))
    assert "--expert-model-parallel-size 2" in command and "--moe-token-dispatcher-type alltoall" in command
    assert len(re.findall(r"built layers \S+ as planned", out)) == 4, out[-4000:]
    # EP 2 over DP 2: each stage's two ranks hold experts 0-1 and 2-3
    held = sorted(re.findall(r"rank (\d): experts ([\d,]+) of its MoE layers \(EP 2\)", out))
    assert [experts for _rank, experts in held] == ["0,1", "2,3", "0,1", "2,3"], out[-4000:]
    losses = [float(x) for x in re.findall(r"iteration \d/3 \| lm loss ([\d.]+)", out)]
    assert len(losses) == 3 and all(math.isfinite(x) and 0 < x < 10 for x in losses)
