"""Start-up overhead of ``poseidon-run`` against plain ``torchrun`` on the README's main command.

    python scripts/bench_startup.py [--repeats 3]

Runs the README's main command (``poseidon-run``, deterministic emulation) and the same job as a user would
start it without Poseidon (``torchrun``, the same script and flags, the ``--poseidon-*`` options left out),
``--repeats`` times each, after one ``poseidon-run`` that warms the profile cache. For every run the
*start-up* is the command's wall time minus the training iterations the script itself logs
(``iteration i/N | ... | 1.23 s``): process start, imports, process groups, model build, teardown — and
for ``poseidon-run`` Poseidon's phases (inventory, probing, profiling from the warm cache, search, apply,
placement), whose own split is its ``overhead:`` line. Prints the medians, the difference and the issue's
target (a warm-cache ``poseidon-run`` starts <= 5 s later than plain ``torchrun``) side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

from _e2e_runs import iteration_seconds  # noqa: E402
from poseidon_plugin.runtime.options import split_argv  # noqa: E402

TARGET_S = 5.0
OVERHEAD = re.compile(r"^poseidon: overhead: Poseidon ([0-9.]+) s", re.M)


def readme_main_command() -> list[str]:
    """The arguments of ``poseidon-run`` in the README's main command (its second line, after the install)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        line = f.read().splitlines()[1]
    words = shlex.split(line.rpartition("&&")[2])
    if not words or words[0] != "poseidon-run":
        raise SystemExit(f"bench_startup: the README's second line does not end in a poseidon-run command: {line!r}")
    return words[1:]


def command(name: str) -> list[str]:
    """The console command next to this Python (the venv's), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.path.exists(local) else shutil.which(name)
    if not found:
        raise SystemExit(f"bench_startup: {name} not found; install the project first (pip install -e '.[cpu]')")
    return [found]


def run(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"bench_startup: {' '.join(argv[:2])} ... failed (exit {proc.returncode}):\n{out[-3000:]}")
    iterations = iteration_seconds(out)
    own = OVERHEAD.search(out)
    return {"wall_s": wall, "train_s": sum(iterations), "startup_s": wall - sum(iterations),
            "iterations": len(iterations), "poseidon_s": float(own.group(1)) if own else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args_poseidon = readme_main_command()
    _options, args_torchrun = split_argv(args_poseidon)   # the same job without the --poseidon-* options
    poseidon = command("poseidon-run") + args_poseidon
    torchrun = command("torchrun") + args_torchrun
    print("warming the profile cache (one poseidon-run) ...", flush=True)
    run(poseidon)
    rows: dict[str, list[dict]] = {"poseidon-run": [], "torchrun": []}
    for i in range(args.repeats):
        for name, argv in (("poseidon-run", poseidon), ("torchrun", torchrun)):
            rows[name].append(run(argv))
            r = rows[name][-1]
            print(f"  run {i + 1}/{args.repeats} {name:12s} wall {r['wall_s']:6.2f} s  iterations "
                  f"{r['train_s']:6.2f} s  start-up {r['startup_s']:5.2f} s", flush=True)
    print()
    print(f"{'command':14s} {'wall s':>8s} {'train s':>8s} {'start-up s':>11s} {'Poseidon phases s':>18s}")
    med = {}
    for name, runs in rows.items():
        med[name] = statistics.median(r["startup_s"] for r in runs)
        own = [r["poseidon_s"] for r in runs if r["poseidon_s"] is not None]
        print(f"{name:14s} {statistics.median(r['wall_s'] for r in runs):8.2f} "
              f"{statistics.median(r['train_s'] for r in runs):8.2f} {med[name]:11.2f} "
              f"{(f'{statistics.median(own):.2f}' if own else '-'):>18s}")
    extra = med["poseidon-run"] - med["torchrun"]
    verdict = "met" if extra <= TARGET_S else f"MISSED by {extra - TARGET_S:.2f} s"
    print(f"\nwarm-cache start-up of poseidon-run over plain torchrun: {extra:+.2f} s "
          f"(target <= {TARGET_S:.0f} s: {verdict}); medians of {args.repeats} runs each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
