"""Elastic jobs whose fleet changes (issue 25): agents leave and join, each declaring its own emulated devices.

Real ``poseidon-run`` agents on 127.0.0.1 (c10d rendezvous on a free port, ``--nnodes 1:2``), each with
``--poseidon-emulate`` of its own devices only; the job's devices are the union of the agents that are there.
One launch trains the reference (both agents, checkpoints at iterations 2, 4, 6); then an agent leaves (its
processes killed) and the survivor re-plans for its devices and resumes from a checkpoint; then an agent
joins a running job and the job re-plans for both and resumes. Every wait is bounded by a subprocess or
poll bound (never asserted on), moments come from the agents' output (a line seen), leftovers are killed.
Losses are compared within ``test_resume.LOSS_TOLERANCE`` (argued there).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from poseidon_plugin.emulation.harness import HOST_FACTOR_ENV, slowdown_factors  # noqa: E402
from poseidon_plugin.runtime.options import RuntimeOptions  # noqa: E402
from poseidon_plugin.runtime.precheck import declared_cluster  # noqa: E402
from tests.dist.conftest import REFERENCE_HOST, free_port, in_background, selected  # noqa: E402
from tests.dist.test_launcher import JOB, REPO, SCRIPT  # noqa: E402
from tests.dist.test_resume import LOSS_TOLERANCE, _with, iteration_losses  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "scripts"))
from _agents import kill_agent, wait_for_port  # noqa: E402

BOUND_S = 300
"""Upper bound on any one wait (a hung launch fails the test instead of the suite)."""
# agent i's own devices; agent 1's is the faster type, so every plan uses it (alone or with agent 0's)
OWN = ["A2-4:1", "A2-2:1"]
# a round waits this long for more agents once --nnodes' minimum has joined before it starts with fewer
# (torchrun's c10d rendezvous): a survivor's next round, an agent that starts alone on purpose (a round
# with --nnodes' maximum completes at once)
LAST_CALL = "last_call_timeout=5"
# an agent that leaves (killed as a node that dies) stays in the rendezvous until its heartbeat is missed
# keep_alive_max_attempt times, keep_alive_interval seconds apart (torchrun's defaults 5 s x 3: 15 s of every
# survivor's restart); 1 s x 5 finds it gone within 5 s and still lets a live agent's heartbeat be late for 4 s
KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=5"
# a global batch of 64: enough micro-batches that plans on both devices compete with one on the faster one
# (which wins depends on the probed links; the tests hold either way)
TRAIN = [*_with(JOB, train_iters="6", global_batch_size="64"), "--poseidon-timeout", "90"]


class Agent:
    """One ``poseidon-run`` agent (its own process group and log file)."""

    def __init__(self, tmp_path, index: int, endpoint: str, script_args: list[str], *, nnodes: str = "1:2",
                 torchrun: list[str] = (), env: dict[str, str] | None = None, own: str | None = None) -> None:
        full = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path.parent / "xdg"),
                    PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        for key in [k for k in full if k.startswith("POSEIDON_") or k.startswith("TORCH_DISABLE_SHARE")]:
            del full[key]
        full.update(REFERENCE_HOST)
        full.update(env or {})
        self.path = tmp_path / f"agent{index}.log"
        self.log = open(self.path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "poseidon_plugin.runtime.launcher", "--nnodes", nnodes, "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--monitor-interval", "0.5", *torchrun,
             SCRIPT, *script_args, "--poseidon-emulate", own or OWN[index]],
            cwd=REPO, env=full, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.path.read_text()

    def wait_for(self, pattern: str) -> None:
        """Until ``pattern`` is in the output (fails if the agent ends first or the bound passes)."""
        deadline = time.monotonic() + BOUND_S
        while not re.search(pattern, self.output(), re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"agent never printed {pattern!r}:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=BOUND_S)
        finally:
            self.kill()
        return code, self.output()

    def kill(self) -> None:
        """The agent and its workers, as a node that dies."""
        kill_agent(self.proc)
        if not self.log.closed:
            self.log.close()


def finish_all(agents: list[Agent]) -> list[tuple[int, str]]:
    """Every agent's (exit code, output) once it ends; all of them killed afterwards, also on a failure."""
    try:
        return [agent.finish() for agent in agents]
    finally:
        for agent in agents:
            agent.kill()


