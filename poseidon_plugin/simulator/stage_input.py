"""The stage-level input format (documented in the README), its validation, and ``simulate(doc)``.

Example::

    {"schedule": "1f1b", "micro_batches": 8, "virtual_stages": 1, "data_parallel": 2,
     "comm_model": "dag",
     "stages": [{"forward_ms": [10.0], "backward_ms": [20.0], "send_ms": 0.5, "allreduce_ms": 3.0}, ...]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import InputError
from .core import SimResult, Simulator, check_time, check_times
from .graph import COMM_MODELS, extra_params
from .schedules import SCHEDULES, validate_shape

TOP_FIELDS = ("schedule", "micro_batches", "virtual_stages", "data_parallel", "comm_model", "stages")
STAGE_FIELDS = ("forward_ms", "backward_ms", "send_ms", "allreduce_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInput:
    """A validated stage-level input: a plan shape plus flat time vectors."""

    schedule: str
    micro_batches: int
    virtual_stages: int
    data_parallel: int
    comm_model: str
    forward_ms: tuple[float, ...]   # [rank * V + chunk]
    backward_ms: tuple[float, ...]  # [rank * V + chunk]
    send_ms: tuple[float, ...]      # [rank]
    allreduce_ms: tuple[float, ...]  # [rank]
    extras: tuple[tuple[str, float], ...] = ()  # comm-model scalars given in the document

    @property
    def pp(self) -> int:
        return len(self.send_ms)

    def simulator(self, pure_python: bool | None = None) -> Simulator:
        """A simulator for this input's shape, with its comm-model scalars set."""
        sim = Simulator(self.schedule, self.pp, self.micro_batches, self.virtual_stages,
                        self.comm_model, pure_python=pure_python)
        for name, value in self.extras:
            sim.set_extra(name, value)
        return sim

    def times(self) -> tuple:
        return self.forward_ms, self.backward_ms, self.send_ms, self.allreduce_ms


def _int_field(doc: dict, name: str, default=None) -> int:
    value = doc.get(name, default)
    if value is None:
        raise InputError(f"missing required field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}={value!r} must be an integer >= 1")
    return value


def parse_stage_input(doc) -> StageInput:
    """Validate a stage-level document (a dict as loaded from JSON); raise :class:`InputError`."""
    if not isinstance(doc, dict):
        raise InputError(f"the stage-level input must be a JSON object, got {type(doc).__name__}")
    comm_model = doc.get("comm_model", "dag")
    if comm_model not in COMM_MODELS:
        raise InputError(f"comm_model={comm_model!r} is unknown; allowed: {', '.join(COMM_MODELS)}")
    extra_specs = extra_params(comm_model)
    allowed = TOP_FIELDS + tuple(name for name, _d, _doc in extra_specs)
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise InputError(f"unknown field {unknown[0]!r}; allowed fields: {', '.join(allowed)}")
    schedule = doc.get("schedule")
    if schedule is None:
        raise InputError("missing required field 'schedule'; allowed: " + ", ".join(SCHEDULES))
    if schedule not in SCHEDULES:
        raise InputError(f"schedule={schedule!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    micro_batches = _int_field(doc, "micro_batches")
    v = _int_field(doc, "virtual_stages", 1)
    dp = _int_field(doc, "data_parallel", 1)
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise InputError(f"stages must be a non-empty list (one entry per pipeline rank), got {stages!r}")
    validate_shape(schedule, len(stages), micro_batches, v)
    fwd, bwd, send, ar = [], [], [], []
    for r, st in enumerate(stages):
        if not isinstance(st, dict):
            raise InputError(f"stages[{r}] must be an object with {', '.join(STAGE_FIELDS)}")
        bad = sorted(set(st) - set(STAGE_FIELDS))
        if bad:
            raise InputError(f"stages[{r}]: unknown field {bad[0]!r}; allowed: {', '.join(STAGE_FIELDS)}")
        for name in STAGE_FIELDS:
            if name not in st:
                raise InputError(f"stages[{r}]: missing required field {name!r}")
        check_times(f"stages[{r}].forward_ms", st["forward_ms"], v)
        check_times(f"stages[{r}].backward_ms", st["backward_ms"], v)
        check_time(f"stages[{r}].send_ms", st["send_ms"])
        check_time(f"stages[{r}].allreduce_ms", st["allreduce_ms"])
        fwd.extend(float(x) for x in st["forward_ms"])
        bwd.extend(float(x) for x in st["backward_ms"])
        send.append(float(st["send_ms"]))
        ar.append(float(st["allreduce_ms"]))
    extras = []
    for name, _default, _doc in extra_specs:
        if name in doc:
            check_time(name, doc[name])
            extras.append((name, float(doc[name])))
    return StageInput(schedule=schedule, micro_batches=micro_batches, virtual_stages=v,
                      data_parallel=dp, comm_model=comm_model, forward_ms=tuple(fwd),
                      backward_ms=tuple(bwd), send_ms=tuple(send), allreduce_ms=tuple(ar),
                      extras=tuple(extras))


def simulate(doc, pure_python: bool | None = None) -> SimResult:
    """Validate a stage-level document and simulate it in full detail."""
    spec = doc if isinstance(doc, StageInput) else parse_stage_input(doc)
    return spec.simulator(pure_python).run(*spec.times())


def load_stage_input(path: str) -> StageInput:
    """Read a stage-level file (JSON; YAML when the name ends in .yaml/.yml; ``-`` for stdin)."""
    import sys

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read stage-level input {path!r}: {exc.strerror}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: malformed {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: "
                         f"{str(exc).splitlines()[0]}") from None
    return parse_stage_input(doc)


def _reject_constant(name: str):
    # json accepts NaN/Infinity by default; a time of NaN is never meaningful.
    raise InputError(f"{name} is not a valid time; times must be finite numbers of milliseconds >= 0")
