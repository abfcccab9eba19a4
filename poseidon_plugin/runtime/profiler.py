"""Profiling the job's own layer on every device type, with a disk cache.

For each candidate (TP degree, micro-batch size) of each device type, the ranks of that type build the
job's GPTModel with one transformer layer (same flags, spec and patches as the training) on a TP group
inside their node, and run warm-up steps and then timed steps. Times come from device marks (events)
placed by hooks: forward pre/post hooks on the embedding and on the layer; for backward, tensor hooks on
the layer's output (its gradient arriving = backward start) and on its input (its gradient complete =
backward end); the rest of the step is the output layer + loss (forward: after the layer; backward:
before it) and the embedding's backward (after the layer's). The median over timed steps is kept, then
the median over the TP groups of the type. Bytes come from autograd's saved-tensor hooks (what each part
keeps for backward), parameter counts from the modules, the inter-stage message from the layer output.

Cache: one profile file per (device type, TP, mbs), keyed by the device, the emulation factor, the layer
configuration, sequence length, dtype and software versions (``cache_key``); written atomically. A second
launch of the same job finds every entry and skips measuring (logged).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import poseidon_plugin
from poseidon_plugin.emulation import harness as emulation
from poseidon_plugin.runtime import client_step
from poseidon_plugin.runtime.collectives import all_gather_json
from poseidon_plugin.runtime.devices import Device
from poseidon_plugin.runtime.inventory import World
from poseidon_plugin.runtime.job_flags import JobFlags
from poseidon_plugin.runtime.megatron_model import (gpt_model, padded_vocab_size, parallel_state_for,
                                                     process_groups, transformer_config)
from poseidon_plugin.specs import ClusterSpec, ModelSpec, ProfileEntry, ProfileSpec, load_profile, valid_tp_degrees
from poseidon_plugin.specs import write_profile
from poseidon_plugin.specs.profile import entry_doc
from poseidon_plugin.errors import InputError, PoseidonError


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileRequest:
    """One configuration to profile."""

    device_type: str
    tp: int
    mbs: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.device_type, self.tp, self.mbs)


def candidate_requests(cluster: ClusterSpec, model: ModelSpec, job: JobFlags, *, micro_batch_sizes: Sequence[int],
                       keep: bool) -> list[ProfileRequest]:
    """Every (type, TP, mbs) the search may use: TP degrees valid for the type, mbs dividing the batch.

    ``micro_batch_sizes``: the target runtime's candidates (``TargetRuntime.micro_batch_sizes``); ``keep``
    (``--poseidon-keep``) restricts both to the user's own TP and micro-batch size.
    """
    if keep:
        sizes: Sequence[int] = (job.micro_batch_size,)
    else:
        sizes = micro_batch_sizes
    sizes = [m for m in sizes if model.global_batch_size % m == 0]
    if not sizes:
        raise PoseidonError(
            f"no candidate micro-batch size divides the global batch {model.global_batch_size}; pass "
            f"--poseidon-micro-batch-sizes with divisors of it (e.g. 1)"
        )
    requests = []
    for device_type in cluster.type_names:
        degrees = valid_tp_degrees(cluster, model, device_type)
        if keep:
            if job.tensor_parallel not in degrees:
                raise PoseidonError(
                    f"--poseidon-keep keeps --tensor-model-parallel-size {job.tensor_parallel}, which is not "
                    f"possible on {device_type} (valid: {', '.join(map(str, degrees))}); drop --poseidon-keep"
                )
            degrees = (job.tensor_parallel,)
        requests += [ProfileRequest(device_type=device_type, tp=tp, mbs=mbs) for tp in degrees for mbs in sizes]
    return requests


def software_versions() -> dict[str, str]:
    """Versions that change layer timings (part of the cache key and of the profile)."""
    import megatron.core

    return {
        "torch": torch.__version__,
        "megatron-core": getattr(megatron.core, "__version__", "unknown"),
        "poseidon": poseidon_plugin.__version__,
    }


def profile_software() -> dict[str, str]:
    """The whole-job profile's ``software``: the versions, and the deterministic emulation it was measured
    under (plans priced on it carry it in ``priced_for``: fingerprint.py)."""
    tag = emulation.profile_cache_tag()
    return {**software_versions(), **({"emulation": tag} if tag else {})}


ENTRY_GENERATION = "framework-4"
"""What a cached entry measures; entries of an older generation (framework-3: an optimizer step without the
gradient clipping; framework-2: no ``expert_parallel``;
framework-1: no job's own step, i.e. no
``first_step_ms`` / ``last_step_ms``; before: no framework fields) are measured again."""


def cache_key(job: JobFlags, request: ProfileRequest, device: Device,
              client: client_step.Client | None = None) -> dict[str, str]:
    """Everything a cached entry depends on, as strings (stored in the profile's ``software`` field): with
    the job's own step (``client``), the training script's source too."""
    layer = {
        "hidden": job.hidden_size, "ffn": job.ffn_hidden_size, "heads": job.num_attention_heads,
        "groups": job.num_query_groups, "swiglu": job.swiglu, "norm": job.normalization,
        "bias": job.add_bias_linear, "pos": job.position_embedding_type,
        "vocab": padded_vocab_size(job, request.tp), "experts": job.num_experts, "topk": job.moe_router_topk,
        "grouped_gemm": job.moe_grouped_gemm,
        "sp": job.sequence_parallel, "untie": job.untie_embeddings, "max_pos": job.max_position_embeddings,
    }
    if job.recompute == "selective":   # measured with it (full recomputation is priced from the plain layer)
        layer["recompute"] = "selective"
    return {
        "device_type": request.device_type, "device": f"{device.kind}:{device.name()}",
        "slowdown": f"{device.slowdown():.6g}", "tp": str(request.tp), "mbs": str(request.mbs),
        "seq": str(job.seq_length), "dtype": job.dtype, "layer": json.dumps(layer, sort_keys=True),
        "emulation": emulation.profile_cache_tag(), "entry": ENTRY_GENERATION,
        "client": "" if client is None else f"{os.path.basename(client.script)}:{client.digest()}",
        **software_versions(),
    }


def cache_path(cache_dir: str, key: dict[str, str]) -> str:
    """``DIR/<type>-tp<t>-mbs<m>-<hash>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key["device_type"])
    return os.path.join(cache_dir, f"{safe}-tp{key['tp']}-mbs{key['mbs']}-{digest}.json")


