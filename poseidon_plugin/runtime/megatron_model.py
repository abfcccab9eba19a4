"""Build megatron-core objects from the job's flags: TransformerConfig, layer spec, GPTModel.

The profiler and ``scripts/pretrain_gpt.py`` both build through here, so the layer Poseidon times is
the layer the training runs (same config, same local spec, same dtype). Jobs that bring their own Megatron-LM
``pretrain_gpt.py`` get the same shape from the same flags (``job_flags.JobFlags``); features outside
that set (TE spec, MLA, fused kernels) are not reproduced by the profiler (docs/RUNTIME.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from poseidon_plugin.runtime.job_flags import JobFlags

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(job: JobFlags) -> torch.dtype:
    """The parameter / activation dtype of the job."""
    return _DTYPES[job.dtype]


def transformer_config(
    job: JobFlags,
    *,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    layout: str | None = None,
    num_layers: int | None = None,
    on_cpu: bool,
    **overrides: Any,
) -> TransformerConfig:
    """TransformerConfig of the job for the given parallelism.

    ``layout`` is a ``--pipeline-model-parallel-layout`` string (uneven / virtual stages); ``num_layers``
    overrides the job's (the profiler builds one layer). On CPU the fused CUDA kernels are off and weights
    are initialised on the host, as megatron-core needs there. Keys the installed TransformerConfig does
    not have are left out, so older megatron-core versions accept the same call.
    """
    values: dict[str, Any] = dict(
        num_layers=job.num_layers if num_layers is None else num_layers,
        hidden_size=job.hidden_size,
        ffn_hidden_size=job.ffn_hidden_size,
        num_attention_heads=job.num_attention_heads,
        num_query_groups=job.num_query_groups,
        normalization=job.normalization,
        gated_linear_unit=job.swiglu,
        activation_func=torch.nn.functional.silu if job.swiglu else torch.nn.functional.gelu,
        add_bias_linear=job.add_bias_linear,
        hidden_dropout=job.hidden_dropout,
        attention_dropout=job.attention_dropout,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=job.sequence_parallel and tensor_parallel > 1,
        bf16=job.dtype == "bf16",
        fp16=job.dtype == "fp16",
        params_dtype=torch_dtype(job),
        pipeline_dtype=torch_dtype(job),
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if job.num_experts:
        values.update(num_moe_experts=job.num_experts, moe_router_topk=job.moe_router_topk)
    if layout is not None:
        values["pipeline_model_parallel_layout"] = layout
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    values.update(overrides)
    return TransformerConfig(**{key: value for key, value in values.items() if key in known})


def layer_spec(job: JobFlags) -> Any:
    """The transformer-layer ModuleSpec (megatron-core's local spec: no Transformer Engine needed)."""
    return get_gpt_layer_local_spec(
        num_experts=job.num_experts or None, normalization=job.normalization
    )


def gpt_model(
    job: JobFlags,
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    pg_collection: Any = None,
) -> GPTModel:
    """A GPTModel chunk for this rank (parallel_state set up first, or explicit ``pg_collection`` groups)."""
    extra = {} if pg_collection is None else {"pg_collection": pg_collection}
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(job),
        vocab_size=padded_vocab_size(job, config.tensor_model_parallel_size),
        max_sequence_length=job.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not job.untie_embeddings,
        position_embedding_type=job.position_embedding_type,
        vp_stage=vp_stage,
        **extra,
    )


def padded_vocab_size(job: JobFlags, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by x TP`` (so every TP shard is equal)."""
    multiple = divisible_by * tensor_parallel
    return -(-job.vocab_size // multiple) * multiple
