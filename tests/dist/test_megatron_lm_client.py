"""Megatron-LM's own ``pretrain_gpt.py``, unmodified, trains through ``poseidon-run`` on the emulated CPU cluster.

The Megatron-LM files (``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``, ``megatron/training``
at the tag of the installed megatron-core) come from a checkout named by ``POSEIDON_MEGATRON_LM``, by
default ``../shared/megatron-lm/core_v0.16.1`` beside the repository; the tests skip when neither exists.
Importing the script needs the ``test`` extra (triton, pydantic, tqdm, wrapt, six, regex, einops).
Launches are shared between assertions (each costs tens of seconds on 2 cores).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings

import pytest

from tests.dist.test_launcher import REPO, poseidon_run

ENV = "POSEIDON_MEGATRON_LM"
_DEFAULT = os.path.join(os.path.dirname(REPO), "shared", "megatron-lm", "core_v0.16.1")
CHECKOUT = os.environ.get(ENV) or _DEFAULT
SCRIPT = os.path.join(CHECKOUT, "pretrain_gpt.py")

if not os.path.isfile(SCRIPT):
    pytest.skip(f"Megatron-LM's pretrain_gpt.py not found: set {ENV} to a Megatron-LM checkout "
                f"(tag core_v0.16.1)", allow_module_level=True)

# What a GPU user writes (no CPU flags), plus the data source this machine has.
JOB = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4",
       "--train-iters", "3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
EMULATE = ["--poseidon-emulate", "A2-2:2,A2-4:2", "--poseidon-emulate-model", "llama2-13b"]
MEGATRON_WORLD = re.compile(r"using world size: (\d+), data-parallel size: (\d+)")


def lm_losses(out: str) -> list[float]:
    """Megatron-LM's ``lm loss: 6.65E+00`` of each logged iteration."""
    return [float(x) for x in re.findall(r"\| lm loss: ([-+\w.]+) \|", out)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron-lm-profiles"))


@pytest.fixture(scope="module")
def searched(tmp_path_factory, cache):
    """One launch: the user's TP 2 / PP 2 kept (``--poseidon-keep``), the interleaved schedule asked for, the
    user's own first-stage split replaced by the plan's placement and layer split; Megatron-LM saves its
    ``torch_dist`` checkpoint of the last iteration into ``ck`` beside the plan."""
    tmp = tmp_path_factory.mktemp("searched")
    saved = str(tmp / "plan.json")
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
                              *EMULATE, "--poseidon-keep", "--poseidon-schedules", "interleaved-1f1b",
                              "--poseidon-profile-cache", cache, "--poseidon-save-plan", saved,
                              "--save", str(tmp / "ck"), "--save-interval", "3", "--ckpt-format", "torch_dist"], tmp)
    return code, out, saved


def test_searched_interleaved_plan_trains_with_planned_layers_and_finite_loss(searched):
    code, out, saved = searched
    assert code == 0, out[-4000:]
    with open(saved, encoding="utf-8") as f:
        plan = json.load(f)
    assert (plan["tp"], plan["pp"], plan["schedule"], plan["virtual_stages"]) == (2, 2, "interleaved-1f1b", 2)
    assert len(re.findall(r"stage \d on A2-[24] built layers \S+ as planned", out)) == 4, out[-4000:]
    assert {"A2-2", "A2-4"} == set(re.findall(r"pipeline stage \d on (A2-[24])", out))
    losses = lm_losses(out)
    assert losses and all(math.isfinite(x) for x in losses), out[-4000:]  # logged at Megatron-LM's interval
    assert MEGATRON_WORLD.search(out).groups() == ("4", "1")
    assert re.search(r"^poseidon: TP 2  PP 2 ", out, re.M)  # --poseidon-keep kept the user's TP and PP
    # CPU-only adjustments, each named once (rank 0's job-wide line)
    assert out.count("poseidon: CPU rank: --transformer-impl local (not given;") == 1
    assert "poseidon: CPU rank: initialize_megatron(allow_no_cuda=True)" in out
    assert "poseidon: CPU rank: gradient clipping on CPU gradients" in out
    assert "grad norm:" in out  # Megatron's clipping ran (it asserts CUDA gradients without the shim)


