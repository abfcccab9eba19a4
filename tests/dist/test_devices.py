"""The accelerator devices (CUDA, Ascend) share one implementation over a torch.cuda-like runtime module.

No accelerator exists here: a stand-in runtime records the calls, so what each method asks of the runtime
(and for which device) is checked without a GPU or NPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from poseidon_plugin.runtime import devices  # noqa: E402


class _Event:
    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.recorded = False

    def record(self) -> None:
        self.recorded = True

    def elapsed_time(self, other: "_Event") -> float:
        return 2.5


class _Runtime:
    """What torch.cuda / torch.npu offer the device classes."""

    Event = _Event

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_device(self, i):
        self.calls.append(("set_device", i))

    def get_device_name(self, *args):
        self.calls.append(("get_device_name",) + args)
        return "Fake-9000"

    def get_device_properties(self, i):
        self.calls.append(("get_device_properties", i))
        return type("Props", (), {"total_memory": 64 << 30})()

    def synchronize(self):
        self.calls.append(("synchronize",))

    def reset_peak_memory_stats(self):
        self.calls.append(("reset_peak_memory_stats",))

    def max_memory_allocated(self):
        return 123


@pytest.mark.parametrize("cls,attr", [(devices.CudaDevice, "cuda"), (devices.NpuDevice, "npu")])
def test_runtime_devices_use_their_runtime(monkeypatch, cls, attr):
    rt = _Runtime()
    monkeypatch.setattr(torch, attr, rt, raising=False)
    dev = cls(3)
    assert rt.calls[0] == ("set_device", 3)
    if attr == "cuda":          # torch knows the "npu" device type only once torch_npu is imported
        assert dev.torch_device == torch.device("cuda", 3)
    assert dev.name() == "Fake-9000"
    # CUDA names the device by index; torch_npu names the current one
    assert rt.calls[-1] == (("get_device_name", 3) if attr == "cuda" else ("get_device_name",))
    assert dev.total_memory() == 64 << 30 and rt.calls[-1] == ("get_device_properties", 3)
    dev.synchronize()
    dev.reset_peak_memory()
    assert rt.calls[-2:] == [("synchronize",), ("reset_peak_memory_stats",)]
    assert dev.peak_memory() == 123
    start, stop = dev.mark(), dev.mark()
    assert start.recorded and stop.recorded and dev.ms_between(start, stop) == 2.5
    assert (dev.kind, dev.backend) == ((attr, "nccl") if attr == "cuda" else (attr, "hccl"))
