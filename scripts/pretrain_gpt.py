"""A small GPT pre-training script on megatron-core, with Megatron-LM's flag names.

Runs under ``torchrun`` (or ``poseidon-run``) on GPUs, or on CPU/gloo through Poseidon's CPU shim::

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --num-layers 4 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --vocab-size 512 --micro-batch-size 1 \\
        --global-batch-size 8 --pipeline-model-parallel-size 2 --train-iters 3

It is what Megatron-LM's ``pretrain_gpt.py`` does, cut to the bone: GPTModel (megatron-core local spec),
the real pipeline schedules from ``get_forward_backward_func()``, DDP + ``finalize_model_grads``, Megatron's
Adam, synthetic token data (``--mock-data`` is the only data source), and one log line per iteration on the
last pipeline stage: ``iteration 1/3 | lm loss 6.2431 | 0.52 s`` (the loss averaged over the global batch, as
Megatron-LM logs it). Uneven and interleaved splits are given with ``--pipeline-model-parallel-layout`` exactly
as in Megatron-LM, or, one chunk per stage, with MindSpeed-LLM's ``--num-layer-list`` (any core, including 0.12
without the layout flag).

Checkpoints as Megatron-LM's ``--save DIR --save-interval N --load DIR`` with ``--ckpt-format torch_dist``
(megatron-core's ``dist_checkpointing``): ``DIR/iter_0000004`` holds the model and the optimizer sharded by
what they are, not by who held them, so a job restarted under another plan (TP, PP, DP, uneven or interleaved
split) loads it and continues from the saved iteration; ``DIR/latest_checkpointed_iteration.txt`` names the
last complete one. ``--load`` of a folder without a checkpoint starts from iteration 0, as Megatron-LM does.
The synthetic data is drawn per global sample index, so the batches after a resume are those an
uninterrupted run would have trained on, whatever the plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from poseidon_plugin.emulation import cpu_shim
from poseidon_plugin.runtime.job_flags import read_job
from poseidon_plugin.runtime.megatron_model import gpt_model, stage_position, transformer_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Megatron-LM's names for the flags this script understands (unknown flags are an error, exit 2)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add = p.add_argument
    # Model (read again, with the same rules as the profiler, by job_flags.read_job).
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
                 "--seq-length", "--max-position-embeddings", "--vocab-size", "--num-experts", "--moe-router-topk",
                 "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"):
        add(flag, type=int)
    add("--moe-expert-capacity-factor", type=float, default=None)
    add("--moe-pad-expert-input-to-capacity", action="store_true")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        add(flag, type=float)
    add("--normalization", choices=("LayerNorm", "RMSNorm"))
    add("--position-embedding-type", choices=("learned_absolute", "rope"))
    for flag in ("--group-query-attention", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--bf16", "--fp16", "--use-cpu-initialization", "--mock-data", "--sequence-parallel",
                 "--use-distributed-optimizer", "--recompute-activations"):
        add(flag, action="store_true")
    # activation recomputation (read by job_flags.read_job, built by megatron_model.transformer_config)
    add("--recompute-granularity", choices=("full", "selective"), default=None)
    add("--recompute-method", choices=("uniform", "block"), default=None)
    add("--recompute-num-layers", type=int, default=None)
    add("--tokenizer-type", default="NullTokenizer", choices=("NullTokenizer",))
    # embedding rows: --vocab-size padded to a multiple of this x TP, as Megatron-LM pads them
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--transformer-impl", default="local", choices=("local",))
    # Parallelism and batch.
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-layout", type=str, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    add("--decoder-first-pipeline-num-layers", type=int, default=None)
    add("--decoder-last-pipeline-num-layers", type=int, default=None)
    add("--num-layer-list", type=str, default=None)  # MindSpeed-LLM's uneven split: one count per stage
    add("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    add("--expert-model-parallel-size", type=int, default=1)
    add("--expert-tensor-parallel-size", type=int, default=None)
    add("--moe-token-dispatcher-type", default="allgather", choices=("allgather", "alltoall"))
    add("--micro-batch-size", type=int, default=1)
    add("--global-batch-size", type=int, default=None)
    # Training.
    add("--train-iters", type=int, default=10)
    add("--lr", type=float, default=1e-4)
    add("--weight-decay", type=float, default=0.01)
    add("--clip-grad", type=float, default=1.0)
    add("--seed", type=int, default=1234)
    add("--log-interval", type=int, default=1)
    # Checkpoints (Megatron-LM's names; torch_dist is the format that reshards across plans).
    add("--save", type=str, default=None)
    add("--load", type=str, default=None)
    add("--save-interval", type=int, default=None)
    add("--ckpt-format", default="torch_dist", choices=("torch_dist",))
    add("--ckpt-step", type=int, default=None)  # load this iteration instead of the tracker's
    add("--no-load-optim", action="store_true")  # the weights only: a fresh optimizer
    args = p.parse_args(argv)
    if args.save_interval is not None and args.save_interval < 1:
        p.error(f"--save-interval {args.save_interval}: give a number of iterations >= 1")
    if args.global_batch_size is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        args.global_batch_size = args.micro_batch_size * world // (
            args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    return args


def init_distributed() -> torch.device:
    """Join the job's process group (kept when a launcher already created it) and pick the device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        cpu_shim.install()
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def build_model(args: argparse.Namespace, job, config) -> list[DistributedDataParallel]:
    """One DDP-wrapped GPTModel chunk per virtual stage of this rank."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = None if vpp is None else vp_stage
        pre_process, post_process = stage_position(stage)
        model = gpt_model(job, config, pre_process=pre_process, post_process=post_process, vp_stage=stage,
                          vocab_divisible_by=args.make_vocab_size_divisible_by)
        if torch.cuda.is_available():
            model.cuda()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=job.dtype != "fp32", overlap_grad_reduce=False,
                                                   use_distributed_optimizer=args.use_distributed_optimizer)
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                              disable_bucketing=vp_stage > 0))
    return chunks


def synthetic_batches(args: argparse.Namespace, vocab: int, device: torch.device, first_iteration: int = 1):
    """Endless deterministic micro-batches of random tokens from iteration ``first_iteration`` on (the same
    sequence on every chunk of a DP replica).

    Sample ``k`` of the run (``k = (iteration - 1) x global batch + j``) is drawn from a generator seeded with
    ``k``, and micro-batch ``m`` of DP rank ``r`` holds samples ``(m x DP + r) x mbs ...``, Megatron's
    order: every plan trains an iteration on the same global batch."""
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    mbs, per_rank = args.micro_batch_size, args.global_batch_size // (args.micro_batch_size * dp)
    positions = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(mbs, -1)
    iteration = first_iteration
    while True:
        for m in range(per_rank):
            first = (iteration - 1) * args.global_batch_size + (m * dp + dp_rank) * mbs
            tokens = torch.stack([torch.randint(0, vocab, (args.seq_length + 1,),
                                                generator=torch.Generator().manual_seed(args.seed * 1_000_003 + k))
                                  for k in range(first, first + mbs)]).to(device)
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                   "position_ids": positions}
        iteration += 1


def _print_local_experts(chunks) -> None:
    """One line per rank: the experts its MoE layers hold (``num_experts / EP`` of them)."""
    held = sorted({int(i) for chunk in chunks for module in chunk.modules()
                   for i in getattr(module, "local_expert_indices", ())})
    ep = parallel_state.get_expert_model_parallel_world_size()
    print(f"rank {dist.get_rank()}: experts {','.join(map(str, held))} of its MoE layers (EP {ep})", flush=True)


def forward_step(data_iterator, model):
    """Megatron's forward-step contract: (output tensor, loss function of that output)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["labels"])


