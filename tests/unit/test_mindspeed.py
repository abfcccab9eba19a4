"""MindSpeed-LLM style, pure logic: start-up order through a fake process, flag rules, world-size rule,
layout-backport detection (torch-free; the real adaptor is replaced by a recording fake)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import mindspeed
from poseidon_plugin.runtime.mindspeed import MindSpeedError, StartupError


class FakeHost:
    """A process: argv, sys.modules, imports. Importing the adaptor package runs the fake adaptor, which
    (like the real one) reads argv at import and offers ``repatch(config)``."""

    def __init__(self, *, ascend: bool = False, megatron_early: bool = False, with_repatch: bool = True) -> None:
        self.argv = ["bootstrap"]
        self.ascend = ascend
        self.mods: dict[str, object] = {"os": object()}
        if megatron_early:
            self.mods["megatron.core"] = object()
        self.events: list[tuple] = []
        self.with_repatch = with_repatch

    def on_ascend(self) -> bool:
        return self.ascend

    def modules(self):
        return self.mods

    def import_module(self, name: str):
        self.events.append(("import", name, tuple(self.argv)))
        module = types.ModuleType(name)
        if name == mindspeed.ADAPTOR_PACKAGE:
            adaptor = types.ModuleType(mindspeed.ADAPTOR_MODULE)
            adaptor.chosen_for = tuple(self.argv)  # what the real adaptor parses at import
            if self.with_repatch:
                def repatch(config):
                    self.events.append(("repatch", tuple(self.argv), dict(config)))
                adaptor.repatch = repatch
            self.mods[mindspeed.ADAPTOR_MODULE] = adaptor
        self.mods[name] = module
        return module


class FakeTable:
    def __init__(self, name: str, log: list, overwritten: bool = False) -> None:
        self.name, self.log, self.overwritten = name, log, overwritten

    def apply(self) -> None:
        self.log.append(("apply", self.name))

    def verify(self) -> list[str]:
        return ["megatron.core.transformer.transformer_block.get_num_layers_to_build is not patched"] \
            if self.overwritten else []


PLANNED = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--num-layer-list", "3,5", "--micro-batch-size", "2"]


def _start(host: FakeHost, tables=None):
    user = ["--num-layers", "8", "--tensor-model-parallel-size", "4"]
    new_args = ["--num-layers", "8", *PLANNED]

    def plan_flags():
        host.events.append(("plan",))
        host.mods["megatron.core"] = object()  # planning imports megatron (profiling): allowed from here on
        return new_args, PLANNED

    log: list = []
    result = mindspeed.start_up(host, script="pretrain_gpt.py", user_args=user, plan_flags=plan_flags,
                                tables=lambda: tables(log) if tables else [FakeTable("layer-assignment", log)])
    return result, log, user, new_args


def test_start_up_order_on_ascend():
    host = FakeHost(ascend=True)
    result, log, user, new_args = _start(host)
    assert result.steps == ["transfer_to_npu", "adaptor", "plan", "repatch", "poseidon patches"]
    kinds = [e[0] if e[0] != "import" else e[1] for e in host.events]
    assert kinds == [mindspeed.TRANSFER_TO_NPU, mindspeed.ADAPTOR_PACKAGE, "plan", "repatch"]
    # The adaptor chose its patches for the user's command line ...
    assert result.adaptor.chosen_for == ("pretrain_gpt.py", *user)
    # ... and re-chose them with argv already the planned command line, the plan's values given too.
    repatch = host.events[-1]
    assert repatch[1] == ("pretrain_gpt.py", *new_args)
    assert repatch[2] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                          "num_layer_list": "3,5", "micro_batch_size": 2}
    assert log == [("apply", "layer-assignment")]
    assert host.argv == ["pretrain_gpt.py", *new_args]


def test_start_up_off_ascend_skips_transfer_to_npu():
    host = FakeHost(ascend=False)
    result, _, _, _ = _start(host)
    assert result.steps == ["adaptor", "plan", "repatch", "poseidon patches"]
    assert (("import", mindspeed.TRANSFER_TO_NPU)) not in [e[:2] for e in host.events]


@pytest.mark.parametrize("ascend", [True, False])
def test_megatron_imported_before_adaptor_is_refused(ascend):
    host = FakeHost(ascend=ascend, megatron_early=True)
    with pytest.raises(StartupError, match=r"megatron\.core was imported before"):
        _start(host)
    assert not [e for e in host.events if e[0] == "import" and e[1] == mindspeed.ADAPTOR_PACKAGE]


def test_adaptor_without_repatch_is_a_clear_error():
    host = FakeHost(with_repatch=False)
    with pytest.raises(MindSpeedError, match=r"has no repatch\(\) \(releases before 26\.0\.0\).*26\.0\.0 or 26\.1\.0"):
        _start(host)
    assert issubclass(MindSpeedError, PoseidonError)


def test_overwritten_patch_is_caught_after_applying():
    def tables(log):
        return [FakeTable("mindspeed-offset", log), FakeTable("layer-assignment", log, overwritten=True)]

    with pytest.raises(StartupError, match=r"'layer-assignment' was overwritten.*get_num_layers_to_build"):
        _start(FakeHost(), tables)


@pytest.mark.parametrize("flags, expected", [
    (["--micro-batch-size", "4", "--num-layer-list", "1,2"], {"micro_batch_size": 4, "num_layer_list": "1,2"}),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"],
     {"sequence_parallel": True, "tensor_model_parallel_size": 2}),
    ([], {}),
])
def test_repatch_config(flags, expected):
    assert mindspeed.repatch_config(flags) == expected


def test_repatch_config_rejects_a_stray_value():
    with pytest.raises(ValueError, match="--flag value pairs, got '2' at position 0"):
        mindspeed.repatch_config(["2"])


# --- flag rules --------------------------------------------------------------------------------------


def test_layer_list_only_with_two_or_more_stages():
    assert mindspeed.layer_list_flags(tp=2, pp=2, layers=(3, 5), micro_batch_size=1) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layer-list", "3,5", "--micro-batch-size", "1"]
    single = mindspeed.layer_list_flags(tp=1, pp=1, layers=(8,), micro_batch_size=2)
    assert "--num-layer-list" not in single and single[:4] == [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]


def test_layer_list_needs_one_entry_per_stage():
    with pytest.raises(MindSpeedError, match="one layer count per pipeline stage; the plan has 4 stages for PP 2"):
        mindspeed.layer_list_flags(tp=1, pp=2, layers=(1, 2, 3, 2), micro_batch_size=1)


def test_noop_layers_refused_with_the_fix():
    with pytest.raises(MindSpeedError, match=r"--noop-layers '0,7' conflicts .*silently sets --num-layer-list to "
                                             r"None.*drop --noop-layers"):
        mindspeed.check_user_flags({"--noop-layers": "0,7"}, tp=1, pp=2, ep=1, num_experts=0)


def test_dualpipev_refused_with_the_fix():
    with pytest.raises(MindSpeedError, match="--schedules-method dualpipev .*drop --schedules-method dualpipev"):
        mindspeed.check_user_flags({"--schedules-method": "dualpipev"}, tp=1, pp=2, ep=1, num_experts=0)


def test_pipeline_num_transformer_layers_dropped_and_said():
    decision = mindspeed.check_user_flags({"--pipeline-num-transformer-layers": "[[2],[6]]",
                                           "--schedules-method": "1f1b"}, tp=1, pp=2, ep=1, num_experts=0)
    assert decision.drop == ("--pipeline-num-transformer-layers",) and decision.add == ()
    assert decision.notes == ("dropped --pipeline-num-transformer-layers '[[2],[6]]': MindSpeed refuses it next to "
                              "--num-layer-list (unaligned_pineline_feature.py); the plan decides the split",)


@pytest.mark.parametrize("tp, ep, experts, given, added", [
    (2, 2, 8, False, True),     # MoE, TP > 1, EP > 1: core 0.12 raises without it
    (2, 2, 8, True, False),     # already given
    (1, 4, 8, False, False),    # TP 1: sequence parallelism does not exist
    (2, 1, 8, False, False),    # EP 1
    (2, 2, 0, False, False),    # dense
])
def test_sequence_parallel_for_moe(tp, ep, experts, given, added):
    user = {"--sequence-parallel": ""} if given else {}
    decision = mindspeed.check_user_flags(user, tp=tp, pp=2, ep=ep, num_experts=experts)
    assert decision.add == (("--sequence-parallel",) if added else ())
    assert bool(decision.notes) == added


# --- world size -------------------------------------------------------------------------------------


def _reference_fits(world: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> bool:
    """Core 0.12's initialize_model_parallel divisibility checks, restated."""
    return world % (tp * pp * cp) == 0 and world % (etp * ep * pp) == 0


