"""Faults at every phase end on every rank with one shared line that names the rank (issue 9, items 2 and 11).

Each case is a real ``poseidon-run`` launch on gloo with an injected fault (``POSEIDON_INJECT_FAULT``):
``raise`` (an exception), ``kill`` (SIGKILL: the rank vanishes without a word) or ``stop`` (SIGSTOP: the
rank freezes, as a hung host would).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.dist.conftest import free_port, module_launches  # noqa: E402
from tests.dist.test_launcher import JOB, SCRIPT, emulated_plan, poseidon_run  # noqa: E402

TWO = ["--nproc-per-node", "2", SCRIPT, *JOB, "--poseidon-emulate", "A2-2:1,A2-4:1"]
FROZEN_TEST = "test_frozen_rank_is_named_while_waiting_and_at_the_timeout"


@pytest.fixture(scope="module", autouse=True)
def frozen_launch(request, tmp_path_factory):
    """The launch of :func:`test_frozen_rank_is_named_while_waiting_and_at_the_timeout`, started with the
    module's first test: it spends most of its time idle (rank 1 stopped, rank 0 waiting out the 25 s
    timeout), so it runs beside the module's other launches instead of after them. It gets a rendezvous port
    of its own (``--master-port``; the others use torchrun's default)."""
    def launch(tmp):
        return poseidon_run(["--master-port", str(free_port()), *TWO, "--poseidon-timeout", "25"], tmp,
                            env={"POSEIDON_INJECT_FAULT": "profiling:1:stop"})
    with module_launches(request, tmp_path_factory, {FROZEN_TEST: launch}) as launches:
        yield launches


def _error_lines(out: str) -> dict[str, str]:
    return dict(re.findall(r"^poseidon\[rank (\d)\]: error: (.*)$", out, re.M))


def _saved_plan(tmp_path) -> str:
    return emulated_plan(tmp_path / "plan.json", [("A2-2", 1), ("A2-4", 1)], stage_types=["A2-2", "A2-4"],
                         layers=[5, 3])


@pytest.mark.parametrize("phase", ["apply", "placement"])
def test_late_phase_failure_ends_every_rank_with_one_line(tmp_path, phase):
    """Apply has no collective of its own: the other rank learns of the failure at the placement barrier."""
    code, out = poseidon_run([*TWO, "--poseidon-plan", _saved_plan(tmp_path)], tmp_path,
                             env={"POSEIDON_INJECT_FAULT": f"{phase}:1"})
    assert code == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = _error_lines(out)
    assert set(errors) == {"0", "1"}, out[-4000:]
    for message in errors.values():
        assert re.fullmatch(rf"{phase} failed on rank 1: RuntimeError: injected fault in {phase} "
                            r"\(POSEIDON_INJECT_FAULT\) \(at poseidon_plugin/runtime/collectives\.py:\d+ in _maybe_inject\)",
                            message), message


def test_killed_rank_is_named_by_the_others_and_the_launcher(tmp_path):
    code, out = poseidon_run([*TWO, "--poseidon-timeout", "60"], tmp_path,
                             env={"POSEIDON_INJECT_FAULT": "profiling:1:kill"})
    assert code != 0
    assert "Traceback" not in out, out[-4000:]
    errors = _error_lines(out)
    assert set(errors) == {"0"}, out[-4000:]  # rank 1 died without a word
    assert re.fullmatch(r"(profiling: lost contact with|stopped by the launcher: lost) rank 1 \(pid \d+ on \S+\): "
                        r"its process is gone(, during Poseidon's start-up)?", errors["0"]), errors["0"]
    assert re.search(r"^poseidon-run: rank 1 \(pid \d+ on \S+\) was killed by SIGKILL first", out, re.M), out[-2000:]


def test_an_unexpected_error_names_where_it_was_raised():
    """An exception without a message (megatron-core's bare asserts) still says where it came from, from the
    package folder on (the same on every machine)."""
    from poseidon_plugin.runtime.collectives import origin

    code = compile("def check(grad):\n    assert grad == 'torch.cuda.FloatTensor'\n",
                   "/opt/venv/lib/python3.11/site-packages/megatron/core/optimizer/clip_grads.py", "exec")
    namespace: dict = {}
    exec(code, namespace)
    with pytest.raises(AssertionError) as caught:
        namespace["check"]("torch.FloatTensor")
    assert origin(caught.value) == "at megatron/core/optimizer/clip_grads.py:2 in check"
    assert origin(AssertionError()) == "where unknown"


def test_the_origin_skips_torch_and_the_cpu_shims_mode():
    import torch

    from poseidon_plugin.emulation import cpu_shim
    from poseidon_plugin.runtime.collectives import origin

    def project(a, b):  # a bf16 weight meeting an fp32 activation, through the CPU shim's mode
        return torch.matmul(a, b)

    with cpu_shim.cpu_shim(force=True):
        with pytest.raises(RuntimeError) as caught:
            project(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bfloat16))
    assert re.fullmatch(r"at test_faults\.py:\d+ in project", origin(caught.value)), origin(caught.value)


@pytest.mark.parametrize("phase", ["inventory", "profiling"])
def test_a_failure_on_the_rank_hosting_the_store_reaches_every_rank(tmp_path, phase):
    """Launcher rank 0 hosts the workers' store: leaving at once took the store, and with it its recorded
    failure, from the others (they said that no rank recorded one, after torch's C++ stack dumps)."""
    code, out = poseidon_run(TWO, tmp_path, env={"POSEIDON_INJECT_FAULT": f"{phase}:0"})
    assert code == 1, out[-4000:]
    errors = _error_lines(out)
    assert set(errors) == {"0", "1"}, out[-4000:]
    for message in errors.values():
        assert message.startswith(f"{phase} failed on rank 0: RuntimeError: injected fault in {phase}"), message
    assert "no rank recorded a failure" not in out and "frame #0" not in out, out[-4000:]


# last: its launch (fixture frozen_launch) has then had the other launches' time to reach its timeout
def test_frozen_rank_is_named_while_waiting_and_at_the_timeout(frozen_launch):
    code, out = frozen_launch[FROZEN_TEST].result()
    assert code != 0
    assert re.search(r"^poseidon\[rank 0\]: profiling is waiting for rank 1 \(pid \d+ on \S+\): silent for \d+ s "
                     r"\(stopped, hung or dead\); it fails when the timeout \(--poseidon-timeout\) runs out$",
                     out, re.M), out[-4000:]
    errors = _error_lines(out)
    assert re.fullmatch(r"profiling: lost contact with rank 1 \(pid \d+ on \S+\): silent for \d+ s "
                        r"\(stopped, hung or dead\)", errors.get("0", "")), out[-4000:]
    # the stopped rank is killed at once, not after torchrun's 30 s wait on its SIGTERM
    assert "Unable to shutdown process" not in out, out[-4000:]
