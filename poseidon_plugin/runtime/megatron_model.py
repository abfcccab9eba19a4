"""Build megatron-core objects from the job's flags: TransformerConfig, layer spec, GPTModel.

The profiler and ``scripts/pretrain_gpt.py`` both build through here, so the layer Poseidon times is
the layer the training runs (same config, same local spec, same dtype). Jobs that bring their own Megatron-LM
``pretrain_gpt.py`` get the same shape from the same flags (``job_flags.JobFlags``); features outside
that set (TE spec, MLA, fused kernels) are not reproduced by the profiler (docs/RUNTIME.md).

One builder for every megatron-core Poseidon meets: 0.13+ (the layout flag, ``GPTModel(vp_stage=,
pg_collection=)``, ``ProcessGroupCollection``) and 0.12.x, the core MindSpeed-LLM pins, which has none of
them and reads every group and the virtual-stage rank from ``parallel_state``. Differences are found by
looking at the installed signatures and attributes (:func:`core_features`), never at version strings, so
a backport or a patched core is handled by what it actually offers:

    groups = process_groups(tp=tp_group, pp=solo, cp=solo)   # ProcessGroupCollection or a namespace
    with parallel_state_for(groups):                         # 0.12: the only way groups reach the model
        model = gpt_model(job, config, pre_process=True, post_process=True, pg_collection=groups)
        loss = model(tokens, positions, None, labels=labels)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime.job_flags import JobFlags

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CoreFeatures:
    """What the installed megatron-core offers, found by inspection."""

    gpt_vp_stage: bool
    """``GPTModel(vp_stage=...)`` (else the virtual rank is read from ``parallel_state``)."""
    gpt_pg_collection: bool
    """``GPTModel(pg_collection=...)`` (else every group is read from ``parallel_state``)."""
    process_group_collection: bool
    """``megatron.core.process_groups_config.ProcessGroupCollection`` exists."""
    layout: bool
    """``TransformerConfig.pipeline_model_parallel_layout`` (``--pipeline-model-parallel-layout``)."""
    stage_query_vp_stage: bool
    """``parallel_state.is_pipeline_first_stage(..., vp_stage=...)``."""


@functools.cache
def core_features() -> CoreFeatures:
    """The installed megatron-core's features (cached: the stack does not change within a process)."""
    gpt = inspect.signature(GPTModel.__init__).parameters
    try:
        from megatron.core import process_groups_config
    except ImportError:
        process_groups_config = None
    return CoreFeatures(
        gpt_vp_stage="vp_stage" in gpt,
        gpt_pg_collection="pg_collection" in gpt,
        process_group_collection=hasattr(process_groups_config, "ProcessGroupCollection"),
        layout="pipeline_model_parallel_layout" in _config_fields(),
        stage_query_vp_stage="vp_stage" in inspect.signature(parallel_state.is_pipeline_first_stage).parameters,
    )


@functools.cache
def _config_fields() -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(TransformerConfig))


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
    overrides the job's (the profiler builds one layer). On CPU the fused CUDA kernels and sequence parallelism
    are off (the local spec's torch norms have no sequence-parallel form; Transformer Engine's have) and
    weights are initialised on the host, as megatron-core needs there. The job's own keys that the installed
    TransformerConfig lacks are left out (older cores default them); a ``layout`` or an override it lacks is
    an error, because dropping it would silently change the split or the schedule.
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
        sequence_parallel=job.sequence_parallel and tensor_parallel > 1 and not on_cpu,
        recompute_granularity=None if job.recompute == "none" else job.recompute,
        recompute_method=job.recompute_method or None,
        recompute_num_layers=job.recompute_num_layers or None,
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
        values.update(num_moe_experts=job.num_experts, moe_router_topk=job.moe_router_topk,
                      moe_ffn_hidden_size=job.moe_ffn_hidden_size or job.ffn_hidden_size)
        if job.moe_shared_expert_size:
            values["moe_shared_expert_intermediate_size"] = job.moe_shared_expert_size
        if job.moe_capacity_factor:
            values.update(moe_expert_capacity_factor=job.moe_capacity_factor,
                          moe_pad_expert_input_to_capacity=job.moe_pad_to_capacity)
    known = _config_fields()
    explicit = dict(overrides)
    if layout is not None:
        explicit["pipeline_model_parallel_layout"] = layout
    missing = sorted(key for key, value in explicit.items() if key not in known and value is not None)
    if missing:
        raise PoseidonError(
            f"the installed megatron-core's TransformerConfig has no {', '.join(missing)}; "
            + ("an uneven split on this core needs --poseidon-flag-style mindspeed or patch (a layer patch "
               "table instead of --pipeline-model-parallel-layout)" if "pipeline_model_parallel_layout" in missing
               else "drop it or use a megatron-core that has it")
        )
    values.update(explicit)
    return TransformerConfig(**{key: value for key, value in values.items() if key in known})