def launch_joined(tmp_path, agents_args: list[list[str]], rdzv_id: str, torchrun: list[str] = (), owns: list[str] = OWN,
                  **kwargs) -> list[Agent]:
    """Agents of ``--nnodes 1:N`` that all join the first round: started together (agent 0 first: torchrun
    ranks one host's agents by process id), agent 0 hosting the rendezvous store (``is_host=true``) and the
    others its clients (``is_host=false``: each waits for the store), so they join as agent 0 does, well
    within its round's last call."""
    port = free_port()
    agents = []
    try:
        for i, args in enumerate(agents_args):
            agents.append(Agent(tmp_path, i, f"127.0.0.1:{port}", args, own=owns[i],
                                torchrun=["--rdzv-id", rdzv_id, *torchrun,
                                          "--rdzv-conf", f"is_host={str(i == 0).lower()},{LAST_CALL},{KEEP_ALIVE}"], **kwargs))
    except BaseException:
        for agent in agents:
            agent.kill()
        raise
    return agents


def launch(tmp_path, agents_args: list[list[str]], owns: list[str] = OWN, envs: list[dict[str, str]] | None = None,
           **kwargs) -> list[Agent]:
    """Agent 0 (it hosts the rendezvous), then the others; agent i declares ``owns[i]`` (and adds ``envs[i]`` to
    its environment)."""
    port = free_port()

    def agent(i: int, args: list[str]) -> Agent:
        env = {**kwargs.get("env", {}), **(envs[i] if envs else {})}
        return Agent(tmp_path, i, f"127.0.0.1:{port}", args, own=owns[i], **{**kwargs, "env": env})

    first = agent(0, agents_args[0])
    try:
        if not wait_for_port(port, BOUND_S):
            pytest.fail(f"no agent listened on port {port}:\n{first.output()[-4000:]}")
        return [first, *[agent(i, args) for i, args in enumerate(agents_args[1:], start=1)]]
    except BaseException:
        first.kill()
        raise


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Both agents from the start (--nnodes 2, each declaring its own device): six iterations, checkpoints
    at 2, 4 and 6."""
    tmp = tmp_path_factory.mktemp("reference")
    ck = str(tmp / "ck")
    args = [*TRAIN, "--save", ck, "--save-interval", "2"]
    agents = launch(tmp, [args, args], nnodes="2", torchrun=["--rdzv-id", "reference"])
    results = [agent.finish() for agent in agents]
    return results, ck


def test_agents_declaring_their_own_devices_plan_for_the_union(reference):
    """Defect 8: with --nnodes 1:2 (or 2) and --poseidon-emulate every attempt failed (declared devices vs world)."""
    results, _ = reference
    both = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], both[-6000:]
    # agent 0's A2-4 is stretched against the job's fastest type, agent 1's A2-2 (alone it would not be)
    union = declared_cluster(RuntimeOptions(emulate=",".join(OWN)), 2)
    factors = slowdown_factors({t.name: t.peak_tflops for t in union.device_types})
    assert factors["A2-2"] == 1.0 < factors["A2-4"]
    assert re.search(r"^poseidon\[rank 1\]: A2-2 \(emulated\) on \S+, local rank 0$", both, re.M), both[-6000:]
    assert re.search(rf"^poseidon\[rank 0\]: A2-4 \(emulated\) on \S+, local rank 0, compute stretched "
                     rf"x{factors['A2-4']:.2f}$", both, re.M), both[-6000:]
    assert sorted(iteration_losses(both)) == [1, 2, 3, 4, 5, 6], both[-6000:]


# --- the deterministic emulation with each agent's own devices ----------------------------------------

MODEL = "llama3-8b"
EMULATED = [*JOB, "--poseidon-emulate-model", MODEL, "--poseidon-micro-batch-sizes", "1", "--poseidon-timeout", "90"]


def _emulation_scale(emulate: str, world_size: int, host_factor: float = 1.0) -> float:
    """The automatic SCALE of the whole job's deterministic emulation (every rank must build this one) on a host
    ``host_factor`` times slower than the reference."""
    from poseidon_plugin.emulation.harness import deterministic_state
    from poseidon_plugin.runtime.job_flags import effective_global_batch, read_job
    from poseidon_plugin.runtime.job_spec import job_name, model_spec

    flags = read_job(SCRIPT, JOB)
    gbs = effective_global_batch(flags, world_size)
    return deterministic_state(emulate=emulate, emulate_model=MODEL, rank=0, world_size=world_size,
                               num_layers=flags.num_layers, global_batch=gbs, micro_batch_size=flags.micro_batch_size,
                               job_model=model_spec(flags, global_batch_size=gbs, name=job_name(SCRIPT, flags)),
                               host_factor=host_factor).scale


def _emulation_lines(output: str) -> dict[int, tuple[str, str]]:
    return {int(rank): (device, scale) for rank, device, scale in re.findall(
        r"^poseidon\[rank (\d)\]: (A2-\d) \(emulated\) on \S+, local rank 0, deterministic emulation of "
        rf"{MODEL} x(\S+) ", output, re.M)}


SLOW_HOST = HOST_FACTOR_ENV


DETERMINISTIC_TEST = "test_agents_declaring_their_own_devices_emulate_the_whole_job_deterministically"
HOSTS_TEST = "test_agents_on_hosts_of_different_speed_agree_on_the_slowest"


@pytest.fixture(scope="module", autouse=True)
def emulated_launches(request, tmp_path_factory):
    """The launches of the two tests below, started with the module's first test: they run beside the
    reference launch (fixture ``reference``), each with a profile cache of its own. Both start their agents
    one after the other (:func:`launch`: agent 1 once agent 0 listens, so they join in that order), sleep to
    emulated deadlines, and take each host's speed from the environment, not from a timing. The tests that
    read them come before the agents that must join within one round's last call (:func:`launch_joined`)."""
    whole = ",".join(OWN)
    calls = {}
    if selected(request, DETERMINISTIC_TEST):
        tmp = tmp_path_factory.mktemp("emulated") / "agents"  # its own XDG cache: tmp.parent / "xdg"
        tmp.mkdir()
        calls[DETERMINISTIC_TEST] = lambda: finish_all(launch(
            tmp, [EMULATED, EMULATED], nnodes="2", torchrun=["--rdzv-id", "emulated"], envs=[{}, {SLOW_HOST: "2"}]))
    if selected(request, HOSTS_TEST):
        hosts = tmp_path_factory.mktemp("emulated-hosts") / "agents"
        hosts.mkdir()
        calls[HOSTS_TEST] = lambda: finish_all(launch(
            hosts, [[*EMULATED, "--poseidon-dry-run"]] * 2, owns=[whole, whole], nnodes="2",
            torchrun=["--rdzv-id", "emulated-hosts"], envs=[{SLOW_HOST: "2"}, {}]))
    with in_background(calls) as launches:
        yield launches


