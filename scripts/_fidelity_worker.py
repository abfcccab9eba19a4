"""One rank of the fidelity benchmark: real megatron-core schedules over sleep-emulated stages.

Started by ``scripts/_fidelity_pool.py`` as a long-lived subprocess (imports cost ~5 s, so a rank serves
many configurations). Protocol, one JSON object per line: the driver writes a job on stdin, the rank
answers one line on stdout prefixed by ``@@`` (anything else on stdout is library noise)::

    {"op": "run", "rank": 3, "world_size": 4, "port": 29512, "cfg": {...}}   ->  @@{"ok": true, ...}
    {"op": "exit"}

A job joins a fresh gloo group of ``world_size`` ranks, builds ``pp`` pipeline stages (``V`` chunks each,
``world_size / pp`` data-parallel replicas) whose forward and backward sleep for the configured times
inside a ``torch.autograd.Function``, wraps them in megatron-core DDP, then measures:

* ``allreduce_ms``: the duration of ``finalize_model_grads`` (the DP gradient all-reduce);
* per iteration (warm-up ones run but are not reported):
  * ``xfer_ms``: one-way time of the activation over each pipeline link just before the iteration, by
    ping-pong through the real ``P2PCommunicator``, and ``post_pingpong_ms`` (its calls' posting time);
  * ``t0`` / ``t1``: start (after a barrier) and end of ``get_forward_backward_func()(...)`` on the
    machine-wide monotonic clock;
  * ``inner_f_ms`` / ``inner_b_ms`` per chunk: time actually slept; ``op_f_ms`` / ``op_b_ms``: mean
    duration of the schedule's ``forward_step`` / ``backward_step`` calls; ``gap_ms``: the schedule's
    bookkeeping between calls, per op; ``post_ms``: mean posting time of the schedule's p2p calls.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.pipeline_parallel import p2p_communication as mc_p2p  # noqa: E402
from megatron.core.pipeline_parallel import schedules as mc_schedules  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.transformer import MegatronModule, TransformerConfig  # noqa: E402

from poseidon_plugin.emulation import cpu_shim  # noqa: E402

PREFIX = "@@"


def clock() -> float:
    """Seconds on CLOCK_MONOTONIC: one clock shared by every process of the machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class _SleepOp(torch.autograd.Function):
    """y = x * w whose forward sleeps ``f_s`` and backward ``b_s`` seconds (sleeping uses no CPU)."""

    @staticmethod
    def forward(ctx, x, w, f_s, b_s, probe):
        t = clock()
        time.sleep(f_s)
        probe.append(("F", clock() - t))
        ctx.b_s, ctx.probe = b_s, probe
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        t = clock()
        time.sleep(ctx.b_s)
        x, w = ctx.saved_tensors
        ctx.probe.append(("B", clock() - t))
        return grad * w, (grad * x).sum().reshape(1), None, None, None


class SleepStage(MegatronModule):
    """One model chunk: a scalar weight and an emulated compute time."""

    def __init__(self, config: TransformerConfig, f_ms: float, b_ms: float, n_params: int) -> None:
        super().__init__(config=config)
        self.f_s, self.b_s = f_ms / 1000.0, b_ms / 1000.0
        self.weight = torch.nn.Parameter(torch.ones(1))
        # Gives the DP all-reduce a size of our choosing; not used in compute.
        self.ballast = torch.nn.Parameter(torch.zeros(max(1, n_params)))
        self.input_tensor = None
        # Attributes finalize_model_grads looks up on the first/last stage (no tied embeddings here).
        self.pre_process = self.post_process = False
        self.share_embeddings_and_output_weights = False
        self.model_type = ModelType.encoder_or_decoder
        self.probe: list[tuple[str, float]] = []

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, first_stage_input):
        x = first_stage_input if self.input_tensor is None else self.input_tensor
        y = _SleepOp.apply(x, self.weight, self.f_s, self.b_s, self.probe)
        # Touch the ballast so that DDP sees a gradient for it (its value stays 0).
        return y + self.ballast[:1] * 0.0


