"""Cluster spec: device types, homogeneous nodes, and the three link classes between devices.

A cluster is a list of node groups; every node holds devices of one type. Devices are enumerated in
file order (node group, node, local index), which is how a plan names physical devices.

Links: a transfer between two devices uses one of three link classes, each with a bandwidth (Gbps) and
a latency (µs): ``intra_node`` (same node), ``inter_node`` (different nodes of the same device type) and
``cross_type`` (nodes of different device types: different clusters in the paper's setting). A device
type may override ``intra_node`` / ``inter_node`` for its own nodes.

Sizes are bounded (:data:`MAX_DEVICES` in all, :data:`MAX_DEVICES_PER_NODE`, :data:`MAX_DEVICE_TYPES`)
and checked from the node groups' counts before anything is built per device. The spec itself stores
node groups only; :meth:`ClusterSpec.devices` builds the per-device list on demand (O(devices)), and
counts (``num_devices``, ``num_devices_of_type``) are O(node groups).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Iterator, Mapping

from ..errors import InputError
from .fields import (PRESET_DIR, check_keys, get_float, get_int, get_list, get_mapping, get_str,
                     load_document_or_preset, preset_names, quote, read_document)

LINK_INTRA_NODE = 0
LINK_INTER_NODE = 1
LINK_CROSS_TYPE = 2
LINK_NAMES = ("intra_node", "inter_node", "cross_type")

MAX_DEVICES = 1 << 20
"""Devices in a cluster (1,048,576): room for million-device planning, checked before any per-device list."""

MAX_DEVICES_PER_NODE = 4096
"""Devices in one node (real nodes hold 8-16; rack-scale "supernodes" a few hundred)."""

MAX_DEVICE_TYPES = 256
"""Device types in a cluster."""

@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One link class."""

    bandwidth_gbps: float  # nominal bandwidth per direction, 1e9 bit/s
    latency_us: float      # per-message latency (one hop), microseconds

    @property
    def bytes_per_ms(self) -> float:
        """Nominal bandwidth in bytes per millisecond."""
        return self.bandwidth_gbps * 1e9 / 8.0 / 1e3

    @property
    def latency_ms(self) -> float:
        """Latency in milliseconds."""
        return self.latency_us * 1e-3


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceType:
    """An accelerator model."""

    name: str                       # e.g. "A2-2"; stage device types in plans use this name
    memory_gb: float                # device memory, GiB
    peak_tflops: float              # peak dense TFLOP/s in the training dtype (bf16/fp16)
    efficiency: float | None = None  # overrides CostConstants.compute_efficiency for this type
    intra_node: LinkSpec | None = None  # overrides the cluster's intra_node link for these nodes
    inter_node: LinkSpec | None = None  # overrides the cluster's inter_node link for these nodes


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroup:
    """``count`` identical nodes with ``devices_per_node`` devices of one type."""

    device_type: str
    count: int
    devices_per_node: int = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One physical device."""

    index: int        # position in the cluster's enumeration (0-based)
    node: int         # global node index (0-based, file order)
    local: int        # index inside its node (the local rank / visible-device index)
    device_type: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A heterogeneous cluster: device types, node groups and link classes."""

    name: str
    device_types: tuple[DeviceType, ...]
    nodes: tuple[NodeGroup, ...]
    intra_node: LinkSpec
    inter_node: LinkSpec
    cross_type: LinkSpec
    constants: Mapping[str, Any] | None = None  # cost-model constant overrides (CostConstants names)
    description: str = ""
    source: str = field(default="<memory>", compare=False)  # file or preset it was read from

    def __post_init__(self) -> None:
        names = [t.name for t in self.device_types]
        if len(names) > MAX_DEVICE_TYPES:
            raise InputError(f"{self.source}: device_types has {len(names):,} entries; a cluster has at "
                             f"most {MAX_DEVICE_TYPES} device types")
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise InputError(f"{self.source}: device_types[{i}].name = {quote(name)} is declared twice; "
                                 "give each device type one entry")
            seen.add(name)
        total = 0
        for i, group in enumerate(self.nodes):
            if group.device_type not in seen:
                raise InputError(f"{self.source}: nodes[{i}].device_type = {quote(group.device_type)} is "
                                 f"not a declared device type; declared: {_names(names)}")
            total += group.count * group.devices_per_node
            if total > MAX_DEVICES:
                raise InputError(_too_many_devices(f"{self.source}: nodes[{i}]", total))
        used = {g.device_type for g in self.nodes}
        for name in names:
            if name not in used:
                raise InputError(f"{self.source}: device type {quote(name)} has no nodes; add a nodes "
                                 "entry with that device_type or remove it from device_types")

    @property
    def type_names(self) -> tuple[str, ...]:
        """Device type names in declaration order."""
        return tuple(t.name for t in self.device_types)

    def device_type(self, name: str) -> DeviceType:
        """The device type called ``name``."""
        for t in self.device_types:
            if t.name == name:
                return t
        raise InputError(f"device type {quote(name)} is not in cluster {quote(self.name)}; "
                         f"known: {_names(self.type_names)}")

    def devices(self) -> tuple[Device, ...]:
        """Every device, in enumeration order (node group, node, local index); built on each call."""
        return tuple(self.iter_devices())

    def iter_devices(self, device_type: str | None = None) -> Iterator[Device]:
        """The devices (of one type, if given) in enumeration order, without building a list."""
        index = node = 0
        for group in self.nodes:
            size = group.count * group.devices_per_node
            if device_type is None or group.device_type == device_type:
                for n in range(group.count):
                    for local in range(group.devices_per_node):
                        yield Device(index=index + n * group.devices_per_node + local, node=node + n,
                                     local=local, device_type=group.device_type)
            index += size
            node += group.count

    def devices_of_type(self, name: str) -> tuple[Device, ...]:
        """The devices of one type, in enumeration order (a list built per call: O(devices))."""
        self.device_type(name)
        return tuple(self.iter_devices(name))

    def type_devices(self, name: str) -> "TypeDevices":
        """The devices of one type as a lazy sequence: ``len``, indexing and slicing without a
        :class:`Device` per device (the cost model asks for a few stage slots of 800,000 devices)."""
        self.device_type(name)
        return TypeDevices(self, name)

    def device_at(self, node: int, local: int) -> Device | None:
        """The device at ``(node, local)``, or None when the cluster has none there; O(node groups)."""
        index = first = 0
        for group in self.nodes:
            if first <= node < first + group.count:
                if not 0 <= local < group.devices_per_node:
                    return None
                return Device(index=index + (node - first) * group.devices_per_node + local, node=node,
                              local=local, device_type=group.device_type)
            index += group.count * group.devices_per_node
            first += group.count
        return None

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return sum(g.count * g.devices_per_node for g in self.nodes)

    def num_devices_of_type(self, name: str) -> int:
        """Number of devices of one type."""
        return sum(g.count * g.devices_per_node for g in self.nodes if g.device_type == name)

    def devices_per_node(self, name: str) -> int:
        """The smallest node size among nodes of this type (a TP group must fit in any of them)."""
        self.device_type(name)
        return min(g.devices_per_node for g in self.nodes if g.device_type == name)

    def link(self, name: str, kind: int) -> LinkSpec:
        """The link of class ``kind`` (``LINK_*``) as seen by devices of type ``name``."""
        t = self.device_type(name)
        if kind == LINK_INTRA_NODE:
            return t.intra_node or self.intra_node
        if kind == LINK_INTER_NODE:
            return t.inter_node or self.inter_node
        if kind == LINK_CROSS_TYPE:
            return self.cross_type
        raise ValueError(f"unknown link kind {kind}")

    def to_dict(self) -> dict[str, Any]:
        """A plain document that :func:`parse_cluster` reads back to an equal spec."""
        def link(ls: LinkSpec) -> dict[str, float]:
            return {"bandwidth_gbps": ls.bandwidth_gbps, "latency_us": ls.latency_us}

        types = []
        for t in self.device_types:
            d: dict[str, Any] = {"name": t.name, "memory_gb": t.memory_gb, "peak_tflops": t.peak_tflops}
            if t.efficiency is not None:
                d["efficiency"] = t.efficiency
            links = {k: link(v) for k, v in (("intra_node", t.intra_node), ("inter_node", t.inter_node))
                     if v is not None}
            if links:
                d["links"] = links
            types.append(d)
        doc: dict[str, Any] = {
            "name": self.name,
            "device_types": types,
            "nodes": [{"device_type": g.device_type, "count": g.count,
                       "devices_per_node": g.devices_per_node} for g in self.nodes],
            "links": {"intra_node": link(self.intra_node), "inter_node": link(self.inter_node),
                      "cross_type": link(self.cross_type)},
        }
        if self.constants:
            doc["constants"] = dict(self.constants)
        if self.description:
            doc["description"] = self.description
        return doc