def load_cached(cache_dir: str, key: dict[str, str], request: ProfileRequest) -> ProfileEntry | None:
    """The cached entry for ``key``, or None: absent, unreadable (not UTF-8, not JSON, a directory, no
    permission), invalid or stale entries are re-measured, never trusted and never fatal."""
    path = cache_path(cache_dir, key)
    if not os.path.isfile(path):
        return None
    try:
        profile = load_profile(path)
    except (InputError, OSError, UnicodeError, ValueError, RecursionError):
        return None
    entry = profile.get(*request.key)
    return entry if entry is not None and dict(profile.software) == key else None


def store_cached(cache_dir: str, key: dict[str, str], entry: ProfileEntry, job: JobFlags) -> str | None:
    """Write one entry as a one-entry profile file, atomically; the reason it could not be stored, or None.

    A cache that cannot take the entry (a directory squats its name, the disk is full, no permission)
    costs a re-measurement next launch, not this one: the measured entry is used all the same.
    """
    profile = ProfileSpec(model="layer-cache", seq_length=job.seq_length, dtype=job.dtype, entries=(entry,),
                          source="measured", software=key)
    path = cache_path(cache_dir, key)
    try:
        write_profile(path, profile)
    except OSError as exc:
        return f"{path}: {exc.strerror or type(exc).__name__}"
    return None


# --- measuring ----------------------------------------------------------------------------------


class _StepMarks:
    """Device marks and byte counts of one forward/backward step (filled by :class:`_Hooks`)."""

    def __init__(self) -> None:
        self.marks: dict[str, Any] = {}
        self.saved = {"embedding": 0, "layer": 0, "head": 0}
        self.send_bytes = 0


