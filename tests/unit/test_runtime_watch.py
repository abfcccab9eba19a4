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

    def reset_overruns(self) -> None:
        pass

    def overruns(self) -> None:
        return None


class _BehindClock(_Clock):
    """An emulated device whose deadlines were overrun: ``late_ms`` in all, counted from the first step."""

    kind = "emulated"

    def __init__(self, late_ms: float) -> None:
        self.late_ms = late_ms
        self.counted = None

    def reset_overruns(self) -> None:
        self.counted = (0, 0, 0.0)

    def overruns(self) -> tuple[int, int, float, float]:
        assert self.counted is not None, "the watch resets the count when training starts"
        return 600, 240, self.late_ms / 1e3, 2.44


def _watch(iterations: int, lines: list[str], device=None) -> Watch:
    cm = CostModel(load_cluster("paper-setting-1"), load_model("llama3-8b"))
    plan = cm.make_plan(Candidate(tp=8, pp=1, dp=1, mbs=1, stage_types=(cm.device_types[0],), layers=(32,)))
    plan = dataclasses.replace(plan, predicted_iteration_ms=100.0, profile_source="measured")
    watch_patch.built_layers[:] = planned_layers(plan, 0)
    return Watch(plan=plan, global_rank=0, stage=0, device=device or _Clock(), iterations=iterations, log=lines.append,
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


def test_an_emulation_behind_its_deadlines_is_named_as_the_cause():
    lines: list[str] = []
    watch = _watch(3, lines, _BehindClock(late_ms=90.0))        # 90 ms late over 390 ms watched: 23 %
    for index, start in enumerate([0.0, 130.0, 260.0, 390.0], 1):
        watch.on_iteration(index, start, start + 80.0)
    assert lines[-3] == f"watch: median of iterations 2-3: measured 130.0 ms vs predicted 100.0 ms (+30.0%); span: {SPAN}"
    assert lines[-2] == ("emulation: 240 of 600 compute passes of rank 0 ended past their deadline, 90 ms in all over the "
                         "watched iterations (23% of them): this host's CPU cannot run the ranks' real work inside the "
                         "emulated times, so the measured iterations are the host's, not the plan's; give a larger "
                         "SCALE (--poseidon-emulate-model PRESET:SCALE; now 2.44) or fewer ranks per core")
    assert lines[-1].endswith("the profile may not reflect the training (the emulation fell behind its deadlines (above))")


def test_deadlines_overrun_by_a_little_are_not_reported():
    lines: list[str] = []
    watch = _watch(3, lines, _BehindClock(late_ms=15.0))        # 15 ms over 360 ms: under LATE_SHARE
    for index, start in enumerate([0.0, 120.0, 240.0, 360.0], 1):
        watch.on_iteration(index, start, start + 80.0)
    assert lines[-2].startswith("watch: median of iterations 2-3")
    assert lines[-1].endswith("(contention, other jobs, clock changes)")
    assert not any(line.startswith("emulation:") for line in lines)


def test_overruns_are_not_reported_where_the_prediction_holds():
    lines: list[str] = []
    watch = _watch(3, lines, _BehindClock(late_ms=90.0))        # late passes, but the iterations match
    for index, start in enumerate([0.0, 100.0, 200.0, 300.0], 1):
        watch.on_iteration(index, start, start + 80.0)
    assert lines[-1].startswith("watch: median of iterations 2-3")
    assert not any(line.startswith("emulation:") for line in lines)


def test_hold_until_counts_the_compute_passes_that_start_past_their_deadline():
    import time

    from poseidon_plugin.emulation import compute_patch

    compute_patch.reset_overruns()
    now = time.perf_counter()
    compute_patch.hold_until(now - 0.5)                       # the real work ended 0.5 s after the deadline
    compute_patch.hold_until(now - compute_patch.LATE_S / 2)  # within the slack: on time
    compute_patch.hold_until(time.perf_counter() + 0.001)     # ahead: sleeps
    compute_patch.sleep_until(now - 0.5)                      # a link's wait: not a compute pass
    passes, late, late_s = compute_patch.overruns()
    assert (passes, late) == (3, 1)
    assert late_s >= 0.5                                       # read on the clock after the call began
    compute_patch.reset_overruns()
    assert compute_patch.overruns() == (0, 0, 0.0)


def test_an_emulated_device_reports_overruns_only_under_deadlines():
    from poseidon_plugin.emulation import compute_patch
    from poseidon_plugin.runtime.devices import Device, EmulatedDevice

    assert Device(0).overruns() is None
    device = EmulatedDevice(0, type_name="A2-2", memory_bytes=1 << 30, factor=1.0)
    assert device.overruns() is None                       # no deterministic emulation installed
    device.scale = 2.5
    compute_patch.set_targets(lambda part, tp, mbs: (1.0, 2.0))
    try:
        device.reset_overruns()
        compute_patch.hold_until(0.0)                      # long past
        passes, late, late_s, scale = device.overruns()
        assert (passes, late, scale) == (1, 1, 2.5) and late_s > 0
    finally:
        compute_patch.set_targets(None)
        compute_patch.reset_overruns()
    assert device.overruns() is None                       # stretch / off: no deadlines