# --- parsing -------------------------------------------------------------------------------------

class TypeDevices(Sequence):
    """The devices of one type in enumeration order, computed per index from the node groups
    (``ClusterSpec.type_devices``); equal, element by element, to ``ClusterSpec.devices_of_type``."""

    __slots__ = ("_runs", "_len", "_type")

    def __init__(self, cluster: "ClusterSpec", name: str):
        runs = []          # (first position in this sequence, device index, node, devices per node, size)
        pos = index = node = 0
        for group in cluster.nodes:
            size = group.count * group.devices_per_node
            if group.device_type == name and size:
                runs.append((pos, index, node, group.devices_per_node, size))
                pos += size
            index += size
            node += group.count
        self._runs, self._len, self._type = tuple(runs), pos, name

    def __len__(self) -> int:
        return self._len

    def _device(self, run: tuple, j: int) -> Device:
        """Device ``j`` of a run (its position within it)."""
        _pos, index, node, per, _size = run
        n, local = divmod(j, per)
        return Device(index=index + j, node=node + n, local=local, device_type=self._type)

    def _at(self, i: int) -> Device:
        for run in self._runs:
            if i < run[0] + run[4]:
                return self._device(run, i - run[0])
        raise IndexError(i)

    def span(self, start: int, stop: int) -> "DeviceSpan":
        """Devices ``start .. stop - 1`` as a lazy view (no :class:`Device` built until asked): a
        plan's stage on 800,000 devices holds 176,000 of them."""
        if not 0 <= start <= stop <= self._len:
            raise IndexError(f"devices {start}..{stop - 1} of {self._len}")
        return DeviceSpan(self, start, stop)

    def _pieces(self, start: int, stop: int):
        """Each run's share of devices ``start .. stop - 1``: ``(run, lo, hi)``, its positions
        ``lo .. hi - 1`` within the run (runs it does not meet are skipped)."""
        for run in self._runs:
            lo, hi = max(start, run[0]) - run[0], min(stop, run[0] + run[4]) - run[0]
            if lo < hi:
                yield run, lo, hi

    def positions(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """``(node, local)`` of devices ``start .. stop - 1``, node by node (no :class:`Device`)."""
        out: list[tuple[int, int]] = []
        for (_pos, _index, node, per, _size), lo, hi in self._pieces(start, stop):
            for n in range(lo // per, (hi + per - 1) // per):
                a, b = max(lo, n * per), min(hi, (n + 1) * per)
                out.extend((node + n, local) for local in range(a - n * per, b - n * per))
        return tuple(out)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return tuple(self._at(j) for j in range(start, stop, step))
            # run by run (no search for the run per device): a plan's stages slice 100k+ devices
            return tuple(self._device(run, j) for run, lo, hi in self._pieces(start, stop)
                         for j in range(lo, hi))
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"device {i} of {self._len}")
        return self._at(i)


class DeviceSpan(Sequence):
    """A run of consecutive devices of one type (``TypeDevices.span``): a sequence of
    :class:`Device` built per index, equal to the tuple of the same devices."""

    __slots__ = ("_of", "_start", "_stop")

    def __init__(self, of: TypeDevices, start: int, stop: int):
        self._of, self._start, self._stop = of, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"device {i} of {len(self)}")
        return self._of[self._start + i]

    def __iter__(self) -> Iterator[Device]:
        return iter(self._of[self._start:self._stop])

    def positions(self) -> tuple[tuple[int, int], ...]:
        """``(node, local)`` of each device, in order, without building the devices."""
        return self._of.positions(self._start, self._stop)

    def __eq__(self, other) -> bool:
        if isinstance(other, DeviceSpan) and (other._of._runs, other._of._type) == (self._of._runs,
                                                                                  self._of._type):
            return (other._start, other._stop) == (self._start, self._stop)
        return isinstance(other, Sequence) and len(other) == len(self) and tuple(other) == tuple(self)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"DeviceSpan({self._of._type!r}, {self._start}, {self._stop})"