@pytest.mark.parametrize("tp, pp, cp, ep, etp", [(2, 2, 1, 1, None), (2, 2, 2, 1, None), (1, 2, 1, 4, None),
                                                 (2, 2, 1, 4, 1), (4, 1, 2, 2, None), (2, 3, 1, 3, None)])
def test_model_parallel_world_matches_the_divisibility_rule(tp, pp, cp, ep, etp):
    unit = mindspeed.model_parallel_world(tp, pp, cp, ep, etp)
    e = tp if etp is None else etp
    fitting = [w for w in range(1, 4 * unit + 1) if _reference_fits(w, tp, pp, cp, ep, e)]
    assert fitting == [unit * k for k in range(1, 5)]
    for world in fitting:
        assert mindspeed.data_parallel_size(world, tp, pp, cp, ep, etp) == world // (tp * pp * cp)


def test_world_that_does_not_fit_names_the_degrees():
    with pytest.raises(MindSpeedError, match=r"12 ranks do not fit TP 2 x PP 2 x CP 1 \(dense\) and expert TP 2 x "
                                             r"EP 2 x PP 2 \(experts\): the world must be a multiple of 8"):
        mindspeed.data_parallel_size(12, 2, 2, 1, 2)


def test_cp_and_ep_change_the_world():
    assert mindspeed.model_parallel_world(2, 2) == 4
    assert mindspeed.model_parallel_world(2, 2, cp=2) == 8
    assert mindspeed.model_parallel_world(1, 2, ep=4) == 8
    assert mindspeed.model_parallel_world(1, 2, cp=2, ep=2) == 4   # CP folds into expert DP


