"""Per-rank bootstrap: what ``poseidon-run`` starts in each training process, before the user's script.

``python -m poseidon_plugin.runtime.bootstrap SCRIPT ARGS...`` (torchrun environment, options in
``POSEIDON_*``): inventory -> link probing -> profiling -> search on rank 0 -> plan agreement -> apply
(flags, patches, placement) -> the script itself, in this process (``runpy``), on the process group
created here. Every phase runs under ``collectives.Phases``: a failure anywhere ends every rank with the
same one-line message (exit 2 for a user mistake, 1 otherwise), never a hang.
"""

from __future__ import annotations

import dataclasses
import os
import runpy
import signal
import sys
import time
import warnings
from typing import TYPE_CHECKING

from poseidon_plugin.costmodel import recompute_note
from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import elastic
from poseidon_plugin.runtime import options as runtime_options
from poseidon_plugin.runtime.collectives import Liveness, Phases, PhaseFailed, parse_fault
from poseidon_plugin.runtime.job_flags import JobFlags
from poseidon_plugin.target import TargetRuntime

if TYPE_CHECKING:  # pragma: no cover  (torch-importing modules, imported when the phase runs)
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.runtime.devices import Device
    from poseidon_plugin.runtime.inventory import World
    from poseidon_plugin.specs import ClusterSpec, ModelSpec, ProfileSpec
    from poseidon_plugin.specs.cluster import Device as ClusterDevice
    from poseidon_plugin.runtime.devices import EmulationState


class Log:
    """``poseidon[rank N]: ...`` on every rank, ``poseidon: ...`` for rank 0's job-wide lines."""

    def __init__(self, rank: int, leader: bool) -> None:
        self.rank = rank
        self.leader = leader

    def rank_line(self, message: str) -> None:
        _write(sys.stdout, f"poseidon[rank {self.rank}]: {message}")

    def job_line(self, message: str) -> None:
        if self.leader:
            for line in message.splitlines() or [""]:
                _write(sys.stdout, f"poseidon: {line}")

    def error(self, message: str) -> None:
        _write(sys.stderr, f"poseidon[rank {self.rank}]: error: {message}")


def _write(stream, line: str) -> None:
    """One write per line: ranks share the launcher's pipes, and print() writes the text and the newline
    separately on an unbuffered stderr, so two ranks' lines could interleave."""
    stream.write(line + "\n")
    stream.flush()


# megatron-core warnings that say the same on every rank (what is installed, deprecated defaults)
ENVIRONMENT_NOTICES = r".*(not installed|is deprecated|Falling back)"


def main(argv: list[str] | None = None) -> None:
    """Entry point of each rank; never returns normally when the job fails."""
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    log = Log(rank, leader=rank == 0)
    if not argv:
        log.error("no training script given (usage: python -m poseidon_plugin.runtime.bootstrap SCRIPT ARGS...)")
        _exit(2)
    # torchrun stops every rank when one dies; say why instead of vanishing (restored before the script runs).
    signal.signal(signal.SIGTERM, lambda signum, frame: _stopped(log))
    if rank != 0:
        # Every rank would print megatron-core's identical notices about its environment (Apex or Transformer
        # Engine not installed, a deprecated default): launcher rank 0 shows them once. Other warnings stay.
        warnings.filterwarnings("ignore", message=ENVIRONMENT_NOTICES, category=UserWarning, module=r"megatron\.")
    try:
        exit_code = _run(argv, rank, log)
    except PhaseFailed as exc:
        log.error(str(exc))
        _leave(2 if exc.user_error else 1)
    except PoseidonError as exc:
        log.error(str(exc))
        _leave(2)
    sys.exit(exit_code)


# The running Phases, for the SIGTERM handler (set once the process group exists).
_state: dict = {"phases": None}


def _stopped(log: Log) -> None:
    """torchrun stops the other ranks when one fails: report the recorded failure if there is one."""
    phases = _state["phases"]
    if phases is not None and phases.failing:
        return  # already reporting its own failure and about to exit
    recorded = phases.recorded_failure() if phases is not None else None
    if recorded is not None:
        log.error(str(recorded))
        _leave(2 if recorded.user_error else 1)
    lost = phases.lost_ranks() if phases is not None else []
    if lost:
        log.error(f"stopped by the launcher: lost {'; '.join(lost)}, during Poseidon's start-up")
    else:
        log.error("stopped by the launcher during Poseidon's start-up; no rank recorded a failure: a rank of "
              "another agent, or that agent, was lost (see that agent's output), or the job was interrupted")
    _leave(1)


