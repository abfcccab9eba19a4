"""The search space: which ``(tp, mbs, dp)`` groups, shapes and ranks-per-type a cluster allows.

Levels (docs/SEARCH.md):

* **group** ``(tp, mbs, dp, ep, etp)``: one TP degree for every stage (stock Megatron); ``M = GBS / (dp x
  mbs)`` must be an integer; a device type takes part when the profile covers it at this TP and its nodes
  hold a TP group; MoE models also take one expert layout for the job, expert parallelism ``ep`` and expert
  TP ``etp`` (``CostModel.expert_layouts``);
* **shape group** = group + ``(schedule, V, pp)``: one DAG shape, one search key of the leaderboard;
* **structure** = shape group + how many ranks use each device type (``dp x tp`` devices each, at most
  what the type has): the unit the branch and bound (:mod:`.splits`) searches.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterator

from ..costmodel import CostModel, expert_key
from ..errors import InputError
from .options import SearchOptions
from .tables import SLOT_COLUMNS, TYPE_COLUMNS, TypeTable, type_table


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """One ``(tp, mbs, dp, ep, etp)`` and the device types usable with it."""

    tp: int
    mbs: int
    dp: int
    micro_batches: int
    names: tuple[str, ...]      # device types with at least one stage slot
    slots: tuple[int, ...]      # stages of dp x tp devices each type can host
    ep: int = 1                 # expert parallelism (MoE)
    etp: int | None = None      # expert TP; None: tp

    @property
    def key(self) -> tuple[int, int, int, int, int | None]:
        """``(tp, mbs, dp, ep, etp)``: what its cost table is built for."""
        return (self.tp, self.mbs, self.dp, self.ep, self.etp)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShapeGroup:
    """A group with a schedule, V and pipeline size: one leaderboard key."""

    group: Group
    schedule: str
    virtual_stages: int
    pp: int

    @property
    def key(self) -> tuple:
        """``(tp, pp, dp, mbs, schedule, V)``, then ``(ep, expert TP)`` with expert parallelism: plans of one
        key differ only in types and layers (``leaderboard.plan_key``)."""
        g = self.group
        return (g.tp, self.pp, g.dp, g.mbs, self.schedule, self.virtual_stages) + expert_key(g.tp, g.ep, g.etp)


def tp_degrees(cm: CostModel, options: SearchOptions) -> tuple[int, ...]:
    """TP degrees to search: ``options.tp_degrees`` (checked against what the cost model allows) or
    every degree some device type allows."""
    avail = sorted({tp for t in cm.device_types for tp in cm.tp_degrees(t)})
    if options.tp_degrees is None:
        return tuple(avail)
    bad = [tp for tp in options.tp_degrees if tp not in avail]
    if bad:
        raise InputError(f"--tp {bad[0]} is not possible here: the model/cluster/profile allow TP "
                         f"degrees {', '.join(map(str, avail))} (powers of two within a node that "
                         "divide heads and KV groups, and covered by the profile)")
    return tuple(sorted(set(options.tp_degrees)))


def micro_batch_sizes(cm: CostModel, options: SearchOptions) -> tuple[int, ...]:
    """Micro-batch sizes to search: ``options.micro_batch_sizes`` (checked against the profile) or
    every size the profile covers."""
    have = tuple(sorted(cm.micro_batch_sizes()))
    if options.micro_batch_sizes is None:
        return have
    bad = [m for m in options.micro_batch_sizes if m not in have]
    if bad:
        raise InputError(f"--micro-batch-size {bad[0]} is not covered by the profile, which has "
                         f"{', '.join(map(str, have))}; profile it or pick one of those")
    return tuple(sorted(set(options.micro_batch_sizes)))


class SearchSpace:
    """Enumerates groups, shape groups and structures for a cost model and options."""

    def __init__(self, cm: CostModel, options: SearchOptions):
        self.cm, self.options = cm, options
        self.num_layers = cm.model.num_layers
        self.gbs = cm.model.global_batch_size
        self.names = cm.device_types
        self.tps = self._tp_degrees()
        self.mbs_list = self._micro_batch_sizes()
        self.groups = self._groups()
        # no pipeline is longer: a structure uses at most this many slots of a type
        self.max_pp = min(self.num_layers, options.max_pipeline_stages or self.num_layers)
        self._tables: dict[tuple, TypeTable] = {}
        self._classes: dict[tuple, array] = {}

    def _tp_degrees(self) -> tuple[int, ...]:
        return tp_degrees(self.cm, self.options)

    def _micro_batch_sizes(self) -> tuple[int, ...]:
        return micro_batch_sizes(self.cm, self.options)

    def _groups(self) -> tuple[Group, ...]:
        out = []
        for tp in self.tps:
            names = tuple(t for t in self.names if tp in self.cm.tp_degrees(t))
            for mbs in self.mbs_list:
                if self.gbs % mbs:
                    continue
                for dp in range(1, self.gbs // mbs + 1):
                    if dp % self.options.dp_multiple:
                        continue        # not a whole number of CP / EP groups (SearchOptions.dp_multiple)
                    m = self.cm.micro_batches(dp, mbs)
                    if m is None:
                        continue
                    slots = tuple(self.cm.max_stages(t, tp, dp) for t in names)
                    used = tuple((n, s) for n, s in zip(names, slots) if s > 0)
                    if not used:
                        break           # larger dp only has fewer slots
                    for ep, etp in self.cm.expert_layouts(tp, dp, self.options.expert_parallel):
                        out.append(Group(tp=tp, mbs=mbs, dp=dp, micro_batches=m, ep=ep, etp=etp,
                                         names=tuple(n for n, _ in used), slots=tuple(s for _, s in used)))
        return tuple(out)

    def table(self, g: Group) -> TypeTable:
        """The cost table of a group (built once)."""
        key = g.key
        tb = self._tables.get(key)
        if tb is None:
            tb = self._tables[key] = type_table(self.cm, g.tp, g.mbs, g.dp, g.names, max_pp=self.max_pp,
                                                ep=g.ep, etp=g.etp)
        return tb

    def type_classes(self, g: Group) -> array:
        """Class id per type: equal ids mark device types with identical costs and links."""
        key = g.key
        cls = self._classes.get(key)
        if cls is None:
            tb = self.table(g)
            sigs: list[tuple] = []
            ids = []
            for t in range(len(tb.names)):
                s = tb.max_slots
                sig = tuple(getattr(tb, f)[t] for f in TYPE_COLUMNS + ("slots",))
                sig += tuple(tuple(getattr(tb, f)[t * s:(t + 1) * s]) for f in SLOT_COLUMNS)
                if sig not in sigs:
                    sigs.append(sig)
                ids.append(sigs.index(sig))
            cls = self._classes[key] = array("i", ids)
        return cls

    def shape_groups(self) -> Iterator[ShapeGroup]:
        """Every (group, schedule, V, pp) the options allow."""
        limit = self.options.max_pipeline_stages or self.num_layers
        lowest = self.options.min_pipeline_stages or 1
        for g in self.groups:
            total = sum(g.slots)
            for schedule in self.options.schedules:
                vs = self.options.virtual_stages if schedule == "interleaved-1f1b" else (1,)
                for v in vs:
                    for pp in range(lowest, min(total, limit, self.num_layers // v) + 1):
                        if v > 1 and (pp < 2 or g.micro_batches % pp):
                            continue
                        yield ShapeGroup(group=g, schedule=schedule, virtual_stages=v, pp=pp)

    def count_vectors(self, sg: ShapeGroup, canonical: bool = True) -> list[tuple[int, ...]]:
        """Ranks per type (each <= the type's slots, summing to pp).

        ``canonical`` drops vectors that only swap counts between interchangeable types (the search
        covers them through the symmetric order); the exhaustive reference keeps them all.
        """
        g = sg.group
        caps = g.slots
        n = len(caps)
        cls = self.type_classes(g) if canonical else array("i", range(n))
        out: list[tuple[int, ...]] = []

        def rec(i: int, left: int, acc: list[int]) -> None:
            if i == n - 1:
                if left <= caps[i]:
                    out.append(tuple(acc + [left]))
                return
            for k in range(min(left, caps[i]) + 1):
                rec(i + 1, left - k, acc + [k])

        rec(0, sg.pp, [])
        if canonical:
            def ok(vec: tuple[int, ...]) -> bool:
                # within a class of identical types, counts are non-increasing in type order
                for a in range(n):
                    for b in range(a + 1, n):
                        if cls[a] == cls[b] and vec[a] < vec[b] and caps[a] == caps[b]:
                            return False
                return True
            out = [v for v in out if ok(v)]
        return out
