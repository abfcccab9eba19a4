"""What the job's own step costs per micro-batch at each stage position: its data and its loss.

The profiled model runs the layers, the embedding and the output layer; what the training script does
around them each micro-batch is the script's own ``forward_step``: fetching the micro-batch (on Megatron-LM's
``pretrain_gpt.py``, ``get_batch`` -> ``get_batch_on_this_tp_rank``, which reads the data iterator on TP
rank 0 and broadcasts the batch over the TP group, on the first and the last pipeline stage only) and the
loss function it returns (the last stage only). So the profiler loads the job's script as a module (not as
``__main__``), and times its ``forward_step`` with the job's data iterator on the profiling TP group, at
three pipeline positions (first, middle, last; ``parallel_state``'s pipeline rank and size set for the
duration), with a stand-in for the model (the profiled model's forward is timed apart) and, on the last
position, the returned loss function on the profiled model's output. The differences from the middle
position are the profile's ``first_step_ms`` and ``last_step_ms`` (``specs/profile.py``); the cost model
adds them to the embedding's and the output layer's forward (``costmodel.py``), so the split search prices
them where they apply. The middle position's cost is part of the profile's ``step_forward_ms``, which every
forward step of every stage pays (in place of the profiler's stand-in step's own tokens and loss).

Two kinds of script are understood, each through its own functions:

* Megatron-LM's (it imports ``megatron.training`` and defines ``forward_step`` and
  ``core_gpt_dataset_config_from_args``): Megatron-LM's arguments parsed and validated from the job's
  command (its parallelism replaced by the profiled TP and 2 pipeline stages, the CPU-rank adjustments of
  ``emulation/cpu_training.py`` on CPU), set as Megatron-LM's global arguments for the measurement and unset
  after; the data iterator is Megatron-LM's pretraining data loader over the mock GPT data set the script's
  own data-set config describes (``--mock-data``; other data sources are not read while profiling);
* ``scripts/pretrain_gpt.py`` (``forward_step``, ``parse_args``, ``synthetic_batches``): its own iterator.

Any other script is priced by the profiler's framework step alone (``step_forward_ms``), as before:
:func:`measure` returns None with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import runpy
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from poseidon_plugin.runtime.devices import Device
from poseidon_plugin.runtime.job_flags import JobFlags, rewrite

POSITIONS = ("first", "middle", "last")
"""Pipeline positions timed; their ranks among :data:`PROBE_STAGES` stages."""
PROBE_STAGES = 3
"""Pipeline size ``parallel_state`` reports while timing (first, middle, last)."""
MIN_ROUNDS = 10
"""Timed rounds (one call at each position) at least, whatever ``--poseidon-profile-iters`` says: a call costs
milliseconds, and its broadcast is the noisiest part of the step."""
MEGATRON_LM_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
"""The ``args_defaults`` Megatron-LM's ``pretrain_gpt.py`` passes to ``pretrain``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Client:
    """The training script the job runs, as the profiler sees it."""

    script: str
    """A path, or a module name when ``is_module``."""
    args: tuple[str, ...]
    """The script's own arguments, as the user gave them."""
    is_module: bool = False
    _namespace: dict = field(default_factory=dict, compare=False, repr=False)

    def digest(self) -> str:
        """16 hex digits of the script's source (the module name for a module): part of the cache key, so a
        changed script is profiled again."""
        if self.is_module:
            return "module:" + self.script
        try:
            with open(self.script, "rb") as handle:
                return hashlib.sha256(handle.read()).hexdigest()[:16]
        except OSError:
            return "unreadable"

    def namespace(self) -> dict:
        """The script's globals, loaded once as a module named ``__poseidon_client__`` (its
        ``if __name__ == "__main__"`` block does not run)."""
        if not self._namespace:
            if self.is_module:
                self._namespace.update(runpy.run_module(self.script, run_name="__poseidon_client__"))
            else:
                folder = os.path.dirname(os.path.abspath(self.script))
                if folder not in sys.path:
                    sys.path.insert(0, folder)   # where the script imports from (as when it runs)
                self._namespace.update(runpy.run_path(self.script, run_name="__poseidon_client__"))
        return self._namespace


class _StandIn:
    """The model as the script's ``forward_step`` calls it: returns the profiled model's output and counts
    the time spent inside (the profiled model's forward is measured apart)."""

    def __init__(self, output: torch.Tensor, device: Device) -> None:
        self.output = output
        self.device = device
        self.vp_stage = None
        self.inside_ms = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = self.device.mark()
        out = self.output
        self.inside_ms += self.device.ms_between(start, self.device.mark())
        return out