class _Hooks:
    """Forward pre/post hooks on the embedding and the layer; tensor hooks for the layer's backward."""

    def __init__(self, model: torch.nn.Module, device: Device) -> None:
        self.device = device
        self.step = _StepMarks()
        self.region = "embedding"
        self.accounting = False
        self._params: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        layer = model.decoder.layers[0]
        self.handles = [
            model.embedding.register_forward_pre_hook(lambda m, a: self._mark("embedding_pre")),
            model.embedding.register_forward_hook(lambda m, a, o: self._mark("embedding_post")),
            layer.register_forward_pre_hook(self._layer_pre, with_kwargs=True),
            layer.register_forward_hook(self._layer_post),
        ]

    def _mark(self, name: str) -> None:
        self.step.marks[name] = self.device.mark()

    def _layer_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self._mark("layer_in_grad"))
        self.region = "layer"
        self._mark("layer_pre")

    def _layer_post(self, module: Any, args: tuple, output: Any) -> None:
        self._mark("layer_post")
        self.region = "head"
        out = output[0] if isinstance(output, tuple) else output
        self.step.send_bytes = out.numel() * out.element_size()
        out.register_hook(lambda grad: self._mark("layer_out_grad"))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack: count each storage once, parameters never."""
        if self.accounting:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in self._params and ptr not in self._seen:
                self._seen.add(ptr)
                self.step.saved[self.region] += tensor.untyped_storage().nbytes()
        return tensor

    def new_step(self, accounting: bool) -> _StepMarks:
        self.step, self.region, self.accounting = _StepMarks(), "embedding", accounting
        self._seen.clear()
        return self.step

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _seed_tracker(groups: Any) -> None:
    """Megatron's RNG tracker seeded for the profiling TP group, as the training script seeds it for its own:
    weight init and dropout of TP regions fork its per-TP-rank state, and fork() refuses an unseeded one."""
    from megatron.core.tensor_parallel import random as mc_random

    tp_rank = groups.tp.rank() if getattr(groups, "tp", None) is not None else 0
    ep_rank = groups.ep.rank() if getattr(groups, "ep", None) is not None else 0   # 0 but in an EP block
    try:
        mc_random.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=0)
    except TypeError:  # megatron-core 0.12: the ranks come from parallel_state (pointed at the group here)
        mc_random.model_parallel_cuda_manual_seed(1234)


def measure(job: JobFlags, device: Device, groups: Any, request: ProfileRequest, *, warmup: int,
            iters: int, client: client_step.Client | None = None,
            framework: dict[str, float] | None = None) -> dict[str, Any]:
    """Profile one (TP, mbs) on this rank's TP group; the ProfileEntry fields as a dict (and, under
    ``client_note``, what became of the job's own step: ``runtime/client_step.py``; under ``framework``, the
    framework's step costs it used, for the next micro-batch size of the same TP).

    ``framework``: :func:`_framework_ms`'s result for this TP at another micro-batch size, used instead of
    measuring it again. Its per-step costs (megatron-core's ``forward_step`` / ``backward_step`` and schedule
    bookkeeping outside the model) are Python and do not grow with the micro-batch, while measuring them runs
    :data:`FRAMEWORK_MICRO_BATCHES` whole micro-batches per call (under a deterministic emulation, at the
    emulated layer times): measured on the 2-core host at micro-batch 1, 2 and 4 they showed no trend
    (README's Megatron-LM job, deterministic emulation: forward 0.55-1.46 ms, one outlier of 5.8 ms at
    micro-batch 2; backward 0.12-0.64 ms; the noise larger than any difference)."""
    on_cpu = device.torch_device.type == "cpu"
    config = transformer_config(job, tensor_parallel=request.tp, num_layers=1, on_cpu=on_cpu, **_profiled_recompute(job))
    model, steps, peak, loss = _run_steps(job, config, device, groups, request, warmup=warmup, iters=iters)
    layer = model.decoder.layers[0]
    head_params = padded_vocab_size(job, request.tp) * job.hidden_size // request.tp
    head_params += sum(p.numel() for p in model.decoder.final_layernorm.parameters())

    def span(start: str, stop: str) -> float:
        return _span(device, steps, start, stop)

    first = steps[0]
    model_forward = span("start", "forward_end")
    model_backward = span("backward_start", "backward_end")
    with parallel_state_for(groups):
        if framework is None:
            framework = _framework_ms(model, groups, job, device, request, model_forward, model_backward,
                                      iters=iters)
        shared = dict(framework)
        framework = dict(framework)
        own = ("no training script given" if client is None else
               client_step.measure(client, job, device, getattr(groups, "tp", None), request.tp, request.mbs,
                                   loss, iters=iters))
        # the TP duplicates the gradient norm skips: megatron-core 0.12 asks parallel_state for the TP rank
        optimizer = _optimizer_ms(model, layer, device, iters=iters, group=getattr(groups, "tp", None),
                                  clip_grad=job.clip_grad)
    # every stage's step pays the job's own step at a middle position (or, not measured, the stand-in's)
    synthetic = framework.pop("synthetic_step_ms")
    framework["client_note"] = client_step.describe(own)
    if isinstance(own, str):
        framework.update(first_step_ms=0.0, last_step_ms=0.0)
        framework["step_forward_ms"] += synthetic
    else:
        framework["step_forward_ms"] += own["middle_step_ms"]
        framework.update(first_step_ms=own["first_step_ms"], last_step_ms=own["last_step_ms"])
    framework.update(optimizer)
    # deterministic emulation: the sizes are the emulated model's, the times stay measured
    framework["framework"] = shared
    return emulation.override_profile_entry({
        **framework,
        "device_type": request.device_type, "tp": request.tp, "mbs": request.mbs,
        "forward_ms": span("layer_pre", "layer_post"),
        "backward_ms": span("layer_out_grad", "layer_in_grad"),
        "layer_params": sum(p.numel() for p in layer.parameters()),
        "activation_bytes": first.saved["layer"],
        "send_bytes": first.send_bytes,
        "embedding_forward_ms": span("embedding_pre", "embedding_post"),
        "embedding_backward_ms": span("layer_in_grad", "backward_end"),
        "embedding_params": sum(p.numel() for p in model.embedding.parameters()),
        "embedding_activation_bytes": first.saved["embedding"],
        "head_forward_ms": span("layer_post", "forward_end"),
        "head_backward_ms": span("backward_start", "layer_out_grad"),
        "head_params": head_params,
        "head_activation_bytes": first.saved["head"],
        "peak_memory_bytes": peak,
    })


def _profiled_recompute(job: JobFlags) -> dict[str, Any]:
    """The layer is measured with the job's selective recomputation (what its core attention keeps and
    recomputes), and without full recomputation, which the cost model prices from the layer itself
    (``costmodel.full_recompute``): a recomputed layer's forward runs again inside its backward, where the
    profile's hooks would time it as a second forward."""
    if job.recompute != "full":
        return {}
    return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}