LINGER_S = 10.0
"""How long the store's host, failing, keeps the store up for the other ranks to read its failure."""


def _leave(code: int) -> None:
    """Leave after a failure. The process that hosts the workers' store (launcher rank 0) takes the store
    with it: before it leaves it closes its process group, so that ranks blocked in a collective with it fail
    at once and read the recorded failure, and waits (at most :data:`LINGER_S`) until each other rank has
    left or is lost; otherwise they could only say that no rank recorded a failure."""
    phases = _state["phases"]
    if phases is not None and phases.store is not None:
        elastic.mark_left(phases.store, phases.rank)
        if elastic.hosts_store(phases.rank):
            _close_process_group()
            lost = phases.liveness.lost_ids if phases.liveness is not None else set
            elastic.wait_for_peers_to_leave(phases.store, phases.rank, int(os.environ.get("WORLD_SIZE", "1")),
                                            lost, LINGER_S)
    _exit(code)


def _close_process_group() -> None:
    """Destroy this rank's process groups, bounded: a peer's pending work must not keep the failure here."""
    import threading

    import torch.distributed as dist

    def close() -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (already broken: the peers see a closed connection all the same)
            pass

    closer = threading.Thread(target=close, name="poseidon-close", daemon=True)
    closer.start()
    closer.join(5.0)


def _exit(code: int) -> None:
    """Leave at once: a process group with a failed peer may block in its destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    """What this rank was started with: the options, the script and what its flags say."""

    opts: runtime_options.RuntimeOptions
    """The ``--poseidon-*`` options, read back from the environment the launcher exported."""
    script: str
    """The training script (a path, or a module name when ``is_module``)."""
    script_args: list[str]
    """The script's own arguments, as the user gave them."""
    is_module: bool
    """The user launched a module (``torchrun -m``)."""
    rank: int
    """Launcher rank (``RANK``), before the plan renumbers the ranks."""
    local_rank: int
    """``LOCAL_RANK``: the device index on this host."""
    world_size: int
    """Ranks started by the launcher."""
    flags: JobFlags
    """What the script's Megatron flags say about the model, the batch and the user's parallelism."""
    global_batch: int
    """The global batch the job trains with (pinned in the rewritten flags)."""
    style: str
    """Resolved flag style (``megatron`` / ``mindspeed-layout`` / ``mindspeed`` / ``patch``: ``runtime/apply.py``)."""
    target: TargetRuntime
    """What runs the plan: the same definition ``poseidon plan`` uses (``poseidon_plugin/target.py``)."""
    own_devices: str | None = None
    """``--poseidon-emulate`` when it names this agent's devices only (``elastic.agent_declares``); the job's
    are the union of the agents', known after inventory."""
    host_factor: float = 1.0
    """How many times slower than the emulation's reference host this agent's host runs (``poseidon-run``
    timed it: ``emulation.harness.host_factor``); the job uses its agents' largest, agreed at inventory."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Devices:
    """The start-up phase's result: this rank's device and the cluster the options declare."""

    device: Device
    """This rank's device (emulated on CPU ranks of a declared cluster), shim and emulation patches applied."""
    declared: ClusterSpec | None
    """The cluster ``--poseidon-cluster`` / ``--poseidon-emulate`` declares; None: detected."""
    entry: ClusterDevice | None
    """This rank's device in ``declared`` (device *i* is launcher rank *i*); None when detected."""
    emulated: EmulationState | None = None
    """``--poseidon-emulate-model``: the deterministic emulation installed on this rank (emulation/harness.py)."""