def test_tp_shards_start_from_their_own_rng_streams(searched):
    """Defect 2 on Megatron-LM's script: each TP rank initialises its shard of a layer's weights under its own
    model-parallel RNG stream (Megatron's tracker on CPU generator states), so the two TP halves of every
    layer's ``linear_qkv`` differ in the checkpoint Megatron-LM saves. With the inference tracker the CPU shim
    used before (its ``fork()`` keeps the default generator, seeded alike on both TP ranks) they were equal,
    and stayed equal through training: the two halves compute the same."""
    import torch
    import torch.distributed.checkpoint as dcp

    code, out, saved = searched
    assert code == 0, out[-4000:]
    folder = os.path.join(os.path.dirname(saved), "ck", "iter_0000003")
    key = "decoder.layers.self_attention.linear_qkv.weight"
    reader = dcp.FileSystemReader(folder)
    meta = reader.read_metadata().state_dict_metadata[key]
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
    with warnings.catch_warnings():     # no process group here: dcp warns that it loads in one process
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    weights = state[key]
    layers, rows = weights.shape[0], weights.shape[1] // 2      # the TP 2 shards split the output rows
    assert layers == 8
    for layer in range(layers):
        assert not torch.equal(weights[layer, :rows], weights[layer, rows:]), layer


def test_profile_prices_megatron_lms_own_step_at_the_first_and_last_stage(searched, cache):
    """Defect 3: the prediction missed what Megatron-LM's forward_step costs besides the model: get_batch's TP
    broadcast of the batch (first and last stage) and its loss function (last). The profile now carries the
    script's own step by position, measured on the TP 2 group of each type."""
    code, out, _ = searched
    assert code == 0, out[-4000:]
    (merged,) = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("-profile.json")]
    with open(merged, encoding="utf-8") as f:
        entries = json.load(f)["entries"]
    assert {(e["device_type"], e["tp"]) for e in entries} == {("A2-2", 2), ("A2-4", 2)}
    assert all(e["first_step_ms"] > 0 and e["last_step_ms"] > 0 for e in entries), entries
    lines = re.findall(r"^poseidon\[rank \d\]: A2-[24] TP 2 micro-batch 1: job's own step: [\d.]+ ms per "
                       r"micro-batch, first stage \+[\d.]+ ms, last stage \+[\d.]+ ms$", out, re.M)
    assert len(lines) == 2, out[-4000:]
    # the cached entries are keyed by the script's source too
    cached = [f for f in os.listdir(cache) if f.endswith(".json") and not f.endswith("-profile.json")]
    with open(os.path.join(cache, cached[0]), encoding="utf-8") as f:
        assert json.load(f)["software"]["client"].startswith("pretrain_gpt.py:")


def test_user_flags_the_plan_replaces_are_logged(searched):
    """Defect 5: ``--decoder-first-pipeline-num-layers 2`` vanished without a word."""
    code, out, _ = searched
    assert code == 0, out[-4000:]
    assert re.search(r"^poseidon: flag style megatron: --decoder-first-pipeline-num-layers 2 dropped: the plan's "
                     r"flags decide it \(--tensor-model-parallel-size 2 ", out, re.M), out[-4000:]


