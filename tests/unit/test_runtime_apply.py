"""Applying a plan's flags in each style (Megatron layout, MindSpeed-LLM layout backport or --num-layer-list,
patch-only), the MindSpeed flag rules on the rewritten command line, and each style's patch tables."""

from __future__ import annotations

import pytest

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.plan import parse_megatron_args, parse_mindspeed_args
from poseidon_plugin.runtime import mindspeed
from poseidon_plugin.runtime.apply import (allowed_schedules, layer_patches, planned_flags, resolve_style,
                                           rewrite_args)
from poseidon_plugin.runtime.job_flags import flag_values
from poseidon_plugin.runtime.mindspeed import MindSpeedError
from poseidon_plugin.specs import ModelSpec, parse_cluster


def _plan(layers, v=1, tp=1, dp=1, mbs=1, experts=0, ep=1, etp=None):
    cluster = parse_cluster({"name": "c", "device_types": ["A2-2", "A2-4"],
                             "nodes": [{"device_type": "A2-2", "count": 1, "devices_per_node": 4},
                                       {"device_type": "A2-4", "count": 1, "devices_per_node": 4}],
                             "links": "npu"})
    model = ModelSpec(name="m", num_layers=sum(layers), hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                      num_query_groups=8, vocab_size=1000, seq_length=128, global_batch_size=16,
                      num_experts=experts, moe_top_k=2 if experts else 0)
    pp = len(layers) // v
    cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, stage_types=tuple(["A2-2", "A2-4"][i * 2 // pp] for i in range(pp)),
                     layers=tuple(layers), schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                     ep=ep, etp=etp)
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
    assignment, helper = layer_patches(plan, "mindspeed", installed=lambda name: object())
    assert not assignment.applied and not helper.applied
    assert {row.target.rsplit(".", 1)[1] for row in assignment.rows} == {"get_num_layers_to_build",
                                                                           "get_transformer_layer_offset"}
    assert [row.target for row in helper.rows] == ["mindspeed.core.transformer.transformer_block._get_layer_offset"]
    assert all(row.sweep for row in assignment.rows + helper.rows)


@pytest.mark.parametrize("style, kinds", [
    ("megatron", []),
    ("mindspeed-layout", ["mindspeed-layer-offset"]),
    ("mindspeed", ["layer-assignment", "mindspeed-layer-offset"]),
    ("patch", ["layer-assignment"]),
])
def test_each_style_patches_what_its_stack_lacks(style, kinds):
    plan = _plan((3, 5))
    tables = layer_patches(plan, style, installed=lambda name: object())
    assert [t.name.split()[0] for t in tables] == kinds
    # without MindSpeed there is no offset helper to replace
    without = layer_patches(plan, style, installed=lambda name: None)
    assert [t.name.split()[0] for t in without] == [k for k in kinds if k != "mindspeed-layer-offset"]


def test_mindspeed_layout_style_uses_the_layout_flag_with_virtual_stages():
    plan = _plan((1, 2, 3, 2), v=2)
    parsed = parse_megatron_args(planned_flags(plan, "mindspeed-layout", 16))
    assert (parsed.pp, parsed.layers) == (2, (1, 2, 3, 2))
    assert "interleaved-1f1b" in allowed_schedules("mindspeed-layout")


def test_mindspeed_style_at_pp_1_has_no_layer_list():
    values = flag_values(planned_flags(_plan((8,), dp=2), "mindspeed", 16))
    assert "--num-layer-list" not in values and values["--pipeline-model-parallel-size"] == "1"


USER = ["--num-layers", "8", "--lr", "0.1", "--pipeline-num-transformer-layers", "[[4],[4]]",
        "--pipeline-model-parallel-size", "4", "--num-layer-list", "2,2,2,2"]


def test_mindspeed_rewrite_drops_conflicts_and_keeps_the_rest():
    out = rewrite_args(_plan((3, 5)), "mindspeed", 16, USER)
    values = flag_values(out.args)
    assert out.args[:4] == ["--num-layers", "8", "--lr", "0.1"]
    assert "--pipeline-num-transformer-layers" not in values
    assert (values["--num-layer-list"], values["--pipeline-model-parallel-size"]) == ("3,5", "2")
    assert out.planned == out.args[4:] and "dropped --pipeline-num-transformer-layers" in out.notes[-1]
    assert out.notes[0] == "--pipeline-model-parallel-size 4 replaced by the plan's --pipeline-model-parallel-size 2"


def test_mindspeed_rewrite_adds_sequence_parallel_for_moe_with_tp_and_ep():
    user = ["--num-layers", "8", "--num-experts", "4"]
    plan = _plan((3, 5), tp=2, dp=2, experts=4, ep=2)
    out = rewrite_args(plan, "mindspeed", 16, user)
    assert out.args.count("--sequence-parallel") == 1 and "--sequence-parallel" in out.planned
    assert any("added --sequence-parallel" in note for note in out.notes)
    assert flag_values(out.args)["--expert-model-parallel-size"] == "2"
    # the same job in the megatron style is passed through as given
    assert "--sequence-parallel" not in rewrite_args(plan, "megatron", 16, user).args


@pytest.mark.parametrize("style", ["megatron", "mindspeed", "mindspeed-layout", "patch"])
def test_the_plan_s_expert_layout_replaces_the_user_s(style):
    """The user's EP / expert TP give way to the plan's in every style (they are planned flags), with a note."""
    user = ["--num-layers", "8", "--num-experts", "4", "--expert-model-parallel-size", "4",
            "--expert-tensor-parallel-size", "2", "--sequence-parallel"]
    out = rewrite_args(_plan((3, 5), tp=2, dp=2, experts=4, ep=2, etp=1), style, 16, user)
    values = flag_values(out.args)
    assert (values["--expert-model-parallel-size"], values["--expert-tensor-parallel-size"],
            values["--moe-token-dispatcher-type"]) == ("2", "1", "alltoall")
    assert out.args.count("--expert-model-parallel-size") == 1
    assert "--expert-model-parallel-size 4 replaced by the plan's --expert-model-parallel-size 2" in out.notes


@pytest.mark.parametrize("extra, match", [
    (["--noop-layers", "7"], r"--noop-layers '7' conflicts with Poseidon's split.*drop --noop-layers"),
    (["--schedules-method", "dualpipev"], r"drop --schedules-method dualpipev"),
    (["--context-parallel-size", "2"], r"2 ranks do not fit TP 1 x PP 2 x CP 2"),
    (["--expert-model-parallel-size", "0"], r"--expert-model-parallel-size '0' is invalid"),
])
def test_mindspeed_rewrite_refuses_with_the_fix(extra, match):
    with pytest.raises(MindSpeedError, match=match):
        rewrite_args(_plan((3, 5)), "mindspeed", 16, ["--num-layers", "8", *extra])


def test_mindspeed_rewrite_accepts_cp_that_divides_the_world():
    out = rewrite_args(_plan((3, 5), dp=2), "mindspeed", 16, ["--num-layers", "8", "--context-parallel-size", "2"])
    assert flag_values(out.args)["--context-parallel-size"] == "2"
    assert mindspeed.data_parallel_size(4, 1, 2, cp=2) == 1


def test_patch_style_has_no_layer_flag():
    plan = _plan((3, 5))
    values = flag_values(planned_flags(plan, "patch", 16))
    assert "--pipeline-model-parallel-layout" not in values and "--num-layer-list" not in values
    assert values["--pipeline-model-parallel-size"] == "2"
    assert layer_patches(plan, "megatron") == []


@pytest.mark.parametrize("style, match", [("mindspeed", "--num-layer-list cannot express virtual_stages = 2.*"
                                                       "--poseidon-flag-style mindspeed-layout"),
                                          ("patch", "--poseidon-flag-style patch cannot express virtual_stages = 2")])
def test_virtual_stages_need_the_layout_flag(style, match):
    with pytest.raises(PoseidonError, match=match):
        planned_flags(_plan((1, 2, 3, 2), v=2), style, 16)
    assert allowed_schedules(style) == ("1f1b",)
    assert "interleaved-1f1b" in allowed_schedules("megatron")


@pytest.mark.parametrize("style", ["megatron", "mindspeed-layout", "mindspeed", "patch"])
def test_explicit_style_is_kept(style):
    # "auto" inspects the installed Megatron (imports torch): exercised by the dist launch tests.
    assert resolve_style(style) == style


def test_auto_style_is_the_detected_one():
    assert resolve_style("auto") == mindspeed.choose_style()