def _loss(labels: torch.Tensor, per_token_loss: torch.Tensor):
    loss = per_token_loss.float().mean()
    # clone: the schedule scales the returned loss in place by 1/num_microbatches.
    return loss, {"lm loss": loss.detach().clone()}


def main(argv: list[str] | None = None) -> int:
    """Train ``--train-iters`` iterations; print the loss per iteration on the last pipeline stage."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    job = read_job("pretrain_gpt.py", argv)
    device = init_distributed()
    torch.manual_seed(args.seed)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_virtual_stages(args),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    model_parallel_cuda_manual_seed(args.seed)  # on CPU: the shim's tracker on CPU generator states
    on_cpu = device.type == "cpu"
    overrides = {}
    if job.num_experts:     # the expert layout (the plan's flags under poseidon-run)
        overrides.update(expert_model_parallel_size=args.expert_model_parallel_size,
                         expert_tensor_parallel_size=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
                         moe_token_dispatcher_type=args.moe_token_dispatcher_type)
    if args.decoder_first_pipeline_num_layers is not None:
        overrides["num_layers_in_first_pipeline_stage"] = args.decoder_first_pipeline_num_layers
    if args.decoder_last_pipeline_num_layers is not None:
        overrides["num_layers_in_last_pipeline_stage"] = args.decoder_last_pipeline_num_layers
    # As Megatron-LM: p2p overlap exists only in the interleaved schedule.
    overlap_p2p = args.overlap_p2p_comm and _virtual_stages(args) is not None
    config = transformer_config(
        job, tensor_parallel=args.tensor_model_parallel_size, pipeline_parallel=args.pipeline_model_parallel_size,
        layout=args.pipeline_model_parallel_layout, on_cpu=on_cpu,
        virtual_pipeline_model_parallel_size=_virtual_stages(args), overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p, **overrides,
    )
    dp = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                         f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, dp)

    _apply_layer_list(args)
    chunks = build_model(args, job, config)
    if job.num_experts:
        _print_local_experts(chunks)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in chunks] if len(chunks) > 1 else chunks[0].no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay, bf16=job.dtype == "bf16",
                        fp16=job.dtype == "fp16", params_dtype=config.params_dtype,
                        clip_grad=args.clip_grad,
                        use_distributed_optimizer=args.use_distributed_optimizer),
        chunks,
    )
    done = load_checkpoint(args, chunks, optimizer) if args.load else 0
    iterators = [synthetic_batches(args, job.vocab_size, device, done + 1) for _ in chunks]
    forward_backward = get_forward_backward_func()
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    logging_rank = (last_stage and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank() == 0)
    saved = done
    for iteration in range(done + 1, args.train_iters + 1):
        start = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        update_ok, _, _ = optimizer.step()
        if last_stage and iteration % args.log_interval == 0:
            loss = torch.stack([entry["lm loss"] for entry in losses]).mean()
            # the global batch's loss, as Megatron-LM logs it: the mean over the DP replicas' micro-batches
            dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = loss.item() / parallel_state.get_data_parallel_world_size()
            if logging_rank:
                print(f"iteration {iteration}/{args.train_iters} | lm loss {loss:.4f} | "
                      f"{time.perf_counter() - start:.2f} s{'' if update_ok else ' | skipped'}", flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, chunks, optimizer, iteration)
            saved = iteration
    if args.save and saved < args.train_iters:  # Megatron-LM saves the last iteration too
        save_checkpoint(args, chunks, optimizer, args.train_iters)
    parallel_state.destroy_model_parallel()
    return 0


TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's name for the file that names a checkpoint folder's last complete iteration."""


