"""Explain why no plan fits: name the binding constraint and the fix."""

from __future__ import annotations

from ..costmodel import CostModel

GB = 1e9


def explain_infeasible(cm: CostModel, space) -> str:
    """One line naming the constraint that leaves no plan (memory, batch divisibility, devices)."""
    if not space.groups:
        gbs = cm.model.global_batch_size
        return (f"no plan fits: global batch size {gbs} has no data-parallel degree x micro-batch size "
                f"({', '.join(map(str, space.mbs_list))}) that divides it on this cluster; change "
                "--global-batch-size or --micro-batch-size")
    # the smallest possible stage: one layer on the last rank (fewest live micro-batches), smallest
    # micro-batch, largest TP, no embedding/head, compared with each type's usable memory
    best = None
    for g in space.groups:
        for name in g.names:
            gc = cm.group(name, g.tp, g.mbs, g.dp, g.ep, g.etp)
            need = gc.layer_state_bytes + gc.layer_activation_bytes
            ratio = need / gc.usable_bytes
            if best is None or ratio < best[0]:
                best = (ratio, name, need, gc.usable_bytes, g)
    ratio, name, need, usable, g = best
    if ratio > 1.0:
        mem = cm.cluster.device_type(name).memory_gb
        tips = "lower --micro-batch-size" if g.mbs > 1 else "use more devices per stage (TP/DP)"
        if not cm.model.distributed_optimizer:
            tips += " or enable the distributed optimizer"
        return (f"no plan fits memory: the smallest stage needs {need / GB:.1f} GB on {name} "
                f"({mem:g} GB, {usable / GB:.1f} GB usable); {tips}")
    # every stage fits one layer, but no layout fits all layers: compare one model replica's states
    # (weights, gradients, optimizer) with the memory of the whole cluster
    usable = sum(cm.num_devices(t) * cm.usable_bytes(t) for t in cm.device_types)
    replica = None
    for g in space.groups:
        for name in g.names:
            gc = cm.group(name, g.tp, g.mbs, g.dp, g.ep, g.etp)
            need = cm.model.num_layers * gc.layer_state_bytes * g.tp * g.dp
            if replica is None or need < replica:
                replica = need
    tip = "" if cm.model.distributed_optimizer else " or enable the distributed optimizer"
    if replica is not None and replica > usable:
        return (f"no plan fits memory: the model's layers need at least {replica / GB:.1f} GB of weights, "
                f"gradients and optimizer states, the cluster has {usable / GB:.1f} GB usable; use a "
                f"bigger cluster{tip}")
    return (f"no plan fits memory: the layers fit the cluster's {usable / GB:.1f} GB only without "
            "their activations (peak live micro-batches per stage); lower --micro-batch-size, raise "
            f"the data-parallel share of --global-batch-size{tip}")
