"""Deterministic emulation (``--poseidon-emulate-model``): compute deadlines, delayed p2p requests, end to end.

The hooks' clock is injected (:class:`FakeTime` stands in for the ``time`` module the patches read), so
deadlines and transfer times are checked exactly, whatever the machine's load. End to end, the watch's
measured time is only bounded from below (an emulated deadline is never met early); how close it comes to
the prediction is a timing, measured by scripts/bench_e2e.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from poseidon_plugin.emulation import links_patch as emulated_links  # noqa: E402
from poseidon_plugin.emulation import compute_patch  # noqa: E402



class FakeTime:
    """The ``time`` functions the emulation patches call, on a virtual clock: ``sleep`` advances it at once
    and real work takes no virtual time, so every held span is exactly what the hooks asked for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(compute_patch, "time", fake)
    monkeypatch.setattr(emulated_links, "time", fake)
    return fake


class _Config:
    tensor_model_parallel_size = 2


class _Layer(torch.nn.Module):
    """A stand-in for TransformerLayer: keyword ``hidden_states`` [s, b, h], returns (output, context)."""

    def __init__(self, post_process: bool = True) -> None:
        super().__init__()
        self.config = _Config()
        self.post_process = post_process
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, hidden_states=None):
        return self.linear(hidden_states), None


@pytest.fixture
def deadlines():
    calls = []

    def targets(part, tp, mbs):
        calls.append((part, tp, mbs))
        return 40.0, 80.0

    compute_patch.set_targets(targets)
    yield calls
    compute_patch.set_targets(None)


def _wrapped(part="layer", post_process=True):
    layer = _Layer(post_process)
    forward = compute_patch._stretched(("hidden_states",), part=part)(_Layer.forward)
    return layer, forward


def test_layer_keeps_its_forward_and_backward_deadlines(deadlines, clock):
    layer, forward = _wrapped()
    x = torch.randn(4, 3, 8, requires_grad=True)
    start = clock.now
    out, _ = forward(layer, hidden_states=x)
    forward_s = clock.now - start
    start = clock.now
    out.sum().backward()
    backward_s = clock.now - start
    assert deadlines == [("layer", 2, 3)]  # TP from the module's config, mbs from the input's batch dimension
    assert forward_s == pytest.approx(0.040)
    assert backward_s == pytest.approx(0.080)
    assert x.grad is not None and x.grad.shape == x.shape
    assert compute_patch.mode() == "deadline"


def test_a_recomputed_layer_holds_its_forward_in_both_passes(deadlines, clock):
    """megatron-core's activation checkpointing runs the layer under no_grad in the forward, then again inside
    its backward: both forwards are held to the forward's deadline (a device runs both), the backward to its
    own, as the cost model prices full recomputation (backward = forward + backward). The forward under
    no_grad was not held: the emulated job ran a recomputing layer's forward in no time."""
    from tests.dist.test_cpu_rng_and_hooks import seeded_shim

    layer, forward = _wrapped()
    with seeded_shim(tp_rank=0) as mc_random:
        x = torch.randn(4, 3, 8, requires_grad=True)
        start = clock.now
        out = mc_random.checkpoint(lambda h: forward(layer, h)[0], False, x)
        forward_s = clock.now - start
        start = clock.now
        out.sum().backward()
        backward_s = clock.now - start
    assert forward_s == pytest.approx(0.040)
    assert backward_s == pytest.approx(0.040 + 0.080)
    assert x.grad is not None and layer.linear.weight.grad is not None
    with torch.no_grad():   # evaluation: the forward is held, no backward is marked
        start = clock.now
        forward(layer, hidden_states=x)
        assert clock.now - start == pytest.approx(0.040)


def test_head_of_a_stage_without_output_layer_is_not_held(deadlines):
    layer, forward = _wrapped(part="head", post_process=False)
    forward(layer, hidden_states=torch.randn(4, 1, 8, requires_grad=True))
    assert deadlines == []


def test_stretch_mode_still_selectable():
    compute_patch.set_targets(None)
    compute_patch.set_factor(1.5)
    try:
        assert compute_patch.mode() == "stretch"
    finally:
        compute_patch.set_factor(1.0)
    assert compute_patch.mode() == "off"


class _Work:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1
        return True

    def is_completed(self):
        return True