def _run_steps(job: JobFlags, config: Any, device: Device, groups: Any, request: ProfileRequest, *, warmup: int,
               iters: int) -> tuple[torch.nn.Module, list[_StepMarks], Any, torch.Tensor]:
    """The one-layer model of ``config`` built on ``groups``, and its forward and backward steps on fixed
    random tokens: the model, the timed steps' marks, the peak memory of the first timed one, the last loss."""
    with parallel_state_for(groups):
        _seed_tracker(groups)
        model = gpt_model(job, config, pre_process=True, post_process=True, pg_collection=groups)
        if device.torch_device.type != "cpu":
            model.to(device.torch_device)
        return (model, *_steps(model, job, device, request, warmup=warmup, iters=iters))


def _span(device: Device, steps: list[_StepMarks], start: str, stop: str) -> float:
    """Median ms from mark ``start`` to mark ``stop`` over the timed steps (at least 1 ns)."""
    return max(statistics.median(device.ms_between(s.marks[start], s.marks[stop]) for s in steps), 1e-6)


def _steps(model: torch.nn.Module, job: JobFlags, device: Device, request: ProfileRequest, *, warmup: int,
           iters: int) -> tuple[list[_StepMarks], Any, torch.Tensor]:
    hooks = _Hooks(model, device)
    vocab = job.vocab_size
    shape = (request.mbs, job.seq_length)
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, shape, generator=generator).to(device.torch_device)
    labels = torch.randint(0, vocab, shape, generator=generator).to(device.torch_device)
    positions = torch.arange(job.seq_length, device=device.torch_device).unsqueeze(0).expand(shape)
    steps: list[_StepMarks] = []
    peak = None
    try:
        for index in range(warmup + iters):
            timed = index >= warmup
            if index == warmup:
                device.reset_peak_memory()
            step = hooks.new_step(accounting=index == warmup)
            step.marks["start"] = device.mark()
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t):
                loss = model(tokens, positions, None, labels=labels)
            step.marks["forward_end"] = device.mark()
            step.marks["backward_start"] = device.mark()
            loss.backward(torch.ones_like(loss))
            step.marks["backward_end"] = device.mark()
            model.zero_grad(set_to_none=True)
            if index == warmup:
                peak = device.peak_memory()
            if timed:
                steps.append(step)
        device.synchronize()
    finally:
        hooks.remove()
    return steps, peak, loss


def measure_expert_parallel(job: JobFlags, device: Device, groups: Any, request: ProfileRequest, ep: int, *,
                            warmup: int, iters: int) -> dict[str, Any]:
    """The MoE layer's forward and backward at EP ``ep`` (expert TP = TP) on this rank's EP block
    (:func:`_profiling_groups`): megatron-core's all-to-all dispatcher, its collectives on the block's
    groups (gloo for CPU ranks), each rank holding ``E / ep`` experts. ``{ep, forward_ms, backward_ms}``."""
    on_cpu = device.torch_device.type == "cpu"
    # the dispatcher a plan with EP > 1 runs (plan.py adds --moe-token-dispatcher-type alltoall)
    config = transformer_config(job, tensor_parallel=request.tp, num_layers=1, on_cpu=on_cpu,
                                expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
                                **_profiled_recompute(job))
    _model, steps, _peak, _loss = _run_steps(job, config, device, groups, request, warmup=warmup, iters=iters)
    return {"ep": ep, "forward_ms": _span(device, steps, "layer_pre", "layer_post"),
            "backward_ms": _span(device, steps, "layer_out_grad", "layer_in_grad")}


def profiled_eps(job: JobFlags, tp: int, node_devices: int, keep: bool) -> tuple[int, ...]:
    """The EP degrees > 1 measured for TP ``tp`` on a node of ``node_devices``: those the search may choose
    with expert TP = TP (dividing the experts; sequence parallelism where TP > 1, megatron-core's rule)
    whose ``TP x EP`` block fits the node; ``keep`` (``--poseidon-keep``): the job's own EP only. None under a
    deterministic emulation (it prices the expert layout analytically, as the cost model's fallback does)."""
    if not job.num_experts or (tp > 1 and not job.sequence_parallel) or emulation.times_layers():
        return ()
    eps = (job.expert_parallel,) if keep else range(2, job.num_experts + 1)
    return tuple(ep for ep in eps if ep > 1 and job.num_experts % ep == 0 and tp * ep <= node_devices)


