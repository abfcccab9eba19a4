"""From the job and the world to one plan that every rank holds: cost model, search, agreement.

Rank 0 alone searches (the search is deterministic but a single source removes any doubt); the plan
crosses to the other ranks as JSON and every rank compares its SHA-256 (``Plan.plan_hash``) with rank 0's.
The search is called in exactly one place, :func:`plan_on_rank0`. The job's specs come from the torch-free
``runtime/job_spec.py``, the checks that a plan fits the job from ``runtime/precheck.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from poseidon_plugin.costmodel import CostModel
from poseidon_plugin.errors import NoFeasiblePlanError, PoseidonError
from poseidon_plugin.plan import Plan
from poseidon_plugin.runtime.collectives import PhaseFailed, all_gather_json, broadcast_json
from poseidon_plugin.runtime.job_flags import JobFlags
from poseidon_plugin.target import TargetRuntime, search_plan


def plan_on_rank0(cost_model: CostModel, target: TargetRuntime, *, keep: JobFlags | None,
                  time_limit_s: float, workers: int = 0) -> Plan:
    """The one call into the search: best plan for the cost model on the target runtime (NoFeasiblePlanError
    when none fits); the same function ``poseidon plan`` calls (``poseidon_plugin.target.search_plan``).

    ``keep`` (``--poseidon-keep``) pins TP, PP, mbs and (MoE) EP to the job's: only placement, layer split, DP,
    schedule, p2p overlap and the expert TP are searched. ``time_limit_s`` keeps the search shorter than the other ranks'
    wait for it. ``workers`` (``--poseidon-search-workers``): the processes it may walk a large tree with; 0: the
    cores this process may run on (``search.shared_walk.auto_workers``).
    """
    from poseidon_plugin.search import SearchOptions
    from poseidon_plugin.search.shared_walk import auto_workers

    workers = workers or auto_workers()
    if keep is None:
        return search_plan(cost_model, target, SearchOptions(time_limit_s=time_limit_s, workers=workers)).plan
    options = SearchOptions(time_limit_s=time_limit_s, workers=workers, tp_degrees=(keep.tensor_parallel,),
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
