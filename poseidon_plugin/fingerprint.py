"""What a plan was priced for: the model shape, job, devices and profile source behind its numbers.

A plan is only as good as what it was priced for: applied to another model (``--hidden-size 128``
instead of 64) its memory prediction is wrong, which on real hardware is an out-of-memory crash an hour
in. So every plan carries ``priced_for`` (``Plan.priced_for``, flat string pairs), and ``poseidon-run
--poseidon-plan`` compares it with the live job before anything starts, refusing a mismatch by name.
Torch-free.

Keys:
- ``model.<field>``: every ModelSpec field that changes time or memory (``MODEL_FIELDS``), including the
  global batch size and sequence length;
- ``cluster.devices``: per device type, its count and memory (``A2-2 x2 64 GiB; A2-4 x2 32 GiB``);
- ``profile``: ``analytic`` (FLOPs / peak of the named device types) or ``measured``;
- ``emulation``: only for a profile measured under ``--poseidon-emulate-model``: what the emulation priced
  (``deterministic:MODEL:SCALE:LINKS``); a plan carrying it runs only under the same emulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length", "global_batch_size", "dtype", "num_experts", "moe_top_k", "swiglu",
                "tie_embeddings", "distributed_optimizer", "sequence_parallel")
MOE_FIELDS = ("moe_ffn_hidden_size", "moe_shared_expert_size", "moe_capacity_factor", "moe_pad_to_capacity")
"""Fingerprinted only for MoE models (``num_experts > 0``), so that dense plans keep their fingerprint."""
RECOMPUTE_FIELDS = ("recompute", "recompute_method", "recompute_num_layers")
"""Fingerprinted only for jobs that recompute activations, so that other plans keep their fingerprint (a
plan without them was priced without recomputation: its ``recompute`` reads ``none``)."""

# Megatron-LM flag that sets each model field (for messages that tell the user what to change)
MODEL_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
               "num_attention_heads": "--num-attention-heads", "num_query_groups": "--num-query-groups",
               "vocab_size": "--vocab-size", "seq_length": "--seq-length",
               "global_batch_size": "--global-batch-size", "dtype": "--bf16 / --fp16",
               "num_experts": "--num-experts", "moe_top_k": "--moe-router-topk", "swiglu": "--swiglu",
               "tie_embeddings": "--untie-embeddings-and-output-weights",
               "distributed_optimizer": "--use-distributed-optimizer",
               "sequence_parallel": "--sequence-parallel", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
               "moe_shared_expert_size": "--moe-shared-expert-intermediate-size",
               "moe_capacity_factor": "--moe-expert-capacity-factor",
               "moe_pad_to_capacity": "--moe-pad-expert-input-to-capacity",
               "recompute": "--recompute-granularity / --recompute-activations",
               "recompute_method": "--recompute-method", "recompute_num_layers": "--recompute-num-layers",
               "emulation": "--poseidon-emulate-model MODEL:SCALE:LINKS"}


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_part(model: Any) -> dict[str, str]:
    """``{"model.<field>": value}`` of a ModelSpec."""
    names = (MODEL_FIELDS + (MOE_FIELDS if getattr(model, "num_experts", 0) else ())
             + (RECOMPUTE_FIELDS if getattr(model, "recompute", "none") != "none" else ()))
    return {f"model.{name}": _text(getattr(model, name)) for name in names}


def devices_part(cluster: Any) -> str:
    """Device types with their counts and memory, in the cluster's type order."""
    return "; ".join(f"{t.name} x{cluster.num_devices_of_type(t.name)} {t.memory_gb:g} GiB"
                     for t in cluster.device_types)


def priced_for(cluster: Any, model: Any, profile_source: str, emulation: str = "") -> tuple[tuple[str, str], ...]:
    """The fingerprint of a plan priced on ``cluster``, ``model`` and a profile of ``profile_source``
    (measured under ``emulation``, the emulation's tag; empty: none)."""
    doc = {**model_part(model), "cluster.devices": devices_part(cluster), "profile": profile_source}
    if emulation:
        doc["emulation"] = emulation
    return tuple(sorted(doc.items()))


def emulation_mismatches(fingerprint: Sequence[tuple[str, str]], live: str | None) -> list[tuple[str, str, str]]:
    """``[("emulation", planned, live)]`` when the plan was priced under an emulation this job does not run
    (``live``: this job's emulation tag, ``""`` for none; None: not known here, nothing compared)."""
    planned = dict(fingerprint).get("emulation")
    if planned is None or live is None or planned == live:
        return []
    return [("emulation", planned, live or "none")]


def model_mismatches(fingerprint: Sequence[tuple[str, str]], model: Any) -> list[tuple[str, str, str]]:
    """``(field, planned, live)`` for each model field the plan was priced with a different value of."""
    planned = dict(fingerprint)
    live = model_part(model)
    if "model.recompute" not in planned:     # priced without recomputation
        planned["model.recompute"] = "none"
    live.setdefault("model.recompute", "none")
    return [(key.partition(".")[2], planned[key], live[key]) for key in live
            if key in planned and planned[key] != live[key]]


def describe_mismatch(source: str, mismatches: Sequence[tuple[str, str, str]]) -> str:
    """One line naming every mismatched field with both values and the flag, and the fix."""
    parts = [f"{field} {planned} (this job: {live}, {MODEL_FLAGS.get(field, field)})"
             for field, planned, live in mismatches]
    return (f"{source} was priced for another model or job: {'; '.join(parts)}; its memory and time do not "
            f"hold here: re-plan (drop --poseidon-plan), or run the job it was made for")


def as_mapping(fingerprint: Sequence[tuple[str, str]]) -> Mapping[str, str]:
    """The fingerprint as a dict (for JSON and display)."""
    return dict(fingerprint)
