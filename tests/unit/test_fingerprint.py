"""What a plan was priced for: activation recomputation is part of it, without changing other plans' fingerprints."""

from __future__ import annotations

import dataclasses

from poseidon_plugin.fingerprint import describe_mismatch, model_mismatches, model_part, priced_for
from poseidon_plugin.specs import load_cluster, load_model

CLUSTER = load_cluster("paper-setting-1")
MODEL = load_model("llama3-8b")
FULL = dataclasses.replace(MODEL, recompute="full", recompute_method="uniform", recompute_num_layers=1)


def test_recomputation_is_fingerprinted_only_where_a_job_recomputes():
    assert not [key for key in model_part(MODEL) if "recompute" in key]
    assert {k: v for k, v in model_part(FULL).items() if "recompute" in k} == {
        "model.recompute": "full", "model.recompute_method": "uniform", "model.recompute_num_layers": "1"}


def test_a_plan_priced_without_recomputation_is_refused_for_a_recomputing_job_and_back():
    plain, full = priced_for(CLUSTER, MODEL, "analytic"), priced_for(CLUSTER, FULL, "analytic")
    assert model_mismatches(plain, MODEL) == [] and model_mismatches(full, FULL) == []
    assert model_mismatches(plain, FULL) == [("recompute", "none", "full")]
    assert ("recompute", "full", "none") in model_mismatches(full, MODEL)
    line = describe_mismatch("plan.json", model_mismatches(plain, FULL))
    assert "recompute none (this job: full, --recompute-granularity / --recompute-activations)" in line
