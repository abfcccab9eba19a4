"""One model builder for megatron-core 0.16.1 (installed) and 0.12.2 (MindSpeed-LLM's core, in .cache/mcore012).

Each case runs a fresh interpreter whose ``PYTHONPATH`` puts the core under test first (as
``test_patches.py`` does for 0.12.2), on a gloo group of ``WORLD`` processes it spawns itself: a
one-layer GPTModel built through ``megatron_model`` runs forward and backward on explicit groups
(``process_groups`` + ``parallel_state_for``, the profiler's path), and the profiler's ``measure()`` runs
on the same groups. The numbers checked are independent of timing: the loss is finite, every parameter
got a gradient, the layer's parameter count matches a count made from the shapes by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.dist.conftest import in_background, selected  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE012 = os.path.join(REPO, ".cache", "mcore012")
H, FFN = 32, 128

_BODY = textwrap.dedent("""
    import dataclasses, json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    H, SEQ, VOCAB = 32, 8, 64
    JOB = ["--num-layers", "4", "--hidden-size", str(H), "--num-attention-heads", "2", "--seq-length", str(SEQ),
           "--vocab-size", str(VOCAB), "--global-batch-size", "8", "--hidden-dropout", "0",
           "--attention-dropout", "0"]

    def rank_main(rank, world, port, out):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        import megatron.core
        from poseidon_plugin.emulation import cpu_shim
        from poseidon_plugin.runtime import devices, megatron_model, profiler
        from poseidon_plugin.runtime.job_flags import read_job
        cpu_shim.install()
        solo = [dist.new_group([r]) for r in range(world)][rank]
        tp_group = dist.new_group(list(range(world)))
        groups = megatron_model.process_groups(tp=tp_group, pp=solo, cp=solo)
        job = read_job("t.py", JOB)
        config = megatron_model.transformer_config(job, tensor_parallel=world, num_layers=1, on_cpu=True)
        torch.manual_seed(5)
        with megatron_model.parallel_state_for(groups):
            model = megatron_model.gpt_model(job, config, pre_process=True, post_process=True,
                                             pg_collection=groups)
            tokens = torch.randint(0, VOCAB, (2, SEQ))
            positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
            loss = model(tokens, positions, None, labels=tokens)
            loss.float().mean().backward()
            entry = profiler.measure(job, devices.Device(rank), groups,
                                     profiler.ProfileRequest(device_type="cpu", tp=world, mbs=2),
                                     warmup=1, iters=2)
        from megatron.core import parallel_state as ps
        result = {
            "version": megatron.core.__version__,
            "features": dataclasses.asdict(megatron_model.core_features()),
            "loss_shape": list(loss.shape),
            "loss_finite": bool(torch.isfinite(loss).all()),
            "missing_grads": [n for n, p in model.named_parameters() if p.grad is None],
            "layer_numbers": [layer.layer_number for layer in model.decoder.layers],
            "layer_params": sum(p.numel() for p in model.decoder.layers[0].parameters()),
            "entry": entry,
            "restored": ps._PIPELINE_MODEL_PARALLEL_GROUP is None and ps._TENSOR_MODEL_PARALLEL_GROUP is None,
        }
        out.put((rank, result))
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, port = int(sys.argv[1]), int(sys.argv[2])
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=240) for _ in range(world))
        for p in procs:
            p.join(timeout=30)
        print("RESULT " + json.dumps([results[r] for r in range(world)]), flush=True)
""")


def _run(tmp_path, stack: str | None, world: int) -> list[dict]:
    from tests.dist.conftest import free_port

    script = tmp_path / "builder_case.py"
    script.write_text(_BODY)
    path = [REPO] if stack is None else [stack, REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(world), str(free_port())], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _layer_params(tp: int) -> int:
    """Local-spec GPT layer (biases, LayerNorm, GELU MLP with ffn = 4h, MHA), per TP rank."""
    layernorms = 2 * (2 * H)
    qkv = 3 * H * H // tp + 3 * H // tp
    proj = H * H // tp + H
    fc1 = FFN * H // tp + FFN // tp
    fc2 = H * FFN // tp + H
    return layernorms + qkv + proj + fc1 + fc2


def _check(results: list[dict], world: int) -> None:
    assert len(results) == world
    for result in results:
        assert result["loss_shape"] == [2, 8]                  # per-token loss, [batch, seq]
        assert result["loss_finite"]
        assert result["missing_grads"] == []
        assert result["layer_numbers"] == [1]
        assert result["layer_params"] == _layer_params(world)
        assert result["restored"], "parallel_state_for left groups behind"
        entry = result["entry"]
        assert entry["layer_params"] == _layer_params(world)
        assert entry["send_bytes"] == 8 * 2 * H * 4            # fp32 hidden states [seq, mbs, h]
        assert entry["forward_ms"] > 0 and entry["backward_ms"] > 0
        assert entry["activation_bytes"] > entry["send_bytes"]


needs_012 = pytest.mark.skipif(not os.path.isdir(MCORE012), reason=(
    "megatron-core 0.12.2 (MindSpeed-LLM's core) not provided; install it with: pip install --no-deps "
    "--target .cache/mcore012 megatron-core==0.12.2"))


INSTALLED_TEST = "test_builder_and_measure_on_installed_core"
CORE_012_TEST = "test_builder_and_measure_on_megatron_core_012"


@pytest.fixture(scope="module", autouse=True)
def builder_runs(request, tmp_path_factory):
    """Every case's interpreter, all started with the module's first test (each on a port of its own; what
    they check does not depend on the load): ``(stack, world)`` -> the future of :func:`_run`'s results."""
    stacks = ([None] if selected(request, INSTALLED_TEST) else []) + (
        [MCORE012] if selected(request, CORE_012_TEST) and os.path.isdir(MCORE012) else [])
    calls = {(stack, world): (lambda stack=stack, world=world, tmp=tmp_path_factory.mktemp("case"): _run(tmp, stack, world))
             for stack in stacks for world in (1, 2)}
    with in_background(calls) as runs:
        yield runs


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_builder_and_measure_on_installed_core(builder_runs, world):
    results = builder_runs[None, world].result()
    assert results[0]["features"]["gpt_pg_collection"] and results[0]["features"]["layout"]
    _check(results, world)


@needs_012
@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_builder_and_measure_on_megatron_core_012(builder_runs, world):
    results = builder_runs[MCORE012, world].result()
    assert results[0]["version"].startswith("0.12"), results[0]["version"]
    features = results[0]["features"]
    # What the builder had to work around on this core, found by inspection.
    assert not features["gpt_vp_stage"] and not features["gpt_pg_collection"]
    assert not features["process_group_collection"] and not features["layout"]
    _check(results, world)
