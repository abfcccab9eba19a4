"""The job-to-spec mapping: the planner's ModelSpec of the job that runs, from its Megatron flags.

Torch-free (neither torch nor Megatron is imported), so the before-launch check (``runtime/precheck.py``)
runs in the launcher process without them; the ranks plan with the same mapping (``runtime/bootstrap.py``).
"""

from __future__ import annotations

import os

from poseidon_plugin.runtime.job_flags import JobFlags
from poseidon_plugin.specs import ModelSpec


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
        recompute=job.recompute,
        recompute_method=job.recompute_method,
        recompute_num_layers=job.recompute_num_layers,
        source="job flags",
    )


def job_name(script: str, job: JobFlags) -> str:
    """A readable model name for plans and logs: ``pretrain_gpt-8l-h64``."""
    stem = os.path.splitext(os.path.basename(script))[0] or "job"
    return f"{stem}-{job.num_layers}l-h{job.hidden_size}"
