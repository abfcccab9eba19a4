"""The first iterations under the plan: check the layers each rank built, compare time with the prediction.

Installed just before the training script starts (``patches/watch_hooks.py`` does the hooking). On the first
training step every rank compares the global layer numbers it built with the plan's (and stops the job
with a clear error if the script did not honour the rewritten flags). Iterations are timed over the span the
prediction covers (:data:`SPAN`): from the start of one training step (the schedule call) to the start of the
next, i.e. the schedule with its gradient sync, then the optimizer step, zeroing and logging -- what a user
sees between two logged iterations. Iteration ``n`` is therefore known when step ``n + 1`` starts: the first
``--poseidon-watch-iterations`` of them are logged by rank 0 against the prediction, then the median (the
first iteration, which pays one-time allocations, is left out when there are at least two), with a warning
past 10 %. A run that stops earlier is summarised with what was measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from poseidon_plugin.patches import watch_hooks as watch_patch
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.plan import Plan
from poseidon_plugin.plan import format_ranges as ranges
from poseidon_plugin.runtime.devices import Device
from poseidon_plugin.runtime.placement import planned_layers

WARN_FRACTION = 0.10
LATE_SHARE = 0.05
"""Where the watch warns, an emulated rank 0 whose deadlines were overrun for more than this share of the
watched time names that as the cause (a TP peer's jitter makes a few passes late in any run)."""
SPAN = "step start to next step start: schedule, gradient sync, optimizer step"
"""What a watched iteration covers, as its log lines say."""


class Watch:
    """Receives the schedule's timings (via patches/watch_hooks.py) for one rank."""

    def __init__(self, *, plan: Plan, global_rank: int, stage: int, device: Device, iterations: int,
                 log: Callable[[str], None], log_rank0: Callable[[str], None]) -> None:
        self.plan = plan
        self.global_rank = global_rank
        self.stage = stage
        self.device = device
        self.iterations = iterations
        self.log = log
        self.log_rank0 = log_rank0
        self.measured_ms: list[float] = []
        self.priced_elsewhere = priced_elsewhere(plan, device.kind)
        self._last_start: object | None = None

    def install(self) -> None:
        """Apply the watch patches and route their reports here."""
        watch_patch.built_layers.clear()
        watch_patch.configure(on_iteration=self.on_iteration, mark=self.device.mark)
        watch_patch.TABLE.apply()

    def uninstall(self) -> None:
        """Revert the watch patches."""
        watch_patch.TABLE.revert()

    def on_iteration(self, index: int, start: object, stop: object) -> None:
        """Called after each training schedule call (``start``/``stop``: its marks): iteration ``index - 1``
        ends where step ``index`` starts."""
        if index == 1:
            self.check_layers()
            self.device.reset_overruns()
        previous, self._last_start = self._last_start, start
        done = index - 1
        if previous is None or done < 1 or done > self.iterations:
            return
        self.device.synchronize()
        measured = self.device.ms_between(previous, start)
        self.measured_ms.append(measured)
        predicted = self.plan.predicted_iteration_ms
        if self.priced_elsewhere:
            self.log_rank0(f"iteration {done}: measured {measured:.1f} ms (no prediction for this run: "
                           f"{self.priced_elsewhere})")
        else:
            self.log_rank0(f"iteration {done}: measured {measured:.1f} ms, predicted {predicted:.1f} ms "
                           f"({_signed(measured, predicted)}; {SPAN})")
        if done == self.iterations:
            self.summarize()

    def check_layers(self) -> None:
        """The layers this rank built must be exactly the plan's for its stage (global 1-based numbers)."""
        built = sorted(watch_patch.built_layers)
        expected = planned_layers(self.plan, self.stage)
        device_type = self.plan.stages[self.stage].device_type
        if built != expected:
            raise PoseidonError(
                f"rank {self.global_rank} (stage {self.stage}, {device_type}) built layers {ranges(built)} but the "
                f"plan assigns {ranges(expected)}: the training script does not apply the rewritten pipeline flags"
            )
        self.log(f"stage {self.stage} on {device_type} built layers {ranges(built)} as planned")

    def summarize(self) -> None:
        """Rank 0: the median measured iteration against the prediction, warning past 10 %."""
        if not self.measured_ms:
            return
        steady = self.measured_ms[1:] if len(self.measured_ms) >= 2 else self.measured_ms
        measured = statistics.median(steady)
        predicted = self.plan.predicted_iteration_ms
        n = len(self.measured_ms)
        which = f"iterations 2-{n}" if n > 2 else "iteration 2" if n == 2 else "iteration 1"
        if self.priced_elsewhere:
            self.log_rank0(f"watch: median of {which}: measured {measured:.1f} ms ({SPAN}); not compared with the plan's "
                           f"{predicted:,.1f} ms: {self.priced_elsewhere}; re-plan here (drop --poseidon-plan) "
                           f"for a prediction of this run")
            return
        self.log_rank0(f"watch: median of {which}: measured {measured:.1f} ms vs predicted {predicted:.1f} ms "
                       f"({_signed(measured, predicted)}); span: {SPAN}")
        if predicted > 0 and abs(measured - predicted) > WARN_FRACTION * predicted:
            behind = self.behind_deadlines()
            if behind:
                self.log_rank0(behind)
            cause = ("the emulation fell behind its deadlines (above)" if behind
                     else "contention, other jobs, clock changes")
            self.log_rank0(f"WARNING: measured iteration time is {_signed(measured, predicted)} off the prediction "
                           f"(more than {WARN_FRACTION:.0%}); the profile may not reflect the training ({cause})")

    def behind_deadlines(self) -> str | None:
        """On a deterministically emulated rank whose compute passes ran past their deadlines for more than
        LATE_SHARE of the watched iterations: one line saying so, with the fix (the host's CPU, not the plan,
        sets those iterations). None otherwise."""
        overruns = self.device.overruns()
        window_ms = sum(self.measured_ms)
        if overruns is None or window_ms <= 0:
            return None
        passes, late, late_s, scale = overruns
        if late_s * 1e3 <= LATE_SHARE * window_ms:
            return None
        return (f"emulation: {late} of {passes} compute passes of rank {self.global_rank} ended past their deadline, "
                f"{late_s * 1e3:,.0f} ms in all over the watched iterations ({late_s * 1e3 / window_ms:.0%} of them): "
                f"this host's CPU cannot run the ranks' real work inside the emulated times, so the measured "
                f"iterations are the host's, not the plan's; give a larger SCALE (--poseidon-emulate-model "
                f"PRESET:SCALE; now {scale:.3g}) or fewer ranks per core")


def priced_elsewhere(plan: Plan, device_kind: str) -> str | None:
    """Why the plan's predicted time does not apply to this run, or None when it does.

    An analytic profile prices the named device types (FLOPs over their peak); a run that only emulates
    them on CPU runs at the CPU's speed, so comparing the two would report a meaningless error.
    """
    if plan.profile_source == "analytic" and device_kind in ("cpu", "emulated"):
        types = "/".join(dict.fromkeys(plan.stage_types))
        return (f"the plan was priced with the analytic profile of real {types} devices, and this run emulates "
                f"them on CPU")
    return None


def _signed(measured: float, predicted: float) -> str:
    if predicted <= 0:
        return "n/a"
    return f"{(measured - predicted) / predicted:+.1%}"
