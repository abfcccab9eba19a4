"""The plan: one frozen, versioned schema that the search returns and the launcher applies.

``Plan`` -> JSON (``to_json``/``from_json``, exact round trip, validated on load), a content hash
(``plan_hash``) every rank compares, and renderers: Megatron flags (``--pipeline-model-parallel-layout``
in megatron-core's layout grammar), MindSpeed-LLM flags (``--num-layer-list``), parsers back from flags,
and a text table for people.

Layers: ``Plan.layers`` lists the layers of each *virtual* stage in Megatron's virtual-stage-major
order, ``vs = chunk x pp + rank``; global layers are numbered in ``vs`` order. With one chunk per rank
(V = 1) it is the layers per pipeline stage. Ranks: Megatron's default order (TP fastest, then DP, then
PP): stage ``s`` holds global ranks ``s x dp x tp .. (s+1) x dp x tp - 1`` and ``devices[i]`` hosts
``ranks[i]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

from .argv import flag_values
from .errors import InputError, PoseidonError
from .specs.documents import parse_document
from .simulator.schedules import MEGATRON_SCHEDULES, SCHEDULES
from .specs.fields import read_document, write_json_atomic

PLAN_SCHEMA_VERSION = 3
# 2: overlap_p2p_comm (version-1 files load with the value they ran with); 3: priced_for, the fingerprint of
# what the plan was priced for (fingerprint.py; older files load with none: checked field by field only), and
# a stage's ranks and devices stored as runs (_rank_runs, _device_runs), so the plan rank 0 broadcasts stays
# small on 100,000 devices. Versions 1 and 2 (every rank and device listed) are read and upgraded. MoE plans
# add ep and etp (expert parallelism; left out at their defaults, so a dense plan and its hash are unchanged).
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
MAX_PLAN_DEVICES = 1 << 20    # ranks (and devices) all of a plan's runs may expand to (a cluster's most)
PLAN_FORMAT = "poseidon-plan"
NO_OVERLAP_P2P_FLAG = "--no-overlap-p2p-communication"   # Megatron-LM's; overlap is its default


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanStage:
    """One pipeline rank (stage) of the plan: where it runs and what it holds."""

    index: int                         # pipeline rank
    device_type: str
    ranks: tuple[int, ...]             # global ranks, dp x tp, TP fastest
    devices: tuple[tuple[int, int], ...]  # (node, local index) hosting ranks[i]
    tp: int
    dp: int
    layers: tuple[int, ...]            # layers of each chunk (virtual stage chunk x pp + index)
    first_layers: tuple[int, ...]      # first global layer (0-based) of each chunk
    forward_ms: tuple[float, ...]      # per chunk, per micro-batch (incl. embedding / head)
    backward_ms: tuple[float, ...]
    send_ms: float                     # to the next rank (last rank: the wrap link, interleaved only)
    allreduce_ms: float                # DP gradient sync per iteration
    memory_bytes: int                  # predicted peak per device
    usable_bytes: int                  # device memory minus reserves


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanSummary:
    """A lighter record of a runner-up plan (top-k alternatives)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    stage_types: tuple[str, ...]
    layers: tuple[int, ...]            # per virtual stage, vs = chunk x pp + rank
    predicted_iteration_ms: float
    tokens_per_s: float
    ep: int = 1                        # expert parallelism (MoE)
    etp: int | None = None             # expert TP; None: tp


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete parallel training plan (validated on construction)."""

    model: str
    cluster: str
    seq_length: int
    global_batch_size: int
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int                 # M = global_batch_size / (dp x micro_batch_size)
    schedule: str
    virtual_stages: int
    layers: tuple[int, ...]            # per virtual stage, len pp x V, vs = chunk x pp + rank
    stages: tuple[PlanStage, ...]
    predicted_iteration_ms: float
    tokens_per_s: float
    profile_source: str = "analytic"   # analytic | measured: what the prediction rests on
    ep: int = 1                        # MoE: expert parallelism, one for the job (--expert-model-parallel-size)
    etp: int | None = None             # MoE: expert TP (--expert-tensor-parallel-size); None: tp
    overlap_p2p_comm: bool = False     # interleaved only: Megatron's overlap_p2p_comm (planned, in the flags)
    priced_for: tuple[tuple[str, str], ...] = ()  # model, devices, profile it was priced for (fingerprint.py)
    alternatives: tuple[PlanSummary, ...] = ()
    search_stats: Mapping[str, Any] = field(default_factory=dict)  # not part of plan_hash
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_layers(self) -> int:
        """Transformer layers in the model."""
        return sum(self.layers)

    @property
    def world_size(self) -> int:
        """Devices the plan uses (``tp x dp x pp``)."""
        return self.tp * self.dp * self.pp

    @property
    def stage_types(self) -> tuple[str, ...]:
        """Device type per pipeline rank."""
        return tuple(s.device_type for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready document (lists for tuples; a stage's ranks and devices as runs)."""
        # the stages' ranks and devices go straight to runs: at 100k+ devices, plain lists of them
        # first cost seconds
        doc = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "stages"}
        doc["stages"] = [{f.name: _plain(getattr(stage, f.name)) for f in dataclasses.fields(stage)
                          if f.name not in ("ranks", "devices")}
                         | {"ranks": _rank_runs(stage.ranks), "devices": _device_runs(stage.devices)}
                         for stage in self.stages]
        doc["priced_for"] = dict(self.priced_for)
        doc["format"] = PLAN_FORMAT
        for d in (doc, *doc["alternatives"]):
            _drop_default_experts(d)
        return doc

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; ``Plan.from_json(p.to_json()) == p``."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "plan") -> "Plan":
        """Validate and build a plan from a plain document."""
        return _plan_from_dict(doc, where)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> "Plan":
        """Parse and validate JSON text."""
        return _plan_from_dict(parse_document(text, where), where)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan JSON atomically."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read and validate a plan JSON file."""
        return _plan_from_dict(read_document(path, "plan"), str(path))

    def plan_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON without ``search_stats`` (which differ run to run)."""
        doc = self.to_dict()
        doc.pop("search_stats", None)
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --- validation and (de)serialisation --------------------------------------------------------

def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [_plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def _drop_default_experts(doc: dict) -> None:
    """Leave out ``ep`` / ``etp`` at their defaults (no expert parallelism): a dense plan's document, and so
    its hash, is what it was before MoE plans had them."""
    if doc.get("ep") == 1:
        del doc["ep"]
    if doc.get("etp", 0) is None:
        del doc["etp"]


def _bad(where: str, name: str, value: Any, allowed: str) -> InputError:
    return InputError(f"{where}: {name} = {value!r} is invalid: must be {allowed}")


def _pos_int(where: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(where, name, value, f"an integer >= {minimum}")


def _time(where: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise _bad(where, name, value, "a finite number >= 0")


def _validate(p: Plan) -> None:
    w = "plan"
    if p.schema_version != PLAN_SCHEMA_VERSION:
        raise InputError(f"{w}: schema_version = {p.schema_version!r} is not supported: this Poseidon "
                         f"reads version {PLAN_SCHEMA_VERSION}; re-run `poseidon plan`")
    for name in ("seq_length", "global_batch_size", "tp", "pp", "dp", "micro_batch_size",
                 "micro_batches", "virtual_stages"):
        _pos_int(w, name, getattr(p, name))
    if p.schedule not in SCHEDULES:
        raise _bad(w, "schedule", p.schedule, "one of " + ", ".join(SCHEDULES))
    if (p.virtual_stages > 1) != (p.schedule == "interleaved-1f1b"):
        raise InputError(f"{w}: virtual_stages = {p.virtual_stages} does not match schedule = "
                         f"{p.schedule!r}: only 'interleaved-1f1b' has (and needs) virtual_stages >= 2")
    if p.micro_batches * p.dp * p.micro_batch_size != p.global_batch_size:
        raise InputError(f"{w}: micro_batches x dp x micro_batch_size = {p.micro_batches} x {p.dp} x "
                         f"{p.micro_batch_size} must equal global_batch_size = {p.global_batch_size}")
    if len(p.layers) != p.pp * p.virtual_stages:
        raise InputError(f"{w}: layers has {len(p.layers)} entries; need pp x virtual_stages = "
                         f"{p.pp * p.virtual_stages} (one per virtual stage)")
    for i, n in enumerate(p.layers):
        _pos_int(w, f"layers[{i}]", n)
    _time(w, "predicted_iteration_ms", p.predicted_iteration_ms)
    _time(w, "tokens_per_s", p.tokens_per_s)
    _pos_int(w, "ep", p.ep)
    if p.etp is not None:
        _pos_int(w, "etp", p.etp)
        if p.etp == p.tp:
            raise InputError(f"{w}: etp = {p.etp} equals tp: leave it out (null), as Megatron's default")
    etp = p.tp if p.etp is None else p.etp
    if p.tp % etp or (p.tp * p.dp) % (etp * p.ep):
        raise InputError(f"{w}: ep = {p.ep}, expert TP {etp} do not fit tp = {p.tp}, dp = {p.dp}: expert TP must "
                         "divide tp and expert TP x ep must divide tp x dp (megatron-core's expert groups)")
    if not isinstance(p.overlap_p2p_comm, bool):
        raise _bad(w, "overlap_p2p_comm", p.overlap_p2p_comm, "true or false")
    if p.overlap_p2p_comm and p.schedule != "interleaved-1f1b":
        raise InputError(f"{w}: overlap_p2p_comm = true needs schedule 'interleaved-1f1b' (Megatron overlaps "
                         f"p2p only there), not {p.schedule!r}")
    if (not isinstance(p.priced_for, tuple) or len(p.priced_for) > 64
            or any(not (isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(x, str) and len(x) <= 512
                                                                        for x in kv)) for kv in p.priced_for)):
        raise _bad(w, "priced_for", "...", "an object of at most 64 short string values")
    if p.profile_source not in ("analytic", "measured"):
        raise _bad(w, "profile_source", p.profile_source, "'analytic' or 'measured'")
    if len(p.stages) != p.pp:
        raise InputError(f"{w}: stages has {len(p.stages)} entries; need pp = {p.pp}")
    firsts = [sum(p.layers[:vs]) for vs in range(len(p.layers))]
    size = p.dp * p.tp
    seen: set = set()
    for r, s in enumerate(p.stages):
        ws = f"{w}: stages[{r}]"
        if s.index != r:
            raise _bad(ws, "index", s.index, str(r))
        if (s.tp, s.dp) != (p.tp, p.dp):
            raise InputError(f"{ws}: tp, dp = {s.tp}, {s.dp} must equal the plan's {p.tp}, {p.dp}")
        if not isinstance(s.device_type, str) or not s.device_type:
            raise _bad(ws, "device_type", s.device_type, "a non-empty string")
        want = tuple(range(r * size, (r + 1) * size))
        if tuple(s.ranks) != want:
            raise InputError(f"{ws}: ranks = {list(s.ranks)} must be {want[0]}..{want[-1]} "
                             "(Megatron rank order: TP fastest, then DP, then PP)")
        if len(s.devices) != size:
            raise InputError(f"{ws}: devices has {len(s.devices)} entries; need dp x tp = {size}")
        for d in s.devices:
            if (type(d) is not tuple or len(d) != 2 or type(d[0]) is not int or type(d[1]) is not int
                    or d[0] < 0 or d[1] < 0):          # exact types: bool is not an int here
                raise _bad(ws, "devices entry", d, "a [node, local] pair of integers >= 0")
            if d in seen:
                raise InputError(f"{ws}: device {list(d)} is used by two ranks")
            seen.add(d)
        chunks = tuple(p.layers[c * p.pp + r] for c in range(p.virtual_stages))
        if tuple(s.layers) != chunks:
            raise InputError(f"{ws}: layers = {list(s.layers)} disagrees with the plan's per-virtual-"
                             f"stage layers {list(chunks)}")
        fl = tuple(firsts[c * p.pp + r] for c in range(p.virtual_stages))
        if tuple(s.first_layers) != fl:
            raise InputError(f"{ws}: first_layers = {list(s.first_layers)} must be {list(fl)}")
        for name in ("forward_ms", "backward_ms"):
            vals = getattr(s, name)
            if len(vals) != p.virtual_stages:
                raise InputError(f"{ws}: {name} needs one value per chunk ({p.virtual_stages})")
            for x in vals:
                _time(ws, name, x)
        _time(ws, "send_ms", s.send_ms)
        _time(ws, "allreduce_ms", s.allreduce_ms)
        _pos_int(ws, "memory_bytes", s.memory_bytes, 0)
        _pos_int(ws, "usable_bytes", s.usable_bytes, 0)
    if not isinstance(p.search_stats, Mapping):
        raise _bad(w, "search_stats", p.search_stats, "a mapping")


def _take(doc: Any, where: str, cls: type, tuples: Mapping[str, Any]) -> Any:
    if not isinstance(doc, Mapping):
        raise InputError(f"{where}: must be an object, got {type(doc).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for key in doc:
        if key not in names:
            raise InputError(f"{where}: unknown field {key!r}; allowed: {', '.join(names)}")
    for key in required:
        if key not in doc:
            raise InputError(f"{where}: missing required field {key!r}")
    values = dict(doc)
    for key, conv in tuples.items():
        if key in values:
            if not isinstance(values[key], list):
                raise _bad(where, key, values[key], "a list")
            values[key] = conv(values[key])
    return values


def _pairs(items: list) -> tuple:
    return tuple(tuple(x) if isinstance(x, list) else x for x in items)


def _rank_runs(ranks: Sequence[int]) -> list[list[int]]:
    """Schema 3: ranks as ``[[first, last], ...]`` runs of consecutive integers, in order."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return runs


