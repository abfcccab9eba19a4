"""Megatron-LM's own ``pretrain_gpt.py`` resumes from its ``torch_dist`` checkpoint through ``poseidon-run``
with its loss continuing as the uninterrupted run's (issue 25), dropout on (Megatron-LM's default 0.1).

What Megatron-LM prints: ``training_log`` does not reset its loss sums after the first iteration a launch logs
(``should_reset = not is_first_iteration``, on any device), so with ``--log-interval 1`` the second iteration a
launch logs shows the mean of its first two. The uninterrupted run's iteration 2 and the resumed run's
iteration 4 are such means; :func:`own_losses` takes each iteration's own loss back out (2 x mean - first).

Tolerance: Megatron-LM prints 7 significant digits (``6.460507E+00``: a rounding of at most 5e-7); an own loss
taken out of a mean carries three roundings (1.5e-6). The same plan sums in the same order, so nothing else
may differ: ``LOSS_TOLERANCE`` = 1e-5. A broken resume is much further off (measured on this job): the
dropout stream shifted by the data loader's seed draw 1.8e-3 at the first resumed iteration.

Under another plan Megatron-LM itself changes two things, on any device: it ignores the checkpoint's RNG state
when TP or PP differ ("RNG state will be ignored": dropout draws other masks), and it pads the vocabulary to a
multiple of ``--make-vocab-size-divisible-by`` x TP, so a padded size that differs between the plans adds
untrained rows to the softmax (NullTokenizer's 512 + 1 tokens: 640 rows at TP 1, 768 at TP 2; measured
6.6185 against 6.4385, about log(768 / 640)). The plan-change test therefore trains without dropout, with a
vocabulary both plans pad alike (511 + 1 = 512).
"""

from __future__ import annotations

import re

from tests.dist.test_megatron_lm_client import SCRIPT, lm_losses  # noqa: F401  (skips without the checkout)
from tests.dist.test_launcher import poseidon_run

LOSS_TOLERANCE = 1e-5
JOB = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4",
       "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
       "--log-interval", "1", "--ckpt-format", "torch_dist", "--poseidon-emulate", "A2-2:1",
       "--poseidon-emulate-model", "llama2-13b"]


def own_losses(out: str) -> dict[int, float]:
    """Each logged iteration's own loss (the second a launch logs is printed as the mean of the first two)."""
    logged = [(int(i), float(x)) for i, x in re.findall(r"iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([-+\w.]+) \|", out)]
    own = dict(logged)
    if len(logged) > 1:
        (_, first), (second, mean) = logged[0], logged[1]
        own[second] = 2 * mean - first
    return own


def test_megatron_lms_script_resumes_with_the_uninterrupted_runs_loss(tmp_path):
    ck = str(tmp_path / "ck")
    cache = ["--poseidon-profile-cache", str(tmp_path / "cache")]
    code, out = poseidon_run(["--nproc-per-node", "1", SCRIPT, *JOB, *cache, "--save", ck, "--save-interval", "2"],
                             tmp_path)
    assert code == 0, out[-4000:]
    uninterrupted = own_losses(out)
    assert sorted(uninterrupted) == [1, 2, 3, 4], out[-4000:]
    code, out = poseidon_run(["--nproc-per-node", "1", SCRIPT, *JOB, *cache, "--load", ck, "--ckpt-step", "2"],
                             tmp_path)
    assert code == 0, out[-4000:]
    assert "CPU rank: data iterators built with the CPU generator's state kept" in out
    resumed = own_losses(out)
    assert sorted(resumed) == [3, 4], out[-4000:]  # continues from the saved iteration
    for iteration, loss in resumed.items():
        assert abs(loss - uninterrupted[iteration]) <= LOSS_TOLERANCE, (iteration, loss, uninterrupted)


def test_megatron_lms_script_resumes_interleaved_pp2_as_tp2_with_larger_micro_batches(tmp_path):
    ck = str(tmp_path / "ck")
    values = {"--num-layers": "8", "--vocab-size": "511", "--poseidon-emulate": "A2-2:2"}
    job = [values.get(JOB[i - 1], a) if i else a for i, a in enumerate(JOB)]
    job += ["--hidden-dropout", "0", "--attention-dropout", "0", "--poseidon-keep", "--poseidon-profile-cache",
            str(tmp_path / "cache")]
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *job, "--tensor-model-parallel-size", "1",
                              "--pipeline-model-parallel-size", "2", "--poseidon-schedules", "interleaved-1f1b",
                              "--save", ck, "--save-interval", "2"], tmp_path)
    assert code == 0, out[-4000:]
    assert re.search(r"^poseidon: TP 1  PP 2  DP 1  V 2 ", out, re.M), out[-4000:]
    uninterrupted = own_losses(out)
    code, out = poseidon_run(["--nproc-per-node", "2", SCRIPT, *job, "--tensor-model-parallel-size", "2",
                              "--pipeline-model-parallel-size", "1", "--micro-batch-size", "4", "--load", ck,
                              "--ckpt-step", "2"], tmp_path)
    assert code == 0, out[-4000:]
    assert re.search(r"^poseidon: TP 2  PP 1  DP 1  V 1 .* mbs 4 ", out, re.M), out[-4000:]
    resumed = own_losses(out)
    assert sorted(resumed) == [3, 4], out[-4000:]
    for iteration, loss in resumed.items():
        assert abs(loss - uninterrupted[iteration]) <= LOSS_TOLERANCE, (iteration, loss, uninterrupted)
