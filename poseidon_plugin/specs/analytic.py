"""Analytic profile: layer costs from FLOP counts, peak TFLOP/s and link bandwidths.

Lets anyone plan before owning the hardware; a measured profile replaces it. The model is a LLaMA-style
decoder layer (RMSNorm, GQA attention, SwiGLU MLP or top-k MoE of SwiGLU experts), Megatron tensor
parallelism (column/row-parallel linears, vocab-parallel embedding and output layer) and, when
``ModelSpec.sequence_parallel`` is on and TP > 1, sequence parallelism. docs/SPECS.md gives the formulas.

Choices (documented because they move the numbers):
* compute time = FLOPs / TP / (peak TFLOP/s x efficiency); backward = ``backward_flops_factor`` x forward;
* TP communication is not overlapped with compute: per layer two collectives of ``tokens x hidden``
  elements forward and two backward, each timed as a ring all-reduce over the intra-node link
  (with sequence parallelism an all-gather + reduce-scatter pair moves the same bytes);
* activation memory counts the tensors a layer keeps for backward (flash attention by default: no
  ``seq^2`` scores); sequence parallelism divides the norm/linear inputs and the inter-stage
  activation by TP;
* the embedding lookup costs no compute (memory-bound and small next to a layer), only its TP collective.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..errors import InputError
from .cluster import LINK_INTRA_NODE, ClusterSpec, check_memory_reserve
from .constants import DEFAULT_CONSTANTS, CostConstants, resolve_constants
from .model import ModelSpec
from .documents import quote
from .profile import ProfileEntry, ProfileSpec

DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def constants_for(cluster: ClusterSpec, model: ModelSpec,
                  constants: Mapping[str, Any] | CostConstants | None = None) -> CostConstants:
    """Defaults, then the cluster file's, the model file's, and finally ``constants`` overrides.

    The result must leave every device type some memory above the reserve (checked here because the
    model file and the caller may change the reserve the cluster file was checked with).
    """
    result = resolve_constants((cluster.constants, f"{cluster.source}: constants"),
                               (model.constants, f"{model.source}: constants"),
                               (constants, "constants"))
    check_memory_reserve(cluster.device_types, result, f"{cluster.source} with {model.source}")
    return result


def valid_tp_degrees(cluster: ClusterSpec, model: ModelSpec, device_type: str) -> tuple[int, ...]:
    """TP degrees allowed for a device type: powers of two that fit in one of its nodes and divide the
    attention heads, the KV groups and the MLP width (Megatron's divisibility rules); an MoE model without
    sequence parallelism only TP 1 (megatron-core's MoE layer refuses to train TP > 1 without it)."""
    limit = cluster.devices_per_node(device_type)
    if model.num_experts and not model.sequence_parallel:
        limit = 1
    out = []
    tp = 1
    while tp <= limit:
        if (model.num_attention_heads % tp == 0 and model.num_query_groups % tp == 0
                and model.ffn_hidden_size % tp == 0 and model.expert_ffn_hidden_size % tp == 0
                and model.moe_shared_expert_size % tp == 0):
            out.append(tp)
        tp *= 2
    return tuple(out)


def _mlp_matrices(model: ModelSpec) -> int:
    return 3 if model.swiglu else 2


def layer_param_counts(model: ModelSpec) -> tuple[int, int]:
    """Parameters of one layer as ``(split over TP, replicated on every TP rank)``."""
    h, f = model.hidden_size, model.ffn_hidden_size
    attention = h * (h + 2 * model.kv_size) + h * h          # QKV + output projection
    expert = _mlp_matrices(model) * h * f
    if model.num_experts:
        mlp = expert_params(model) + _mlp_matrices(model) * h * model.moe_shared_expert_size
        replicated = 2 * h + h * model.num_experts            # two norms + router
    else:
        mlp = expert
        replicated = 2 * h
    return attention + mlp, replicated


def expert_params(model: ModelSpec) -> int:
    """Parameters of one layer's routed experts (all experts, all TP ranks); 0 for a dense model."""
    return model.num_experts * _mlp_matrices(model) * model.hidden_size * model.expert_ffn_hidden_size


def expert_load_factor(model: ModelSpec, ep: int, constants: CostConstants) -> float:
    """Tokens the busiest device's experts compute, over the balanced average ``tokens x top_k / EP``.

    Without EP every device computes (its TP share of) every expert, so only padding to capacity changes
    the sum; with EP > 1 the busiest rank's experts get ``moe_load_imbalance`` x the average, at most the
    capacity factor's (dropped tokens above it), exactly it when padded to capacity."""
    cf = model.moe_capacity_factor
    if model.moe_pad_to_capacity:
        return cf
    load = constants.moe_load_imbalance if ep > 1 else 1.0
    return min(load, cf) if cf else load


def expert_forward_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of one layer's routed experts at balanced load (all TP ranks together)."""
    tokens = mbs * model.seq_length
    return model.moe_top_k * (2.0 * tokens * model.hidden_size * model.expert_ffn_hidden_size * _mlp_matrices(model))


def moe_dispatch_bytes(model: ModelSpec, mbs: int, tp: int) -> float:
    """Bytes one device sends into the dispatch all-to-all per micro-batch at balanced load: its tokens
    (sequence-split over TP with sequence parallelism) times ``top_k`` copies of ``hidden`` elements."""
    local = mbs * model.seq_length / (tp if (model.sequence_parallel and tp > 1) else 1)
    return local * model.moe_top_k * model.hidden_size * model.dtype_bytes


def layer_forward_flops(model: ModelSpec, mbs: int, causal_attention_factor: float = 1.0) -> float:
    """Forward FLOPs of one transformer layer for one micro-batch (all TP ranks together)."""
    h, f, s = model.hidden_size, model.ffn_hidden_size, model.seq_length
    tokens = mbs * s
    qkv = 2.0 * tokens * h * (h + 2 * model.kv_size)
    scores = 2.0 * 2.0 * tokens * s * h * causal_attention_factor   # Q K^T and softmax x V
    proj = 2.0 * tokens * h * h
    expert = 2.0 * tokens * h * f * _mlp_matrices(model)
    if model.num_experts:
        shared = 2.0 * tokens * h * model.moe_shared_expert_size * _mlp_matrices(model)
        routed = expert_forward_flops(model, mbs) * expert_load_factor(model, 1, DEFAULT_CONSTANTS)
        mlp = routed + shared + 2.0 * tokens * h * model.num_experts  # experts + shared + router
    else:
        mlp = expert
    return qkv + scores + proj + mlp


def head_forward_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of the output layer (logits) for one micro-batch."""
    return 2.0 * mbs * model.seq_length * model.hidden_size * model.vocab_size


def layer_activation_bytes(model: ModelSpec, mbs: int, tp: int, flash_attention: bool = True) -> int:
    """Bytes one layer keeps for backward per micro-batch on one TP rank."""
    d = model.dtype_bytes
    tokens = mbs * model.seq_length
    h, f = model.hidden_size, model.ffn_hidden_size
    sp = tp if (model.sequence_parallel and tp > 1) else 1
    # inputs of the two norms and of the QKV and first MLP linears: sequence-split with SP
    per_token = 4.0 * h * d / sp
    # Q, K, V and the attention output (input of the output projection): head-split over TP
    per_token += (2 * h + 2 * model.kv_size) * d / tp
    if flash_attention:
        per_token += 4.0 * model.num_attention_heads / tp      # fp32 softmax statistics per head
    else:
        per_token += float(d) * model.num_attention_heads * model.seq_length / tp  # softmax output
    mlp = (3 if model.swiglu else 2) * f * d / tp            # gated pre-activations + fc2 input
    if model.num_experts:
        # each token visits top_k experts: their activations plus its routed (gathered) copy; shared
        # experts keep a dense MLP's
        expert = (3 if model.swiglu else 2) * model.expert_ffn_hidden_size * d / tp
        shared = (3 if model.swiglu else 2) * model.moe_shared_expert_size * d / tp
        per_token += model.moe_top_k * (expert + h * d) + shared + 4.0 * model.num_experts
    else:
        per_token += mlp
    return int(round(per_token * tokens))


def _ring_allreduce_ms(nbytes: float, ranks: int, bytes_per_ms: float, latency_ms: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / bytes_per_ms + 2.0 * (ranks - 1) * latency_ms


def all_to_all_ms(nbytes: float, ranks: int, bytes_per_ms: float, latency_ms: float) -> float:
    """An all-to-all where each of ``ranks`` devices sends ``nbytes`` split evenly over the group (pairwise
    exchange: ``ranks - 1`` steps, the share for the others crosses the link)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bytes_per_ms + (ranks - 1) * latency_ms


def expert_parallel_ms(cluster: ClusterSpec, model: ModelSpec, device_type: str, tp: int, mbs: int,
                       ep: int, etp: int, ep_link: int, constants: CostConstants) -> tuple[float, float]:
    """``(forward, backward)`` ms one MoE layer takes more per micro-batch with expert parallelism ``ep`` and
    expert TP ``etp`` than as profiled (``ep = 1``, experts TP-split: Megatron's all-gather dispatcher).

    Megatron's all-to-all dispatcher, work that blocks the layer: the MLP's TP collective (all-gather +
    reduce-scatter of ``tokens x hidden``) goes; the dispatch and the combine all-to-all of
    :func:`moe_dispatch_bytes` over the EP group's link ``ep_link`` (``LINK_*``) and, with ``etp > 1``, an
    all-gather + reduce-scatter of the received tokens over the expert-TP group (inside a node) come, each
    in the forward and again in the backward. The busiest device's expert GEMMs change by
    :func:`expert_load_factor` (its tokens over ``tokens x top_k / EP``; with ``EP x expert-DP x expert-TP``
    over the stage's ``TP x DP`` ranks a device computes ``tokens x top_k x 1 / TP`` expert rows whatever
    the layout)."""
    if not model.num_experts or (ep == 1 and etp == tp):
        return 0.0, 0.0
    dev = cluster.device_type(device_type)
    eff = dev.efficiency if dev.efficiency is not None else constants.compute_efficiency
    flops_per_ms = dev.peak_tflops * 1e12 * eff / 1e3
    intra = cluster.link(device_type, LINK_INTRA_NODE)
    bw, lat = intra.bytes_per_ms * constants.link_efficiency, intra.latency_ms
    group = cluster.link(device_type, ep_link)
    tokens = mbs * model.seq_length
    mlp_collective = _ring_allreduce_ms(float(tokens * model.hidden_size * model.dtype_bytes), tp, bw, lat)
    load = expert_load_factor(model, ep, constants)
    sent = moe_dispatch_bytes(model, mbs, tp) * load
    a2a = all_to_all_ms(sent, ep, group.bytes_per_ms * constants.link_efficiency, group.latency_ms)
    expert_tp = _ring_allreduce_ms(etp * sent, etp, bw, lat)      # all-gather + reduce-scatter
    compute = expert_forward_flops(model, mbs) / tp / flops_per_ms * (load - expert_load_factor(model, 1, constants))
    comm = 2.0 * a2a + expert_tp - mlp_collective
    return compute + comm, constants.backward_flops_factor * compute + comm


def analytic_entry(cluster: ClusterSpec, model: ModelSpec, device_type: str, tp: int, mbs: int,
                   constants: CostConstants) -> ProfileEntry:
    """One profile entry computed from FLOPs and bandwidths."""
    dev = cluster.device_type(device_type)
    eff = dev.efficiency if dev.efficiency is not None else constants.compute_efficiency
    flops_per_ms = dev.peak_tflops * 1e12 * eff / 1e3
    link = cluster.link(device_type, LINK_INTRA_NODE)
    bw = link.bytes_per_ms * constants.link_efficiency
    lat = link.latency_ms
    d = model.dtype_bytes
    tokens = mbs * model.seq_length
    h, v = model.hidden_size, model.vocab_size
    sp = model.sequence_parallel and tp > 1
    act_bytes = float(tokens * h * d)
    collective = _ring_allreduce_ms(act_bytes, tp, bw, lat)   # one all-reduce (= AG + RS with SP)

    compute = layer_forward_flops(model, mbs, constants.causal_attention_factor) / tp / flops_per_ms
    forward = compute + 2.0 * collective
    backward = constants.backward_flops_factor * compute + 2.0 * collective

    sharded, replicated = layer_param_counts(model)
    # embedding: vocab-parallel lookup, then an all-reduce (reduce-scatter with SP; all-gather back)
    emb_fwd = collective * (0.5 if sp else 1.0)
    emb_bwd = collective * 0.5 if sp else 0.0
    # head: final norm, vocab-parallel logits, cross entropy (three fp32 all-reduces of one value
    # per token: max, sum of exponentials, target logit)
    head_compute = head_forward_flops(model, mbs) / tp / flops_per_ms
    ce_comm = 3.0 * _ring_allreduce_ms(tokens * 4.0, tp, bw, lat)
    head_fwd = head_compute + ce_comm + (collective * 0.5 if sp else 0.0)
    head_bwd = constants.backward_flops_factor * head_compute + collective * (0.5 if sp else 1.0)
    head_act = tokens * h * d / (tp if sp else 1) + tokens * h * d + tokens * v * 4.0 / tp
    return ProfileEntry(
        device_type=device_type, tp=tp, mbs=mbs, forward_ms=forward, backward_ms=backward,
        layer_params=sharded // tp + replicated,
        activation_bytes=layer_activation_bytes(model, mbs, tp, constants.flash_attention),
        send_bytes=int(tokens * h * d // (tp if sp else 1)),
        embedding_forward_ms=emb_fwd, embedding_backward_ms=emb_bwd,
        embedding_params=-(-v * h // tp), embedding_activation_bytes=0,
        head_forward_ms=head_fwd, head_backward_ms=head_bwd,
        head_params=-(-v * h // tp) + h, head_activation_bytes=int(round(head_act)))


def analytic_profile(cluster: ClusterSpec, model: ModelSpec, *,
                     micro_batch_sizes: Iterable[int] = DEFAULT_MICRO_BATCH_SIZES,
                     tp_degrees: Mapping[str, Iterable[int]] | Iterable[int] | None = None,
                     constants: Mapping[str, Any] | CostConstants | None = None) -> ProfileSpec:
    """A :class:`ProfileSpec` for every device type, valid TP degree and micro-batch size.

    ``tp_degrees``: ``None`` = :func:`valid_tp_degrees` per type; a list (same for every type) or a
    mapping type -> list restricts it.
    """
    consts = constants if isinstance(constants, CostConstants) else constants_for(cluster, model,
                                                                                  constants)
    mbs_list = tuple(sorted(set(micro_batch_sizes)))
    if not mbs_list or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mbs_list):
        raise InputError(f"micro_batch_sizes = {quote(mbs_list)} is invalid: must be integers >= 1")
    entries = []
    for name in cluster.type_names:
        allowed = valid_tp_degrees(cluster, model, name)
        if tp_degrees is None:
            tps = allowed
        else:
            tps = tuple(tp_degrees.get(name, ()) if isinstance(tp_degrees, Mapping) else tp_degrees)
            bad = [t for t in tps if t not in allowed]
            if bad:
                raise InputError(f"tp_degrees for {quote(name)}: {bad} not allowed; allowed: {allowed} "
                                 "(powers of two within a node dividing heads, KV groups and FFN)")
        for tp in tps:
            for mbs in mbs_list:
                entries.append(analytic_entry(cluster, model, name, tp, mbs, consts))
    return ProfileSpec(model=model.name, seq_length=model.seq_length, dtype=model.dtype,
                       entries=tuple(entries), source="analytic", software={"poseidon": _version()},
                       origin="analytic")


def _version() -> str:
    from .. import __version__
    return __version__
