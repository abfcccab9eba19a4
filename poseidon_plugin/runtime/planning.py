"""From the job and the world to one plan that every rank holds: specs, cost model, search, agreement.

Rank 0 alone searches (the search is deterministic but a single source removes any doubt); the plan
crosses to the other ranks as JSON and every rank compares its SHA-256 (``Plan.plan_hash``) with rank 0's.
The search is called in exactly one place, :func:`plan_on_rank0`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.errors import NoFeasiblePlanError, PoseidonError
from poseidon_plugin.plan import Plan
from poseidon_plugin.runtime.collectives import PhaseFailed, all_gather_json, broadcast_json
from poseidon_plugin.runtime.inventory import World
from poseidon_plugin.runtime.job_flags import JobFlags, flag_values
from poseidon_plugin.runtime.mindspeed import MindSpeedError, data_parallel_size, user_cp_ep
from poseidon_plugin.specs import ModelSpec
from poseidon_plugin.target import TargetRuntime, search_plan


def model_spec(job: JobFlags, *, global_batch_size: int, name: str) -> ModelSpec:
    """The planner's ModelSpec of the job (``global_batch_size`` pinned: plans never change it)."""
    return ModelSpec(
        name=name,
        num_layers=job.num_layers,
        hidden_size=job.hidden_size,
        ffn_hidden_size=job.ffn_hidden_size,
        num_attention_heads=job.num_attention_heads,
        num_query_groups=job.num_query_groups,
        vocab_size=job.vocab_size,
        seq_length=job.seq_length,
        global_batch_size=global_batch_size,
        dtype=job.dtype,
        num_experts=job.num_experts,
        moe_top_k=job.moe_router_topk if job.num_experts else 0,
        moe_ffn_hidden_size=job.moe_ffn_hidden_size,
        moe_shared_expert_size=job.moe_shared_expert_size,
        moe_capacity_factor=job.moe_capacity_factor,
        moe_pad_to_capacity=job.moe_pad_to_capacity,
        moe_grouped_gemm=job.moe_grouped_gemm,
        swiglu=job.swiglu,
        tie_embeddings=not job.untie_embeddings,
        distributed_optimizer=job.distributed_optimizer,
        sequence_parallel=job.sequence_parallel,
        source="job flags",
    )


def job_name(script: str, job: JobFlags) -> str:
    """A readable model name for plans and logs: ``pretrain_gpt-8l-h64``."""
    stem = os.path.splitext(os.path.basename(script))[0] or "job"
    return f"{stem}-{job.num_layers}l-h{job.hidden_size}"


def plan_on_rank0(cost_model: CostModel, target: TargetRuntime, *, keep: JobFlags | None,
                  time_limit_s: float) -> Plan:
    """The one call into the search: best plan for the cost model on the target runtime (NoFeasiblePlanError
    when none fits); the same function ``poseidon plan`` calls (``poseidon_plugin.target.search_plan``).

    ``keep`` (``--poseidon-keep``) pins TP, PP, mbs and (MoE) EP to the job's: only placement, layer split, DP,
    schedule, p2p overlap and the expert TP are searched. ``time_limit_s`` keeps the search shorter than the other ranks'
    wait for it.
    """
    from poseidon_plugin.search import SearchOptions

    if keep is None:
        return search_plan(cost_model, target, SearchOptions(time_limit_s=time_limit_s)).plan
    options = SearchOptions(time_limit_s=time_limit_s, tp_degrees=(keep.tensor_parallel,),
                            micro_batch_sizes=(keep.micro_batch_size,), min_pipeline_stages=keep.pipeline_parallel,
                            max_pipeline_stages=keep.pipeline_parallel,
                            expert_parallel=(keep.expert_parallel,) if keep.num_experts else None)
    try:
        return search_plan(cost_model, target, options).plan
    except NoFeasiblePlanError as exc:
        raise PoseidonError(
            f"--poseidon-keep: no plan keeps --tensor-model-parallel-size {keep.tensor_parallel}, "
            f"--pipeline-model-parallel-size {keep.pipeline_parallel} and --micro-batch-size "
            f"{keep.micro_batch_size} on this cluster ({exc}); drop --poseidon-keep to let Poseidon choose"
        ) from None


def share_plan(search: Callable[[], Plan] | None, rank: int, device: torch.device) -> Plan:
    """Rank 0 runs ``search`` and broadcasts the plan, or its error, so that all ranks go on or fail together.

    Every rank validates the received plan and compares its hash with the others'.
    """
    doc: dict | None = None
    if rank == 0:
        try:
            doc = {"plan": search().to_dict()}
        except PoseidonError as exc:
            doc = {"error": str(exc), "user": True}
        except Exception as exc:  # noqa: BLE001  (every rank must learn that rank 0 failed, and why)
            doc = {"error": f"{type(exc).__name__}: {exc}", "user": False}
    doc = broadcast_json(doc, device)
    if "error" in doc:
        raise PhaseFailed(f"search failed on rank 0: {doc['error']}", user_error=doc["user"])
    received = Plan.from_dict(doc["plan"], "plan from rank 0")
    hashes = all_gather_json(received.plan_hash(), device)
    if len(set(hashes)) != 1:
        raise PoseidonError(f"ranks hold different plans (hashes {sorted(set(hashes))}); this is a bug, please report it")
    return received


def check_plan_fits(plan: Plan, world: World, job: JobFlags, global_batch_size: int, source: str, *,
                    script_args: Sequence[str] = (), emulation: str | None = None) -> None:
    """A plan (saved or searched) must match this job and this world; PoseidonError naming the mismatch.

    ``script_args`` (the user's flags) give the context parallelism the plan must fit, the plan its expert
    layout: megatron-core needs its ranks to be a multiple of both ``tp x pp x cp`` and ``etp x ep x pp``
    (``mindspeed.model_parallel_world``).
    """
    from poseidon_plugin.runtime.precheck import check_plan_job

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
