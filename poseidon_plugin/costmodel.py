"""Cost model: specs + profile -> per-stage times, memory and the simulator's stage-level input.

Pure Python, no torch. Built once per planning run; the search then reads precomputed records::

    cm = CostModel(cluster, model)                       # analytic profile when profile is None
    gc = cm.group("A2-2", tp=8, mbs=1, dp=2)             # GroupCosts: O(1) after the first call
    gc.forward_ms * layers + gc.embedding_forward_ms         # stage forward of a first stage
    cm.max_layers("A2-4", 8, 1, 2, live=4, first=True)   # memory-feasible layer count
    cand = Candidate(tp=8, pp=4, dp=2, mbs=1, stage_types=("A2-2",) * 4, layers=(20,) * 4)
    doc = cm.stage_input(cand)                           # simulator stage-level dict
    cm.memory_per_stage(cand); cm.iteration_ms(cand); cm.make_plan(cand)

Model (docs/SPECS.md has the formulas and constants):
* stage forward/backward = per-layer time x layers (+ embedding on the first, output layer + loss on
  the last virtual stage);
* ``send_ms`` = activation bytes / (link bandwidth x link_efficiency) + latency, over the link the two
  stage groups actually share: same node, same device type on different nodes, or different types;
* DP gradient sync per layer over the slowest link of the stage's DP group, as a ring: all-reduce
  ``2(dp-1)/dp x grad bytes / bw + 2(dp-1) x latency``; with the distributed optimizer a reduce-scatter
  of gradients plus an all-gather of parameters;
* framework (measured profiles): every (chunk, micro-batch) step pays the profile's ``step_forward_ms`` /
  ``step_backward_ms``; the job's own step by position is part of the first and last stage's extras
  (``embedding_forward_ms`` + ``first_step_ms``, ``head_forward_ms`` + ``last_step_ms``: each forward
  micro-batch of the first / last virtual stage); the optimizer step (``optimizer_ms`` per layer, / DP with the distributed optimizer,
  + ``optimizer_fixed_ms``) follows each stage's gradient sync, so the iteration is what a user sees between
  two logged iterations;
* memory = parameters x (weight + grad + optimizer bytes, the optimizer part / DP with the distributed
  optimizer) + activations x the simulator's peak live (chunk, micro-batch) count for the rank.

Placement: every stage's ``dp x tp`` devices are of one type; stages take devices of their type in
pipeline order, in the cluster's enumeration order (:meth:`CostModel.placement`). Device index ``i``
inside a stage is ``dp_rank x tp + tp_rank`` (Megatron's tp-fastest rank order), so TP groups are
contiguous and stay inside a node when TP divides the node size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

from .errors import InputError
from .fingerprint import priced_for
from .plan import Plan, PlanStage, PlanSummary
from .simulator.graph import extra_params
from .simulator.schedules import SCHEDULES, peak_live_microbatches
from .specs import (GIB, LINK_CROSS_TYPE, LINK_INTER_NODE, LINK_INTRA_NODE, ClusterSpec,
                    CostConstants, Device, ModelSpec, ProfileSpec, analytic_profile, constants_for,
                    valid_tp_degrees)
from .specs.analytic import DEFAULT_MICRO_BATCH_SIZES, expert_parallel_ms, expert_params, layer_param_counts
from .specs.cluster import DeviceSpan
from .stagecost import base_params, link_carries_data, put_rank_times, rank_memory, send_index


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """A complete plan candidate, as the search builds it.

    ``layers`` has ``pp x virtual_stages`` entries in Megatron's virtual-stage-major order: virtual
    stage ``vs = chunk x pp + rank`` holds ``layers[vs]`` layers, and global layers are numbered in
    ``vs`` order. With ``virtual_stages == 1`` it is simply the layers per pipeline stage.
    """

    tp: int
    pp: int
    dp: int
    mbs: int
    stage_types: tuple[str, ...]      # device type of each pipeline stage, len pp
    layers: tuple[int, ...]           # layers per virtual stage, len pp * virtual_stages
    schedule: str = "1f1b"
    virtual_stages: int = 1
    devices: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Optional explicit placement: per stage, ``dp x tp`` ``(node, local)`` pairs in rank order.
    ``None`` uses the deterministic :meth:`CostModel.placement`."""
    ep: int = 1
    """Expert parallelism (MoE): each EP rank holds ``num_experts / ep`` experts; one EP for the job."""
    etp: int | None = None
    """Expert tensor parallelism; ``None``: ``tp`` (Megatron's default)."""

    def chunk_layers(self, rank: int) -> tuple[int, ...]:
        """Layers of each chunk (virtual stage) of pipeline rank ``rank``."""
        return tuple(self.layers[c * self.pp + rank] for c in range(self.virtual_stages))


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupCosts:
    """Costs of one stage group: ``dp`` replicas of a TP group of ``tp`` devices of one type.

    Times are per micro-batch (forward/backward) or per iteration (all-reduce), in ms; sizes in bytes
    per device. ``*_allreduce_ms`` are indexed by the DP group's slowest link kind
    (``LINK_INTRA_NODE`` or ``LINK_INTER_NODE``); ``send_ms`` by ``LINK_*`` (intra, inter, cross).
    """

    device_type: str
    tp: int
    mbs: int
    dp: int
    forward_ms: float                 # one layer
    backward_ms: float
    embedding_forward_ms: float       # extra on the first virtual stage (embedding; the job's own step there)
    embedding_backward_ms: float
    head_forward_ms: float            # extra on the last virtual stage (output layer + loss; the job's step there)
    head_backward_ms: float
    allreduce_ms: tuple[float, float]            # DP gradient sync of one layer
    embedding_allreduce_ms: tuple[float, float]  # of the embedding
    head_allreduce_ms: tuple[float, float]       # of the output layer
    send_ms: tuple[float, float, float]      # activation (and gradient) transfer out of this group
    layer_state_bytes: float          # weights + grads + optimizer states of one layer
    embedding_state_bytes: float
    head_state_bytes: float
    layer_activation_bytes: float     # kept per live micro-batch by one layer
    embedding_activation_bytes: float
    head_activation_bytes: float
    usable_bytes: float               # device memory minus reserves
    ep: int = 1                       # expert parallelism (MoE; costs above include its all-to-all)
    etp: int | None = None            # expert TP; None: tp
    step_forward_ms: float = 0.0      # framework cost per forward micro-batch step of any chunk
    step_backward_ms: float = 0.0     # ... per backward step
    optimizer_ms: float = 0.0         # optimizer step, one layer's share (/ dp with the distributed optimizer)
    optimizer_fixed_ms: float = 0.0   # the rest of a stage's optimizer step

    def stage_memory(self, layers: int, live: int, first: bool = False, last: bool = False) -> float:
        """Peak bytes of a (non-interleaved) stage with ``layers`` layers and ``live`` micro-batches."""
        return self.rank_memory((layers,), live, first, last)

    def rank_memory(self, chunk_layers: Sequence[int], live: int, first: bool = False,
                    last: bool = False) -> float:
        """Peak bytes of a rank with ``chunk_layers[c]`` layers in chunk ``c`` (:func:`stagecost.rank_memory`)."""
        return rank_memory(chunk_layers, first, last, live, self.layer_state_bytes,
                           self.layer_activation_bytes, self.embedding_state_bytes,
                           self.embedding_activation_bytes, self.head_state_bytes,
                           self.head_activation_bytes)

    def max_layers(self, live: int, first: bool = False, last: bool = False) -> int:
        """Most layers a stage can hold within ``usable_bytes`` (may be < 0 when even 0 do not fit)."""
        room = self.usable_bytes - self.stage_memory(0, live, first, last)
        per_layer = self.layer_state_bytes + live * self.layer_activation_bytes
        if room < 0:
            return -1
        return int(room // per_layer)


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where a candidate's stages run and which links they use."""

    stage_devices: tuple[Sequence[Device], ...]  # per stage, dp*tp devices in rank order (a lazy span)
    send_link: tuple[int, ...]        # per rank r: LINK_* of r -> r+1 (r = pp-1: wrap to 0); -1 if pp=1
    dp_link: tuple[int, ...]          # per rank: slowest LINK_* inside its DP group (-1: no gradient sync,
                                      # has_gradient_sync; its expert-DP group takes the same link)


def recompute_note(model: ModelSpec) -> str | None:
    """How the job's activation recomputation is priced, in one line (None without recomputation)."""
    if model.recompute == "selective":
        return ("recomputation selective (core attention): as the profile measured the layer with it (an analytic "
                "profile assumes flash attention, which keeps no attention scores to recompute)")
    if model.recompute != "full":
        return None
    flags = (f"--recompute-granularity full --recompute-method {model.recompute_method} "
             f"--recompute-num-layers {model.recompute_num_layers}")
    if model.recompute_method == "uniform":
        return (f"recomputation {flags}: every layer's forward runs again in its backward, keeps its input, and "
                f"{model.recompute_num_layers} layer(s) of activations are rebuilt at once (off the usable memory)")
    return (f"recomputation {flags}: priced by bounds (every layer's forward again, every layer's activations "
            f"kept): the block method's costs differ between the layers of a stage, which per-layer costs cannot "
            f"express; --recompute-method uniform is priced as it runs")


def full_recompute(model: ModelSpec, forward_ms: float, backward_ms: float, activation_bytes: float,
                   input_bytes: float) -> tuple[float, float, float]:
    """One layer under Megatron's full activation recomputation (``--recompute-granularity full``):
    ``(backward ms, bytes it keeps per live micro-batch, bytes rebuilt at once during a backward)``.

    Every recomputed layer runs its forward again inside its backward. ``uniform`` (every layer, in units of
    ``recompute_num_layers``) keeps each unit's input: at most one layer input (``input_bytes``, the hidden
    state it receives) per layer; while a unit's backward runs, its layers' activations exist again for one
    micro-batch: ``recompute_num_layers`` layers' activations, once per device, which the cost model takes off
    the usable memory. ``block`` recomputes the first ``recompute_num_layers`` layers of each chunk only, a cost
    that is not the same for every layer of a stage, which the per-layer costs cannot express; it is priced by
    bounds on both: every layer's forward again (time) and every layer's activations kept (memory)."""
    backward_ms = backward_ms + forward_ms
    if model.recompute_method == "uniform":
        return backward_ms, input_bytes, model.recompute_num_layers * activation_bytes
    return backward_ms, activation_bytes, 0.0


def _ring_sync_ms(params: float, dp: int, grad_bytes: float, param_bytes: float, distributed: bool,
                  bytes_per_ms: float, latency_ms: float) -> float:
    if dp <= 1:
        return 0.0
    share = (dp - 1) / dp
    if distributed:   # reduce-scatter of gradients + all-gather of updated parameters
        return share * params * (grad_bytes + param_bytes) / bytes_per_ms + 2 * (dp - 1) * latency_ms
    return 2 * share * params * grad_bytes / bytes_per_ms + 2 * (dp - 1) * latency_ms


def has_gradient_sync(tp: int, dp: int, ep: int = 1, etp: int | None = None) -> bool:
    """Whether a stage syncs gradients: DP > 1, or an expert-DP group of ``tp x dp / (etp x ep)`` > 1 ranks
    (expert TP below TP gives the experts data parallelism even at DP 1)."""
    return dp > 1 or tp * dp > (tp if etp is None else etp) * ep


def expert_key(tp: int, ep: int, etp: int | None) -> tuple[int, ...]:
    """What an expert layout adds to a search key: nothing without expert parallelism (a dense plan's key is
    unchanged), else ``(ep, expert TP)`` (numbers, so that keys always compare)."""
    return () if ep == 1 and etp in (None, tp) else (ep, tp if etp is None else etp)


def check_expert_layout(model: ModelSpec, tp: int, dp: int, ep: int, etp: int | None) -> None:
    """InputError unless megatron-core runs expert parallelism ``ep`` and expert TP ``etp`` (``None``: ``tp``)
    on stages of ``tp x dp`` ranks: ``ep`` divides the experts, ``etp`` the TP degree and the expert FFN, and
    ``etp x ep`` the stage's ranks (``EP x expert-TP x expert-DP`` spans the ranks ``TP x DP`` spans; CP
    folds into the expert DP: ``parallel_state.initialize_model_parallel``); EP > 1 with TP > 1 needs
    sequence parallelism (``ModelParallelConfig``)."""
    e_tp = tp if etp is None else etp
    where = f"expert layout EP {ep}, expert TP {e_tp} with TP {tp}, DP {dp}"
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or not isinstance(e_tp, int) or e_tp < 1:
        raise InputError(f"{where}: EP and expert TP must be integers >= 1")
    if not model.num_experts:
        if (ep, e_tp) != (1, tp):
            raise InputError(f"{where}: {model.name} is dense (no experts); drop --expert-model-parallel-size "
                             "and --expert-tensor-parallel-size")
        return
    if model.num_experts % ep:
        raise InputError(f"{where}: EP must divide num_experts = {model.num_experts}")
    if tp % e_tp or model.expert_ffn_hidden_size % e_tp:
        raise InputError(f"{where}: expert TP must divide TP {tp} and the expert FFN "
                         f"{model.expert_ffn_hidden_size}")
    if (tp * dp) % (e_tp * ep):
        raise InputError(f"{where}: expert TP x EP = {e_tp * ep} must divide a stage's TP x DP = {tp * dp} ranks")
    if ep > 1 and tp > 1 and not model.sequence_parallel:
        raise InputError(f"{where}: megatron-core needs --sequence-parallel for EP > 1 with TP > 1")


def expert_layouts(model: ModelSpec, tp: int, dp: int,
                   eps: Sequence[int] | None = None) -> tuple[tuple[int, int | None], ...]:
    """The ``(ep, etp)`` layouts the search tries on stages of ``tp x dp`` ranks, ``(1, None)`` first: for an
    MoE model every EP in ``eps`` (default: every divisor of the experts) with the expert TP ``tp``
    (Megatron's default, ``None``) or any smaller power of two dividing it, down to 1 (experts whole, the
    usual choice with EP), those :func:`check_expert_layout` accepts; a dense model has only ``(1, None)``.
    megatron-core itself only asks that ``etp x ep x pp`` divide the world; an expert TP that does not divide
    TP (or exceeds it) is not searched."""
    for ep in eps or ():
        if not model.num_experts and ep != 1:
            raise InputError(f"--ep {ep} is not possible for {model.name}: it is dense (no experts); drop --ep")
        if model.num_experts and model.num_experts % ep:
            sizes = ", ".join(str(d) for d in range(1, model.num_experts + 1) if model.num_experts % d == 0)
            raise InputError(f"--ep {ep} is not possible for {model.name}: expert-parallel sizes divide "
                             f"num_experts = {model.num_experts} ({sizes})")
    if not model.num_experts:
        return ((1, None),)
    out: list[tuple[int, int | None]] = []
    for ep in (eps if eps is not None else range(1, model.num_experts + 1)):
        for etp in (None, *[tp >> k for k in range(1, tp.bit_length()) if tp % (tp >> k) == 0]):
            try:
                check_expert_layout(model, tp, dp, ep, etp)
            except InputError:
                continue
            out.append((ep, etp))
    return tuple(out)


def slot_indices(types: Sequence) -> tuple[int, ...]:
    """For each stage (or rank), its index among the earlier ones of the same type: its slot ``j``."""
    seen: dict = {}
    out = []
    for t in types:
        j = seen.get(t, 0)
        out.append(j)
        seen[t] = j + 1
    return tuple(out)


class CostModel:
    """Per-group costs, placement and simulator input for one (cluster, model, profile)."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, profile: ProfileSpec | None = None,
                 constants: Mapping[str, Any] | CostConstants | None = None, *,
                 micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES) -> None:
        """``profile=None`` derives an analytic profile for ``micro_batch_sizes``."""
        self.cluster = cluster
        self.model = model
        self.constants = constants_for(cluster, model, constants)
        if profile is None:
            profile = analytic_profile(cluster, model, micro_batch_sizes=micro_batch_sizes,
                                       constants=self.constants)
        else:
            self._check_profile(profile)
        self.profile = profile
        self.device_types = tuple(t for t in cluster.type_names if t in profile.device_types())
        if not self.device_types:
            raise InputError(f"profile {profile.origin} has no entry for any device type of cluster "
                             f"{cluster.name!r} ({', '.join(cluster.type_names)}); profile those types")
        c = self.constants
        dtype = model.dtype
        self.param_bytes = float(model.dtype_bytes)
        grad_fp32 = c.grad_reduce_in_fp32 if c.grad_reduce_in_fp32 is not None else dtype != "fp16"
        self.grad_bytes = 4.0 if grad_fp32 else float(model.dtype_bytes)
        # Adam moments, plus an fp32 master copy of low-precision weights, plus an fp32 copy of
        # low-precision gradients (Megatron's mixed-precision optimizer); sharded with the dist. optim.
        self.optimizer_bytes = (c.adam_state_bytes + (4.0 if dtype != "fp32" else 0.0)
                                + (4.0 if self.grad_bytes < 4.0 else 0.0))
        # lazy per type (len, index, slice): no Device object per device of a huge cluster
        self._devices = {t: cluster.type_devices(t) for t in cluster.type_names}
        # devices per node when every node of a type has the same size (0: mixed sizes). Devices are
        # listed node by node, so device i of the type is on the type's node i // size: slots and links
        # are then arithmetic, not a loop over a slot's devices (seconds at 800,000 devices)
        self._node_size: dict[str, int] = {}
        for t in cluster.type_names:
            sizes = {g.devices_per_node for g in cluster.nodes if g.device_type == t}
            self._node_size[t] = sizes.pop() if len(sizes) == 1 else 0
        self._groups: dict[tuple[str, int, int, int], GroupCosts] = {}
        self._slots: dict[tuple[str, int, int, int], tuple] = {}
        self._links: dict[tuple, int] = {}
        self._simulators: dict[tuple, Any] = {}
        # the megatron comm models' CPU cost of one p2p call: one scalar for the whole pipeline, so the
        # slowest profiled type's (0 in analytic profiles)
        self.comm_extras: dict[str, float] = {
            "p2p_call_ms": max((e.p2p_call_ms for e in profile.entries if e.device_type in self.device_types),
                               default=0.0)}

    def _check_profile(self, profile: ProfileSpec) -> None:
        m = self.model
        for attr, flag in (("model", "--model"), ("seq_length", "--seq-length"), ("dtype", "dtype")):
            have = getattr(profile, attr)
            want = m.name if attr == "model" else getattr(m, attr)
            if have != want:
                raise InputError(f"profile {profile.origin} has {attr}={have!r} but the job has "
                                 f"{want!r} ({flag}); re-profile for this job or drop --profile to use "
                                 "the analytic profile")

    # --- options the search enumerates --------------------------------------------------------

    def tp_degrees(self, device_type: str) -> tuple[int, ...]:
        """TP degrees the profile covers for ``device_type`` that Megatron can run on its nodes."""
        allowed = valid_tp_degrees(self.cluster, self.model, device_type)
        return tuple(t for t in self.profile.tp_degrees(device_type) if t in allowed)

    def micro_batch_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the profile covers."""
        return self.profile.micro_batch_sizes()

    def num_devices(self, device_type: str) -> int:
        """Devices of one type."""
        return len(self._devices[device_type])

    def max_stages(self, device_type: str, tp: int, dp: int) -> int:
        """How many stages of ``dp x tp`` devices the devices of one type can host."""
        return len(self._devices[device_type]) // (tp * dp)

    def micro_batches(self, dp: int, mbs: int) -> int | None:
        """``M = GBS / (dp x mbs)``, or ``None`` when it does not divide."""
        q, r = divmod(self.model.global_batch_size, dp * mbs)
        return q if r == 0 and q > 0 else None

    # --- per-group records --------------------------------------------------------------------

    def group(self, device_type: str, tp: int, mbs: int, dp: int, ep: int = 1,
              etp: int | None = None) -> GroupCosts:
        """The :class:`GroupCosts` of ``(device_type, tp, mbs, dp)`` with expert parallelism ``ep`` and
        expert TP ``etp`` (``None``: ``tp``; computed once, then cached)."""
        etp = None if etp == tp else etp
        key = (device_type, tp, mbs, dp, ep, etp)
        gc = self._groups.get(key)
        if gc is None:
            check_expert_layout(self.model, tp, dp, ep, etp)
            gc = self._groups[key] = self._make_group(device_type, tp, mbs, dp, ep, etp)
        return gc

    def expert_layouts(self, tp: int, dp: int, eps: Sequence[int] | None = None) -> tuple[tuple[int, int | None], ...]:
        """Every ``(ep, etp)`` megatron-core runs on stages of ``tp x dp`` ranks (:func:`expert_layouts`)."""
        return expert_layouts(self.model, tp, dp, eps)

    def expert_link(self, device_type: str, etp: int, ep: int) -> int:
        """``LINK_*`` of the slowest EP group of a type: EP groups are aligned blocks of ``etp x ep``
        consecutive devices of a stage (Megatron's expert rank order: expert TP fastest, then EP), and stages
        start at multiples of it, so a block stays inside a node iff every node boundary of the type falls on
        a block boundary. Stages are of one type, so an EP group never crosses types."""
        block = etp * ep
        if ep <= 1:
            return LINK_INTRA_NODE
        for g in self.cluster.nodes:
            if g.device_type == device_type and g.devices_per_node % block:
                return LINK_INTER_NODE
        return LINK_INTRA_NODE

    def _make_group(self, device_type: str, tp: int, mbs: int, dp: int, ep: int = 1,
                    etp: int | None = None) -> GroupCosts:
        e = self.profile.lookup(device_type, tp, mbs)
        c = self.constants
        cl = self.cluster
        dist = self.model.distributed_optimizer
        per_param = self.param_bytes + self.grad_bytes + self.optimizer_bytes / (dp if dist else 1)
        moe = (ep, etp) != (1, None)
        e_tp = tp if etp is None else etp
        edp = tp * dp // (e_tp * ep)

        def ring(params: float, ranks: int) -> tuple[float, float]:
            out = []
            for kind in (LINK_INTRA_NODE, LINK_INTER_NODE):
                link = cl.link(device_type, kind)
                out.append(_ring_sync_ms(params, ranks, self.grad_bytes, self.param_bytes, dist,
                                         link.bytes_per_ms * c.link_efficiency, link.latency_ms))
            return out[0], out[1]

        def sync(params: float) -> tuple[float, float]:
            return ring(params, dp)

        forward_ms, backward_ms = e.forward_ms, e.backward_ms
        layer_sync = sync(e.layer_params)
        layer_state = e.layer_params * per_param
        if moe:
            # experts: E / ep of them on each device, split over etp; their gradients sync over the
            # expert-DP group (its own group, over the stage's DP link), their optimizer states shard there
            # the profile's layer parameters split in the model's proportion (a measured or an emulated
            # profile counts what its layer holds; the analytic count says which share is experts')
            sharded, replicated = layer_param_counts(self.model)
            share = expert_params(self.model) / (sharded + tp * replicated)
            experts_profiled = e.layer_params * share
            experts = experts_profiled * tp / (ep * e_tp)
            dense = e.layer_params - experts_profiled
            dense_sync, expert_sync = ring(dense, dp), ring(experts, edp)
            layer_sync = (dense_sync[0] + expert_sync[0], dense_sync[1] + expert_sync[1])
            layer_state = (dense * per_param + experts * (self.param_bytes + self.grad_bytes
                                                          + self.optimizer_bytes / (edp if dist else 1)))
            link = self.expert_link(device_type, e_tp, ep)
            measured = e.expert_parallel_ms(ep) if etp is None and link == LINK_INTRA_NODE else None
            if measured is not None:
                # the job's own layer measured at this EP (its all-to-all over the node's link, the
                # dispatcher's work): it replaces the analytic term
                forward_ms, backward_ms = measured
            else:
                extra_f, extra_b = expert_parallel_ms(cl, self.model, device_type, tp, mbs, ep, e_tp, link, c)
                forward_ms, backward_ms = forward_ms + extra_f, backward_ms + extra_b

        activation, rebuilt = float(e.activation_bytes), 0.0
        if self.model.recompute == "full":
            backward_ms, activation, rebuilt = full_recompute(self.model, forward_ms, backward_ms, activation,
                                                              float(e.send_bytes))
        sends = []
        for kind in (LINK_INTRA_NODE, LINK_INTER_NODE, LINK_CROSS_TYPE):
            link = cl.link(device_type, kind)
            sends.append(e.send_bytes / (link.bytes_per_ms * c.link_efficiency) + link.latency_ms)
        usable = self.usable_bytes(device_type) - rebuilt
        return GroupCosts(
            device_type=device_type, tp=tp, mbs=mbs, dp=dp,
            forward_ms=forward_ms, backward_ms=backward_ms,
            # the job's own step by position (data and its broadcast; labels and loss) goes where it is paid
            embedding_forward_ms=e.embedding_forward_ms + e.first_step_ms,
            embedding_backward_ms=e.embedding_backward_ms,
            head_forward_ms=e.head_forward_ms + e.last_step_ms, head_backward_ms=e.head_backward_ms,
            allreduce_ms=layer_sync, embedding_allreduce_ms=sync(e.embedding_params),
            head_allreduce_ms=sync(e.head_params), send_ms=(sends[0], sends[1], sends[2]),
            layer_state_bytes=layer_state, ep=ep, etp=etp,
            embedding_state_bytes=e.embedding_params * per_param,
            head_state_bytes=e.head_params * per_param,
            layer_activation_bytes=activation,
            embedding_activation_bytes=float(e.embedding_activation_bytes),
            head_activation_bytes=float(e.head_activation_bytes),
            usable_bytes=usable, step_forward_ms=e.step_forward_ms, step_backward_ms=e.step_backward_ms,
            # the distributed optimizer steps 1/dp of the parameters on each device
            optimizer_ms=e.optimizer_ms / (dp if dist else 1), optimizer_fixed_ms=e.optimizer_fixed_ms)

    def max_layers(self, device_type: str, tp: int, mbs: int, dp: int, live: int,
                   first: bool = False, last: bool = False, ep: int = 1, etp: int | None = None) -> int:
        """Most layers a non-interleaved stage of this group can hold with ``live`` micro-batches."""
        return self.group(device_type, tp, mbs, dp, ep, etp).max_layers(live, first, last)

    def stage_max_layers(self, device_type: str, tp: int, mbs: int, dp: int, schedule: str, pp: int,
                         rank: int, ep: int = 1, etp: int | None = None) -> int:
        """Most layers pipeline rank ``rank`` (V = 1) can hold on this group under ``schedule``."""
        m = self.micro_batches(dp, mbs)
        if m is None:
            raise InputError(f"global_batch_size = {self.model.global_batch_size} is not a multiple of "
                             f"dp x mbs = {dp} x {mbs}")
        live = self.peak_live(schedule, pp, m, 1)[rank]
        return self.group(device_type, tp, mbs, dp, ep, etp).max_layers(live, rank == 0, rank == pp - 1)

    @staticmethod
    def peak_live(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> tuple[int, ...]:
        """Per rank, peak live (chunk, micro-batch) activations (the simulator's schedules; cached)."""
        return _peak_live(schedule, pp, micro_batches, virtual_stages)

    # --- placement ----------------------------------------------------------------------------

    def slot(self, device_type: str, tp: int, dp: int, j: int) -> tuple[tuple[int, ...], bool]:
        """The ``j``-th stage slot of a type: (node of each DP replica's TP group, spans > 1 node).

        Built on demand, one slot at a time: a search touches only the first ``pp`` slots of a type,
        and a per-device loop over every slot cost seconds on clusters of 100,000 devices."""
        key = (device_type, tp, dp, j)
        got = self._slots.get(key)
        if got is None:
            size = tp * dp
            devs = self._devices[device_type]
            if (j + 1) * size > len(devs):
                raise InputError(f"{j + 1} stages of {dp}x{tp} {device_type} devices need "
                                 f"{(j + 1) * size} devices; the cluster has {len(devs)}")
            got = self._slots[key] = self._make_slot(device_type, devs, j * size, tp, dp)
        return got

    def _uniform(self, device_type: str, tp: int) -> int:
        """The type's node size when the arithmetic of :meth:`slot_spans` applies (TP groups never
        straddle a node), else 0."""
        n = self._node_size.get(device_type, 0)
        return n if n and n % tp == 0 else 0

    def slot_spans(self, device_type: str, tp: int, dp: int, j: int) -> bool:
        """Whether slot ``j``'s DP replicas span more than one node (``slot(...)[1]``)."""
        n = self._uniform(device_type, tp)
        size = tp * dp
        if not n or (j + 1) * size > len(self._devices[device_type]):
            return self.slot(device_type, tp, dp, j)[1]
        return (j * size) // n != (j * size + (dp - 1) * tp) // n

    @staticmethod
    def _make_slot(device_type: str, devs, start: int, tp: int, dp: int) -> tuple:
        nodes = []
        for r in range(dp):
            group = devs[start + r * tp: start + (r + 1) * tp]
            if len({d.node for d in group}) != 1:
                raise InputError(f"tp={tp} does not fit the nodes of {device_type}: a TP group would "
                                 "span two nodes; choose a TP degree that divides every node size")
            nodes.append(group[0].node)
        return (tuple(nodes), len(set(nodes)) > 1)

    def link_between(self, type_a: str, j_a: int, type_b: str, j_b: int, tp: int, dp: int) -> int:
        """``LINK_*`` between slot ``j_a`` of ``type_a`` and slot ``j_b`` of ``type_b`` (slowest pair)."""
        if type_a != type_b:
            return LINK_CROSS_TYPE
        key = (type_a, j_a, j_b, tp, dp)
        kind = self._links.get(key)
        n = self._uniform(type_a, tp)
        size = tp * dp
        if kind is None and n and max(j_a, j_b) * size + size <= len(self._devices[type_a]):
            # replica r's node is (j size + r tp) // n, non-decreasing in r, and the two slots' device
            # ranges are shifted by a multiple of size >= the range of r: the node tuples differ iff
            # the first or the last replica's nodes differ
            a, b = j_a * size, j_b * size
            last = (dp - 1) * tp
            differ = a // n != b // n or (a + last) // n != (b + last) // n
            kind = self._links[key] = LINK_INTER_NODE if differ else LINK_INTRA_NODE
        if kind is None:
            na, _ = self.slot(type_a, tp, dp, j_a)
            nb, _ = self.slot(type_b, tp, dp, j_b)
            kind = LINK_INTER_NODE if any(x != y for x, y in zip(na, nb)) else LINK_INTRA_NODE
            self._links[key] = kind
        return kind

    def slot_indices(self, stage_types: Sequence[str]) -> tuple[int, ...]:
        """For each stage, its index among the earlier stages of the same type (its slot ``j``)."""
        return slot_indices(stage_types)

    def placement(self, cand: Candidate) -> Placement:
        """Physical devices of each stage and the link kinds the candidate uses."""
        self._check_types(cand)
        pp, tp, dp = cand.pp, cand.tp, cand.dp
        if cand.devices is not None:
            return self._explicit_placement(cand)
        js = self.slot_indices(cand.stage_types)
        syncs = has_gradient_sync(tp, dp, cand.ep, cand.etp)
        stage_devices = []
        dp_link = []
        for t, j in zip(cand.stage_types, js):
            spans = self.slot_spans(t, tp, dp, j)
            start = j * tp * dp
            stage_devices.append(self._devices[t].span(start, start + tp * dp))
            dp_link.append(-1 if not syncs else (LINK_INTER_NODE if spans else LINK_INTRA_NODE))
        send = []
        for r in range(pp):
            n = (r + 1) % pp
            send.append(-1 if pp == 1 else self.link_between(cand.stage_types[r], js[r],
                                                            cand.stage_types[n], js[n], tp, dp))
        return Placement(stage_devices=tuple(stage_devices), send_link=tuple(send),
                         dp_link=tuple(dp_link))

    def _explicit_placement(self, cand: Candidate) -> Placement:
        used: set = set()
        stages = []
        for s, devs in enumerate(cand.devices or ()):
            if len(devs) != cand.dp * cand.tp:
                raise InputError(f"candidate devices[{s}] has {len(devs)} devices; need dp*tp = "
                                 f"{cand.dp * cand.tp}")
            group = []
            for pos in devs:
                d = None
                if len(pos) == 2 and all(type(x) is int for x in pos):
                    d = self.cluster.device_at(*pos)
                if d is None or d.device_type != cand.stage_types[s] or d.index in used:
                    raise InputError(f"candidate devices[{s}]: {tuple(pos)} is not a free "
                                     f"{cand.stage_types[s]} device of the cluster")
                used.add(d.index)
                group.append(d)
            stages.append(tuple(group))
        if len(stages) != cand.pp:
            raise InputError(f"candidate devices has {len(stages)} stages; pp = {cand.pp}")
        tp, dp = cand.tp, cand.dp
        for s, g in enumerate(stages):
            for r in range(dp):
                if len({d.node for d in g[r * tp:(r + 1) * tp]}) != 1:
                    raise InputError(f"candidate devices[{s}]: TP group {r} spans several nodes")
        syncs = has_gradient_sync(tp, dp, cand.ep, cand.etp)
        dp_link = tuple(-1 if not syncs else (LINK_INTER_NODE if len({d.node for d in g}) > 1
                                            else LINK_INTRA_NODE) for g in stages)
        send = []
        for r in range(cand.pp):
            a, b = stages[r], stages[(r + 1) % cand.pp]
            if cand.pp == 1:
                send.append(-1)
            elif a[0].device_type != b[0].device_type:
                send.append(LINK_CROSS_TYPE)
            else:
                send.append(max(LINK_INTER_NODE if x.node != y.node else LINK_INTRA_NODE
                                for x, y in zip(a, b)))
        return Placement(stage_devices=tuple(stages), send_link=tuple(send), dp_link=dp_link)

    # --- whole candidates ---------------------------------------------------------------------

    def _check_types(self, cand: Candidate) -> None:
        if cand.schedule not in SCHEDULES:
            raise InputError(f"candidate schedule {cand.schedule!r} is unknown; allowed: "
                             f"{', '.join(SCHEDULES)}")
        if len(cand.stage_types) != cand.pp:
            raise InputError(f"candidate has {len(cand.stage_types)} stage types; pp = {cand.pp}")
        if len(cand.layers) != cand.pp * cand.virtual_stages:
            raise InputError(f"candidate has {len(cand.layers)} layer counts; need pp * virtual_stages"
                             f" = {cand.pp * cand.virtual_stages}")
        if sum(cand.layers) != self.model.num_layers or min(cand.layers) < 1:
            raise InputError(f"candidate layers {list(cand.layers)} must be >= 1 each and sum to "
                             f"num_layers = {self.model.num_layers}")
        for t in cand.stage_types:
            if t not in self.device_types:
                raise InputError(f"candidate stage type {t!r} is not profiled; known: "
                                 f"{', '.join(self.device_types)}")

    def _m(self, cand: Candidate) -> int:
        m = self.micro_batches(cand.dp, cand.mbs)
        if m is None:
            raise InputError(f"global_batch_size = {self.model.global_batch_size} is not a multiple of "
                             f"dp x mbs = {cand.dp} x {cand.mbs}")
        return m

    def stage_times(self, cand: Candidate, place: Placement | None = None):
        """Flat vectors ``(forward_ms, backward_ms, send_ms, allreduce_ms)`` as the simulator takes them
        (forward/backward indexed ``rank * V + chunk``), assembled by :mod:`.stagecost`."""
        place = place or self.placement(cand)
        pp, v = cand.pp, cand.virtual_stages
        nv = pp * v
        params = [0.0] * base_params(pp, v)
        for r in range(pp):
            gc = self.group(cand.stage_types[r], cand.tp, cand.mbs, cand.dp, cand.ep, cand.etp)
            kind = place.dp_link[r]
            has_ar = kind >= 0
            put_rank_times(params, pp, v, r, cand.layers, None, gc.forward_ms, gc.backward_ms,
                           gc.allreduce_ms[kind] if has_ar else 0.0, gc.embedding_forward_ms,
                           gc.embedding_backward_ms, gc.embedding_allreduce_ms[kind] if has_ar else 0.0,
                           gc.head_forward_ms, gc.head_backward_ms,
                           gc.head_allreduce_ms[kind] if has_ar else 0.0, has_ar, gc.step_forward_ms,
                           gc.step_backward_ms, gc.optimizer_ms, gc.optimizer_fixed_ms)
            link = place.send_link[r]
            params[send_index(pp, v, r)] = (gc.send_ms[link] if link >= 0 and link_carries_data(r, pp, v)
                                            else 0.0)
        return (params[1:1 + nv], params[1 + nv:1 + 2 * nv], params[1 + 2 * nv:1 + 2 * nv + pp],
                params[1 + 2 * nv + pp:1 + 2 * nv + 2 * pp])

    def stage_input(self, cand: Candidate, comm_model: str = "dag") -> dict[str, Any]:
        """The simulator's stage-level document for ``cand`` (see the simulator README); it names
        ``comm_model`` when that is not the default ``dag``."""
        m = self._m(cand)
        fwd, bwd, send, ar = self.stage_times(cand)
        v = cand.virtual_stages
        stages = [{"forward_ms": fwd[r * v:(r + 1) * v], "backward_ms": bwd[r * v:(r + 1) * v],
                   "send_ms": send[r], "allreduce_ms": ar[r]} for r in range(cand.pp)]
        doc = {"schedule": cand.schedule, "micro_batches": m, "virtual_stages": v,
               "data_parallel": cand.dp, "stages": stages}
        if comm_model != "dag":
            doc["comm_model"] = comm_model
            doc.update({name: self.comm_extras[name] for name, _d, _doc in extra_params(comm_model)
                        if self.comm_extras.get(name)})
        return doc

    def memory_per_stage(self, cand: Candidate) -> list[float]:
        """Peak bytes per device of each pipeline rank (states + activations x peak live units)."""
        self._check_types(cand)
        pp, v = cand.pp, cand.virtual_stages
        live = self.peak_live(cand.schedule, pp, self._m(cand), v)
        return [self.group(cand.stage_types[r], cand.tp, cand.mbs, cand.dp, cand.ep, cand.etp).rank_memory(
                    cand.chunk_layers(r), live[r], r == 0, r == pp - 1) for r in range(pp)]

    def usable_bytes(self, device_type: str) -> float:
        """Device memory available to the model: memory x (1 - reserve fraction) - reserve GiB."""
        c = self.constants
        mem = self.cluster.device_type(device_type).memory_gb * GIB
        return mem * (1.0 - c.memory_reserve_fraction) - c.memory_reserve_gb * GIB

    def memory_violations(self, cand: Candidate) -> list[tuple[int, float, float]]:
        """``(rank, needed bytes, usable bytes)`` of every stage that does not fit."""
        mem = self.memory_per_stage(cand)
        out = []
        for r, need in enumerate(mem):
            usable = self.group(cand.stage_types[r], cand.tp, cand.mbs, cand.dp, cand.ep, cand.etp).usable_bytes
            if need > usable:
                out.append((r, need, usable))
        return out

    def fits(self, cand: Candidate) -> bool:
        """Every stage fits its devices' usable memory."""
        return not self.memory_violations(cand)

    def iteration_ms(self, cand: Candidate, comm_model: str = "dag") -> float:
        """Simulated iteration time of ``cand`` under the simulator's ``comm_model`` (its extras from the
        profile, :attr:`comm_extras`, as the search uses them)."""
        sim = self.simulator(cand.schedule, cand.pp, self._m(cand), cand.virtual_stages, comm_model)
        return sim.iteration_time(*self.stage_times(cand))

    def simulator(self, schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
                  comm_model: str = "dag"):
        """The :class:`~poseidon_plugin.simulator.Simulator` of a shape that :meth:`iteration_ms`
        uses (built once per shape and comm model)."""
        key = (schedule, pp, micro_batches, virtual_stages, comm_model)
        sim = self._simulators.get(key)
        if sim is None:
            from .simulator import Simulator
            sim = self._simulators[key] = Simulator(schedule, pp, micro_batches, virtual_stages,
                                                    comm_model)
            for name, _default, _doc in extra_params(comm_model):
                if name in self.comm_extras:
                    sim.set_extra(name, self.comm_extras[name])
        return sim

    def tokens_per_s(self, iteration_ms: float) -> float:
        """Training throughput for an iteration time."""
        return self.model.tokens_per_iteration / (iteration_ms / 1e3) if iteration_ms > 0 else 0.0

    def make_plan(self, cand: Candidate, iteration_ms: float | None = None, *,
                  alternatives: Sequence[PlanSummary] = (), search_stats: Mapping[str, Any] | None = None,
                  comm_model: str = "dag") -> Plan:
        """The :class:`~poseidon_plugin.plan.Plan` of ``cand``: placement, times and memory filled in
        (simulates it under ``comm_model`` when ``iteration_ms`` is None)."""
        if iteration_ms is None:
            iteration_ms = self.iteration_ms(cand, comm_model)
        place = self.placement(cand)
        fwd, bwd, send, ar = self.stage_times(cand, place)
        mem = self.memory_per_stage(cand)
        pp, v, size = cand.pp, cand.virtual_stages, cand.dp * cand.tp
        firsts = [sum(cand.layers[:vs]) for vs in range(pp * v)]
        stages = []
        for r in range(pp):
            stages.append(PlanStage(
                index=r, device_type=cand.stage_types[r], ranks=tuple(range(r * size, (r + 1) * size)),
                devices=_positions(place.stage_devices[r]), tp=cand.tp,
                dp=cand.dp, layers=cand.chunk_layers(r),
                first_layers=tuple(firsts[c * pp + r] for c in range(v)),
                forward_ms=tuple(fwd[r * v:(r + 1) * v]), backward_ms=tuple(bwd[r * v:(r + 1) * v]),
                send_ms=send[r], allreduce_ms=ar[r], memory_bytes=int(math.ceil(mem[r])),
                usable_bytes=int(self.group(cand.stage_types[r], cand.tp, cand.mbs, cand.dp, cand.ep,
                                            cand.etp).usable_bytes)))
        model = self.model
        return Plan(model=model.name, cluster=self.cluster.name, seq_length=model.seq_length,
                    global_batch_size=model.global_batch_size, tp=cand.tp, pp=pp, dp=cand.dp,
                    micro_batch_size=cand.mbs, ep=cand.ep, etp=None if cand.etp == cand.tp else cand.etp,
                    micro_batches=model.global_batch_size // (cand.dp * cand.mbs),
                    schedule=cand.schedule, virtual_stages=v, layers=tuple(cand.layers),
                    stages=tuple(stages), predicted_iteration_ms=float(iteration_ms),
                    tokens_per_s=self.tokens_per_s(iteration_ms),
                    profile_source="analytic" if self.profile.source == "analytic" else "measured",
                    # Megatron-LM's default; target.search_plan sets the planned value
                    overlap_p2p_comm=cand.schedule == "interleaved-1f1b",
                    priced_for=priced_for(self.cluster, model, "analytic" if self.profile.source == "analytic"
                                          else "measured", emulation=self.profile.software.get("emulation", "")),
                    alternatives=tuple(alternatives),
                    # normalised through JSON so that to_json/from_json round-trips it exactly
                    search_stats=json.loads(json.dumps(dict(search_stats or {}), allow_nan=False)))

    def summarize(self, cand: Candidate, iteration_ms: float) -> PlanSummary:
        """A light :class:`~poseidon_plugin.plan.PlanSummary` (for a plan's top-k alternatives)."""
        return PlanSummary(tp=cand.tp, pp=cand.pp, dp=cand.dp, micro_batch_size=cand.mbs, ep=cand.ep,
                           etp=None if cand.etp == cand.tp else cand.etp,
                           schedule=cand.schedule, virtual_stages=cand.virtual_stages,
                           stage_types=tuple(cand.stage_types), layers=tuple(cand.layers),
                           predicted_iteration_ms=float(iteration_ms),
                           tokens_per_s=self.tokens_per_s(iteration_ms))


def _positions(devices: Sequence[Device]) -> tuple[tuple[int, int], ...]:
    """``(node, local)`` of a stage's devices (a lazy span's without building them)."""
    if isinstance(devices, DeviceSpan):
        return devices.positions()
    return tuple((d.node, d.local) for d in devices)


@lru_cache(maxsize=4096)
def _peak_live(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> tuple[int, ...]:
    return tuple(peak_live_microbatches(schedule, pp, micro_batches, virtual_stages))
