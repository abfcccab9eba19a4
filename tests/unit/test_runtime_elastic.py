"""runtime/elastic.py without torchrun: attempt scoping, agreement across agents, the end of an attempt, the
agent stopping its workers."""

from __future__ import annotations

import json

import pytest

from poseidon_plugin.errors import PoseidonError
from poseidon_plugin.runtime import elastic


def test_launcher_sets_a_fresh_store_per_round_unless_the_user_chose():
    assert elastic.launcher_env({}) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert elastic.launcher_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}) == {}


def test_keys_belong_to_one_attempt_where_the_agent_store_outlives_attempts():
    agent_store = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert elastic.store_prefix({**agent_store, "TORCHELASTIC_RESTART_COUNT": "0"}) == "poseidon/attempt-0"
    assert elastic.store_prefix({**agent_store, "TORCHELASTIC_RESTART_COUNT": "2"}) == "poseidon/attempt-2"
    # a store of the round's own: agents' restart counts may differ, the store already is the round's
    per_round = {"TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert elastic.store_prefix({**per_round, "TORCHELASTIC_RESTART_COUNT": "0"}) == \
        elastic.store_prefix({**per_round, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert elastic.hosts_store(0, per_round) and not elastic.hosts_store(1, per_round)
    assert not elastic.hosts_store(0, agent_store)


def _told(agent, options, args):
    return {"agent": agent, "options": options, "args": args}


def test_agents_told_different_options_are_named_with_the_field():
    everyone = [_told(0, {"POSEIDON_EMULATE": "A2-2:1,A2-4:1"}, ["--num-layers", "8"]),
                _told(0, {"POSEIDON_EMULATE": "A2-2:1,A2-4:1"}, ["--num-layers", "8"]),
                _told(1, {"POSEIDON_EMULATE": "A2-4:1,A2-2:1"}, ["--num-layers", "8"])]
    with pytest.raises(PoseidonError, match=r"^agent 1 \(rank 2\) was started with POSEIDON_EMULATE='A2-4:1,A2-2:1' "
                                            r"but agent 0 \(rank 0\) with POSEIDON_EMULATE='A2-2:1,A2-4:1'"):
        elastic.check_agreement(everyone)
    missing = [_told(0, {"POSEIDON_KEEP": "1"}, []), _told(1, {}, [])]
    with pytest.raises(PoseidonError, match=r"POSEIDON_KEEP='\(unset\)' but agent 0 \(rank 0\) with POSEIDON_KEEP='1'"):
        elastic.check_agreement(missing)


def test_agents_running_different_flags_are_named_with_the_argument():
    everyone = [_told(0, {}, ["--num-layers", "8", "--lr", "0.1"]), _told(1, {}, ["--num-layers", "6", "--lr", "0.1"])]
    with pytest.raises(PoseidonError, match=r"agent 1 \(rank 1\) runs the script with different flags than agent 0 "
                                            r"\(rank 0\): argument 2 is '--num-layers 6 --lr' there"):
        elastic.check_agreement(everyone)
    elastic.check_agreement([_told(0, {}, ["-x"]), _told(1, {}, ["-x"])])  # the same: no error


class _Store:
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.keys: dict[str, str] = {}
        self.broken = False

    def add(self, key, n):
        if self.broken:
            raise RuntimeError("Connection closed")
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]

    def set(self, key, value):
        if self.broken:
            raise RuntimeError("Connection closed")
        self.keys[key] = value

    def check(self, keys):
        if self.broken:
            raise RuntimeError("Connection closed")
        return all(k in self.keys for k in keys)


def test_an_unused_rank_waits_until_the_planned_ranks_are_done():
    store, polls = _Store(), []

    def sleep(s):
        polls.append(s)
        if len(polls) == 3:  # the two planned ranks finish while it waits
            elastic.mark_done(store, planned=True)
            elastic.mark_done(store, planned=True)

    assert elastic.wait_for_job(store, 2, lambda: [], sleep=sleep) is None
    assert len(polls) == 3
    assert store.counts == {elastic.PLANNED_DONE_KEY: 2, elastic.DONE_KEY: 2}


