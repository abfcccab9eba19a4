"""A restart after a lost agent: from the death to the new attempt's first iteration, split by who spends it.

    python scripts/bench_restart.py

What a user runs (``poseidon-run``, default options; ``--poseidon-emulate`` because the devices are emulated
on CPU, ``--poseidon-emulate-model`` so that their times and links are the emulated model's, the same on
every launch): an elastic job of two agents on this host (c10d rendezvous on 127.0.0.1, ``--nnodes 1:2``,
``--max-restarts 1``), agent 0 with two devices, agent 1 with one, each declaring its own emulated devices,
training ``scripts/pretrain_gpt.py`` with ``--load``/``--save``. A first launch warms the profile cache and
saves a checkpoint (and agent 0 alone warms its own entries). In the next, agent 1 is lost (its rank frozen at
hand-over, then its launcher and worker killed, as a node that dies) and agent 0 restarts alone on its two
devices. Every line agent 0 prints is timestamped when it arrives; the split:

- *detection*: the death to the surviving rank's ``lost rank ...`` line (Poseidon's guard; without it the
  rank would wait in a store call for the process group's timeout);
- *torchrun*: the rest until the new attempt's workers start (restart, rendezvous round, which waits
  ``last_call_timeout`` for more agents);
- *worker start-up*: imports and process group (the ``start-up ... before it`` of the ``overhead:`` line; a
  plain torchrun restart pays it too);
- *Poseidon's phases*: inventory, probing, profiling from the cache, search, apply, placement, hand-over
  (the ``overhead:`` line);
- *checkpoint load* (the script's ``loaded checkpoint ... in X s``), and the rest (model build, the first
  iteration itself).

Targets printed beside the figures: Poseidon's share (detection + its phases) <= 2 s with a warm cache, and the
restarted plan's hash equals the plan ``poseidon plan`` gives for the surviving fleet (two devices: the same
profile and model, the survivor's emulated cluster and links). Timings on a loaded machine are noisy: run it
on an idle one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

from _agents import kill_agent, wait_for_port  # noqa: E402
from _e2e_runs import pin_host_factor  # noqa: E402

TARGET_S = 2.0
# agent i's own devices: the survivor (agent 0) keeps two, so its new plan has a placement and links to choose;
# agent 1's A2-2 is the faster type (in every plan of both agents)
OWN = ["A2-4:2", "A2-2:1"]
NPROC = [2, 1]
LOST_RANK = 2  # agent 1's rank (torchrun numbers agent 0's two ranks first)
MODEL = "llama3-8b"
JOB = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
       "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "6",
       "--hidden-dropout", "0", "--attention-dropout", "0"]
LAST_CALL_S = 5
BOUND_S = 600


class Agent:
    """One ``poseidon-run`` agent; its output lines timestamped (``time.monotonic()``) as they arrive."""

    def __init__(self, index: int, port: int, args: list[str], env: dict[str, str], rdzv_id: str) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "poseidon_plugin.runtime.launcher", "--nnodes", "1:2",
             "--nproc-per-node", str(NPROC[index]),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
             "--rdzv-conf", f"last_call_timeout={LAST_CALL_S}", "--max-restarts", "1", "--monitor-interval", "0.5",
             "scripts/pretrain_gpt.py", *JOB, *args, "--poseidon-emulate", OWN[index],
             "--poseidon-emulate-model", MODEL],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        for when, line in list(self.lines):
            found = re.search(pattern, line)
            if when >= after and found:
                return when, found
        return None

    def wait_for(self, pattern: str) -> tuple[float, re.Match]:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            hit = self.first(pattern)
            if hit:
                return hit
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"bench_restart: never printed {pattern!r}:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def finish(self) -> int:
        code = self.proc.wait(timeout=BOUND_S)
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        kill_agent(self.proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], env: dict[str, str], rdzv_id: str, fault: str | None = None) -> list[Agent]:
    port = free_port()
    env = dict(env, **({"POSEIDON_INJECT_FAULT": fault} if fault else {}))
    first = Agent(0, port, args, env, rdzv_id)
    if not wait_for_port(port, BOUND_S):
        first.kill()
        raise SystemExit(f"bench_restart: no agent listened on {port}")
    return [first, Agent(1, port, args, env, rdzv_id)]


def offline_hash(out: str, work: str) -> tuple[str, str]:
    """``poseidon plan`` for the surviving devices, with the profile the new attempt wrote and the cluster its
    emulation declares (devices and scaled links): its plan's hash."""
    from poseidon_plugin.emulation.harness import HOST_FACTOR_ENV, deterministic_state, parse_host_factor
    from poseidon_plugin.runtime.job_flags import read_job
    from poseidon_plugin.runtime.job_spec import job_name, model_spec

    profiles = re.findall(r"written to (\S+-profile\.json)", out)
    job = read_job("scripts/pretrain_gpt.py", JOB)
    model = model_spec(job, global_batch_size=64, name=job_name("scripts/pretrain_gpt.py", job))
    cluster = deterministic_state(emulate=OWN[0], emulate_model=MODEL, rank=0, world_size=NPROC[0],
                                  num_layers=job.num_layers, global_batch=64, micro_batch_size=job.micro_batch_size,
                                  job_model=model, host_factor=parse_host_factor(os.environ[HOST_FACTOR_ENV])).cluster
    paths = {}
    for name, doc in (("model", model.to_dict()), ("cluster", cluster.to_dict())):
        paths[name] = os.path.join(work, f"{name}.json")
        with open(paths[name], "w", encoding="utf-8") as f:
            json.dump(doc, f)
    plan_file = os.path.join(work, "offline-plan.json")
    cmd = [sys.executable, "-m", "poseidon_plugin.cli", "plan", "--cluster", paths["cluster"], "--model",
           paths["model"], "--profile", profiles[-1], "--output", plan_file, "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return "", f"poseidon plan failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    from poseidon_plugin.plan import Plan

    return Plan.load(plan_file).plan_hash()[:12], (f"poseidon plan --cluster ({OWN[0]}, emulated links) --model "
                                                   f"(the job) --profile (the new attempt's)")


def main() -> int:
    work = tempfile.mkdtemp(prefix="poseidon-bench-restart-")
    pin_host_factor()  # one factor for every agent and for offline_hash's emulation
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=os.path.join(work, "xdg"),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    ck = os.path.join(work, "ck")
    print("warming the profile cache and saving a checkpoint (two agents) ...", flush=True)
    agents = launch(["--save", ck, "--save-interval", "2"], env, "warm")
    if [a.finish() for a in agents] != [0, 0]:
        raise SystemExit("bench_restart: the warm-up launch failed:\n" + agents[0].text()[-3000:])
    # the survivor alone once too: emulated compute is stretched against the fleet's fastest type, so agent 0's
    # device alone is profiled as another speed (a real device's profile would not change)
    alone = Agent(0, free_port(), [], env, "warm-alone")
    if alone.finish() != 0:
        raise SystemExit("bench_restart: the warm-up launch of agent 0 alone failed:\n" + alone.text()[-3000:])
    print("restart: agent 1 lost during its start-up, agent 0 restarts alone ...", flush=True)
    agents = launch(["--load", ck, "--ckpt-step", "2"], env, "restart", fault=f"hand-over:{LOST_RANK}:stop:0")
    try:
        agents[1].wait_for(rf"^poseidon\[rank {LOST_RANK}\]: now global rank")
        death = time.monotonic()
        agents[1].kill()
        code = agents[0].finish()
    finally:
        for agent in agents:
            agent.kill()
    out = agents[0].text()
    if code != 0:
        raise SystemExit(f"bench_restart: the survivor exited {code}:\n{out[-4000:]}")
    lost = agents[0].first(r"^poseidon\[rank 0\]: error: lost rank", death)
    overhead = agents[0].first(r"^poseidon: overhead: Poseidon ([0-9.]+) s .*start-up ([0-9.]+) s before it", death)
    loaded = agents[0].first(r"^loaded checkpoint .* in ([0-9.]+) s$", death)
    first_iteration = agents[0].first(r"^iteration \d+/\d+ \|", death)
    now_hash = agents[0].first(r"^poseidon:   now:    hash ([0-9a-f]{12}) +TP (\d+) PP (\d+) DP (\d+) .*$", death)
    cache = agents[0].first(r"^poseidon: profile: cache: (reused \d+ of \d+ configurations)", death)
    if not (lost and overhead and loaded and first_iteration and now_hash):
        raise SystemExit(f"bench_restart: a line is missing from the survivor's output:\n{out[-4000:]}")
    total = first_iteration[0] - death
    detection = lost[0] - death
    phases, startup = float(overhead[1][1]), float(overhead[1][2])
    torchrun = overhead[0] - phases - startup - lost[0]
    load = float(loaded[1][1])
    rest = total - detection - torchrun - startup - phases - load
    share = detection + phases
    print()
    print(f"{'from the death of agent 1 to the first iteration':60s} {total:7.2f} s")
    for name, value in (("detection (Poseidon's guard)", detection),
                        (f"torchrun: restart + rendezvous (last_call_timeout={LAST_CALL_S} s)", torchrun),
                        ("worker start-up (imports, process group)", startup),
                        (f"Poseidon's phases (cache: {cache[1][1] if cache else '?'})", phases),
                        ("checkpoint load", load),
                        ("model build, first iteration, other", rest)):
        print(f"  {name:58s} {value:7.2f} s")
    print(f"\nPoseidon's share (detection + phases): {share:.2f} s   target <= {TARGET_S:.0f} s: "
          f"{'met' if share <= TARGET_S else f'MISSED by {share - TARGET_S:.2f} s'}")
    offline, how = offline_hash(out, work)
    restarted = now_hash[1][1]
    used = int(now_hash[1][2]) * int(now_hash[1][3]) * int(now_hash[1][4])
    print(f"restarted plan ({used} of the survivor's {NPROC[0]} devices): {now_hash[1][0].split('now:')[1].strip()}")
    print(f"restarted plan hash {restarted}; {how}: {offline or '-'}   target equal: "
          f"{'met' if offline == restarted else 'MISSED'}")
    print("(one run; timings on a shared machine are noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
