"""Resuming under another plan (issue 25): ``--save`` / ``--load`` of ``scripts/pretrain_gpt.py`` (megatron-core
``dist_checkpointing``, torch_dist) through ``poseidon-run``, the second launch on another fleet and plan.

Tolerance of the loss comparison: the resumed run must train the iterations after the checkpoint as the
uninterrupted run did. The script logs the loss with 4 decimals, so two equal losses can print up to 1e-4
apart; what else differs between plans is the order of fp32 sums (TP splits the matmul reductions, DP and PP
sum gradients in other groupings), about 1e-7 relative, far below the print. Hence ``LOSS_TOLERANCE`` =
2e-4. A broken resume is much further off (measured on this job's 4-layer twin): weights not loaded ~4e-2
at the first resumed iteration, the batches of other iterations ~1e-2, a fresh optimizer (``--no-load-optim``,
Adam's moments lost) 7e-4 at the second one.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.dist.conftest import free_port, module_launches  # noqa: E402
from tests.dist.test_launcher import JOB, SCRIPT, emulated_plan, poseidon_run  # noqa: E402

LOSS_TOLERANCE = 2e-4
PADDING_TEST = "test_a_resume_whose_tp_pads_the_vocabulary_otherwise_warns_and_the_flag_avoids_it"


def _with(args: list[str], **values: str) -> list[str]:
    """``args`` with the values of some flags replaced (``train_iters="6"``: ``--train-iters 6``)."""
    out = list(args)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


# vocabulary 256: Megatron pads it to a multiple of 128 x TP, so TP 1 and TP 2 hold the same embedding
RESUME_JOB = _with(JOB, vocab_size="256", train_iters="6")


def iteration_losses(output: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in re.findall(r"^iteration (\d+)/\d+ \| lm loss ([-+\w.]+)", output, re.M)}


def test_a_checkpoint_resumes_under_another_plan_on_another_fleet(tmp_path):
    ck = str(tmp_path / "ck")
    first = emulated_plan(tmp_path / "first.json", [("A2-2", 1), ("A2-4", 1)], stage_types=["A2-2", "A2-4"],
                          layers=[3, 5], job_args=RESUME_JOB)
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *RESUME_JOB, "--save", ck, "--save-interval", "3",
                              "--poseidon-emulate", "A2-2:1,A2-4:1", "--poseidon-plan", first], tmp_path)
    assert code == 0, out[-4000:]
    uninterrupted = iteration_losses(out)
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6], out[-4000:]
    assert re.search(r"^saved checkpoint at iteration 3 to ", out, re.M), out[-4000:]

    # the fleet changed: two A2-4 devices, one TP-2 stage instead of a PP-2 pipeline split 3/5
    second = emulated_plan(tmp_path / "second.json", [("A2-4", 2)], stage_types=["A2-4"], layers=[8], tp=2,
                           job_args=RESUME_JOB)
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *RESUME_JOB, "--load", ck, "--ckpt-step", "3",
                              "--poseidon-emulate", "A2-4:2", "--poseidon-plan", second], tmp_path)
    assert code == 0, out[-4000:]
    assert re.search(rf"^loaded checkpoint from {re.escape(ck)} at iteration 3 \(TP 2 PP 1 DP 1\) in [\d.]+ s$", out, re.M), out[-4000:]
    resumed = iteration_losses(out)
    assert sorted(resumed) == [4, 5, 6], out[-4000:]  # the iteration counter continues
    for iteration, loss in resumed.items():
        assert abs(loss - uninterrupted[iteration]) <= LOSS_TOLERANCE, (iteration, loss, uninterrupted)


def _padding_launches(tmp_path) -> tuple[str, tuple[int, str], tuple[int, str], tuple[int, str]]:
    """The padding test's three launches, one after another (each on a rendezvous port of its own: they run
    beside the other test's): ``(checkpoint folder, TP 1 save, TP 2 resume, TP 2 resume with the flag)``."""
    job = _with(JOB, train_iters="3")
    ck = str(tmp_path / "ck")
    one = emulated_plan(tmp_path / "tp1.json", [("A2-4", 1)], stage_types=["A2-4"], layers=[8], job_args=job)
    two = emulated_plan(tmp_path / "tp2.json", [("A2-4", 2)], stage_types=["A2-4"], layers=[8], tp=2, job_args=job)
    resume = [SCRIPT, *job, "--load", ck, "--ckpt-step", "2", "--poseidon-emulate", "A2-4:2", "--poseidon-plan", two]

    def launch(nproc: int, args: list[str]) -> tuple[int, str]:
        return poseidon_run(["--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args], tmp_path)

    saved = launch(1, [SCRIPT, *job, "--save", ck, "--save-interval", "2", "--poseidon-emulate", "A2-4:1",
                       "--poseidon-plan", one])
    if saved[0] != 0:
        return ck, saved, (-1, ""), (-1, "")
    warned = launch(2, resume)
    return ck, saved, warned, launch(2, [*resume, "--make-vocab-size-divisible-by", "64"])


@pytest.fixture(scope="module", autouse=True)
def padding_launches(request, tmp_path_factory):
    """The padding test's launches, started with the module's first test: they run beside the other test's
    launches (their losses do not depend on the load; neither test checks a timing)."""
    with module_launches(request, tmp_path_factory, {PADDING_TEST: _padding_launches}) as launches:
        yield launches


def test_a_resume_whose_tp_pads_the_vocabulary_otherwise_warns_and_the_flag_avoids_it(padding_launches):
    """--vocab-size 128 holds 128 rows at TP 1 and 256 at TP 2 (Megatron-LM pads to a multiple of
    --make-vocab-size-divisible-by 128 x TP): resumed under TP 2, rank 0 warns once, naming both sizes and the
    flag's value that pads TP 2 to the checkpoint's rows; with that value given there is no warning and the
    loss continues as the uninterrupted run's."""
    ck, (code, out), warned, flagged = padding_launches[PADDING_TEST].result()
    assert code == 0, out[-4000:]
    uninterrupted = iteration_losses(out)
    code, out = warned
    assert code == 0, out[-4000:]
    warnings = re.findall(r"^poseidon: warning: --load .*$", out, re.M)
    assert warnings == [f"poseidon: warning: --load {ck}: the checkpoint's embedding has 128 vocabulary rows but this "
                        f"plan's TP 2 pads the 128 tokens to 256 (a multiple of --make-vocab-size-divisible-by 128 x "
                        f"TP 2): rows 129-256 are not in the checkpoint: they start from their initialization and "
                        f"join the softmax, so the loss resumes above the uninterrupted run's; "
                        f"--make-vocab-size-divisible-by 64 pads TP 2 to the checkpoint's 128 rows"], out[-4000:]
    code, out = flagged
    assert code == 0, out[-4000:]
    assert "poseidon: warning: --load" not in out, out[-4000:]
    resumed = iteration_losses(out)
    assert sorted(resumed) == [3], out[-4000:]
    assert abs(resumed[3] - uninterrupted[3]) <= LOSS_TOLERANCE, (resumed, uninterrupted)
