"""The training script's Megatron flags: read the job (model shape, batch, parallelism) and rewrite them.

Torch-free. Poseidon never asks the user to describe the model twice: the flags they already pass to
Megatron-LM's ``pretrain_gpt.py`` (or MindSpeed-LLM's) *are* the job description. After planning, the
parallelism flags are replaced by the plan's and everything else is passed through untouched, in order.

Flag names are Megatron-LM's (``megatron/training/arguments.py``); the command line is read with
``poseidon_plugin.argv``'s rules (``--flag value``, ``--flag=value``, switches), as argparse does.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from poseidon_plugin import argv
from poseidon_plugin.errors import PoseidonError

# Parallelism / layer-split flags the plan decides. Each takes one value unless listed in _SWITCHES.
# Older spellings are included so that a stale flag cannot contradict the plan.
PLANNED_FLAGS: tuple[str, ...] = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--pipeline-model-parallel-layout",
    "--micro-batch-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--virtual-pipeline-model-parallel-size",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--pipeline-model-parallel-split-rank",
    "--num-layer-list",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--standalone-embedding-stage",
    "--no-overlap-p2p-communication",  # the plan decides p2p overlap for interleaved (poseidon_plugin/target.py)
    "--expert-model-parallel-size",    # MoE: the plan's expert layout (plan.expert_args)
    "--expert-tensor-parallel-size",
)
_SWITCHES = frozenset(
    {
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        "--standalone-embedding-stage",
        "--no-overlap-p2p-communication",
        "--group-query-attention",
        "--swiglu",
        "--bf16",
        "--fp16",
        "--use-distributed-optimizer",
        "--untie-embeddings-and-output-weights",
        "--sequence-parallel",
        "--disable-bias-linear",
        "--use-cpu-initialization",
        "--moe-grouped-gemm",
        "--moe-pad-expert-input-to-capacity",
        "--recompute-activations",
    }
)
# Without these, there is no transformer layer to profile and no model to plan.
REQUIRED_FLAGS: tuple[str, ...] = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length")
DEFAULT_VOCAB_SIZE = 32000


@dataclass(frozen=True, kw_only=True, slots=True)
class JobFlags:
    """What the job's Megatron flags say about the model, the batch and the user's own parallelism."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """KV groups (``--num-query-groups`` with ``--group-query-attention``, else the head count)."""
    ffn_hidden_size: int
    """``--ffn-hidden-size``, or Megatron's default (4h, or the SwiGLU 8h/3 rounded down to 64)."""
    seq_length: int
    vocab_size: int
    """``--vocab-size`` (before padding); :data:`DEFAULT_VOCAB_SIZE` when the tokenizer decides it."""
    vocab_size_given: bool
    micro_batch_size: int
    global_batch_size: int | None
    """None when the user left it to Megatron (then it is mbs x the user's DP; see :func:`effective_global_batch`)."""
    tensor_parallel: int
    pipeline_parallel: int
    dtype: str
    """``bf16``, ``fp16`` or ``fp32``."""
    swiglu: bool
    distributed_optimizer: bool
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    """``--moe-ffn-hidden-size`` (0: not given, Megatron's default ``--ffn-hidden-size``)."""
    moe_shared_expert_size: int
    """``--moe-shared-expert-intermediate-size`` (0: no shared experts)."""
    moe_capacity_factor: float
    """``--moe-expert-capacity-factor`` (0: not given, dropless)."""
    moe_pad_to_capacity: bool
    expert_parallel: int
    """The user's ``--expert-model-parallel-size`` (the plan replaces it; ``--poseidon-keep`` keeps it)."""
    untie_embeddings: bool
    sequence_parallel: bool
    train_iters: int | None
    normalization: str
    """``LayerNorm`` or ``RMSNorm``."""
    position_embedding_type: str
    """``learned_absolute`` or ``rope``."""
    max_position_embeddings: int
    add_bias_linear: bool
    hidden_dropout: float
    attention_dropout: float
    overlap_p2p_comm: bool
    """Megatron-LM's ``overlap_p2p_comm`` (on unless ``--no-overlap-p2p-communication``); off pins the plan's."""
    clip_grad: float = 1.0
    """``--clip-grad``: the gradient-norm clipping threshold (Megatron-LM's default 1.0; 0 turns it off)."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: the local experts' GEMMs as one grouped GEMM (MoE jobs only)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``selective`` (``--recompute-activations`` or
    ``--recompute-granularity selective``) or ``full``."""
    recompute_method: str = ""
    """``--recompute-method`` (``uniform`` or ``block``; full recomputation only)."""
    recompute_num_layers: int = 0
    """``--recompute-num-layers`` (full recomputation only)."""


def flag_values(args: Sequence[str]) -> dict[str, str]:
    """``{flag: value}`` for every ``--flag`` in ``args`` (switches map to ``""``; the last occurrence wins)."""
    return argv.flag_values(args, _SWITCHES)


