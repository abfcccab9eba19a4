"""The watch times the span the prediction covers: from one training step's start to the next's."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.patches import watch_hooks as watch_patch  # noqa: E402
from poseidon_plugin.runtime.placement import planned_layers  # noqa: E402
from poseidon_plugin.runtime.watch import SPAN, Watch  # noqa: E402
from poseidon_plugin.specs import load_cluster, load_model  # noqa: E402


class _Clock:
    """A device whose marks are given times (ms)."""

    kind = "cuda"

    def synchronize(self) -> None:
        pass

    def ms_between(self, start: float, stop: float) -> float:
        return stop - start


def _watch(iterations: int, lines: list[str]) -> Watch:
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    plan = cm.make_plan(Candidate(tp=8, pp=1, dp=1, mbs=1, stage_types=(cm.device_types[0],), layers=(32,)))
    plan = dataclasses.replace(plan, predicted_iteration_ms=100.0, profile_source="measured")
    watch_patch.built_layers[:] = planned_layers(plan, 0)
    return Watch(plan=plan, global_rank=0, stage=0, device=_Clock(), iterations=iterations, log=lines.append,
                 log_rank0=lines.append)


def test_iteration_is_step_start_to_next_step_start():
    lines: list[str] = []
    watch = _watch(3, lines)
    # schedule calls of 80 ms each; 20 ms between them (optimizer step, zeroing, logging) are part of it
    starts = [0.0, 100.0, 205.0, 310.0, 420.0]
    for index, start in enumerate(starts, 1):
        watch.on_iteration(index, start, start + 80.0)
    assert watch.measured_ms == [100.0, 105.0, 105.0]     # iterations 1-3; the 4th call's start ends the 3rd
    assert lines[0] == "stage 0 on A2-2 built layers 1-32 as planned"
    assert lines[1] == f"iteration 1: measured 100.0 ms, predicted 100.0 ms (+0.0%; {SPAN})"
    assert lines[-1] == f"watch: median of iterations 2-3: measured 105.0 ms vs predicted 100.0 ms (+5.0%); span: {SPAN}"


def test_short_run_is_summarised_with_what_was_measured():
    lines: list[str] = []
    watch = _watch(3, lines)
    for index, start in enumerate([0.0, 100.0, 230.0], 1):   # 3 training steps: 2 whole iterations
        watch.on_iteration(index, start, start + 80.0)
    assert watch.measured_ms == [100.0, 130.0]
    watch.summarize()                                        # what bootstrap does after the script
    assert lines[-2] == (f"watch: median of iteration 2: measured 130.0 ms vs predicted 100.0 ms (+30.0%); "
                         f"span: {SPAN}")
    assert lines[-1].startswith("WARNING: measured iteration time is +30.0% off the prediction")
