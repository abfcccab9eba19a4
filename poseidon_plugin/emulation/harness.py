"""Emulated heterogeneous clusters on CPU: ``--poseidon-emulate "A2-2:2,A2-4:2"`` [``--poseidon-emulate-model``].

Torch-free. Lets the whole flow (detection, profiling, search, placement, uneven split) run for real on a
CPU-only machine. Each ``TYPE:COUNT`` entry is one emulated node of COUNT devices of a device type from the
specs presets (``poseidon_plugin/specs/presets/devices.yaml``) or from ``--poseidon-cluster``; launcher
ranks are handed out in order (entry one gets ranks 0..COUNT-1, and so on), so the counts must add up to
the world size.

What an emulated rank does differently (the documented factor):
- it reports the type's name and memory in the inventory;
- its compute is stretched by ``factor = max peak TFLOP/s among the emulated types / its type's peak``:
  the fastest type runs at the CPU's own speed, an A2-4 (280 TFLOP/s) next to an A2-2 (376) takes
  376/280 = 1.34x as long. The stretch is applied to every transformer layer's forward and backward, and to
  the embedding and output layer + loss, by sleeping ``(factor - 1) x`` the measured compute time right
  after it (``emulation/compute_patch.py``). Profiling and training go through the same hooks, so the profile
  measures exactly the slowed-down compute the training will see;
- links are not emulated: the cost model gets what gloo measures on this machine (the transfers the
  training really pays).

That is the *stretch* mode. With ``--poseidon-emulate-model PRESET[:SCALE[:LINKS]]`` the emulation is
*deterministic* instead (second half of this module): compute and links take the analytic times of a real
model on the emulated devices, independent of what the CPU measures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from poseidon_plugin.errors import PoseidonError

FLAG = "--poseidon-emulate"


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulatedNode:
    """One ``TYPE:COUNT`` entry: an emulated node of ``devices`` devices of ``device_type``."""

    device_type: str
    devices: int


def parse_emulate(text: str, known_types: Sequence[str]) -> tuple[EmulatedNode, ...]:
    """Parse ``"A2-2:2,A2-4:2"``; PoseidonError naming the flag, the bad entry and the known types."""
    nodes = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, count = entry.rpartition(":")
        if not sep or not name:
            raise PoseidonError(f"{FLAG} entry {entry!r} is not TYPE:COUNT; e.g. {FLAG} A2-2:2,A2-4:2")
        try:
            devices = int(count)
        except ValueError:
            raise PoseidonError(f"{FLAG} entry {entry!r}: COUNT {count!r} is not an integer") from None
        if devices < 1:
            raise PoseidonError(f"{FLAG} entry {entry!r}: COUNT must be >= 1")
        if name not in known_types:
            raise PoseidonError(
                f"{FLAG} entry {entry!r}: unknown device type {name!r}; known: {', '.join(known_types)}"
            )
        nodes.append(EmulatedNode(device_type=name, devices=devices))
    if not nodes:
        raise PoseidonError(f"{FLAG} {text!r} names no device; e.g. {FLAG} A2-2:2,A2-4:2")
    return tuple(nodes)


def check_world(nodes: Sequence[EmulatedNode], world_size: int) -> None:
    """The emulated devices must be exactly the ranks: one rank per emulated device."""
    total = sum(node.devices for node in nodes)
    if total != world_size:
        spec = ",".join(f"{n.device_type}:{n.devices}" for n in nodes)
        raise PoseidonError(
            f"{FLAG} {spec} declares {total} devices but the job has {world_size} ranks; make the counts add "
            f"up to {world_size} (e.g. --nproc-per-node {total})"
        )


def types_by_rank(nodes: Sequence[EmulatedNode]) -> list[str]:
    """Device type of each launcher rank, in rank order."""
    return [node.device_type for node in nodes for _ in range(node.devices)]


def declared_devices(emulate: str) -> int:
    """How many devices ``--poseidon-emulate`` declares (of the preset device types)."""
    from poseidon_plugin.specs import device_presets

    return sum(node.devices for node in parse_emulate(emulate, device_presets()))


def slowdown_factors(peak_tflops: Mapping[str, float]) -> dict[str, float]:
    """``{type: max peak / its peak}`` over the given types (the fastest gets 1.0)."""
    if not peak_tflops:
        return {}
    fastest = max(peak_tflops.values())
    return {name: fastest / peak for name, peak in peak_tflops.items()}


# --- the deterministic emulation: ``--poseidon-emulate-model PRESET[:SCALE[:LINKS]]`` -------------
#
# With it an emulated rank no longer stretches its *measured* CPU compute. Instead every transformer layer,
# the embedding and the output layer + loss take exactly the time the analytic profile gives a real model
# (the preset) on the rank's device type, times SCALE: the tiny real compute runs first and the rank sleeps
# until the deadline (``emulation/compute_patch.py``). Inter-stage transfers take the time of the emulated link
# class (same node / other node / other type) for the preset's message (``emulation/links_patch.py``), and
# the DP gradient sync the time of the preset's gradients over the DP group's emulated link. Links are
# scaled with compute (bandwidth / SCALE, latency x SCALE), so their weight relative to compute is the real
# cluster's. The planner sees the same numbers: the cluster spec carries the scaled links, and the measured
# profile's byte figures (parameters, activations, messages) are replaced by the preset's, so memory limits
# bind where they would on the real devices (each device type keeps its preset memory).
#
# SCALE defaults to "auto": the scale at which the job's whole compute for one global batch (every layer,
# the embedding and the head, forward and backward, at the job's --micro-batch-size, averaged over the
# emulated ranks' types) divided by the number of ranks lasts AUTO_ITERATION_MS: an iteration with its
# pipeline bubbles then lasts about 1-3 s, long next to the framework's per-call costs on a CPU and short
# enough for a benchmark. With more than RANKS_PER_CORE ranks per CPU core of this host, that target grows
# in proportion: each rank's real CPU work per iteration (megatron-core's Python around the tiny model, about
# 0.3 s at 8 ranks) stays the same, so a longer iteration keeps the host from running out of CPU, which
# would delay every deadline (measured: 8 ranks on 2 cores at 1.5 s ran 15-23 % over the plan). The job's
# own flags still give the layer count, the batch and the tiny model that really runs; the preset gives the
# hidden size, sequence length, vocabulary and dtype of the emulated one.
#
# The automatic SCALE must also leave each layer's deadlines room for the tiny layer's real CPU work, which is
# not small: megatron-core's Python around the layer, and at TP > 1 its gloo all-reduces (thread hand-offs on
# a CPU). When every rank computes at once (the steady 1F1B phase), ranks / (RANKS_PER_CORE x cores) times
# HOST_LAYER_MS[tp] is what one layer's forward and backward really take; a deadline shorter than that is
# overrun by contention and the run drifts from the prediction (measured: 8 ranks at TP 4 with the deadline
# 0.46x that cost ran 9-17 % over the plan with 8 % spread; 12 ranks at TP 2 at 0.91x ran 5-10 % over). The
# forward and the backward are fitted each on its own: the forward does most of the real work (it builds the
# graph) but gets a third of the emulated time, so it is the one that overruns first. So the automatic SCALE
# grows until every TP degree's shortest forward and backward deadlines (fastest type, micro-batch 1) are
# HOST_FIT times those costs, but at most MAX_FIT_GROWTH times the iteration target above; TP degrees that
# would need more are left out of the emulated job (not profiled, so the search cannot pick them), and the
# job's log says which SCALE would include them. An explicit SCALE is kept as given: every TP degree stays,
# and the log warns about those whose deadlines are too short. The embedding and the output layer are not
# fitted: the embedding's emulated time is about 0 at any SCALE, and both run once per micro-batch; the
# profile measures what they really take, overruns included.
#
# HOST_LAYER_MS is one host's, on one day: the same 2-core machine type has run the same code 2-3x slower on
# other days. So the launcher times a fixed pure-Python loop (:func:`host_loop_ms`) before any rank starts,
# and the table is scaled by how much slower than HOST_LOOP_MS (the loop's time on the day of the table) this
# host runs it: :func:`host_factor`, never below 1 (a faster host keeps the table: its deadlines have more
# room), in half-octave steps so that one host keeps one SCALE, and its profile cache, from launch to launch.
# Every rank of the job uses the largest factor of its agents (each agent times its own host).

MODEL_FLAG = "--poseidon-emulate-model"
AUTO_ITERATION_MS = 1500.0
RANKS_PER_CORE = 2
# Wall ms of the real work inside one forward and one backward deadline of the tiny layer (the README job's:
# hidden 64, 4 heads, sequence 32, micro-batch 1) with RANKS_PER_CORE ranks per core, per TP degree: the median
# over every layer pass of 4 ranks on the 2-core host training a plan kept at that TP (--poseidon-keep, 8
# iterations, llama2-13b:2), timed from the pass's start to its hold (emulation/compute_patch.py). TP 8 is not
# measured (it needs 8 devices per node and 8 heads); HOST_LAYER_MS_PER_DOUBLING extends the table beyond TP 4,
# an assumption.
HOST_LAYER_MS = {1: (7.3, 4.6), 2: (16.3, 10.8), 4: (27.4, 20.3)}
HOST_LAYER_MS_PER_DOUBLING = 2.0
# The fastest of HOST_LOOP_REPEATS runs of :func:`_host_loop`, wall ms, on the host and day of HOST_LAYER_MS.
# That host ran it in 14-23 ms within the same minute (it alternates between two speeds); the slower, 22.0,
# is the reference, so that both read as factor 1.
HOST_LOOP_MS = 22.0
HOST_LOOP_REPEATS = 5
HOST_FACTOR_ENV = "POSEIDON_EMULATION_HOST_FACTOR"
HOST_FIT = 1.5
MAX_FIT_GROWTH = 3.0
DEFAULT_LINKS = "npu"
# Link families only the emulation offers (beside devices.yaml's): "npu-wan" is the npu family with the
# device types' clusters joined by a 10 Gbps / 500 us WAN (our assumption), so cross-type transfers are slow.
EXTRA_LINKS = {
    "npu-wan": {"intra_node": {"bandwidth_gbps": 1400, "latency_us": 10},
                "inter_node": {"bandwidth_gbps": 200, "latency_us": 20},
                "cross_type": {"bandwidth_gbps": 10, "latency_us": 500}},
}
_BYTE_FIELDS = ("layer_params", "activation_bytes", "send_bytes", "embedding_params", "embedding_activation_bytes",
                "head_params", "head_activation_bytes")
_TIME_FIELDS = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms", "head_forward_ms",
                "head_backward_ms")


@dataclass(frozen=True, kw_only=True, slots=True)
class EmulatedModel:
    """``PRESET[:SCALE[:LINKS]]``: the real model whose times and sizes the ranks emulate."""

    preset: str
    scale: float | None
    """Emulated time / real time; None: automatic (:func:`auto_scale`)."""
    links: str = DEFAULT_LINKS
    """Link preset of ``devices.yaml`` (``npu``, ``gpu``, ``npu-wan``) for the three link classes."""


def parse_emulate_model(text: str, known_models: Sequence[str], known_links: Sequence[str]) -> EmulatedModel:
    """Parse ``llama3-8b``, ``llama3-8b:0.5``, ``llama3-8b:auto:gpu``; PoseidonError naming the bad part."""
    example = f"e.g. {MODEL_FLAG} llama3-8b:auto:npu"
    parts = [p.strip() for p in text.strip().split(":")]
    if not parts[0] or len(parts) > 3:
        raise PoseidonError(f"{MODEL_FLAG} {text!r} is not PRESET[:SCALE[:LINKS]]; {example}")
    preset = parts[0]
    if preset not in known_models:
        raise PoseidonError(f"{MODEL_FLAG} {text!r}: unknown model preset {preset!r}; known: {', '.join(known_models)}")
    scale: float | None = None
    if len(parts) > 1 and parts[1] not in ("", "auto"):
        try:
            scale = float(parts[1])
        except ValueError:
            raise PoseidonError(f"{MODEL_FLAG} {text!r}: SCALE {parts[1]!r} is not a number or 'auto'; {example}") from None
        if not 0.0 < scale < float("inf"):
            raise PoseidonError(f"{MODEL_FLAG} {text!r}: SCALE must be a finite number > 0 (or 'auto')")
    links = parts[2] if len(parts) > 2 and parts[2] else DEFAULT_LINKS
    if links not in known_links:
        raise PoseidonError(f"{MODEL_FLAG} {text!r}: unknown link preset {links!r}; known: {', '.join(known_links)}")
    return EmulatedModel(preset=preset, scale=scale, links=links)


def link_families() -> dict[str, dict]:
    """Link families by name: devices.yaml's presets (npu, gpu) and :data:`EXTRA_LINKS`."""
    from poseidon_plugin.specs.cluster import _device_presets

    return {**_device_presets()[1], **EXTRA_LINKS}


