"""CPU stand-ins for the CUDA calls megatron-core makes that are not about compute, as a patch table.

Used by ``poseidon_plugin.runtime.cpu_shim`` (which also pushes the device-rewriting ``TorchFunctionMode``);
the facts behind each row are in ``/work/shared/MEGATRON-ON-CPU.md``:

* megatron-core's CUDA RNG tracker -> its inference tracker (no CUDA generator state); first, so that
  megatron-core (and torch._dynamo, which it imports and which indexes every torch.cuda function once)
  is imported while torch.cuda is still the original;
* ``torch.cuda.current_device`` -> the CPU device (buffers are allocated on it), ``synchronize`` /
  ``set_device`` / ``empty_cache`` -> no-ops, streams and events -> null objects (CPU work is synchronous).

Every stand-in is a distinct object: torch._dynamo maps each torch.cuda function to a rule and rejects one
object registered under two names.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from .table import Patch, PatchTable

_CPU = torch.device("cpu")
_RANDOM = "megatron.core.tensor_parallel.random"


class NullEvent:
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


class NullStream:
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

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()


_STREAM = NullStream()


def _current_device(original: Any):
    def current_device() -> torch.device:
        # Used as a device argument (GlobalMemoryBuffer, p2p receive buffers, grad buffers).
        return _CPU
    return current_device


def _no_op(original: Any):
    def no_op(*args: Any, **kwargs: Any) -> None:
        # synchronize after batch_isend_irecv (a CUDA race), set_device, empty_cache: nothing to do on CPU.
        return None
    return no_op


def _null_stream(original: Any):
    def stream(device: Any = None) -> NullStream:
        # DDP / param-and-grad buffers take stream handles even when they do not overlap.
        return _STREAM
    return stream


def _stream_context(original: Any):
    def stream(s: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
    return stream


def _inference_tracker(original: Any) -> Any:
    """megatron-core's inference RNG tracker, built by its own ``initialize_rng_tracker`` on a clean slate;
    the module's globals are left as found (the table sets them). Works on 0.12 (no ``force_reset``) and 0.16."""
    import importlib

    random = importlib.import_module(_RANDOM)
    saved = (random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
    try:
        random.initialize_rng_tracker(inference_rng_tracker=True)
        return random._CUDA_RNG_STATE_TRACKER
    finally:
        random._CUDA_RNG_STATE_TRACKER, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def _rows() -> tuple[Patch, ...]:
    rows: list[Patch] = []
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        rows += [Patch(target=f"{_RANDOM}._CUDA_RNG_STATE_TRACKER", make=_inference_tracker, value=True),
                 Patch(target=f"{_RANDOM}._CUDA_RNG_STATE_TRACKER_INITIALIZED", make=lambda original: True,
                       value=True)]
    rows += [
        Patch(target="torch.cuda.current_device", make=_current_device),
        Patch(target="torch.cuda.synchronize", make=_no_op),
        Patch(target="torch.cuda.set_device", make=_no_op),
        Patch(target="torch.cuda.empty_cache", make=_no_op),
        Patch(target="torch.cuda.current_stream", make=_null_stream),
        Patch(target="torch.cuda.default_stream", make=_null_stream),
        Patch(target="torch.cuda.Stream", make=lambda original: NullStream),
        Patch(target="torch.cuda.Event", make=lambda original: NullEvent),
        Patch(target="torch.cuda.stream", make=_stream_context),
    ]
    return tuple(rows)


TABLE = PatchTable("cpu_shim", _rows())
