"""Flat per-group cost tables the search loops read (no Python objects per search node).

A :class:`TypeTable` holds, for one ``(tp, mbs, dp)``, every device type's
:class:`~poseidon_plugin.costmodel.GroupCosts` unpacked into ``array('d')`` columns of the same names
(:mod:`poseidon_plugin.stagecost` lists them), plus what depends on a stage's *slot* -- its index
among the earlier stages of the same type, which fixes its devices under the cost model's placement
(:meth:`CostModel.placement`): the DP all-reduce link, and the link to the next slot of the same type.
Values are copied verbatim from the cost model, and the search assembles them with the cost model's
own functions (:mod:`poseidon_plugin.stagecost`), so a plan's times are bit for bit
:meth:`CostModel.stage_times`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from ..costmodel import CostModel, has_gradient_sync
from ..specs import LINK_CROSS_TYPE
from ..stagecost import put_rank_times

# per-type columns, each a GroupCosts field of the same name (send_cross_ms: send_ms[LINK_CROSS_TYPE])
TYPE_COLUMNS = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
                "head_forward_ms", "head_backward_ms", "send_cross_ms", "layer_state_bytes",
                "layer_activation_bytes", "embedding_state_bytes", "embedding_activation_bytes",
                "head_state_bytes", "head_activation_bytes", "usable_bytes", "step_forward_ms",
                "step_backward_ms", "optimizer_ms", "optimizer_fixed_ms")
# per-slot columns ([t * max_slots + j]): the GroupCosts all-reduce fields at the slot's DP link,
# whether it has one, and the sends to the next slot of its type and back to slot 0
SLOT_COLUMNS = ("allreduce_ms", "embedding_allreduce_ms", "head_allreduce_ms", "has_allreduce",
                "send_same_ms", "send_wrap_ms")


@dataclass(frozen=True, kw_only=True, slots=True)
class TypeTable:
    """Costs of every device type for one ``(tp, mbs, dp, ep, etp)``; slot arrays are ``[t * max_slots + j]``."""

    tp: int
    mbs: int
    dp: int
    names: tuple[str, ...]     # device types, cluster order
    slots: array               # 'i' per type: stages of dp x tp devices the type can host
    max_slots: int             # stride of the slot arrays (>= 1)
    forward_ms: array          # 'd' per type: forward ms of one layer, per micro-batch
    backward_ms: array         # 'd' backward ms of one layer
    embedding_forward_ms: array   # 'd' extra forward on the first virtual stage (embedding)
    embedding_backward_ms: array
    head_forward_ms: array     # 'd' extra forward on the last virtual stage (output layer + loss)
    head_backward_ms: array
    allreduce_ms: array        # 'd' per slot: DP gradient sync ms of one layer (0 without a gradient sync)
    embedding_allreduce_ms: array   # 'd' per slot: sync of the embedding
    head_allreduce_ms: array   # 'd' per slot: sync of the output layer
    has_allreduce: array       # 'i' per slot: 1 when the stage syncs gradients (has_gradient_sync)
    send_same_ms: array        # 'd' per slot j: transfer ms from slot j to slot j+1 of the same type
    send_wrap_ms: array        # 'd' per slot j: transfer ms from slot j to slot 0 (interleaved wrap)
    send_cross_ms: array       # 'd' per type: transfer ms to a stage of another type
    layer_state_bytes: array   # 'd' per type: bytes of one layer's weights, grads, optimizer states
    layer_activation_bytes: array   # 'd' per type: activation bytes of one layer per live micro-batch
    embedding_state_bytes: array
    embedding_activation_bytes: array
    head_state_bytes: array
    head_activation_bytes: array
    usable_bytes: array        # 'd' per type: usable bytes per device
    step_forward_ms: array     # 'd' per type: framework cost of one forward micro-batch step of a chunk
    step_backward_ms: array    # 'd' ... of one backward step
    optimizer_ms: array        # 'd' per type: optimizer step, one layer's share, per iteration
    optimizer_fixed_ms: array  # 'd' per type: the rest of a stage's optimizer step

    @property
    def key(self) -> tuple[int, int, int]:
        """``(tp, mbs, dp)`` (the expert layout is the group's: ``space.Group.key``)."""
        return (self.tp, self.mbs, self.dp)

    def put_rank_times(self, params, pp: int, v: int, rank: int, layers, lower, t: int, slot: int) -> None:
        """:func:`~poseidon_plugin.stagecost.put_rank_times` for a rank of type ``t`` in slot ``slot``
        (``t * max_slots + j``), with this table's columns: the complete plans' and the bounds' one call."""
        put_rank_times(params, pp, v, rank, layers, lower, self.forward_ms[t], self.backward_ms[t],
                       self.allreduce_ms[slot], self.embedding_forward_ms[t], self.embedding_backward_ms[t],
                       self.embedding_allreduce_ms[slot], self.head_forward_ms[t], self.head_backward_ms[t],
                       self.head_allreduce_ms[slot], self.has_allreduce[slot], self.step_forward_ms[t],
                       self.step_backward_ms[t], self.optimizer_ms[t], self.optimizer_fixed_ms[t])


def type_table(cm: CostModel, tp: int, mbs: int, dp: int, names: tuple[str, ...],
               max_pp: int | None = None, ep: int = 1, etp: int | None = None) -> TypeTable:
    """Build the table of ``names`` for ``(tp, mbs, dp)`` with expert layout ``(ep, etp)`` from the cost
    model's records.

    ``max_pp``: the largest pipeline the search tries. A plan uses at most ``pp`` slots of a type, so
    the slot columns stop there (``slots`` keeps the true count): on a cluster of 100,000 devices a
    type has thousands of slots and a column per slot cost seconds."""
    slots = [cm.max_stages(t, tp, dp) for t in names]
    kept = [s if max_pp is None else min(s, max_pp) for s in slots]
    stride = max(1, max(kept, default=1))
    cols: dict[str, array] = {k: array("d") for k in TYPE_COLUMNS}
    per_slot: dict[str, array] = {k: array("d", [0.0]) * (len(names) * stride)
                                  for k in SLOT_COLUMNS if k != "has_allreduce"}
    has_allreduce = array("i", [0]) * (len(names) * stride)
    syncs = has_gradient_sync(tp, dp, ep, etp)
    for t, name in enumerate(names):
        gc = cm.group(name, tp, mbs, dp, ep, etp)
        for key in TYPE_COLUMNS:
            cols[key].append(gc.send_ms[LINK_CROSS_TYPE] if key == "send_cross_ms" else getattr(gc, key))
        for j in range(kept[t]):
            i = t * stride + j
            if syncs:
                spans = dp > 1 and cm.slot_spans(name, tp, dp, j)
                kind = 1 if spans else 0          # LINK_INTER_NODE / LINK_INTRA_NODE
                for key in ("allreduce_ms", "embedding_allreduce_ms", "head_allreduce_ms"):
                    per_slot[key][i] = getattr(gc, key)[kind]
                has_allreduce[i] = 1
            if j + 1 < slots[t]:
                per_slot["send_same_ms"][i] = gc.send_ms[cm.link_between(name, j, name, j + 1, tp, dp)]
            per_slot["send_wrap_ms"][i] = gc.send_ms[cm.link_between(name, j, name, 0, tp, dp)]
    return TypeTable(tp=tp, mbs=mbs, dp=dp, names=tuple(names), slots=array("i", slots),
                     max_slots=stride, has_allreduce=has_allreduce, **cols, **per_slot)