FRAMEWORK_MICRO_BATCHES = 4
"""Micro-batches per schedule call when timing the framework's per-step cost."""


@contextlib.contextmanager
def _timed_steps(device: Device, calls: dict[str, list]) -> Iterator[None]:
    """Time megatron-core's own ``forward_step`` / ``backward_step`` while the schedule runs.

    The schedule calls them as module globals, so rebinding the module attributes for the duration
    reaches every call; restored on exit, also on errors.
    """
    from megatron.core.pipeline_parallel import schedules

    originals = {"forward": schedules.forward_step, "backward": schedules.backward_step}

    def timed(kind: str):
        original = originals[kind]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = device.mark()
            out = original(*args, **kwargs)
            calls[kind].append((start, device.mark()))
            return out

        return wrapper

    schedules.forward_step, schedules.backward_step = timed("forward"), timed("backward")
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = originals["forward"], originals["backward"]


def _framework_ms(model: torch.nn.Module, groups: Any, job: JobFlags, device: Device, request: ProfileRequest,
                  model_forward_ms: float, model_backward_ms: float, *, iters: int) -> dict[str, float]:
    """The per-micro-batch cost of the framework around the model: megatron-core's schedule
    (``forward_backward_no_pipelining``) runs :data:`FRAMEWORK_MICRO_BATCHES` micro-batches of the profiled
    model, fed like ``pretrain_gpt.py`` (fresh random tokens, per-token loss averaged by a loss function); a
    step's cost is megatron's ``forward_step`` (``backward_step``) minus the model's own forward (backward)
    measured by the hooks, plus half the schedule's time outside both (bookkeeping). The forward one leaves
    out what this stand-in step itself does (its tokens and its loss function), returned apart as
    ``synthetic_step_ms``: where the job's own step is measured (``runtime/client_step.py``), that takes its
    place."""
    import inspect

    from megatron.core.pipeline_parallel import schedules

    vocab, shape = job.vocab_size, (request.mbs, job.seq_length)
    positions = torch.arange(job.seq_length, device=device.torch_device).unsqueeze(0).expand(shape)

    own: list[tuple[Any, Any]] = []   # marks around the stand-in step's own work (its data, its loss)

    def loss_func(per_token: torch.Tensor):
        start = device.mark()
        loss = per_token.float().mean()
        report = {"lm loss": loss.detach().clone()}
        own.append((start, device.mark()))
        return loss, report

    def forward_step_func(data_iterator: Any, chunk: torch.nn.Module):
        start = device.mark()
        tokens = torch.randint(0, vocab, shape).to(device.torch_device)
        labels = torch.randint(0, vocab, shape).to(device.torch_device)
        own.append((start, device.mark()))
        return chunk(tokens, positions, None, labels=labels), loss_func

    kwargs: dict[str, Any] = {"forward_step_func": forward_step_func, "data_iterator": None, "model": model,
                              "num_microbatches": FRAMEWORK_MICRO_BATCHES, "seq_length": job.seq_length,
                              "micro_batch_size": request.mbs, "forward_only": False}
    if "pg_collection" in inspect.signature(schedules.forward_backward_no_pipelining).parameters:
        # the profiled model is alone in its pipeline, data-parallel and embedding groups
        collection = copy.copy(groups)
        for name in ("embd", "pos_embd", "dp_cp", "dp"):
            setattr(collection, name, groups.pp)
        kwargs["pg_collection"] = collection
    runs = []
    for index in range(1 + iters):   # the first call pays one-time allocations
        own.clear()
        calls: dict[str, list] = {"forward": [], "backward": []}
        with _timed_steps(device, calls):
            start = device.mark()
            schedules.forward_backward_no_pipelining(**kwargs)
            stop = device.mark()
        model.zero_grad(set_to_none=True)
        if index:
            runs.append((start, stop, calls, list(own)))
    device.synchronize()
    forward, backward, outside, synthetic = [], [], [], []
    for start, stop, calls, marks in runs:
        synthetic.append(sum(device.ms_between(a, b) for a, b in marks) / FRAMEWORK_MICRO_BATCHES)
        f = [device.ms_between(a, b) for a, b in calls["forward"]]
        b = [device.ms_between(a, b) for a, b in calls["backward"]]
        forward += f
        backward += b
        outside.append((device.ms_between(start, stop) - sum(f) - sum(b)) / FRAMEWORK_MICRO_BATCHES)
    between = max(statistics.median(outside), 0.0) / 2
    synthetic_ms = statistics.median(synthetic)
    return {"step_forward_ms": max(statistics.median(forward) - model_forward_ms - synthetic_ms, 0.0) + between,
            "step_backward_ms": max(statistics.median(backward) - model_backward_ms, 0.0) + between,
            "synthetic_step_ms": synthetic_ms}


