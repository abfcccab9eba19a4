"""The job's own step by stage position (``runtime/client_step.py``): the training script's own functions are
timed, at the first, a middle and the last pipeline position, with the loss function on the last only.

A stand-in script keeps its own clock (the device's marks read it), so the differences are exact; the real
scripts (``scripts/pretrain_gpt.py`` here, Megatron-LM's in ``test_megatron_lm_client.py``) run as they are.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from poseidon_plugin.runtime import client_step
from poseidon_plugin.runtime.devices import Device
from poseidon_plugin.runtime.job_flags import read_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "128", "--micro-batch-size", "1", "--global-batch-size", "4")

STAND_IN = '''
from functools import partial

from megatron.core import parallel_state

CLOCK = [0.0]   # what the device's marks read: each part of the step advances it by its own cost
CALLS = []


def parse_args(argv):
    return {"argv": list(argv)}


def synthetic_batches(args, vocab, device):
    while True:
        yield {"argv": args["argv"]}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    CLOCK[0] += 1.0 + (5.0 if first else 0.0) + (2.0 if last else 0.0)   # its data, more at the ends
    CALLS.append(("step", first, last, batch["argv"]))
    return model(None), partial(_loss, last)


def _loss(last, output):
    CLOCK[0] += 4.0
    CALLS.append(("loss", last))
    return output.sum(), {}


if __name__ == "__main__":
    raise SystemExit("loaded as __main__")
'''


class _ScriptClock(Device):
    """A CPU device whose marks read the stand-in script's clock."""

    def __init__(self, client: client_step.Client) -> None:
        super().__init__(0)
        self.client = client

    def mark(self):
        return self.client.namespace()["CLOCK"][0]

    def ms_between(self, start, stop):
        return stop - start


def _client(tmp_path, source: str) -> client_step.Client:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(source))
    return client_step.Client(script=str(path), args=ARGS)


def test_positions_are_the_scripts_own_step_and_loss(tmp_path):
    client = _client(tmp_path, STAND_IN)
    job = read_job("train.py", ARGS)
    costs = client_step.measure(client, job, _ScriptClock(client), None, 2, 4, torch.zeros(4, 16), iters=3)
    # a middle stage's step costs 1; first: +5 of data beyond it; last: +2 of data and the 4 of its loss function
    assert costs == {"middle_step_ms": 1.0, "first_step_ms": 5.0, "last_step_ms": 6.0}
    calls = client.namespace()["CALLS"]
    rounds = 1 + client_step.MIN_ROUNDS   # one untimed, then at least MIN_ROUNDS (more than iters=3)
    steps = [c[1:3] for c in calls if c[0] == "step"]
    assert steps == [(True, False), (False, False), (False, True)] * rounds   # first, middle, last in turn
    assert [c for c in calls if c[0] == "loss"] == [("loss", True)] * rounds   # the last position only
    # the script's own argument parser saw the profiled TP and micro-batch size
    argv = calls[0][3]
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "2"
    assert argv[argv.index("--micro-batch-size") + 1] == "4"
    from megatron.core import parallel_state

    assert parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK is None   # restored after


def test_poseidons_own_script_is_timed_with_its_own_batches():
    client = client_step.Client(script=os.path.join(REPO, "scripts", "pretrain_gpt.py"), args=ARGS)
    assert client_step.kind(client)[0] == "pretrain_gpt.py"
    job = read_job("pretrain_gpt.py", ARGS)
    costs = client_step.measure(client, job, Device(0), None, 1, 2, torch.zeros(2, 16), iters=2)
    assert set(costs) == {"middle_step_ms", "first_step_ms", "last_step_ms"} and min(costs.values()) >= 0.0


@pytest.mark.parametrize("source, why", [
    ("x = 1\n", "defines no forward_step"),
    ("raise RuntimeError('needs a GPU')\n", "does not load as a module (RuntimeError: needs a GPU)"),
    ("def forward_step(data_iterator, model):\n    pass\n", "is neither Megatron-LM's pretrain_gpt.py nor Poseidon's"),
])
def test_other_scripts_are_not_timed_and_say_why(tmp_path, source, why):
    client = _client(tmp_path, source)
    costs = client_step.measure(client, read_job("train.py", ARGS), Device(0), None, 1, 1, torch.zeros(1, 16),
                                iters=1)
    assert isinstance(costs, str) and why in costs
    assert client_step.describe(costs).startswith("job's own step not profiled: ")
