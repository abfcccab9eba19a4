"""What CPU ranks change in a Megatron-LM command before its loop runs (``emulation/cpu_training.py``): every change
named in one line, the user's other flags untouched, nothing changed twice."""

from __future__ import annotations

import pytest

from poseidon_plugin.emulation.cpu_training import apply_adjustments, flag_adjustments

GPU_USER = ["--num-layers", "8", "--hidden-size", "64", "--bf16", "--sequence-parallel", "--swiglu",
            "--position-embedding-type", "rope", "--tensor-model-parallel-size", "2", "--train-iters", "3"]


def test_a_gpu_users_command_gets_each_cpu_change_once_in_one_line():
    adjustments = flag_adjustments(GPU_USER)
    lines = [a.line() for a in adjustments]
    assert lines == [
        "CPU rank: --transformer-impl local (not given; Transformer Engine runs on CUDA only; Megatron-LM's default "
        "is transformer_engine)",
        "CPU rank: --no-persist-layer-norm (not given; the persistent layer norm is an Apex CUDA kernel)",
        "CPU rank: --no-gradient-accumulation-fusion (not given; the fused weight-gradient accumulation is a CUDA "
        "extension)",
        "CPU rank: --no-masked-softmax-fusion (not given; the fused bf16 / fp16 softmax is a CUDA extension)",
        "CPU rank: --no-rope-fusion (not given; the fused RoPE needs Transformer Engine)",
        "CPU rank: --sequence-parallel dropped (the local layer spec's torch norms have no sequence-parallel form "
        "(Transformer Engine's have); the plan is priced with it)",
        "CPU rank: --eval-interval 3 (not given; Megatron-LM's loop divides by it; the default None stops it)",
        "CPU rank: --eval-iters 0 (not given; no evaluation set up by the user: the emulated run does not evaluate)",
    ]
    out = apply_adjustments(GPU_USER, adjustments)
    added = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-rope-fusion", "--eval-interval", "3", "--eval-iters", "0"]
    assert out == [t for t in GPU_USER if t != "--sequence-parallel"] + added


@pytest.mark.parametrize("dtype_flag, fused_softmax_dropped", [("--bf16", True), ("--fp16", True), (None, False)])
def test_the_fused_softmax_is_switched_off_only_where_megatron_would_use_it(dtype_flag, fused_softmax_dropped):
    # Megatron-core's FusedScaleMaskSoftmax takes its CUDA kernel for bf16 / fp16 inputs only
    args = ["--num-layers", "2", *([dtype_flag] if dtype_flag else [])]
    flags = {a.flag for a in flag_adjustments(args)}
    assert ("--no-masked-softmax-fusion" in flags) is fused_softmax_dropped


def test_a_users_own_cpu_friendly_flags_are_kept():
    args = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion", "--bf16",
            "--no-masked-softmax-fusion", "--eval-interval", "5", "--eval-iters", "1"]
    assert flag_adjustments(args) == []
    assert apply_adjustments(args, []) == args


def test_a_switch_dropped_before_another_flag_leaves_that_flag_whole():
    args = ["--sequence-parallel", "--lr", "1e-4"]
    out = apply_adjustments(args, flag_adjustments(args))
    assert out[:2] == ["--lr", "1e-4"]