class _TimedReq:
    """Wraps a p2p request so that the schedule's deferred ``wait()`` (overlap_p2p_comm) is recorded."""

    def __init__(self, req, name: str, trace: list) -> None:
        self.req, self.name, self.trace = req, name, trace

    def wait(self):
        t = clock()
        out = self.req.wait()
        self.trace.append(("W" + self.name, t, clock()))
        return out


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def _measure_transfer(comm: P2PCommunicator, pp_rank: int, pp: int, measure: bool, shape,
                      rounds: int) -> list[float]:
    """One-way ms over the link this rank sends on (pp_rank -> pp_rank+1), by ping-pong through the
    real ``P2PCommunicator``: an activation forward and a gradient back per round, as the schedule does.

    Links are measured one at a time, and only in one pipeline replica (``measure``): concurrent
    ping-pongs would compete for the CPU and inflate each other's wake-up latencies, which the mostly
    sleeping pipeline does not see. Every rank takes part in the barriers between links.
    """
    out = []
    x = torch.ones(shape)
    for link in range(pp - 1):
        dist.barrier()
        if measure and pp_rank == link:
            t = clock()
            for _ in range(rounds):
                comm.send_forward(x, is_last_stage=False)
                comm.recv_backward(shape, is_last_stage=False)
            out.append((clock() - t) / rounds / 2 * 1000.0)
        elif measure and pp_rank == link + 1:
            for _ in range(rounds):
                comm.recv_forward(shape, is_first_stage=False)
                comm.send_backward(x, is_first_stage=False)
    dist.barrier()
    return out