@contextlib.contextmanager
def _parallel_state(**values: int | None) -> Iterator[None]:
    """``parallel_state``'s cached ``_MPU_<NAME>`` values set for the duration (restored after)."""
    from megatron.core import parallel_state

    values = {name: value for name, value in values.items() if hasattr(parallel_state, f"_MPU_{name}")}
    saved = {name: getattr(parallel_state, f"_MPU_{name}") for name in values}
    for name, value in values.items():
        setattr(parallel_state, f"_MPU_{name}", value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(parallel_state, f"_MPU_{name}", value)


def _position(index: int) -> contextlib.AbstractContextManager:
    """``parallel_state`` reports pipeline rank ``index`` of :data:`PROBE_STAGES` for the duration."""
    return _parallel_state(PIPELINE_MODEL_PARALLEL_WORLD_SIZE=PROBE_STAGES, PIPELINE_MODEL_PARALLEL_RANK=index)


def _probe_args(client: Client, job: JobFlags, tp: int, mbs: int, on_cpu: bool) -> list[str]:
    """The job's command with the profiled TP, micro-batch size and 2 pipeline stages (the layers split
    as Megatron-LM accepts them); on CPU with the CPU-rank adjustments."""
    planned = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "2",
               "--micro-batch-size", str(mbs)]
    if job.num_layers % 2:
        planned += ["--decoder-first-pipeline-num-layers", str(job.num_layers - job.num_layers // 2)]
    args = rewrite(client.args, planned)
    if on_cpu:
        from poseidon_plugin.emulation import cpu_training

        args = cpu_training.apply_adjustments(args, cpu_training.flag_adjustments(args))
    return args


@contextlib.contextmanager
def _megatron_lm(client: Client, job: JobFlags, tp: int, mbs: int, tp_rank: int,
                 device: torch.device) -> Iterator[Any]:
    """Megatron-LM's global arguments for the measurement, and TP rank 0's data iterator (None elsewhere)."""
    ns = client.namespace()
    on_cpu = device.type == "cpu"
    with contextlib.ExitStack() as stack:
        if on_cpu:   # Megatron-LM's CUDA runtime calls, as on the training's CPU ranks (reverted after)
            from poseidon_plugin.emulation import megatron_training_patch as megatron_training

            if not megatron_training.TABLE.applied:
                megatron_training.TABLE.apply()
                stack.callback(megatron_training.TABLE.revert)
        yield from _megatron_lm_state(ns, client, job, tp, mbs, tp_rank, on_cpu)


def _megatron_lm_state(ns: dict, client: Client, job: JobFlags, tp: int, mbs: int, tp_rank: int,
                       on_cpu: bool) -> Iterator[Any]:
    """:func:`_megatron_lm`'s state, made and unmade."""
    import numpy
    from megatron.core import rerun_state_machine
    from megatron.core.datasets.gpt_dataset import MockGPTDataset, MockGPTLowLevelDataset
    from megatron.core.datasets.utils import Split
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    from megatron.training import arguments, global_vars
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    saved = sys.argv
    sys.argv = [client.script, *_probe_args(client, job, tp, mbs, on_cpu)]
    try:
        args = arguments.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = saved
    args.world_size = tp * 2
    with contextlib.redirect_stdout(io.StringIO()):   # Megatron-LM prints its arguments
        arguments.validate_args(args, dict(MEGATRON_LM_DEFAULTS))
    if not getattr(args, "mock_data", False):
        raise LookupError("the job reads a data set (no --mock-data); the profiler times the mock data path only")
    global_vars.set_global_variables(args, build_tokenizer=False)
    had_rerun = rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is not None
    loader = None
    try:
        data = None
        if tp_rank == 0:
            config = ns["core_gpt_dataset_config_from_args"](args)
            samples = 64 * mbs
            dataset = MockGPTDataset(MockGPTLowLevelDataset(build_tokenizer(args)), None,
                                     numpy.arange(samples), samples, Split.train, config)
            loader = build_pretraining_data_loader(dataset, 0)
            data = _cycle(loader)
        yield data
    finally:
        global_vars.unset_global_variables()
        destroy_num_microbatches_calculator()
        if not had_rerun:   # the loss function creates it; the training's initialize_megatron makes its own
            rerun_state_machine.destroy_rerun_state_machine()
        del loader


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


@contextlib.contextmanager
def _own_script(client: Client, job: JobFlags, tp: int, mbs: int, tp_rank: int,
                device: torch.device) -> Iterator[Any]:
    """``scripts/pretrain_gpt.py``: its own synthetic batches at the profiled micro-batch size."""
    ns = client.namespace()
    args = ns["parse_args"](rewrite(client.args, ["--tensor-model-parallel-size", str(tp),
                                                  "--micro-batch-size", str(mbs)]))
    yield ns["synthetic_batches"](args, job.vocab_size, device)


def kind(client: Client) -> tuple[str, Callable] | str:
    """``(name, context factory)`` of the script's kind, or why it is not understood."""
    try:
        ns = client.namespace()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- a script that does not load: not understood
        return f"{client.script} does not load as a module ({type(exc).__name__}: {exc})"
    if not callable(ns.get("forward_step")):
        return f"{client.script} defines no forward_step(data_iterator, model)"
    if "core_gpt_dataset_config_from_args" in ns and "get_batch" in ns:
        return "Megatron-LM", _megatron_lm
    if callable(ns.get("synthetic_batches")) and callable(ns.get("parse_args")):
        return "pretrain_gpt.py", _own_script
    return f"{client.script} is neither Megatron-LM's pretrain_gpt.py nor Poseidon's"


def measure(client: Client, job: JobFlags, device: Device, tp_group: Any, tp: int, mbs: int,
            output: torch.Tensor, *, iters: int) -> dict[str, float] | str:
    """Collective over the TP group: ``{"middle_step_ms", "first_step_ms", "last_step_ms"}`` (ms per forward
    micro-batch at a middle stage, and beyond that at the first and the last), or why the script's step is not
    timed. ``output``: the profiled model's per-token loss
    (what the script's loss function takes)."""
    found = kind(client)
    if isinstance(found, str):
        return found
    name, context = found
    tp_rank = tp_group.rank() if tp_group is not None else 0
    with contextlib.ExitStack() as stack:
        # the profiled model is its own data-parallel replica
        stack.enter_context(_parallel_state(DATA_PARALLEL_RANK=0, DATA_PARALLEL_WORLD_SIZE=1))
        try:   # no collective before the timed calls: every rank of the TP group fails here alike, or none
            data = stack.enter_context(context(client, job, tp, mbs, tp_rank, device.torch_device))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 -- a set-up the script refuses: priced without it
            return f"{name} script's step not set up for profiling ({type(exc).__name__}: {exc})"
        return _positions_ms(client.namespace()["forward_step"], data, output, device, iters=iters)


def _positions_ms(forward_step: Callable, data: Any, output: torch.Tensor, device: Device, *,
                  iters: int) -> dict[str, float]:
    """The script's forward step (with its loss function at the last position) outside the model, per call:
    rounds of one call at each position in turn (a change of load on the host shifts the three alike), the
    first round not timed (it starts the data loader). The middle position's median, and the medians of the
    first's and the last's excess over the middle call of the same round."""
    detached = output.detach().requires_grad_(False)
    rounds: list[list[float]] = []
    for index in range(1 + max(iters, MIN_ROUNDS)):
        costs = []
        for rank, position in enumerate(POSITIONS):
            model = _StandIn(detached, device)
            with _position(rank):
                start = device.mark()
                _, loss_func = forward_step(data, model)
                if position == "last":
                    loss_func(detached)
                stop = device.mark()
            costs.append(device.ms_between(start, stop) - model.inside_ms)
        if index:
            rounds.append(costs)
    device.synchronize()
    first, middle, last = (POSITIONS.index(p) for p in ("first", "middle", "last"))
    return {"middle_step_ms": statistics.median(r[middle] for r in rounds),
            "first_step_ms": max(statistics.median(r[first] - r[middle] for r in rounds), 0.0),
            "last_step_ms": max(statistics.median(r[last] - r[middle] for r in rounds), 0.0)}


def kind_name(client: Client) -> str | None:
    """``"Megatron-LM"``, ``"pretrain_gpt.py"``, or None for a script :func:`kind` does not understand."""
    found = kind(client)
    return None if isinstance(found, str) else found[0]


def describe(costs: dict[str, float] | str) -> str:
    """One line for the log."""
    if isinstance(costs, str):
        return f"job's own step not profiled: {costs}"
    return (f"job's own step: {costs['middle_step_ms']:.2f} ms per micro-batch, first stage "
            f"+{costs['first_step_ms']:.2f} ms, last stage +{costs['last_step_ms']:.2f} ms")


__all__ = ["Client", "POSITIONS", "describe", "kind", "kind_name", "measure"]