def _device_runs(devices: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Schema 3: devices as ``[[first_node, last_node, first_local, last_local], ...]`` blocks, each
    its nodes' locals in node-major order (a stage on whole nodes is one block)."""
    per_node: list[list[int]] = []        # [node, first_local, last_local]
    for node, local in devices:
        last = per_node[-1] if per_node else None
        if last is not None and node == last[0] and local == last[2] + 1:
            last[2] = local
        else:
            per_node.append([node, local, local])
    runs: list[list[int]] = []
    for node, lo, hi in per_node:
        last = runs[-1] if runs else None
        if last is not None and node == last[1] + 1 and (lo, hi) == (last[2], last[3]):
            last[1] = node
        else:
            runs.append([node, node, lo, hi])
    return runs


def _int_runs(where: str, name: str, runs: Any, width: int, budget: list, slot: int) -> list[list[int]]:
    """Check a schema-3 run list: lists of ``width`` integers >= 0, first <= last in each pair; the
    entries it expands to are taken from ``budget[slot]`` (a plan expands to at most a cluster)."""
    if not isinstance(runs, list):
        raise _bad(where, name, runs, "a list of runs")
    for run in runs:
        if (not isinstance(run, list) or len(run) != width
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in run)
                or any(run[i] > run[i + 1] for i in range(0, width, 2))):
            shape = "[first, last]" if width == 2 else "[first_node, last_node, first_local, last_local]"
            raise _bad(where, f"{name} run", run, f"{shape}, integers >= 0, first <= last")
        size = 1
        for i in range(0, width, 2):
            size *= run[i + 1] - run[i] + 1
        budget[slot] -= size
        if budget[slot] < 0:
            raise InputError(f"{where}: {name} expand to more than {MAX_PLAN_DEVICES:,} entries over "
                             "the plan; a plan has tp x dp x pp of them")
    return runs