class _State:
    my_rank = 1

    def p2p_ms(self, peer, mbs):
        return {0: 100.0, 2: 200.0}[peer] * mbs


def test_p2p_requests_last_their_links_time_and_complete_together(clock):
    made = []

    def original(**kwargs):
        works = {name: _Work() for name in ("send_next", "recv_prev")}
        made.append(works)
        return works

    emulated_links.set_state(_State())
    try:
        reqs = emulated_links._delayed_p2p(original)(
            tensor_send_prev=None, tensor_recv_prev=torch.empty(4, 1, 8), tensor_send_next=torch.empty(4, 1, 8),
            tensor_recv_next=None, group=None, prev_pipeline_rank=0, next_pipeline_rank=2)
    finally:
        emulated_links.set_state(None)
    assert reqs["recv_prev"].seconds == pytest.approx(0.1) and reqs["send_next"].seconds == pytest.approx(0.2)
    start = clock.now
    for req in reqs.values():
        req.wait()
    elapsed = clock.now - start
    # one completion stamp for both: the call lasts the slower link (0.2 s), not the sum (0.3 s)
    assert reqs["recv_prev"].done_at == reqs["send_next"].done_at
    assert elapsed == pytest.approx(0.2)
    assert [w.waited for w in made[0].values()] == [1, 1]


class _Rank:
    def __init__(self, rank):
        self.my_rank = rank

    def p2p_ms(self, peer, mbs):
        return 100.0 * mbs


def _post(rank, stamps, **tensors):
    """Rank ``rank`` (pipeline neighbours 0 < 1 < 2) posts one call of ``_p2p_ops`` through the wrapper."""
    emulated_links.set_state(_Rank(rank), stamps)
    try:
        return emulated_links._delayed_p2p(lambda **kw: {n: _Work() for n in tensors})(
            tensor_send_prev=tensors.get("send_prev"), tensor_recv_prev=tensors.get("recv_prev"),
            tensor_send_next=tensors.get("send_next"), tensor_recv_next=tensors.get("recv_next"),
            group=None, prev_pipeline_rank=rank - 1, next_pipeline_rank=rank + 1)
    finally:
        emulated_links.set_state(None)


def test_p2p_transfer_counts_from_the_later_of_both_posts(tmp_path, clock):
    # two ranks of one host map the same stamp file (as the launcher's POSEIDON_EMULATION_STAMPS)
    path = str(tmp_path / "stamps")
    one, two = emulated_links.Stamps(path, 3), emulated_links.Stamps(path, 3)
    message = torch.empty(4, 1, 8)
    send = _post(1, one, send_next=message)["send_next"]
    clock.sleep(0.3)  # rank 2 reaches its receive late: the transfer starts then, for both sides
    recv = _post(2, two, recv_prev=message)["recv_prev"]
    start = clock.now
    send.wait()
    recv.wait()
    assert send.done_at == recv.done_at == recv.posted_at == pytest.approx(send.posted_at + 0.3)
    assert clock.now - start == pytest.approx(0.1)
    # the next message on the pair: rank 2 posted first; waited long after, it costs nothing more
    recv = _post(2, two, recv_prev=message)["recv_prev"]
    send = _post(1, one, send_next=message)["send_next"]
    clock.sleep(0.2)
    start = clock.now
    recv.wait()
    send.wait()
    assert recv.done_at == send.done_at == send.posted_at
    assert clock.now == start  # its time had passed already: no wait at all


def test_p2p_without_a_peer_stamp_counts_from_completion_seen(tmp_path, monkeypatch, clock):
    monkeypatch.setattr(emulated_links.Stamps, "WAIT_S", 0.05)
    lonely = emulated_links.Stamps(str(tmp_path / "stamps"), 3)
    send = _post(1, lonely, send_next=torch.empty(4, 1, 8))["send_next"]
    clock.sleep(0.2)
    start = clock.now
    send.wait()
    # the peer never wrote its post: after waiting WAIT_S for it, the transfer starts when seen complete
    assert send.done_at >= start + 0.05
    assert clock.now == pytest.approx(send.done_at + 0.1)