def test_plan_leaving_ranks_unused_trains_with_megatron_world_and_dp(searched, tmp_path, cache):
    """A saved plan on the two A2-2 ranks (TP 2, PP 1): the A2-4 ranks leave, Megatron-LM sees 2 ranks, DP 1;
    the same plan run under another emulation scale is refused (defect 4)."""
    code, out, saved = searched
    assert code == 0, out[-4000:]
    from poseidon_plugin.costmodel import Candidate
    from poseidon_plugin.target import plan_as_run

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import _e2e_runs

    case = _e2e_runs.ClusterCase(name="t", emulate="A2-2:2,A2-4:2", model="llama2-13b", layers=8, global_batch=8,
                                 why="")
    profile = [os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("-profile.json")]
    cm = _e2e_runs.cost_model(case, profile[0])  # the same model flags, emulation and profile as the launch
    small = plan_as_run(cm, Candidate(tp=2, pp=1, dp=1, mbs=1, stage_types=("A2-2",), layers=(8,)))
    path = str(tmp_path / "small.json")
    small.save(path)
    code, run = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, *EMULATE, "--poseidon-plan", path], tmp_path)
    assert code == 0, run[-4000:]
    assert run.count("device is not used by the plan; waiting for the job to end") == 2
    assert MEGATRON_WORLD.search(run).groups() == ("2", "1")
    assert len(re.findall(r"built layers \S+ as planned", run)) == 2
    assert all(math.isfinite(x) for x in lm_losses(run)) and lm_losses(run)
    other = [a if a != "llama2-13b" else "llama2-13b:0.5" for a in EMULATE]
    code, refused = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, *other, "--poseidon-plan", path], tmp_path)
    assert code == 2
    assert re.search(r"was priced for another model or job: emulation deterministic:llama2-13b:[\d.]+:npu "
                     r"\(this job: deterministic:llama2-13b:0.5:npu", refused), refused[-3000:]


def test_dry_run_plans_and_stops_before_megatron_lm_loop(searched, tmp_path, cache):
    code, dry = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "2", *EMULATE, "--poseidon-keep",
                              "--poseidon-dry-run", "--poseidon-profile-cache", cache], tmp_path)
    assert code == 0, dry[-4000:]
    assert re.search(r"^poseidon: Poseidon plan: pretrain_gpt-8l-h64 ", dry, re.M), dry[-4000:]
    assert "cache: reused 2 of 2 configurations" in dry
    assert "dry run: stopping before training" in dry and "lm loss" not in dry
    assert "CPU rank:" not in dry  # nothing of Megatron-LM's loop was touched


def test_disabled_is_plain_torchrun(tmp_path):
    """POSEIDON_DISABLE=1: exactly torchrun, so no CPU shim: Megatron-LM stops at its own CUDA check."""
    code, out = poseidon_run(["--nproc-per-node", "1", SCRIPT, *JOB, *EMULATE], tmp_path,
                             env={"POSEIDON_DISABLE": "1"})
    assert code != 0
    assert "Megatron requires CUDA." in out
    assert "poseidon[rank" not in out and "poseidon: " not in out


# A Llama-style command as written for GPUs: mixed precision, the distributed optimizer with overlapped gradient
# reduction, sequence parallelism, full activation recomputation, grouped-query attention, SwiGLU, RMSNorm, RoPE,
# untied embeddings.
LLAMA_STYLE = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--sequence-parallel",
               "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "176", "--swiglu",
               "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
               "--disable-bias-linear", "--clip-grad", "1.0", "--weight-decay", "0.1", "--lr-decay-style", "cosine",
               "--min-lr", "1e-5", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1"]


def test_a_llama_style_gpu_command_trains_on_cpu_ranks(tmp_path, cache):
    """Each of these flags stopped the emulated job before: --bf16 in profiling (fp32 norms fed bf16 weights;
    the clipping's fp32 check) and in Megatron-LM's optimizer (its CUDA tensor-type check), the fused bf16 softmax
    (a CUDA extension), --sequence-parallel (the local spec's norms have no sequence-parallel form), activation
    recomputation (it saved the CUDA generator's state); and recomputation was not priced."""
    # one micro-batch size: the flags are the point here, and each size is profiled on 4 ranks of 2 cores
    code, out = poseidon_run(["--nproc-per-node", "4", SCRIPT, *JOB, *LLAMA_STYLE, *EMULATE,
                              "--poseidon-micro-batch-sizes", "1", "--poseidon-profile-cache", cache], tmp_path)
    assert code == 0, out[-6000:]
    assert "built layers" in out and "NOT as planned" not in out
    losses = lm_losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    for line in ("CPU rank: --sequence-parallel dropped", "CPU rank: --no-masked-softmax-fusion (not given",
                 "CPU rank: mixed-precision optimizer set up over CPU parameters",
                 "recomputation --recompute-granularity full --recompute-method uniform --recompute-num-layers 1: "
                 "every layer's forward runs again in its backward"):
        assert out.count(f"poseidon: {line}") == 1, line