def _expand_ranks(where: str, runs: Any, budget: list) -> tuple[int, ...]:
    out: list[int] = []
    for a, b in _int_runs(where, "ranks", runs, 2, budget, 0):
        out.extend(range(a, b + 1))
    return tuple(out)


def _expand_devices(where: str, runs: Any, budget: list) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for n0, n1, l0, l1 in _int_runs(where, "devices", runs, 4, budget, 1):
        out.extend((n, x) for n in range(n0, n1 + 1) for x in range(l0, l1 + 1))
    return tuple(out)


def _plan_from_dict(doc: Any, where: str) -> Plan:
    if isinstance(doc, Mapping):
        doc = dict(doc)
        fmt = doc.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise InputError(f"{where}: format = {fmt!r} is invalid: must be {PLAN_FORMAT!r}")
        version = doc.get("schema_version", PLAN_SCHEMA_VERSION)
        if version == 1 and "overlap_p2p_comm" not in doc:
            # Version 1 rendered no overlap flag, so Megatron-LM ran interleaved plans with its default (on).
            doc["overlap_p2p_comm"] = doc.get("schedule") == "interleaved-1f1b"
        if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
            raise InputError(f"{where}: schema_version = {version!r} is not supported: this Poseidon "
                             f"reads versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))}; "
                             "re-run `poseidon plan`")
        doc["schema_version"] = PLAN_SCHEMA_VERSION      # older versions: upgraded on load
        if isinstance(doc.get("priced_for"), Mapping):
            doc["priced_for"] = tuple(sorted((str(k), v) for k, v in doc["priced_for"].items()))
    else:
        version = PLAN_SCHEMA_VERSION
    values = _take(doc, where, Plan, {"layers": tuple, "stages": list, "alternatives": list})
    budget = [MAX_PLAN_DEVICES, MAX_PLAN_DEVICES]    # entries all runs may still expand to
    stages = []
    for i, s in enumerate(values.get("stages", ())):
        ws = f"{where}: stages[{i}]"
        if version >= 3:          # ranks and devices as runs
            conv = {"ranks": lambda x, ws=ws: _expand_ranks(ws, x, budget),
                    "devices": lambda x, ws=ws: _expand_devices(ws, x, budget)}
        else:                     # every rank and device listed
            conv = {"ranks": tuple, "devices": _pairs}
        sv = _take(s, ws, PlanStage, {**conv, "layers": tuple, "first_layers": tuple,
                                      "forward_ms": tuple, "backward_ms": tuple})
        stages.append(PlanStage(**sv))
    values["stages"] = tuple(stages)
    alts = []
    for i, a in enumerate(values.get("alternatives", ())):
        av = _take(a, f"{where}: alternatives[{i}]", PlanSummary,
                   {"stage_types": tuple, "layers": tuple})
        alts.append(PlanSummary(**av))
    values["alternatives"] = tuple(alts)
    try:
        return Plan(**values)
    except InputError as exc:
        raise InputError(str(exc).replace("plan:", f"{where}:", 1)) from None
    except TypeError as exc:  # a wrong type that the checks above did not name
        raise InputError(f"{where}: {exc}") from None


