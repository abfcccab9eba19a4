"""CPU ranks keep Megatron's RNG semantics, and the emulation hands Megatron its own output tensors.

Defect 2 of Megatron-LM's loop on CPU: the shim used megatron-core's inference tracker, whose ``fork()``
does nothing, so tensor-parallel shards started identical and dropout streams were shared. Defect 1: the
emulation's backward-start mark returned ``output.view_as(output)``, which Megatron-LM refuses to free
(``deallocate_pipeline_outputs``: "counter-productive to free a view of another tensor").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from poseidon_plugin.emulation import cpu_shim_patch as shim_table


def _tracker():
    return shim_table.cpu_rng_tracker_class()()


def test_fork_draws_from_each_tp_rank_own_state_and_restores_the_default():
    """Two TP ranks (seed + 2718 + tp_rank, as model_parallel_cuda_manual_seed adds them) draw different
    shards under fork(); the default stream continues as if the fork had not happened."""
    shards = []
    for tp_rank in (0, 1):
        torch.manual_seed(1234)
        tracker = _tracker()
        tracker.add("data-parallel-rng", 1234)
        tracker.add("model-parallel-rng", 1234 + 2718 + tp_rank)
        with tracker.fork():
            shards.append(torch.randn(8))
        after_fork = torch.randn(4)
        torch.manual_seed(1234)
        assert torch.equal(after_fork, torch.randn(4))  # the fork did not consume the default stream
    assert not torch.equal(shards[0], shards[1])


def test_fork_continues_its_stream_nests_and_keeps_megatron_checks():
    tracker = _tracker()
    tracker.add("model-parallel-rng", 7)
    tracker.add("expert-parallel-rng", 8)
    with tracker.fork():
        first = torch.randn(3)
        with tracker.fork("expert-parallel-rng"):
            expert = torch.randn(3)
        second = torch.randn(3)
    reference = torch.Generator().manual_seed(7)
    assert torch.equal(torch.cat([first, second]), torch.randn(6, generator=reference))
    assert torch.equal(expert, torch.randn(3, generator=torch.Generator().manual_seed(8)))
    with pytest.raises(Exception, match="seed 7 already exists"):
        tracker.add("other", 7)
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("missing"):
            pass
    states = tracker.get_states()  # what checkpointing and the rerun state machine save and restore
    with tracker.fork():
        drawn = torch.randn(3)
    tracker.set_states(states)
    with tracker.fork():
        assert torch.equal(torch.randn(3), drawn)


def test_shim_seeds_tp_shards_differently_through_megatron_own_seeding():
    """megatron-core's model_parallel_cuda_manual_seed on the shim's tracker: the TP weights initialised
    under fork() differ between TP ranks (they were equal with the inference tracker)."""
    from megatron.core.tensor_parallel import random as mc_random

    from poseidon_plugin.emulation import cpu_shim

    installed_here = not cpu_shim.installed()
    cpu_shim.install(force=True)
    try:
        draws = []
        for tp_rank in (0, 1):
            mc_random.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
            with mc_random.get_cuda_rng_tracker().fork():
                draws.append(torch.empty(16).normal_())
        assert type(mc_random.get_cuda_rng_tracker()).__name__ == "CpuRNGStatesTracker"
        assert not torch.equal(draws[0], draws[1])
    finally:
        if installed_here:
            cpu_shim.uninstall()


def test_emulated_output_is_not_a_view_and_still_marks_backward_start():
    """deallocate_output_tensor asserts ``out._base is None`` on a stage's output."""
    from poseidon_plugin.emulation import compute_patch as emulation

    x = torch.randn(4, 3, requires_grad=True)
    out = x * 2
    clock = emulation._Clock()
    marked = emulation._mark_output(out, clock)
    assert marked is out and marked._base is None
    pair = emulation._mark_output((x * 3, None), emulation._Clock())
    assert pair[0]._base is None
    marked.sum().backward()
    assert clock.backward_start is not None


