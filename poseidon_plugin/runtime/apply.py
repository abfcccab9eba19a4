"""Apply a plan to the training script: its flags, and on stacks without a layout flag, layer patches.

Four ways to hand the layer split to Megatron (``--poseidon-flag-style``, ``auto`` picks:
``runtime/mindspeed.py:choose_style``):
- ``megatron``: megatron-core with ``PipelineParallelLayerLayout`` (>= 0.13): ``--pipeline-model-parallel-layout``
  carries any uneven and virtual split.
- ``mindspeed-layout``: MindSpeed-LLM on a MindSpeed with the layout backport (26.1.0_core_r0.12.1): the same
  flag, plus the table of MindSpeed's even-split offset helper (``patches/mindspeed_offsets.py``).
- ``mindspeed``: MindSpeed-LLM's ``--num-layer-list`` (one chunk per rank; none at PP = 1), plus the
  layer-assignment table so that the split holds on its megatron-core 0.12.x whatever MindSpeed's own
  handling does, and the offset-helper table.
- ``patch``: an older megatron-core without MindSpeed: only TP / PP / mbs flags, the split by the patch table.
In every style the planned flags replace the user's parallelism flags (``job_flags.PLANNED_FLAGS``) and
the global batch is pinned (MoE: the plan's expert layout replaces the user's EP / expert TP). In the
MindSpeed styles the user's flags are also checked against MindSpeed-LLM's rules (conflicting flags dropped
or refused, ``--sequence-parallel`` added for MoE with TP and EP > 1) and the world must fit the user's CP
and the plan's EP (:func:`rewrite_args`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.patches import layer_assignment
from poseidon_plugin.patches import mindspeed_offsets as mindspeed_patch
from poseidon_plugin.patches.table import PatchTable
from poseidon_plugin.plan import Plan, expert_args, megatron_args
from poseidon_plugin.runtime import job_flags, mindspeed
from poseidon_plugin.target import FLAG_STYLES, LAYOUT_STYLES, style_schedules

STYLES = FLAG_STYLES
MINDSPEED_STYLES = ("mindspeed-layout", "mindspeed")
"""Styles that run under MindSpeed-LLM's adaptor (its start-up order: ``runtime/mindspeed.py``)."""


def resolve_style(requested: str) -> str:
    """``auto`` -> the style the installed stack supports (no module imported); an explicit style is kept."""
    if requested != "auto":
        return requested
    return mindspeed.choose_style()


def allowed_schedules(style: str) -> tuple[str, ...]:
    """Schedules the target runtime can execute in this style (a virtual split needs the layout flag)."""
    return style_schedules(style)


def planned_flags(plan: Plan, style: str, global_batch_size: int) -> list[str]:
    """The flags that put the plan into the training script (they replace the user's parallelism flags)."""
    if style in LAYOUT_STYLES:
        flags = megatron_args(plan)
    elif plan.virtual_stages != 1:
        what = ("MindSpeed-LLM's --num-layer-list" if style == "mindspeed"
                else f"--poseidon-flag-style {style}")
        raise PoseidonError(
            f"{what} cannot express virtual_stages = {plan.virtual_stages}; re-plan with --poseidon-schedules 1f1b"
            + (" or use --poseidon-flag-style mindspeed-layout (MindSpeed 26.1.0's layout backport)"
               if style == "mindspeed" else "")
        )
    elif style == "mindspeed":
        flags = mindspeed.layer_list_flags(tp=plan.tp, pp=plan.pp, layers=plan.layers,
                                           micro_batch_size=plan.micro_batch_size) + expert_args(plan)
    else:
        flags = ["--tensor-model-parallel-size", str(plan.tp), "--pipeline-model-parallel-size", str(plan.pp),
                 "--micro-batch-size", str(plan.micro_batch_size), *expert_args(plan)]
    return flags + ["--global-batch-size", str(global_batch_size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class Rewritten:
    """The training script's command line after the plan (:func:`rewrite_args`)."""

    args: list[str]
    """The script's arguments: the user's, minus the replaced and dropped flags, then ``planned``."""
    planned: list[str]
    """The flags Poseidon put in (the plan's, plus any the style adds)."""
    notes: tuple[str, ...] = ()
    """One log line per user flag the plan replaced (old and new value) or dropped, and per flag the style
    dropped or added, and why."""


def rewrite_args(plan: Plan, style: str, global_batch_size: int, user_args: Sequence[str]) -> Rewritten:
    """The plan applied to the user's arguments in ``style``; MindSpeedError for a refused flag or a world
    that does not fit the user's context / expert parallelism."""
    planned = planned_flags(plan, style, global_batch_size)
    if style not in MINDSPEED_STYLES:
        return Rewritten(args=job_flags.rewrite(user_args, planned), planned=planned,
                         notes=tuple(job_flags.replaced_flags(user_args, planned)))
    user = job_flags.flag_values(user_args)
    cp, _ep, _etp = mindspeed.user_cp_ep(user)        # the user's EP / expert TP are replaced by the plan's
    mindspeed.data_parallel_size(plan.world_size, plan.tp, plan.pp, cp, plan.ep, plan.etp)
    experts = user.get("--num-experts", "0")
    decision = mindspeed.check_user_flags(user, tp=plan.tp, pp=plan.pp, ep=plan.ep,
                                          num_experts=int(experts) if experts.isdigit() else 0)
    planned = planned + list(decision.add)
    return Rewritten(args=job_flags.rewrite(user_args, planned, drop=decision.drop), planned=planned,
                     notes=(*job_flags.replaced_flags(user_args, planned), *decision.notes))


def layer_patches(plan: Plan, style: str, *,
                  installed: Callable[[str], object] = importlib.util.find_spec) -> list[PatchTable]:
    """The patch tables the style needs, in applying order (none for ``megatron``'s layout flag).

    ``layer_assignment`` decides the layer numbers on cores without the layout flag (``mindspeed``,
    ``patch``); MindSpeed's offset helper table (both MindSpeed styles) only where MindSpeed is installed
    (``installed("mindspeed")``): without it there is no helper to replace, and nothing reads one.
    """
    tables = []
    if style in ("mindspeed", "patch"):
        tables.append(layer_assignment.table(plan.layers, plan.pp))
    if style in MINDSPEED_STYLES and _installed(installed, "mindspeed"):
        tables.append(mindspeed_patch.table(plan.layers, plan.pp))
    return tables


def _installed(find_spec: Callable[[str], object], name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False