class _Profiler:
    """Times the schedule's compute calls and the posting part of its p2p calls, by rebinding names.

    The schedules call ``forward_step`` / ``backward_step`` through their module globals, and
    ``P2PCommunicator._communicate`` looks up ``_batched_p2p_ops`` / ``_p2p_ops`` at call time, which is
    what a profiling hook of the real runtime does as well. A call's *posting* time runs from its entry
    to the moment its sends and receives are posted (receive buffers allocated, ops issued): the part of
    a call a rank always pays, whether or not it then waits.
    """

    def __init__(self) -> None:
        self.op = {"F": [], "B": []}
        self.posts: list[float] = []
        # Every compute, p2p call and deferred wait as (what, start, end): the gaps between them are the
        # schedule's own Python time, which the stage times must include (see gap_per_op_ms).
        self.events: list[tuple[str, float, float]] = []
        self._entry = 0.0
        self._orig = (mc_schedules.forward_step, mc_schedules.backward_step, P2PCommunicator._communicate,
                      mc_p2p._batched_p2p_ops, mc_p2p._p2p_ops)

    def _timed(self, kind: str, fn):
        def timed(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                end = clock()
                self.op[kind].append(end - t)
                self.events.append((kind, t, end))
        return timed

    def _posting(self, fn):
        def posting(**k):
            out = fn(**k)
            self.posts.append(clock() - self._entry)
            return out
        return posting

    def _timed_communicate(self, comm_self, **k):
        t = self._entry = clock()
        out = self._orig[2](comm_self, **k)
        what = "".join(c for c, key in (("n", "tensor_send_next"), ("p", "tensor_send_prev"))
                       if k.get(key) is not None)
        what += "".join(c for c, key in (("P", "recv_prev"), ("N", "recv_next")) if k.get(key))
        self.events.append(("C" + what + ("" if k.get("wait_on_reqs", True) else "~"), t, clock()))
        if isinstance(out[2], dict):  # deferred waits (overlap_p2p_comm): time them too
            out = (out[0], out[1], {name: _TimedReq(req, name, self.events) for name, req in out[2].items()})
        return out

    def __enter__(self) -> "_Profiler":
        mc_schedules.forward_step = self._timed("F", self._orig[0])
        mc_schedules.backward_step = self._timed("B", self._orig[1])
        prof = self
        P2PCommunicator._communicate = lambda comm_self, **k: prof._timed_communicate(comm_self, **k)
        mc_p2p._batched_p2p_ops = self._posting(self._orig[3])
        mc_p2p._p2p_ops = self._posting(self._orig[4])
        return self

    def __exit__(self, *exc) -> None:
        (mc_schedules.forward_step, mc_schedules.backward_step, P2PCommunicator._communicate,
         mc_p2p._batched_p2p_ops, mc_p2p._p2p_ops) = self._orig

    def reset(self) -> None:
        self.op["F"].clear()
        self.op["B"].clear()
        self.posts.clear()
        self.events.clear()

    def gap_per_op_ms(self) -> float:
        """Time between consecutive recorded events (schedule bookkeeping), per compute op, in ms.

        Attributed to the compute ops because it sits between a p2p call and a compute or between two
        computes: a profiler timing "everything a rank does outside p2p calls" would include it.
        """
        ev = sorted(self.events, key=lambda e: e[1])
        gaps = sum(max(0.0, b[1] - a[2]) for a, b in zip(ev, ev[1:]))
        n_ops = len(self.op["F"]) + len(self.op["B"])
        return gaps / n_ops * 1000.0 if n_ops else 0.0


def _mean_ms(xs) -> float:
    return statistics.fmean(xs) * 1000.0 if xs else 0.0


def run_job(rank: int, world_size: int, port: int, cfg: dict) -> dict:
    """Join the group, run one configuration, return this rank's measurements.

    Every iteration (warm-up included, so that all iterations see the same pattern) is preceded by a
    short transfer ping-pong, so that each measured iteration is paired with the transfer time and the
    stage times of its own moment: on a shared machine both drift with the load.
    """
    pp, vpp = cfg["pp"], cfg["V"]
    overlap = bool(cfg.get("overlap", False))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=cfg.get("pg_timeout_s", 60)))
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        seq, mbs, hidden = cfg["seq"], cfg["mbs"], cfg["hidden"]
        config = TransformerConfig(
            num_layers=pp * vpp, hidden_size=hidden, num_attention_heads=1,
            pipeline_dtype=torch.float32, use_cpu_initialization=True,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            microbatch_group_size_per_vp_stage=pp if vpp > 1 else None,
            overlap_p2p_comm=overlap, batch_p2p_comm=not overlap)
        chunks = []
        for c in range(vpp):
            stage = SleepStage(config, cfg["f_ms"][pp_rank][c], cfg["b_ms"][pp_rank][c], cfg.get("params", 1))
            chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(), stage))
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [m.no_sync for m in chunks] if vpp > 1 else chunks[0].no_sync
        comm = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)

        ar = []
        for _ in range(cfg.get("ar_rounds", 5)):
            dist.barrier()
            t = clock()
            finalize_model_grads(chunks)
            ar.append((clock() - t) * 1000.0)

        first_input = torch.zeros(seq, mbs, hidden)
        m = cfg["M"]

        def data():
            for _ in range(m):
                yield first_input

        def forward_step_func(data_iterator, model):
            out = model(next(data_iterator) if data_iterator is not None else None)
            return out, lambda o: (o.sum() * 0.0, {"loss": o.detach().sum()})

        fwd_bwd = get_forward_backward_func()
        warmup, iters = cfg.get("warmup", 2), cfg["iters"]
        records = []
        with _Profiler() as prof:
            for it in range(warmup + iters):
                prof.reset()
                xfer = _measure_transfer(comm, pp_rank, pp, parallel_state.get_data_parallel_rank() == 0,
                                         (seq, mbs, hidden), cfg.get("xfer_rounds", 8))
                post_pingpong = _mean_ms(prof.posts) if prof.posts else None
                for ch in chunks:
                    ch.zero_grad_buffer()
                    ch.module.probe.clear()
                prof.reset()
                dist.barrier()
                t0 = clock()
                fwd_bwd(forward_step_func=forward_step_func,
                        data_iterator=[data() for _ in range(vpp)] if vpp > 1 else data(),
                        model=chunks if vpp > 1 else chunks[0],
                        num_microbatches=m, seq_length=seq, micro_batch_size=mbs, forward_only=False)
                t1 = clock()
                if it < warmup:
                    continue
                records.append({
                    "t0": t0, "t1": t1, "xfer_ms": xfer,
                    # posting time of one p2p call: in the ping-pong (part of its one-way time) and in
                    # the schedule's own calls
                    "post_pingpong_ms": post_pingpong, "post_ms": _mean_ms(prof.posts),
                    "gap_ms": prof.gap_per_op_ms(),
                    # per chunk: mean time actually slept; per rank: mean duration of the compute calls
                    "inner_f_ms": [_mean_ms([d for k, d in ch.module.probe if k == "F"]) for ch in chunks],
                    "inner_b_ms": [_mean_ms([d for k, d in ch.module.probe if k == "B"]) for ch in chunks],
                    "op_f_ms": _mean_ms(prof.op["F"]), "op_b_ms": _mean_ms(prof.op["B"]),
                })
            events = list(prof.events)
        return {"rank": rank, "pp_rank": pp_rank, "dp_rank": parallel_state.get_data_parallel_rank(),
                "allreduce_ms": _median(ar), "iters": records, "trace": events if cfg.get("trace") else []}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _reply(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    """Serve jobs from stdin until ``exit`` or end of input."""
    torch.set_num_threads(1)
    if not cpu_shim.install():
        _reply({"ok": False, "error": "an accelerator is present; the fidelity benchmark runs on CPU only"})
        return 1
    _reply({"ok": True, "ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if job.get("op") == "exit":
            break
        try:
            _reply({"ok": True, **run_job(job["rank"], job["world_size"], job["port"], job["cfg"])})
        except Exception:
            _reply({"ok": False, "rank": job.get("rank"), "error": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Skip the interpreter's teardown of torch and megatron (seconds of CPU per rank): every process
    # group is already destroyed and nothing else holds state worth flushing.
    os._exit(code)
