"""Make real megatron-core run on a CPU-only machine (gloo), for tests, benchmarks and dry runs.

megatron-core assumes CUDA in a handful of places that are not about compute (buffers allocated on
``torch.cuda.current_device()``, ``torch.cuda.synchronize()`` after batched p2p, ``device="cuda"`` factory
calls in the schedules, the CUDA RNG tracker, DDP stream handles). The facts behind each stand-in are in
docs/RUNTIME.md ("CPU ranks: what the shim stands in for"). This module replaces exactly those calls, and nothing that does
compute, so that the schedules, DDP and ``finalize_model_grads`` run unchanged on gloo: the attributes
through the patch table ``emulation/cpu_shim_patch.py`` (applied, verified, reverted like every other patch), the
``device="cuda"`` arguments through a ``TorchFunctionMode``.

Usage::

    from poseidon_plugin.emulation import cpu_shim
    cpu_shim.install()        # no-op (returns False) when an accelerator is present
    ...                       # build the model, run get_forward_backward_func()(...)
    cpu_shim.uninstall()      # restores every patched attribute; idempotent

or ``with cpu_shim.cpu_shim(): ...``. ``install()`` is idempotent and counts nothing: one ``uninstall()``
undoes it. The device-rewriting ``TorchFunctionMode`` is thread-local (a torch rule), so call ``install()``
on the thread that runs the training loop; the other stand-ins are process-wide.

Not covered (configure instead): ``--sequence-parallel`` with the local spec fails on CPU (transformer configs
built with ``on_cpu`` leave it out; Megatron-LM's loop gets the flag dropped, ``emulation/cpu_training.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from poseidon_plugin.emulation.cpu_shim_patch import CORE_TABLE, MOE_TABLE, TABLE
from poseidon_plugin.patches.table import Patch, PatchTable

_CPU = torch.device("cpu")

_lock = threading.Lock()
# The pushed device-rewriting mode (popped on uninstall).
_mode: _CudaToCpuMode | None = None


def accelerator_present() -> bool:
    """True when torch sees a CUDA, NPU or other accelerator device (then the shim must stay off)."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    if npu is not None and getattr(npu, "is_available", lambda: False)():
        return True
    accel = getattr(torch, "accelerator", None)
    return bool(accel is not None and accel.is_available())


def _engine_under_shim(original: Any):
    def _engine_run_backward(*args: Any, **kwargs: Any) -> Any:
        # torch hands backward() and grad() to a TorchFunctionMode, and the handler runs them with the mode
        # off: the autograd engine's Python code (activation recomputation's replayed forward, hooks) would
        # reach CUDA. The shim's mode stays on for it, as it is for the forward.
        mode = _mode
        if mode is None or mode in torch.overrides._get_current_function_mode_stack():
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)
    return _engine_run_backward


ENGINE_TABLE = PatchTable("cpu_shim_engine", (Patch(target="torch.autograd._engine_run_backward",
                                                    make=_engine_under_shim),))


def installed() -> bool:
    """Whether the shim is currently installed in this process."""
    return TABLE.applied


def install(*, force: bool = False) -> bool:
    """Install the CPU stand-ins; return True if installed now or already, False if an accelerator is present.

    ``force=True`` installs even with an accelerator (only useful for tests of the shim itself).
    Must be called before the first megatron-core call that allocates on ``torch.cuda.current_device()``.
    """
    global _mode
    with _lock:
        if TABLE.applied:
            return True
        if not force and accelerator_present():
            return False
        TABLE.apply()  # verified; on failure nothing stays patched
        try:
            MOE_TABLE.apply()
            CORE_TABLE.apply()
            ENGINE_TABLE.apply()
        except Exception:
            CORE_TABLE.revert()
            MOE_TABLE.revert()
            TABLE.revert()
            raise
        _mode = _CudaToCpuMode()
        _mode.__enter__()
        return True


def uninstall() -> None:
    """Restore every attribute the shim replaced and pop its torch-function mode; a no-op when not installed."""
    global _mode
    with _lock:
        if not TABLE.applied:
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
        ENGINE_TABLE.revert()
        CORE_TABLE.revert()
        MOE_TABLE.revert()
        TABLE.revert()


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