def test_an_unused_rank_stops_waiting_for_a_lost_rank_or_a_lost_store():
    store = _Store()
    why = elastic.wait_for_job(store, 2, lambda: ["rank 1 (pid 7 on h): its process is gone"], sleep=lambda s: None)
    assert why == "lost rank 1 (pid 7 on h): its process is gone"
    store.broken = True
    assert elastic.wait_for_job(store, 2, lambda: [], sleep=lambda s: None) == "the job's store is gone (RuntimeError)"


def test_the_store_host_waits_for_every_rank_with_a_bound():
    now = [0.0]
    store = _Store()

    def sleep(s):
        now[0] += s

    assert not elastic.wait_for_everyone(store, 3, 10.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] >= 10.0
    for _ in range(3):
        elastic.mark_done(store, planned=False)
    assert elastic.wait_for_everyone(store, 3, 10.0, clock=lambda: now[0], sleep=sleep)


def test_each_attempt_records_its_plan_and_reads_the_previous_one(tmp_path):
    path = str(tmp_path / "runs" / "job.json")
    assert elastic.record_plan(path, {"hash": "a"}, {"A2-2": 2, "A2-4": 2}) is None
    previous = elastic.record_plan(path, {"hash": "b"}, {"A2-2": 2})
    assert previous == {"sequence": 0, "devices": {"A2-2": 2, "A2-4": 2}, "plan": {"hash": "a"}}
    assert json.loads(open(path).read())["sequence"] == 1
    assert elastic.fleet_change(previous["devices"], {"A2-2": 2}) == "A2-4 x2 gone"
    assert elastic.fleet_change({"A2-2": 1}, {"A2-2": 2, "A2-4": 1}) == "A2-2 x1 added, A2-4 x1 added"
    assert elastic.fleet_change({"A2-2": 1}, {"A2-2": 1}) == "same devices"
    (tmp_path / "runs" / "job.json").write_text('{"sequence": "x"}')  # damaged: no previous record
    assert elastic.record_plan(path, {"hash": "c"}, {"A2-2": 1}) is None


def test_an_agent_declares_its_own_devices_when_they_are_its_ranks_only():
    """Defect 8: with --nnodes 1:2 every attempt failed (declared devices vs world)."""
    assert elastic.agent_declares(1, world_size=2, local_world_size=1)
    assert not elastic.agent_declares(2, world_size=2, local_world_size=1)  # the job's devices
    assert not elastic.agent_declares(1, world_size=1, local_world_size=1)  # one agent: the same either way
    assert not elastic.agent_declares(3, world_size=4, local_world_size=2)  # neither: the ranks say so


def test_the_job_is_the_union_of_the_agents_own_devices_in_rank_order():
    def doc(agent, devices, emulate="A2-2:1"):
        return {"agent": agent, "devices": devices, "args": [], "options": {"POSEIDON_EMULATE": emulate}}

    everyone = [doc(0, "A2-2:2"), doc(0, "A2-2:2"), doc(1, "A2-4:1")]
    assert elastic.union_of_agents(everyone) == "A2-2:2,A2-4:1"
    with pytest.raises(PoseidonError, match=r"agent 1 \(rank 2\) declared no devices of its own"):
        elastic.union_of_agents([doc(0, "A2-2:2"), doc(0, "A2-2:2"), doc(1, None)])
    with pytest.raises(PoseidonError, match="agent 0's ranks are not contiguous"):
        elastic.union_of_agents([doc(0, "A2-2:1"), doc(1, "A2-4:1"), doc(0, "A2-2:1")])