def _optimizer_ms(model: torch.nn.Module, layer: torch.nn.Module, device: Device, *, iters: int,
                  clip_grad: float = 0.0, group: Any = None) -> dict[str, float]:
    """The optimizer step per iteration as megatron-core's optimizer runs it: with ``clip_grad > 0`` (the job
    clips, :func:`client_step.clip_grad`) first the gradient norm (``get_grad_norm_fp32``, its all-reduce
    over ``group``, the TP group) and the clipping (``clip_grad_by_total_norm_fp32``), then megatron-core's
    Adam class (the one its optimizer wraps here); stepped over the profiled model's parameters, and over
    all but the layer's; the difference is one layer's share, the rest is the fixed part of a stage
    (per-call cost, the norm's all-reduce, embedding, output layer). Collective over ``group`` when
    clipping: every rank of it makes the same calls. A bf16 / fp16 model is stepped as Megatron-LM's
    ``Float16OptimizerWithFloat16Params`` does: clipping and Adam on fp32 copies of the parameters (the fp32
    gradients its DDP accumulates), then every copy written back into the model's parameter, which the
    measured time includes; fp16 first unscales the gradients and checks them for inf / NaN."""
    from megatron.core import optimizer as megatron_optimizer

    adam = getattr(megatron_optimizer, "Adam", torch.optim.AdamW)
    in_layer = {id(p) for p in layer.parameters()}
    every = [p for p in model.parameters() if p.requires_grad]
    rest = [p for p in every if id(p) not in in_layer]

    def step_ms(params: list) -> float:
        if not params:
            return 0.0
        stepped = [_main_param(p) for p in params]   # the parameters themselves in fp32
        for p in stepped:
            p.grad = torch.randn_like(p) * 1e-3
        opt = adam(stepped, lr=1e-6, weight_decay=0.01)
        clip = _gradient_clipping(stepped, clip_grad, group, device)
        unscale = _fp16_unscale(stepped, device) if params[0].dtype == torch.float16 else (lambda: None)
        pairs = [(p, m) for p, m in zip(params, stepped) if m is not p]
        times = []
        for index in range(1 + iters):
            start = device.mark()
            unscale()
            clip()
            opt.step()
            for model_param, main_param in pairs:
                model_param.copy_(main_param)
            opt.zero_grad(set_to_none=False)
            stop = device.mark()
            if index:
                times.append((start, stop))
        device.synchronize()
        return statistics.median(device.ms_between(a, b) for a, b in times)

    with torch.no_grad():
        total = step_ms(every)
        fixed = step_ms(rest)
    model.zero_grad(set_to_none=True)
    return {"optimizer_ms": max(total - fixed, 0.0), "optimizer_fixed_ms": fixed}


def _main_param(param: torch.Tensor) -> torch.Tensor:
    """``param`` when it is fp32, else the fp32 copy Megatron's mixed-precision optimizer steps instead (with
    the attributes its gradient norm reads: tensor-parallel layout, shared)."""
    if param.dtype == torch.float32:
        return param
    from megatron.core import tensor_parallel

    main = param.detach().clone().float()
    tensor_parallel.copy_tensor_model_parallel_attributes(main, param)
    if hasattr(param, "shared"):
        main.shared = param.shared
    return main


def _fp16_unscale(params: list, device: Device) -> Callable[[], None]:
    """fp16's loss-scaled gradients: unscaled and checked for inf / NaN before the step, as
    ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan`` does (its all-reduce of the flag over
    the model-parallel group is left out)."""
    found_inf = torch.zeros(1, device=device.torch_device)
    inv_scale = torch.ones(1, device=device.torch_device)
    grads = [p.grad for p in params]
    return lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def _gradient_clipping(params: list, clip_grad: float, group: Any, device: Device) -> Callable[[], None]:
    """megatron-core's ``clip_grad_norm`` on ``params`` (``MegatronOptimizer.clip_grad_norm``: the norm over
    the gradients that are neither shared nor TP duplicates, reduced over ``group``, then every gradient
    clipped by it); a no-op without clipping."""
    if clip_grad <= 0.0:
        return lambda: None
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.transformer.module import param_is_not_shared

    def not_duplicate(param: torch.Tensor) -> bool:
        try:
            return tensor_parallel.param_is_not_tensor_parallel_duplicate(param, group)
        except TypeError:   # megatron-core 0.12: the TP rank comes from parallel_state
            return tensor_parallel.param_is_not_tensor_parallel_duplicate(param)

    for_norm = [p.grad for p in params if param_is_not_shared(p) and not_duplicate(p)]
    def clip() -> None:
        norm = get_grad_norm_fp32(for_norm, grad_stats_parallel_group=group)
        clip_grad_by_total_norm_fp32(params, clip_grad, norm)   # on CPU ranks with the shim's type names

    return clip


