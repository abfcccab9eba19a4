"""Profile spec: per (device type, TP degree, micro-batch size), what one layer costs.

The launcher's profiler writes this file (JSON) from measurements; :mod:`.analytic` derives the same
numbers from FLOPs and bandwidths. All times are per micro-batch on one device of a TP group; all sizes
are per device (i.e. already divided by TP where the layer is split).

File format (``format: poseidon-profile``, ``version: 1``)::

    {"format": "poseidon-profile", "version": 1, "source": "measured", "model": "llama3-8b",
     "seq_length": 4096, "dtype": "bf16", "software": {"torch": "2.4.0", ...},
     "entries": [{"device_type": "A2-2", "tp": 2, "mbs": 1,
                  "forward_ms": 5.1, "backward_ms": 10.3, "layer_params": 109060096,
                  "activation_bytes": 402653184, "send_bytes": 16777216,
                  "embedding_forward_ms": 0.2, "embedding_backward_ms": 0.1, "embedding_params": ...,
                  "embedding_activation_bytes": 0,
                  "head_forward_ms": 3.0, "head_backward_ms": 6.0, "head_params": ...,
                  "head_activation_bytes": ...,
                  "step_forward_ms": 0.4, "step_backward_ms": 0.3, "p2p_call_ms": 0.1,
                  "optimizer_ms": 0.2, "optimizer_fixed_ms": 1.5,
                  "first_step_ms": 14.0, "last_step_ms": 15.2,
                  "expert_parallel": [{"ep": 2, "forward_ms": 7.9, "backward_ms": 14.1}]}, ...]}

The framework fields (``FRAMEWORK_FIELDS``) are optional: files written before them load with 0. The
position fields ``first_step_ms`` / ``last_step_ms`` are the job's own step (its training script's
``forward_step``: data loading with its TP broadcast, the loss function) beyond what it costs on a middle
stage, per forward micro-batch, measured by ``runtime/client_step.py``; the cost model adds them to the
embedding's and the output layer's forward. ``expert_parallel`` (optional, MoE models) is the layer's
forward and backward measured at each EP > 1 that fits a node (expert TP = TP, the real all-to-all
dispatcher on the profiling group); the cost model uses it in place of the analytic EP term.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..errors import InputError
from .fields import (check_keys, get_float, get_int, get_list, get_mapping, get_str, quote,
                     read_document, write_json_atomic)
from .cluster import MAX_DEVICES_PER_NODE
from .model import DTYPE_BYTES, MODEL_LIMITS

PROFILE_FORMAT = "poseidon-profile"
PROFILE_VERSION = 1
PROFILE_SOURCES = ("measured", "analytic")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileEntry:
    """Costs of one (device type, TP, micro-batch size) combination, per device, per micro-batch."""

    device_type: str
    tp: int
    mbs: int
    forward_ms: float              # forward of one transformer layer
    backward_ms: float             # backward of one transformer layer
    layer_params: int              # parameters of one layer held by one device (after TP split)
    activation_bytes: int          # memory one layer keeps for backward, per live micro-batch
    send_bytes: int                # activation bytes one device sends to the next stage per micro-batch
    embedding_forward_ms: float = 0.0   # extra forward on the first stage (embedding)
    embedding_backward_ms: float = 0.0
    embedding_params: int = 0
    embedding_activation_bytes: int = 0
    head_forward_ms: float = 0.0        # extra forward on the last stage (final norm, output layer, loss)
    head_backward_ms: float = 0.0
    head_params: int = 0
    head_activation_bytes: int = 0
    # The framework around the layers (0 in analytic profiles and in files older than these fields):
    step_forward_ms: float = 0.0        # per forward micro-batch step of a stage, outside the model's forward:
                                        # schedule bookkeeping, forward_step, data, loss function
    step_backward_ms: float = 0.0       # per backward step, outside the model's backward (backward_step, schedule)
    p2p_call_ms: float = 0.0            # CPU cost of one pipeline p2p call (the megatron comm model's p2p_call_ms)
    optimizer_ms: float = 0.0           # optimizer step, share of one layer's parameters, per iteration
    optimizer_fixed_ms: float = 0.0     # optimizer step of a stage besides its layers' share (per-call cost,
                                        # embedding and output layer), per iteration
    # The job's own step by stage position, beyond a middle stage's (0 where not measured):
    first_step_ms: float = 0.0          # per forward micro-batch on the first stage (its data and TP broadcast)
    last_step_ms: float = 0.0           # per forward micro-batch on the last stage (labels, mask, loss function)
    # MoE: the layer measured with expert parallelism, expert TP = TP, its all-to-all dispatcher inside a node:
    # ``(ep, forward_ms, backward_ms)`` per measured EP > 1, ascending (empty where not measured)
    expert_parallel: tuple[tuple[int, float, float], ...] = ()

    def expert_parallel_ms(self, ep: int) -> tuple[float, float] | None:
        """The measured ``(forward_ms, backward_ms)`` of the layer at EP ``ep``, or ``None``."""
        for degree, forward, backward in self.expert_parallel:
            if degree == ep:
                return forward, backward
        return None

    @property
    def key(self) -> tuple[str, int, int]:
        """The lookup key ``(device_type, tp, mbs)``."""
        return (self.device_type, self.tp, self.mbs)


_ENTRY_FLOATS = ("forward_ms", "backward_ms", "embedding_forward_ms", "embedding_backward_ms",
                 "head_forward_ms", "head_backward_ms", "step_forward_ms", "step_backward_ms", "p2p_call_ms",
                 "optimizer_ms", "optimizer_fixed_ms", "first_step_ms", "last_step_ms")
FRAMEWORK_FIELDS = ("step_forward_ms", "step_backward_ms", "p2p_call_ms", "optimizer_ms", "optimizer_fixed_ms",
                    "first_step_ms", "last_step_ms")
"""Per-micro-batch and per-iteration costs around the layers; optional (0) in files."""
_ENTRY_INTS = ("layer_params", "activation_bytes", "send_bytes", "embedding_params",
               "embedding_activation_bytes", "head_params", "head_activation_bytes")
_ENTRY_REQUIRED = ("device_type", "tp", "mbs", "forward_ms", "backward_ms", "layer_params",
                   "activation_bytes", "send_bytes")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSpec:
    """A set of profile entries for one model at one sequence length and dtype."""

    model: str
    seq_length: int
    dtype: str
    entries: tuple[ProfileEntry, ...]
    source: str = "measured"                       # measured | analytic
    software: Mapping[str, str] = field(default_factory=dict)  # versions (torch, megatron, driver...)
    origin: str = field(default="<memory>", compare=False)  # file it was read from
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for e in self.entries:
            if e.key in self._index:
                raise InputError(f"{self.origin}: duplicate profile entry for device_type="
                                 f"{quote(e.device_type)} tp={e.tp} mbs={e.mbs}; keep one")
            self._index[e.key] = e

    def get(self, device_type: str, tp: int, mbs: int) -> ProfileEntry | None:
        """The entry for ``(device_type, tp, mbs)``, or ``None``."""
        return self._index.get((device_type, tp, mbs))

    def lookup(self, device_type: str, tp: int, mbs: int) -> ProfileEntry:
        """The entry for ``(device_type, tp, mbs)``; a clear error when the profile lacks it."""
        e = self._index.get((device_type, tp, mbs))
        if e is None:
            have = sorted({(k[1], k[2]) for k in self._index if k[0] == device_type})
            raise InputError(f"profile {self.origin} has no entry for device_type={quote(device_type)} "
                             f"tp={tp} mbs={mbs}; it has (tp, mbs) = {have or 'none for this type'}; "
                             "re-profile with that combination or restrict the search to profiled ones")
        return e

    def device_types(self) -> tuple[str, ...]:
        """Device types with at least one entry, in first-seen order."""
        return tuple(dict.fromkeys(e.device_type for e in self.entries))

    def tp_degrees(self, device_type: str) -> tuple[int, ...]:
        """Profiled TP degrees of one device type, ascending."""
        return tuple(sorted({e.tp for e in self.entries if e.device_type == device_type}))

    def micro_batch_sizes(self) -> tuple[int, ...]:
        """Every profiled micro-batch size, ascending."""
        return tuple(sorted({e.mbs for e in self.entries}))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (see the module docstring)."""
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "source": self.source,
                "model": self.model, "seq_length": self.seq_length, "dtype": self.dtype,
                "software": dict(self.software),
                "entries": [entry_doc(e) for e in self.entries]}


