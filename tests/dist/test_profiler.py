"""Profiling the job's layer on gloo: measured entries, sizes against an independent count, the disk cache."""

from __future__ import annotations

import glob
import os
import socket

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

H, HEADS, SEQ, VOCAB, MAX_POS = 32, 2, 16, 64, 16
JOB = ["--num-layers", "4", "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
       "--vocab-size", str(VOCAB), "--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _profile(rank: int, world_size: int, cache_dir: str, extra: tuple[str, ...] = (),
             configurations: tuple[tuple[int, int], ...] = ((1, 1), (1, 2), (2, 1), (2, 2))) -> dict:
    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime import devices
    from poseidon_plugin.runtime.inventory import RankInfo, World
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import model_spec
    from poseidon_plugin.runtime.profiler import ProfileRequest, profile_world

    cpu_shim.install()
    job = read_job("t.py", [*JOB, *extra])
    model = model_spec(job, global_batch_size=8, name="t")
    host = socket.gethostname()
    world = World(ranks=tuple(RankInfo(rank=r, host=host, local_rank=r, device_type="cpu", device_kind="cpu",
                                       memory_bytes=1 << 34, node_tag="cpu") for r in range(world_size)),
                  nodes=(tuple(range(world_size)),))
    requests = [ProfileRequest(device_type="cpu", tp=tp, mbs=mbs) for tp, mbs in configurations]
    outcome = profile_world(world=world, rank=rank, device=devices.Device(rank), job=job, model=model,
                            requests=requests, cache_dir=cache_dir, warmup=1, iters=2)
    return {"reused": outcome.reused, "measured": outcome.measured,
            "entries": [{k: getattr(e, k) for k in e.__dataclass_fields__} for e in outcome.profile.entries],
            "source": outcome.profile.source, "model": outcome.profile.model}


def _layer_params(tp: int) -> int:
    """Megatron local-spec GPT layer with biases, LayerNorm, GELU MLP (ffn = 4h), MHA; per TP rank."""
    ffn = 4 * H
    layernorms = 2 * (2 * H)
    qkv = 3 * H * H // tp + 3 * H // tp          # column-parallel: weight and bias split
    proj = H * H // tp + H                         # row-parallel: weight split, bias whole
    fc1 = ffn * H // tp + ffn // tp
    fc2 = H * ffn // tp + H
    return layernorms + qkv + proj + fc1 + fc2


