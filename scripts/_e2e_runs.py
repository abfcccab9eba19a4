"""Helpers of ``scripts/bench_e2e.py``: the emulated clusters, the plans to compare, one launch and its parse.

Torch-free here (the launches are subprocesses); the planning side uses the cost model, the search and
the profile written by Poseidon's own run on the same cluster.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from poseidon_plugin.costmodel import Candidate, CostModel
from poseidon_plugin.errors import InputError
from poseidon_plugin.plan import Plan
from poseidon_plugin.emulation import harness as emulation
from poseidon_plugin.runtime.job_flags import read_job
from poseidon_plugin.runtime.job_spec import job_name, model_spec
from poseidon_plugin.search import SearchOptions
from poseidon_plugin.search.baselines import best_uniform
from poseidon_plugin.specs import device_presets, load_profile
from poseidon_plugin.target import TargetRuntime, plan_as_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "scripts/pretrain_gpt.py"
MEGATRON_LM_ENV = "POSEIDON_MEGATRON_LM"
MEGATRON_LM_DEFAULT = os.path.join(os.path.dirname(REPO), "shared", "megatron-lm", "core_v0.16.1")
# What Megatron-LM's own script needs besides the job's flags on this machine: data, a position table as long
# as the sequence, a log line per iteration (its wall time is read like the project script's)
MEGATRON_LM_FLAGS = ["--max-position-embeddings", "32", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                     "--log-interval", "1"]
_client: dict[str, Any] = {"script": SCRIPT, "extra": []}


def use_client(name: str) -> str:
    """``--client``: ``poseidon`` (scripts/pretrain_gpt.py) or ``megatron-lm`` (Megatron-LM's own pretrain_gpt.py
    from the checkout in POSEIDON_MEGATRON_LM, default ../shared/megatron-lm/core_v0.16.1); the script used."""
    if name == "megatron-lm":
        folder = os.environ.get(MEGATRON_LM_ENV) or MEGATRON_LM_DEFAULT
        script = os.path.join(folder, "pretrain_gpt.py")
        if not os.path.isfile(script):
            raise SystemExit(f"--client megatron-lm: {script} not found; set {MEGATRON_LM_ENV} to a Megatron-LM "
                             f"checkout (tag core_v0.16.1)")
        _client.update(script=script, extra=list(MEGATRON_LM_FLAGS))
    else:
        _client.update(script=SCRIPT, extra=[])
    return _client["script"]
COMM_MODEL = "megatron"  # what poseidon-run plans with (runtime/planning.py)
WARMUP_ITERS = 2
MEASURED_ITERS = 5
# the watch times iteration n when step n + 1 starts, so the last iteration of a run is never timed
MIN_ITERS = WARMUP_ITERS + MEASURED_ITERS + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterCase:
    """One emulated cluster and the job trained on it."""

    name: str
    emulate: str                     # --poseidon-emulate
    model: str                       # --poseidon-emulate-model
    layers: int
    global_batch: int
    why: str                         # what this case exercises
    micro_batch_sizes: str = "1,2"
    extra: tuple[str, ...] = ()      # more job flags (an MoE job's)

    @property
    def ranks(self) -> int:
        return sum(int(part.rpartition(":")[2]) for part in self.emulate.split(","))

    def job(self) -> list[str]:
        return ["--num-layers", str(self.layers), "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--vocab-size", "512", "--micro-batch-size", "1",
                "--global-batch-size", str(self.global_batch), "--hidden-dropout", "0", "--attention-dropout", "0",
                *self.extra]

    def type_speed_ratio(self) -> float:
        from poseidon_plugin.specs.cluster import _device_presets

        peaks = [_device_presets()[0][p.rpartition(":")[0]]["peak_tflops"] for p in self.emulate.split(",")]
        return max(peaks) / min(peaks)


CLUSTERS = (
    ClusterCase(name="a2x2+a2-4x2", emulate="A2-2:2,A2-4:2", model="llama3-8b", layers=8, global_batch=8,
                why="4 ranks, 2 types 1.34x apart"),
    ClusterCase(name="a2x4+a2-4x4", emulate="A2-2:4,A2-4:4", model="llama3-8b", layers=16, global_batch=16,
                why="8 ranks, 2 types 1.34x apart"),
    ClusterCase(name="4090x4+a100x4 mem", emulate="RTX-4090:4,A100-80G:4", model="llama2-13b:auto:gpu", layers=16,
                global_batch=16, why="memory binds: 24 GiB RTX-4090 next to 80 GiB A100"),
    ClusterCase(name="a2-2x4+a2-3x4 wan", emulate="A2-2:4,A2-3:4", model="llama3-8b:auto:npu-wan", layers=16,
                global_batch=16, why="slow cross-type link (10 Gbps WAN)"),
    ClusterCase(name="3 types x12", emulate="A2-2:4,A2-3:4,A2-4:4", model="llama3-8b", layers=24, global_batch=24,
                why="3 device types, 12 ranks"),
    ClusterCase(name="a2x8+3090x8", emulate="A2-2:8,RTX-3090:8", model="llama3-8b:auto:gpu", layers=16,
                global_batch=16, why="16 ranks, types 5.3x apart"),
    ClusterCase(name="a2x2+a2-4x2 moe", emulate="A2-2:2,A2-4:2", model="mixtral-8x7b", layers=4, global_batch=8,
                why="MoE: 4 experts, top-2, the expert layout searched (EP 1 or 2)",
                extra=("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear")),
)
QUICK = ("a2x2+a2-4x2",)


# --- plans ------------------------------------------------------------------------------------------------


def job_model(case: ClusterCase) -> Any:
    """The ModelSpec of the job that really runs on ``case`` (what poseidon-run plans for)."""
    flags = read_job(SCRIPT, case.job())
    return model_spec(flags, global_batch_size=case.global_batch, name=job_name(SCRIPT, flags))


def emulation_state(case: ClusterCase) -> emulation.EmulationState:
    """Rank 0's deterministic emulation as poseidon-run builds it for ``case`` (same scale, same TP degrees, the
    host factor of this process's environment: :func:`pin_host_factor`)."""
    return emulation.deterministic_state(emulate=case.emulate, emulate_model=case.model, rank=0,
                                         world_size=case.ranks, num_layers=case.layers,
                                         global_batch=case.global_batch, micro_batch_size=1, job_model=job_model(case),
                                         host_factor=emulation.parse_host_factor(
                                             os.environ.get(emulation.HOST_FACTOR_ENV)))