def _sharded_state(chunks: list[DistributedDataParallel], optimizer, *, is_loading: bool) -> dict:
    """The model chunks and the optimizer as megatron-core sharded tensors, keyed by what they hold (layer
    numbers are global, TP shards are offsets into the full tensor), as Megatron-LM builds them."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state = {}
    for index, chunk in enumerate(chunks):
        # the model itself, not its DDP wrapper (as Megatron-LM's unwrap_model): keys without "module."
        state["model" if len(chunks) == 1 else f"model{index}"] = chunk.module.sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    return state


def save_checkpoint(args: argparse.Namespace, chunks, optimizer, iteration: int) -> None:
    """``--save DIR``: the model and optimizer after ``iteration`` in ``DIR/iter_NNNNNNN`` (torch_dist), then
    the tracker file, so a checkpoint cut short by a failure is never the one loaded."""
    from megatron.core import dist_checkpointing

    folder = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    state = _sharded_state(chunks, optimizer, is_loading=False)
    state["iteration"] = iteration
    dist_checkpointing.save(state, folder)
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = os.path.join(args.save, TRACKER)
        with open(tracker + ".tmp", "w", encoding="utf-8") as f:
            f.write(f"{iteration}\n")
        os.replace(tracker + ".tmp", tracker)
        print(f"saved checkpoint at iteration {iteration} to {args.save}", flush=True)
    dist.barrier()


def load_checkpoint(args: argparse.Namespace, chunks, optimizer) -> int:
    """``--load DIR``: the last complete checkpoint into the model and optimizer, resharded for this plan;
    the iteration it was saved at (0 when ``DIR`` holds none)."""
    from megatron.core import dist_checkpointing

    tracker = os.path.join(args.load, TRACKER)
    try:
        with open(tracker, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.load} ({TRACKER} not found); training from iteration 0", flush=True)
        return 0
    if not text.isdigit():
        raise SystemExit(f"--load {args.load}: {TRACKER} holds {text[:40]!r}, not an iteration number; "
                         f"remove it to train from iteration 0")
    iteration = int(text) if args.ckpt_step is None else args.ckpt_step
    folder = os.path.join(args.load, f"iter_{iteration:07d}")
    if not os.path.isdir(folder):
        raise SystemExit(f"--ckpt-step {iteration}: {args.load} has no checkpoint of that iteration "
                         f"({os.path.basename(folder)} not found)")
    started = time.perf_counter()
    state = _sharded_state(chunks, None if args.no_load_optim else optimizer, is_loading=True)
    state["iteration"] = iteration
    loaded = dist_checkpointing.load(state, folder)
    for index, chunk in enumerate(chunks):
        chunk.module.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{index}"])
    if not args.no_load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    if dist.get_rank() == 0:
        print(f"loaded checkpoint from {args.load} at iteration {iteration} (TP "
              f"{parallel_state.get_tensor_model_parallel_world_size()} PP "
              f"{parallel_state.get_pipeline_model_parallel_world_size()} DP "
              f"{parallel_state.get_data_parallel_world_size()}) in {time.perf_counter() - started:.2f} s", flush=True)
    return iteration


def _apply_layer_list(args: argparse.Namespace) -> None:
    """``--num-layer-list 5,3``: layers per pipeline stage, as MindSpeed-LLM takes them on megatron-core 0.12,
    put into effect through Poseidon's layer-assignment table (poseidon-run has already applied it)."""
    if not args.num_layer_list:
        return
    from megatron.core.transformer import transformer_block

    from poseidon_plugin.patches import layer_assignment

    try:
        layers = [int(n) for n in args.num_layer_list.split(",")]
    except ValueError:
        layers = []
    pp = args.pipeline_model_parallel_size
    if len(layers) != pp or min(layers, default=0) < 1 or sum(layers) != args.num_layers:
        raise SystemExit(f"--num-layer-list {args.num_layer_list!r} must give {pp} counts >= 1 (one per pipeline "
                         f"stage) adding up to --num-layers {args.num_layers}, e.g. "
                         f"{','.join([str(args.num_layers // pp)] * pp)}")
    if not hasattr(transformer_block.get_num_layers_to_build, "__poseidon_patch__"):
        layer_assignment.table(layers, pp).apply()


def _virtual_stages(args: argparse.Namespace) -> int | None:
    """Virtual stages per pipeline rank, from the layout (stages / PP) or the explicit flag."""
    if args.pipeline_model_parallel_layout:
        # megatron-core >= 0.13 only; older cores (MindSpeed-LLM's 0.12) never get a layout from Poseidon.
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(args.pipeline_model_parallel_layout)
        vpp = stages // args.pipeline_model_parallel_size
    else:
        vpp = args.num_virtual_stages_per_pipeline_rank or 1
    return vpp if vpp > 1 else None


if __name__ == "__main__":
    sys.exit(main())