def test_profile_entries_and_cache(gloo_pool, tmp_path):
    pool = gloo_pool(2)
    cache = str(tmp_path / "cache")
    first = pool.run(_profile, cache, timeout_s=240)
    assert first[0] == first[1], "ranks disagree on the merged profile"
    result = first[0]
    assert (result["reused"], result["measured"]) == (0, 4)
    assert result["source"] == "measured" and result["model"] == "t"
    by_key = {(e["tp"], e["mbs"]): e for e in result["entries"]}
    assert set(by_key) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for (tp, mbs), entry in by_key.items():
        padded = -(-VOCAB // (128 * tp)) * 128 * tp
        assert entry["layer_params"] == _layer_params(tp)
        assert entry["embedding_params"] == padded // tp * H + MAX_POS * H
        assert entry["head_params"] == padded * H // tp + 2 * H
        assert entry["send_bytes"] == SEQ * mbs * H * 4          # fp32 hidden states to the next stage
        for name in ("forward_ms", "backward_ms", "embedding_forward_ms", "head_forward_ms", "head_backward_ms"):
            assert entry[name] > 0, name
        assert entry["activation_bytes"] > entry["send_bytes"]   # a layer keeps more than its output
        assert entry["head_activation_bytes"] > 0
        # the framework around the layer: schedule steps, one p2p call (2 ranks pair up), the optimizer
        for name in ("step_forward_ms", "step_backward_ms", "p2p_call_ms", "optimizer_fixed_ms"):
            assert entry[name] > 0, name
    for tp in (1, 2):  # what a layer keeps for backward grows with the micro-batch
        assert by_key[(tp, 2)]["activation_bytes"] > by_key[(tp, 1)]["activation_bytes"]
        # the framework's step costs are measured once per TP (at micro-batch 1) and shared by micro-batch 2
        for name in ("step_forward_ms", "step_backward_ms"):
            assert by_key[(tp, 2)][name] == by_key[(tp, 1)][name], name
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp")]

    second = pool.run(_profile, cache, timeout_s=240)[0]
    assert (second["reused"], second["measured"]) == (4, 0)
    assert second["entries"] == result["entries"]

    (corrupt,) = glob.glob(os.path.join(cache, "*tp1-mbs1-*.json"))
    with open(corrupt, "w") as fh:
        fh.write("{not json")
    third = pool.run(_profile, cache, timeout_s=240)[0]  # a corrupt file is re-measured, not trusted
    assert (third["reused"], third["measured"]) == (3, 1)


def test_a_bf16_job_is_profiled_in_bf16(gloo_pool, tmp_path):
    # --bf16, as Megatron-LM runs it: every parameter and buffer of the model in bf16 (its Float16Module; the
    # local spec's torch norms are built in fp32 and fed bf16 weights fp32 activations: a dtype error), and
    # the optimizer stepping fp32 copies (its Float16OptimizerWithFloat16Params; megatron-core's clipping
    # asserts fp32 gradients)
    result = gloo_pool(2).run(_profile, str(tmp_path), ("--bf16", "--clip-grad", "1.0"), ((2, 1),),
                              timeout_s=240)[0]
    assert result["measured"] == 1
    (entry,) = result["entries"]
    assert entry["send_bytes"] == SEQ * H * 2                  # bf16 hidden states to the next stage
    assert entry["layer_params"] == _layer_params(2)
    assert entry["optimizer_ms"] > 0 and entry["optimizer_fixed_ms"] > 0


def _mixed_precision_step(rank: int, world_size: int) -> dict:
    import torch

    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime import devices, profiler

    cpu_shim.install()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    copied = []
    original = profiler._main_param

    def main_param(param):
        main = original(param)
        copied.append((str(param.dtype), str(main.dtype), main is param))
        return main

    profiler._main_param = main_param
    try:
        profiler._optimizer_ms(model, model[1], devices.Device(rank), iters=2, clip_grad=1.0,
                               group=torch.distributed.group.WORLD)
    finally:
        profiler._main_param = original
    return {"dtypes": sorted({str(p.dtype) for p in model.parameters()}), "copied": sorted(set(copied)),
            "close": all(torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(before, model.parameters()))}


def test_a_bf16_models_optimizer_step_runs_on_fp32_copies(gloo_pool):
    for result in gloo_pool(2).run(_mixed_precision_step, timeout_s=120):
        assert result["dtypes"] == ["torch.bfloat16"]          # written back in the model's dtype
        assert result["copied"] == [("torch.bfloat16", "torch.float32", False)]
        assert result["close"]                                   # a step of lr 1e-6, not a new model


def test_cache_entry_without_framework_fields_is_measured_again(gloo_pool, tmp_path):
    """An entry written before the framework fields (older cache generation) is not reused."""
    import json

    pool = gloo_pool(2)
    cache = str(tmp_path / "cache")
    pool.run(_profile, cache, timeout_s=240)
    for path in glob.glob(os.path.join(cache, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        for entry in doc["entries"]:
            for name in ("step_forward_ms", "step_backward_ms", "p2p_call_ms", "optimizer_ms", "optimizer_fixed_ms"):
                entry.pop(name)
        del doc["software"]["entry"]                  # what an older Poseidon wrote: no generation
        with open(path, "w") as fh:
            json.dump(doc, fh)
    again = pool.run(_profile, cache, timeout_s=240)[0]
    assert (again["reused"], again["measured"]) == (0, 4)
    assert all(e["step_forward_ms"] > 0 for e in again["entries"])


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


def _profile_moe(rank: int, world_size: int, cache_dir: str) -> dict:
    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime import devices
    from poseidon_plugin.runtime.inventory import RankInfo, World
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import model_spec
    from poseidon_plugin.runtime.profiler import ProfileRequest, profile_world

    cpu_shim.install()
    job = read_job("t.py", JOB + MOE)
    model = model_spec(job, global_batch_size=8, name="t")
    host = socket.gethostname()
    world = World(ranks=tuple(RankInfo(rank=r, host=host, local_rank=r, device_type="cpu", device_kind="cpu",
                                       memory_bytes=1 << 34, node_tag="cpu") for r in range(world_size)),
                  nodes=(tuple(range(world_size)),))
    outcome = profile_world(world=world, rank=rank, device=devices.Device(rank), job=job, model=model,
                            requests=[ProfileRequest(device_type="cpu", tp=1, mbs=1)], cache_dir=cache_dir,
                            warmup=1, iters=2)
    (entry,) = outcome.profile.entries
    return {"measured": outcome.measured, "expert_parallel": entry.expert_parallel}


def test_moe_profile_has_the_measured_ep_2_entry(gloo_pool, tmp_path):
    # a tiny MoE job (4 experts, top-2) on 2 CPU ranks: its layer is measured at EP 2 too (the two ranks
    # one EP group, the all-to-all on gloo), merged into the one entry and kept in the cache with it
    from poseidon_plugin.specs import load_profile

    cache = str(tmp_path / "cache")
    first, second = gloo_pool(2).run(_profile_moe, cache, timeout_s=240)
    assert first == second, "ranks disagree on the merged profile"
    assert first["measured"] == 1
    ((ep, forward, backward),) = first["expert_parallel"]
    assert ep == 2 and forward > 0 and backward > 0
    (name,) = os.listdir(cache)
    (stored,) = load_profile(os.path.join(cache, name)).entries
    assert stored.expert_parallel == first["expert_parallel"]


def _clipping_calls(rank: int, world_size: int, clip_grad: float) -> dict:
    import torch
    from megatron.core.optimizer import clip_grads

    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime import devices, profiler

    cpu_shim.install()
    calls = {"norm": 0, "clip": 0}
    originals = (clip_grads.get_grad_norm_fp32, clip_grads.clip_grad_by_total_norm_fp32)

    def norm(*args, **kwargs):
        calls["norm"] += 1
        return originals[0](*args, **kwargs)

    def clip(*args, **kwargs):
        calls["clip"] += 1
        return originals[1](*args, **kwargs)

    clip_grads.get_grad_norm_fp32, clip_grads.clip_grad_by_total_norm_fp32 = norm, clip
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        times = profiler._optimizer_ms(model, model[1], devices.Device(rank), iters=2, clip_grad=clip_grad,
                                       group=torch.distributed.group.WORLD)
    finally:
        clip_grads.get_grad_norm_fp32, clip_grads.clip_grad_by_total_norm_fp32 = originals
    return {**calls, "fixed_ms": times["optimizer_fixed_ms"]}


@pytest.mark.parametrize("clip_grad, calls", [(1.0, 6), (0.0, 0)])
def test_the_optimizer_step_includes_the_jobs_gradient_clipping(gloo_pool, clip_grad, calls):
    # with --clip-grad > 0 each timed optimizer step (1 + 2 iterations, over all and over all but the layer's
    # parameters) computes megatron-core's gradient norm (its all-reduce on the group) and clips by it
    for result in gloo_pool(2).run(_clipping_calls, clip_grad, timeout_s=120):
        assert (result["norm"], result["clip"]) == (calls, calls)
        assert result["fixed_ms"] > 0
