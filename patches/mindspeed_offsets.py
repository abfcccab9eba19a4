"""Layer identity on uneven splits under MindSpeed: its layer-offset helper, made to read the planned split.

MindSpeed's ``_get_layer_offset(args)`` (``mindspeed/core/transformer/transformer_block.py``, branch
26.1.0_core_r0.12.1) returns the first global layer of this rank's chunk assuming an *even* split
(``pp_rank x num_layers // pp``, with a VPP and a dualpipev variant). MindSpeed-LLM decides layer
*types* from it, not just numbers (``mindspeed_llm/core/transformer/transformer_block.py``:
dense vs MoE from ``--first-k-dense-replace`` / ``--moe-layer-freq``, Qwen3-Next attention types,
noop layers; MindSpeed's ``noop_layers/transformer.py``; MLA in
``mindspeed_llm/tasks/models/transformer/multi_latent_attention.py``). Neither ``--num-layer-list`` nor the
layout backport patches it, so on an uneven split a DeepSeek-style model builds the wrong layer types.
This table replaces it, sweeping the by-name copies those modules import:

    table = mindspeed.table(layers=(3, 5), pp=2)   # per virtual stage, vs = chunk x pp + rank
    table.apply()      # after MindSpeed-LLM's adaptor (re)patched: see runtime/mindspeed.py

The replacement falls through to the original when ``args`` is not the planned model (another layer
count or pipeline size) and for dualpipev, whose chunks are not virtual stages of the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .layer_assignment import _ranks
from .table import Patch, PatchTable

LAYER_OFFSET_HELPER = "mindspeed.core.transformer.transformer_block._get_layer_offset"


def table(layers: Sequence[int], pp: int) -> PatchTable:
    """The patch table for a planned split: ``layers[vs]`` decoder layers in virtual stage ``vs``."""
    layers = tuple(int(n) for n in layers)
    if pp < 1 or not layers or len(layers) % pp or min(layers) < 1:
        raise ValueError(f"layers {list(layers)} must be >= 1 each, one per virtual stage, a multiple of pp={pp}")
    total = sum(layers)

    def planned(args: Any) -> bool:
        from megatron.core import parallel_state

        return (getattr(args, "num_layers", None) == total
                and getattr(args, "schedules_method", None) != "dualpipev"
                and parallel_state.get_pipeline_model_parallel_world_size() == pp)

    def layer_offset(original):
        @functools.wraps(original)
        def _get_layer_offset(args):
            if not planned(args):
                return original(args)
            rank, chunk = _ranks(None, None)
            return sum(layers[: chunk * pp + rank])

        return _get_layer_offset

    return PatchTable(
        f"mindspeed-layer-offset {'/'.join(map(str, layers))}",
        (Patch(target=LAYER_OFFSET_HELPER, make=layer_offset, sweep=True),),
    )