P2P_CALLS = 20
"""Timed p2p calls per rank pair."""


def p2p_call_ms(world: World, rank: int, device: Device, job: JobFlags) -> float:
    """Collective: the CPU cost of one pipeline p2p call on this rank, as megatron-core makes it (allocate the
    receive buffer of a stage activation, post the send and the receive with ``batch_isend_irecv``), up to the
    moment both are posted; median over :data:`P2P_CALLS` calls with a partner rank (0 with one rank)."""
    from poseidon_plugin.runtime.megatron_model import torch_dtype

    size = len(world.ranks)
    if size < 2:
        return 0.0
    rounds = [[(r, r + 1) for r in range(0, size - 1, 2)]]
    if size % 2:
        rounds.append([(0, size - 1)])   # the odd rank out pairs with rank 0 afterwards
    shape = (job.seq_length, 1, job.hidden_size)
    dtype = torch_dtype(job)
    payload = torch.zeros(shape, dtype=dtype, device=device.torch_device)
    times: list[float] = []
    for pairs in rounds:
        peer = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        if peer is None:
            continue
        for call in range(1 + P2P_CALLS):   # the first call of each pairing sets the pair up: not timed
            start = device.mark()
            buffer = torch.empty(shape, dtype=dtype, device=device.torch_device, requires_grad=True)
            ops = [dist.P2POp(dist.isend, payload, peer), dist.P2POp(dist.irecv, buffer, peer)]
            if rank > peer:   # matching order on both sides
                ops.reverse()
            works = dist.batch_isend_irecv(ops)
            posted = device.mark()
            for work in works:
                work.wait()
            if call:
                times.append(device.ms_between(start, posted))
    return statistics.median(times) if times else 0.0


# --- the collective flow --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOutcome:
    """The merged profile and what the cache contributed."""

    profile: ProfileSpec
    reused: int
    measured: int
    unstored: tuple[str, ...] = ()
    """Cache files this rank could not write (why, per file); the measurements were used all the same."""


