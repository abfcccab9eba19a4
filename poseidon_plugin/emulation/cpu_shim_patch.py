"""CPU stand-ins for the CUDA calls megatron-core makes that are not about compute, as a patch table.

Used by ``poseidon_plugin.emulation.cpu_shim`` (which also pushes the device-rewriting ``TorchFunctionMode``);
the facts behind each row are in docs/RUNTIME.md ("CPU ranks: what the shim stands in for"):

* megatron-core's CUDA RNG tracker -> the same tracker on CPU generator states (:func:`cpu_rng_tracker_class`:
  ``fork()`` really switches states, so TP shards start different and dropout streams are per TP rank);
  first, so that megatron-core (and torch._dynamo, which it imports and which indexes every torch.cuda
  function once) is imported while torch.cuda is still the original;
* megatron-core's ``deallocate_output_tensor`` (``deallocate_pipeline_outputs``, Megatron-LM's default) keeps
  the output's old storage alive: gloo's send reads it until the send completes;
* ``torch.cuda.current_device`` -> the CPU device (buffers are allocated on it), ``synchronize`` /
  ``set_device`` / ``empty_cache`` -> no-ops, streams and events -> null objects (CPU work is synchronous);
  ``get_rng_state`` / ``set_rng_state`` -> the (empty) state of a CUDA generator a CPU rank does not have;

Rows only where the installed core has the target (:data:`CORE_TABLE`, built when applied):

* megatron-core's checks of CUDA tensor-type names (:data:`TYPE_NAME_CHECKS`: gradient clipping asserts
  ``torch.cuda.FloatTensor`` gradients, the mixed-precision and distributed optimizers accept only
  ``torch.cuda.*Tensor`` parameters) -> the call runs inside a ``TorchFunctionMode`` under which
  ``Tensor.type()`` answers the CUDA name of the tensor's dtype; what the call does is megatron-core's;
* ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` (activation recomputation saves
  and replays every RNG state) -> the empty state of the CUDA generator a CPU rank does not have, and a
  no-op: the CPU generator dropout draws from is saved and restored by recomputation itself.

Every stand-in is a distinct object: torch._dynamo maps each torch.cuda function to a rule and rejects one
object registered under two names.

MoE layers (:data:`MOE_TABLE`, built when applied, rows only where the installed core has the target):

* ``moe_utils.maybe_move_tensor_to_cpu`` -> also turns a CPU tensor into numpy when asked to: the all-to-all
  dispatcher hands its split sizes to ``all_to_all_single`` after this call, which converts only CUDA
  tensors, and torch's ``all_to_all_single`` takes a list or an array, not a tensor;
* ``moe_utils.router_gating_linear`` -> the same product in plain torch ops, on a core whose router reads a
  Transformer Engine name it defines only when TE imports (``te_general_gemm``: a NameError without TE,
  which CPU ranks never have).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any

import torch

from torch.overrides import TorchFunctionMode

from poseidon_plugin.patches.table import LazyPatchTable, Patch, PatchTable

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


@functools.cache
def cpu_rng_tracker_class() -> type:
    """megatron-core's ``CudaRNGStatesTracker`` with CPU generator states (built on first use: it imports
    megatron-core; one class for the process).

    Megatron's tracker keeps one named generator state per parallel role (``model-parallel-rng``: a seed per
    TP rank; ``data-parallel-rng``; ``expert-parallel-rng``) and ``fork(name)`` runs a block on that state:
    weight init of TP shards and dropout in TP regions draw from it, so TP ranks differ and dropout streams
    are per TP rank. On a CPU rank those draws use the CPU's default generator, so the states tracked and
    swapped are that generator's. ``add``, ``fork``, ``get_states``, ``set_states`` and ``reset`` keep
    Megatron's contract (a seed or name added twice is refused; a fork restores the state it interrupted,
    also when nested; a tracker nobody seeded forks nothing, as megatron-core's inference tracker); the CUDA
    tracker's warning that the CPU state changed inside a fork is meaningless
    here, where the CPU state is the one forked.
    """
    import importlib

    base = importlib.import_module(_RANDOM).CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):  # type: ignore[valid-type, misc]
        """Megatron's RNG-state tracker on the CPU's default generator (``emulation/cpu_shim_patch.py``)."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if not self.states_:
                # Never seeded (code on bare megatron-core that skips model_parallel_cuda_manual_seed, as it
                # ran with the inference tracker before): the block draws from the current state.
                yield
                return
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            generator = torch.default_generator
            # megatron-core 0.12's tracker has no current-state name: nested forks then restore by value only
            interrupted, interrupted_name = generator.get_state(), getattr(self, "_current_state_name", "default-rng")
            if interrupted_name != "default-rng":
                self.states_[interrupted_name] = interrupted
            generator.set_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if getattr(self, "_current_state_name", name) != name:
                    raise Exception(f"current state name {self._current_state_name} is not the same as the "
                                    f"desired state name {name}.")
                self.states_[name] = generator.get_state()
                generator.set_state(self.states_[interrupted_name] if interrupted_name != "default-rng"
                                    else interrupted)
                self._current_state_name = interrupted_name

    return CpuRNGStatesTracker


