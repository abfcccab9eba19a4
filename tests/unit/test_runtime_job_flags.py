"""Reading the job from Megatron flags, and rewriting the parallelism flags (property-tested against a reference)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime.job_flags import (PLANNED_FLAGS, effective_global_batch, flag_values, read_job,
                                               rewrite)

BASE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128"]


def test_reads_model_and_defaults():
    job = read_job("train.py", BASE)
    assert (job.num_layers, job.hidden_size, job.num_attention_heads, job.seq_length) == (8, 256, 8, 128)
    assert job.num_query_groups == 8            # no GQA: one group per head
    assert job.ffn_hidden_size == 4 * 256       # Megatron's GELU default
    assert job.micro_batch_size == 1 and job.global_batch_size is None
    assert (job.tensor_parallel, job.pipeline_parallel) == (1, 1)
    assert job.dtype == "fp32" and job.max_position_embeddings == 128
    assert not job.vocab_size_given


def test_clip_grad_and_grouped_gemm():
    # Megatron-LM's default --clip-grad 1.0 (what the profiled optimizer step clips with); 0 turns it off
    assert read_job("t.py", BASE).clip_grad == 1.0
    assert read_job("t.py", BASE + ["--clip-grad", "0"]).clip_grad == 0.0
    moe = BASE + ["--num-experts", "4", "--moe-router-topk", "2"]
    assert not read_job("t.py", moe).moe_grouped_gemm
    assert read_job("t.py", moe + ["--moe-grouped-gemm"]).moe_grouped_gemm
    assert not read_job("t.py", BASE + ["--moe-grouped-gemm"]).moe_grouped_gemm   # no experts: nothing to group


# Megatron: int(8h/3 / 64) * 64 (LLaMA-7B's 4096 -> 10880); a width that rounds to 0 falls back to 4h.
@pytest.mark.parametrize("hidden, ffn", [(256, 640), (4096, 10880), (96, 256), (16, 64)])
def test_swiglu_default_ffn_is_megatrons(hidden, ffn):
    args = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "4", "--seq-length", "8",
            "--swiglu"]
    job = read_job("t.py", args)
    assert job.swiglu and job.ffn_hidden_size == ffn


def test_inline_values_gqa_and_switches():
    args = BASE + ["--group-query-attention", "--num-query-groups=2", "--bf16", "--tensor-model-parallel-size=2",
                   "--use-distributed-optimizer", "--untie-embeddings-and-output-weights", "--global-batch-size", "64",
                   "--normalization", "RMSNorm", "--position-embedding-type=rope", "--disable-bias-linear"]
    job = read_job("t.py", args)
    assert job.num_query_groups == 2 and job.dtype == "bf16" and job.tensor_parallel == 2
    assert job.distributed_optimizer and job.untie_embeddings and job.global_batch_size == 64
    assert job.normalization == "RMSNorm" and job.position_embedding_type == "rope" and not job.add_bias_linear


def test_not_megatron_shaped_names_missing_flags():
    with pytest.raises(PoseidonError, match=r"train.py is not Megatron-shaped: its arguments lack --hidden-size, "
                                            r"--seq-length.*POSEIDON_DISABLE=1"):
        read_job("train.py", ["--num-layers", "2", "--num-attention-heads", "4", "--lr", "0.1"])


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--num-layers", "eight"], r"--num-layers 'eight' is not an integer"),
        (["--micro-batch-size", "0"], r"--micro-batch-size 0 must be >= 1"),
        (["--num-attention-heads", "7"], r"--hidden-size 256 is not divisible by --num-attention-heads 7"),
        (["--group-query-attention", "--num-query-groups", "3"], r"--num-attention-heads 8 is not divisible by --num-query-groups 3"),
        (["--normalization", "BatchNorm"], r"--normalization 'BatchNorm' is not supported"),
        (["--hidden-dropout", "1.5"], r"--hidden-dropout 1.5 must be in \[0, 1\)"),
        (["--clip-grad", "-1"], r"--clip-grad -1 must be a finite number >= 0"),
        (["--clip-grad", "nan"], r"--clip-grad nan must be a finite number >= 0"),
        (["--clip-grad", "x"], r"--clip-grad 'x' is not a number"),
    ],
)
def test_bad_job_flags(extra, match):
    with pytest.raises(PoseidonError, match=match):
        read_job("t.py", BASE + extra)


@pytest.mark.parametrize(
    "extra, world, gbs",
    [([], 4, 4), (["--micro-batch-size", "2"], 8, 16), (["--tensor-model-parallel-size", "2"], 8, 4),
     (["--global-batch-size", "32"], 4, 32)],
)
def test_effective_global_batch(extra, world, gbs):
    assert effective_global_batch(read_job("t.py", BASE + extra), world) == gbs


def test_effective_global_batch_needs_divisible_world():
    with pytest.raises(PoseidonError, match="does not divide the world size 6.*pass --global-batch-size"):
        effective_global_batch(read_job("t.py", BASE + ["--pipeline-model-parallel-size", "4"]), 6)


def test_rewrite_replaces_parallelism_and_keeps_the_rest():
    args = ["--num-layers", "8", "--tensor-model-parallel-size", "4", "--lr", "1e-4",
            "--pipeline-model-parallel-size=2", "--decoder-first-pipeline-num-layers", "3",
            "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "2",
            "--global-batch-size", "16", "--mock-data", "--micro-batch-size", "4"]
    planned = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
               "--pipeline-model-parallel-layout", "Et*3|t*2|t*2|tL", "--micro-batch-size", "2",
               "--global-batch-size", "16"]
    assert rewrite(args, planned) == ["--num-layers", "8", "--lr", "1e-4", "--mock-data", *planned]


# --- property: rewrite against an independent reference -------------------------------------------

_OTHER = ["--num-layers", "--lr", "--seed", "--data-path", "--save"]
_OTHER_SWITCHES = ["--mock-data", "--bf16", "--swiglu"]
_PLANNED_SWITCHES = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                     "--standalone-embedding-stage", "--no-overlap-p2p-communication"]
_PLANNED_WITH_VALUE = [f for f in PLANNED_FLAGS if f not in _PLANNED_SWITCHES]

_items = st.one_of(
    st.tuples(st.sampled_from(_OTHER), st.sampled_from(["1", "0.5", "x/y", "-3"]), st.booleans(), st.just(False)),
    st.tuples(st.sampled_from(_OTHER_SWITCHES), st.none(), st.just(False), st.just(False)),
    st.tuples(st.sampled_from(_PLANNED_WITH_VALUE), st.sampled_from(["2", "Et|tL", "1,2"]), st.booleans(), st.just(True)),
    st.tuples(st.sampled_from(_PLANNED_SWITCHES), st.none(), st.just(False), st.just(True)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_items, max_size=12))
def test_rewrite_matches_reference(items):
    """Reference: build argv from (flag, value, inline, planned) items; the kept part is the non-planned items."""
    args: list[str] = []
    kept: list[str] = []
    for flag, value, inline, planned in items:
        tokens = [flag] if value is None else ([f"{flag}={value}"] if inline else [flag, value])
        args += tokens
        if not planned:
            kept += tokens
    planned_flags = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"]
    assert rewrite(args, planned_flags) == kept + planned_flags
    values = flag_values(rewrite(args, planned_flags))
    assert values["--tensor-model-parallel-size"] == "2" and values["--micro-batch-size"] == "1"


def test_each_user_flag_the_plan_replaces_is_named_with_old_and_new_value():
    """Defect: --decoder-first-pipeline-num-layers and a changed --pipeline-model-parallel-size vanished."""
    from poseidon_plugin.runtime.job_flags import replaced_flags

    user = ["--num-layers", "8", "--decoder-first-pipeline-num-layers", "2", "--pipeline-model-parallel-size", "2",
            "--micro-batch-size", "1", "--no-overlap-p2p-communication", "--lr", "1e-4"]
    planned = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
               "--pipeline-model-parallel-layout", "Et|t|t|tL", "--micro-batch-size", "1"]
    lines = replaced_flags(user, planned)
    assert lines == [
        "--decoder-first-pipeline-num-layers 2 dropped: the plan's flags decide it (--tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Et|t|t|tL' --micro-batch-size 1)",
        "--pipeline-model-parallel-size 2 replaced by the plan's --pipeline-model-parallel-size 4",
        "--no-overlap-p2p-communication dropped: the plan's flags decide it (--tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout 'Et|t|t|tL' --micro-batch-size 1)"]
    assert replaced_flags(["--num-layers", "8", "--lr", "1"], planned) == []


@pytest.mark.parametrize("flags, recompute", [
    ([], ("none", "", 0)),
    (["--recompute-activations"], ("selective", "", 0)),
    (["--recompute-granularity", "selective"], ("selective", "", 0)),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     ("full", "uniform", 2)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "4"],
     ("full", "block", 4)),
    # as Megatron-LM: --recompute-activations sets selective; a method alone recomputes nothing
    (["--recompute-granularity", "full", "--recompute-activations"], ("selective", "", 0)),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], ("none", "", 0)),
])
def test_recomputation_is_read_as_megatron_lm_reads_it(flags, recompute):
    job = read_job("t.py", BASE + flags)
    assert (job.recompute, job.recompute_method, job.recompute_num_layers) == recompute
    from poseidon_plugin.runtime.job_spec import model_spec

    spec = model_spec(job, global_batch_size=8, name="t")
    assert (spec.recompute, spec.recompute_method, spec.recompute_num_layers) == recompute


@pytest.mark.parametrize("flags, match", [
    (["--recompute-granularity", "full"], r"--recompute-granularity full needs --recompute-method \(uniform or "
                                          r"block\) and --recompute-num-layers N"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], r"--recompute-num-layers N"),
    (["--recompute-activations", "--recompute-method", "uniform"], r"are for --recompute-granularity full"),
    (["--recompute-granularity", "some"], r"--recompute-granularity 'some' is not supported"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     r"--recompute-num-layers 0 must be >= 1"),
])
def test_recomputation_flags_megatron_refuses_are_one_line(flags, match):
    with pytest.raises(PoseidonError, match=match):
        read_job("t.py", BASE + flags)
