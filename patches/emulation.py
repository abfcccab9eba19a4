"""Emulated device speed: stretch each transformer layer, the embedding and the output layer + loss.

Used only with ``--poseidon-emulate`` / a declared cluster on CPU (``poseidon_plugin/runtime/emulation.py``
documents the factor). Each patched ``forward`` sleeps ``(factor - 1) x`` its own measured compute time
right after computing; for backward, an identity autograd function on the module's output notes when its
gradient arrives (backward start) and one on its input sleeps ``(factor - 1) x`` the elapsed time when the
input's gradient is complete (backward end). With ``factor == 1`` every wrapper falls through to the
original, so a rank of the fastest emulated type runs the stock code path.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from .table import Patch, PatchTable

_state = {"factor": 1.0}


def set_factor(factor: float) -> None:
    """The stretch factor of this rank (>= 1.0)."""
    if not factor >= 1.0:
        raise ValueError(f"emulation factor must be >= 1.0, got {factor}")
    _state["factor"] = float(factor)


def factor() -> float:
    """The stretch factor in effect."""
    return _state["factor"]


class _Clock:
    __slots__ = ("backward_start",)

    def __init__(self) -> None:
        self.backward_start: float | None = None


class _BackwardStart(torch.autograd.Function):
    """Identity; its backward runs when the module's output gradient arrives."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, clock: _Clock) -> torch.Tensor:
        ctx.clock = clock
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.clock.backward_start = time.perf_counter()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity; its backward runs once the module's input gradient is complete, and stretches backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, clock: _Clock, stretch: float) -> torch.Tensor:
        ctx.clock, ctx.stretch = clock, stretch
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = ctx.clock.backward_start
        if start is not None:
            _sleep(ctx.stretch * (time.perf_counter() - start))
        return grad, None, None


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


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


def _stretched(inputs: tuple[str, ...]):
    """Wrapper factory for a ``forward`` whose main input is the first tensor (or keyword ``inputs``)."""

    def make(original):
        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            stretch = _state["factor"] - 1.0
            if stretch <= 0.0 or not torch.is_grad_enabled():
                return original(self, *args, **kwargs)
            clock = _Clock()
            where, tensor = _first_tensor(args, kwargs, inputs)
            if tensor is not None and tensor.requires_grad:
                marked = _BackwardEnd.apply(tensor, clock, stretch)
                if where[0] == "kw":
                    kwargs = {**kwargs, where[1]: marked}
                else:
                    args = (*args[: where[1]], marked, *args[where[1] + 1:])
            start = time.perf_counter()
            output = original(self, *args, **kwargs)
            _sleep(stretch * (time.perf_counter() - start))
            return _mark_output(output, clock)

        return forward

    return make


def _mark_output(output: Any, clock: _Clock) -> Any:
    if isinstance(output, torch.Tensor):
        return _BackwardStart.apply(output, clock) if output.requires_grad else output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].requires_grad:
        return (_BackwardStart.apply(output[0], clock), *output[1:])
    return output


_LAYER = Patch(target="megatron.core.transformer.transformer_layer.TransformerLayer.forward",
               make=_stretched(("hidden_states",)))
_EMBEDDING = Patch(
    target="megatron.core.models.common.embeddings.language_model_embedding.LanguageModelEmbedding.forward",
    make=_stretched(("input_ids",)))
_HEAD = Patch(target="megatron.core.models.gpt.gpt_model.GPTModel._postprocess", make=_stretched(("hidden_states",)))


def _rows() -> tuple[Patch, ...]:
    """The rows the installed core has (feature detection, not versions): megatron-core 0.12 computes the
    output layer and the loss inline in ``GPTModel.forward`` (no ``_postprocess``), and stretching
    ``forward`` would stretch the decoder twice, so there only the layers and the embedding are stretched."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return (_LAYER, _EMBEDDING, _HEAD) if hasattr(GPTModel, "_postprocess") else (_LAYER, _EMBEDDING)


class _DetectedTable(PatchTable):
    """A table whose rows are chosen when it is applied (importing megatron then, not at import)."""

    def __init__(self, name: str, rows) -> None:
        super().__init__(name, ())
        self._choose = rows

    def apply(self) -> None:
        if not self.applied:
            self.rows = tuple(self._choose())
        super().apply()


TABLE = _DetectedTable("emulation", _rows)