def read_job(script: str, args: Sequence[str]) -> JobFlags:
    """Read the job from the training script's arguments; PoseidonError if they are not Megatron-shaped."""
    values = flag_values(args)
    missing = [flag for flag in REQUIRED_FLAGS if flag not in values]
    if missing:
        raise PoseidonError(
            f"{script} is not Megatron-shaped: its arguments lack {', '.join(missing)}; poseidon-run reads the "
            f"model from Megatron-LM's flags (e.g. --num-layers 8 --hidden-size 256 --num-attention-heads 8 "
            f"--seq-length 128); add them, or set POSEIDON_DISABLE=1 to run the script with plain torchrun"
        )

    def integer(flag: str, default: int | None = None, minimum: int = 1) -> int | None:
        if flag not in values:
            return default
        raw = values[flag]
        try:
            number = int(raw)
        except ValueError:
            raise PoseidonError(f"{flag} {raw!r} is not an integer (in the arguments of {script})") from None
        if number < minimum:
            raise PoseidonError(f"{flag} {number} must be >= {minimum} (in the arguments of {script})")
        return number

    hidden = integer("--hidden-size")
    heads = integer("--num-attention-heads")
    swiglu = "--swiglu" in values
    if hidden % heads:
        raise PoseidonError(f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}")
    groups = integer("--num-query-groups", heads) if "--group-query-attention" in values else heads
    if heads % groups:
        raise PoseidonError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden

    def choice(flag: str, default: str, allowed: tuple[str, ...]) -> str:
        value = values.get(flag, default)
        if value not in allowed:
            raise PoseidonError(f"{flag} {value!r} is not supported; use one of {', '.join(allowed)}")
        return value

    def number(flag: str, default: float, valid: Callable[[float], bool], rule: str) -> float:
        raw = values.get(flag)
        try:
            value = default if raw is None else float(raw)
        except ValueError:
            raise PoseidonError(f"{flag} {raw!r} is not a number (in the arguments of {script})") from None
        if not valid(value):
            raise PoseidonError(f"{flag} {value:g} must be {rule} (in the arguments of {script})")
        return value

    def fraction(flag: str, default: float) -> float:
        return number(flag, default, lambda v: 0.0 <= v < 1.0, "in [0, 1)")

    num_experts = integer("--num-experts", 0, minimum=0)
    capacity = 0.0
    if num_experts:
        if values.get("--moe-layer-freq", "1") != "1":
            raise PoseidonError(f"--moe-layer-freq {values['--moe-layer-freq']!r} is not supported: Poseidon prices "
                                "every layer alike, so every layer must be an MoE layer; drop --moe-layer-freq")
        raw = values.get("--moe-expert-capacity-factor")
        try:
            capacity = 0.0 if raw in (None, "None") else float(raw)
        except ValueError:
            raise PoseidonError(f"--moe-expert-capacity-factor {raw!r} is not a number") from None
        if not 0.0 <= capacity <= 1024.0:
            raise PoseidonError(f"--moe-expert-capacity-factor {raw} must be in (0, 1024]")
        if "--moe-pad-expert-input-to-capacity" in values and not capacity:
            raise PoseidonError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    seq_length = integer("--seq-length")
    dtype = "bf16" if "--bf16" in values else "fp16" if "--fp16" in values else "fp32"
    recompute, method, recompute_layers = _recompute(values, integer)
    return JobFlags(
        num_layers=integer("--num-layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=integer("--ffn-hidden-size", default_ffn or 4 * hidden),
        seq_length=seq_length,
        vocab_size=integer("--vocab-size", DEFAULT_VOCAB_SIZE),
        vocab_size_given="--vocab-size" in values,
        micro_batch_size=integer("--micro-batch-size", 1),
        global_batch_size=integer("--global-batch-size"),
        tensor_parallel=integer("--tensor-model-parallel-size", 1),
        pipeline_parallel=integer("--pipeline-model-parallel-size", 1),
        dtype=dtype,
        swiglu=swiglu,
        distributed_optimizer="--use-distributed-optimizer" in values,
        num_experts=num_experts,
        moe_router_topk=integer("--moe-router-topk", 2),
        moe_ffn_hidden_size=integer("--moe-ffn-hidden-size", 0) if num_experts else 0,
        moe_shared_expert_size=integer("--moe-shared-expert-intermediate-size", 0) if num_experts else 0,
        moe_capacity_factor=capacity,
        moe_pad_to_capacity=num_experts > 0 and "--moe-pad-expert-input-to-capacity" in values,
        expert_parallel=integer("--expert-model-parallel-size", 1),
        untie_embeddings="--untie-embeddings-and-output-weights" in values,
        sequence_parallel="--sequence-parallel" in values,
        train_iters=integer("--train-iters"),
        normalization=choice("--normalization", "LayerNorm", ("LayerNorm", "RMSNorm")),
        position_embedding_type=choice("--position-embedding-type", "learned_absolute", ("learned_absolute", "rope")),
        max_position_embeddings=integer("--max-position-embeddings", seq_length),
        add_bias_linear="--disable-bias-linear" not in values,
        hidden_dropout=fraction("--hidden-dropout", 0.1),
        attention_dropout=fraction("--attention-dropout", 0.1),
        overlap_p2p_comm="--no-overlap-p2p-communication" not in values,
        clip_grad=number("--clip-grad", 1.0, lambda v: 0.0 <= v < float("inf"), "a finite number >= 0"),
        moe_grouped_gemm=num_experts > 0 and "--moe-grouped-gemm" in values,
        recompute=recompute,
        recompute_method=method,
        recompute_num_layers=recompute_layers,
    )


def _recompute(values: dict[str, str], integer: Callable[..., int | None]) -> tuple[str, str, int]:
    """``(recompute, method, num_layers)`` from Megatron-LM's recomputation flags, with its own rules
    (``megatron/training/arguments.py``, ``TransformerConfig``): PoseidonError naming the flag otherwise."""
    granularity = values.get("--recompute-granularity")
    if "--recompute-activations" in values:   # Megatron-LM sets --recompute-granularity selective for it
        granularity = "selective"
    method = values.get("--recompute-method")
    layers = integer("--recompute-num-layers", 0)
    if granularity is None:   # a method or a layer count alone recomputes nothing in Megatron either
        return "none", "", 0
    if granularity == "selective":
        if method is not None or layers:
            raise PoseidonError("--recompute-method and --recompute-num-layers are for --recompute-granularity "
                                "full (Megatron-LM refuses them with selective recomputation); drop them")
        return "selective", "", 0
    if granularity != "full":
        raise PoseidonError(f"--recompute-granularity {granularity!r} is not supported; use full or selective")
    if method not in ("uniform", "block") or not layers:
        raise PoseidonError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                            "--recompute-num-layers N, as Megatron-LM does; e.g. --recompute-method uniform "
                            "--recompute-num-layers 1")
    return "full", method, layers


