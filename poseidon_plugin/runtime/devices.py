"""One small device interface for CUDA, Ascend (torch_npu) and CPU, plus the emulated device.

Everything Poseidon asks of an accelerator goes through :class:`Device`: which process-group backend to
use, the device's name and memory, timing events, peak-memory statistics. Profiling and the watch are then
written once. The Ascend code follows torch_npu's documented API (``torch.npu.Event(enable_timing=True)``,
``torch.npu.synchronize()``, ``max_memory_allocated``, ``reset_peak_memory_stats``, ``mem_get_info``,
``get_device_properties(i).total_memory``, ``get_device_name()`` after ``set_device``); it cannot be run
on this project's machines.

An :class:`EmulatedDevice` wraps the CPU device: it reports an emulated device type (name, memory) and
tells the emulation patches (``emulation/compute_patch.py``) how much to slow compute down, see
``emulation/harness.py``.

This module is the bootstrap's one way into the CPU emulation harness (``poseidon_plugin/emulation/``):
:func:`emulated`, :func:`install_emulation`, :func:`restretch`, :meth:`Device.prepare_training` and the
harness names imported below; the bootstrap imports nothing of the harness itself (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from poseidon_plugin.emulation import harness
# the harness's names the bootstrap uses, through this interface (the harness module imports no torch)
from poseidon_plugin.emulation.harness import (HOST_FACTOR_ENV, EmulationState, declared_devices, deterministic_state,
                                               parse_host_factor, share_stamps)
from poseidon_plugin.errors import PoseidonError

if TYPE_CHECKING:  # pragma: no cover
    from poseidon_plugin.specs import ClusterSpec

__all__ = ["GIB", "HOST_FACTOR_ENV", "Device", "CudaDevice", "NpuDevice", "EmulatedDevice", "EmulationState",
           "declared_devices", "deterministic_state", "detect", "emulated", "install_emulation", "parse_host_factor",
           "restretch", "share_stamps"]

GIB = 1 << 30


class Device:
    """CPU: gloo, wall clock, host memory. Subclasses override what their runtime offers."""

    kind = "cpu"
    backend = "gloo"

    def __init__(self, local_rank: int) -> None:
        self.local_rank = local_rank

    @property
    def torch_device(self) -> torch.device:
        """Where tensors of this rank live."""
        return torch.device("cpu")

    def name(self) -> str:
        """The device model as the runtime names it (``NVIDIA H100 80GB HBM3``, ``Ascend910B3``, ``cpu``)."""
        return "cpu"

    def total_memory(self) -> int:
        """Bytes of device memory (CPU: the host's physical memory shared by the local ranks)."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 0

    def synchronize(self) -> None:
        """Wait for queued work on this device (CPU work is synchronous)."""

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory measurement window."""

    def peak_memory(self) -> int | None:
        """Peak bytes allocated since :meth:`reset_peak_memory`; None where the runtime cannot tell (CPU)."""
        return None

    def mark(self) -> Any:
        """A timing mark recorded on the device's current stream (an event; the wall clock on CPU)."""
        return time.perf_counter()

    def ms_between(self, start: Any, stop: Any) -> float:
        """Milliseconds between two marks; call :meth:`synchronize` first."""
        return (stop - start) * 1e3

    def slowdown(self) -> float:
        """Factor by which compute on this rank is stretched (1.0 except on emulated devices)."""
        return 1.0

    def reset_overruns(self) -> None:
        """Start counting :meth:`overruns` anew."""

    def overruns(self) -> tuple[int, int, float, float] | None:
        """``(passes, late passes, seconds late, SCALE)`` of the deterministic emulation's deadlines since
        :meth:`reset_overruns` (``emulation/compute_patch.py``); None where compute is not held to deadlines
        (every real device)."""
        return None

    def prepare_training(self, script: str, args: Sequence[str], *, is_module: bool,
                         log: Callable[[str], None]) -> list[str]:
        """The training script's arguments on this device: on CPU ranks Megatron-LM's own loop
        (``megatron.training``) is made to run first (``emulation/cpu_training.py``)."""
        from poseidon_plugin.runtime.job_flags import uses_megatron_training

        if not uses_megatron_training(script, is_module):
            return list(args)
        from poseidon_plugin.emulation import cpu_training

        return cpu_training.prepare(script, args, is_module=is_module, log=log)


class _RuntimeDevice(Device):
    """An accelerator behind a torch.cuda-like runtime module (``torch.cuda``, or ``torch.npu`` from
    torch_npu, which mirrors its API): memory queries, stream events and synchronisation go to
    ``self._rt``, on the device ``set_device`` made current."""

    def __init__(self, local_rank: int, runtime: Any) -> None:
        super().__init__(local_rank)
        self._rt = runtime
        # the name and memory queries refer to the *current* device
        self._rt.set_device(local_rank)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.local_rank)

    def total_memory(self) -> int:
        return int(self._rt.get_device_properties(self.local_rank).total_memory)

    def synchronize(self) -> None:
        self._rt.synchronize()

    def reset_peak_memory(self) -> None:
        self._rt.reset_peak_memory_stats()

    def peak_memory(self) -> int | None:
        return int(self._rt.max_memory_allocated())

    def mark(self) -> Any:
        event = self._rt.Event(enable_timing=True)
        event.record()
        return event

    def ms_between(self, start: Any, stop: Any) -> float:
        return float(start.elapsed_time(stop))

    def prepare_training(self, script: str, args: Sequence[str], *, is_module: bool,
                         log: Callable[[str], None]) -> list[str]:
        return list(args)