# --- flag renderers and parsers --------------------------------------------------------------

class ParallelFlags(NamedTuple):
    """What the flag parsers recover: enough to compare with a plan."""

    tp: int
    pp: int
    layers: tuple[int, ...]   # per virtual stage, vs = chunk x pp + rank
    mbs: int


def megatron_layout(layers: Sequence[int]) -> str:
    """megatron-core layout string for per-virtual-stage layer counts: ``Et*3|t*5|t*2L``.

    ``E`` (embedding) opens virtual stage 0, ``L`` (loss) closes the last one, ``|`` separates virtual
    stages in virtual-stage-major order.
    """
    parts = []
    for vs, n in enumerate(layers):
        body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
        parts.append(("E" if vs == 0 else "") + body + ("L" if vs == len(layers) - 1 else ""))
    return "|".join(parts)


_REPEAT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT_CHAR = re.compile(r"(.)\*(\d+)")


def parse_megatron_layout(layout: str, pp: int) -> tuple[int, ...]:
    """Per-virtual-stage decoder-layer counts of a layout string (``E``/``t``/``L``, ``x*n``, ``(..)*n``)."""
    text = layout.replace(",", "")
    text = _REPEAT_GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _REPEAT_CHAR.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    if len(stages) % pp:
        raise InputError(f"--pipeline-model-parallel-layout {layout!r} has {len(stages)} stages, not a "
                         f"multiple of --pipeline-model-parallel-size {pp}")
    for i, st in enumerate(stages):
        bad = set(st) - {"E", "t", "L"}
        if bad:
            raise InputError(f"--pipeline-model-parallel-layout {layout!r}: stage {i} has "
                             f"{sorted(bad)[0]!r}; allowed: E (embedding), t (layer), L (loss)")
    flat = "".join(stages)
    if not stages[0].startswith("E") or flat.count("E") != 1:
        raise InputError(f"--pipeline-model-parallel-layout {layout!r}: E must open stage 0, once")
    if not stages[-1].endswith("L") or flat.count("L") != 1:
        raise InputError(f"--pipeline-model-parallel-layout {layout!r}: L must close the last stage, once")
    return tuple(st.count("t") for st in stages)


