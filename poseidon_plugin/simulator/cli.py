"""``poseidon simulate FILE [--json] [--trace OUT.json]``."""

from __future__ import annotations

import json

from .stage_input import checked_result, load_stage_input
from .trace import trace_events, write_json_atomic


def configure(parser) -> None:
    """Add the ``simulate`` arguments."""
    parser.add_argument("file", metavar="FILE",
                        help="stage-level input (JSON, or YAML by extension; '-' reads stdin)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write the simulated timeline as Chrome trace-event JSON (Perfetto)")


def run(args) -> int:
    """Simulate the file and print a table (or JSON)."""
    spec = load_stage_input(args.file)
    sim = spec.simulator()
    where = "<stdin>" if args.file == "-" else args.file
    result = checked_result(sim.run(*spec.times()), where)  # before the trace: it would hold inf too
    if args.trace:
        try:
            write_json_atomic(args.trace, trace_events(sim, *spec.times()))
        except OSError as exc:
            from ..errors import PoseidonError
            raise PoseidonError(f"--trace {args.trace}: cannot write: {exc.strerror}") from None
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    print(f"schedule {spec.schedule}, pp={spec.pp}, micro-batches={spec.micro_batches}, "
          f"V={spec.virtual_stages}, dp={spec.data_parallel}, comm model {spec.comm_model}")
    print(f"{'rank':>4}  {'busy ms':>10}  {'all-red ms':>10}  {'bubble ms':>10}  {'bubble %':>8}  "
          f"{'peak live':>9}")
    for s in result.stages:
        pct = 100.0 * s.bubble_ms / result.iteration_ms if result.iteration_ms else 0.0
        print(f"{s.rank:>4}  {s.busy_ms:>10.3f}  {s.allreduce_ms:>10.3f}  {s.bubble_ms:>10.3f}  "
              f"{pct:>7.1f}%  {s.peak_live_microbatches:>9}")
    print(f"iteration time: {result.iteration_ms:.3f} ms")
    path = result.critical_path
    shown = " -> ".join(path) if len(path) <= 12 else (
        " -> ".join(path[:6]) + f" -> ... ({len(path) - 12} more) ... -> " + " -> ".join(path[-6:]))
    print(f"critical path ({len(path)} nodes): {shown}")
    if args.trace:
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
