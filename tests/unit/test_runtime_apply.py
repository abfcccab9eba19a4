"""Applying a plan's flags in each style (Megatron layout, MindSpeed-LLM --num-layer-list, patch-only)."""

from __future__ import annotations

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.plan import parse_megatron_args, parse_mindspeed_args
from poseidon_plugin.runtime.apply import allowed_schedules, layer_patches, planned_flags, resolve_style
from poseidon_plugin.runtime.job_flags import flag_values
from poseidon_plugin.specs import ModelSpec, parse_cluster


def _plan(layers, v=1, tp=1, dp=1, mbs=1):
    cluster = parse_cluster({"name": "c", "device_types": ["A2-2", "A2-4"],
                             "nodes": [{"device_type": "A2-2", "count": 1, "devices_per_node": 4},
                                       {"device_type": "A2-4", "count": 1, "devices_per_node": 4}],
                             "links": "npu"})
    model = ModelSpec(name="m", num_layers=sum(layers), hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                      num_query_groups=8, vocab_size=1000, seq_length=128, global_batch_size=16)
    pp = len(layers) // v
    cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, stage_types=tuple(["A2-2", "A2-4"][i * 2 // pp] for i in range(pp)),
                     layers=tuple(layers), schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v)
    return CostModel(cluster, model).make_plan(cand)


@pytest.mark.parametrize("layers, v, tp, mbs", [((3, 5), 1, 2, 2), ((1, 3, 3, 1), 1, 1, 1), ((1, 2, 3, 2), 2, 1, 4)])
def test_megatron_style_round_trips(layers, v, tp, mbs):
    plan = _plan(layers, v=v, tp=tp, mbs=mbs)
    flags = planned_flags(plan, "megatron", 16)
    parsed = parse_megatron_args(flags)
    assert (parsed.tp, parsed.pp, parsed.layers, parsed.mbs) == (tp, len(layers) // v, layers, mbs)
    assert flag_values(flags)["--global-batch-size"] == "16"


def test_mindspeed_style_renders_num_layer_list_and_patches():
    plan = _plan((3, 5), tp=2, mbs=2)
    flags = planned_flags(plan, "mindspeed", 16)
    parsed = parse_mindspeed_args(flags)
    assert (parsed.tp, parsed.pp, parsed.layers, parsed.mbs) == (2, 2, (3, 5), 2)
    assert flag_values(flags)["--num-layer-list"] == "3,5"
    table = layer_patches(plan, "mindspeed")
    assert table is not None and not table.applied
    assert {row.target.rsplit(".", 1)[1] for row in table.rows} == {"get_num_layers_to_build",
                                                                      "get_transformer_layer_offset"}
    assert all(row.sweep for row in table.rows)


def test_patch_style_has_no_layer_flag():
    plan = _plan((3, 5))
    values = flag_values(planned_flags(plan, "patch", 16))
    assert "--pipeline-model-parallel-layout" not in values and "--num-layer-list" not in values
    assert values["--pipeline-model-parallel-size"] == "2"
    assert layer_patches(plan, "megatron") is None


@pytest.mark.parametrize("style, match", [("mindspeed", "--num-layer-list cannot express virtual_stages = 2"),
                                          ("patch", "--poseidon-flag-style patch cannot express virtual_stages = 2")])
def test_virtual_stages_need_the_layout_flag(style, match):
    with pytest.raises(PoseidonError, match=match):
        planned_flags(_plan((1, 2, 3, 2), v=2), style, 16)
    assert allowed_schedules(style) == ("1f1b",)
    assert "interleaved-1f1b" in allowed_schedules("megatron")


@pytest.mark.parametrize("style", ["megatron", "mindspeed", "patch"])
def test_explicit_style_is_kept(style):
    # "auto" inspects the installed Megatron (imports torch): exercised by the dist launch tests.
    assert resolve_style(style) == style