def _cpu_tracker(original: Any) -> Any:
    """A fresh :func:`cpu_rng_tracker_class` tracker (what ``model_parallel_cuda_manual_seed`` then seeds)."""
    return cpu_rng_tracker_class()()


def _initialize_rng_tracker(original: Any):
    def initialize_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                               use_cudagraphable_rng: bool = False, force_reset: bool = False) -> None:
        # The tracker the table installed stays (TE's and the CUDA-graph trackers need CUDA); a forced
        # reset empties it, as a new tracker would be.
        import importlib

        random = importlib.import_module(_RANDOM)
        if force_reset and random._CUDA_RNG_STATE_TRACKER is not None:
            random._CUDA_RNG_STATE_TRACKER.reset()
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return initialize_rng_tracker


def _no_cuda_generator_state(original: Any):
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        # There is no CUDA generator on a CPU rank: its state is empty (saved and restored as such).
        return torch.empty(0, dtype=torch.uint8)
    return get_rng_state


def _keep_sent_storage(original: Any):
    def deallocate_output_tensor(out: Any, deallocate_pipeline_outputs: bool = False) -> None:
        # Megatron frees a stage's output right after *posting* its send, by swapping the tensor's storage for
        # one element; on CUDA the send's stream keeps the memory, gloo's send reads the old storage's raw
        # pointer until it completes: freed under it, the next stage can receive garbage (NaN). The old storage
        # stays alive, held by the (pseudo-freed) output until Megatron drops it after its backward.
        kept = out.data if out is not None and deallocate_pipeline_outputs else None
        original(out, deallocate_pipeline_outputs)
        if kept is not None:
            out._poseidon_sent_storage = kept
    return deallocate_output_tensor


class CudaTypeNames(TorchFunctionMode):
    """``Tensor.type()`` (no argument) answers the CUDA tensor type name of the tensor's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1) if not result.startswith("torch.cuda.") else result
        return result


def _with_cuda_type_names(original: Any):
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with CudaTypeNames():
            return original(*args, **kwargs)
    return call


_OPTIMIZER = "megatron.core.optimizer"
TYPE_NAME_CHECKS: dict[str, tuple[str, tuple[str, ...]]] = {
    f"{_OPTIMIZER}.clip_grads.clip_grad_by_total_norm_fp32":
        ("gradient clipping on CPU gradients (its torch.cuda.FloatTensor check reads their CUDA type name)", ()),
    f"{_OPTIMIZER}.optimizer.Float16OptimizerWithFloat16Params.__init__":
        ("mixed-precision optimizer set up over CPU parameters (its torch.cuda.BFloat16Tensor / HalfTensor check "
         "reads their CUDA type name)", ("--bf16", "--fp16")),
    f"{_OPTIMIZER}.distrib_optimizer.DistributedOptimizer.__init__":
        ("distributed optimizer set up over CPU parameters (its torch.cuda tensor-type check reads their CUDA "
         "type name)", ("--use-distributed-optimizer",)),
}
"""megatron-core calls that check CUDA tensor-type names: ``target -> (what the row does, the job flags that
make the call: the row's line is logged only for a job with one of them; none: every job)``."""


def _rows() -> tuple[Patch, ...]:
    rows: list[Patch] = []
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        rows += [Patch(target=f"{_RANDOM}._CUDA_RNG_STATE_TRACKER", make=_cpu_tracker, value=True),
                 Patch(target=f"{_RANDOM}._CUDA_RNG_STATE_TRACKER_INITIALIZED", make=lambda original: True,
                       value=True),
                 Patch(target=f"{_RANDOM}.initialize_rng_tracker", make=_initialize_rng_tracker, sweep=True),
                 Patch(target="megatron.core.pipeline_parallel.schedules.deallocate_output_tensor",
                       make=_keep_sent_storage, sweep=True)]

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
        Patch(target="torch.cuda.get_rng_state", make=_no_cuda_generator_state),
        Patch(target="torch.cuda.set_rng_state", make=_no_op),
    ]
    return tuple(rows)


