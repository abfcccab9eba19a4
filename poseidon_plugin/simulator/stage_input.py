"""The stage-level input format (documented in the README), its validation, and ``simulate(doc)``.

Example::

    {"schedule": "1f1b", "micro_batches": 8, "virtual_stages": 1, "data_parallel": 2,
     "comm_model": "dag",
     "stages": [{"forward_ms": [10.0], "backward_ms": [20.0], "send_ms": 0.5, "allreduce_ms": 3.0}, ...]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InputError
from ..specs.documents import quote, read_document
from .core import SimResult, Simulator
from .graph import COMM_MODELS, extra_params
from .schedules import SCHEDULES, validate_shape

TOP_FIELDS = ("schedule", "micro_batches", "virtual_stages", "data_parallel", "comm_model", "stages")
STAGE_FIELDS = ("forward_ms", "backward_ms", "send_ms", "allreduce_ms")

MAX_MICRO_BATCHES = 1 << 16
"""Micro-batches per iteration (65,536)."""
MAX_VIRTUAL_STAGES = 1 << 10
"""Model chunks per rank (1,024)."""
MAX_DATA_PARALLEL = 1 << 20
"""DP degree (it does not change the simulated time; bounded like a cluster's devices)."""
MAX_SIMULATED_OPS = 1 << 20
"""Forwards + backwards simulated (2 x pp x V x M): about 1-2 GB and a minute at most per input."""


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


def _int_field(doc: dict, name: str, maximum: int, default=None) -> int:
    value = doc.get(name, default)
    if value is None:
        raise InputError(f"missing required field {name!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}={quote(value)} must be an integer >= 1")
    if value > maximum:
        raise InputError(f"{name}={quote(value)} is too large: the simulator takes at most {maximum:,}")
    return value


def _check_time(field: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not _finite(x) or x < 0:
        raise InputError(f"{field}={quote(x)} must be a finite number of milliseconds >= 0")


def _check_times(field: str, values, length: int) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != length:
        got = f"{len(values)} entries" if isinstance(values, (list, tuple)) else quote(values)
        raise InputError(f"{field} must be a list of {length} time(s) in ms (one per chunk), got {got}")
    for i, x in enumerate(values):
        _check_time(f"{field}[{i}]", x)


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond the float range
        return False


def parse_stage_input(doc) -> StageInput:
    """Validate a stage-level document (a dict as loaded from JSON); raise :class:`InputError`."""
    if not isinstance(doc, dict):
        raise InputError(f"the stage-level input must be a JSON object, got {type(doc).__name__}")
    comm_model = doc.get("comm_model", "dag")
    if not isinstance(comm_model, str) or comm_model not in COMM_MODELS:
        raise InputError(f"comm_model={quote(comm_model)} is unknown; allowed: {', '.join(COMM_MODELS)}")
    extra_specs = extra_params(comm_model)
    allowed = TOP_FIELDS + tuple(name for name, _d, _doc in extra_specs)
    unknown = next((key for key in doc if key not in allowed), None)
    if unknown is not None:
        raise InputError(f"unknown field {quote(unknown)}; allowed fields: {', '.join(allowed)}")
    schedule = doc.get("schedule")
    if schedule is None:
        raise InputError("missing required field 'schedule'; allowed: " + ", ".join(SCHEDULES))
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise InputError(f"schedule={quote(schedule)} is unknown; allowed: {', '.join(SCHEDULES)}")
    micro_batches = _int_field(doc, "micro_batches", MAX_MICRO_BATCHES)
    v = _int_field(doc, "virtual_stages", MAX_VIRTUAL_STAGES, 1)
    dp = _int_field(doc, "data_parallel", MAX_DATA_PARALLEL, 1)
    stages = doc.get("stages")
    if not isinstance(stages, list) or not stages:
        raise InputError(f"stages must be a non-empty list (one entry per pipeline rank), "
                         f"got {quote(stages)}")
    ops = 2 * len(stages) * v * micro_batches
    if ops > MAX_SIMULATED_OPS:  # checked before the graph (about 1 KB per operation) is built
        raise InputError(
            f"the input asks for {ops:,} forward and backward operations (2 x {len(stages)} stages x "
            f"virtual_stages={v} x micro_batches={micro_batches:,}); the simulator takes at most "
            f"{MAX_SIMULATED_OPS:,}: simulate fewer micro-batches (the bubble share settles after a few "
            "times the pipeline size)")
    validate_shape(schedule, len(stages), micro_batches, v)
    fwd, bwd, send, ar = [], [], [], []
    for r, st in enumerate(stages):
        if not isinstance(st, dict):
            raise InputError(f"stages[{r}] must be an object with {', '.join(STAGE_FIELDS)}")
        bad = next((key for key in st if key not in STAGE_FIELDS), None)
        if bad is not None:
            raise InputError(f"stages[{r}]: unknown field {quote(bad)}; allowed: {', '.join(STAGE_FIELDS)}")
        for name in STAGE_FIELDS:
            if name not in st:
                raise InputError(f"stages[{r}]: missing required field {name!r}")
        _check_times(f"stages[{r}].forward_ms", st["forward_ms"], v)
        _check_times(f"stages[{r}].backward_ms", st["backward_ms"], v)
        _check_time(f"stages[{r}].send_ms", st["send_ms"])
        _check_time(f"stages[{r}].allreduce_ms", st["allreduce_ms"])
        fwd.extend(float(x) for x in st["forward_ms"])
        bwd.extend(float(x) for x in st["backward_ms"])
        send.append(float(st["send_ms"]))
        ar.append(float(st["allreduce_ms"]))
    extras = []
    for name, _default, _doc in extra_specs:
        if name in doc:
            _check_time(name, doc[name])
            extras.append((name, float(doc[name])))
    return StageInput(schedule=schedule, micro_batches=micro_batches, virtual_stages=v,
                      data_parallel=dp, comm_model=comm_model, forward_ms=tuple(fwd),
                      backward_ms=tuple(bwd), send_ms=tuple(send), allreduce_ms=tuple(ar),
                      extras=tuple(extras))


def simulate(doc, pure_python: bool | None = None) -> SimResult:
    """Validate a stage-level document and simulate it in full detail (the result must be finite)."""
    spec = doc if isinstance(doc, StageInput) else parse_stage_input(doc)
    return checked_result(spec.simulator(pure_python).run(*spec.times()))


def checked_result(result: SimResult, where: str = "") -> SimResult:
    """``result``, unless its times overflowed: finite inputs can still add up past the double range."""
    values = [result.iteration_ms] + [x for s in result.stages for x in (s.busy_ms, s.bubble_ms)]
    if all(math.isfinite(x) for x in values):
        return result
    raise InputError(f"{where + ': ' if where else ''}the simulated iteration time is "
                     f"{result.iteration_ms} ms: the input's times add "
                     "up past the largest double (about 1.8e308); give realistic times in milliseconds")


def _time_rule(path: str) -> str:
    return "is not a valid time; times must be finite numbers of milliseconds >= 0" if "_ms" in path else ""


def load_stage_input(path: str) -> StageInput:
    """Read a stage-level file (JSON; YAML when the name ends in .yaml/.yml; ``-`` for stdin)."""
    doc = read_document(path, "stage-level input", allow_stdin=True, nonfinite=_time_rule)
    try:
        return parse_stage_input(doc)
    except InputError as exc:
        raise InputError(f"{'<stdin>' if path == '-' else path}: {exc}") from None
