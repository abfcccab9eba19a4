"""The cost model's named constants: defaults, where they come from, and overriding them.

Every number the cost model uses that is not a property of the hardware or the model lives here, in
:class:`CostConstants`. Defaults can be overridden, in increasing priority, by a ``constants:`` section in
the cluster file, a ``constants:`` section in the model file, and the ``constants=`` argument of
:class:`~poseidon_plugin.costmodel.CostModel` (a mapping or a ``CostConstants``). docs/SPECS.md explains
each one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InputError
from .fields import get_bool, get_float, get_mapping

GIB = 1 << 30  # device memory sizes in spec files are GiB ("64 GB" HBM cards hold 64 GiB)


@dataclass(frozen=True, kw_only=True, slots=True)
class CostConstants:
    """Tunable assumptions of the analytic profile and the cost model (see docs/SPECS.md)."""

    compute_efficiency: float = 0.5
    """Fraction of a device's peak TFLOP/s that a transformer layer's matmuls reach (model FLOPs
    utilisation). Megatron-LM reports 40-55 % on A100 for large GPT models (Narayanan et al., SC'21);
    a device type may set its own ``efficiency`` in the cluster file, which wins over this."""

    link_efficiency: float = 0.8
    """Fraction of a link's nominal bandwidth that collectives and p2p transfers achieve (NCCL/HCCL bus
    bandwidth typically reaches 70-90 % of the line rate)."""

    memory_reserve_gb: float = 2.0
    """GiB per device the model cannot use: runtime context, communication buffers, workspaces."""

    memory_reserve_fraction: float = 0.05
    """Fraction of device memory lost to allocator fragmentation, on top of ``memory_reserve_gb``."""

    backward_flops_factor: float = 2.0
    """Backward FLOPs / forward FLOPs of a layer (input and weight gradients: 2x, the standard count)."""

    flash_attention: bool = True
    """Attention keeps no (seq x seq) score matrix for backward (fused/flash attention), only the
    softmax statistics; ``false`` adds the classic ``5 * heads * seq^2`` bytes per sequence."""

    causal_attention_factor: float = 1.0
    """Share of the attention-score FLOPs counted (1.0 = the full ``s^2`` product, as Megatron's FLOP
    count does; 0.5 models a causal kernel that skips the masked half)."""

    grad_reduce_in_fp32: bool | None = None
    """Gradients accumulated and reduced in fp32. ``None``: Megatron's default for the dtype (true for
    bf16 and fp32, false for fp16)."""

    adam_state_bytes: float = 8.0
    """Optimizer state bytes per parameter: Adam's fp32 first and second moments."""

    moe_load_imbalance: float = 1.0
    """MoE with expert parallelism: tokens the busiest EP rank's experts get over the average (the layer
    waits for it). 1.0 = balanced routing (an auxiliary load-balancing loss keeps it near); a capacity factor
    caps it."""

    def override(self, updates: Mapping[str, Any] | None, where: str) -> "CostConstants":
        """A copy with ``updates`` applied (validated; unknown names are an error naming ``where``)."""
        if not updates:
            return self
        get_mapping(updates, where)
        allowed = [f.name for f in dataclasses.fields(self)]
        values: dict[str, Any] = {}
        for key, value in updates.items():
            if key not in allowed:
                raise InputError(f"{where}.{key}: unknown cost-model constant; allowed: "
                                 f"{', '.join(allowed)}")
            if key in ("flash_attention",):
                values[key] = get_bool(updates, key, where)
            elif key == "grad_reduce_in_fp32":
                values[key] = None if value is None else get_bool(updates, key, where)
            elif key in ("compute_efficiency", "link_efficiency", "causal_attention_factor"):
                values[key] = get_float(updates, key, where, minimum=0.0, strict=True, maximum=1.0)
            elif key == "memory_reserve_fraction":
                values[key] = get_float(updates, key, where, minimum=0.0, maximum=0.9)
            elif key == "moe_load_imbalance":
                values[key] = get_float(updates, key, where, minimum=1.0, maximum=1024.0)
            elif key == "backward_flops_factor":
                values[key] = get_float(updates, key, where, minimum=0.0, strict=True)
            else:
                values[key] = get_float(updates, key, where, minimum=0.0)
        return dataclasses.replace(self, **values)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every constant (for reports and the plan's metadata)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


DEFAULT_CONSTANTS = CostConstants()


def resolve_constants(*layers: tuple[Mapping[str, Any] | "CostConstants" | None, str]) -> CostConstants:
    """Apply override layers in order: each is ``(mapping or CostConstants or None, where)``."""
    result = DEFAULT_CONSTANTS
    for updates, where in layers:
        if updates is None:
            continue
        if isinstance(updates, CostConstants):
            result = updates
        else:
            result = result.override(updates, where)
    return result
