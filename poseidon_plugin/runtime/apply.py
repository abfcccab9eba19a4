"""Apply a plan to the training script: its flags, and on stacks without a layout flag, a layer patch.

Three ways to hand the layer split to Megatron (``--poseidon-flag-style``, ``auto`` picks):
- ``megatron``: megatron-core with ``PipelineParallelLayerLayout`` (>= 0.13): ``--pipeline-model-parallel-layout``
  carries any uneven and virtual split.
- ``mindspeed``: MindSpeed-LLM's ``--num-layer-list`` (one chunk per rank), plus the layer-assignment patch
  table so that the split holds on its megatron-core 0.12.x whatever MindSpeed's own handling does.
- ``patch``: an older megatron-core without MindSpeed: only TP / PP / mbs flags, the split by the patch table.
In every style the planned flags replace the user's parallelism flags (``job_flags.PLANNED_FLAGS``) and
the global batch is pinned.
"""

from __future__ import annotations

import importlib.util

from poseidon_plugin.patches import layer_assignment
from poseidon_plugin.patches.table import PatchTable
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.plan import Plan, megatron_args, mindspeed_args
from poseidon_plugin.target import style_schedules

STYLES = ("megatron", "mindspeed", "patch")


def resolve_style(requested: str) -> str:
    """``auto`` -> the style the installed stack supports (imports megatron.core); an explicit style is kept."""
    if requested != "auto":
        return requested
    if importlib.util.find_spec("megatron.core.transformer.pipeline_parallel_layer_layout") is not None:
        return "megatron"
    if importlib.util.find_spec("mindspeed_llm") is not None:
        return "mindspeed"
    return "patch"


def allowed_schedules(style: str) -> tuple[str, ...]:
    """Schedules the target runtime can execute in this style (a virtual split needs the layout flag)."""
    return style_schedules(style)


def planned_flags(plan: Plan, style: str, global_batch_size: int) -> list[str]:
    """The flags that put the plan into the training script (they replace the user's parallelism flags)."""
    if style == "megatron":
        flags = megatron_args(plan)
    elif style == "mindspeed":
        flags = mindspeed_args(plan)
    else:
        if plan.virtual_stages != 1:
            raise PoseidonError(
                f"--poseidon-flag-style patch cannot express virtual_stages = {plan.virtual_stages}; re-plan with "
                f"--poseidon-schedules 1f1b"
            )
        flags = ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp),
                 "--micro-batch-size", str(plan.micro_batch_size)]
    return flags + ["--global-batch-size", str(global_batch_size)]


def layer_patches(plan: Plan, style: str) -> PatchTable | None:
    """The layer-assignment patch table the style needs (None for the layout flag)."""
    if style == "megatron":
        return None
    return layer_assignment.table(plan.layers, plan.pp)