class _Store:
    """The two calls of a c10d store that share_stamps makes (one process plays every rank in turn)."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]


def test_planned_ranks_of_two_agents_share_one_stamp_file(tmp_path, monkeypatch):
    """Defect 7 (issue 25): each agent's launcher made its own stamp file and the ranks of a second agent
    (torchrun's GROUP_WORLD_SIZE > 1) shared none; now planned rank 0's file is everyone's."""
    from poseidon_plugin.emulation import harness as emulation

    store, mapped = _Store(), {}
    monkeypatch.setattr(emulated_links, "set_stamps", lambda stamps: mapped.__setitem__(rank, stamps))
    for rank, agent_folder in enumerate(["agent0", "agent1"]):  # each agent's launcher names its own folder
        (tmp_path / agent_folder).mkdir()
        monkeypatch.setenv(emulated_links.STAMPS_ENV, str(tmp_path / agent_folder / "p2p-stamps"))
        line = emulation.share_stamps(store, rank, 2, one_host=True, agree=lambda ok: ok)
        assert line == "p2p posting times shared by the 2 planned ranks through one file"
    # rank 1 (agent 1) reads what rank 0 (agent 0) wrote
    assert mapped[0]._map is not mapped[1]._map
    mapped[0].post(0, 1, 0, 12.5)
    assert mapped[1].read(0, 1, 0, 0) == 12.5
    assert store.get(emulation.STAMPS_KEY).decode().startswith(str(tmp_path / "agent0" / "p2p-stamps-"))


def test_stamps_are_used_by_every_rank_or_by_none(tmp_path, monkeypatch):
    from poseidon_plugin.emulation import harness as emulation

    store, mapped = _Store(), {}
    monkeypatch.setattr(emulated_links, "set_stamps", lambda stamps: mapped.__setitem__("me", stamps))
    monkeypatch.setenv(emulated_links.STAMPS_ENV, str(tmp_path / "p2p-stamps"))
    line = emulation.share_stamps(store, 0, 2, one_host=True, agree=lambda ok: False)  # a peer could not map it
    assert mapped["me"] is None and line.startswith("p2p posting times not shared (a rank could not map")
    line = emulation.share_stamps(store, 1, 2, one_host=False, agree=lambda ok: ok)
    assert mapped["me"] is None and "(the planned ranks are on several hosts)" in line
    store.set(emulation.STAMPS_KEY, str(tmp_path / "gone"))  # not on this host: never created by a reader
    assert emulation.share_stamps(store, 1, 2, one_host=True, agree=lambda ok: ok).startswith("p2p posting times not")
    assert not (tmp_path / "gone").exists()


def test_p2p_falls_through_until_bound():
    works = [_Work()]
    out = emulated_links._delayed_p2p(lambda **kw: works)(
        tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=torch.empty(4, 1, 8), tensor_recv_next=None,
        group=None, prev_pipeline_rank=0, next_pipeline_rank=2)
    assert out is works


def test_dp_sync_is_held_before_the_pipeline_collectives_of_finalize(monkeypatch, clock):
    """The emulated DP sync starts when the stage's last backward ends; the real ``finalize_model_grads`` (whose
    tied-embedding all-reduce waits for the other stages) runs after it, not before."""

    class Synced:
        sync_ms = 150.0

    events = []
    monkeypatch.setattr(emulated_links, "sleep_until", lambda deadline: events.append(("held until", deadline)))
    emulated_links.set_state(Synced())
    try:
        entered = clock.now
        out = emulated_links._held_sync(lambda *a, **k: events.append(("finalize", a)) or "done")("model")
    finally:
        emulated_links.set_state(None)
    assert out == "done"
    assert [name for name, _ in events] == ["held until", "finalize"]   # the sync first, then the real call
    assert events[0][1] - entered == pytest.approx(0.150)                 # for the stage's sync time
    assert events[1][1] == ("model",)
    events.clear()
    assert emulated_links._held_sync(lambda: "plain")() == "plain" and events == []   # unbound: falls through


def test_emulated_links_table_applies_to_installed_megatron():
    import megatron.core.distributed as mcore_distributed
    from megatron.core.pipeline_parallel import p2p_communication

    original = mcore_distributed.finalize_model_grads
    emulated_links.TABLE.apply()
    try:
        assert emulated_links.TABLE.verify() == []
        assert p2p_communication._batched_p2p_ops.__poseidon_patch__ == "emulated_links"
        assert p2p_communication._p2p_ops.__poseidon_patch__ == "emulated_links"
        assert mcore_distributed.finalize_model_grads is not original  # the package's by-name copy, swept
    finally:
        emulated_links.TABLE.revert()
    assert mcore_distributed.finalize_model_grads is original
# --- end to end through poseidon-run (needs the bootstrap / options wiring of --poseidon-emulate-model) -------

import re  # noqa: E402

from poseidon_plugin.costmodel import Candidate, CostModel  # noqa: E402
from poseidon_plugin.emulation import harness as emulation  # noqa: E402
from poseidon_plugin.runtime.job_flags import read_job  # noqa: E402
from poseidon_plugin.runtime.job_spec import job_name, model_spec  # noqa: E402
from poseidon_plugin.specs import ProfileEntry, ProfileSpec  # noqa: E402
from tests.dist.conftest import free_port, in_background, selected  # noqa: E402
from tests.dist.test_launcher import JOB, SCRIPT, poseidon_run  # noqa: E402

EMULATE = "A2-2:1,A2-4:1"
MODEL = "llama3-8b"
ITERS = 4
E2E_JOB = [str(ITERS) if i and JOB[i - 1] == "--train-iters" else a for i, a in enumerate(JOB)]


def _plan_file(path, stage_types, layers) -> tuple[str, float]:
    flags = read_job(SCRIPT, E2E_JOB)
    gbs = 4
    state = emulation.deterministic_state(emulate=EMULATE, emulate_model=MODEL, rank=0, world_size=2,
                                          num_layers=flags.num_layers, global_batch=gbs,
                                          micro_batch_size=flags.micro_batch_size)
    job = model_spec(flags, global_batch_size=gbs, name=job_name(SCRIPT, flags))
    entries = tuple(ProfileEntry(**state.emulated_entry(t, 1, 1)) for t in ("A2-2", "A2-4"))
    profile = ProfileSpec(model=job.name, seq_length=job.seq_length, dtype=job.dtype, entries=entries)
    cm = CostModel(state.cluster, job, profile)
    cand = Candidate(tp=1, pp=2, dp=1, mbs=1, stage_types=stage_types, layers=layers)
    plan = cm.make_plan(cand, comm_model="megatron")
    plan.save(path)
    return str(path), plan.predicted_iteration_ms


SAVED_PLANS = [(("A2-2", "A2-4"), (5, 3)), (("A2-4", "A2-2"), (3, 5))]
SAVED_PLAN_TEST = "test_saved_plan_runs_as_planned_near_its_prediction"
PROFILED_TEST = "test_profiled_plan_predicts_the_watched_iteration"


def _emulated_launch(tmp_path, *extra: str) -> tuple[int, str]:
    """A launch of the end-to-end job on the deterministic emulation (its own rendezvous port: they run at once)."""
    return poseidon_run(["--nproc-per-node", "2", "--master-port", str(free_port()), SCRIPT, *E2E_JOB,
                         "--poseidon-emulate", EMULATE, "--poseidon-emulate-model", MODEL, *extra,
                         "--poseidon-watch-iterations", str(ITERS)], tmp_path)


@pytest.fixture(scope="module", autouse=True)
def emulated_launches(request, tmp_path_factory):
    """The end-to-end launches below, started together with the module's first test: they spend most of their
    time sleeping to emulated deadlines (an emulated deadline is never met early, so what they check does not
    depend on the load of the others). Keyed by the saved plan's ``(stage_types, layers)``, or ``"profiled"``:
    ``(exit code, output, predicted ms of the saved plan / the profile cache folder)``."""
    calls = {}
    if selected(request, SAVED_PLAN_TEST):
        for stage_types, layers in SAVED_PLANS:
            tmp = tmp_path_factory.mktemp("saved-plan")
            plan, predicted = _plan_file(tmp / "plan.json", stage_types, layers)
            calls[stage_types, layers] = (lambda tmp=tmp, plan=plan, predicted=predicted:
                                          (*_emulated_launch(tmp, "--poseidon-plan", plan), predicted))
    if selected(request, PROFILED_TEST):
        tmp = tmp_path_factory.mktemp("profiled")
        cache = str(tmp / "profiles")
        calls["profiled"] = lambda: (*_emulated_launch(tmp, "--poseidon-profile-cache", cache,
                                                       "--poseidon-micro-batch-sizes", "1"), cache)
    with in_background(calls) as launches:
        yield launches


@pytest.mark.parametrize("stage_types, layers", SAVED_PLANS)
def test_saved_plan_runs_as_planned_near_its_prediction(emulated_launches, stage_types, layers):
    code, out, predicted = emulated_launches[stage_types, layers].result()
    assert code == 0, out[-3000:]
    assert "deterministic emulation of llama3-8b" in out
    assert len(re.findall(r"built layers \S+ as planned", out)) == 2, out[-3000:]
    # 4 training steps: 3 whole iterations (step start to next step start)
    median = re.search(r"watch: median of iterations 2-3: measured ([\d.]+) ms vs predicted ([\d.]+) ms", out)
    assert median, out[-3000:]
    measured = float(median.group(1))
    assert float(median.group(2)) == pytest.approx(predicted, rel=1e-3)
    assert measured >= 0.8 * predicted, out[-3000:]  # held deadlines: load can only lengthen an iteration


def test_profiled_plan_predicts_the_watched_iteration(emulated_launches):
    """The whole flow on the deterministic emulation: the profile measures the framework around the layer
    (per-step cost, p2p call, optimizer step), the plan's prediction includes it, and the watch times the same
    span (step start to next step start). How close: scripts/bench_e2e.py."""
    import glob

    from poseidon_plugin.specs import load_profile

    code, out, cache = emulated_launches["profiled"].result()
    assert code == 0, out[-3000:]
    entries = [e for path in glob.glob(f"{cache}/*-tp*-mbs*-*.json") for e in load_profile(path).entries]
    assert entries and all(e.step_forward_ms > 0 and e.step_backward_ms > 0 and e.p2p_call_ms > 0
                           and e.optimizer_fixed_ms > 0 for e in entries)
    assert re.search(r"iteration 1: measured [\d.]+ ms, predicted [\d.]+ ms \([+-][\d.]+%; step start to next "
                     r"step start: schedule, gradient sync, optimizer step\)", out), out[-3000:]
    median = re.search(r"watch: median of iterations 2-3: measured ([\d.]+) ms vs predicted ([\d.]+) ms .*; span: "
                       r"step start to next step start", out)
    assert median, out[-3000:]
    measured, predicted = float(median.group(1)), float(median.group(2))
    assert predicted > 0 and measured >= 0.8 * predicted, out[-3000:]  # deadlines are never met early


def test_bad_emulate_model_is_one_line_before_any_process(capsys, monkeypatch):
    import os

    from poseidon_plugin.runtime import launcher
    from tests.dist.test_launcher import REPO

    monkeypatch.chdir(REPO)
    for key in [k for k in os.environ if k.startswith("POSEIDON_")]:
        monkeypatch.delenv(key)
    code = launcher.main(["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", EMULATE,
                          "--poseidon-emulate-model", "gpt-5:1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert re.search(r"--poseidon-emulate-model 'gpt-5:1': unknown model preset 'gpt-5'", err[0]), err[0]


def test_launcher_gives_each_emulated_job_its_own_stamp_file_and_removes_it():
    import os

    from poseidon_plugin.runtime import launcher

    with launcher._emulation_stamps():
        path = os.environ[emulated_links.STAMPS_ENV]
        assert os.path.isdir(os.path.dirname(path)) and not os.path.exists(path)
    assert not os.path.exists(os.path.dirname(path))
    assert emulated_links.STAMPS_ENV not in os.environ


class _PassThroughHead(torch.nn.Module):
    """A stand-in for GPTModel._postprocess on a stage without the output layer: hands its input back."""

    post_process = False

    def forward(self, hidden_states=None):
        return hidden_states


def test_stretch_mode_hands_a_stage_without_output_layer_its_own_tensor():
    """Megatron-LM's stretch-mode run at PP 2 failed with "counter-productive to free a view of another
    tensor": the head wrapper wrapped a non-last stage's output (which _postprocess returns as is) in a view."""
    head = _PassThroughHead()
    forward = compute_patch._stretched(("hidden_states",), part="head")(_PassThroughHead.forward)
    compute_patch.set_factor(1.5)
    try:
        x = torch.randn(4, 1, 8, requires_grad=True) * 2
        out = forward(head, hidden_states=x)
    finally:
        compute_patch.set_factor(1.0)
    assert out is x and out._base is None
