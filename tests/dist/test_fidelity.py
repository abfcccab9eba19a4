"""Real megatron-core on gloo/CPU: the CPU shim runs GPTModel through the real schedules, and the
simulator's ``megatron`` comm model stays within a loose bound of measured emulated runs."""

from __future__ import annotations

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")


def _gpt_pipeline_body(rank: int, world_size: int, pp: int, vpp: int | None, overlap: bool) -> dict:
    """Train a tiny GPTModel for 3 steps with pp stages (and optional virtual stages) on CPU."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from poseidon_plugin.emulation import cpu_shim

    assert cpu_shim.install(), "the test machine unexpectedly has an accelerator"
    try:
        parallel_state.initialize_model_parallel(1, pp, virtual_pipeline_model_parallel_size=vpp)
        torch.manual_seed(1234)
        seq, mbs, hidden, vocab, micro_batches = 16, 2, 32, 64, 4
        chunks = vpp or 1
        config = TransformerConfig(
            num_layers=2 * pp * chunks,
            hidden_size=hidden,
            num_attention_heads=4,
            use_cpu_initialization=True,
            pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vpp,
            microbatch_group_size_per_vp_stage=pp if vpp else None,
            overlap_p2p_comm=overlap,
            batch_p2p_comm=not overlap,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        model = []
        for vp_stage in range(chunks):
            kw = {"vp_stage": vp_stage} if vpp else {}
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kw)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kw)
            gpt = GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=vocab,
                max_sequence_length=seq,
                pre_process=pre,
                post_process=post,
                **kw,
            )
            model.append(DistributedDataParallel(config, DistributedDataParallelConfig(), gpt))
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in model] if vpp else model[0].no_sync
        params = [p for m in model for p in m.parameters()]
        opt = torch.optim.Adam(params, lr=1e-2)

        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (micro_batches, mbs, seq), generator=gen)

        def data():
            for i in range(micro_batches):
                t = tokens[i]
                yield {
                    "tokens": t,
                    "labels": torch.roll(t, -1, dims=1),
                    "position_ids": torch.arange(seq).expand(mbs, seq),
                    "attention_mask": torch.ones(mbs, 1, seq, seq, dtype=torch.bool).tril().logical_not(),
                }

        def forward_step(data_iterator, m):
            batch = next(data_iterator)
            out = m(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"loss": loss.detach()}

            return out, loss_func

        fwd_bwd = get_forward_backward_func()
        losses = []
        for _ in range(3):
            for m in model:
                m.zero_grad_buffer()
            opt.zero_grad()
            iters = [data() for _ in range(chunks)] if vpp else data()
            out = fwd_bwd(
                forward_step_func=forward_step,
                data_iterator=iters,
                model=model if vpp else model[0],
                num_microbatches=micro_batches,
                seq_length=seq,
                micro_batch_size=mbs,
                forward_only=False,
            )
            for p in params:  # megatron DDP accumulates into main_grad; torch optimizers read grad
                p.grad = p.main_grad
            opt.step()
            if out:
                losses.append(sum(float(d["loss"]) for d in out) / len(out))
        grad_norm = math.sqrt(sum(float(p.main_grad.norm()) ** 2 for p in params))
        return {"losses": losses, "grad_norm": grad_norm}
    finally:
        parallel_state.destroy_model_parallel()
        cpu_shim.uninstall()


def test_cpu_shim_install_is_idempotent_and_reversible():
    """install() twice, uninstall() twice: torch.cuda and the mode stack come back exactly as they were."""
    from poseidon_plugin.emulation import cpu_shim

    before = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "current_stream")}
    modes = len(torch.overrides._get_current_function_mode_stack())
    assert cpu_shim.install() and cpu_shim.install()
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
    finally:
        cpu_shim.uninstall()
    cpu_shim.uninstall()
    assert not cpu_shim.installed()
    assert {name: getattr(torch.cuda, name) for name in before} == before
    assert len(torch.overrides._get_current_function_mode_stack()) == modes
    with cpu_shim.cpu_shim() as active:
        assert active and torch.empty(1, device="cuda:0").device.type == "cpu"
    assert not cpu_shim.installed()


@pytest.mark.parametrize(
    ("vpp", "overlap"),
    [(None, False), (2, False), (2, True)],
    ids=["1f1b", "interleaved", "interleaved-overlap"],
)
def test_cpu_shim_trains_gptmodel_through_real_schedules(gloo_pool, vpp, overlap):
    """GPTModel on 2 pipeline stages learns a fixed batch through megatron's own schedule and DDP."""
    results = gloo_pool(2).run(_gpt_pipeline_body, 2, vpp, overlap, timeout_s=120)
    first, last = results
    assert first["losses"] == []  # only the last stage sees losses
    losses = last["losses"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], f"loss did not decrease over 3 Adam steps: {losses}"
    assert first["grad_norm"] > 0 and last["grad_norm"] > 0  # gradients reached both stages