def effective_global_batch(job: JobFlags, world_size: int) -> int:
    """The global batch the user's job trains with: theirs, or Megatron's default mbs x DP for their TP/PP.

    Poseidon never changes it (a different plan must not change the optimisation), so it is pinned
    explicitly in the rewritten flags.
    """
    if job.global_batch_size is not None:
        return job.global_batch_size
    model_parallel = job.tensor_parallel * job.pipeline_parallel
    if world_size % model_parallel:
        raise PoseidonError(
            f"--tensor-model-parallel-size {job.tensor_parallel} x --pipeline-model-parallel-size "
            f"{job.pipeline_parallel} does not divide the world size {world_size}, so the global batch is "
            f"undefined; pass --global-batch-size"
        )
    return job.micro_batch_size * (world_size // model_parallel)


def rewrite(args: Sequence[str], planned: Sequence[str], drop: Sequence[str] = ()) -> list[str]:
    """``args`` without any :data:`PLANNED_FLAGS`, any flag of ``planned`` (e.g. ``--global-batch-size``)
    or of ``drop`` (flags a flag style refuses next to its own: ``runtime/apply.py``), followed by
    ``planned``. Every other token is kept, in order.
    """
    drop = set(PLANNED_FLAGS) | set(drop)
    drop.update(token.flag for token in argv.scan(planned, _SWITCHES))
    return argv.remove_flags(args, drop, _SWITCHES) + list(planned)


def replaced_flags(args: Sequence[str], planned: Sequence[str], drop: Sequence[str] = ()) -> list[str]:
    """One line per user flag :func:`rewrite` takes out whose value the planned command does not keep: the
    old value and the plan's, or that it was dropped (the plan decides it another way)."""
    user = flag_values(args)
    new = flag_values(planned)
    lines = []
    for flag in [f for f in user if f in set(PLANNED_FLAGS) | set(new) | set(drop)]:
        old = user[flag]
        shown = f"{flag} {old}" if old else flag
        if flag in new:
            if new[flag] != old:
                lines.append(f"{shown} replaced by the plan's {flag} {new[flag]}".rstrip())  # a switch has no value
        else:
            lines.append(f"{shown} dropped: the plan's flags decide it ({shlex.join(planned)})")
    return lines


def command_line(script: str, args: Sequence[str]) -> str:
    """A shell-quoted one-line rendering of ``script args`` (for the log)."""
    return shlex.join([script, *args])


def uses_megatron_training(script: str, is_module: bool) -> bool:
    """Whether the script's stack has ``megatron.training`` (Megatron-LM's files beside the script, or a
    megatron-core that ships them), without importing it."""
    if not is_module:
        folder = os.path.dirname(os.path.abspath(script))
        if folder not in sys.path:
            sys.path.insert(0, folder)  # where the script imports from (runpy puts it there too)
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False
