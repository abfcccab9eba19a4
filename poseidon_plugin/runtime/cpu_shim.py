"""Make real megatron-core run on a CPU-only machine (gloo), for tests, benchmarks and dry runs.

megatron-core assumes CUDA in a handful of places that are not about compute (buffers allocated on
``torch.cuda.current_device()``, ``torch.cuda.synchronize()`` after batched p2p, ``device="cuda"`` factory
calls in the schedules, the CUDA RNG tracker, DDP stream handles). The facts behind each stand-in are in
``/work/shared/MEGATRON-ON-CPU.md``. This module replaces exactly those calls, and nothing that does
compute, so that the schedules, DDP and ``finalize_model_grads`` run unchanged on gloo.

Usage::

    from poseidon_plugin.runtime import cpu_shim
    cpu_shim.install()        # no-op (returns False) when an accelerator is present
    ...                       # build the model, run get_forward_backward_func()(...)
    cpu_shim.uninstall()      # restores every patched attribute; idempotent

or ``with cpu_shim.cpu_shim(): ...``. ``install()`` is idempotent and counts nothing: one ``uninstall()``
undoes it. The device-rewriting ``TorchFunctionMode`` is thread-local (a torch rule), so call ``install()``
on the thread that runs the training loop; the other stand-ins are process-wide.

Not covered (configure instead): gradient clipping asserts ``torch.cuda.FloatTensor`` (use
``clip_grad=0.0``); the distributed optimizer and ``--sequence-parallel`` with the local spec fail on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")

_lock = threading.Lock()
# (owner object, attribute name) -> original value, filled by install(), emptied by uninstall().
_saved: dict[tuple[Any, str], Any] = {}
# The pushed device-rewriting mode, and the RNG tracker state we replaced (restored on uninstall).
_mode: _CudaToCpuMode | None = None
_saved_rng_tracker: tuple[Any, bool] | None = None


def accelerator_present() -> bool:
    """True when torch sees a CUDA, NPU or other accelerator device (then the shim must stay off)."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return True
    accel = getattr(torch, "accelerator", None)
    return bool(accel is not None and accel.is_available())


def installed() -> bool:
    """Whether the shim is currently installed in this process."""
    return bool(_saved)


def install(*, force: bool = False) -> bool:
    """Install the CPU stand-ins; return True if installed now or already, False if an accelerator is present.

    ``force=True`` installs even with an accelerator (only useful for tests of the shim itself).
    Must be called before the first megatron-core call that allocates on ``torch.cuda.current_device()``.
    """
    global _mode
    with _lock:
        if _saved:
            return True
        if not force and accelerator_present():
            return False
        # First, so that megatron-core (and torch._dynamo, which it imports and which indexes every
        # torch.cuda function once) sees the original torch.cuda.
        _install_rng_tracker()
        cuda = torch.cuda
        for name, value in _stand_ins().items():
            _saved[(cuda, name)] = getattr(cuda, name)
            setattr(cuda, name, value)
        _mode = _CudaToCpuMode()
        _mode.__enter__()
        return True


def uninstall() -> None:
    """Restore every attribute the shim replaced and pop its torch-function mode; a no-op when not installed."""
    global _mode
    with _lock:
        if not _saved:
            return
        if _mode is not None:
            stack = torch.overrides._get_current_function_mode_stack()
            if not stack or stack[-1] is not _mode:
                # Popping someone else's mode would silently break them; change nothing, fail loudly.
                raise RuntimeError("cpu_shim.uninstall(): the shim's TorchFunctionMode is not on top of this "
                                   "thread's mode stack (another mode was pushed above it, or install() ran "
                                   "on another thread); exit that mode first")
            _mode.__exit__(None, None, None)
            _mode = None
        for (owner, name), value in _saved.items():
            setattr(owner, name, value)
        _saved.clear()
        _restore_rng_tracker()


@contextlib.contextmanager
def cpu_shim(*, force: bool = False) -> Iterator[bool]:
    """Context manager form of ``install()`` / ``uninstall()``; yields whether the shim is active.

    Leaves an already installed shim in place on exit (so it nests inside a process-wide ``install()``).
    """
    was_installed = installed()
    active = install(force=force)
    try:
        yield active
    finally:
        if active and not was_installed:
            uninstall()


def _stand_ins() -> dict[str, Any]:
    """The torch.cuda attributes to replace, each by a distinct object.

    Distinct objects matter: torch._dynamo builds a map from every torch.cuda function to a rule and
    rejects one object registered under two names.
    """
    stream = _NullStream()

    def current_device() -> torch.device:
        # Used as a device argument (GlobalMemoryBuffer, p2p receive buffers, grad buffers).
        return _CPU

    def synchronize(device: Any = None) -> None:
        # p2p code synchronizes after batch_isend_irecv to dodge a CUDA race; CPU work is synchronous.
        return None

    def set_device(device: Any) -> None:
        return None

    def empty_cache() -> None:
        return None

    def current_stream(device: Any = None) -> _NullStream:
        # DDP / param-and-grad buffers take stream handles even when they do not overlap.
        return stream

    def default_stream(device: Any = None) -> _NullStream:
        return stream

    def stream_context(s: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    return {
        "current_device": current_device,
        "synchronize": synchronize,
        "set_device": set_device,
        "empty_cache": empty_cache,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "Stream": _NullStream,
        "Event": _NullEvent,
        "stream": stream_context,
    }


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so every event has already happened."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` and the current/default stream: all waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int means a CUDA ordinal to torch factory functions.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``Tensor.cuda()``, ``Tensor.to("cuda")``, ``pin_memory``) to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs = dict(kwargs, device=_CPU)
            if kwargs.get("pin_memory"):
                # Pinned memory needs an accelerator runtime; it is only a transfer optimisation.
                kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **(kwargs or {}))


def _install_rng_tracker() -> None:
    """Replace the CUDA RNG tracker by megatron-core's inference tracker (no CUDA generator state).

    Keeps a reference to the previous tracker so that ``uninstall()`` restores it. Skipped when
    megatron-core is not importable (the shim then only covers torch-level calls).
    """
    global _saved_rng_tracker
    try:
        from megatron.core.tensor_parallel import random as mc_random
    except ImportError:
        return
    _saved_rng_tracker = (mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    # What ``force_reset=True`` does on 0.16+; megatron-core 0.12.x (MindSpeed-LLM) lacks that argument.
    mc_random._CUDA_RNG_STATE_TRACKER = None
    mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mc_random.initialize_rng_tracker(inference_rng_tracker=True)


def _restore_rng_tracker() -> None:
    global _saved_rng_tracker
    if _saved_rng_tracker is None:
        return
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._CUDA_RNG_STATE_TRACKER, mc_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _saved_rng_tracker
    _saved_rng_tracker = None