# --------------------------------------------------------------------------------------------------
# Simulator fidelity (loose bound; the precise figures come from scripts/bench_fidelity.py)
# --------------------------------------------------------------------------------------------------

_SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


@pytest.fixture(scope="module")
def fidelity_pool():
    """Four long-lived benchmark ranks (scripts/_fidelity_worker.py), shared by the fidelity cases."""
    sys.path.insert(0, _SCRIPTS)
    try:
        from _fidelity_pool import FidelityPool

        pool = FidelityPool(4)
        yield pool
        pool.close()
    finally:
        sys.path.remove(_SCRIPTS)


def _fidelity_cases():
    return [
        ("1f1b", dict(schedule="1f1b", pp=4, m=8, spread=3.0, pattern=1)),
        ("interleaved", dict(schedule="interleaved-1f1b", pp=2, m=4, v=2, spread=2.0)),
        ("interleaved+overlap", dict(schedule="interleaved-1f1b", pp=4, m=4, v=2, overlap=True, spread=3.0,
                                     pattern=2)),
    ]


@pytest.mark.parametrize(("variant", "spec"), _fidelity_cases(), ids=[c[0] for c in _fidelity_cases()])
def test_megatron_comm_model_prices_the_real_schedules_it_measures(fidelity_pool, variant, spec):
    """Real megatron-core schedules over sleep-emulated stages, priced by the simulator's ``megatron``
    model from what they measured. How close the prediction comes is a timing, so it is
    ``scripts/bench_fidelity.py``'s (with its targets), not a pass/fail bound here; what is checked is
    what load cannot change: every stage slept its compute (a sleep never ends early, so an iteration
    lasts at least its busiest stage's compute), and the prediction built from the measurement is a
    finite schedule of at least that length."""
    sys.path.insert(0, _SCRIPTS)
    try:
        import _fidelity_configs as fc
    finally:
        sys.path.remove(_SCRIPTS)
    spec = dict(spec)
    cfg = fc.config(variant, spec.pop("schedule"), spec.pop("pp"), spec.pop("m"), spec.pop("v", 1),
                    base_ms=3.0, **spec)
    assert fc.variant(cfg) == variant
    iters = 3
    answers = fidelity_pool.run(dict(cfg, iters=iters, warmup=1), cfg["pp"] * cfg["dp"], timeout_s=60)
    assert sorted(a["pp_rank"] for a in answers) == sorted(list(range(cfg["pp"])) * cfg["dp"])
    for i in range(iters):
        measured = fc.measured_ms(answers, i)
        doc = fc.stage_input(cfg, answers, i)
        assert len(doc["stages"]) == cfg["pp"]
        busiest = max(cfg["M"] * sum(s["forward_ms"]) + cfg["M"] * sum(s["backward_ms"]) for s in doc["stages"])
        assert measured >= busiest * 0.99
        predicted = fc.predicted_ms(cfg, answers, i, "megatron")
        assert math.isfinite(predicted) and predicted >= busiest * 0.99
