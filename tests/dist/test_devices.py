"""The accelerator devices (CUDA, Ascend) share one implementation over a torch.cuda-like runtime module.

No accelerator exists here: a stand-in runtime records the calls, so what each method asks of the runtime
(and for which device) is checked without a GPU or NPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from poseidon_plugin.errors import PoseidonError  # noqa: E402
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


def _declared(emulate: str):
    from poseidon_plugin.runtime.options import RuntimeOptions
    from poseidon_plugin.runtime.precheck import declared_cluster

    return declared_cluster(RuntimeOptions(emulate=emulate), None)


def test_a_cpu_rank_is_the_declared_device_stretched_against_the_fastest_type():
    """``devices.emulated`` (the bootstrap's way to the emulation): a CPU rank reports the declared type and
    its preset memory, its compute stretched by fastest peak / its peak (A2-2 376, A2-4 280 TFLOP/s); the
    deterministic emulation keeps factor 1 (it holds compute to deadlines)."""
    declared = _declared("A2-2:1,A2-4:1")
    slow = devices.emulated(devices.Device(1), declared, "A2-4", flag="A2-2:1,A2-4:1", deterministic=False)
    assert (slow.kind, slow.name(), slow.total_memory()) == ("emulated", "A2-4", 32 * devices.GIB)
    assert slow.slowdown() == pytest.approx(376 / 280)
    fast = devices.emulated(devices.Device(0), declared, "A2-2", flag="A2-2:1,A2-4:1", deterministic=False)
    assert fast.slowdown() == 1.0
    held = devices.emulated(devices.Device(1), declared, "A2-4", flag="A2-2:1,A2-4:1", deterministic=True)
    assert held.slowdown() == 1.0 and held.name() == "A2-4"


def test_an_accelerator_is_not_emulated_and_refuses_poseidon_emulate(monkeypatch):
    monkeypatch.setattr(torch, "cuda", _Runtime(), raising=False)
    gpu = devices.CudaDevice(0)
    declared = _declared("A2-2:1")
    assert devices.emulated(gpu, declared, "A2-2", flag=None, deterministic=False) is gpu  # --poseidon-cluster
    with pytest.raises(PoseidonError, match=r"--poseidon-emulate emulates devices on CPU ranks, but this "
                                                     r"rank has a cuda device; declare the cluster with "
                                                     r"--poseidon-cluster FILE instead"):
        devices.emulated(gpu, declared, "A2-2", flag="A2-2:1", deterministic=False)
    assert gpu.prepare_training("pretrain_gpt.py", ("--x", "1"), is_module=False, log=print) == ["--x", "1"]


def test_restretch_follows_the_fastest_type_of_the_agents_union(monkeypatch):
    """An agent that declared only A2-4 ran unstretched; the union with another agent's A2-2 stretches it
    (and applies the compute patch: recorded here, not applied to megatron)."""
    from poseidon_plugin.emulation import compute_patch

    applied = []
    monkeypatch.setattr(compute_patch.TABLE, "apply", lambda: applied.append(compute_patch.factor()))
    monkeypatch.setitem(compute_patch._state, "factor", 1.0)  # restored after the test
    alone = devices.emulated(devices.Device(0), _declared("A2-4:1"), "A2-4", flag="A2-4:1", deterministic=False)
    assert alone.slowdown() == 1.0
    devices.restretch(alone, _declared("A2-2:1,A2-4:1"), "A2-4")
    assert alone.slowdown() == pytest.approx(376 / 280) and applied == [pytest.approx(376 / 280)]
    cpu = devices.Device(0)
    devices.restretch(cpu, _declared("A2-2:1,A2-4:1"), "A2-4")  # not emulated: left alone
    assert cpu.slowdown() == 1.0 and len(applied) == 1
