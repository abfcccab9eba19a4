"""Layers per pipeline stage for stacks without a layout flag (megatron-core 0.12.x under MindSpeed-LLM).

megatron-core >= 0.13 takes any uneven (and virtual) split as ``--pipeline-model-parallel-layout``; older
stacks decide the split in two functions, ``transformer_block.get_num_layers_to_build`` (how many) and
``transformer_layer.get_transformer_layer_offset`` (the first global layer), and other modules hold
by-name copies of them (``from ... import get_transformer_layer_offset``). This table replaces both,
sweeping the copies, with functions that read the planned split:

    table = layer_assignment.table(layers=(3, 5), pp=2)   # per virtual stage, vs = chunk x pp + rank
    table.apply()      # idempotent; verified (targets and every copy patched) or nothing stays patched
    ...
    table.revert()

Both wrappers fall through to the original when the config is not the planned model (another pipeline
size or layer count, e.g. a one-layer model built for profiling). Signatures differ across versions
(0.12: ``(config)``; 0.16: ``(config, vp_stage=None, pp_rank=None)``): the wrappers take both, reading the
ranks from ``parallel_state`` when they are not passed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .table import Patch, PatchTable

NUM_LAYERS = "megatron.core.transformer.transformer_block.get_num_layers_to_build"
LAYER_OFFSET = "megatron.core.transformer.transformer_layer.get_transformer_layer_offset"


def _ranks(pp_rank: int | None, vp_stage: int | None) -> tuple[int, int]:
    from megatron.core import parallel_state

    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if vp_stage is None:
        vp_stage = parallel_state.get_virtual_pipeline_model_parallel_rank() or 0
    return pp_rank, vp_stage


def table(layers: Sequence[int], pp: int) -> PatchTable:
    """The patch table for a planned split: ``layers[vs]`` decoder layers in virtual stage ``vs``."""
    layers = tuple(int(n) for n in layers)
    if pp < 1 or not layers or len(layers) % pp or min(layers) < 1:
        raise ValueError(f"layers {list(layers)} must be >= 1 each, one per virtual stage, a multiple of pp={pp}")
    total = sum(layers)

    def planned(config: Any) -> bool:
        return config.num_layers == total and config.pipeline_model_parallel_size == pp

    def virtual_stage(pp_rank: int | None, vp_stage: int | None) -> int:
        rank, chunk = _ranks(pp_rank, vp_stage)
        return chunk * pp + rank

    def num_layers_to_build(original):
        @functools.wraps(original)
        def wrapper(config, vp_stage=None, pp_rank=None, *args, **kwargs):
            if not planned(config):
                return original(config, *_passed(vp_stage, pp_rank), *args, **kwargs)
            return layers[virtual_stage(pp_rank, vp_stage)]

        return wrapper

    def layer_offset(original):
        @functools.wraps(original)
        def wrapper(config, vp_stage=None, pp_rank=None, *args, **kwargs):
            if not planned(config):
                return original(config, *_passed(vp_stage, pp_rank), *args, **kwargs)
            return sum(layers[: virtual_stage(pp_rank, vp_stage)])

        return wrapper

    return PatchTable(
        f"layer-assignment {'/'.join(map(str, layers))}",
        (
            Patch(target=NUM_LAYERS, make=num_layers_to_build, sweep=True),
            Patch(target=LAYER_OFFSET, make=layer_offset, sweep=True),
        ),
    )


def _passed(vp_stage: Any, pp_rank: Any) -> tuple:
    """The optional positional arguments the caller actually gave (0.12's originals take only ``config``)."""
    if pp_rank is not None:
        return (vp_stage, pp_rank)
    if vp_stage is not None:
        return (vp_stage,)
    return ()
