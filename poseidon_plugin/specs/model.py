"""Model + job spec: the transformer's architecture and the training job's batch settings.

One document holds both because the planner needs both together and the CLI overrides job fields
(``--global-batch-size``, ``--seq-length``) with :meth:`ModelSpec.with_overrides`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError
from .fields import (check_keys, get_bool, get_float, get_int, get_mapping, get_str, load_document_or_preset,
                     preset_names, quote)


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
"""Megatron's ``--recompute-granularity`` (``selective`` also ``--recompute-activations``), ``none`` without it."""
RECOMPUTE_METHODS = ("uniform", "block")

MODEL_LIMITS = {
    "num_layers": 4096,                 # published models: <= ~130
    "hidden_size": 1 << 20,
    "ffn_hidden_size": 1 << 22,
    "num_attention_heads": 1 << 16,
    "num_query_groups": 1 << 16,
    "vocab_size": 1 << 24,
    "seq_length": 1 << 24,              # 16M-token contexts
    "global_batch_size": 1 << 16,       # 65,536 samples; it bounds the micro-batches a plan simulates
    "num_experts": 1 << 16,
    "moe_top_k": 1 << 16,
    "moe_ffn_hidden_size": 1 << 22,
    "moe_shared_expert_size": 1 << 24,
}
"""Largest value of each integer field (docs/SPECS.md, Limits): far above real models, low enough that
the planner never sizes work or memory by an absurd number."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only (LLaMA-style) transformer and the job that trains it."""

    name: str
    num_layers: int            # transformer (decoder) layers
    hidden_size: int
    ffn_hidden_size: int       # intermediate size of the (SwiGLU) MLP; of each expert unless moe_ffn_hidden_size
    num_attention_heads: int
    num_query_groups: int      # KV heads (GQA groups); == num_attention_heads for plain MHA
    vocab_size: int
    seq_length: int            # tokens per sample
    global_batch_size: int     # samples per iteration (fixed by the user; M = GBS / (DP * mbs))
    dtype: str = "bf16"        # training dtype: bf16 | fp16 | fp32 (mixed precision with fp32 master)
    num_experts: int = 0       # MoE experts per layer; 0 = dense MLP
    moe_top_k: int = 0         # experts each token is routed to (MoE only)
    moe_ffn_hidden_size: int = 0        # intermediate size of one expert; 0 = ffn_hidden_size (Megatron's default)
    moe_shared_expert_size: int = 0     # intermediate size of the shared experts all tokens pass (0: none)
    moe_capacity_factor: float = 0.0    # expert capacity / average load; 0 = dropless (Megatron's default)
    moe_pad_to_capacity: bool = False   # experts compute a full capacity of tokens (needs a capacity factor)
    moe_grouped_gemm: bool = False      # Megatron's --moe-grouped-gemm: the local experts as one grouped GEMM
                                        # (not priced apart; cached measured entries are keyed on it)
    swiglu: bool = True        # gated MLP with 3 weight matrices (LLaMA); false = 2-matrix GELU MLP
    tie_embeddings: bool = False   # output layer shares the embedding weights
    distributed_optimizer: bool = True  # optimizer states (and fp32 master) sharded over DP (ZeRO-1)
    sequence_parallel: bool = True      # Megatron --sequence-parallel when TP > 1
    recompute: str = "none"             # activation recomputation: none | selective | full (--recompute-granularity)
    recompute_method: str = ""          # full only: uniform | block (--recompute-method)
    recompute_num_layers: int = 0       # full only: layers per recomputed unit (uniform) / per chunk (block)
    constants: Mapping[str, Any] | None = None  # cost-model constant overrides
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        where = f"{self.source}: "
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"{where}dtype = {quote(self.dtype)} is invalid: must be one of "
                             f"{', '.join(DTYPE_BYTES)}")
        if self.hidden_size % self.num_attention_heads:
            raise InputError(f"{where}hidden_size = {self.hidden_size} is invalid: must be a multiple of "
                             f"num_attention_heads = {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups:
            raise InputError(f"{where}num_query_groups = {self.num_query_groups} is invalid: must divide "
                             f"num_attention_heads = {self.num_attention_heads}")
        if self.num_experts == 1 or (self.num_experts == 0) != (self.moe_top_k == 0):
            raise InputError(f"{where}num_experts = {self.num_experts}, moe_top_k = {self.moe_top_k} is "
                             "invalid: a dense model has both 0; an MoE model has num_experts >= 2 and "
                             "1 <= moe_top_k <= num_experts")
        if self.moe_top_k > self.num_experts:
            raise InputError(f"{where}moe_top_k = {self.moe_top_k} is invalid: must be <= num_experts = "
                             f"{self.num_experts}")
        moe_fields = {"moe_ffn_hidden_size": 0, "moe_shared_expert_size": 0, "moe_capacity_factor": 0.0,
                      "moe_pad_to_capacity": False, "moe_grouped_gemm": False}
        if not self.num_experts:
            for name, default in moe_fields.items():
                if getattr(self, name) != default:
                    raise InputError(f"{where}{name} = {quote(getattr(self, name))} is invalid for a dense model "
                                     "(num_experts = 0): set num_experts and moe_top_k, or drop it")
        if self.recompute not in RECOMPUTE:
            raise InputError(f"{where}recompute = {quote(self.recompute)} is invalid: must be one of "
                             f"{', '.join(RECOMPUTE)}")
        if self.recompute == "full":
            if self.recompute_method not in RECOMPUTE_METHODS or self.recompute_num_layers < 1:
                raise InputError(f"{where}recompute = full needs recompute_method (one of "
                                 f"{', '.join(RECOMPUTE_METHODS)}) and recompute_num_layers >= 1, as Megatron's "
                                 f"--recompute-method and --recompute-num-layers; got {quote(self.recompute_method)}"
                                 f" and {self.recompute_num_layers}")
        elif self.recompute_method or self.recompute_num_layers:
            raise InputError(f"{where}recompute_method and recompute_num_layers are for recompute = full only "
                             f"(recompute = {self.recompute})")
        if self.moe_pad_to_capacity and not self.moe_capacity_factor:
            raise InputError(f"{where}moe_pad_to_capacity = true needs a moe_capacity_factor > 0 (Megatron's "
                             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor)")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the training dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def head_dim(self) -> int:
        """Hidden size per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the K (and of the V) projection: query groups x head_dim."""
        return self.num_query_groups * self.head_dim

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Intermediate size of one routed expert (``moe_ffn_hidden_size``, else ``ffn_hidden_size``)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens processed per iteration (global batch x sequence length)."""
        return self.global_batch_size * self.seq_length

    def with_overrides(self, *, global_batch_size: int | None = None,
                       seq_length: int | None = None) -> "ModelSpec":
        """A copy with job fields replaced (``None`` keeps the file's value); validates the values."""
        changes = {}
        for key, value in (("global_batch_size", global_batch_size), ("seq_length", seq_length)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MODEL_LIMITS[key]:
                flag = "--" + key.replace("_", "-")
                raise InputError(f"{flag} {quote(value)} is invalid: must be an integer >= 1 and <= "
                                 f"{MODEL_LIMITS[key]:,}")
            changes[key] = value
        return dataclasses.replace(self, **changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        """A plain document that :func:`parse_model` reads back to an equal spec."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("source", "constants")}
        if self.constants:
            doc["constants"] = dict(self.constants)
        return doc


_INT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
               "seq_length", "global_batch_size")
_BOOL_FIELDS = ("swiglu", "tie_embeddings", "distributed_optimizer", "sequence_parallel")
_MOE_INT_FIELDS = ("num_experts", "moe_top_k", "moe_ffn_hidden_size", "moe_shared_expert_size")
_ALL_FIELDS = ("name", *_INT_FIELDS, "num_query_groups", "dtype", *_MOE_INT_FIELDS, "moe_capacity_factor",
               "moe_pad_to_capacity", "moe_grouped_gemm", *_BOOL_FIELDS, "recompute", "recompute_method",
               "recompute_num_layers", "constants", "description")


def parse_model(doc: Any, source: str = "<model>") -> ModelSpec:
    """Validate a model document (as loaded from YAML/JSON) into a :class:`ModelSpec`."""
    root = f"{source}: "
    get_mapping(doc, root, "a mapping with num_layers, hidden_size, ...")
    check_keys(doc, root, _ALL_FIELDS, _INT_FIELDS)
    lim = MODEL_LIMITS
    values: dict[str, Any] = {k: get_int(doc, k, root, maximum=lim[k]) for k in _INT_FIELDS}
    values["num_query_groups"] = get_int(doc, "num_query_groups", root, maximum=lim["num_query_groups"],
                                         default=values["num_attention_heads"])
    for k in _MOE_INT_FIELDS:
        values[k] = get_int(doc, k, root, minimum=0, maximum=lim[k], default=0)
    values["moe_capacity_factor"] = get_float(doc, "moe_capacity_factor", root, minimum=0.0, maximum=1024.0,
                                              default=0.0)
    values["moe_pad_to_capacity"] = get_bool(doc, "moe_pad_to_capacity", root, default=False)
    values["moe_grouped_gemm"] = get_bool(doc, "moe_grouped_gemm", root, default=False)
    values["dtype"] = get_str(doc, "dtype", root, choices=DTYPE_BYTES, default="bf16")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    for k in _BOOL_FIELDS:
        values[k] = get_bool(doc, k, root, default=defaults[k])
    values["recompute"] = get_str(doc, "recompute", root, choices=RECOMPUTE, default="none")
    values["recompute_method"] = ("" if doc.get("recompute_method", "") == ""   # "": none (what to_dict writes)
                                  else get_str(doc, "recompute_method", root, choices=RECOMPUTE_METHODS))
    values["recompute_num_layers"] = get_int(doc, "recompute_num_layers", root, minimum=0,
                                             maximum=lim["num_layers"], default=0)
    constants = doc.get("constants")
    if constants is not None:
        from .constants import DEFAULT_CONSTANTS
        DEFAULT_CONSTANTS.override(get_mapping(constants, f"{source}: constants"),
                                   f"{source}: constants")
    return ModelSpec(name=get_str(doc, "name", root, default=Path(source).stem),
                     constants=constants, source=source, **values)


def model_presets() -> tuple[str, ...]:
    """Names of the built-in models."""
    return preset_names("model")

def load_model(name_or_path: str | os.PathLike) -> ModelSpec:
    """A model from a YAML/JSON file, or a built-in preset by name (``llama3-70b``)."""
    return load_document_or_preset(name_or_path, "model", parse_model)
