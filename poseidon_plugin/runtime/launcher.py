"""``poseidon-run``: torchrun with a planner in front of the training script.

    poseidon-run [torchrun options] SCRIPT [script args] [--poseidon-* options]

Every torchrun option is accepted and passed through (torch.distributed.run's own parser reads them).
``--poseidon-*`` options (or their ``POSEIDON_*`` variables, see ``options.py``) are taken out wherever they
stand, validated here before any process starts, and handed to the ranks through the environment. Each
rank runs ``poseidon_plugin.runtime.bootstrap`` with the script and its arguments; the bootstrap plans,
rewrites the flags and then runs the script in that same process. With ``POSEIDON_DISABLE=1`` this is
exactly torchrun (the ``--poseidon-*`` options are dropped).

Mistakes are one line naming the flag, and exit code 2; a failed job exits with its ranks' exit code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import options as runtime_options

BOOTSTRAP_MODULE = "poseidon_plugin.runtime.bootstrap"
_MODULE_FLAGS = ("-m", "--module")
# Set for the ranks unless the user set them. Megatron-LM refuses tensor parallelism on pre-Blackwell GPUs
# without CUDA_DEVICE_MAX_CONNECTIONS=1; a user who ran TP 1 never needed it, but the plan may choose TP > 1,
# and CUDA reads it when the context is created, before the plan exists.
# OMP_NUM_THREADS=1 is what torchrun sets anyway when it is unset (with a banner saying so, which this
# default keeps out of the demo's output); set it yourself for more threads per rank.
RANK_ENV_DEFAULTS = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate, launch; returns the exit code (0, 2 for a usage mistake, else the ranks')."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, rest = runtime_options.parse(argv)
        if opts.disable:
            from torch.distributed import run as torchrun

            torchrun.main(rest)
            return 0
        torchrun_args, env = prepare(opts, rest)
        if opts.emulate_model:
            env.update(host_factor_env(os.environ))
        from poseidon_plugin.runtime import elastic

        barrier_s = elastic.exit_barrier_timeout(os.environ)
    except PoseidonError as exc:
        message = runtime_options.as_given(str(exc), argv, os.environ)
        print(f"poseidon-run: error: {message}", file=sys.stderr, flush=True)
        return 2
    os.environ.update(env)
    with elastic.torchrun_agent(barrier_s), (_emulation_stamps() if opts.emulate_model else contextlib.nullcontext()):
        return launch(torchrun_args)


def host_factor_env(environ: Mapping[str, str], measure: Callable[[], float] | None = None) -> dict[str, str]:
    """The deterministic emulation's host factor for the ranks (``emulation.harness.host_factor``): timed
    here once per launch, before any rank runs, so that every attempt of this agent (restarts) uses the same;
    nothing when the user pinned it (checked: PoseidonError naming the variable). ``measure``: the loop's
    wall ms (default ``harness.host_loop_ms``)."""
    from poseidon_plugin.emulation import harness

    if environ.get(harness.HOST_FACTOR_ENV, "").strip():
        harness.parse_host_factor(environ[harness.HOST_FACTOR_ENV])
        return {}
    loop_ms = (measure or harness.host_loop_ms)()
    factor = harness.host_factor(loop_ms)
    if factor > 1.0:
        print(f"poseidon-run: emulation: this host ran the reference loop in {loop_ms:.1f} ms "
              f"({harness.HOST_LOOP_MS:g} ms on the host of the emulation's CPU costs): the ranks' CPU work counts "
              f"{factor:g}x ({harness.HOST_FACTOR_ENV} pins it)", flush=True)
    return {harness.HOST_FACTOR_ENV: f"{factor:g}"}


@contextlib.contextmanager
def _emulation_stamps():
    """A fresh folder for the deterministic emulation's shared p2p posting times (``emulation/links_patch``),
    named to the ranks by ``POSEIDON_EMULATION_STAMPS`` and removed when the job ends."""
    import shutil
    import tempfile

    from poseidon_plugin.emulation.links_patch import STAMPS_ENV

    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    folder = tempfile.mkdtemp(prefix="poseidon-emulation-", dir=shm)
    os.environ[STAMPS_ENV] = os.path.join(folder, "p2p-stamps")
    try:
        yield
    finally:
        os.environ.pop(STAMPS_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def prepare(opts: runtime_options.RuntimeOptions, rest: list[str]) -> tuple[list[str], dict[str, str]]:
    """The torchrun argv that starts the bootstrap, and the environment for the ranks; PoseidonError on mistakes."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    args = parser.parse_args(rest)  # torchrun's own errors: usage + exit 2, as torchrun
    if args.no_python:
        raise PoseidonError("--no-python cannot be used with poseidon-run: the script must be Python, run "
                            "in-process after planning; set POSEIDON_DISABLE=1 to launch it with plain torchrun")
    if args.run_path:
        raise PoseidonError("--run-path cannot be used with poseidon-run (it runs the script in the launcher "
                            "process); drop it")
    script, script_args = args.training_script, list(args.training_script_args)
    if not args.module and not os.path.isfile(script):
        raise PoseidonError(f"training script {script!r} does not exist; give the path of a Python script "
                            f"(e.g. scripts/pretrain_gpt.py)")
    world_size = _static_world_size(args)
    if world_size is not None and _agent_declares(opts, world_size, args.nproc_per_node):
        world_size = None  # each agent declares its own devices: the job's are known to the ranks only
    validate(opts, script, script_args, world_size)
    options_part = rest[: len(rest) - len(script_args) - 1]
    options_part = [token for token in options_part if token not in _MODULE_FLAGS]
    env = runtime_options.to_env(opts)
    env[runtime_options.ENV_SCRIPT_IS_MODULE] = "1" if args.module else "0"
    env.update({key: value for key, value in RANK_ENV_DEFAULTS.items() if key not in os.environ})
    from poseidon_plugin.runtime import elastic

    # A fresh worker store per rendezvous round, so that restarts work (runtime/elastic.py explains why).
    env.update(elastic.launcher_env(os.environ))
    return [*options_part, "--module", BOOTSTRAP_MODULE, script, *script_args], env