def entry_doc(entry: ProfileEntry) -> dict[str, Any]:
    """One entry as its JSON object (``expert_parallel`` as a list of ``{ep, forward_ms, backward_ms}``)."""
    doc = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
    doc["expert_parallel"] = [{"ep": ep, "forward_ms": f, "backward_ms": b} for ep, f, b in entry.expert_parallel]
    return doc


def _parse_expert_parallel(doc: Any, where: str) -> tuple[tuple[int, float, float], ...]:
    out = []
    for i, item in enumerate(get_list(doc, "expert_parallel", where, nonempty=False)):
        at = f"{where}.expert_parallel[{i}]"
        get_mapping(item, at)
        check_keys(item, at, ("ep", "forward_ms", "backward_ms"), ("ep", "forward_ms", "backward_ms"))
        ep = get_int(item, "ep", at, minimum=2, maximum=MODEL_LIMITS["num_experts"])
        forward = get_float(item, "forward_ms", at, strict=True)
        backward = get_float(item, "backward_ms", at, strict=True)
        out.append((ep, forward, backward))
    eps = [ep for ep, _f, _b in out]
    if len(set(eps)) != len(eps):
        raise InputError(f"{where}: expert_parallel lists an EP degree twice ({eps}); keep one of each")
    return tuple(sorted(out))


