"""STAND-IN for the layer-type decision in ``mindspeed_llm/core/transformer/transformer_block.py``
(Ascend/MindSpeed-LLM, master c77308a1 / 26.1.0: ``_transformer_block_build_layers``'s ``build_layer``),
reduced to what it decides, rewritten from its behaviour there. Tests only; not the real package.

The real module imports the helper by name, as here, so a patch must rebind this copy too.
"""

from mindspeed.core.transformer.transformer_block import _get_layer_offset


def layer_kind(args, layer_number):
    """``(global layer number, "noop" | "moe" | "dense")`` of local layer ``layer_number`` (1-based).

    Global number = helper offset + local number. Noop: ``global - 1`` in ``args.noop_layers`` (a set).
    Dense-and-MoE mix only when ``num_experts``, ``first_k_dense_replace`` and ``moe_layer_freq`` are all
    set: MoE iff ``global - 1 >= first_k_dense_replace`` and ``(global - 1) % moe_layer_freq == 0``;
    otherwise the layer keeps the model's spec (MoE when ``num_experts``).
    """
    number = _get_layer_offset(args) + layer_number
    if args.noop_layers and isinstance(args.noop_layers, set) and number - 1 in args.noop_layers:
        return number, "noop"
    if args.num_experts and args.first_k_dense_replace and args.moe_layer_freq:
        mixed_moe = number - 1 >= args.first_k_dense_replace and (number - 1) % args.moe_layer_freq == 0
        return number, "moe" if mixed_moe else "dense"
    return number, "moe" if args.num_experts else "dense"