def _device_presets() -> tuple[dict, dict]:
    doc = read_document(PRESET_DIR / "devices.yaml", "device preset")
    return doc["device_types"], doc["link_presets"]


def _names(names) -> str:
    """Declared names for a message: each quoted, and at most a few dozen."""
    shown = ", ".join(quote(n, 40) for n in list(names)[:20])
    return shown + (f", ... ({len(names)} in all)" if len(names) > 20 else "")


def _too_many_devices(where: str, total: int) -> str:
    return (f"{where}: the cluster reaches {total:,} devices here; Poseidon plans clusters of at most "
            f"{MAX_DEVICES:,} devices (docs/SPECS.md, Limits)")


def check_memory_reserve(device_types, constants, where: str) -> None:
    """Refuse a device type whose memory does not exceed the reserve (``memory_reserve_*`` constants)."""
    for t in device_types:
        reserve = t.memory_gb * constants.memory_reserve_fraction + constants.memory_reserve_gb
        if reserve >= t.memory_gb:
            raise InputError(
                f"{where}: device type {quote(t.name)} has memory_gb = {t.memory_gb:g} but the memory "
                f"reserve is {reserve:.3g} GiB (memory_reserve_gb = {constants.memory_reserve_gb:g} + "
                f"memory_reserve_fraction = {constants.memory_reserve_fraction:g} of its memory), which "
                "leaves nothing for the model; fix memory_gb (GiB per device), or lower "
                "constants.memory_reserve_gb if this device's runtime needs less")