def _run(argv: list[str], rank: int, log: Log) -> int | None:
    """All phases, then the script; the script's exit code (None for success)."""
    import torch.distributed as dist

    from poseidon_plugin.runtime import apply, job_flags, mindspeed
    from poseidon_plugin.runtime.devices import HOST_FACTOR_ENV, parse_host_factor

    started = time.perf_counter()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    flags = job_flags.read_job(argv[0], argv[1:])
    opts = runtime_options.resolve({}, os.environ)
    style = apply.resolve_style(opts.flag_style)
    job = _Job(opts=opts, script=argv[0], script_args=argv[1:],
               is_module=os.environ.get(runtime_options.ENV_SCRIPT_IS_MODULE) == "1", rank=rank,
               local_rank=int(os.environ.get("LOCAL_RANK", "0")), world_size=world_size, flags=flags,
               global_batch=job_flags.effective_global_batch(flags, world_size), style=style,
               target=TargetRuntime.for_job(opts, flags, style, mindspeed.dp_multiple(argv[1:])),
               own_devices=_own_devices(opts, world_size),
               host_factor=parse_host_factor(os.environ.get(HOST_FACTOR_ENV)))
    adaptor = _mindspeed_adaptor(job, log)  # before _device(): it imports megatron (CPU shim, emulation)
    emulated = _deterministic_emulation(job)
    devices = _device(job, emulated.cluster if emulated is not None else _declared_cluster(job), emulated)
    device = devices.device

    # this attempt's own store: torchrun's is shared by every attempt (runtime/elastic.py)
    elastic.init_process_group(device.backend, rank, world_size, job.opts.timeout)
    store = dist.distributed_c10d._get_default_store()
    phases = Phases(device=device.torch_device, rank=rank, store=store,
                    fault=parse_fault(os.environ.get(runtime_options.ENV_INJECT_FAULT), elastic.attempt(), world_size),
                    liveness=Liveness(store, rank, world_size, prefix=elastic.store_prefix()).start())
    _state["phases"] = phases
    phases.seconds["start-up"] = time.perf_counter() - started

    world, devices = phases.run("inventory", lambda: _inventory(job, devices))
    emulated = devices.emulated  # built at inventory when each agent declares its own devices
    me = world.ranks[rank]
    log.rank_line(f"{me.device_type} ({device.kind}) on {me.host}, local rank {me.local_rank}"
                  + (f", compute stretched x{device.slowdown():.2f}" if device.slowdown() > 1.0 else "")
                  + (f", deterministic emulation of {emulated.spec.preset} x{emulated.scale:.4g} "
                     f"({emulated.spec.links} links)" if emulated is not None else ""))
    plan = _plan(job, phases, world, devices, log)
    return _apply_and_run(job, phases, world, devices, plan, log, adaptor)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Adaptor:
    """MindSpeed-LLM's adaptor as imported at start-up (MindSpeed styles only; ``runtime/mindspeed.py``)."""

    host: object
    """The process as ``mindspeed.Host``."""
    module: object | None
    """``mindspeed_llm.tasks.megatron_adaptor_v2``; None when MindSpeed-LLM is not installed."""


def _mindspeed_adaptor(job: _Job, log: Log) -> _Adaptor | None:
    """MindSpeed styles: ``transfer_to_npu`` on Ascend, then the adaptor on the user's argv, both before any
    megatron import. Without MindSpeed-LLM installed (CPU runs) the adaptor steps are skipped, said once."""
    from poseidon_plugin.runtime import apply, mindspeed

    if job.style not in apply.MINDSPEED_STYLES:
        return None
    host = mindspeed.ProcessHost()
    mindspeed.transfer_to_npu(host)
    if not mindspeed.adaptor_installed():
        log.job_line(f"flag style {job.style}: MindSpeed-LLM ({mindspeed.ADAPTOR_PACKAGE}) is not installed; "
                     "skipping its adaptor (import before megatron, repatch for the plan) and MindSpeed's "
                     "offset-helper patch; the split reaches megatron-core through Poseidon's layer patches")
        return _Adaptor(host=host, module=None)
    return _Adaptor(host=host, module=mindspeed.import_adaptor(host, job.script, job.script_args))


def _declared_cluster(job: _Job) -> ClusterSpec | None:
    """The cluster ``--poseidon-cluster`` or ``--poseidon-emulate`` declares (None: detect); this agent's
    own devices when each agent declares its own."""
    from poseidon_plugin.runtime.precheck import declared_cluster

    if job.own_devices is not None:
        return declared_cluster(job.opts, int(os.environ["LOCAL_WORLD_SIZE"]))
    return declared_cluster(job.opts, job.world_size)


