"""The layout strings our plans render are accepted by megatron-core's own parser, with the same meaning.

Single process (no process group): megatron-core's ``PipelineParallelLayerLayout`` parses and validates
the string; its per-(pp rank, virtual stage) layer counts and offsets must equal the plan's layers and
first layers. Lives in tests/dist because importing megatron-core imports torch.
"""

from __future__ import annotations

import random

import pytest

layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
parallel_state = pytest.importorskip("megatron.core.parallel_state")
LayerType = pytest.importorskip("megatron.core.transformer.enums").LayerType

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.plan import megatron_args, megatron_layout, parse_megatron_args  # noqa: E402
from poseidon_plugin.specs import load_cluster, load_model  # noqa: E402


def _random_layers(rng: random.Random, n: int, parts: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, n), parts - 1))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [n]))


def _cases():
    rng = random.Random(3)
    cases = [((3, 5, 6, 4, 2), 5), ((16,), 1), ((1, 1), 2), ((3, 5, 6, 4, 2, 4, 4, 4), 4)]
    for _ in range(30):
        pp = rng.randint(1, 8)
        v = rng.randint(1, 3) if pp > 1 else 1
        n = rng.randint(pp * v, 80)
        cases.append((_random_layers(rng, n, pp * v), pp))
    return cases


@pytest.mark.parametrize("layers, pp", _cases())
def test_megatron_parses_our_layout(layers, pp):
    v = len(layers) // pp
    text = megatron_layout(layers)
    parsed = layout_mod.PipelineParallelLayerLayout(text, pp)
    assert parsed.virtual_pipeline_model_parallel_size == v
    parsed.validate_layer_layout(num_layers=sum(layers), mtp_num_layers=None)
    previous = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    try:
        for rank in range(pp):
            for chunk in range(v):
                vs = chunk * pp + rank
                kw = {"pp_rank": rank, "vp_stage": chunk}
                assert parsed.get_num_layers_to_build(LayerType.decoder, **kw) == layers[vs]
                assert parsed.get_layer_offset(LayerType.decoder, **kw) == sum(layers[:vs])
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(previous)


def test_plan_flags_through_megatron_parser():
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    cand = Candidate(tp=2, pp=4, dp=1, mbs=1, stage_types=("A2-2", "A2-2", "A2-3", "A2-3"),
                     layers=(3, 5, 6, 4, 2, 4, 4, 4), schedule="interleaved-1f1b", virtual_stages=2)
    plan = cm.make_plan(cand, 100.0)
    args = megatron_args(plan)
    layout = args[args.index("--pipeline-model-parallel-layout") + 1]
    parsed = layout_mod.PipelineParallelLayerLayout(layout, plan.pp)
    parsed.validate_layer_layout(num_layers=plan.num_layers, mtp_num_layers=None)
    for stage in plan.stages:
        for chunk, n in enumerate(stage.layers):
            assert parsed.layout[stage.index][chunk].count(LayerType.decoder) == n
    assert parse_megatron_args(args).layers == plan.layers
