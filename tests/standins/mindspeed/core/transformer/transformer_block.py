"""STAND-IN for ``mindspeed/core/transformer/transformer_block.py`` (Ascend/MindSpeed, branch
26.1.0_core_r0.12.1): only ``_get_layer_offset(args)``, the even-split offset helper, rewritten from its
behaviour there. Tests only; not the real package.
"""

from megatron.core import parallel_state


def _get_layer_offset(args):
    """First global layer (0-based) of this rank's chunk, for an *even* split of ``args.num_layers``.

    As the real helper: per pipeline rank ``num_layers // pp`` layers; dualpipev counts two chunks per rank,
    the second from the end of the model; with virtual stages, chunk ``vp`` starts at
    ``vp x num_layers // vpp + pp_rank x (num_layers // pp // vpp)``; PP 1 has offset 0.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    per_rank = args.num_layers // pp
    if getattr(args, "schedules_method", None) == "dualpipev":
        per_chunk = per_rank // 2
        if args.dualpipev_first_chunk:
            return rank * per_chunk
        return args.num_layers - (rank + 1) * per_chunk
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
        return vp_rank * (args.num_layers // vpp) + rank * (per_rank // vpp)
    return rank * per_rank if pp > 1 else 0
