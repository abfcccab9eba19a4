"""``poseidon``: the planning command line (``simulate``, ``plan``).

Each subcommand lives in its own module exposing ``configure(parser)`` and ``run(args) -> int``; this
module only dispatches, and turns user mistakes (:class:`PoseidonError`) into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from . import __version__
from .errors import PoseidonError

SUBCOMMANDS = {
    "simulate": ("poseidon_plugin.simulator.cli", "simulate one plan given its stage-level times"),
    "plan": ("poseidon_plugin.search.cli", "search the fastest plan for a cluster and a model"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="poseidon", description="Heterogeneity-aware parallelism planning for Megatron-LM.")
    parser.add_argument("--version", action="version", version=f"poseidon {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:  # a subcommand whose module is not part of this build
            continue
        sub = subs.add_parser(name, help=help_text, description=help_text)
        mod.configure(sub)
        sub.set_defaults(_run=mod.run)
    return parser


def process_age_s(stat: bytes | None = None, uptime: bytes | None = None, ticks_per_s: int | None = None) -> float:
    """Seconds since this process started (Linux ``/proc``; 0.0 where unknown or implausible): a
    console script's ``--time-limit`` then counts the interpreter's start-up and imports too.

    ``stat`` (the contents of ``/proc/self/stat``), ``uptime`` (of ``/proc/uptime``) and ``ticks_per_s``
    default to this machine's; tests pass their own."""
    try:
        if stat is None:
            with open("/proc/self/stat", "rb") as f:
                stat = f.read()
        if uptime is None:
            with open("/proc/uptime", "rb") as f:
                uptime = f.read()
        ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        # field 22, starttime (clock ticks after boot); fields after the command name's ")"
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        age = float(uptime.split()[0]) - ticks / ticks_per_s
    except (OSError, ValueError, IndexError):
        return 0.0
    return age if 0.0 <= age < 60.0 else 0.0


def main(argv=None) -> int:
    """Entry point of the ``poseidon`` console script (``argv``: None reads ``sys.argv``, the process's
    own command line, whose ``--time-limit`` then counts from the process's start)."""
    started = time.monotonic() - (process_age_s() if argv is None else 0.0)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.started = started
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except PoseidonError as exc:
        print(f"poseidon {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"poseidon {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
