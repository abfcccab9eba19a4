"""DAG training-time simulator (paper §4.1): critical path of one pipeline's iteration.

Public API::

    Simulator(schedule, pp, micro_batches, virtual_stages=1, comm_model="dag")
        .iteration_time(forward_ms, backward_ms, send_ms, allreduce_ms) -> float   # hot path
        .run(...) -> SimResult                                                     # full detail
    simulate(doc) -> SimResult          # validated stage-level document (README)
    parse_stage_input(doc) -> StageInput; load_stage_input(path) -> StageInput
    kernel_name() -> "compiled" | "pure-python"   (POSEIDON_PURE_PYTHON=1 forces the reference)
"""

from .core import SimResult, Simulator, StageResult, kernel_name
from .graph import COMM_MODELS, build_graph
from .schedules import SCHEDULES, peak_live_microbatches, rank_order
from .stage_input import StageInput, load_stage_input, parse_stage_input, simulate

__all__ = [
    "COMM_MODELS", "SCHEDULES", "SimResult", "Simulator", "StageInput", "StageResult", "build_graph",
    "kernel_name", "load_stage_input", "parse_stage_input", "peak_live_microbatches", "rank_order",
    "simulate",
]
