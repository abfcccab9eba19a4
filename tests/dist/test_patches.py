"""Patch tables on real megatron-core: layer assignment (0.16 installed; 0.12.2 if provided), emulation, watch.

Layer assignment is checked by building real GPTModel chunks on a gloo pipeline and reading the global
layer numbers each rank built, against the split computed independently from the plan's layer list.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MCORE012 = os.path.join(REPO, ".cache", "mcore012")
JOB = ["--num-layers", "{n}", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "8",
       "--vocab-size", "64"]


def expected_layers(layers: tuple[int, ...], pp: int, rank: int) -> list[list[int]]:
    """Global 1-based layer numbers per chunk of a pipeline rank (virtual stage vs = chunk x pp + rank)."""
    out = []
    for chunk in range(len(layers) // pp):
        vs = chunk * pp + rank
        start = sum(layers[:vs]) + 1
        out.append(list(range(start, start + layers[vs])))
    return out


def _build_with_layer_patch(rank: int, world: int, layers: tuple[int, ...]) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_layer

    from poseidon_plugin.patches import layer_assignment
    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.megatron_model import gpt_model, transformer_config

    cpu_shim.install()
    pp = world
    vpp = len(layers) // pp
    original = transformer_layer.get_transformer_layer_offset
    job = read_job("t.py", [a.format(n=sum(layers)) for a in JOB])
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    table = layer_assignment.table(layers, pp)
    table.apply()
    try:
        problems = table.verify()
        swept = gpt_layer_specs.get_transformer_layer_offset is transformer_layer.get_transformer_layer_offset
        config = transformer_config(job, tensor_parallel=1, pipeline_parallel=pp, on_cpu=True,
                                    virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        built = []
        for chunk in range(vpp):
            stage = chunk if vpp > 1 else None
            model = gpt_model(job, config, vp_stage=stage,
                              pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                              post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage))
            built.append([layer.layer_number for layer in model.decoder.layers])
    finally:
        table.revert()
        ps.destroy_model_parallel()
    restored = (transformer_layer.get_transformer_layer_offset is original
                and gpt_layer_specs.get_transformer_layer_offset is original)
    return {"built": built, "problems": problems, "swept": swept, "restored": restored}


@pytest.mark.parametrize("layers", [(3, 1), (1, 4), (1, 2, 3, 2)], ids=["3-1", "1-4", "vpp2-1-2-3-2"])
def test_layer_assignment_patch_builds_planned_layers(gloo_pool, layers):
    results = gloo_pool(2).run(_build_with_layer_patch, layers, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["problems"] == []
        assert result["swept"], "the by-name copy in gpt_layer_specs was not rebound"
        assert result["built"] == expected_layers(layers, 2, rank)
        assert result["restored"]


# One process: on 0.12 the split functions read the pipeline rank from parallel_state, which can be set
# without a process group; a TransformerBlock is what builds the layers.
_MCORE012_BODY = textwrap.dedent("""
    import torch
    import megatron.core
    assert megatron.core.__version__.startswith("0.12"), megatron.core.__version__
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock
    from poseidon_plugin.patches import layer_assignment
    ps.set_tensor_model_parallel_world_size(1)
    ps.set_tensor_model_parallel_rank(0)
    ps.set_pipeline_model_parallel_world_size(2)
    table = layer_assignment.table((3, 1), 2)
    table.apply()
    assert table.verify() == [], table.verify()
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2, pipeline_model_parallel_size=2,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    for rank in range(2):
        ps.set_pipeline_model_parallel_rank(rank)
        block = TransformerBlock(config, get_gpt_layer_local_spec(), pre_process=rank == 0, post_process=rank == 1)
        print("BUILT", rank, [layer.layer_number for layer in block.layers], flush=True)
    table.revert()
    from megatron.core.transformer import transformer_block
    assert not hasattr(transformer_block.get_num_layers_to_build, "__poseidon_patch__")
""")


@pytest.mark.skipif(not os.path.isdir(MCORE012), reason=(
    "megatron-core 0.12.2 (MindSpeed-LLM's core, no layout flag) not provided; install it with: pip install "
    "--no-deps --target .cache/mcore012 megatron-core==0.12.2"))
def test_layer_assignment_patch_on_megatron_core_012(tmp_path):
    script = tmp_path / "build012.py"
    script.write_text(_MCORE012_BODY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MCORE012, REPO]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    built = [line.split(" ", 2)[1:] for line in proc.stdout.splitlines() if line.startswith("BUILT")]
    assert built == [["0", "[1, 2, 3]"], ["1", "[4]"]]


# --- emulation ------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """A stand-in with a TransformerLayer-like signature: keyword hidden_states in, (output, context) out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, hidden_states, attention_mask=None):
        return torch.tanh(self.linear(hidden_states)) + hidden_states, None


