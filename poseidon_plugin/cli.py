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


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0.0 where unknown or implausible): a
    console script's ``--time-limit`` then counts the interpreter's start-up and imports too."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # field 22, starttime (clock ticks after boot); fields after the command name's ")"
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
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
