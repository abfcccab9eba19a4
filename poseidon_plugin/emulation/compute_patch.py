"""Emulated device speed of each transformer layer, the embedding and the output layer + loss.

Used only with ``--poseidon-emulate`` / a declared cluster on CPU (``emulation/harness.py``
documents both modes). Two modes, one table:

* *stretch* (:func:`set_factor`): each patched ``forward`` sleeps ``(factor - 1) x`` its own measured
  compute time right after computing; for backward, a hook on the module's output tensor
  notes when its gradient arrives (backward start) and one on its input sleeps ``(factor - 1) x`` the
  elapsed time when the input's gradient is complete (backward end). With ``factor == 1`` every wrapper
  falls through to the original, so a rank of the fastest emulated type runs the stock code path.
* *deadline* (:func:`set_targets`, deterministic): the part's target times come from ``targets(part, tp,
  mbs)``; forward runs the real compute, then sleeps until ``start + forward target``; backward (same
  marks) sleeps until ``backward start + backward target``. The time no longer depends on how fast the CPU
  computed, only on wake-up precision, so many ranks on few cores keep their deadlines as long as the
  tiny real compute fits inside them. The embedding's backward is not emulated (its input is token ids;
  its analytic time is zero without sequence parallelism, which does not run on CPU).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from poseidon_plugin.patches.table import LazyPatchTable, Patch

_state: dict[str, Any] = {"factor": 1.0, "targets": None}


def set_factor(factor: float) -> None:
    """The stretch factor of this rank (>= 1.0)."""
    if not factor >= 1.0:
        raise ValueError(f"emulation factor must be >= 1.0, got {factor}")
    _state["factor"] = float(factor)


def factor() -> float:
    """The stretch factor in effect."""
    return _state["factor"]


def set_targets(targets: Callable[[str, int, int], tuple[float, float]] | None) -> None:
    """Deadline mode: ``targets(part, tp, mbs) -> (forward ms, backward ms)`` for part ``layer``,
    ``embedding`` or ``head``; None leaves deadline mode (the stretch factor applies again)."""
    _state["targets"] = targets


def mode() -> str:
    """``deadline``, ``stretch`` or ``off``: what the patched forwards do now."""
    if _state.get("targets") is not None:
        return "deadline"
    return "stretch" if _state["factor"] > 1.0 else "off"


class _Clock:
    __slots__ = ("backward_start",)

    def __init__(self) -> None:
        self.backward_start: float | None = None


class _BackwardEnd(torch.autograd.Function):
    """Identity; its backward runs once the module's input gradient is complete, and holds the backward:
    ``hold(start)`` sleeps as the mode says (stretch: a multiple of the time since ``start``; deadline:
    until ``start`` + the target)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, clock: _Clock, hold: Callable[[float], None]) -> torch.Tensor:
        ctx.clock, ctx.hold = clock, hold
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = ctx.clock.backward_start
        if start is not None:
            ctx.hold(start)
        return grad, None, None


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


LATE_S = 1e-3
"""A compute pass that finds its deadline already this far behind counts as late (:func:`overruns`)."""
_overruns = [0, 0, 0.0]   # held passes, late ones, seconds late in all