def validate(opts: runtime_options.RuntimeOptions, script: str, script_args: list[str],
             world_size: int | None) -> None:
    """Checks that need no process: the job is Megatron-shaped, files parse, options fit together."""
    from poseidon_plugin.plan import MEGATRON_SCHEDULES, SCHEDULES
    from poseidon_plugin.runtime import precheck
    from poseidon_plugin.runtime.apply import MINDSPEED_STYLES, resolve_style
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.target import TargetRuntime

    job = read_job(script, script_args)
    precheck.check_launch(opts, job, world_size, script_args)
    if opts.emulate_model:
        from poseidon_plugin.emulation import harness as emulation
        from poseidon_plugin.specs import model_presets

        emulation.parse_emulate_model(opts.emulate_model, model_presets(), tuple(emulation.link_families()))
    for schedule in opts.schedules:
        if schedule not in SCHEDULES:
            raise PoseidonError(f"--poseidon-schedules: unknown schedule {schedule!r}; choose from "
                                f"{', '.join(MEGATRON_SCHEDULES)}")
        if schedule not in MEGATRON_SCHEDULES:
            raise PoseidonError(f"--poseidon-schedules: Megatron cannot run {schedule!r}; choose from "
                                f"{', '.join(MEGATRON_SCHEDULES)}")
    from poseidon_plugin.runtime import mindspeed

    style = resolve_style(opts.flag_style)
    if not opts.plan:  # the plan's target runtime: its schedules must run in the flag style
        TargetRuntime.for_job(opts, job, style, mindspeed.dp_multiple(script_args))
    if style in MINDSPEED_STYLES:  # MindSpeed-LLM's refused flags and CP/EP values fail before any process
        from poseidon_plugin.runtime.job_flags import flag_values

        user = flag_values(script_args)
        mindspeed.user_cp_ep(user)
        mindspeed.check_user_flags(user, tp=1, pp=1, ep=1, num_experts=0)


def _agent_declares(opts: runtime_options.RuntimeOptions, world_size: int, nproc_per_node) -> bool:
    """``--poseidon-emulate`` names this agent's devices, not the job's (``elastic.agent_declares``)."""
    if not opts.emulate:
        return False
    from poseidon_plugin.emulation.harness import declared_devices
    from poseidon_plugin.runtime import elastic

    return elastic.agent_declares(declared_devices(opts.emulate), world_size, int(nproc_per_node))


def _static_world_size(args) -> int | None:
    """``nnodes x nproc_per_node`` when both are fixed numbers (elastic ranges and 'gpu'/'auto' are not)."""
    low, _, high = str(args.nnodes).partition(":")
    try:
        nnodes, nproc = int(low), int(args.nproc_per_node)
        if high and int(high) != nnodes:
            return None
    except (TypeError, ValueError):
        return None
    return nnodes * nproc


def launch(torchrun_args: list[str]) -> int:
    """Run torchrun; on failure one summary line (each rank already printed its own message)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from poseidon_plugin.runtime.collectives import first_line

    try:
        torchrun.run(torchrun.parse_args(torchrun_args))
    except ChildFailedError as exc:
        first_rank, first = exc.get_first_failure()
        print(failure_summary(exc.failures, first_rank, first), file=sys.stderr, flush=True)
        codes = [first.exitcode] + [f.exitcode for f in exc.failures.values()]
        return next((code for code in codes if code > 0), 1)
    except RendezvousError as exc:  # e.g. the agent hosting the rendezvous store is gone
        print(f"poseidon-run: error: torchrun's rendezvous failed ({type(exc).__name__}: {first_line(exc)}); "
              f"the agent hosting the rendezvous store (--rdzv-endpoint) may have ended or been lost, or "
              f"too few agents joined", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        print(f"poseidon-run: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


def failure_summary(failures: dict, first_rank: int, first) -> str:
    """One line: which rank failed first (pid, host, exit code or signal), and how many failed in all.

    ``failures`` maps a global rank to torchrun's ``ProcessFailure`` (``exitcode``, ``pid``, ``signal_name()``).
    """
    import socket

    how = (f"was killed by {first.signal_name()}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    others = sorted(rank for rank in failures if rank != first_rank)
    rest = f"; then rank(s) {others} were stopped or failed too" if others else ""
    return (f"poseidon-run: rank {first_rank} (pid {first.pid} on {socket.gethostname()}) {how} first{rest}; "
            f"each rank's message is above")


if __name__ == "__main__":
    sys.exit(main())
