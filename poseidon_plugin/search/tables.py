"""Flat per-group cost tables the search loops read (no Python objects per search node).

A :class:`TypeTable` holds, for one ``(tp, mbs, dp)``, every device type's
:class:`~poseidon_plugin.costmodel.GroupCosts` unpacked into ``array('d')`` columns, plus what depends on
a stage's *slot* -- its index among the earlier stages of the same type, which fixes its devices under
the cost model's placement (:meth:`CostModel.placement`): the DP all-reduce link, and the link to the
next slot of the same type. Values are copied verbatim from the cost model so that a plan assembled by
the search has bit-for-bit the times :meth:`CostModel.stage_times` computes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from ..costmodel import CostModel
from ..specs import LINK_CROSS_TYPE


@dataclass(frozen=True, kw_only=True, slots=True)
class TypeTable:
    """Costs of every device type for one ``(tp, mbs, dp)``; slot arrays are ``[t * max_slots + j]``."""

    tp: int
    mbs: int
    dp: int
    names: tuple[str, ...]     # device types, cluster order
    slots: array               # 'i' per type: stages of dp x tp devices the type can host
    max_slots: int             # stride of the slot arrays (>= 1)
    fwd: array                 # 'd' per type: forward ms of one layer, per micro-batch
    bwd: array                 # 'd' backward ms of one layer
    emb_fwd: array             # 'd' extra forward on the first virtual stage (embedding)
    emb_bwd: array
    head_fwd: array            # 'd' extra forward on the last virtual stage (output layer + loss)
    head_bwd: array
    ar: array                  # 'd' per slot: DP gradient sync ms of one layer (0 when dp = 1)
    ar_emb: array              # 'd' per slot: sync of the embedding
    ar_head: array             # 'd' per slot: sync of the output layer
    has_ar: array              # 'i' per slot: 1 when the stage has a DP all-reduce (dp > 1)
    send_same: array           # 'd' per slot j: transfer ms from slot j to slot j+1 of the same type
    send_wrap: array           # 'd' per slot j: transfer ms from slot j to slot 0 (interleaved wrap)
    send_cross: array          # 'd' per type: transfer ms to a stage of another type
    state: array               # 'd' per type: bytes of one layer's weights, grads, optimizer states
    act: array                 # 'd' per type: activation bytes of one layer per live micro-batch
    emb_state: array
    emb_act: array
    head_state: array
    head_act: array
    usable: array              # 'd' per type: usable bytes per device

    @property
    def key(self) -> tuple[int, int, int]:
        """``(tp, mbs, dp)``."""
        return (self.tp, self.mbs, self.dp)


def type_table(cm: CostModel, tp: int, mbs: int, dp: int, names: tuple[str, ...]) -> TypeTable:
    """Build the table of ``names`` for ``(tp, mbs, dp)`` from the cost model's records."""
    slots = [cm.max_stages(t, tp, dp) for t in names]
    stride = max(1, max(slots, default=1))
    cols: dict[str, array] = {k: array("d") for k in (
        "fwd", "bwd", "emb_fwd", "emb_bwd", "head_fwd", "head_bwd", "send_cross", "state", "act",
        "emb_state", "emb_act", "head_state", "head_act", "usable")}
    per_slot: dict[str, array] = {k: array("d", [0.0]) * (len(names) * stride) for k in (
        "ar", "ar_emb", "ar_head", "send_same", "send_wrap")}
    has_ar = array("i", [0]) * (len(names) * stride)
    for t, name in enumerate(names):
        gc = cm.group(name, tp, mbs, dp)
        for key, value in (("fwd", gc.forward_ms), ("bwd", gc.backward_ms),
                           ("emb_fwd", gc.first_forward_ms), ("emb_bwd", gc.first_backward_ms),
                           ("head_fwd", gc.last_forward_ms), ("head_bwd", gc.last_backward_ms),
                           ("send_cross", gc.send_ms[LINK_CROSS_TYPE]),
                           ("state", gc.layer_state_bytes), ("act", gc.layer_activation_bytes),
                           ("emb_state", gc.first_state_bytes), ("emb_act", gc.first_activation_bytes),
                           ("head_state", gc.last_state_bytes), ("head_act", gc.last_activation_bytes),
                           ("usable", gc.usable_bytes)):
            cols[key].append(value)
        for j in range(slots[t]):
            i = t * stride + j
            if dp > 1:
                _nodes, spans = cm.slot(name, tp, dp, j)
                kind = 1 if spans else 0          # LINK_INTER_NODE / LINK_INTRA_NODE
                per_slot["ar"][i] = gc.allreduce_ms[kind]
                per_slot["ar_emb"][i] = gc.first_allreduce_ms[kind]
                per_slot["ar_head"][i] = gc.last_allreduce_ms[kind]
                has_ar[i] = 1
            if j + 1 < slots[t]:
                per_slot["send_same"][i] = gc.send_ms[cm.link_between(name, j, name, j + 1, tp, dp)]
            if j > 0:
                per_slot["send_wrap"][i] = gc.send_ms[cm.link_between(name, j, name, 0, tp, dp)]
            else:
                per_slot["send_wrap"][i] = gc.send_ms[cm.link_between(name, 0, name, 0, tp, dp)]
    return TypeTable(tp=tp, mbs=mbs, dp=dp, names=tuple(names), slots=array("i", slots),
                     max_slots=stride, has_ar=has_ar, **cols, **per_slot)