def test_freed_pipeline_output_keeps_the_storage_gloo_is_sending():
    """Megatron-LM frees each stage's output right after posting its send (``deallocate_pipeline_outputs``);
    gloo's send reads the old storage until it completes, so freeing it under the send made the next stage
    receive garbage: NaN losses from the third iteration of interleaved plans (p2p overlap) in bench_e2e
    --client megatron-lm. On a CPU rank the storage now outlives the send; Megatron's contract (a
    one-element output for its custom backward) is kept."""
    from megatron.core.pipeline_parallel import schedules

    from poseidon_plugin.emulation import cpu_shim

    installed_here = not cpu_shim.installed()
    cpu_shim.install(force=True)
    try:
        x = torch.randn(64, 8, requires_grad=True)
        out = x * 2
        values, pointer = out.detach().clone(), out.data_ptr()
        schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
        assert out.numel() == 1 and out.grad_fn is not None
        kept = out._poseidon_sent_storage
        assert kept.data_ptr() == pointer and torch.equal(kept, values)
        other = x * 3
        schedules.deallocate_output_tensor(other, deallocate_pipeline_outputs=False)  # not freed: untouched
        assert other.numel() == 64 * 8 and not hasattr(other, "_poseidon_sent_storage")
    finally:
        if installed_here:
            cpu_shim.uninstall()


def test_activation_recomputation_replays_the_forwards_dropout():
    """megatron-core's activation checkpointing saves every RNG state and replays the forward in backward
    (``--recompute-granularity full``, ``--recompute-activations``); it read the CUDA generator a CPU rank does
    not have ("Torch not compiled with CUDA enabled"). Replayed on the CPU generator and the tracker, the
    recomputed dropout masks are the forward's: outputs and gradients equal the run without recomputation."""
    with seeded_shim(tp_rank=1) as mc_random:
        weight = torch.randn(8, 8, requires_grad=True)

        def block(x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.dropout(x @ weight, 0.5, training=True)     # the default (CPU) stream
            with mc_random.get_cuda_rng_tracker().fork():                        # a TP region's own stream
                return torch.nn.functional.dropout(torch.tanh(y), 0.5, training=True)

        x = torch.randn(4, 8, requires_grad=True)  # checkpointing needs an input with a gradient
        states = torch.get_rng_state(), mc_random.get_cuda_rng_tracker().get_states()
        results = []
        for recompute in (False, True):
            torch.set_rng_state(states[0])
            mc_random.get_cuda_rng_tracker().set_states(dict(states[1]))  # its fork writes into the dict
            weight.grad = x.grad = None
            out = mc_random.checkpoint(block, False, x) if recompute else block(x)
            (out * torch.arange(8.0)).sum().backward()
            results.append((out.detach(), weight.grad.clone(), x.grad.clone()))
        plain, replayed = results
        assert all(torch.equal(a, b) for a, b in zip(plain, replayed))
        plain_out = plain[0]
        assert (plain_out == 0).any()  # dropout did drop: the masks were really replayed


def test_a_recomputed_forward_allocates_on_the_cpu_as_the_forward_did():
    """The replayed forward runs inside ``backward``: torch hands ``torch.autograd.backward`` to the shim's
    TorchFunctionMode, whose handler runs it with the mode off, so the replay's ``device="cuda"`` (megatron-
    core's ``get_default_causal_mask`` when no attention mask is given) reached CUDA ("Torch not compiled
    with CUDA enabled"). The shim keeps its mode on for the autograd engine's Python code: the replay
    allocates on the CPU, and the gradients equal those without recomputation."""
    with seeded_shim(tp_rank=0) as mc_random:
        weight = torch.randn(8, 8, requires_grad=True)

        def block(x: torch.Tensor) -> torch.Tensor:
            mask = torch.triu(torch.ones(4, 8, device="cuda"), diagonal=1).bool()
            return torch.tanh(x @ weight).masked_fill(mask, 0.0)

        x = torch.randn(4, 8, requires_grad=True)
        grads = []
        for recompute in (False, True):
            for backward in (torch.autograd.backward, torch.Tensor.backward):
                weight.grad = x.grad = None
                out = mc_random.checkpoint(block, False, x) if recompute else block(x)
                backward((out * torch.arange(8.0)).sum())
                grads.append((weight.grad.clone(), x.grad.clone()))
        assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


@contextlib.contextmanager
def seeded_shim(tp_rank: int):
    """The CPU shim installed (and removed after, where this installed it), megatron-core's RNG seeded
    for ``tp_rank``; yields ``megatron.core.tensor_parallel.random``."""
    from megatron.core.tensor_parallel import random as mc_random

    from poseidon_plugin.emulation import cpu_shim

    installed_here = not cpu_shim.installed()
    cpu_shim.install(force=True)
    try:
        mc_random.model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        yield mc_random
    finally:
        if installed_here:
            cpu_shim.uninstall()
