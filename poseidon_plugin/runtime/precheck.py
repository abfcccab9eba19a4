"""Checks made before torchrun starts, so that a mistake costs one line and no start-up.

``poseidon-run`` runs :func:`check_launch` in the launcher process, before any rank exists: declared
devices (``--poseidon-emulate`` / ``--poseidon-cluster``) against the world size, a saved plan
(``--poseidon-plan``) against the job's flags, what it was priced for and, when the devices are declared,
the device types it puts each stage on; candidate micro-batch sizes against the global batch; and the
paths Poseidon will write. The ranks repeat the plan checks against the live world
(:func:`check_plan_fits`), which the launcher cannot see when the devices are detected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.fingerprint import describe_mismatch, emulation_mismatches, model_mismatches
from poseidon_plugin.plan import Plan
from poseidon_plugin.runtime.job_flags import JobFlags, flag_values
from poseidon_plugin.runtime.job_spec import model_spec
from poseidon_plugin.runtime.mindspeed import MindSpeedError, data_parallel_size, user_cp_ep
from poseidon_plugin.runtime.options import RuntimeOptions
from poseidon_plugin.runtime.world import RankInfo, World, world_from_declared
from poseidon_plugin.specs import ClusterSpec


def declared_cluster(opts: RuntimeOptions, world_size: int | None) -> ClusterSpec | None:
    """The cluster ``--poseidon-cluster`` or ``--poseidon-emulate`` declares (None: detect at run time)."""
    from poseidon_plugin.emulation import harness as emulation
    from poseidon_plugin.specs import device_presets, load_cluster, parse_cluster

    if opts.emulate and opts.cluster:
        raise PoseidonError("--poseidon-emulate conflicts with --poseidon-cluster: both declare the devices; "
                            "use one (a cluster file is emulated on CPU ranks too)")
    if opts.cluster:
        cluster = load_cluster(opts.cluster)
        if world_size is not None and cluster.num_devices != world_size:
            raise PoseidonError(f"--poseidon-cluster {opts.cluster} declares {cluster.num_devices} devices but "
                                f"the launch starts {world_size} ranks; declare one device per rank")
        return cluster
    if not opts.emulate:
        return None
    nodes = emulation.parse_emulate(opts.emulate, device_presets())
    if world_size is not None:
        emulation.check_world(nodes, world_size)
    return parse_cluster({
        "name": "emulated",
        "device_types": sorted({n.device_type for n in nodes}),
        "nodes": [{"device_type": n.device_type, "count": 1, "devices_per_node": n.devices} for n in nodes],
        "links": "npu",  # placeholder: the links of an emulated cluster are measured (emulation.py)
    }, f"{emulation.FLAG} {opts.emulate}")


def check_plan_job(plan: Plan, source: str, job: JobFlags, global_batch_size: int,
                   emulation: str | None = None) -> None:
    """A saved plan must have been priced for this job: the model shape, sequence, batch and heads, and the
    emulation its profile was measured under (``emulation``: this job's tag, "" for none; None: unknown)."""
    if plan.priced_for:
        live = model_spec(job, global_batch_size=global_batch_size, name=plan.model)
        mismatches = model_mismatches(plan.priced_for, live) + emulation_mismatches(plan.priced_for, emulation)
        if mismatches:
            raise PoseidonError(describe_mismatch(source, mismatches))

    def fail(reason: str) -> PoseidonError:
        return PoseidonError(f"{source} does not match this job: {reason}; re-plan (drop --poseidon-plan) or "
                             f"fix the plan file")

    if plan.num_layers != job.num_layers:
        raise fail(f"it splits {plan.num_layers} layers but --num-layers is {job.num_layers}")
    if plan.seq_length != job.seq_length:
        raise fail(f"seq_length {plan.seq_length} but --seq-length is {job.seq_length}")
    if plan.global_batch_size != global_batch_size:
        raise fail(f"global_batch_size {plan.global_batch_size} but the job's global batch is {global_batch_size}")
    if job.num_attention_heads % plan.tp or job.num_query_groups % plan.tp:
        raise fail(f"tp {plan.tp} does not divide the {job.num_attention_heads} heads / {job.num_query_groups} "
                   f"groups")


def check_micro_batch_sizes(sizes: tuple[int, ...], global_batch_size: int) -> None:
    """Every ``--poseidon-micro-batch-sizes`` value must divide the global batch (mbs x DP x M = GBS)."""
    bad = [m for m in sizes if global_batch_size % m]
    if bad:
        divisors = [d for d in range(1, min(global_batch_size, 64) + 1) if global_batch_size % d == 0]
        raise PoseidonError(
            f"--poseidon-micro-batch-sizes {','.join(map(str, sizes))}: {', '.join(map(str, bad))} does not "
            f"divide the global batch {global_batch_size} (micro-batch size x DP x micro-batches = global batch); "
            f"use divisors of it, e.g. {','.join(map(str, divisors[:6]))}")


def check_output_paths(opts: RuntimeOptions) -> None:
    """Paths Poseidon writes must be writable as given: nothing is created behind the user's back except the
    profile cache folder itself (and its parents, when they can be made)."""
    if opts.save_plan:
        path = os.path.abspath(opts.save_plan)
        folder = os.path.dirname(path)
        if os.path.isdir(path):
            raise PoseidonError(f"--poseidon-save-plan {opts.save_plan} is a directory; give a file name, e.g. "
                                f"{os.path.join(opts.save_plan, 'plan.json')}")
        if not os.path.isdir(folder):
            raise PoseidonError(f"--poseidon-save-plan {opts.save_plan}: the folder {folder} does not exist; "
                                f"create it first or save the plan elsewhere")
        if not os.access(folder, os.W_OK):
            raise PoseidonError(f"--poseidon-save-plan {opts.save_plan}: the folder {folder} is not writable")
    if opts.profile_cache:
        path = os.path.abspath(opts.profile_cache)
        if os.path.exists(path) and not os.path.isdir(path):
            raise PoseidonError(f"--poseidon-profile-cache {opts.profile_cache} is a file, not a folder; give a "
                                f"folder (it is created if missing)")
        existing = path
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise PoseidonError(f"--poseidon-profile-cache {opts.profile_cache}: {existing} is a file, so the "
                                f"folder cannot be created; give another folder")
        if not os.access(existing, os.W_OK):
            raise PoseidonError(f"--poseidon-profile-cache {opts.profile_cache}: {existing} is not writable")


def check_launch(opts: RuntimeOptions, job: JobFlags, world_size: int | None,
                 script_args: tuple[str, ...] | list[str] = ()) -> None:
    """Everything that can be checked before torchrun starts; PoseidonError naming the flag and the fix."""
    from poseidon_plugin.runtime import job_flags

    cluster = declared_cluster(opts, world_size)
    check_output_paths(opts)
    # the job's own global batch, or Megatron's default for a known world size; unknown for elastic launches
    global_batch = job.global_batch_size
    if global_batch is None and world_size is not None:
        global_batch = job_flags.effective_global_batch(job, world_size)
    if global_batch is not None and opts.micro_batch_sizes:
        check_micro_batch_sizes(opts.micro_batch_sizes, global_batch)
    if not opts.plan:
        return
    source = f"--poseidon-plan {opts.plan}"
    plan = Plan.load(opts.plan)
    if world_size is not None and plan.world_size > world_size:
        raise PoseidonError(f"{source} needs {plan.world_size} devices (tp {plan.tp} x dp {plan.dp} x pp "
                            f"{plan.pp}) but the launch starts {world_size} ranks")
    if global_batch is not None:
        check_plan_job(plan, source, job, global_batch)
    if cluster is not None and world_size is not None:
        check_plan_fits(plan, declared_world(cluster), job, global_batch, source, script_args=script_args)


def check_plan_fits(plan: Plan, world: World, job: JobFlags, global_batch_size: int, source: str, *,
                    script_args: Sequence[str] = (), emulation: str | None = None) -> None:
    """A plan (saved or searched) must match this job and this world; PoseidonError naming the mismatch.

    ``script_args`` (the user's flags) give the context parallelism the plan must fit, the plan its expert
    layout: megatron-core needs its ranks to be a multiple of both ``tp x pp x cp`` and ``etp x ep x pp``
    (``mindspeed.model_parallel_world``).
    """
    check_plan_job(plan, source, job, global_batch_size, emulation)

    def fail(reason: str) -> PoseidonError:
        return PoseidonError(f"{source} does not match this job: {reason}; re-plan (drop --poseidon-plan) or "
                             f"fix the plan file")

    if plan.world_size > len(world.ranks):
        raise fail(f"it needs {plan.world_size} devices (tp {plan.tp} x dp {plan.dp} x pp {plan.pp}) but the job "
                   f"has {len(world.ranks)} ranks")
    cp, _ep, _etp = user_cp_ep(flag_values(script_args))
    try:
        dp = data_parallel_size(plan.world_size, plan.tp, plan.pp, cp, plan.ep, plan.etp)
    except MindSpeedError as exc:
        raise fail(f"its tp {plan.tp} x dp {plan.dp} x pp {plan.pp} = {plan.world_size} ranks: {exc}") from None
    if global_batch_size % (plan.micro_batch_size * dp):
        raise fail(f"with --context-parallel-size {cp}, megatron's data-parallel size is {dp} and the global batch "
                   f"{global_batch_size} is not a multiple of micro-batch {plan.micro_batch_size} x {dp}")
    for stage in plan.stages:
        for node, local in stage.devices:
            try:
                world.launcher_rank(node, local)
            except PoseidonError as exc:
                raise fail(f"stage {stage.index}: {exc}") from None
            if world.node_type(node) != stage.device_type:
                raise fail(f"stage {stage.index} runs on {stage.device_type} but device (node {node}, local {local}) "
                           f"here is a {world.node_type(node)}")


def declared_world(cluster: ClusterSpec):
    """The World the ranks will form on a declared cluster: launcher rank i is the cluster's device i."""
    infos = [RankInfo(rank=d.index, host="launch", local_rank=d.local, device_type=d.device_type,
                      device_kind="declared", memory_bytes=0, node_tag=f"declared-node-{d.node}")
             for d in cluster.devices()]
    return world_from_declared(cluster, infos)