def test_user_cp_ep():
    assert mindspeed.user_cp_ep({}) == (1, 1, None)
    assert mindspeed.user_cp_ep({"--context-parallel-size": "2", "--expert-model-parallel-size": "4",
                                 "--expert-tensor-parallel-size": "1"}) == (2, 4, 1)
    with pytest.raises(MindSpeedError, match="--expert-model-parallel-size 'x' is invalid"):
        mindspeed.user_cp_ep({"--expert-model-parallel-size": "x"})


# --- layout backport and style ------------------------------------------------------------------------


def _stack(installed: dict[str, list[str]], shadowed: dict[str, list[str]] | None = None):
    """find_spec / exists over a fake site-packages: {top package: [relative files]}; ``shadowed``: the same
    namespace packages again in a second folder further down the path (e.g. another megatron-core)."""
    files = {f"/site/{top}/{path}" for top, paths in installed.items() for path in paths}
    files |= {f"/later/{top}/{path}" for top, paths in (shadowed or {}).items() for path in paths}

    def find_spec(name):
        if name in installed:
            later = [f"/later/{name}"] if name in (shadowed or {}) else []
            return types.SimpleNamespace(name=name, submodule_search_locations=[f"/site/{name}", *later])
        return None

    return find_spec, files.__contains__


MINDSPEED_2610 = ["__init__.py", "core/__init__.py", "core/pipeline_parallel/__init__.py",
                  "core/pipeline_parallel/pipeline_model_parallel_layout/__init__.py"]
MEGATRON_012 = ["core/__init__.py", "core/transformer/__init__.py", "core/transformer/transformer_block.py"]
MEGATRON_016 = ["core/__init__.py", "core/transformer/__init__.py", "core/transformer/pipeline_parallel_layer_layout.py"]


@pytest.mark.parametrize("installed, style, backport", [
    ({"megatron": MEGATRON_016}, "megatron", False),
    ({"megatron": [], "mindspeed": MINDSPEED_2610, "mindspeed_llm": []}, "mindspeed-layout", True),
    ({"megatron": [], "mindspeed": ["core/__init__.py"], "mindspeed_llm": []}, "mindspeed", False),
    ({"megatron": []}, "patch", False),
])
def test_style_detection(installed, style, backport):
    find_spec, exists = _stack(installed)
    assert mindspeed.choose_style(find_spec, exists) == style
    assert mindspeed.layout_backport(find_spec, exists) is backport


def test_detection_follows_the_first_megatron_core_on_the_path():
    """0.12 first on the path, 0.16 further down (megatron is a namespace package): 0.12 is imported."""
    find_spec, exists = _stack({"megatron": MEGATRON_012}, shadowed={"megatron": MEGATRON_016})
    assert mindspeed.choose_style(find_spec, exists) == "patch"
    find_spec, exists = _stack({"megatron": MEGATRON_016}, shadowed={"megatron": MEGATRON_012})
    assert mindspeed.choose_style(find_spec, exists) == "megatron"


def test_module_is_torch_free_and_detection_imports_nothing():
    code = ("import sys; from poseidon_plugin.runtime import mindspeed; mindspeed.choose_style(); "
            "mindspeed.layout_backport(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'mindspeed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