def pin_host_factor() -> float:
    """Time this host once, as poseidon-run does (``launcher.host_factor_env``), and pin the factor in this
    process's environment, so that every launch of the benchmark and its own :func:`emulation_state` use the
    same; a factor already pinned is kept."""
    from poseidon_plugin.runtime.launcher import host_factor_env

    os.environ.update(host_factor_env(os.environ))
    return emulation.parse_host_factor(os.environ[emulation.HOST_FACTOR_ENV])


def scaled(case: ClusterCase, factor: float) -> ClusterCase:
    """``case`` at ``factor`` x its automatic SCALE (given explicitly in ``--poseidon-emulate-model``): for a host
    slower than the one the emulation's host-fit constants were measured on (docs/FIDELITY.md)."""
    import dataclasses

    preset, _, rest = case.model.partition(":")
    links = rest.partition(":")[2]
    scale = emulation_state(case).scale * factor
    return dataclasses.replace(case, model=f"{preset}:{scale:.4g}" + (f":{links}" if links else ""))


def cost_model(case: ClusterCase, profile_path: str) -> CostModel:
    """The cost model poseidon-run planned with: the emulated cluster, the job, the profile it measured."""
    return CostModel(emulation_state(case).cluster, job_model(case), load_profile(profile_path))


def candidate_of(summary: Any) -> Candidate:
    """A Candidate from a Plan or a PlanSummary (default placement)."""
    mbs = getattr(summary, "micro_batch_size")
    return Candidate(tp=summary.tp, pp=summary.pp, dp=summary.dp, mbs=mbs, stage_types=tuple(summary.stage_types),
                     layers=tuple(summary.layers), schedule=summary.schedule,
                     virtual_stages=summary.virtual_stages, ep=getattr(summary, "ep", 1), etp=getattr(summary, "etp", None))


def uniform_plan(cm: CostModel) -> Plan | None:
    """(b): the best uniform split, devices in launch order, by the same search restricted to uniform splits,
    run as stock Megatron-LM runs it (interleaved with its default p2p overlap, and priced so)."""
    found = best_uniform(cm, SearchOptions(mode="exact", comm_model="megatron-overlap"))
    if found is None:
        return None
    _ms, cand = found
    return plan_as_run(cm, cand, TargetRuntime(comm_model=COMM_MODEL, p2p_overlap="on"))