TABLE = PatchTable("cpu_shim", _rows())

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _splits_as_numpy(original: Any):
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return maybe_move_tensor_to_cpu


def _plain_router_gating(original: Any):
    def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: Any, router_dtype: torch.dtype):
        # megatron-core's non-TE branch (mm / addmm in router_dtype, gradients back in the input's dtypes)
        return torch.nn.functional.linear(inp.to(router_dtype), weight.to(router_dtype),
                                          None if bias is None else bias.to(router_dtype))
    return router_gating_linear


def _moe_rows() -> tuple[Patch, ...]:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ()
    try:
        moe_utils = importlib.import_module(_MOE_UTILS)
    except ImportError:
        return ()
    rows = []
    if hasattr(moe_utils, "maybe_move_tensor_to_cpu"):
        rows.append(Patch(target=f"{_MOE_UTILS}.maybe_move_tensor_to_cpu", make=_splits_as_numpy, sweep=True))
    if hasattr(moe_utils, "router_gating_linear") and "te_general_gemm" not in vars(moe_utils):
        rows.append(Patch(target=f"{_MOE_UTILS}.router_gating_linear", make=_plain_router_gating, sweep=True))
    return tuple(rows)


MOE_TABLE = LazyPatchTable("cpu_shim_moe", _moe_rows)


def _no_cuda_rng_state(original: Any):
    def _get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        # activation recomputation saves every RNG state to replay the forward; a CPU rank has no CUDA
        # generator (its dropout draws from the CPU one, which recomputation saves and restores itself)
        return torch.empty(0, dtype=torch.uint8)
    return _get_cuda_rng_state


def _no_cuda_rng_restore(original: Any):
    def _set_cuda_rng_state(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
        return None
    return _set_cuda_rng_state


def _core_rows() -> tuple[Patch, ...]:
    """Rows for megatron-core functions some cores lack, each only where the installed core has the target:
    every :data:`TYPE_NAME_CHECKS` target (a constructor is reached through its class: no copies to sweep),
    and megatron-core's own CUDA generator state accessors (activation recomputation reads and restores
    them)."""
    wanted = [(target, _with_cuda_type_names) for target in TYPE_NAME_CHECKS]
    wanted += [(f"{_RANDOM}._get_cuda_rng_state", _no_cuda_rng_state),
               (f"{_RANDOM}._set_cuda_rng_state", _no_cuda_rng_restore)]
    rows = []
    for target, make in wanted:
        path, attr = target.rsplit(".", 1)
        owner = _resolve(path)
        if owner is not None and hasattr(owner, attr):
            rows.append(Patch(target=target, make=make, sweep=attr != "__init__"))
    return tuple(rows)


def _resolve(path: str) -> Any:
    """The module or class at dotted ``path``, or None where this installation has none."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return obj
    return None


CORE_TABLE = LazyPatchTable("cpu_shim_core", _core_rows)