def megatron_args(plan: Plan) -> list[str]:
    """Megatron-LM / megatron-core flags that apply the plan's parallel layout."""
    if plan.schedule not in MEGATRON_SCHEDULES:
        raise PoseidonError(f"schedule {plan.schedule!r} has no Megatron equivalent (Megatron runs "
                            f"{', '.join(MEGATRON_SCHEDULES)}); re-plan with --schedules 1f1b,"
                            "interleaved-1f1b")
    flags = ["--tensor-model-parallel-size", str(plan.tp),
             "--pipeline-model-parallel-size", str(plan.pp),
             "--pipeline-model-parallel-layout", megatron_layout(plan.layers),
             "--micro-batch-size", str(plan.micro_batch_size)]
    flags += expert_args(plan)
    if plan.schedule == "interleaved-1f1b" and not plan.overlap_p2p_comm:
        # Megatron-LM overlaps interleaved p2p unless told not to, and refuses that on fewer than 3 ranks.
        if plan.pp < 3:
            raise PoseidonError(f"Megatron-LM runs interleaved without p2p overlap only on >= 3 pipeline "
                                f"ranks, not pp = {plan.pp}; re-plan (the overlap is planned)")
        flags.append(NO_OVERLAP_P2P_FLAG)
    return flags


MOE_DISPATCHER_FLAG = "--moe-token-dispatcher-type"