class CudaDevice(_RuntimeDevice):
    """An NVIDIA GPU through torch.cuda (nccl)."""

    kind = "cuda"
    backend = "nccl"

    def __init__(self, local_rank: int) -> None:
        super().__init__(local_rank, torch.cuda)

    def name(self) -> str:
        return self._rt.get_device_name(self.local_rank)


class NpuDevice(_RuntimeDevice):
    """An Ascend NPU through torch_npu (hccl). Written against torch_npu's API; not runnable here."""

    kind = "npu"
    backend = "hccl"

    def __init__(self, local_rank: int) -> None:
        super().__init__(local_rank, torch.npu)  # type: ignore[attr-defined]  # present once torch_npu is imported

    def name(self) -> str:
        return str(self._rt.get_device_name())


class EmulatedDevice(Device):
    """The CPU, reporting an emulated device type and stretching compute by ``factor`` (see emulation.py)."""

    kind = "emulated"

    def __init__(self, local_rank: int, *, type_name: str, memory_bytes: int, factor: float) -> None:
        super().__init__(local_rank)
        self.type_name = type_name
        self.memory_bytes = memory_bytes
        self.factor = factor
        self.scale: float | None = None
        """The deterministic emulation's SCALE once installed (:func:`install_emulation`)."""

    def name(self) -> str:
        return self.type_name

    def total_memory(self) -> int:
        return self.memory_bytes

    def slowdown(self) -> float:
        return self.factor

    def reset_overruns(self) -> None:
        from poseidon_plugin.emulation import compute_patch

        compute_patch.reset_overruns()

    def overruns(self) -> tuple[int, int, float, float] | None:
        from poseidon_plugin.emulation import compute_patch

        if self.scale is None or compute_patch.mode() != "deadline":
            return None
        return (*compute_patch.overruns(), self.scale)


def emulated(device: Device, declared: ClusterSpec, device_type: str, *, flag: str | None,
             deterministic: bool) -> Device:
    """A CPU rank as the declared cluster's ``device_type`` (its name and memory), compute stretched against
    the fastest declared type; the deterministic emulation holds compute to deadlines instead (factor 1).
    An accelerator is kept as it is; ``--poseidon-emulate`` (``flag``) on one is a PoseidonError."""
    if device.kind != "cpu":
        if flag:
            raise PoseidonError(f"{harness.FLAG} emulates devices on CPU ranks, but this rank has a {device.kind} "
                                f"device; declare the cluster with --poseidon-cluster FILE instead")
        return device
    factors = harness.slowdown_factors({t.name: t.peak_tflops for t in declared.device_types})
    memory = int(declared.device_type(device_type).memory_gb * GIB)
    return EmulatedDevice(device.local_rank, type_name=device_type, memory_bytes=memory,
                          factor=1.0 if deterministic else factors[device_type])


def install_emulation(device: Device, state: EmulationState | None) -> EmulationState | None:
    """The CPU shim on a CPU rank, then on an emulated one the deterministic emulation (``state``) or the
    stretched compute; the deterministic state this rank keeps (None unless the device is emulated)."""
    if device.torch_device.type == "cpu":
        from poseidon_plugin.emulation import cpu_shim

        cpu_shim.install()
    if state is not None and device.kind != "emulated":
        state = None  # only a CPU rank emulates a device
    if state is not None:
        harness.install_deterministic(state)
        device.scale = state.scale
    if device.slowdown() > 1.0:
        from poseidon_plugin.emulation import compute_patch

        compute_patch.set_factor(device.slowdown())
        compute_patch.TABLE.apply()
    return state


def restretch(device: Device, declared: ClusterSpec, device_type: str) -> None:
    """An emulated device's compute stretched against the fastest type of ``declared`` (the union of the
    agents' devices: an agent alone knows only its own types); other devices are left alone."""
    if not isinstance(device, EmulatedDevice):
        return
    factor = harness.slowdown_factors({t.name: t.peak_tflops for t in declared.device_types})[device_type]
    if factor != device.slowdown():
        from poseidon_plugin.emulation import compute_patch

        device.factor = factor
        compute_patch.set_factor(factor)
        if factor > 1.0:
            compute_patch.TABLE.apply()


def detect(local_rank: int) -> Device:
    """The real device of this process: Ascend if torch_npu is importable and sees NPUs, then CUDA, then CPU."""
    if _npu_available():
        return NpuDevice(local_rank)
    if torch.cuda.is_available():
        return CudaDevice(local_rank)
    return Device(local_rank)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())