def test_agents_declaring_their_own_devices_agree_on_the_rest(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    mine = elastic.told({"POSEIDON_EMULATE": "A2-4:1", "POSEIDON_TIMEOUT": "90"}, ["--x"], own_devices="A2-4:1")
    monkeypatch.setenv("GROUP_RANK", "0")
    first = elastic.told({"POSEIDON_EMULATE": "A2-2:1", "POSEIDON_TIMEOUT": "90"}, ["--x"], own_devices="A2-2:1")
    elastic.check_agreement([first, mine])  # different own devices: fine
    whole = elastic.told({"POSEIDON_EMULATE": "A2-2:1,A2-4:1", "POSEIDON_TIMEOUT": "90"}, ["--x"])
    with pytest.raises(PoseidonError, match=r"POSEIDON_EMULATE='A2-2:1,A2-4:1' but agent 1 \(rank 0\) with "
                                            r"POSEIDON_EMULATE='\(each agent its own devices\)'"):
        elastic.check_agreement([mine, whole])


def test_agents_on_hosts_of_different_speed_emulate_with_the_slowest(monkeypatch, capsys):
    """Each agent's poseidon-run times its own host once (every attempt of that agent then uses the same
    factor); the ranks of all agents agree on the largest without refusing the job."""
    from poseidon_plugin.emulation import harness
    from poseidon_plugin.runtime.launcher import host_factor_env

    monkeypatch.delenv(harness.HOST_FACTOR_ENV, raising=False)
    fast = host_factor_env({}, measure=lambda: 0.9 * harness.HOST_LOOP_MS)
    assert fast == {harness.HOST_FACTOR_ENV: "1"} and capsys.readouterr().out == ""
    slow = host_factor_env({}, measure=lambda: 2.2 * harness.HOST_LOOP_MS)
    assert slow == {harness.HOST_FACTOR_ENV: "2"} and "counts 2x" in capsys.readouterr().out

    def never():
        raise AssertionError("a pinned factor is not measured")

    assert host_factor_env({harness.HOST_FACTOR_ENV: "1.5"}, measure=never) == {}
    with pytest.raises(PoseidonError, match=harness.HOST_FACTOR_ENV):
        host_factor_env({harness.HOST_FACTOR_ENV: "quick"}, measure=never)
    options = {"POSEIDON_EMULATE_MODEL": "llama2-13b"}
    everyone = [elastic.told(options, ["--x"], host_factor=1.0), elastic.told(options, ["--x"], host_factor=2.0)]
    elastic.check_agreement(everyone)  # not an option: agents may differ
    assert elastic.slowest_host(everyone) == 2.0
    assert elastic.slowest_host([{"agent": 0}]) == 1.0  # a rank that reports none: the reference host


def test_test_faults_name_an_attempt_or_a_world_size():
    pytest.importorskip("torch")
    from poseidon_plugin.runtime.collectives import parse_fault

    assert parse_fault("hand-over:0:wait:w1", attempt=0, world_size=1) == ("hand-over", 0, "wait")
    assert parse_fault("hand-over:0:wait:w1", attempt=0, world_size=2) is None
    assert parse_fault("hand-over:1:kill:0", attempt=1, world_size=2) is None
    with pytest.raises(PoseidonError, match="PHASE:RANK"):
        parse_fault("hand-over:0:wait:x1")


@pytest.mark.parametrize("tokens, tp, divisible_by, rows", [
    (128, 1, 128, 128), (128, 2, 128, 256), (513, 1, 128, 640), (513, 2, 128, 768), (513, 2, 64, 640)])
def test_the_vocabulary_pads_to_a_multiple_of_the_divisor_times_tp(tokens, tp, divisible_by, rows):
    assert elastic.padded_vocab(tokens, tp, divisible_by) == rows


def test_the_divisor_that_pads_a_tp_to_the_checkpoints_rows():
    assert elastic.divisor_for_rows(640, 513, 2) == 64  # Megatron-LM's NullTokenizer: 512 + 1 tokens
    assert elastic.divisor_for_rows(128, 128, 2) == 64
    assert elastic.padded_vocab(513, 2, elastic.divisor_for_rows(640, 513, 2)) == 640
    assert elastic.divisor_for_rows(640, 513, 3) is None  # 640 rows do not split into 3 equal shards
    assert elastic.divisor_for_rows(256, 513, 1) is None  # fewer rows than tokens


def test_a_resume_padded_otherwise_warns_with_the_rows_and_the_flag():
    assert elastic.vocab_padding_warning(load="ck", checkpoint_rows=640, tokens=513, tp=1) is None
    grown = elastic.vocab_padding_warning(load="ck", checkpoint_rows=640, tokens=513, tp=2)
    assert grown == ("warning: --load ck: the checkpoint's embedding has 640 vocabulary rows but this plan's TP 2 "
                     "pads the 513 tokens to 768 (a multiple of --make-vocab-size-divisible-by 128 x TP 2): rows "
                     "641-768 are not in the checkpoint: they start from their initialization and join the softmax, "
                     "so the loss resumes above the uninterrupted run's; --make-vocab-size-divisible-by 64 pads TP 2 "
                     "to the checkpoint's 640 rows")
    shrunk = elastic.vocab_padding_warning(load="ck", checkpoint_rows=768, tokens=513, tp=1)
    assert "the checkpoint's rows 641-768 are left out" in shrunk and "--make-vocab-size-divisible-by 256 pads TP 1" in shrunk
    none = elastic.vocab_padding_warning(load="ck", checkpoint_rows=640, tokens=513, tp=3)
    assert none.endswith("no --make-vocab-size-divisible-by pads TP 3 to 640 rows: resume under a TP that divides "
                         "640 and pads alike")


def test_the_checkpoint_folder_is_megatrons_tracker_or_the_step(tmp_path):
    assert elastic.checkpoint_folder(str(tmp_path)) is None  # no tracker: a fresh start
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert elastic.checkpoint_folder(str(tmp_path)) == str(tmp_path / "iter_0000004")
    assert elastic.checkpoint_folder(str(tmp_path), 2) is None  # no such iteration saved
    (tmp_path / "release").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert elastic.checkpoint_folder(str(tmp_path)) == str(tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert elastic.checkpoint_folder(str(tmp_path)) is None


def test_the_test_only_exit_barrier_is_a_positive_number_of_seconds():
    assert elastic.exit_barrier_timeout({}) is None
    assert elastic.exit_barrier_timeout({"POSEIDON_INJECT_EXIT_BARRIER": "5"}) == 5.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(PoseidonError, match=r"^POSEIDON_INJECT_EXIT_BARRIER='.*' is not a positive number"):
            elastic.exit_barrier_timeout({"POSEIDON_INJECT_EXIT_BARRIER": bad})


def test_the_failing_store_host_waits_for_each_rank_to_leave_or_be_lost_with_a_bound():
    now, store = [0.0], _Store()

    def sleep(s):
        now[0] += s
        if now[0] >= 1.0:   # rank 2 reads the failure and leaves a second later
            elastic.mark_left(store, 2)

    lost: set[int] = set()
    assert not elastic.wait_for_peers_to_leave(store, 0, 4, lambda: lost, 5.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] >= 5.0                                           # ranks 1 and 3 never left: bounded
    elastic.mark_left(store, 1)
    lost.add(3)                                                    # rank 3's process is gone: nothing to wait for
    now[0] = 0.0
    assert elastic.wait_for_peers_to_leave(store, 0, 4, lambda: lost, 5.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 0.0                                           # no poll needed
    store.broken = True
    assert not elastic.wait_for_peers_to_leave(store, 0, 4, lambda: set(), 5.0, clock=lambda: now[0], sleep=sleep)


def test_stopping_the_workers_kills_a_stopped_worker_at_once_and_leaves_the_others_to_torchrun():
    """torchrun stops its workers with SIGTERM and waits 30 s for them before SIGKILL; a stopped worker holds
    the SIGTERM pending all that time. The agent's close now kills a stopped worker (its process group) first;
    a running worker is left to torchrun's own close."""
    import signal
    import subprocess
    import sys
    import time

    def worker():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)

    stopped, running = worker(), worker()
    try:
        stopped.send_signal(signal.SIGSTOP)
        for _ in range(500):               # the kernel stops it asynchronously
            if elastic.process_stopped(stopped.pid):
                break
            time.sleep(0.01)
        assert elastic.process_stopped(stopped.pid) and not elastic.process_stopped(running.pid)
        closed = []

        class PContext:                    # the part of torchrun's process context the agent uses
            def pids(self):
                return {0: stopped.pid, 1: running.pid}

            def close(self, death_sig=None, timeout=30):
                # the stopped worker is gone before torchrun's close; the running one is still there
                closed.append((death_sig, timeout, stopped.wait(10), running.poll()))

        pcontext = PContext()
        elastic._kill_stopped_on_close(pcontext)
        pcontext.close(signal.SIGTERM, 30)
        assert closed == [(signal.SIGTERM, 30, -signal.SIGKILL, None)]
        assert not elastic.process_stopped(running.pid) and not elastic.process_stopped(10 ** 9)
    finally:
        for proc in (stopped, running):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