def expert_args(plan: Plan) -> list[str]:
    """The expert layout's flags, Megatron-LM's and MindSpeed-LLM's alike: none without expert parallelism
    (EP 1, expert TP = TP: Megatron's defaults, priced with its all-gather dispatcher), else the EP, the
    expert TP when it is not TP, and the all-to-all dispatcher the plan was priced with."""
    if plan.ep == 1 and plan.etp is None:
        return []
    flags = ["--expert-model-parallel-size", str(plan.ep)]
    if plan.etp is not None:
        flags += ["--expert-tensor-parallel-size", str(plan.etp)]
    return flags + [MOE_DISPATCHER_FLAG, "alltoall"]


def mindspeed_args(plan: Plan) -> list[str]:
    """MindSpeed-LLM flags (``--num-layer-list``, left out at PP = 1); only for one chunk per rank."""
    if plan.virtual_stages != 1 or plan.schedule != "1f1b":
        raise PoseidonError(f"MindSpeed-LLM's --num-layer-list cannot express virtual_stages = "
                            f"{plan.virtual_stages} / schedule {plan.schedule!r}; re-plan with "
                            "--schedules 1f1b for MindSpeed-LLM")
    # MindSpeed-LLM refuses --num-layer-list without pipeline parallelism; one stage has no split to express
    layer_list = ["--num-layer-list", ",".join(str(n) for n in plan.layers)] if plan.pp > 1 else []
    return ["--tensor-model-parallel-size", str(plan.tp),
            "--pipeline-model-parallel-size", str(plan.pp),
            *layer_list,
            "--micro-batch-size", str(plan.micro_batch_size),
            *expert_args(plan)]


