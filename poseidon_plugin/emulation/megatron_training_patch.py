"""CPU stand-ins for the CUDA calls Megatron-LM's training loop (``megatron.training``) makes, as a patch table.

Applied on CPU ranks only, after the megatron-core shim (``emulation/cpu_shim_patch.py``), when the training script
runs on ``megatron.training`` (``emulation/cpu_training.py`` decides and logs each row once). Each row
replaces one call that is about the CUDA runtime, never about compute; the facts are in docs/RUNTIME.md
("Megatron-LM's own pretrain_gpt.py on CPU ranks"):

* ``initialize_megatron`` asserts ``torch.cuda.is_available()``: called with its own ``allow_no_cuda=True``;
* ``_initialize_distributed`` builds the model-parallel groups and ``_set_random_seed`` seeds the
  model-parallel RNG tracker only when ``torch.cuda.device_count() > 0``: both run with the count of
  this rank's one compute device (the CPU), only for the length of the call;
* ``_compile_dependencies`` builds the dataset helper with ``make`` and the fused kernels with nvcc: skipped
  (the wheel ships the built helper; the fused kernels are CUDA code);
* ``set_jit_fusion_options`` warms up the fused CUDA kernels: skipped; ``torch._dynamo`` is disabled, so that
  the ``torch.compile``-fused functions run eagerly on CPU;
* ``get_device_arch_version`` asks the GPU's compute capability: 0 (no CUDA architecture; the pre-Blackwell
  rules, which ``poseidon-run``'s ``CUDA_DEVICE_MAX_CONNECTIONS=1`` satisfies);
* ``build_train_valid_test_data_iterators`` draws a worker seed from torch's default generator (the
  ``DataLoader`` iterator's base seed): on a GPU that is the CPU generator, and dropout draws from the CUDA
  one; on a CPU rank the default generator is the one dropout draws from, so the draw would shift a run
  resumed from a checkpoint (whose RNG state is loaded before the iterators are built) off the stream of the
  uninterrupted run: the call runs with that generator's state kept;

megatron-core's own checks of CUDA tensor-type names (gradient clipping, the mixed-precision and distributed
optimizers) are the megatron-core shim's (``emulation/cpu_shim_patch.py``): every client meets them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from poseidon_plugin.patches.table import LazyPatchTable, Patch

_INIT = "megatron.training.initialize"

ROW_NOTES: dict[str, str] = {
    f"{_INIT}.initialize_megatron": "initialize_megatron(allow_no_cuda=True): it asserts torch.cuda.is_available()",
    f"{_INIT}._initialize_distributed": "model-parallel groups built with the CPU as the rank's one device "
                                        "(Megatron-LM builds them only when torch.cuda.device_count() > 0)",
    f"{_INIT}._set_random_seed": "model-parallel RNG seeded with the CPU as the rank's one device (Megatron-LM "
                                 "seeds its tracker only when torch.cuda.device_count() > 0)",
    f"{_INIT}._compile_dependencies": "skipped helper compilation (make in megatron/core/datasets, nvcc fused "
                                      "kernels)",
    "megatron.training.training.set_jit_fusion_options": "skipped the fused-kernel warm-up; torch._dynamo "
                                                         "disabled (torch.compile-fused functions run eagerly)",
    "torch._dynamo.config.disable": "",
    "megatron.training.utils.get_device_arch_version": "CUDA architecture 0 (no GPU)",
    "megatron.training.training.build_train_valid_test_data_iterators": "data iterators built with the CPU "
                                                                         "generator's state kept (it stands "
                                                                         "in for the CUDA generator dropout "
                                                                         "draws from)",
}
"""What each row does, for the one log line per CPU-only adjustment (rows without a note share the previous
row's line)."""


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """``torch.cuda.device_count()`` counts the rank's one compute device while Megatron-LM decides whether to
    set up model parallelism; restored right after (nothing else sees it)."""
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = original


@contextlib.contextmanager
def _kept_generator_state() -> Iterator[None]:
    """Draws from torch's default (CPU) generator inside leave it as it was: on a GPU they would not touch the
    CUDA generator that dropout uses, and on a CPU rank the CPU generator plays that part."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _allow_no_cuda(original: Any):
    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)
    return initialize_megatron


def _inside(context: Callable[[], contextlib.AbstractContextManager]):
    """Wrapper factory: the original runs inside a fresh ``context()``, and nothing outside the call sees it."""
    def make(original: Any):
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            with context():
                return original(*args, **kwargs)
        return call
    return make


def _skipped(original: Any):
    @functools.wraps(original)
    def skipped(*args: Any, **kwargs: Any) -> None:
        return None
    return skipped


def _no_cuda_arch(original: Any):
    @functools.wraps(original)
    def get_device_arch_version() -> int:
        return 0
    return get_device_arch_version


def _rows() -> tuple[Patch, ...]:
    """The rows, built when the table is applied: importing ``megatron.training`` is the training script's
    business."""
    return (
        Patch(target=f"{_INIT}.initialize_megatron", make=_allow_no_cuda, sweep=True),
        Patch(target=f"{_INIT}._initialize_distributed", make=_inside(_one_device)),
        Patch(target=f"{_INIT}._set_random_seed", make=_inside(_one_device)),
        Patch(target=f"{_INIT}._compile_dependencies", make=_skipped),
        Patch(target="megatron.training.training.set_jit_fusion_options", make=_skipped, sweep=True),
        Patch(target="torch._dynamo.config.disable", make=lambda original: True, value=True),
        Patch(target="megatron.training.utils.get_device_arch_version", make=_no_cuda_arch, sweep=True),
        Patch(target="megatron.training.training.build_train_valid_test_data_iterators",
              make=_inside(_kept_generator_state), sweep=True),
    )


TABLE = LazyPatchTable("megatron_training", _rows)