def _own_devices(opts: runtime_options.RuntimeOptions, world_size: int) -> str | None:
    """``--poseidon-emulate`` when it declares this agent's devices only (the job's are then the agents' union,
    known at inventory; a deterministic emulation is built there)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not opts.emulate or opts.cluster or not local:
        return None
    from poseidon_plugin.runtime.devices import declared_devices

    return opts.emulate if elastic.agent_declares(declared_devices(opts.emulate), world_size, int(local)) else None


def profile_digest(cluster: ClusterSpec, model: ModelSpec, profile: ProfileSpec) -> str:
    """12 hex digits naming the whole-job profile file by what it measured (devices, model, software), so a
    run on other devices writes its own file instead of overwriting this one."""
    import hashlib
    import json

    from poseidon_plugin.fingerprint import devices_part, model_part

    key = {"devices": devices_part(cluster), "model": model_part(model), "software": dict(profile.software)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:12]


def _deterministic_emulation(job: _Job, emulate: str | None = None,
                             host_factor: float | None = None) -> EmulationState | None:
    """``--poseidon-emulate-model``: this rank's EmulationState (emulation/harness.py) for the job's devices
    ``emulate`` (default ``--poseidon-emulate``) on a host ``host_factor`` times slower than the reference
    (default this agent's), or None. None too before inventory when each agent declares its own devices: the
    emulation needs the job's, the agents' union (:func:`_union_of_agents`)."""
    if not job.opts.emulate_model or (emulate is None and job.own_devices is not None):
        return None
    from poseidon_plugin.runtime.devices import deterministic_state

    return deterministic_state(
        emulate=emulate or job.opts.emulate, emulate_model=job.opts.emulate_model, rank=job.rank,
        world_size=job.world_size,
        num_layers=job.flags.num_layers, global_batch=job.global_batch, micro_batch_size=job.flags.micro_batch_size,
        job_model=_job_model(job), host_factor=job.host_factor if host_factor is None else host_factor)


def _job_model(job: _Job) -> ModelSpec:
    """The ModelSpec of the job that really runs (its flags, its global batch, its name)."""
    from poseidon_plugin.runtime import job_spec

    return job_spec.model_spec(job.flags, global_batch_size=job.global_batch,
                               name=job_spec.job_name(job.script, job.flags))


def _device(job: _Job, declared: ClusterSpec | None, emulated: EmulationState | None = None) -> _Devices:
    """This rank's device (emulated on CPU when a cluster is declared), with the CPU shim and emulation
    patches in place, and this rank's declared cluster device (None when detected)."""
    from poseidon_plugin.runtime import devices

    device = devices.detect(job.local_rank)
    entry = None
    if declared is not None:
        index = job.local_rank if job.own_devices is not None else job.rank  # an agent's own: by local rank
        if index >= declared.num_devices:
            raise PoseidonError(f"{declared.source} declares {declared.num_devices} devices but the job has "
                                f"{job.world_size} ranks; declare one device per rank")
        entry = declared.devices()[index]
        device = devices.emulated(device, declared, entry.device_type, flag=job.opts.emulate,
                                  deterministic=bool(job.opts.emulate_model))
    emulated = devices.install_emulation(device, emulated)
    return _Devices(device=device, declared=declared, entry=entry, emulated=emulated)


def _inventory(job: _Job, devices: _Devices) -> tuple[World, _Devices]:
    """Every rank's RankInfo, arranged as the cluster's nodes (the declared ones for a cluster file); the
    devices with the job's declared cluster (the union of the agents' when each declares its own)."""
    from poseidon_plugin.runtime import inventory
    from poseidon_plugin.runtime.devices import GIB

    from poseidon_plugin.runtime.collectives import all_gather_json

    # every agent must have been told the same: rank 0's agent is the reference
    everyone = all_gather_json(elastic.told(runtime_options.to_env(job.opts), job.script_args,
                                            own_devices=job.own_devices, host_factor=job.host_factor),
                               devices.device.torch_device)
    elastic.check_agreement(everyone)
    host_factor = elastic.slowest_host(everyone)
    if job.own_devices is not None:
        devices = _union_of_agents(job, devices, elastic.union_of_agents(everyone), host_factor)
    elif job.opts.emulate_model and host_factor != job.host_factor:  # another agent's host is slower
        devices = _reinstall(devices, _deterministic_emulation(job, host_factor=host_factor))
    device, declared, entry = devices.device, devices.declared, devices.entry
    info = inventory.local_info(
        job.rank, job.local_rank, device,
        declared_type=entry.device_type if entry is not None else None,
        declared_memory=int(declared.device_type(entry.device_type).memory_gb * GIB) if entry is not None else None,
        node_tag=f"declared-node-{entry.node}" if entry is not None else None, agent=elastic.agent())
    world = inventory.gather_world(info, device.torch_device)
    declared_world = job.opts.cluster or job.opts.emulate_model  # the emulated cluster's nodes, as declared
    return (inventory.world_from_declared(declared, world.ranks) if declared_world else world), devices


def _reinstall(devices: _Devices, state: EmulationState) -> _Devices:
    """``devices`` with the deterministic emulation ``state`` installed in place of the one built at start-up."""
    from poseidon_plugin.runtime.devices import install_emulation

    kept = install_emulation(devices.device, state)
    return dataclasses.replace(devices, declared=state.cluster, emulated=kept or devices.emulated)


def _union_of_agents(job: _Job, devices: _Devices, union: str, host_factor: float) -> _Devices:
    """The job's emulated cluster from every agent's own devices (``union``: theirs in rank order, gathered at
    inventory); this rank's compute stretched against the fastest type of the whole job (an agent alone knows
    only its own types), or, with ``--poseidon-emulate-model``, the deterministic emulation of the whole job
    built and installed here (its SCALE, links and TP fit depend on every device of the job)."""
    from poseidon_plugin.runtime.devices import restretch
    from poseidon_plugin.runtime.precheck import declared_cluster

    declared = declared_cluster(dataclasses.replace(job.opts, emulate=union), job.world_size)
    entry = declared.devices()[job.rank]
    if devices.entry is not None and entry.device_type != devices.entry.device_type:
        raise PoseidonError(f"rank {job.rank} is a {devices.entry.device_type} of its agent's --poseidon-emulate but "
                            f"device {job.rank} of the agents' union {union!r} is a {entry.device_type}")
    if job.opts.emulate_model:  # every rank builds the same emulation from the same union, then installs its own
        return dataclasses.replace(_reinstall(devices, _deterministic_emulation(job, union, host_factor)),
                                   entry=entry)
    restretch(devices.device, declared, entry.device_type)
    return dataclasses.replace(devices, declared=declared, entry=entry)


def _plan(job: _Job, phases: Phases, world: World, devices: _Devices, log: Log) -> Plan:
    """A saved plan checked against the world, or: probe links, profile, search on rank 0, share."""
    from poseidon_plugin.costmodel import CostModel
    from poseidon_plugin.plan import Plan
    from poseidon_plugin.runtime import client_step, inventory, planning, precheck, profiler
    from poseidon_plugin.specs import write_profile

    opts, device, declared = job.opts, devices.device, devices.declared
    if opts.plan:
        def check() -> Plan:
            plan = Plan.load(opts.plan)
            precheck.check_plan_fits(plan, world, job.flags, job.global_batch, f"--poseidon-plan {opts.plan}",
                                     script_args=job.script_args,
                                     emulation=devices.emulated.cache_tag() if devices.emulated else "")
            return plan

        return phases.run("plan check", check)
    if opts.cluster or opts.emulate_model:
        cluster = declared
        phases.notes["inventory"] = ("links from --poseidon-cluster" if opts.cluster
                                     else "emulated links from --poseidon-emulate-model")
    else:
        probe = phases.run("probing", lambda: inventory.probe_links(world, job.rank, device))
        cluster = inventory.cluster_from_world(world, inventory.link_specs(probe["links"]), declared)
        log.job_line(_links_line(probe))
    model = _job_model(job)
    cache_dir = runtime_options.profile_cache_dir(opts)

    emulated = devices.emulated
    if emulated is not None:
        for note in emulated.host_notes():
            log.job_line(f"emulation: {note}")
        if opts.keep and not emulated.allows_tp(job.flags.tensor_parallel):
            log.job_line(f"emulation: --poseidon-keep keeps TP {job.flags.tensor_parallel} all the same; expect "
                         f"iterations above the prediction")

    def profile() -> profiler.ProfileOutcome:
        requests = profiler.candidate_requests(cluster, model, job.flags,
                                               micro_batch_sizes=job.target.micro_batch_sizes, keep=opts.keep)
        if emulated is not None and not opts.keep:  # TP degrees this host cannot emulate (emulation.fit_to_host)
            requests = [r for r in requests if emulated.allows_tp(r.tp)]
        client = client_step.Client(script=job.script, args=tuple(job.script_args), is_module=job.is_module)
        return profiler.profile_world(world=world, rank=job.rank, device=device, job=job.flags, model=model,
                                      requests=requests, cache_dir=cache_dir, warmup=opts.profile_warmup,
                                      iters=opts.profile_iters, progress=log.rank_line, client=client,
                                      keep=opts.keep)

    outcome = phases.run("profiling", profile)
    phases.notes["profiling"] = f"cache: reused {outcome.reused} of {outcome.reused + outcome.measured} configurations"
    for why in outcome.unstored:
        log.rank_line(f"warning: profile cache entry not stored ({why}); it will be measured again next launch")
    merged = os.path.join(cache_dir, f"{model.name}-{profile_digest(cluster, model, outcome.profile)}-profile.json")
    written = f"written to {merged}"
    if job.rank == 0:  # the job's whole profile, for `poseidon plan --profile` later
        try:
            write_profile(merged, outcome.profile)
        except OSError as exc:
            written = f"not written to {merged} ({exc.strerror or type(exc).__name__})"
    log.job_line(f"profile: {phases.notes['profiling']} in {cache_dir}; {written}")

    def search() -> Plan:
        found = planning.plan_on_rank0(CostModel(cluster, model, outcome.profile), job.target,
                                       keep=job.flags if opts.keep else None, time_limit_s=opts.search_budget_s,
                                       workers=opts.search_workers)
        precheck.check_plan_fits(found, world, job.flags, job.global_batch, "the searched plan",
                                 script_args=job.script_args)
        return found

    plan = phases.run("search", lambda: planning.share_plan(search, job.rank, device.torch_device))
    if job.rank == 0:
        _log_replan(world, plan, cache_dir, log)
    return plan


def _plan_line(plan: Plan) -> str:
    return (f"hash {plan.plan_hash()[:12]}  TP {plan.tp} PP {plan.pp} DP {plan.dp} mbs {plan.micro_batch_size} "
            f"{plan.schedule} V {plan.virtual_stages}  types {'/'.join(s.device_type for s in plan.stages)}  "
            f"layers {'/'.join(str(n) for n in plan.layers)}  {plan.predicted_iteration_ms:,.1f} ms")


def _log_replan(world: World, plan: Plan, cache_dir: str, log: Log) -> None:
    """Under torchrun, record this attempt's plan for the run (``runs/RUN_ID.json`` in the profile cache);
    on a later attempt log why it re-planned and the old and the new plan side by side."""
    import collections
    import re

    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return
    devices = dict(collections.Counter(r.device_type for r in world.ranks))
    path = os.path.join(cache_dir, "runs", re.sub(r"[^A-Za-z0-9_.-]", "_", run_id) + ".json")
    try:
        previous = elastic.record_plan(path, {"line": _plan_line(plan), "hash": plan.plan_hash()}, devices)
    except OSError as exc:
        log.job_line(f"warning: this attempt's plan not recorded in {path} ({exc.strerror or type(exc).__name__})")
        return
    if previous is None:
        return
    change = elastic.fleet_change(previous["devices"], devices)
    same = previous["plan"].get("hash") == plan.plan_hash()
    log.job_line(f"re-planned for attempt {previous.get('sequence', 0) + 1} of this run ({change}; "
                 f"{sum(previous['devices'].values())} -> {sum(devices.values())} devices): "
                 + ("the same plan" if same else "a new plan"))
    log.job_line(f"  before: {previous['plan'].get('line', '?')}")
    log.job_line(f"  now:    {_plan_line(plan)}")


def _apply_and_run(job: _Job, phases: Phases, world: World, devices: _Devices, plan: Plan, log: Log,
                   adaptor: _Adaptor | None = None) -> int | None:
    """Rewrite the flags, patch, renumber the ranks, then run the script in this process."""
    import torch.distributed as dist

    from poseidon_plugin.plan import render_table
    from poseidon_plugin.runtime import apply, job_flags, mindspeed, placement
    from poseidon_plugin.runtime.watch import Watch

    opts, style, device = job.opts, job.style, devices.device
    rewritten = phases.run("apply", lambda: apply.rewrite_args(plan, style, job.global_batch, job.script_args))
    new_args = rewritten.args
    for note in rewritten.notes:
        log.job_line(f"flag style {style}: {note}")
    log.job_line(render_table(plan, runtime=None if opts.plan else job.target.describe(plan)))
    recompute = recompute_note(_job_model(job))
    if recompute:
        log.job_line(recompute)
    log.job_line("command: " + job_flags.command_line(job.script, new_args))
    if job.rank == 0:
        _warn_vocab_padding(job, plan, log)
    if job.rank == 0 and opts.save_plan:
        plan.save(opts.save_plan)
        log.job_line(f"plan saved to {opts.save_plan}")
    if opts.dry_run:
        log.job_line("dry run: stopping before training")
        log.job_line("overhead: " + phases.summary())
        phases.liveness.stop()
        dist.destroy_process_group()
        return None

    tables = apply.layer_patches(plan, style)
    if adaptor is None:
        for table in tables:
            phases.run("apply", table.apply)
    else:
        # MindSpeed re-chooses its patches for the planned argv first: its apply_patch would overwrite ours.
        if adaptor.module is not None:
            phases.run("apply", lambda: mindspeed.repatch(adaptor.host, adaptor.module, job.script, new_args,
                                                          rewritten.planned))
        phases.run("apply", lambda: mindspeed.apply_and_verify(tables))
    new_rank = placement.planned_ranks(plan, world).get(job.rank)
    phases.run("placement", lambda: placement.regroup(new_rank, plan.world_size, device.backend, opts.timeout))
    me = world.ranks[job.rank]
    if new_rank is None:
        return _wait_unused(job, phases, plan, me.device_type, log)
    stage = placement.stage_of(plan, new_rank)
    stamps_line = None
    if devices.emulated is not None:  # emulated links and DP sync need the plan's placement
        devices.emulated.bind_plan(plan, new_rank, _job_model(job))
        stamps_line = phases.run("placement", lambda: _share_stamps(plan, world, new_rank, device))
    log.rank_line(f"now global rank {new_rank}: pipeline stage {stage} on {plan.stages[stage].device_type}")
    log = Log(job.rank, leader=new_rank == 0)  # job-wide lines now come from the planned rank 0
    if stamps_line:
        log.job_line(f"emulation: {stamps_line}")
    watch = Watch(plan=plan, global_rank=new_rank, stage=stage, device=device, iterations=opts.watch_iterations,
                  log=log.rank_line, log_rank0=log.job_line)
    if opts.watch_iterations:
        phases.run("hand-over", watch.install)
    log.job_line("overhead: " + phases.summary())
    # From here on, failures are the training script's, and torchrun reports them; the heartbeat goes on
    # so that ranks the plan leaves unused can tell a finished job from a lost rank.
    def lost_in_training(gone: list[str]) -> None:  # a peer that left (e.g. its agent killed): restart now
        log.error(f"lost {'; '.join(gone)}, during training; leaving so that torchrun restarts the job "
                  f"(--max-restarts) or ends it")
        _exit(1)

    phases.liveness.guard(lost_in_training, silent_s=opts.timeout, ranks=placement.planned_ranks(plan, world))
    try:
        new_args = device.prepare_training(job.script, new_args, is_module=job.is_module, log=log.job_line)
        code = _run_script(job, new_args)
        phases.liveness.mark_finished()
    finally:
        phases.liveness.stop()
    if opts.watch_iterations and len(watch.measured_ms) < opts.watch_iterations:
        watch.summarize()
    elastic.mark_done(phases.store, planned=True)
    _wait_as_store_host(job, phases, log)
    return code


def _warn_vocab_padding(job: _Job, plan: Plan, log: Log) -> None:
    """A resume (``--load``) whose plan pads the vocabulary to other rows than its checkpoint holds: one line
    (``elastic.vocab_padding_warning``). Only where the tokens are known from the flags (``--vocab-size`` with
    the NullTokenizer; Megatron-LM's adds an end-of-document token); the script's own load reports the rest."""
    from poseidon_plugin.runtime import job_flags

    values = job_flags.flag_values(job.script_args)
    step, divisible = values.get("--ckpt-step", ""), values.get("--make-vocab-size-divisible-by", "")
    if not values.get("--load") or not job.flags.vocab_size_given or (step and not step.isdigit()):
        return
    megatron_lm = job_flags.uses_megatron_training(job.script, job.is_module)
    if values.get("--tokenizer-type", "GPT2BPETokenizer" if megatron_lm else "NullTokenizer") != "NullTokenizer":
        return
    folder = elastic.checkpoint_folder(values["--load"], int(step) if step else None)
    try:
        rows = elastic.checkpoint_vocab_rows(folder) if folder is not None else None
    except Exception:  # noqa: BLE001  (a checkpoint the script cannot read either: its load says why)
        rows = None
    if rows is None:
        return
    line = elastic.vocab_padding_warning(
        load=values["--load"], checkpoint_rows=rows, tokens=job.flags.vocab_size + (1 if megatron_lm else 0),
        tp=plan.tp, divisible_by=int(divisible) if divisible.isdigit() and int(divisible) > 0
        else elastic.VOCAB_DIVISIBLE_BY)
    if line:
        log.job_line(line)


def _share_stamps(plan: Plan, world: World, new_rank: int, device: Device) -> str:
    """One stamp file for the emulated links of every planned rank on this host, across agents."""
    import torch.distributed as dist

    from poseidon_plugin.runtime import placement
    from poseidon_plugin.runtime.collectives import all_gather_json
    from poseidon_plugin.runtime.devices import share_stamps

    hosts = {world.ranks[rank].host for rank in placement.planned_ranks(plan, world)}
    return share_stamps(dist.distributed_c10d._get_default_store(), new_rank, plan.world_size,
                        one_host=len(hosts) == 1, agree=lambda ok: all(all_gather_json(ok, device.torch_device)))


def _wait_unused(job: _Job, phases: Phases, plan: Plan, device_type: str, log: Log) -> None:
    """A rank the plan does not use stays until the planned ranks finish: its agent would otherwise enter
    torchrun's exit barrier, time out and leave with the rendezvous store (runtime/elastic.py)."""
    log.rank_line(f"{device_type} device is not used by the plan; waiting for the job to end")

    def stopped(signum, frame) -> None:  # a restart or the job's failure: torchrun stops this rank
        log.rank_line("unused by the plan; stopped by the launcher")
        _exit(0)

    signal.signal(signal.SIGTERM, stopped)
    # a planned rank is lost as the training guard sees it (gone, or silent for --poseidon-timeout): one that
    # stalls for a few seconds (a checkpoint save, a stopped process) is not, or this rank would end the job
    why = elastic.wait_for_job(phases.store, plan.world_size,
                               lambda: phases.liveness.lost(silent_s=job.opts.timeout) if phases.liveness else [])
    phases.liveness.stop()
    if why is not None:
        log.error(f"stopped waiting for the job (unused by the plan): {why}")
        _exit(1)
    elastic.mark_done(phases.store, planned=False)
    _wait_as_store_host(job, phases, log)
    log.rank_line("the job has ended; leaving")
    return None


def _wait_as_store_host(job: _Job, phases: Phases, log: Log) -> None:
    """The process hosting the workers' store (a fresh one per round) stays until every rank is done."""
    if elastic.hosts_store(job.rank) and not elastic.wait_for_everyone(phases.store, job.world_size,
                                                                        job.opts.timeout):
        log.rank_line("warning: not every rank finished within --poseidon-timeout; this rank hosts the "
                      "job's store and leaves now")


def _run_script(job: _Job, args: list[str]) -> int | None:
    """The user's script as ``__main__`` in this process, with the rewritten argv; its exit code."""
    sys.argv = [job.script, *args]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if job.is_module:
            runpy.run_module(job.script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(job.script)))
            runpy.run_path(job.script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return exc.code if isinstance(exc.code, int) else 1
    return None


def _links_line(probe: dict) -> str:
    parts = [f"{name} {m['bandwidth_gbps']:.2f} Gbps / {m['latency_us']:.0f} us (ranks {m['pair'][0]}-{m['pair'][1]})"
             for name, m in probe["links"].items()]
    return "links: " + ("; ".join(parts) or "none to probe") + f"; all-reduce bus {probe['allreduce_gbps']:.2f} Gbps"


if __name__ == "__main__":
    main()