def test_agents_declaring_their_own_devices_emulate_the_whole_job_deterministically(emulated_launches):
    """--poseidon-emulate-model with --poseidon-emulate given per agent failed before any process started (it
    needed the whole job's devices before the ranks met): each agent's list is now gathered at inventory and
    every rank builds the emulation of the union (one SCALE, one cluster), then the job plans and trains.
    Agent 1's host runs 2x slower than agent 0's (poseidon-run's timing, pinned here): both emulate with it."""
    results = emulated_launches[DETERMINISTIC_TEST].result()
    both = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], both[-6000:]
    scale = f"{_emulation_scale(','.join(OWN), 2, host_factor=2.0):.4g}"
    assert scale != f"{_emulation_scale(','.join(OWN), 2):.4g}"  # the slower host's, not agent 0's
    assert _emulation_lines(both) == {0: ("A2-4", scale), 1: ("A2-2", scale)}, both[-6000:]
    assert len(re.findall(r"^poseidon: Poseidon plan:", both, re.M)) == 1, both[-6000:]  # one plan, rank 0's
    assert len(iteration_losses(both)) == 3, both[-6000:]


def test_agents_on_hosts_of_different_speed_agree_on_the_slowest(emulated_launches):
    """Every agent declares the whole job's devices; each built its emulation from its own host's factor at
    start-up, and at inventory the ranks of the faster host rebuild theirs with the slower host's (one SCALE)."""
    whole = ",".join(OWN)
    results = emulated_launches[HOSTS_TEST].result()
    both = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], both[-6000:]
    scale = f"{_emulation_scale(whole, 2, host_factor=2.0):.4g}"
    assert _emulation_lines(both) == {0: ("A2-4", scale), 1: ("A2-2", scale)}, both[-6000:]
    assert re.search(r"^poseidon: emulation: this host runs the ranks' CPU work 2x slower", both, re.M), both[-6000:]