def sleep_until(deadline: float) -> None:
    """Sleep to ``deadline`` (perf_counter seconds); a second short sleep absorbs an early wake-up."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


def hold_until(deadline: float) -> None:
    """A compute pass held to its deadline: :func:`sleep_until`, counting the pass, and whether its real work
    already ran past the deadline (:func:`overruns`; the emulated links' waits are not counted: a late
    receive is the pipeline's, not the host's)."""
    late = time.perf_counter() - deadline
    _overruns[0] += 1
    if late > LATE_S:
        _overruns[1] += 1
        _overruns[2] += late
    sleep_until(deadline)


def overruns() -> tuple[int, int, float]:
    """``(passes, late, seconds)`` since :func:`reset_overruns`: the passes held to a deadline, those whose real
    work (the tiny model's compute and collectives) ended more than LATE_S past it, and by how much in all.
    Late passes mean the host's CPU could not keep the emulated times: the rank runs slower than emulated."""
    return int(_overruns[0]), int(_overruns[1]), float(_overruns[2])


def reset_overruns() -> None:
    """Start counting :func:`overruns` anew."""
    _overruns[:] = [0, 0, 0.0]


def _first_tensor(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple[Any, torch.Tensor | None]:
    """Where the module's main input is: ``("kw", name)`` / ``("arg", index)`` and the tensor."""
    for name in names:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            return ("kw", name), value
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            return ("arg", index), value
    return None, None


def _replace(args: tuple, kwargs: dict, where: Any, value: torch.Tensor) -> tuple[tuple, dict]:
    if where[0] == "kw":
        return args, {**kwargs, where[1]: value}
    return (*args[: where[1]], value, *args[where[1] + 1:]), kwargs


def _deadline_forward(original, module, args: tuple, kwargs: dict, part: str, inputs: tuple[str, ...],
                      batch_dim: int):
    """Deadline mode: real compute, then sleep to the part's forward target; backward marked likewise."""
    where, tensor = _first_tensor(args, kwargs, inputs)
    if tensor is None or tensor.dim() <= batch_dim:
        return original(module, *args, **kwargs)
    tp = int(getattr(getattr(module, "config", None), "tensor_model_parallel_size", 1) or 1)
    forward_ms, backward_ms = _state["targets"](part, tp, int(tensor.shape[batch_dim]))
    start = time.perf_counter()
    clock = None
    if backward_ms > 0 and tensor.requires_grad and torch.is_grad_enabled():
        clock = _Clock()
        seconds = backward_ms / 1e3
        args, kwargs = _replace(args, kwargs, where,
                                _BackwardEnd.apply(tensor, clock, lambda start: hold_until(start + seconds)))
    output = original(module, *args, **kwargs)
    hold_until(start + forward_ms / 1e3)
    return output if clock is None else _mark_output(output, clock)


def _stretched(inputs: tuple[str, ...], part: str = "layer", batch_dim: int = 1):
    """Wrapper factory for a ``forward`` whose main input is the first tensor (or keyword ``inputs``);
    ``part`` and ``batch_dim`` (the micro-batch dimension of that input) serve the deadline mode."""

    def make(original):
        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if part == "head" and not getattr(self, "post_process", True):
                # GPTModel._postprocess runs on every stage; only the last one has the output layer + loss.
                # Elsewhere it hands the stage's output back as it is: wrapped, it would be a view, which
                # Megatron-LM refuses to free after sending it (deallocate_pipeline_outputs)
                return original(self, *args, **kwargs)
            # a forward without autograd is held too: under activation recomputation (Megatron's checkpoint
            # runs the layer under no_grad, then again inside its backward) and in evaluation it costs the
            # device its forward all the same
            if _state.get("targets") is not None:
                return _deadline_forward(original, self, args, kwargs, part, inputs, batch_dim)
            stretch = _state["factor"] - 1.0
            if stretch <= 0.0:
                return original(self, *args, **kwargs)
            clock = _Clock()
            where, tensor = _first_tensor(args, kwargs, inputs)
            if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
                hold = lambda start: _sleep(stretch * (time.perf_counter() - start))  # noqa: E731
                args, kwargs = _replace(args, kwargs, where, _BackwardEnd.apply(tensor, clock, hold))
            start = time.perf_counter()
            output = original(self, *args, **kwargs)
            _sleep(stretch * (time.perf_counter() - start))
            return _mark_output(output, clock)

        return forward

    return make


def _mark_output(output: Any, clock: _Clock) -> Any:
    """Note on ``clock`` when the output's gradient arrives (backward start), with a hook on the output tensor
    itself: Megatron-LM frees a stage's output after sending it (``deallocate_pipeline_outputs``) and refuses a
    view of another tensor, so the module's output is handed back as it is, never wrapped."""
    tensor = output[0] if isinstance(output, tuple) and output else output
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(functools.partial(_note_backward_start, clock))
    return output


def _note_backward_start(clock: _Clock, grad: torch.Tensor) -> None:
    clock.backward_start = time.perf_counter()


_LAYER = Patch(target="megatron.core.transformer.transformer_layer.TransformerLayer.forward",
               make=_stretched(("hidden_states",)))
_EMBEDDING = Patch(
    target="megatron.core.models.common.embeddings.language_model_embedding.LanguageModelEmbedding.forward",
    make=_stretched(("input_ids",), part="embedding", batch_dim=0))
_HEAD = Patch(target="megatron.core.models.gpt.gpt_model.GPTModel._postprocess",
              make=_stretched(("hidden_states",), part="head"))


def _rows() -> tuple[Patch, ...]:
    """The rows the installed core has (feature detection, not versions): megatron-core 0.12 computes the
    output layer and the loss inline in ``GPTModel.forward`` (no ``_postprocess``), and stretching
    ``forward`` would stretch the decoder twice, so there only the layers and the embedding are stretched."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return (_LAYER, _EMBEDDING, _HEAD) if hasattr(GPTModel, "_postprocess") else (_LAYER, _EMBEDDING)


TABLE = LazyPatchTable("emulation", _rows)