def _flag_values(args: Sequence[str]) -> dict[str, str]:
    return flag_values(args, missing=None)


def _int_flag(flags: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in flags:
        if default is not None:
            return default
        raise InputError(f"{name} is missing")
    try:
        value = int(flags[name])
    except ValueError:
        value = 0
    if value < 1:
        raise InputError(f"{name} {flags[name]!r} is invalid: must be an integer >= 1")
    return value


def parse_megatron_args(argv: Sequence[str]) -> ParallelFlags:
    """Recover (tp, pp, layers per virtual stage, mbs) from Megatron flags."""
    f = _flag_values(argv)
    pp = _int_flag(f, "--pipeline-model-parallel-size", 1)
    if "--pipeline-model-parallel-layout" not in f:
        raise InputError("--pipeline-model-parallel-layout is missing")
    return ParallelFlags(tp=_int_flag(f, "--tensor-model-parallel-size", 1), pp=pp,
                         layers=parse_megatron_layout(f["--pipeline-model-parallel-layout"], pp),
                         mbs=_int_flag(f, "--micro-batch-size", 1))


def parse_mindspeed_args(argv: Sequence[str]) -> ParallelFlags:
    """Recover (tp, pp, layers per stage, mbs) from MindSpeed-LLM flags."""
    f = _flag_values(argv)
    pp = _int_flag(f, "--pipeline-model-parallel-size", 1)
    raw = f.get("--num-layer-list")
    if raw is None and pp == 1 and "--num-layers" in f:
        raw = f["--num-layers"]  # one stage: the list is left out, the stage holds every layer
    if raw is None:
        raise InputError("--num-layer-list is missing")
    try:
        layers = tuple(int(x) for x in raw.split(","))
    except ValueError:
        raise InputError(f"--num-layer-list {raw!r} is invalid: must be comma-separated integers") \
            from None
    if len(layers) != pp or min(layers) < 1:
        raise InputError(f"--num-layer-list {raw!r} must list {pp} integers >= 1 (one per stage)")
    return ParallelFlags(tp=_int_flag(f, "--tensor-model-parallel-size", 1), pp=pp, layers=layers,
                         mbs=_int_flag(f, "--micro-batch-size", 1))


def parse_expert_args(argv: Sequence[str]) -> tuple[int, int | None]:
    """Recover ``(ep, etp)`` from Megatron-LM / MindSpeed-LLM flags (``etp`` None when not given: TP)."""
    f = _flag_values(argv)
    etp = _int_flag(f, "--expert-tensor-parallel-size") if "--expert-tensor-parallel-size" in f else None
    return _int_flag(f, "--expert-model-parallel-size", 1), etp


# --- human-readable table --------------------------------------------------------------------

def format_ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3,7`` (``none`` when empty): ranks, nodes or layers in one short string."""
    spans: list[list[int]] = []
    for n in sorted(set(values)):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def format_gap(gap: float | None) -> str:
    """A gap (``best / bound - 1``) as a percentage that is 0 only when it is 0: ``2.7 %``, ``0.0042 %``
    (a tiny gap is not rounded to a misleading ``0.0 %``), ``0 %``; ``n/a`` without a bound."""
    if gap is None or not math.isfinite(gap):
        return "n/a"
    if gap <= 0.0:
        return "0 %"
    pct = 100.0 * gap
    return f"{pct:.1f} %" if pct >= 0.1 else f"{pct:.2g} %"


def proof_line(stats: Mapping[str, Any], best_ms: float) -> str:
    """What the search proved about the plan, in one line: ``proven optimal`` (the plan equals its proven
    lower bound), or the bound, the gap and the part not proven (``stats``: ``Plan.search_stats``)."""
    if stats.get("complete"):
        return f"best {best_ms:,.1f} ms, proven optimal (equal to the proven lower bound)"
    lb = stats.get("lower_bound_ms")
    bound = f"proven >= {lb:,.1f} ms" if lb else "no lower bound"
    why = stats.get("unproven") or "the search did not finish"
    return f"best {best_ms:,.1f} ms, {bound}, gap {format_gap(stats.get('gap'))}: NOT proven optimal ({why})"


def render_table(plan: Plan, max_alternatives: int = 5, runtime: str | None = None) -> str:
    """The plan as a text table (what ``poseidon plan`` prints); ``runtime``: the target's line."""
    gb = float(1 << 30)
    lines = [
        f"Poseidon plan: {plan.model} on {plan.cluster}  (schema {plan.schema_version}, "
        f"hash {plan.plan_hash()[:12]})",
        f"TP {plan.tp}  PP {plan.pp}  DP {plan.dp}  V {plan.virtual_stages}  schedule {plan.schedule}  "
        f"mbs {plan.micro_batch_size}  M {plan.micro_batches}  GBS {plan.global_batch_size}  "
        f"seq {plan.seq_length}  devices {plan.world_size}"
        + (f"  p2p overlap {'on' if plan.overlap_p2p_comm else 'off'}" if plan.virtual_stages > 1 else ""),
        *([f"experts: EP {plan.ep}  expert TP {plan.tp if plan.etp is None else plan.etp}  expert DP "
           f"{plan.tp * plan.dp // ((plan.tp if plan.etp is None else plan.etp) * plan.ep)}"
           "  (one expert layout for every stage)"] if (plan.ep, plan.etp) != (1, None) else []),
        f"predicted iteration {plan.predicted_iteration_ms:,.1f} ms   throughput "
        f"{plan.tokens_per_s:,.0f} tokens/s   ({plan.profile_source} profile)",
        *([runtime] if runtime else []),
        "",
    ]
    header = ("stage", "type", "ranks", "nodes", "layers", "first", "fwd ms", "bwd ms", "send ms",
              "dp-sync ms", "memory GiB")
    rows = [header]
    for s in plan.stages:
        rows.append((str(s.index), s.device_type, format_ranges(s.ranks), format_ranges([d[0] for d in s.devices]),
                     "+".join(map(str, s.layers)), ",".join(map(str, s.first_layers)),
                     "+".join(f"{x:.2f}" for x in s.forward_ms), "+".join(f"{x:.2f}" for x in s.backward_ms),
                     f"{s.send_ms:.3f}", f"{s.allreduce_ms:.2f}",
                     f"{s.memory_bytes / gb:.1f} / {s.usable_bytes / gb:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    lines.append("")
    try:
        lines.append("Megatron:      " + " ".join(megatron_args(plan)))
    except PoseidonError as exc:
        lines.append(f"Megatron:      n/a ({exc})")
    try:
        lines.append("MindSpeed-LLM: " + " ".join(mindspeed_args(plan)))
    except PoseidonError:
        lines.append("MindSpeed-LLM: n/a (needs schedule 1f1b and one chunk per rank)")
    if plan.alternatives:
        if plan.search_stats.get("alternatives_proven", True):
            lines += ["", "alternatives (each the best plan of its parallel shape):"]
        else:
            lines += ["", "alternatives (best plans of other shapes met during the search, not proven "
                          "the best of their shapes):"]
        for a in plan.alternatives[:max_alternatives]:
            experts = (f" EP {a.ep}" + ("" if a.etp is None else f" ETP {a.etp}")
                       if (a.ep, a.etp) != (1, None) else "")
            lines.append(f"  {a.predicted_iteration_ms:,.1f} ms  TP {a.tp} PP {a.pp} DP {a.dp}{experts} "
                         f"mbs {a.micro_batch_size} {a.schedule} V {a.virtual_stages}  "
                         f"types {'/'.join(a.stage_types)}  layers {'/'.join(map(str, a.layers))}")
    if plan.search_stats:
        if "complete" in plan.search_stats:     # the anytime answer (search/engine.py)
            lines += ["", proof_line(plan.search_stats, plan.predicted_iteration_ms)]
        stats = ", ".join(f"{k}={v}" for k, v in sorted(plan.search_stats.items()))
        lines += ["", f"search: {stats}"]
    return "\n".join(lines)