def random_plans(cm: CostModel, count: int, seed: int, avoid: set) -> list[Plan]:
    """(d): ``count`` random feasible 1F1B plans (random TP, PP, DP, mbs, stage types and layer split)."""
    rng = random.Random(seed)
    types = list(cm.device_types)
    L = cm.model.num_layers
    plans: list[Plan] = []
    for _ in range(20000):
        if len(plans) == count:
            break
        tp = rng.choice([t for t in cm.tp_degrees(types[0]) if all(t in cm.tp_degrees(x) for x in types)])
        mbs = rng.choice(cm.micro_batch_sizes())
        dp = rng.choice([1, 2, 4])
        free = {t: cm.max_stages(t, tp, dp) for t in types}
        stage_types = []
        if sum(free.values()) == 0:
            continue
        pp = rng.randint(1, min(L, sum(free.values())))
        for _s in range(pp):
            options = [t for t in types if free[t] > 0]
            if not options:
                break
            t = rng.choice(options)
            free[t] -= 1
            stage_types.append(t)
        if len(stage_types) != pp or cm.micro_batches(dp, mbs) is None:
            continue
        cuts = sorted(rng.sample(range(1, L), pp - 1))
        layers = tuple(b - a for a, b in zip([0, *cuts], [*cuts, L]))
        cand = Candidate(tp=tp, pp=pp, dp=dp, mbs=mbs, stage_types=tuple(stage_types), layers=layers)
        key = (cand.tp, cand.pp, cand.dp, cand.mbs, cand.stage_types, cand.layers, cand.schedule)
        if key in avoid:
            continue
        try:
            if not cm.fits(cand):
                continue
            plan = cm.make_plan(cand, comm_model=COMM_MODEL)
        except InputError:
            continue
        avoid.add(key)
        plans.append(plan)
    return plans


def plan_key(plan: Any) -> tuple:
    return (plan.tp, plan.pp, plan.dp, plan.micro_batch_size, tuple(plan.stage_types), tuple(plan.layers),
            plan.schedule, getattr(plan, "ep", 1), getattr(plan, "etp", None))


# --- one launch ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What one poseidon-run launch printed."""

    code: int
    wall_s: float
    schedule_ms: list[float] = field(default_factory=list)   # watch: one schedule call per iteration
    iteration_s: list[float] = field(default_factory=list)   # the script: whole iteration incl. optimizer
    layers_as_planned: bool = False
    load: float = float("nan")
    """Machine load average (1 min) at the end of the run: other jobs on the shared cores."""
    tail: str = ""

    @property
    def steady_ms(self) -> list[float]:
        return self.schedule_ms[WARMUP_ITERS:]

    @property
    def measured_ms(self) -> float:
        return statistics.median(self.steady_ms) if self.steady_ms else float("nan")

    @property
    def spread(self) -> float:
        """(max - min) / median of the measured iterations after warm-up."""
        s = self.steady_ms
        return (max(s) - min(s)) / statistics.median(s) if len(s) >= 2 else float("nan")

    @property
    def optimizer_ms(self) -> float:
        """Median of (script iteration - schedule call): optimizer step, zeroing, logging."""
        pairs = list(zip(self.iteration_s, self.schedule_ms))[WARMUP_ITERS:]
        return statistics.median(1e3 * s - m for s, m in pairs) if pairs else float("nan")


SCRIPT_ITERATION = re.compile(r"^iteration \d+/\d+ \| lm loss \S+ \| ([\d.]+) s", re.M)
"""``scripts/pretrain_gpt.py``'s line per training iteration; the group is its wall time in seconds."""


MEGATRON_LM_ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
"""Megatron-LM's ``training_log`` line (``--log-interval 1``); the group is the iteration's wall time in ms."""


def iteration_seconds(output: str) -> list[float]:
    """The wall seconds of each training iteration the script logged in ``output`` (either client)."""
    return ([float(m) for m in SCRIPT_ITERATION.findall(output)]
            or [float(m) / 1e3 for m in MEGATRON_LM_ITERATION.findall(output)])


def launch(case: ClusterCase, *, iters: int, cache_dir: str, plan_file: str | None, save_plan: str | None,
           timeout_s: float = 600.0) -> RunResult:
    """One ``python -m poseidon_plugin.runtime.launcher`` run of the case (sequential; bounded)."""
    import time

    args = [sys.executable, "-m", "poseidon_plugin.runtime.launcher", "--nproc-per-node", str(case.ranks),
            _client["script"], *case.job(), *_client["extra"], "--train-iters", str(iters), "--poseidon-emulate", case.emulate,
            "--poseidon-emulate-model", case.model, "--poseidon-watch-iterations", str(iters),
            "--poseidon-profile-cache", cache_dir]
    if plan_file:
        args += ["--poseidon-plan", plan_file]
    else:
        args += ["--poseidon-micro-batch-sizes", case.micro_batch_sizes]
    if save_plan:
        args += ["--poseidon-save-plan", save_plan]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    for key in [k for k in env if k.startswith("POSEIDON_")]:
        del env[key]
    start = time.perf_counter()
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
        code, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        code, out = 124, (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    result = RunResult(code=code, wall_s=time.perf_counter() - start, tail="\n".join(out.splitlines()[-15:]),
                       load=os.getloadavg()[0])
    result.schedule_ms = [float(m) for m in re.findall(r"^poseidon: iteration \d+: measured ([\d.]+) ms", out, re.M)]
    result.iteration_s = iteration_seconds(out)
    built = re.findall(r"built layers \S+ as planned", out)
    result.layers_as_planned = code == 0 and len(built) > 0 and "does not apply the rewritten" not in out
    return result


def known_types() -> tuple[str, ...]:
    return device_presets()
