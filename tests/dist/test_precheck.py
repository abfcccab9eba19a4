"""Mistakes caught before torchrun starts (issue 9, items 3, 4 and 9): one line, exit 2, no rank started."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from poseidon_plugin.runtime import launcher  # noqa: E402
from poseidon_plugin.runtime.watch import priced_elsewhere  # noqa: E402
from poseidon_plugin.plan import Plan  # noqa: E402
from tests.dist.test_launcher import JOB, SCRIPT, emulated_plan  # noqa: E402

EMULATE = ["--poseidon-emulate", "A2-2:2,A2-4:2"]


def _run(argv, capsys, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("POSEIDON_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(launcher, "launch", lambda args: pytest.fail("a rank was started"))
    code = launcher.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def _plan(tmp_path) -> str:
    return emulated_plan(tmp_path / "plan.json", [("A2-2", 2), ("A2-4", 2)], stage_types=["A2-2", "A2-4"],
                         layers=[5, 3], dp=2)


def test_plan_priced_for_another_model_is_refused_naming_the_field(tmp_path, capsys, monkeypatch):
    job = [a if a != "32" else "64" for a in JOB]  # --hidden-size 32 -> 64 (and nothing else is 32)
    assert job != JOB
    line = _run(["--nproc-per-node", "4", SCRIPT, *job, *EMULATE, "--poseidon-plan", _plan(tmp_path)],
                capsys, monkeypatch)
    assert line.startswith(f"poseidon-run: error: --poseidon-plan {tmp_path}/plan.json was priced for another "
                           f"model or job: hidden_size 32 (this job: 64, --hidden-size)"), line
    assert line.endswith("re-plan (drop --poseidon-plan), or run the job it was made for")


def test_plan_for_other_device_types_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    line = _run(["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", "A2-4:2,A2-2:2",
                 "--poseidon-plan", _plan(tmp_path)], capsys, monkeypatch)
    assert "does not match this job: stage 0 runs on A2-2 but device (node 0, local 0) here is a A2-4" in line


def test_old_plan_without_fingerprint_is_still_checked(tmp_path, capsys, monkeypatch):
    path = _plan(tmp_path)
    doc, plan = json.loads(open(path).read()), Plan.load(path)
    doc.pop("priced_for")
    doc["schema_version"] = 2  # version 2: no fingerprint, every rank and device listed
    doc["stages"] = [dict(d, ranks=list(s.ranks), devices=[list(x) for x in s.devices])
                     for d, s in zip(doc["stages"], plan.stages)]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert Plan.load(tmp_path / "old.json").priced_for == ()
    job = [a if a != "8" else "6" for a in JOB]  # --num-layers 8 -> 6
    line = _run(["--nproc-per-node", "4", SCRIPT, *job, *EMULATE, "--poseidon-plan", str(tmp_path / "old.json")],
                capsys, monkeypatch)
    assert "it splits 8 layers but --num-layers is 6" in line


@pytest.mark.parametrize("extra, expected", [
    (["--poseidon-micro-batch-sizes", "1,3"],
     "--poseidon-micro-batch-sizes 1,3: 3 does not divide the global batch 4 (micro-batch size x DP x "
     "micro-batches = global batch); use divisors of it, e.g. 1,2,4"),
    (["--poseidon-save-plan", "{tmp}/missing/plan.json"],
     "--poseidon-save-plan {tmp}/missing/plan.json: the folder {tmp}/missing does not exist; create it first "
     "or save the plan elsewhere"),
    (["--poseidon-save-plan", "{tmp}"], "--poseidon-save-plan {tmp} is a directory; give a file name"),
    (["--poseidon-profile-cache", "{tmp}/a-file"],
     "--poseidon-profile-cache {tmp}/a-file is a file, not a folder; give a folder (it is created if missing)"),
    (["--poseidon-profile-cache", "{tmp}/a-file/cache"],
     "--poseidon-profile-cache {tmp}/a-file/cache: {tmp}/a-file is a file, so the folder cannot be created"),
])
def test_bad_options_are_refused_before_launch(tmp_path, capsys, monkeypatch, extra, expected):
    (tmp_path / "a-file").write_text("")
    line = _run(["--nproc-per-node", "4", SCRIPT, *JOB, *EMULATE, *[e.format(tmp=tmp_path) for e in extra]],
                capsys, monkeypatch)
    assert line.startswith("poseidon-run: error: " + expected.format(tmp=tmp_path)), line


def test_prediction_is_compared_only_where_the_plan_was_priced(tmp_path):
    plan = Plan.load(_plan(tmp_path))
    assert plan.profile_source == "analytic"
    assert priced_elsewhere(plan, "emulated") == ("the plan was priced with the analytic profile of real A2-2/A2-4 "
                                                  "devices, and this run emulates them on CPU")
    assert priced_elsewhere(plan, "cuda") is None
    import dataclasses
    measured = dataclasses.replace(plan, profile_source="measured")
    assert priced_elsewhere(measured, "emulated") is None


def test_empty_option_is_refused_and_variables_are_named_as_given(capsys, monkeypatch):
    line = _run(["--nproc-per-node", "4", SCRIPT, *JOB, "--poseidon-emulate", ""], capsys, monkeypatch)
    assert line == ("poseidon-run: error: --poseidon-emulate '' is empty; give a value, e.g. "
                    "--poseidon-emulate=A2-2:2,A2-4:2, or leave the option out")
    monkeypatch.setenv("POSEIDON_EMULATE", "A2-2:one")
    monkeypatch.setattr(launcher, "launch", lambda args: pytest.fail("a rank was started"))
    assert launcher.main(["--nproc-per-node", "4", SCRIPT, *JOB]) == 2
    assert capsys.readouterr().err.strip() == ("poseidon-run: error: POSEIDON_EMULATE entry 'A2-2:one': COUNT "
                                               "'one' is not an integer")