def test_emulation_stretches_forward_and_backward_without_changing_numbers(monkeypatch):
    from poseidon_plugin.emulation import compute_patch as emulation

    sleeps: list[float] = []
    monkeypatch.setattr(emulation, "_sleep", sleeps.append)
    stretched = emulation._stretched(("hidden_states",))(_Block.forward)
    block = _Block()
    x = torch.randn(3, 4, requires_grad=True)
    ref_out, _ = block(hidden_states=x)
    ref_out.sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    monkeypatch.setattr(emulation, "_state", {"factor": 3.0})
    out, context = stretched(block, hidden_states=x)
    assert len(sleeps) == 1 and sleeps[0] > 0  # forward: 2x its own compute time
    out.sum().backward()
    assert len(sleeps) == 2 and sleeps[1] > 0  # backward, once the input gradient is complete
    assert context is None and torch.equal(out, ref_out) and torch.equal(x.grad, ref_grad)
    monkeypatch.setattr(emulation, "_state", {"factor": 1.0})
    stretched(block, hidden_states=x)[0].sum().backward()
    assert len(sleeps) == 2  # factor 1: the original path, no sleeping


def test_emulation_and_watch_tables_apply_to_installed_megatron():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from poseidon_plugin.emulation import compute_patch as emulation
    from poseidon_plugin.patches import watch_hooks as watch

    original = TransformerLayer.forward
    for table in (emulation.TABLE, watch.TABLE):
        table.apply()
        assert table.verify() == []
    import megatron.core.pipeline_parallel as pipeline_parallel

    assert getattr(pipeline_parallel.get_forward_backward_func, "__poseidon_patch__") == "watch"
    for table in (watch.TABLE, emulation.TABLE):
        table.revert()
    assert TransformerLayer.forward is original
    assert not hasattr(pipeline_parallel.get_forward_backward_func, "__poseidon_patch__")


def test_emulation_factor_must_not_speed_up():
    from poseidon_plugin.emulation import compute_patch as emulation

    with pytest.raises(ValueError, match="must be >= 1.0"):
        emulation.set_factor(0.5)


# --- CPU shim and profiling: megatron-core state changed through tables ------------------------------


def test_cpu_shim_is_a_verified_reversible_table():
    """The shim's torch.cuda stand-ins and megatron-core's RNG tracker go through emulation/cpu_shim_patch.py: verified
    after install, and install/uninstall restore the exact objects (tracker included)."""
    from megatron.core.tensor_parallel import random as mc_random

    from poseidon_plugin.emulation import cpu_shim_patch as shim_table
    from poseidon_plugin.emulation import cpu_shim

    if cpu_shim.installed():
        pytest.skip("the shim is installed process-wide by an earlier test")
    before = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "Stream", "Event")}
    tracker = (mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    assert cpu_shim.install(force=True)
    try:
        assert shim_table.TABLE.verify() == []
        assert {row.target.rsplit(".", 1)[1] for row in shim_table.TABLE.rows} >= {
            "_CUDA_RNG_STATE_TRACKER", "current_device", "synchronize", "Stream", "Event"}
        assert mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED is True
        assert type(mc_random.get_cuda_rng_tracker()).__name__ == "CpuRNGStatesTracker"
        torch.cuda.synchronize = lambda device=None: None  # someone else's patch on top: verify() notices
        assert shim_table.TABLE.verify() == ["torch.cuda.synchronize is not patched"]
    finally:
        cpu_shim.uninstall()
    assert not cpu_shim.installed()
    assert {name: getattr(torch.cuda, name) for name in before} == before
    assert (mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED) == tracker


def test_profiling_table_points_parallel_state_at_a_group_and_back():
    from megatron.core import parallel_state as ps

    from poseidon_plugin.patches import profiling

    names = ("_TENSOR_MODEL_PARALLEL_GROUP", "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
             "_MPU_TENSOR_MODEL_PARALLEL_RANK", "_GLOBAL_MEMORY_BUFFER")
    before = {name: getattr(ps, name) for name in names}
    group = object()  # identity is all the table handles
    table = profiling.table(group)
    table.apply()
    try:
        assert table.verify() == []
        assert ps._TENSOR_MODEL_PARALLEL_GROUP is group and ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
        assert ps.get_global_memory_buffer() is not None
        ps._MPU_TENSOR_MODEL_PARALLEL_RANK = 3  # a write behind the table's back shows up
        assert table.verify() == ["megatron.core.parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK is not patched"]
    finally:
        table.revert()
    assert all(getattr(ps, name) is value for name, value in before.items())