def _parse_link(doc: Any, where: str) -> LinkSpec:
    get_mapping(doc, where, "a mapping with bandwidth_gbps and latency_us")
    check_keys(doc, where, ("bandwidth_gbps", "latency_us"), ("bandwidth_gbps",))
    w = where
    return LinkSpec(bandwidth_gbps=get_float(doc, "bandwidth_gbps", w, minimum=0.0, strict=True),
                    latency_us=get_float(doc, "latency_us", w, minimum=0.0, default=0.0))


def _parse_links(doc: Any, where: str, kinds: tuple[str, ...], link_presets: Mapping) -> dict:
    if isinstance(doc, str):
        if doc not in link_presets:
            raise InputError(f"{where} = {quote(doc)} is not a link preset; presets: "
                             f"{', '.join(link_presets)}; or give a mapping with {', '.join(kinds)}")
        doc = link_presets[doc]
    get_mapping(doc, where, f"a link preset name ({', '.join(link_presets)}) or a mapping")
    check_keys(doc, where, kinds)
    return {k: _parse_link(doc[k], f"{where}.{k}") for k in kinds if k in doc}


def _parse_device_type(doc: Any, where: str, presets: Mapping, link_presets: Mapping) -> DeviceType:
    if isinstance(doc, str):
        if doc not in presets:
            raise InputError(f"{where} = {quote(doc)} is not a device preset; presets: {', '.join(presets)}; "
                             "or give a mapping with name, memory_gb, peak_tflops")
        doc = {"name": doc}
    get_mapping(doc, where, "a device preset name or a mapping")
    check_keys(doc, where, ("name", "memory_gb", "peak_tflops", "efficiency", "links"), ("name",))
    name = get_str(doc, "name", where)
    base = {k: v for k, v in presets.get(name, {}).items() if k in ("memory_gb", "peak_tflops")}
    merged = {**base, **doc}
    links = _parse_links(doc["links"], where + ".links", ("intra_node", "inter_node"), link_presets) \
        if "links" in doc else {}
    eff = merged.get("efficiency")
    return DeviceType(
        name=name,
        memory_gb=get_float(merged, "memory_gb", where, minimum=0.0, strict=True),
        peak_tflops=get_float(merged, "peak_tflops", where, minimum=0.0, strict=True),
        efficiency=None if eff is None else get_float(merged, "efficiency", where, minimum=0.0,
                                                      strict=True, maximum=1.0),
        intra_node=links.get("intra_node"), inter_node=links.get("inter_node"))