def emulated_cluster(nodes: Sequence[EmulatedNode], *, links: str, scale: float = 1.0) -> Any:
    """The ClusterSpec of the emulated nodes (preset device types), its links scaled with compute."""
    from poseidon_plugin.specs import parse_cluster

    family = link_families()[links]
    scaled = {kind: {"bandwidth_gbps": spec["bandwidth_gbps"] / scale, "latency_us": spec["latency_us"] * scale}
              for kind, spec in family.items()}
    return parse_cluster({
        "name": "emulated",
        "description": f"{FLAG} {','.join(f'{n.device_type}:{n.devices}' for n in nodes)} ({links} links x{scale:.6g})",
        "device_types": sorted({n.device_type for n in nodes}),
        "nodes": [{"device_type": n.device_type, "count": 1, "devices_per_node": n.devices} for n in nodes],
        "links": scaled,
    }, f"{FLAG} {','.join(f'{n.device_type}:{n.devices}' for n in nodes)}")


def auto_scale(nodes: Sequence[EmulatedNode], model: Any, *, links: str, num_layers: int, global_batch: int,
               micro_batch_size: int, cores: int | None = None) -> float:
    """The SCALE at which the job's compute per global batch, spread over every rank, lasts AUTO_ITERATION_MS
    (times ranks / (RANKS_PER_CORE x cores) when that is more than 1; ``cores``: this host's usable CPUs)."""
    from poseidon_plugin.specs import analytic_entry, constants_for

    cluster = emulated_cluster(nodes, links=links)
    constants = constants_for(cluster, model)
    mbs = max(1, micro_batch_size)
    per_type = {}
    for name in cluster.type_names:
        e = analytic_entry(cluster, model, name, 1, mbs, constants)
        per_type[name] = (num_layers * (e.forward_ms + e.backward_ms) + e.embedding_forward_ms
                          + e.embedding_backward_ms + e.head_forward_ms + e.head_backward_ms)
    ranks = types_by_rank(nodes)
    mean_ms = sum(per_type[t] for t in ranks) / len(ranks)
    ideal_ms = mean_ms * max(1, global_batch // mbs) / len(ranks)
    return AUTO_ITERATION_MS * max(1.0, len(ranks) / (RANKS_PER_CORE * usable_cores(cores))) / ideal_ms


def usable_cores(cores: int | None = None) -> int:
    """``cores``, or this host's usable CPUs when None."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores)


def host_layer_ms(tp: int, ranks: int, cores: int | None = None, host_factor: float = 1.0) -> tuple[float, float]:
    """``(forward, backward)`` ms of real work in one tiny layer's deadlines at TP ``tp`` on this host when
    ``ranks`` ranks compute at once (HOST_LAYER_MS scaled by the ranks per core beyond RANKS_PER_CORE and by
    ``host_factor``, :func:`host_factor`)."""
    known = max(t for t in HOST_LAYER_MS if t <= tp)
    forward, backward = HOST_LAYER_MS[known]
    grow = host_factor * max(1.0, ranks / (RANKS_PER_CORE * usable_cores(cores)))
    while known < tp:
        known *= 2
        grow *= HOST_LAYER_MS_PER_DOUBLING
    return forward * grow, backward * grow


def _host_loop(n: int = 50_000) -> int:
    """A fixed piece of interpreter work (integer arithmetic and a dict), what a rank's Python around the tiny
    model is made of."""
    table: dict[int, int] = {}
    acc = 0
    for i in range(n):
        acc += i * 3 ^ (i >> 2)
        table[i & 1023] = acc
    return acc


def host_loop_ms(clock: Callable[[], float] | None = None, repeats: int = HOST_LOOP_REPEATS) -> float:
    """Wall ms of :func:`_host_loop` on this host, the fastest of ``repeats`` runs (``clock``: seconds,
    default ``time.perf_counter``)."""
    import time

    clock = clock or time.perf_counter
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = clock()
        _host_loop()
        best = min(best, (clock() - start) * 1e3)
    return best


def host_factor(loop_ms: float) -> float:
    """How many times slower than the host of HOST_LAYER_MS this one runs the tiny layer, from
    :func:`host_loop_ms`: ``loop_ms / HOST_LOOP_MS`` rounded to the nearest half octave (1, 1.41, 2, 2.83,
    ...), never below 1."""
    if not loop_ms > HOST_LOOP_MS:
        return 1.0
    steps = round(2.0 * math.log2(loop_ms / HOST_LOOP_MS))
    return float(f"{2.0 ** (steps / 2.0):.4g}") if steps > 0 else 1.0


def parse_host_factor(text: str | None) -> float:
    """:data:`HOST_FACTOR_ENV` as the ranks read it: 1 when unset; PoseidonError naming it when not a number
    >= 1."""
    if text is None or not text.strip():
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 1.0 <= value < float("inf"):
        raise PoseidonError(f"{HOST_FACTOR_ENV}={text!r} is not a number >= 1 (how many times slower than the "
                            f"emulation's reference host this one runs; unset it to let poseidon-run measure)")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class HostFit:
    """The emulation's SCALE and TP degrees as this host can keep them (:func:`fit_to_host`)."""

    scale: float
    tp_limit: int | None
    """Largest TP degree the emulated job offers; None: every valid one."""
    short: tuple[tuple[int, float], ...] = ()
    """``(TP, SCALE it needs)`` of the TP degrees whose deadline is under HOST_FIT x their CPU cost at
    ``scale``: left out when automatic, kept (and warned about) when the SCALE was given."""
    host_factor: float = 1.0
    """How many times slower than HOST_LAYER_MS's host this one runs (:func:`host_factor`), as fitted."""


def fit_to_host(nodes: Sequence[EmulatedNode], model: Any, *, links: str, scale: float, automatic: bool,
                tp_degrees: Mapping[str, Sequence[int]], cores: int | None = None,
                host_factor: float = 1.0) -> HostFit:
    """Grow an automatic ``scale`` (at most MAX_FIT_GROWTH x) until each TP degree's shortest forward and
    backward deadlines are HOST_FIT x :func:`host_layer_ms`'s; TP degrees needing more are left out.
    ``tp_degrees``: per device type of ``nodes``, the TP degrees the job can use there. A given SCALE
    (``automatic`` false) stays."""
    from poseidon_plugin.specs import analytic_entry, constants_for

    cluster = emulated_cluster(nodes, links=links)
    constants = constants_for(cluster, model)
    ranks = len(types_by_rank(nodes))
    needed: dict[int, float] = {}
    for tp in sorted({t for degrees in tp_degrees.values() for t in degrees}):
        entries = [analytic_entry(cluster, model, name, tp, 1, constants)
                   for name, degrees in tp_degrees.items() if tp in degrees]
        forward, backward = host_layer_ms(tp, ranks, cores, host_factor)
        needed[tp] = HOST_FIT * max(forward / min(e.forward_ms for e in entries),
                                    backward / min(e.backward_ms for e in entries))
    if not automatic:
        return HostFit(scale=scale, tp_limit=None, host_factor=host_factor,
                       short=tuple((tp, need) for tp, need in needed.items() if need > scale))
    out, limit = scale, None
    for tp, need in needed.items():  # ascending TP: the CPU cost grows with it
        if need > MAX_FIT_GROWTH * scale:
            return HostFit(scale=out, tp_limit=limit, host_factor=host_factor,
                           short=tuple((t, n) for t, n in needed.items() if t >= tp))
        out, limit = max(out, need), tp
    return HostFit(scale=out, tp_limit=None, host_factor=host_factor)


def link_kind(a: tuple[int, str], b: tuple[int, str]) -> int:
    """LINK_* between two devices given as ``(node, device type)``."""
    from poseidon_plugin.specs import LINK_CROSS_TYPE, LINK_INTER_NODE, LINK_INTRA_NODE

    if a[1] != b[1]:
        return LINK_CROSS_TYPE
    return LINK_INTRA_NODE if a[0] == b[0] else LINK_INTER_NODE


class EmulationState:
    """One rank's deterministic emulation: its targets, the emulated sizes, and (once bound) its links.

    Torch-free; the patches read it. Built by :func:`deterministic_state`.
    """

    def __init__(self, *, nodes: Sequence[EmulatedNode], model: Any, spec: EmulatedModel, scale: float,
                 device_type: str, fit: HostFit | None = None) -> None:
        from poseidon_plugin.specs import constants_for

        self.nodes = tuple(nodes)
        self.model = model
        self.spec = spec
        self.scale = float(scale)
        self.fit = fit if fit is not None else HostFit(scale=self.scale, tp_limit=None)
        self.device_type = device_type
        self.real_cluster = emulated_cluster(nodes, links=spec.links)
        self.cluster = emulated_cluster(nodes, links=spec.links, scale=self.scale)
        self.constants = constants_for(self.real_cluster, model)
        self._entries: dict[tuple[str, int, int], Any] = {}
        self.rank_places: dict[int, tuple[int, str]] = {}
        """Global rank (planned numbering) -> (node, device type), once :meth:`bind_plan` ran."""
        self.my_rank: int | None = None
        self.tp = 1
        """The plan's TP degree (sizes the emulated messages), once bound."""
        self.sync_ms = 0.0
        """This rank's emulated DP gradient sync per iteration (0 until bound, or with DP = 1)."""
        self.expert_ms = (0.0, 0.0)
        """(forward, backward) ms an MoE layer of this rank takes more under the plan's expert layout than
        profiled (the dispatch and combine all-to-all, as the cost model prices them; 0 until bound)."""

    def entry(self, device_type: str, tp: int, mbs: int) -> Any:
        """The preset's analytic ProfileEntry on the real (unscaled) devices and links."""
        key = (device_type, tp, mbs)
        e = self._entries.get(key)
        if e is None:
            from poseidon_plugin.specs import analytic_entry

            e = self._entries[key] = analytic_entry(self.real_cluster, self.model, device_type, tp, mbs,
                                                    self.constants)
        return e

    def targets_ms(self, part: str, tp: int, mbs: int) -> tuple[float, float]:
        """(forward, backward) ms of ``part`` (``layer``, ``embedding``, ``head``) on this rank, scaled."""
        e = self.entry(self.device_type, tp, mbs)
        if part == "layer":
            return e.forward_ms * self.scale + self.expert_ms[0], e.backward_ms * self.scale + self.expert_ms[1]
        if part == "embedding":
            f, b = e.embedding_forward_ms, e.embedding_backward_ms
        elif part == "head":
            f, b = e.head_forward_ms, e.head_backward_ms
        else:
            raise ValueError(f"unknown emulated part {part!r}")
        return f * self.scale, b * self.scale

    def profile_bytes(self, tp: int, mbs: int, device_type: str | None = None) -> dict[str, int]:
        """The preset's byte figures (parameters, activations, message) for a profile entry."""
        e = self.entry(device_type or self.device_type, tp, mbs)
        return {name: int(getattr(e, name)) for name in _BYTE_FIELDS}

    def override_profile(self, doc: dict) -> dict:
        """A measured profile entry (dict) with the preset's byte figures; times stay measured."""
        out = dict(doc)
        out.update(self.profile_bytes(int(doc["tp"]), int(doc["mbs"]), str(doc["device_type"])))
        return out

    def emulated_entry(self, device_type: str, tp: int, mbs: int) -> dict:
        """A whole profile entry (dict) of the emulated device: scaled times, the preset's sizes."""
        e = self.entry(device_type, tp, mbs)
        doc = {"device_type": device_type, "tp": tp, "mbs": mbs}
        doc.update({name: getattr(e, name) * self.scale for name in _TIME_FIELDS})
        doc.update({name: int(getattr(e, name)) for name in _BYTE_FIELDS})
        return doc

    def allows_tp(self, tp: int) -> bool:
        """Whether the emulated job offers TP ``tp`` on this host (:class:`HostFit`)."""
        return self.fit.tp_limit is None or tp <= self.fit.tp_limit

    def host_notes(self) -> list[str]:
        """What :func:`fit_to_host` decided, for the job's log: TP degrees left out or short of CPU time."""
        cores = usable_cores()
        flag = f"{MODEL_FLAG} {self.spec.preset}"
        notes = []
        if self.fit.host_factor > 1.0:
            fitted = (f"SCALE {self.scale:.3g} gives each layer's deadlines room for it" if self.spec.scale is None
                      else "the TP degrees below (if any) are short of time for it at the given SCALE")
            notes.append(f"this host runs the ranks' CPU work {self.fit.host_factor:.3g}x slower than the host of "
                         f"the emulation's CPU costs (poseidon-run timed it; {HOST_FACTOR_ENV} pins it): {fitted}")
        for tp, need in self.fit.short:
            why = (f"TP {tp}: on {cores} cores its layers need SCALE >= {need:.3g} to keep their deadlines (the "
                   f"tiny layer's CPU cost x{HOST_FIT:g}, every rank busy)")
            if self.allows_tp(tp):
                notes.append(f"{why}; at SCALE {self.scale:.3g} expect iterations above the prediction")
            else:
                notes.append(f"{why}; left out of the search (automatic SCALE {self.scale:.3g}; "
                             f"{flag}:{need:.3g} includes it)")
        return notes

    def cache_tag(self) -> str:
        """What a cached profile entry depends on beyond the job (part of the profiler's cache key)."""
        return f"deterministic:{self.spec.preset}:{self.scale:.9g}:{self.spec.links}"

    def memory_bytes(self, device_type: str | None = None) -> int:
        """The emulated device's memory (the preset device type's)."""
        from poseidon_plugin.specs import GIB

        return int(self.cluster.device_type(device_type or self.device_type).memory_gb * GIB)

    # --- once the plan is known ----------------------------------------------------------------

    def bind_plan(self, plan: Any, global_rank: int, job_model: Any) -> None:
        """Learn where every planned rank sits (for link classes), this rank's DP sync time and (MoE) its layers'
        expert-layout time.

        ``job_model`` is the planner's ModelSpec of the job (its dtype and optimizer set the gradient
        bytes, as in the cost model); the sync time is the cost model's for the preset's parameters.
        """
        from poseidon_plugin.costmodel import Candidate, CostModel
        from poseidon_plugin.specs import ProfileEntry, ProfileSpec

        self.rank_places = {}
        for stage in plan.stages:
            for rank, (node, _local) in zip(stage.ranks, stage.devices):
                self.rank_places[rank] = (node, stage.device_type)
        self.my_rank = global_rank
        self.tp = plan.tp
        stage_types = plan.stage_types
        entries = tuple(ProfileEntry(**self.emulated_entry(t, plan.tp, plan.micro_batch_size))
                        for t in sorted(set(stage_types)))
        profile = ProfileSpec(model=job_model.name, seq_length=job_model.seq_length, dtype=job_model.dtype,
                              entries=entries, source="analytic", software={})
        cand = Candidate(tp=plan.tp, pp=plan.pp, dp=plan.dp, mbs=plan.micro_batch_size, stage_types=stage_types,
                         layers=tuple(plan.layers), schedule=plan.schedule, virtual_stages=plan.virtual_stages,
                         devices=tuple(tuple(s.devices) for s in plan.stages), ep=plan.ep, etp=plan.etp)
        # priced without recomputation: a recomputing layer runs its forward again inside its backward, and
        # that replay is held to the forward's own deadline; the backward deadline is the plain layer's
        plain = replace(job_model, recompute="none", recompute_method="", recompute_num_layers=0)
        cm = CostModel(self.cluster, plain, profile)
        _f, _b, _s, allreduce = cm.stage_times(cand)
        stage = next(s.index for s in plan.stages if global_rank in s.ranks)
        self.sync_ms = allreduce[stage]
        # the expert layout's all-to-all blocks each MoE layer: its deadline grows by what the planner added
        mine = plan.stages[stage].device_type
        group = cm.group(mine, plan.tp, plan.micro_batch_size, plan.dp, plan.ep, plan.etp)
        entry = profile.lookup(mine, plan.tp, plan.micro_batch_size)
        self.expert_ms = (group.forward_ms - entry.forward_ms, group.backward_ms - entry.backward_ms)

    def p2p_ms(self, peer: int, mbs: int, tp: int | None = None) -> float:
        """Emulated one-way time of one activation (or gradient) message to/from global rank ``peer``."""
        if self.my_rank is None or peer not in self.rank_places or self.my_rank not in self.rank_places:
            return 0.0
        kind = link_kind(self.rank_places[self.my_rank], self.rank_places[peer])
        link = self.cluster.link(self.device_type, kind)
        nbytes = self.entry(self.device_type, tp or self.tp, mbs).send_bytes
        return nbytes / (link.bytes_per_ms * self.constants.link_efficiency) + link.latency_ms


def deterministic_state(*, emulate: str, emulate_model: str, rank: int, world_size: int, num_layers: int,
                        global_batch: int, micro_batch_size: int, job_model: Any = None,
                        cores: int | None = None, host_factor: float = 1.0) -> EmulationState:
    """Parse both options and build this rank's EmulationState (the scale resolved when automatic and fitted
    to this host, :func:`fit_to_host`, ``host_factor`` times slower than HOST_LAYER_MS's). ``job_model``: the
    ModelSpec of the job that really runs, whose TP degrees are fitted (None: every power of two up to a
    node's devices)."""
    from poseidon_plugin.specs import device_presets, load_model, model_presets, valid_tp_degrees

    nodes = parse_emulate(emulate, device_presets())
    check_world(nodes, world_size)
    spec = parse_emulate_model(emulate_model, model_presets(), tuple(link_families()))
    model = load_model(spec.preset)
    scale = spec.scale if spec.scale is not None else auto_scale(
        nodes, model, links=spec.links, num_layers=num_layers, global_batch=global_batch,
        micro_batch_size=micro_batch_size, cores=cores)
    cluster = emulated_cluster(nodes, links=spec.links)
    degrees = {name: (valid_tp_degrees(cluster, job_model, name) if job_model is not None
                      else tuple(2 ** k for k in range(cluster.devices_per_node(name).bit_length())))
               for name in cluster.type_names}
    fit = fit_to_host(nodes, model, links=spec.links, scale=scale, automatic=spec.scale is None,
                      tp_degrees=degrees, cores=cores, host_factor=host_factor)
    return EmulationState(nodes=nodes, model=model, spec=spec, scale=fit.scale, device_type=types_by_rank(nodes)[rank],
                          fit=fit)


# --- the process's active deterministic emulation (what the bootstrap and the profiler ask) ------------

_active: dict[str, EmulationState | None] = {"state": None}


def install_deterministic(state: EmulationState) -> EmulationState:
    """Make ``state`` this process's emulation: compute deadlines and link delays patched in (the links stay
    free until :meth:`EmulationState.bind_plan`). Imports torch/Megatron (the patch tables)."""
    from poseidon_plugin.emulation import compute_patch, links_patch as emulated_links

    compute_patch.set_targets(state.targets_ms)
    compute_patch.TABLE.apply()
    emulated_links.set_state(state)
    emulated_links.TABLE.apply()
    _active["state"] = state
    return state


STAMPS_KEY = "poseidon/emulation-stamps"


def share_stamps(store: Any, rank: int, world_size: int, *, one_host: bool,
                 agree: Callable[[bool], bool]) -> str:
    """Give every planned rank the same stamp file for the emulated links' posting times
    (``emulation/links_patch.Stamps``), whichever torchrun agent started it; a line for the log.

    Planned rank 0 creates a fresh file (named by its pid: a restart never reads an earlier attempt's
    stamps) where its launcher lets it (``STAMPS_ENV``) and publishes the path in the store of this round
    (``store``); the others map that file. ``agree(ok)`` is True when every rank mapped it: stamps are used
    by all ranks or by none (a rank without them would wait for stamps its peers never read). Only when
    ``one_host``: a mapped file is one host's."""
    from poseidon_plugin.emulation import links_patch as emulated_links

    stamps, why = None, "the planned ranks are on several hosts"
    if one_host:
        if rank == 0:
            base = os.environ.get(emulated_links.STAMPS_ENV, "")
            path = f"{base}-{os.getpid()}" if base else ""
            try:
                stamps = emulated_links.Stamps(path, world_size) if path else None
            except OSError:
                stamps = None
            store.set(STAMPS_KEY, path if stamps is not None else "")
        else:
            path = store.get(STAMPS_KEY).decode("utf-8")
            try:
                stamps = emulated_links.Stamps(path, world_size, create=False) if path else None
            except (OSError, ValueError):
                stamps = None
        why = "a rank could not map the shared file" if path else "no launcher folder for it (run by poseidon-run)"
    if not agree(stamps is not None):
        stamps = None
    emulated_links.set_stamps(stamps)
    if stamps is not None:
        return f"p2p posting times shared by the {world_size} planned ranks through one file"
    return (f"p2p posting times not shared ({why}): a transfer counts from when its completion is first seen")


def uninstall_deterministic() -> None:
    """Revert :func:`install_deterministic` (tests)."""
    state = _active["state"]
    _active["state"] = None
    if state is None:
        return
    from poseidon_plugin.emulation import compute_patch, links_patch as emulated_links

    emulated_links.TABLE.revert()
    emulated_links.set_state(None)
    compute_patch.TABLE.revert()
    compute_patch.set_targets(None)


def active() -> EmulationState | None:
    """The installed deterministic emulation, or None."""
    return _active["state"]


def override_profile_entry(doc: dict) -> dict:
    """For the profiler: a measured entry with the emulated model's byte figures (unchanged without one)."""
    state = _active["state"]
    return doc if state is None else state.override_profile(doc)


def times_layers() -> bool:
    """A deterministic emulation is in effect: it times the layers itself (an MoE layer's expert layout from
    the analytic term: ``bind_plan``), so the profiler measures no expert-parallel layer under it."""
    return _active["state"] is not None


def profile_cache_tag() -> str:
    """For the profiler's cache key: the deterministic emulation in effect ('' without one)."""
    state = _active["state"]
    return "" if state is None else state.cache_tag()