def layer_spec(job: JobFlags) -> Any:
    """The transformer-layer ModuleSpec (megatron-core's local spec: no Transformer Engine needed)."""
    kwargs: dict[str, Any] = {"num_experts": job.num_experts or None}
    if "normalization" in inspect.signature(get_gpt_layer_local_spec).parameters:
        kwargs["normalization"] = job.normalization
    return get_gpt_layer_local_spec(**kwargs)


def gpt_model(
    job: JobFlags,
    config: TransformerConfig,
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    pg_collection: Any = None,
    vocab_divisible_by: int = 128,
) -> GPTModel:
    """A GPTModel chunk for this rank (its vocabulary padded to a multiple of ``vocab_divisible_by`` x TP).

    Groups: ``pg_collection`` where GPTModel takes it; elsewhere the caller must hold
    :func:`parallel_state_for` ``(pg_collection)`` around building *and* running the model (checked), or
    pass None after ``parallel_state.initialize_model_parallel``. ``vp_stage``: passed where GPTModel takes
    it; elsewhere set as parallel_state's virtual rank while the chunk is built (layer numbers are decided
    then) and restored afterwards.
    """
    features = core_features()
    kwargs: dict[str, Any] = dict(
        config=config,
        transformer_layer_spec=layer_spec(job),
        vocab_size=padded_vocab_size(job, config.tensor_model_parallel_size, vocab_divisible_by),
        max_sequence_length=job.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not job.untie_embeddings,
        position_embedding_type=job.position_embedding_type,
    )
    if pg_collection is not None:
        if features.gpt_pg_collection:
            kwargs["pg_collection"] = pg_collection
        elif parallel_state._TENSOR_MODEL_PARALLEL_GROUP is not pg_collection.tp:
            raise RuntimeError("this megatron-core's GPTModel takes no pg_collection: build and run the model "
                               "inside megatron_model.parallel_state_for(groups)")
    if features.gpt_vp_stage:
        model = GPTModel(**kwargs, vp_stage=vp_stage)
    else:
        with _virtual_rank(vp_stage):
            model = GPTModel(**kwargs)
    # As Megatron-LM's Float16Module: every parameter and buffer in the job's dtype (the local spec's torch
    # norms are created in fp32 whatever params_dtype says, and fp32 norm outputs meet bf16 weights)
    return model if config.params_dtype == torch.float32 else model.to(config.params_dtype)


def stage_position(vp_stage: int | None = None) -> tuple[bool, bool]:
    """``(pre_process, post_process)`` of this rank's chunk ``vp_stage`` (after initialize_model_parallel)."""
    if core_features().stage_query_vp_stage:
        return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
    with _virtual_rank(vp_stage):
        return (parallel_state.is_pipeline_first_stage(ignore_virtual=False),
                parallel_state.is_pipeline_last_stage(ignore_virtual=False))


@contextlib.contextmanager
def _virtual_rank(vp_stage: int | None) -> Iterator[None]:
    if vp_stage is None:
        yield
        return
    saved = parallel_state.get_virtual_pipeline_model_parallel_rank()
    parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(saved)


def process_groups(*, tp: Any, pp: Any, cp: Any) -> Any:
    """Model groups for a one-stage model (profiling): a ProcessGroupCollection where the core has one,
    else a namespace with the same fields (0.12 reads them through :func:`parallel_state_for`)."""
    if core_features().process_group_collection:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection()
    else:
        groups = types.SimpleNamespace()
    groups.tp, groups.pp, groups.cp = tp, pp, cp
    groups.embd = groups.pos_embd = None
    # MoE layers read their groups here too: a profiled layer runs its experts on its TP group (EP 1, one
    # replica), as the plan's profile assumes (patches/profiling.py: the same for parallel_state); the
    # profiler's EP > 1 measurement sets its own EP groups over these (profiler._profiling_groups)
    groups.ep = groups.expt_dp = groups.dp = pp
    groups.expt_tp = groups.tp_ep = groups.tp_cp = groups.tp_dp_cp = tp
    return groups


@contextlib.contextmanager
def parallel_state_for(groups: Any) -> Iterator[None]:
    """Point parallel_state at ``groups`` (TP, PP, CP and the expert groups) and give it a global memory
    buffer, for the duration: the patch table ``patches/profiling.py``, applied, verified, reverted on exit.

    Needed on every core for the vocab-parallel loss (it reads the TP group from parallel_state) and, on
    cores whose GPTModel takes no ``pg_collection``, for everything else the model reads there.
    """
    from poseidon_plugin.patches import profiling

    patched = profiling.table(groups)
    patched.apply()
    try:
        yield
    finally:
        patched.revert()


def padded_vocab_size(job: JobFlags, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by x TP`` (so every TP shard is equal)."""
    multiple = divisible_by * tensor_parallel
    return -(-job.vocab_size // multiple) * multiple