def parse_cluster(doc: Any, source: str = "<cluster>") -> ClusterSpec:
    """Validate a cluster document (as loaded from YAML/JSON) into a :class:`ClusterSpec`."""
    root = f"{source}: "
    get_mapping(doc, root, "a mapping with name, device_types, nodes, links")
    check_keys(doc, root, ("name", "description", "device_types", "nodes", "links", "constants"),
               ("device_types", "nodes", "links"))
    presets, link_presets = _device_presets()
    type_docs = get_list(doc, "device_types", root)
    if len(type_docs) > MAX_DEVICE_TYPES:
        raise InputError(f"{source}: device_types has {len(type_docs):,} entries; a cluster has at most "
                         f"{MAX_DEVICE_TYPES} device types")
    types = tuple(_parse_device_type(d, f"{source}: device_types[{i}]", presets, link_presets)
                  for i, d in enumerate(type_docs))
    nodes = []
    total = 0
    for i, nd in enumerate(get_list(doc, "nodes", root)):
        w = f"{source}: nodes[{i}]"
        get_mapping(nd, w, "a mapping with device_type, count, devices_per_node")
        check_keys(nd, w, ("device_type", "count", "devices_per_node"), ("device_type",))
        group = NodeGroup(device_type=get_str(nd, "device_type", w),
                          count=get_int(nd, "count", w, default=1, maximum=MAX_DEVICES),
                          devices_per_node=get_int(nd, "devices_per_node", w, default=8,
                                                   maximum=MAX_DEVICES_PER_NODE))
        total += group.count * group.devices_per_node
        if total > MAX_DEVICES:  # before the spec, or anything per device, exists
            raise InputError(_too_many_devices(w, total))
        nodes.append(group)
    links = _parse_links(doc["links"], f"{source}: links", LINK_NAMES, link_presets)
    for k in LINK_NAMES:
        if k not in links:
            raise InputError(f"{source}: links.{k}: missing required field (bandwidth_gbps, latency_us)")
    constants = doc.get("constants")
    from .constants import DEFAULT_CONSTANTS  # validate names and values now, not at first use
    effective = DEFAULT_CONSTANTS
    if constants is not None:
        get_mapping(constants, f"{source}: constants")
        effective = DEFAULT_CONSTANTS.override(constants, f"{source}: constants")
    check_memory_reserve(types, effective, f"{source}: device_types")
    description = doc.get("description") or ""
    if not isinstance(description, str):
        raise InputError(f"{source}: description = {quote(description)} is invalid: must be a string")
    return ClusterSpec(
        name=get_str(doc, "name", root, default=Path(source).stem), description=description,
        device_types=types, nodes=tuple(nodes), constants=constants,
        intra_node=links["intra_node"], inter_node=links["inter_node"], cross_type=links["cross_type"],
        source=source)


def cluster_presets() -> tuple[str, ...]:
    """Names of the built-in clusters."""
    return preset_names("cluster")


def device_presets() -> tuple[str, ...]:
    """Names of the built-in device types."""
    return tuple(_device_presets()[0])


def load_cluster(name_or_path: str | os.PathLike) -> ClusterSpec:
    """A cluster from a YAML/JSON file, or a built-in preset by name (``paper-setting-3``)."""
    return load_document_or_preset(name_or_path, "cluster", parse_cluster)