def _profiling_groups(world: World, requests: Sequence[ProfileRequest], rank: int, job: JobFlags,
                      keep: bool = False) -> dict[tuple[int, int], Any]:
    """``{(tp, ep): groups}`` for this rank's profiling groups: ``ep = 1``, its TP group; ``ep > 1``
    (:func:`profiled_eps`), its block of ``tp x ep`` consecutive devices of a node, TP groups inside it,
    EP groups across them (Megatron's expert rank order, expert TP = TP). Every rank creates every group,
    in order."""
    own = None
    for r in range(len(world.ranks)):  # singleton pipeline / context groups: the profiled model has one stage
        group = dist.new_group([r])
        if r == rank:
            own = group
    collections: dict[tuple[int, int], Any] = {}
    for tp in sorted({req.tp for req in requests}):
        types = {req.device_type for req in requests if req.tp == tp}
        for index, node in enumerate(world.nodes):
            if world.node_type(index) not in types:
                continue
            for start in range(0, len(node) - tp + 1, tp):
                members = list(node[start:start + tp])
                group = dist.new_group(members)
                if rank in members:
                    collections[(tp, 1)] = process_groups(tp=group, pp=own, cp=own)
            for ep in profiled_eps(job, tp, len(node), keep):
                for start in range(0, len(node) - tp * ep + 1, tp * ep):
                    block = list(node[start:start + tp * ep])
                    whole = dist.new_group(block)
                    tps = [dist.new_group(block[i:i + tp]) for i in range(0, len(block), tp)]
                    eps = [dist.new_group(block[i::tp]) for i in range(tp)]
                    if rank in block:
                        at = block.index(rank)
                        groups = process_groups(tp=tps[at // tp], pp=own, cp=own)
                        groups.ep = groups.dp = eps[at % tp]
                        groups.expt_dp = own
                        groups.tp_ep = groups.tp_dp_cp = whole
                        collections[(tp, ep)] = groups
    return collections


def profile_world(*, world: World, rank: int, device: Device, job: JobFlags, model: ModelSpec,
                  requests: Sequence[ProfileRequest], cache_dir: str, warmup: int, iters: int,
                  progress: Callable[[str], None] | None = None,
                  client: client_step.Client | None = None, keep: bool = False) -> ProfileOutcome:
    """Collective: cached entries are shared, the missing ones measured by the ranks of their type, merged.

    ``progress`` receives one line per configuration this rank measures, from one rank per (host, type), and
    what became of the job's own step (``client``: the training script) there."""
    me = world.ranks[rank]
    keys = {req.key: cache_key(job, req, device, client) for req in requests
            if req.device_type == me.device_type}
    local = {}
    for req in requests:
        if req.key in keys:
            entry = load_cached(cache_dir, keys[req.key], req)
            if entry is not None:
                local[req.key] = entry
    cached: dict[tuple, dict] = {}
    for part in all_gather_json([_entry_doc(e) for e in local.values()], device.torch_device):
        for doc in part:
            cached.setdefault((doc["device_type"], doc["tp"], doc["mbs"]), doc)
    missing = [req for req in requests if req.key not in cached]
    measured: list[dict] = []
    if missing:
        call_ms = p2p_call_ms(world, rank, device, job)
        groups = _profiling_groups(world, missing, rank, job, keep)
        mine = [req for req in missing if req.device_type == me.device_type and (req.tp, 1) in groups]
        started = time.perf_counter()
        steps_by_tp: dict[int, dict[str, float]] = {}   # the framework's step costs, once per TP (measure())
        for index, req in enumerate(mine):
            if progress is not None and _writes_cache(world, rank):
                progress(f"profiling {req.device_type} TP {req.tp} micro-batch {req.mbs} ({index + 1}/{len(mine)}, "
                         f"{time.perf_counter() - started:.0f} s so far)")
            doc = measure(job, device, groups[(req.tp, 1)], req, warmup=warmup, iters=iters, client=client,
                          framework=steps_by_tp.get(req.tp))
            steps_by_tp[req.tp] = doc.pop("framework")
            doc["expert_parallel"] = [
                measure_expert_parallel(job, device, groups[(req.tp, ep)], req, ep, warmup=warmup, iters=iters)
                for ep in sorted(ep for tp, ep in groups if tp == req.tp and ep > 1)]
            if progress is not None and _writes_cache(world, rank):
                progress(f"{req.device_type} TP {req.tp} micro-batch {req.mbs}: {doc.pop('client_note')}")
            measured.append({**doc, "p2p_call_ms": call_ms})
    merged = dict(cached)
    if missing:
        by_key: dict[tuple, list[dict]] = {}
        for part in all_gather_json(measured, device.torch_device):
            for doc in part:
                by_key.setdefault((doc["device_type"], doc["tp"], doc["mbs"]), []).append(doc)
        for req in missing:
            docs = by_key.get(req.key)
            if not docs:
                raise PoseidonError(
                    f"no rank could profile {req.device_type} with TP {req.tp}: its nodes hold fewer than "
                    f"{req.tp} devices"
                )
            merged[req.key] = _median_entry(docs)
    unstored = []
    if _writes_cache(world, rank):
        for key, cache in keys.items():
            if key not in local:
                why = store_cached(cache_dir, cache, ProfileEntry(**_entry_fields(merged[key])), job)
                if why is not None:
                    unstored.append(why)
    entries = tuple(ProfileEntry(**_entry_fields(merged[req.key])) for req in requests)
    profile = ProfileSpec(model=model.name, seq_length=model.seq_length, dtype=model.dtype, entries=entries,
                          source="measured", software=profile_software())
    return ProfileOutcome(profile=profile, reused=len(requests) - len(missing), measured=len(missing),
                          unstored=tuple(unstored))


def _writes_cache(world: World, rank: int) -> bool:
    """One writer per (host, device type): the lowest launcher rank of the pair."""
    me = world.ranks[rank]
    return all(not (r.host == me.host and r.device_type == me.device_type and r.rank < rank) for r in world.ranks)


_FIELDS = tuple(ProfileEntry.__dataclass_fields__)


def _entry_fields(doc: dict) -> dict:
    out = {name: doc[name] for name in _FIELDS if name in doc}
    out["expert_parallel"] = tuple(sorted((int(m["ep"]), float(m["forward_ms"]), float(m["backward_ms"]))
                                          for m in doc.get("expert_parallel", ())))
    return out


def _entry_doc(entry: ProfileEntry) -> dict:
    return entry_doc(entry)


def _median_entry(docs: list[dict]) -> dict:
    """Times: median over the TP groups (EP blocks) that measured; sizes: the largest (memory must fit on all)."""
    out = dict(docs[0])
    for name in _FIELDS:
        if name == "expert_parallel":
            by_ep: dict[int, list[dict]] = {}
            for doc in docs:
                for m in doc.get(name, ()):
                    by_ep.setdefault(m["ep"], []).append(m)
            out[name] = [{"ep": ep, **{k: statistics.median(m[k] for m in ms) for k in ("forward_ms", "backward_ms")}}
                         for ep, ms in sorted(by_ep.items())]
            continue
        values = [doc[name] for doc in docs]
        if name.endswith("_ms"):
            out[name] = statistics.median(values)
        elif name not in ("device_type", "tp", "mbs"):
            out[name] = max(values)
    return out