def test_an_agent_leaves_and_the_survivor_replans_and_resumes(reference, tmp_path):
    """Agent 1's processes are killed (its rank frozen at hand-over first, so it never trains): agent 0's
    next attempt plans for its own device and loads the checkpoint of iteration 2, saved under the plan
    of both agents' devices."""
    (_, ref0), (_, ref1) = reference[0]
    uninterrupted = iteration_losses(ref0 + ref1)
    ck = reference[1]
    args = [*TRAIN, "--load", ck, "--ckpt-step", "2"]
    agents = launch_joined(tmp_path, [args, args], "leave", torchrun=["--max-restarts", "1"],
                           env={"POSEIDON_INJECT_FAULT": "hand-over:1:stop:0"})
    try:
        agents[1].wait_for(r"^poseidon\[rank 1\]: now global rank")
        agents[1].kill()  # the agent leaves: launcher and worker gone without a word
        code, out = agents[0].finish()
    finally:
        for agent in agents:
            agent.kill()
    assert code == 0, out[-6000:]
    assert re.search(r"^poseidon: re-planned for attempt 1 of this run \(A2-2 x1 gone; 2 -> 1 devices\): a new plan$",
                     out, re.M), out[-6000:]
    assert re.search(rf"^loaded checkpoint from {re.escape(ck)} at iteration 2 \(TP 1 PP 1 DP 1\) in [\d.]+ s$", out, re.M), out[-6000:]
    resumed = iteration_losses(out.split("re-planned for attempt 1")[-1])
    assert sorted(resumed) == [3, 4, 5, 6], out[-6000:]
    for iteration, loss in resumed.items():
        assert abs(loss - uninterrupted[iteration]) <= LOSS_TOLERANCE, (iteration, loss, uninterrupted)


def test_an_agent_joins_and_the_job_replans_for_both_and_resumes(reference, tmp_path):
    """Agent 0 alone plans for its device (its rank then waits, so the job is still running), agent 1
    joins: torchrun restarts the workers of both for the new membership, the plan is for both devices, the
    checkpoint of iteration 4 is loaded and iterations 5 and 6 train."""
    (_, ref0), (_, ref1) = reference[0]
    uninterrupted = iteration_losses(ref0 + ref1)
    ck = reference[1]
    args = [*TRAIN, "--load", ck, "--ckpt-step", "4"]
    port = free_port()
    kwargs = dict(torchrun=["--rdzv-id", "join", "--rdzv-conf", LAST_CALL], env={"POSEIDON_INJECT_FAULT": "hand-over:0:wait:w1"})
    alone = Agent(tmp_path, 0, f"127.0.0.1:{port}", args, **kwargs)
    agents = [alone]
    try:
        alone.wait_for(r"^poseidon\[rank 0\]: now global rank 0")  # planned for one device
        agents.append(Agent(tmp_path, 1, f"127.0.0.1:{port}", args, **kwargs))
        results = finish_all(agents)
    finally:
        for agent in agents:
            agent.kill()
    both = results[0][1] + results[1][1]
    assert [code for code, _ in results] == [0, 0], both[-6000:]
    assert re.search(r"^poseidon: re-planned for attempt 1 of this run \(A2-2 x1 added; 1 -> 2 devices\): a new plan$",
                     both, re.M), both[-6000:]
    assert re.search(rf"^loaded checkpoint from {re.escape(ck)} at iteration 4 \(TP \d PP \d DP \d\) in [\d.]+ s$", both, re.M)
    resumed = iteration_losses(both)
    assert sorted(resumed) == [5, 6], both[-6000:]
    for iteration, loss in resumed.items():
        assert abs(loss - uninterrupted[iteration]) <= LOSS_TOLERANCE, (iteration, loss, uninterrupted)


def test_an_agent_leaves_a_deterministically_emulated_job_and_the_survivor_replans(tmp_path):
    """2 -> 1 agents under --poseidon-emulate-model: the survivor's next attempt emulates its own device
    alone (the SCALE of a one-device job) and re-plans for it. The survivor is the A2-2 (64 GB): the
    emulated model does not fit one A2-4's 32 GB."""
    owns = OWN[::-1]
    agents = launch_joined(tmp_path, [EMULATED, EMULATED], "emulated-leave", torchrun=["--max-restarts", "1"], owns=owns,
                           env={"POSEIDON_INJECT_FAULT": "hand-over:1:stop:0"})
    try:
        agents[1].wait_for(r"^poseidon\[rank 1\]: now global rank")
        agents[1].kill()
        code, out = agents[0].finish()
    finally:
        for agent in agents:
            agent.kill()
    assert code == 0, out[-6000:]
    before, _, after = out.partition("error: lost rank")  # attempt 0 ends where its rank 0 finds rank 1 gone
    assert _emulation_lines(before) == {0: ("A2-2", f"{_emulation_scale(','.join(owns), 2):.4g}")}, out[-6000:]
    assert _emulation_lines(after) == {0: ("A2-2", f"{_emulation_scale(owns[0], 1):.4g}")}, out[-6000:]
    assert re.search(r"^poseidon: re-planned for attempt 1 of this run \(A2-4 x1 gone; 2 -> 1 devices\): a new plan$",
                     out, re.M), out[-6000:]
    assert len(iteration_losses(after)) == 3, out[-6000:]