def _parse_entry(doc: Any, where: str) -> ProfileEntry:
    get_mapping(doc, where)
    allowed = ("device_type", "tp", "mbs", "expert_parallel", *_ENTRY_FLOATS, *_ENTRY_INTS)
    check_keys(doc, where, allowed, _ENTRY_REQUIRED)
    values: dict[str, Any] = {"device_type": get_str(doc, "device_type", where),
                              "tp": get_int(doc, "tp", where, maximum=MAX_DEVICES_PER_NODE),
                              "mbs": get_int(doc, "mbs", where, maximum=MODEL_LIMITS["global_batch_size"])}
    for k in _ENTRY_FLOATS:
        if k in doc:
            values[k] = get_float(doc, k, where)
    for k in _ENTRY_INTS:
        if k in doc:
            values[k] = get_int(doc, k, where, minimum=0)
    if "expert_parallel" in doc:
        values["expert_parallel"] = _parse_expert_parallel(doc, where)
    if values["forward_ms"] <= 0 or values["backward_ms"] <= 0:
        raise InputError(f"{where}: forward_ms and backward_ms must be > 0, got "
                         f"{values['forward_ms']} and {values['backward_ms']}")
    return ProfileEntry(**values)


def parse_profile(doc: Any, origin: str = "<profile>") -> ProfileSpec:
    """Validate a profile document into a :class:`ProfileSpec`."""
    root = f"{origin}: "
    get_mapping(doc, root, "a JSON object")
    check_keys(doc, root, ("format", "version", "source", "model", "seq_length", "dtype", "software",
                           "entries"), ("format", "version", "model", "seq_length", "dtype", "entries"))
    if doc["format"] != PROFILE_FORMAT:
        raise InputError(f"{root}format = {quote(doc['format'])} is invalid: must be {PROFILE_FORMAT!r} "
                         "(is this a Poseidon profile file?)")
    if doc["version"] != PROFILE_VERSION:
        raise InputError(f"{root}version = {quote(doc['version'])} is not supported: this Poseidon reads "
                         f"version {PROFILE_VERSION}; re-run the profiler")
    software = doc.get("software", {})
    get_mapping(software, f"{origin}: software")
    entries = tuple(_parse_entry(e, f"{origin}: entries[{i}]")
                    for i, e in enumerate(get_list(doc, "entries", root)))
    return ProfileSpec(model=get_str(doc, "model", root),
                       seq_length=get_int(doc, "seq_length", root, maximum=MODEL_LIMITS["seq_length"]),
                       dtype=get_str(doc, "dtype", root, choices=DTYPE_BYTES),
                       source=get_str(doc, "source", root, choices=PROFILE_SOURCES, default="measured"),
                       software={str(k): str(v) for k, v in software.items()}, entries=entries,
                       origin=origin)


def load_profile(path: str | os.PathLike) -> ProfileSpec:
    """Read and validate a profile JSON (or YAML) file."""
    return parse_profile(read_document(path, "profile"), str(path))


def write_profile(path: str | os.PathLike, profile: ProfileSpec) -> None:
    """Write ``profile`` as JSON atomically (temp file + ``os.replace``)."""
    write_json_atomic(path, profile.to_dict())


def merge_profiles(profiles: Iterable[ProfileSpec], origin: str = "<merged>") -> ProfileSpec:
    """One profile from several (e.g. one file per device type); model, seq and dtype must agree."""
    profiles = list(profiles)
    if not profiles:
        raise InputError("merge_profiles: no profiles given")
    first = profiles[0]
    for p in profiles[1:]:
        for attr in ("model", "seq_length", "dtype"):
            if getattr(p, attr) != getattr(first, attr):
                raise InputError(f"cannot merge profiles: {p.origin} has {attr}={quote(getattr(p, attr))} "
                                 f"but {first.origin} has {quote(getattr(first, attr))}")
    sources = {p.source for p in profiles}
    software: dict[str, str] = {}
    for p in profiles:
        software.update(p.software)
    return ProfileSpec(model=first.model, seq_length=first.seq_length, dtype=first.dtype,
                       source=sources.pop() if len(sources) == 1 else "measured",
                       software=software, entries=tuple(e for p in profiles for e in p.entries),
                       origin=origin)
